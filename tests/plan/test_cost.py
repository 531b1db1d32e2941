"""The cost model as docs/planning.md writes it down."""

from __future__ import annotations

import dataclasses

import pytest

from nnx_sharding.plan import PRESETS, Memory
from nnx_sharding.plan._cost import (
    collective_time,
    crosses_nodes,
    parse_bytes,
    predict,
    spanned_axes,
)
from nnx_sharding.plan._hlo import Collective

H100 = PRESETS["h100"]
MB = 10**6


@pytest.mark.parametrize(
    ("kind", "factor"),
    [
        ("all-reduce", 2 * 7 / 8),
        ("all-gather", 7 / 8),
        ("reduce-scatter", 7 / 8),
        ("all-to-all", 7 / 8),
        ("collective-permute", 1.0),
    ],
)
def test_ring_volume_over_the_link_plus_latency(kind, factor):
    c = Collective(kind, 64 * MB, (tuple(range(8)),), "x")
    inside = collective_time(c, H100, crosses_nodes=False)
    across = collective_time(c, H100, crosses_nodes=True)
    assert inside == pytest.approx(H100.intra_latency + 64 * MB * factor / H100.intra_bandwidth)
    assert across == pytest.approx(H100.inter_latency + 64 * MB * factor / H100.inter_bandwidth)


def test_a_group_crosses_nodes_when_its_devices_do():
    assert not crosses_nodes(range(8), 8)
    assert crosses_nodes((0, 8), 8)
    assert spanned_axes((0, 1, 2, 3), {"data": 2, "model": 4}) == {"model"}
    assert spanned_axes((0, 4), {"data": 2, "model": 4}) == {"data"}


def test_model_axis_comms_are_exposed_and_the_others_overlap():
    mesh = {"data": 2, "model": 4}
    tp = Collective("all-reduce", 8 * MB, ((0, 1, 2, 3), (4, 5, 6, 7)), "tp")
    dp = Collective("all-reduce", 8 * MB, ((0, 4), (1, 5), (2, 6), (3, 7)), "dp")
    flops = 1e-3 * H100.peak_flops("bfloat16")  # a millisecond of compute
    t = predict(flops, 0.0, [tp, dp], mesh, H100, "bfloat16")
    tp_s, dp_s = (collective_time(c, H100, False) for c in (tp, dp))
    assert t.compute == pytest.approx(1e-3)
    assert t.comms == pytest.approx(tp_s + dp_s)
    assert t.exposed == pytest.approx(tp_s)  # the gradient reduction hides under compute
    assert t.step == pytest.approx(1e-3 + tp_s)
    assert t.serial == pytest.approx(1e-3 + tp_s + dp_s)
    slow = dataclasses.replace(H100, intra_bandwidth=1e9)  # now dp outlasts the compute
    t = predict(flops, 0.0, [tp, dp], mesh, slow, "bfloat16")
    dp_s = collective_time(dp, slow, False)
    assert t.exposed == pytest.approx(collective_time(tp, slow, False) + dp_s - 1e-3)


def test_peak_memory():
    m = Memory(state=10, arguments=12, outputs=11, alias=10, temp=5)
    assert m.peak == 12 + 11 - 10 + 5


@pytest.mark.parametrize(
    ("text", "value"),
    [("80GiB", 80 * 2**30), ("16 GB", 16 * 10**9), ("1.5e3", 1500), (4096, 4096), ("2kib", 2048)],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value
