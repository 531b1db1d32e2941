"""`plan.search`: a step built from knob values (a small MLP with a remat knob and a
microbatch scan), planned over a space of them; pruning checked against the compiler's
own figures for every point; JSON; what would fit when nothing does; bad input."""

from __future__ import annotations

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from rich.console import Console

import nnx_sharding
from nnx_sharding._units import format_bytes
from nnx_sharding.plan import Built, Plans
from nnx_sharding.plan._search.knobs import no_faster, rank

D, F, LAYERS, BATCH = 32, 128, 2, 2048
"""Activations (BATCH x F per layer) outweigh the weights (D x F): remat and
microbatches change the memory that matters."""
POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable}
SPACE = {"remat": ["none", "full"], "microbatches": [1, 2, 4]}
PARAMS = 2 * D * F * LAYERS


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ups = nnx.List([nnx.Linear(D, F, use_bias=False, rngs=rngs) for _ in range(LAYERS)])
        self.downs = nnx.List([nnx.Linear(F, D, use_bias=False, rngs=rngs) for _ in range(LAYERS)])

    def __call__(self, x: jax.Array, remat: str) -> jax.Array:
        def block(up: nnx.Linear, down: nnx.Linear, x: jax.Array) -> jax.Array:
            return x + down(jnp.tanh(up(x)))

        if remat != "none":
            block = nnx.remat(block, policy=POLICIES[remat])
        for up, down in zip(self.ups, self.downs, strict=True):
            x = block(up, down, x)
        return x


def make_step(remat: str, microbatches: int):
    """A training step whose gradients are accumulated over ``microbatches`` slices of
    the batch (a scan); returns each slice's loss."""

    def step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array) -> jax.Array:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p, xb):
            return jnp.mean(nnx.merge(graphdef, p, rest)(xb, remat) ** 2)

        def body(total, xb):
            value, grads = jax.value_and_grad(loss)(params, xb)
            return jax.tree.map(jnp.add, total, grads), value

        slices = x.reshape(microbatches, -1, x.shape[-1])
        grads, losses = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), slices)
        optimizer.update(model, jax.tree.map(lambda g: g / microbatches, grads))
        return losses

    return step


def make_state() -> tuple[MLP, nnx.Optimizer]:
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def build(knobs) -> Built:
    """The builder: knobs ``remat`` ('none', 'full') and ``microbatches``."""
    remat, count = knobs.get("remat", "none"), knobs.get("microbatches", 1)
    if remat not in POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; choose among 'none', 'full'")
    with nnx.use_eager_sharding(False):
        model, optimizer = nnx.eval_shape(make_state)
    x = jax.ShapeDtypeStruct((BATCH, D), jnp.float32)
    return Built(
        make_step(remat, count),
        (model, optimizer, x),
        {"donate_argnums": (0, 1)},
        model_flops=6 * PARAMS * BATCH,
    )


def search(**options) -> Plans:
    options = {"devices": 8, "accelerator": "cpu", **options}
    return nnx_sharding.plan.search(build, options.pop("space", SPACE), **options)


@pytest.fixture(scope="module")
def every() -> Plans:
    """Every point of dp, fsdp and tp compiled: the reference."""
    return search(layouts=["dp", "fsdp", "tp"], prune=False)


def key(p) -> tuple:
    return (p.layout, tuple(p.mesh_shape.items()), tuple(p.knobs.items()))


# --- the search ------------------------------------------------------------------------


def test_every_point_of_every_candidate_is_planned_with_its_knobs(every):
    assert sorted(key(p) for p in every) == sorted(
        (layout, mesh, (("remat", r), ("microbatches", m)))
        for layout, mesh in [("dp", (("data", 8),)), ("fsdp", (("fsdp", 8),))]
        + [("tp", (("model", 8),))]
        for r in SPACE["remat"]
        for m in SPACE["microbatches"]
    )
    for p in every:
        assert p.compiled and p.pruned is None
        assert p.model_flops == 6 * PARAMS * BATCH / 8  # per device
        assert p.model_tflops_per_device == pytest.approx(p.model_flops / p.time.step / 1e12)
        assert f"remat={p.knobs['remat']}, microbatches={p.knobs['microbatches']}" in p.label


@pytest.mark.parametrize(
    "knobs", [{"remat": "none", "microbatches": 1}, {"remat": "full", "microbatches": 4}]
)
def test_a_plans_jit_runs_the_step_built_for_its_knobs(every, knobs):
    plan = next(p for p in every if p.layout == "fsdp" and p.knobs == knobs)
    model, optimizer = make_state()
    x = jax.random.normal(jax.random.key(1), (BATCH, D))
    expected_model, expected_optimizer = make_state()
    expected = make_step(knobs["remat"], knobs["microbatches"])(
        expected_model, expected_optimizer, x
    )
    losses = plan.jit()(model, optimizer, x)
    assert losses.shape == (knobs["microbatches"],)  # this knob point's own step
    np.testing.assert_allclose(losses, expected, rtol=2e-5)
    for got, want in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(expected_model)), strict=True
    ):  # adam's steps are ~1e-3: the sums' order moves them by under 1 %
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert model.ups[0].kernel.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")


def test_pruning_finds_the_best_of_every_point_and_compiles_less(every):
    """A limit below the fastest plan's peak: the pruned search finds the fastest plan
    that fits among all the reference's points, every figure it shows is the
    reference's, and what it left uncompiled is as its reason says."""
    fastest = min(every, key=lambda p: p.time.step)
    limit = fastest.memory.peak - 1
    # the rules the pruning rests on hold for this step on this compiler
    for a in every:
        for b in every:
            if key(a)[:2] == key(b)[:2] and no_faster(rank(a.knobs), rank(b.knobs)):
                assert b.time.step >= a.time.step, (a.label, b.label)
    plans = search(layouts=["dp", "fsdp", "tp"], memory_limit=limit)
    reference = {key(p): p for p in every}
    best = min((p for p in every if p.memory.peak <= limit), key=lambda p: p.time.step)
    assert plans.best.time.step == best.time.step and plans.best.fits
    compiled = [p for p in plans if p.compiled]
    assert len(compiled) <= len(every) // 2
    for p in compiled:
        ref = reference[key(p)]
        assert (p.memory, p.flops, p.time) == (ref.memory, ref.flops, ref.time)
    for p in plans:
        if p.pruned == "time":  # no faster than its pruner, no faster than the best
            assert reference[key(p)].time.step >= p.pruned_by.time.step >= best.time.step
            assert p.pruned_by.compiled and key(p.pruned_by)[:2] == key(p)[:2]
            assert no_faster(rank(p.pruned_by.knobs), rank(p.knobs))
        if p.pruned == "memory":
            assert reference[key(p)].memory.peak > limit
        if not p.compiled:
            assert p.memory is None and p.time is None and p.compile_seconds == 0
    assert {p.pruned for p in plans} >= {None, "time"}


def test_a_state_above_the_limit_is_listed_as_not_fitting_and_not_compiled(every):
    """dp keeps the whole state on every device: a limit below it (and above fsdp's
    eighth) lists dp without compiling it, and compiles fsdp."""
    leaves = jax.tree.leaves(nnx.state(make_state()))
    state = sum(x.size * x.dtype.itemsize for x in leaves)
    scalars = sum(x.dtype.itemsize for x in leaves if x.ndim == 0)  # adam's counts: whole
    dp = next(p for p in every if p.layout == "dp")
    assert dp.memory.state == state  # replicated: the whole state on each device
    limit = state - 1
    plans = search(layouts=["dp", "fsdp"], memory_limit=limit, space={"remat": ["none"]})
    by_layout = {p.layout: p for p in plans}
    listed = by_layout["dp"]
    assert not listed.fits and not listed.compiled and listed.pruned == "state"
    assert listed.memory is None and listed.compile_seconds == 0
    assert listed.state_bytes == state
    assert listed.reason == (
        f"not compiled: its state alone needs {state:,} bytes per device, 1 more than "
        f"the limit of {limit:,}"
    )
    fsdp = by_layout["fsdp"]
    assert (
        fsdp.compiled
        and fsdp.pruned is None
        and fsdp.memory.state == (state - scalars) // 8 + scalars
    )
    console = Console(width=400, file=io.StringIO())
    console.print(plans.table())
    assert f"not compiled, does not fit: its state alone is {format_bytes(state)}" in (
        console.file.getvalue()
    )


def test_to_json_writes_every_plan_with_its_figures(every, tmp_path):
    limit = min(every, key=lambda p: p.time.step).memory.peak - 1
    plans = search(layouts=["dp", "fsdp"], memory_limit=limit)
    path = tmp_path / "plans.json"
    text = plans.to_json(str(path))
    document = json.loads(path.read_text())
    assert document == json.loads(text)
    assert document["memory_limit"] == limit and document["space"] == SPACE
    assert len(document["plans"]) == len(plans)
    for p, row in zip(plans, document["plans"], strict=True):
        assert row["layout"] == p.layout and row["mesh_shape"] == dict(p.mesh_shape)
        assert row["knobs"] == dict(p.knobs) and row["compiled"] == p.compiled
        assert row["reason"] == p.reason and row["compiler"] == "cpu"
        assert row["model_flops"] == 6 * PARAMS * BATCH / 8
        if p.compiled:
            assert row["fits"] == p.fits
            assert row["memory"]["peak"] == p.memory.peak
            assert row["memory"]["state"] == p.memory.state
            assert row["memory"]["temp"] == p.memory.temp
            assert row["flops"] == p.flops and row["collectives"] == dict(p.collectives)
            for name in ("compute", "memory", "comms", "step"):
                assert row["time"][name] == getattr(p.time, name)
            assert row["model_tflops_per_device"] == row["model_flops"] / p.time.step / 1e12
        else:  # nothing estimated shows as compiled
            assert row["memory"]["peak"] is None and row["time"] is None
            assert row["flops"] is None and row["model_tflops_per_device"] is None
            inferred = p.pruned in ("time", "memory")  # only the state's rule is exact
            assert row["fits"] is (None if inferred else False)


def test_when_nothing_fits_the_error_names_knob_values_compiled_beyond_the_space(every):
    """Searched at remat none and one microbatch only, with a limit only remat full
    and 4 microbatches meet: before saying nothing fits, the planner compiles the
    closest candidate with more of both, and names what fits."""
    fsdp = {tuple(p.knobs.values()): p for p in every if p.layout == "fsdp"}
    limit = fsdp[("full", 4)].memory.peak
    assert fsdp[("none", 1)].memory.peak > limit and fsdp[("full", 2)].memory.peak > limit
    plans = search(
        layouts=["fsdp"], memory_limit=limit, space={"remat": ["none"], "microbatches": [1]}
    )
    assert not any(p.fits for p in plans)
    tried = [(p.knobs["remat"], p.knobs["microbatches"]) for p in plans.advice]
    assert tried == [("full", 1), ("full", 2), ("full", 4)]  # more remat, then doubling
    fitting = plans.advice[-1]
    assert fitting.compiled and fitting.fits
    assert fitting.memory == fsdp[("full", 4)].memory  # the compiler's figures
    with pytest.raises(ValueError) as info:
        _ = plans.best
    message = str(info.value)
    first, *_ = message.splitlines()
    assert "the closest is fsdp (fsdp=8; remat=none, microbatches=1)" in first
    assert (
        "  1. search remat='full', microbatches=4: compiled beyond the space searched, "
        "fsdp (fsdp=8; remat=full, microbatches=4) fits"
    ) in message


# --- bad input: the first line names the value, the rule the choices ----------------------


def declared(knobs):
    return build(knobs)


declared.choices = {"remat": ["none", "full"]}


@pytest.mark.parametrize(
    ("builder", "space", "message"),
    [
        (build, {"remat": ["fulll"]}, "plan.search: build: the builder failed for "
         "remat=fulll: ValueError: unknown remat policy 'fulll'; choose among 'none', 'full'"),
        (declared, {"remat": ["fulll"]}, "plan.search: space: remat='fulll' is not a value "
         "the builder takes"),
        (build, {"microbatches": [3]}, "plan.search: space: microbatches=3 does not divide "
         "the batch of 2048 (its divisors: 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, "
         "2048)"),
        (build, {"microbatches": [0]}, "plan.search: space: microbatches=0 is not a positive "
         "integer"),
        (build, {"remats": ["none"]}, "plan.search: space: the builder never reads the "
         "knob(s) 'remats' of the space"),
        (build, {"remat": "none"}, "plan.search: space: space['remat'] = 'none' is not a "
         "non-empty list of values"),
        (build, ["remat"], "plan.search: space: got list"),
    ],
)  # fmt: skip
def test_a_bad_knob_is_named_on_the_first_line(builder, space, message):
    with pytest.raises(ValueError) as info:
        nnx_sharding.plan.search(builder, space, devices=8, layouts=["dp"])
    first, rule, *_ = str(info.value).splitlines()
    assert first == message and rule.startswith("Rule: ")


def test_pareto_leaves_a_candidate_beaten_at_the_same_knobs_uncompiled(every):
    """With ``prune='pareto'``, a candidate whose compiled point another beats on both
    memory and time at the same knobs is compiled no further; the reference shows the
    beating, from the compiler's figures."""
    limit = min(every, key=lambda p: p.time.step).memory.peak - 1
    plans = search(layouts=["dp", "fsdp", "tp"], memory_limit=limit, prune="pareto")
    reference = {key(p): p for p in every}
    beaten = [p for p in plans if p.pruned == "pareto"]
    assert beaten
    for p in beaten:
        by = p.pruned_by
        assert by.compiled and key(by)[:2] != key(p)[:2]
        mine = reference[(p.layout, tuple(p.mesh_shape.items()), tuple(by.knobs.items()))]
        assert by.memory.peak <= mine.memory.peak and by.time.step <= mine.time.step


def test_an_unknown_prune_names_the_choices():
    with pytest.raises(ValueError, match=r"prune: 'fast' is not one of True, False, 'pareto'"):
        search(layouts=["dp"], prune="fast")


def test_a_builder_must_return_a_built_step():
    with pytest.raises(TypeError, match="the builder returned int for its defaults"):
        nnx_sharding.plan.search(lambda knobs: 3, devices=8, layouts=["dp"])


def test_a_builder_may_return_a_step_and_its_arguments():
    model = nnx.eval_shape(lambda: nnx.Linear(16, 16, rngs=nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    plans = nnx_sharding.plan.search(
        lambda knobs: (lambda m, x: jnp.sum(m(x) ** 2), (model, x)), devices=8, layouts=["dp"]
    )
    assert [p.label for p in plans] == ["dp (data=8)"] and plans[0].fits
    assert plans[0].model_flops is None and plans[0].model_tflops_per_device is None


def test_a_microbatch_that_does_not_split_over_the_data_axes_is_a_reason():
    """2048 / 4 microbatches = 512 per slice splits over 8; the space's own check is
    per candidate: with 2048 microbatches a slice of 1 does not."""
    plans = search(layouts=["dp"], space={"microbatches": [2048]})
    assert plans[0].reason == (
        "shapes do not divide: a microbatch of 1 (batch 2048 / microbatches=2048) is not "
        "divisible by the data-parallel axes data=8 (8)"
    )
