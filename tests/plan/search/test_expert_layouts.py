"""Expert parallelism planned: the ``expert`` layouts and their mesh order, a Mixture-of-
Experts layer's stacked experts over ``expert`` from its metadata (FSDP on the largest
free dimension, tensor parallelism on each expert's units), the batch over ``expert``
too, experts that do not divide listed with the reason, no ``ep`` candidate for a step
without experts, the state per device from the shapes and a candidate whose experts do
not fit refused before compiling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding.plan import DECODER_RULES, Built, search
from nnx_sharding.plan._search.compile import NO_EXPERTS, in_shardings
from nnx_sharding.plan._search.layouts import (
    LAYOUTS,
    Candidate,
    candidates,
    exact_candidate,
)
from nnx_sharding.plan._search.prepare import prepare, resolve_target

E, D, F, BATCH = 8, 32, 64, 32
"""Experts, width, each expert's units, batch: the experts' weights (E x D x F, twice)
outweigh the router (D x E)."""
MESH_ORDER = ("data", "stage", "fsdp", "context", "expert", "model")


class MoE(nnx.Module):
    """A Mixture-of-Experts layer with stacked experts' weights: every token through
    every expert, weighted by a softmax router (dense, for the test)."""

    def __init__(self, experts: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.router = nnx.Param(nnx.with_partitioning(init, ("embed", None))(rngs(), (D, experts)))
        up = nnx.with_partitioning(init, ("experts", "embed", "expert_mlp"))
        down = nnx.with_partitioning(init, ("experts", "expert_mlp", "embed"))
        self.up = nnx.Param(up(rngs(), (experts, D, F)))
        self.down = nnx.Param(down(rngs(), (experts, F, D)))

    def __call__(self, x: jax.Array) -> jax.Array:
        gates = jax.nn.softmax(x @ self.router[...], axis=-1)
        h = jax.nn.relu(jnp.einsum("bd,edf->bef", x, self.up[...]))
        y = jnp.einsum("bef,efd->bed", h, self.down[...])
        return jnp.einsum("bed,be->bd", y, gates)


def train_step(model: MoE, optimizer: nnx.Optimizer, x: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def abstract(experts: int = E) -> tuple[MoE, nnx.Optimizer, jax.ShapeDtypeStruct]:
    def build():
        model = MoE(experts, nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    with nnx.use_eager_sharding(False):
        model, optimizer = nnx.eval_shape(build)
    return model, optimizer, jax.ShapeDtypeStruct((BATCH, D), jnp.float32)


def build(knobs):
    return Built(train_step, abstract(), rules=DECODER_RULES)


def specs_under(candidate: Candidate, experts: int = E) -> tuple[dict, list[str]]:
    """Every Variable's spec (by path, model's and optimizer's) and the batch's under
    ``candidate``, from the step prepared as `plan` prepares it; the problems found."""
    target = resolve_target(8, "cpu", None, 1)
    step = prepare(train_step, abstract(experts), {}, target, DECODER_RULES, {})
    entries, problems = in_shardings(step, candidate)
    out = {}
    for i in (0, 1):
        for path, var in step.variables[i]:
            out[(i, *path)] = entries[i].sharding_for(path, var)
    out["batch"] = entries[2]
    return out, problems


def test_the_expert_layouts_put_expert_inside_fsdp_outside_model():
    assert {"ep", "fsdp+ep", "dp+ep", "dp+fsdp+ep", "fsdp+tp+ep"} <= set(LAYOUTS)
    for name, axes in LAYOUTS.items():
        assert list(axes) == [a for a in MESH_ORDER if a in axes], name
    labels = [c.label for c in candidates(8, ["ep", "fsdp+ep", "dp+fsdp+ep", "fsdp+tp+ep"])]
    assert labels == [
        "ep (expert=8)",
        "fsdp+ep (fsdp=4×expert=2)",
        "fsdp+ep (fsdp=2×expert=4)",
        "dp+fsdp+ep (data=2×fsdp=2×expert=2)",
        "fsdp+tp+ep (fsdp=2×expert=2×model=2)",
    ]
    exact = exact_candidate(("dp+fsdp+ep", {"data": 16, "fsdp": 2, "expert": 8}), 256)
    assert list(exact.mesh_shape.items()) == [("data", 16), ("fsdp", 2), ("expert", 8)]
    exact = exact_candidate(("fsdp+tp+ep", {"model": 4, "expert": 8, "fsdp": 2}), 64)
    assert list(exact.mesh_shape) == ["fsdp", "expert", "model"]
    assert exact.data_parallel == 2 * 8  # the batch over fsdp and expert, not model


def test_the_experts_go_over_expert_fsdp_takes_the_largest_free_dimension():
    """``experts`` -> ``expert``, ``expert_mlp`` -> ``model`` (`DECODER_RULES`); FSDP
    then takes the largest dimension left; the optimizer's moments as their weights."""
    specs, problems = specs_under(Candidate("fsdp+tp+ep", {"fsdp": 2, "expert": 2, "model": 2}))
    assert problems == []
    assert specs[(0, "up")] == P("expert", "fsdp", "model")
    assert specs[(0, "down")] == P("expert", "model", "fsdp")
    assert specs[(0, "router")] == P("fsdp")
    assert specs[(1, "opt_state", 0, "mu", "up")] == P("expert", "fsdp", "model")
    assert specs[(1, "opt_state", 0, "nu", "down")] == P("expert", "model", "fsdp")
    assert specs[(1, "step")] == P()
    assert specs["batch"] == P(("fsdp", "expert"))

    specs, _ = specs_under(Candidate("fsdp+ep", {"fsdp": 2, "expert": 4}))
    assert specs[(0, "up")] == P("expert", None, "fsdp")  # F (64) > D (32)
    assert specs[(0, "down")] == P("expert", "fsdp")
    assert specs["batch"] == P(("fsdp", "expert"))

    specs, _ = specs_under(Candidate("ep", {"expert": 8}))
    assert (specs[(0, "up")], specs[(0, "router")], specs["batch"]) == (
        P("expert"),
        P(),
        P("expert"),
    )
    specs, _ = specs_under(Candidate("dp+fsdp+ep", {"data": 2, "fsdp": 2, "expert": 2}))
    assert specs["batch"] == P(("data", "fsdp", "expert"))


def test_experts_that_do_not_divide_are_listed_with_the_reason():
    """6 experts: not over 8 nor 4 devices (listed, not compiled), over 2 they are."""
    _, problems = specs_under(Candidate("dp+ep", {"data": 4, "expert": 2}), experts=6)
    assert problems == []
    model, optimizer, x = abstract(experts=6)
    layouts = [("ep", {"expert": 8}), ("fsdp+ep", {"fsdp": 2, "expert": 4})]
    plans = nnx_sharding.plan(
        train_step, model, optimizer, x, devices=8, layouts=layouts, rules=DECODER_RULES
    )
    assert len(plans) == 2 and not any(p.compiled for p in plans)
    by = {p.layout: p.reason for p in plans}
    assert by["ep"].startswith("shapes do not divide: ")
    assert "args[0].up: dimension 0 (6) is not divisible by 'expert' (8)" in by["ep"]
    assert "args[0].down: dimension 0 (6) is not divisible by 'expert' (4)" in by["fsdp+ep"]


def test_a_step_without_experts_gets_no_expert_candidates():
    model = nnx.eval_shape(lambda: nnx.Linear(16, 16, rngs=nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)

    def step(m, x):
        return (m(x) ** 2).mean()

    # a limit of one byte: every candidate refused before compiling, none compiled
    plans = search(lambda knobs: Built(step, (model, x)), devices=4, memory_limit=1)
    assert {p.layout for p in plans} == {"dp", "fsdp", "dp+fsdp", "tp", "dp+tp", "fsdp+tp"}
    assert not any(p.compiled for p in plans)
    plans = nnx_sharding.plan(step, model, x, devices=4, layouts=["ep", "fsdp+ep"])
    assert [p.reason for p in plans] == [NO_EXPERTS] * 2


@pytest.fixture(scope="module")
def expert_plans():
    """The MoE step on 8 CPU devices, every split of three expert layouts."""
    return search(build, devices=8, layouts=["ep", "fsdp+ep", "dp+ep"])


def test_search_plans_the_expert_layouts(expert_plans):
    assert sorted(p.label for p in expert_plans) == [
        "dp+ep (data=2×expert=4)",
        "dp+ep (data=4×expert=2)",
        "ep (expert=8)",
        "fsdp+ep (fsdp=2×expert=4)",
        "fsdp+ep (fsdp=4×expert=2)",
    ]
    assert all(p.compiled and p.fits for p in expert_plans)


def shards_under(mesh: dict[str, int]) -> dict[str, int]:
    """Each weight's shards under ``fsdp+ep`` (from the specs found above by hand):
    the experts' weights over ``expert`` and ``fsdp``, the router over ``fsdp``."""
    return {"up": mesh["expert"] * mesh["fsdp"], "down": mesh["expert"] * mesh["fsdp"],
            "router": mesh["fsdp"]}  # fmt: skip


def test_the_state_per_device_is_the_shapes_over_their_shards(expert_plans):
    """A compiled ``fsdp+ep`` plan's state: every Variable's bytes over its shards
    (weights and both Adam moments alike, the scalars whole)."""
    model, optimizer, _ = abstract()
    every = nnx.to_flat_state(nnx.state((model, optimizer)))
    for plan in (p for p in expert_plans if p.layout == "fsdp+ep"):
        shards = shards_under(dict(plan.mesh_shape))
        expected = 0
        for path, var in every:
            v = var.get_value()
            size = math.prod(v.shape) * np.dtype(v.dtype).itemsize
            expected += size // (shards[path[-1]] if v.shape else 1)
        assert plan.state_bytes == expected
        assert plan.memory.state == expected


def test_experts_that_cannot_fit_are_refused_before_compiling():
    """Over 2 the experts' weights and moments exceed the limit (refused, exact, before
    compiling); over 8 the same model's are compiled."""
    weights = 2 * E * D * F * 4
    over_2 = 3 * (weights // 2 + D * E * 4) + 8  # the Adam count and the step
    over_8 = 3 * (weights // 8 + D * E * 4) + 8
    limit = (over_2 + over_8) // 2
    layouts = [("dp+ep", {"data": 4, "expert": 2}), ("ep", {"expert": 8})]
    plans = search(build, devices=8, layouts=layouts, memory_limit=limit)
    by = {p.layout: p for p in plans}
    refused, compiled = by["dp+ep"], by["ep"]
    assert refused.pruned == "state" and not refused.compiled
    assert refused.state_bytes == over_2
    assert f"its state alone needs {over_2:,} bytes per device" in refused.reason
    assert compiled.compiled and compiled.state_bytes == over_8
