"""Pipeline parallelism planned: the ``stage`` layouts and their splits, the stacked
layers' specs over ``stage``, the decoder run through `nnx_sharding.pipeline` under
them, the bubble in the notes and in the step time (the compiled loop's), the
pipeline knobs compiled once where they change nothing, and the collective-permute
between stages priced on the link it crosses."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding.plan import DECODER_CONFIGS, DECODER_RULES, decoder_builder, search
from nnx_sharding.plan._cost.hlo import Collective
from nnx_sharding.plan._cost.model import collective_time
from nnx_sharding.plan._hardware.accelerators import PRESETS
from nnx_sharding.plan._hardware.devices import has_gpu_compiler
from nnx_sharding.plan._search.compile import NO_STAGES
from nnx_sharding.plan._search.layouts import (
    LAYOUTS,
    Candidate,
    candidates,
    exact_candidate,
    metadata_tp,
    node_specs,
)

STACKED = dataclasses.replace(DECODER_CONFIGS["tiny"], scan=True, layers=4, batch=16)


def test_the_pipeline_layouts_put_stage_outermost_of_the_model_axes():
    assert {"pp", "pp+fsdp", "pp+tp", "pp+fsdp+tp", "dp+pp+fsdp"} <= set(LAYOUTS)
    for name, axes in LAYOUTS.items():
        if "stage" in axes:  # after data, before fsdp and model: across nodes first
            order = [a for a in ("data", "stage", "fsdp", "model") if a in axes]
            assert list(axes) == order, name
    labels = [c.label for c in candidates(16, ["pp+fsdp", "dp+pp+fsdp"])]
    assert labels == [
        "pp+fsdp (stage=8×fsdp=2)",
        "pp+fsdp (stage=4×fsdp=4)",
        "pp+fsdp (stage=2×fsdp=8)",
        "dp+pp+fsdp (data=4×stage=2×fsdp=2)",
        "dp+pp+fsdp (data=2×stage=4×fsdp=2)",
        "dp+pp+fsdp (data=2×stage=2×fsdp=4)",
    ]
    exact = exact_candidate(("pp+fsdp", {"fsdp": 16, "stage": 4}), 64)
    assert list(exact.mesh_shape.items()) == [("stage", 4), ("fsdp", 16)]


def test_the_stacked_layers_go_over_stage_and_the_rest_as_before():
    """The decoder names its stacked dimension ``layers``, which `DECODER_RULES` maps
    to ``stage``: each stage holds its layers, split further by FSDP and the tensor-
    parallel rules; the embedding, outside the stack, is not split over ``stage``."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: nnx_sharding.plan.Decoder(STACKED, rngs=nnx.Rngs(0)))
    pairs = [(tuple(p), v) for p, v in nnx.to_flat_state(nnx.state(model))]
    stage = metadata_tp(pairs, DECODER_RULES, "stage")
    tp = metadata_tp(pairs, DECODER_RULES)
    specs, wrong = node_specs(
        Candidate("pp+fsdp+tp", {"stage": 2, "fsdp": 2, "model": 2}), pairs, tp, "m", stage
    )
    assert wrong == []
    assert specs[("layers", "wq")] == P("stage", "fsdp", "model")
    assert specs[("layers", "down")] == P("stage", "model", "fsdp")
    assert specs[("embed",)] == P("model", "fsdp")
    _, wrong = node_specs(Candidate("pp", {"stage": 8}), pairs, tp, "m", stage)
    assert "m.layers.wq: dimension 0 (4) is not divisible by 'stage' (8)" in wrong


@pytest.fixture(scope="module")
def decoder_plans():
    """The stacked tiny decoder on 8 CPU devices, two pipeline layouts and FSDP, at
    two pipeline microbatch counts."""
    return search(
        decoder_builder(STACKED),
        {"pipeline_microbatches": [4, 8]},
        devices=8,
        layouts=["fsdp", ("pp+fsdp", {"stage": 4, "fsdp": 2}), ("pp+tp", {"stage": 2, "model": 4})],
        prune=False,
    )


def test_the_decoder_is_pipelined_under_a_stage_axis(decoder_plans):
    pipelined = [p for p in decoder_plans if "stage" in p.mesh_shape]
    assert len(pipelined) == 4 and all(p.compiled and p.fits for p in pipelined)
    for p in pipelined:
        stages, m = p.mesh_shape["stage"], p.knobs["pipeline_microbatches"]
        bubble = (stages - 1) / (m + stages - 1)
        assert f"pipeline bubble: {bubble:.0%} of the step ({stages} stages, {m} microbatches" in (
            "; ".join(p.notes)
        )
        # each stage sends its microbatch on once per tick, forward and backward
        assert p.collectives.get("collective-permute", 0) > 0
    fsdp = [p for p in decoder_plans if p.layout == "fsdp"]
    assert not any("bubble" in n for p in fsdp for n in p.notes)


def test_the_pipeline_knobs_are_compiled_once_without_a_stage_axis(decoder_plans):
    """Without ``stage`` the two pipeline microbatch counts build the same program: it
    is compiled once and the other point shares its figures."""
    fsdp = sorted(
        (p for p in decoder_plans if p.layout == "fsdp"),
        key=lambda p: p.knobs["pipeline_microbatches"],
    )
    assert [p.knobs["pipeline_microbatches"] for p in fsdp] == [4, 8]
    assert fsdp[0].memory == fsdp[1].memory and fsdp[0].time == fsdp[1].time
    assert fsdp[0].label != fsdp[1].label
    assert [p.source.knobs["pipeline_microbatches"] for p in fsdp] == [4, 8]


def test_a_step_without_stacked_layers_gets_no_pipeline_candidates():
    model = nnx.eval_shape(lambda: nnx.Linear(16, 16, rngs=nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    plans = nnx_sharding.plan(lambda m, x: (m(x) ** 2).mean(), model, x, devices=4)
    assert not any("stage" in p.mesh_shape for p in plans)
    plans = nnx_sharding.plan(lambda m, x: (m(x) ** 2).mean(), model, x, devices=4, layouts=["pp"])
    assert [p.reason for p in plans] == [NO_STAGES]


def test_a_permute_crossing_nodes_is_priced_on_the_network():
    """A stage ring over two nodes of 8: the pairs that cross set the time."""
    h100 = PRESETS["h100"]
    ring = tuple((i, (i + 8) % 16) for i in range(16))
    inside = tuple((i, i ^ 1) for i in range(16))
    crossing = collective_time(Collective("collective-permute", 10**9, ring, "cp"), h100)
    local = collective_time(Collective("collective-permute", 10**9, inside, "cp"), h100)
    assert crossing == pytest.approx(
        h100.inter_latency + 10**9 / (h100.inter_bandwidth * h100.link_efficiency)
    )
    assert local < crossing / 5


@pytest.mark.skipif(not has_gpu_compiler(), reason="needs the GPU compiler")
def test_the_predicted_step_follows_the_bubble():
    """4 stages on 8 H100s, 4 and 16 pipeline microbatches of a decoder whose layers'
    matmuls dominate: the step's ratio is the bubble's, ``(1 + 3/4) / (1 + 3/16)``,
    within 20 % (more ticks also add weight-gradient sums and per-tick latencies)."""
    c = nnx_sharding.plan.DecoderConfig(
        "bubble", vocab=512, d_model=4096, heads=8, head_dim=512, mlp=16384, layers=8,
        batch=512, seq_len=512,
    )  # fmt: skip
    plans = search(
        decoder_builder(c),
        {"pipeline_microbatches": [4, 16]},
        devices=8,
        accelerator="h100",
        layouts=[("pp+tp", {"stage": 4, "model": 2})],
        prune=False,
    )
    step = {p.knobs["pipeline_microbatches"]: p.time.step for p in plans if p.time}
    formula = (1 + 3 / 4) / (1 + 3 / 16)
    assert step[4] / step[16] == pytest.approx(formula, rel=0.2)
