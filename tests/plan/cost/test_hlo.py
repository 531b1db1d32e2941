"""Reading collectives from optimized HLO text: every form the compilers write."""
# ruff: noqa: E501 - HLO text is quoted as the compilers write it, one instruction a line

from __future__ import annotations

import pytest

from nnx_sharding.plan._cost.flops import dot_flops
from nnx_sharding.plan._cost.hlo import collectives, replica_groups, shape_bytes, summary


def test_shape_bytes_of_arrays_and_tuples():
    assert shape_bytes("f32[4,8]{1,0}") == [128]
    assert shape_bytes("(bf16[16]{0}, s32[], f32[2,2]{1,0})") == [32, 4, 16]


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        ("replica_groups={{0,1},{2,3}}, x", ((0, 1), (2, 3))),
        ("replica_groups=[2,4]<=[8], x", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("replica_groups=[2,4]<=[4,2]T(1,0), x", ((0, 2, 4, 6), (1, 3, 5, 7))),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, x", ((0, 1, 2, 3), (4, 5, 6, 7))),
        (
            "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, x",
            ((0, 4), (1, 5), (2, 6), (3, 7)),
        ),
        ("replica_groups={}, x", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("source_target_pairs={{0,1},{1,0}}, x", ((0, 1), (1, 0))),
    ],
)
def test_replica_groups_in_every_form(text, groups):
    assert replica_groups(text, 8) == groups


CPU_FORMS = """
HloModule m

ENTRY %main (p0: f32[8,4], p1: f32[16]) -> (f32[1,4], f32[16], f32[8,4]) {
  %p0 = f32[8,4]{1,0} parameter(0)
  %p1 = f32[16]{0} parameter(1)
  %ar = (f32[8,4]{1,0}, f32[16]{0}) all-reduce(f32[8,4]{1,0} %p0, f32[16]{0} %p1), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %g0 = f32[8,4]{1,0} get-tuple-element(%ar), index=0
  %g1 = f32[16]{0} get-tuple-element(%ar), index=1
  %partition-id = u32[] partition-id()
  %offset = s32[] convert(%partition-id)
  %zero = s32[] constant(0)
  %slice = f32[1,4]{1,0} dynamic-slice(f32[8,4]{1,0} %g0, s32[] %offset, s32[] %zero), dynamic_slice_sizes={1,4}
  %ag = f32[8,4]{1,0} all-gather(f32[1,4]{1,0} %slice), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %t = (f32[1,4]{1,0}, f32[16]{0}, f32[8,4]{1,0}) tuple(%slice, %g1, %ag)
}
"""


def test_a_tuple_all_reduce_counts_each_array_and_a_sliced_one_as_reduce_scatter():
    found = collectives(CPU_FORMS, 8)
    kinds = sorted((c.kind, c.bytes, c.group_size) for c in found)
    assert kinds == [("all-gather", 128, 4), ("all-reduce", 64, 8), ("reduce-scatter", 128, 8)]
    assert summary(found)["reduce-scatter"] == 128


TPU_FORM = """
%all-reduce-scatter.fused (param_0: f32[64,32]) -> f32[8,32] {
  %param_0 = f32[64,32]{1,0} parameter(0)
  %all-reduce.7 = f32[64,32]{1,0} all-reduce(f32[64,32]{1,0} %param_0), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %slice.1 = f32[8,32]{1,0} slice(f32[64,32]{1,0} %all-reduce.7), slice={[0:8], [0:32]}
}

ENTRY %main (p0: f32[64,32]) -> f32[8,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  ROOT %all-reduce-scatter.1 = f32[8,32]{1,0} fusion(f32[64,32]{1,0} %p0), kind=kOutput, calls=%all-reduce-scatter.fused
}
"""


def test_the_tpu_all_reduce_scatter_fusion_is_a_reduce_scatter():
    (found,) = collectives(TPU_FORM, 8)
    assert (found.kind, found.bytes, found.group_size) == ("reduce-scatter", 64 * 32 * 4, 8)


GPU_ASYNC = """
ENTRY %main (p0: f32[4,32], p1: f32[32,32]) -> f32[32,32] {
  %p0 = f32[4,32]{1,0} parameter(0)
  %p1 = f32[32,32]{1,0} parameter(1)
  %all-gather-start = (f32[4,32]{1,0}, f32[32,32]{1,0}) all-gather-start(f32[4,32]{1,0} %p0), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %all-gather-done = f32[32,32]{1,0} all-gather-done(%all-gather-start)
  %reduce-scatter-start = ((f32[32,32]{1,0}), f32[4,32]{1,0}) reduce-scatter-start(f32[32,32]{1,0} %p1), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  %reduce-scatter-done = f32[4,32]{1,0} reduce-scatter-done(%reduce-scatter-start)
  %all-reduce-start = f32[32,32]{1,0} all-reduce-start(f32[32,32]{1,0} %all-gather-done), channel_id=3, replica_groups=[4,2]<=[8]
  ROOT %all-reduce-done = f32[32,32]{1,0} all-reduce-done(%all-reduce-start)
}
"""


def test_async_pairs_count_once_at_their_start():
    found = sorted((c.kind, c.bytes, c.group_size) for c in collectives(GPU_ASYNC, 8))
    assert found == [
        ("all-gather", 4096, 8),
        ("all-reduce", 4096, 2),
        ("reduce-scatter", 4096, 8),
    ]


GPU_FUSED_DOT = """
%fused_dot (parameter_0: f32[128,512], parameter_1: f32[512,256]) -> f32[128,256] {
  %parameter_0 = f32[128,512]{1,0} parameter(0)
  %parameter_1 = f32[512,256]{1,0} parameter(1)
  ROOT %dot.5 = f32[128,256]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[128,512], b: f32[512,256]) -> f32[128,256] {
  %a = f32[128,512]{1,0} parameter(0)
  %b = f32[512,256]{1,0} parameter(1)
  %gemm = (f32[128,256]{1,0}, s8[4096]{0}) custom-call(f32[128,512]{1,0} %a, f32[512,256]{1,0} %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %fusion = f32[128,256]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
}
"""


def test_matmul_flops_where_the_compiler_gives_no_cost_analysis():
    assert dot_flops(GPU_FUSED_DOT) == 2 * (2 * 128 * 256 * 512)
