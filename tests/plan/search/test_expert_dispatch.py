"""The built-in decoder's mixture of experts planned on compile-only TPUs and GPUs: the
compiled program's all-to-alls are the layers' dispatch and combine (one each way per
layer, forward and backward), over the ``expert`` axis's devices, which sit inside a
node (GPUs) or a slice (TPUs), and are priced on that node's links."""

from __future__ import annotations

import dataclasses

import pytest

from nnx_sharding._moe import capacity
from nnx_sharding.plan import DECODER_CONFIGS, decoder_builder, search
from nnx_sharding.plan._cost.model import Topology, collective_time, crosses_nodes
from nnx_sharding.plan._hardware.accelerators import PRESETS
from nnx_sharding.plan._hardware.devices import has_gpu_compiler, has_tpu_compiler

LAYERS, BATCH, SEQ, D, E, K, F = 2, 16, 128, 256, 8, 2, 256
CONFIG = dataclasses.replace(
    DECODER_CONFIGS["tiny"], experts=E, experts_per_token=K, expert_mlp=F, gated=True,
    activation="silu", scan=True, layers=LAYERS, batch=BATCH, seq_len=SEQ, d_model=D,
    capacity_factor=1.25,
)  # fmt: skip


def planned(accelerator: str, devices: int, mesh: dict[str, int]):
    (plan,) = search(
        decoder_builder(CONFIG), {"remat": ["none"]}, devices=devices,
        accelerator=accelerator, layouts=[("fsdp+ep", mesh)], prune=False,
    )  # fmt: skip
    assert plan.compiled and plan.reason is None, plan
    return plan


@pytest.mark.parametrize(
    ("accelerator", "devices", "mesh"),
    [
        pytest.param("v5e", 8, {"fsdp": 2, "expert": 4}, marks=pytest.mark.skipif(
            not has_tpu_compiler(), reason="needs the TPU compiler")),
        pytest.param("h100", 16, {"fsdp": 2, "expert": 8}, marks=pytest.mark.skipif(
            not has_gpu_compiler(), reason="needs the GPU compiler")),
    ],
)  # fmt: skip
def test_the_all_to_alls_are_each_layers_dispatch_and_combine(accelerator, devices, mesh):
    plan = planned(accelerator, devices, mesh)
    found = [c for c in plan.detail if c.kind == "all-to-all"]
    # the dispatched tokens (experts, batch, capacity, d_model) in bfloat16, per device
    tokens = E * BATCH * capacity(SEQ, E, K, 1.25) * D * 2 // devices
    assert [c.bytes for c in found] == [tokens] * (4 * LAYERS)  # dispatch + combine, twice
    expert_groups = {tuple(range(i, i + mesh["expert"])) for i in range(0, devices, mesh["expert"])}
    for c in found:
        assert set(c.groups) == expert_groups  # the expert axis: consecutive devices
    assert plan.collectives["all-to-all"] == sum(c.bytes for c in found)


def test_the_expert_axis_sits_inside_a_gpu_node_and_is_priced_on_nvlink():
    """16 GPUs in nodes of 8: an all-to-all over 8 consecutive devices is NVLink's; the
    same over 8 devices in two nodes (an expert axis outside FSDP's) is the network's."""
    from nnx_sharding.plan._cost.hlo import Collective

    h100, topology = PRESETS["h100"], Topology.of([None] * 16, 8)
    inside = Collective("all-to-all", 2**26, (tuple(range(8)), tuple(range(8, 16))), "a2a")
    across = Collective(
        "all-to-all", 2**26, (tuple(range(0, 16, 2)), tuple(range(1, 16, 2))), "a2a"
    )
    assert not crosses_nodes(inside.groups[0], 8) and crosses_nodes(across.groups[0], 8)
    eff = h100.link_efficiency
    assert collective_time(inside, h100, topology) == pytest.approx(
        h100.intra_latency + 2**26 * 7 / 8 / (h100.intra_bandwidth * eff)
    )
    # each device sends the half of its buffer bound for the other node on its own link
    assert collective_time(across, h100, topology) == pytest.approx(
        h100.inter_latency + 2**26 / 2 / (h100.inter_bandwidth * eff)
    )
