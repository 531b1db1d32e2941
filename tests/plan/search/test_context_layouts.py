"""Context parallelism planned: the ``context`` layouts and their mesh order, the
decoder's sequence split over ``context`` by each strategy (the strategy's collective in
the compiled program), the weights sharded over ``context`` with ``fsdp``, exact
candidates, the ``context_strategy`` knob searched, and what cannot be split listed with
its reason (a sequence that does not divide, Ulysses over heads that do not), all on 8
simulated CPU devices."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_sharding.plan import DECODER_CONFIGS, LAYOUTS, decoder_builder, plan, search
from nnx_sharding.plan._search.layouts import Candidate, candidates, exact_candidate, node_specs

CONFIG = dataclasses.replace(
    DECODER_CONFIGS["tiny"], layers=1, seq_len=256, batch=2, heads=4, kv_heads=2,
    compute_dtype="float32",
)  # fmt: skip
COLLECTIVE = {"all_gather": "all-gather", "ring": "collective-permute", "ulysses": "all-to-all"}


def test_the_context_layouts_and_exact_candidates():
    """``cp``, ``fsdp+cp``, ``dp+fsdp+cp`` and ``fsdp+tp+cp`` exist with ``context``
    after ``fsdp`` and before ``model``; an exact candidate puts its axes in that order."""
    assert LAYOUTS["cp"] == ("context",)
    assert LAYOUTS["fsdp+cp"] == ("fsdp", "context")
    assert LAYOUTS["dp+fsdp+cp"] == ("data", "fsdp", "context")
    assert LAYOUTS["fsdp+tp+cp"] == ("fsdp", "context", "model")
    exact = exact_candidate(("fsdp+cp", {"context": 16, "fsdp": 4}), 64)
    assert exact.label == "fsdp+cp (fsdp=4×context=16)"
    assert [c.label for c in candidates(8, ["fsdp+cp"])] == [
        "fsdp+cp (fsdp=4×context=2)", "fsdp+cp (fsdp=2×context=4)"
    ]  # fmt: skip


def test_the_weights_are_sharded_over_context_with_fsdp():
    """FSDP's largest dimension takes ``fsdp`` and ``context`` together; under ``cp``
    alone, ``context``; the batch is not split over ``context``."""
    var = nnx.Param(jnp.zeros((64, 16)))
    together, _ = node_specs(Candidate("fsdp+cp", {"fsdp": 2, "context": 4}), [(("w",), var)],
                             None, "model")  # fmt: skip
    alone, _ = node_specs(Candidate("cp", {"context": 8}), [(("w",), var)], None, "model")
    assert together[("w",)] == P(("fsdp", "context"))
    assert alone[("w",)] == P("context")
    assert Candidate("fsdp+cp", {"fsdp": 2, "context": 4}).data_parallel == 2


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_each_strategy_compiles_with_its_collective(strategy):
    """The decoder's step under ``context`` 4 × ``fsdp`` 2 compiles with the strategy,
    and its program holds the strategy's collective (the keys' ring of
    collective-permutes, Ulysses' all-to-alls; the all-gather strategy's collective is
    checked in tests/plan/decoder/test_context_parallel.py)."""
    build = decoder_builder(CONFIG)
    plans = search(build, {"context_strategy": [strategy]}, devices=8, accelerator="cpu",
                   layouts=[("fsdp+cp", {"fsdp": 2, "context": 4})])  # fmt: skip
    (found,) = plans
    assert found.compiled and found.reason is None, found.reason
    assert found.collectives[COLLECTIVE[strategy]] > 0


def test_what_cannot_be_split_is_listed_with_its_reason():
    """A sequence that does not split into twice the context axis (load-balanced) is
    listed before compiling; Ulysses with 4 heads over ``context`` 8 is the decoder's
    error, as the plan's reason; the other strategies compile there."""
    build = decoder_builder(dataclasses.replace(CONFIG, seq_len=24))
    (short,) = search(build, None, devices=8, accelerator="cpu", layouts=[("cp", {"context": 8})])
    assert "does not split into 16 chunks" in short.reason and not short.compiled
    plans = search(decoder_builder(CONFIG), {"context_strategy": ["ulysses", "ring"]},
                   devices=8, accelerator="cpu", layouts=[("cp", {"context": 8})])  # fmt: skip
    by = {p.knobs["context_strategy"]: p for p in plans}
    assert "4 query heads" in by["ulysses"].reason and not by["ulysses"].compiled
    assert by["ring"].compiled and by["ring"].reason is None


def test_only_a_step_with_a_sequence_gets_context_candidates():
    """`search` proposes ``cp`` layouts for the decoder (its `Built.sequence`), none for
    a step that names no sequence; there a named ``cp`` layout is still compiled."""

    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    def create():
        model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(create)
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    plain = plan(step, model, optimizer, x, devices=8, accelerator="cpu")
    assert not any("context" in p.mesh_shape for p in plain)
    named = plan(step, model, optimizer, x, devices=8, accelerator="cpu", layouts=["cp"])
    assert [p.layout for p in named] == ["cp"] and named[0].compiled
