"""The cost model as docs/planning/cost_model.md writes it down: each collective on the
link it spans, each kernel its own roofline, and the overlap rules."""

from __future__ import annotations

import dataclasses

import pytest

from nnx_sharding.plan import PRESETS, Memory, Time
from nnx_sharding.plan._cost.hlo import Collective
from nnx_sharding.plan._cost.kernels import Op
from nnx_sharding.plan._cost.model import (
    Topology,
    collective_time,
    crosses_nodes,
    parse_bytes,
    predict,
    spanned_axes,
)
from nnx_sharding.plan._hardware.devices import (
    compile_devices,
    has_gpu_compiler,
    has_tpu_compiler,
)

H100 = PRESETS["h100"]
MB = 10**6
needs_tpu = pytest.mark.skipif(not has_tpu_compiler(), reason="needs nnx_sharding[tpu]")


@pytest.mark.parametrize(
    ("kind", "factor"),
    [
        ("all-reduce", 2 * 7 / 8),
        ("all-gather", 7 / 8),
        ("reduce-scatter", 7 / 8),
        ("all-to-all", 7 / 8),
    ],
)
def test_ring_volume_over_nvlink_at_its_bus_efficiency(kind, factor):
    """Inside a node of 8 GPUs: nccl-tests' ring volume over NVLink at the measured
    fraction of its bandwidth (370 of 450 GB/s)."""
    c = Collective(kind, 64 * MB, (tuple(range(8)),), "x")
    link = H100.intra_bandwidth * H100.link_efficiency
    assert H100.link_efficiency == pytest.approx(370 / 450, abs=0.01)
    assert collective_time(c, H100) == pytest.approx(H100.intra_latency + 64 * MB * factor / link)


def test_a_group_across_gpu_nodes_shares_each_nodes_network_links():
    """16 GPUs on 2 nodes: the across-node ring has 2 members per group of nodes, and
    every GPU of a node sends its share over its own network link (8 links a node);
    the in-node ring over NVLink runs alongside, and the slower of the two counts."""
    c = Collective("all-gather", 800 * MB, (tuple(range(16)),), "x")
    eff = H100.link_efficiency
    across = 800 * MB * (1 / 2) / (8 * H100.inter_bandwidth * eff)
    inside = 800 * MB * (7 / 8) / (H100.intra_bandwidth * eff)
    expected = H100.inter_latency + max(across, inside)
    assert collective_time(c, H100) == pytest.approx(expected)
    pair = Collective("all-reduce", 800 * MB, ((0, 8), (1, 9)), "x")  # one GPU a node
    expected = H100.inter_latency + 800 * MB * 1.0 / (H100.inter_bandwidth * eff)
    assert collective_time(pair, H100) == pytest.approx(expected)
    assert not crosses_nodes(range(8), 8)
    assert crosses_nodes((0, 8), 8)
    assert spanned_axes((0, 1, 2, 3), {"data": 2, "model": 4}) == {"model"}
    assert spanned_axes((0, 4), {"data": 2, "model": 4}) == {"data"}


@needs_tpu
def test_a_tpu_slice_is_one_torus_whatever_its_hosts():
    """A v5e-256 slice has 32 hosts and one ICI torus: FSDP's gather over all 256 chips
    runs on ICI, over both axes of the 16x16 torus, each wrapping (two links per axis,
    one each way), never on the data-centre network."""
    v5e = PRESETS["v5e"]
    devices, compiler, _ = compile_devices("v5e:16x16", 256)
    topology = Topology.of(devices, v5e.devices_per_node)
    assert compiler == "tpu" and set(topology.nodes) == {0} and topology.dims[:2] == (16, 16)
    gather = Collective("all-gather", 1000 * MB, (tuple(range(256)),), "x")
    link = v5e.intra_bandwidth / 2  # one link, one way: 50 GB/s
    expected = v5e.intra_latency + 1000 * MB * (255 / 256) / (4 * link * v5e.link_efficiency)
    assert collective_time(gather, v5e, topology) == pytest.approx(expected)
    # a row of 16 (one axis, wrapped): two links; 8 of a row (no wrap): one
    at = {c[:2]: i for i, c in enumerate(topology.coords)}
    row = Collective("all-gather", 1000 * MB, (tuple(at[x, 0] for x in range(16)),), "x")
    half = Collective("all-gather", 1000 * MB, (tuple(at[x, 0] for x in range(8)),), "x")
    assert collective_time(row, v5e, topology) == pytest.approx(
        v5e.intra_latency + 1000 * MB * (15 / 16) / (2 * link * v5e.link_efficiency)
    )
    assert collective_time(half, v5e, topology) == pytest.approx(
        v5e.intra_latency + 1000 * MB * (7 / 8) / (link * v5e.link_efficiency)
    )


@pytest.mark.skipif(not has_gpu_compiler(), reason="needs the GPU compiler")
def test_compile_only_gpus_are_nodes_of_eight_on_the_network():
    """16 compile-only H100s are two hosts of 8 (their devices carry coords, as TPUs'
    do, but no torus joins the hosts): FSDP's gather over all 16 crosses the network,
    a gather inside a host stays on NVLink."""
    h100 = PRESETS["h100"]
    devices, compiler, _ = compile_devices(h100, 16)
    topology = Topology.of(devices, h100.devices_per_node)
    assert compiler == "gpu" and topology.nodes == (0,) * 8 + (1,) * 8 and not topology.coords
    every = Collective("all-gather", 1000 * MB, (tuple(range(16)),), "x")
    inside = Collective("all-gather", 1000 * MB, (tuple(range(8)),), "x")
    across = 1000 * MB * (1 / 2) / (8 * h100.inter_bandwidth * h100.link_efficiency)
    assert collective_time(every, h100, topology) >= h100.inter_latency + across
    assert collective_time(inside, h100, topology) < collective_time(every, h100, topology)


@needs_tpu
def test_only_groups_across_tpu_slices_use_the_data_centre_network():
    v5e = PRESETS["v5e"]
    devices, _, _ = compile_devices("v5e:2x4", 16, num_slices=2)
    topology = Topology.of(devices, v5e.devices_per_node)
    assert topology.nodes == (0,) * 8 + (1,) * 8
    within = Collective("all-reduce", 100 * MB, (tuple(range(8)),), "x")
    across = Collective("all-reduce", 100 * MB, tuple((i, i + 8) for i in range(8)), "x")
    assert collective_time(within, v5e, topology) < 0.01
    expected = v5e.inter_latency + 100 * MB * 1.0 / (v5e.inter_bandwidth * v5e.link_efficiency)
    assert collective_time(across, v5e, topology) == pytest.approx(expected)


def op(name, flops, nbytes, program="main", runs=1, dtype="bf16"):
    return Op(name, "fusion", program, runs, float(flops), dtype if flops else "", float(nbytes))


def test_each_kernel_is_its_own_roofline():
    """A compute-bound GEMM and a memory-bound elementwise op: the step is the sum of
    their rooflines, not the roofline of their sums (which would hide one in the other)."""
    peak = H100.peak_flops("bfloat16") * H100.matmul_efficiency
    bandwidth = H100.hbm_bandwidth * H100.hbm_efficiency
    gemm = op("gemm", 2 * 8192**3, 3 * 2 * 8192**2)
    scale = op("scale", 0, 4 * 2 * 8192**2 * 16)
    t = predict([gemm, scale], [], {"data": 1}, H100)
    expected = gemm.flops / peak + scale.bytes / bandwidth + 2 * H100.kernel_overhead
    assert t.busy == pytest.approx(expected)
    assert t.busy > max(t.compute, t.memory)  # the roofline of sums is lower
    assert t.compute == pytest.approx(gemm.flops / peak)
    assert t.memory == pytest.approx((gemm.bytes + scale.bytes) / bandwidth)
    # an f32 matmul runs at the f32 rate; one in a loop of 10 runs 10 times
    f32 = dataclasses.replace(gemm, dtype="f32", runs=10)
    t32 = predict([f32], [], {"data": 1}, H100)
    rate = H100.peak_flops("float32") * H100.matmul_efficiency
    assert t32.busy == pytest.approx(10 * (gemm.flops / rate + H100.kernel_overhead))


def test_data_parallel_comms_hide_under_their_programs_kernels_tensor_parallel_do_not():
    """A loop of 4 layers: each layer's gather (FSDP, over 'data') hides under that
    layer's kernels except the loop's first and last; the activations' all-reduce over
    'model' is exposed whole."""
    mesh = {"data": 2, "model": 4}
    layer = op("layer", 1e-3 * H100.peak_flops() * H100.matmul_efficiency, 0, "body", runs=4)
    gather = Collective("all-gather", 8 * MB, ((0, 4), (1, 5), (2, 6), (3, 7)), "g", "body")
    tp = Collective("all-reduce", 8 * MB, ((0, 1, 2, 3), (4, 5, 6, 7)), "tp", "body")
    t = predict([layer], [gather, tp] * 4, mesh, H100, entries={"body": 1})
    g, r = collective_time(gather, H100), collective_time(tp, H100)
    assert t.comms == pytest.approx(4 * (g + r))
    assert t.exposed == pytest.approx(4 * r + g)  # one gather: the first, the last
    assert t.step == pytest.approx(t.busy + 4 * r + g)
    assert t.serial == pytest.approx(t.busy + 4 * (g + r))
    assert t.step_low <= t.step <= t.step_high
    # a link too slow to hide behind the kernels: what exceeds them is exposed too
    slow = dataclasses.replace(H100, intra_bandwidth=2e9)
    t = predict([layer], [gather] * 4, mesh, slow, entries={"body": 1})
    g = collective_time(gather, slow)
    assert t.busy < 4 * g
    assert t.exposed == pytest.approx(4 * g - t.busy + g)


def test_the_range_widens_with_the_efficiencies_spread():
    gemm = op("gemm", 1e15, 1e9)
    t = predict([gemm], [], {"data": 1}, H100)
    sure = predict([gemm], [], {"data": 1}, dataclasses.replace(H100, spread=0.0))
    assert sure.step_low == sure.step == sure.step_high == pytest.approx(t.step)
    assert t.step_low == pytest.approx(
        gemm.flops / (H100.peak_flops() * H100.matmul_efficiency * 1.1) + H100.kernel_overhead
    )
    assert t.step_high == pytest.approx(
        gemm.flops / (H100.peak_flops() * H100.matmul_efficiency * 0.9) + H100.kernel_overhead
    )


def test_time_defaults():
    t = Time(compute=2.0, memory=1.0, comms=0.5, exposed=0.25)
    assert (t.busy, t.step, t.serial, t.step_low, t.step_high) == (2.0, 2.25, 2.5, 2.25, 2.25)


def test_peak_memory():
    m = Memory(state=10, arguments=12, outputs=11, alias=10, temp=5)
    assert m.peak == 12 + 11 - 10 + 5


@pytest.mark.parametrize(
    ("text", "value"),
    [("80GiB", 80 * 2**30), ("16 GB", 16 * 10**9), ("1.5e3", 1500), (4096, 4096), ("2kib", 2048)],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value
