"""Host offload planned (nnx_sharding/plan/_cost/host.py and the cost model): on a
compile-only TPU, the offloading remat policies' transfers are the named activations'
bytes (a formula from the shapes), priced on the accelerator's host link and hidden
under the layer's kernels only as far as they fit; a plan reports the host's bytes
and does not fit where they exceed the host's memory; the CPU compiler, which does not
offload, says so. The TPU compiler's asynchronous collective chains count once."""

from __future__ import annotations

import dataclasses

import pytest

from nnx_sharding.plan import DECODER_CONFIGS, PRESETS, decoder_builder, search
from nnx_sharding.plan._cost.hlo import collectives
from nnx_sharding.plan._hardware.devices import has_tpu_compiler

needs_tpu = pytest.mark.skipif(not has_tpu_compiler(), reason="needs nnx_sharding[tpu]")
CONFIG = dataclasses.replace(
    DECODER_CONFIGS["llama3-8b"], layers=2, seq_len=1024, batch=8, vocab=4096, d_model=1024,
    heads=8, kv_heads=2, mlp=2048,
)  # fmt: skip
DEVICES = 8


def _plan(remat: str, accelerator="v5e"):
    (found,) = search(decoder_builder(CONFIG), {"remat": [remat]}, devices=DEVICES,
                      accelerator=accelerator, layouts=["fsdp"], prune=False)  # fmt: skip
    return found


@pytest.fixture(scope="module")
def offloaded():
    return _plan("offload_qkv")


@needs_tpu
def test_the_transfers_are_the_named_activations(offloaded):
    """Each layer writes its input and its q, k, v and output projections (bfloat16,
    the batch split over 8 devices) to the host and reads them back: twice their bytes
    per layer, in transfers of exactly those arrays."""
    c = CONFIG
    tokens = c.batch // DEVICES * c.seq_len
    named = tokens * (c.d_model + c.heads * c.head_dim + 2 * c.kv * c.head_dim + c.d_model)
    moved = offloaded.program.transfers
    assert sum(t.bytes * t.runs for t in moved if t.to_host) == 2 * named * c.layers
    assert sum(t.bytes * t.runs for t in moved if not t.to_host) == 2 * named * c.layers
    assert offloaded.memory.host >= 2 * named * c.layers  # the host holds every layer's
    assert any("in the host's memory" in note for note in offloaded.notes)


@needs_tpu
def test_the_host_link_prices_them_and_a_slow_one_is_exposed(offloaded):
    """``Time.host`` is the transfers' bytes over the host link at its efficiency; on
    a link 1000 times slower the step grows by what the layers' kernels cannot hide."""
    v5e = PRESETS["v5e"]
    moved = sum(t.bytes * t.runs for t in offloaded.program.transfers)
    t = offloaded.program.time(v5e)
    assert t.host == pytest.approx(moved / (v5e.host_bandwidth * v5e.host_efficiency))
    slow = dataclasses.replace(v5e, host_bandwidth=v5e.host_bandwidth / 1000)
    t_slow = offloaded.program.time(slow)
    assert t_slow.host == pytest.approx(1000 * t.host)
    assert t_slow.step > t.step + 0.5 * t_slow.host  # mostly exposed: the kernels are short
    unknown = dataclasses.replace(v5e, host_bandwidth=0.0)
    assert offloaded.program.time(unknown).host == 0.0  # not known: not priced


@needs_tpu
def test_a_plan_over_the_hosts_memory_does_not_fit(offloaded):
    """The same step on a v5e whose host holds less than the offloaded activations."""
    small = dataclasses.replace(PRESETS["v5e"], host_bytes=offloaded.memory.host // 2)
    found = _plan("offload_qkv", small)
    assert not found.fits and "in the host's memory" in found.reason


def test_the_cpu_compiler_says_it_does_not_offload():
    found = _plan("offload_input", "cpu")
    assert found.memory.host == 0 and not found.program.transfers
    assert any("does not offload" in note for note in found.notes)


def test_a_tpu_collective_chain_counts_once():
    """An all-gather the TPU compiler splits into a start, a continuation sunk into a
    loop of 4 iterations and a done (one channel) is one all-gather, counted where it
    starts; a collective of another channel in the loop counts per iteration."""
    text = """
%fused_start (p: bf16[4,8]) -> bf16[32,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  ROOT %ag.1 = bf16[32,8]{1,0} all-gather(%p), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
%async_collective_fusion.3 (p: bf16[4,8]) -> bf16[32,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  ROOT %ag.2 = bf16[32,8]{1,0} all-gather(%p), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
%body (t: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %t = (s32[], bf16[4,8]{1,0}) parameter(0)
  %x = bf16[4,8]{1,0} get-tuple-element(%t), index=1
  %fusion.3 = bf16[32,8]{1,0} fusion(%x), kind=kLoop, calls=%async_collective_fusion.3
  %ar = bf16[4,8]{1,0} all-reduce(%x), channel_id=9, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], bf16[4,8]{1,0}) tuple(%i, %ar)
}
%cond (t: (s32[], bf16[4,8])) -> pred[] {
  %t = (s32[], bf16[4,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}
ENTRY %main (a: bf16[4,8]) -> bf16[32,8] {
  %a = bf16[4,8]{1,0} parameter(0)
  %async-collective-start = bf16[32,8]{1,0} fusion(%a), kind=kLoop, calls=%fused_start
  %z = s32[] constant(0)
  %init = (s32[], bf16[4,8]{1,0}) tuple(%z, %a)
  %w = (s32[], bf16[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %done = bf16[32,8]{1,0} copy(%async-collective-start)
}
"""  # noqa: E501
    found = collectives(text, 8)
    assert [c.kind for c in found].count("all-gather") == 1
    assert [c.kind for c in found].count("all-reduce") == 4
