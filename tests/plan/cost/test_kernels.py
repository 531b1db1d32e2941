"""The kernels the cost model prices (`_ops`) and what their collectives may overlap
(`_flow`), on HLO text written out and on programs the compilers build."""
# ruff: noqa: E501 - HLO text is quoted as the compilers write it, one instruction a line

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import nnx_sharding
from nnx_sharding.plan._cost.flops import kernel_flops
from nnx_sharding.plan._cost.hlo import instructions
from nnx_sharding.plan._cost.kernels import ops
from nnx_sharding.plan._hardware.devices import has_gpu_compiler

needs_gpu = pytest.mark.skipif(not has_gpu_compiler(), reason="needs nnx_sharding[gpu]")
F32 = 4

SLICED = """
HloModule m

%fused (p0: f32[32,256,256], p1: s32[], p2: f32[8,256]) -> f32[8,256] {
  %p0 = f32[32,256,256]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[8,256]{1,0} parameter(2)
  %z = s32[] constant(0)
  %ds = f32[1,256,256]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,256,256}
  %w = f32[256,256]{1,0} bitcast(%ds)
  ROOT %d = f32[8,256]{1,0} dot(%p2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%update (q0: f32[32,8,256], q1: f32[8,256], q2: s32[]) -> f32[32,8,256] {
  %q0 = f32[32,8,256]{2,1,0} parameter(0)
  %q1 = f32[8,256]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %t = f32[8,256]{1,0} tanh(%q1)
  %u = f32[1,8,256]{2,1,0} bitcast(%t)
  %z = s32[] constant(0)
  ROOT %dus = f32[32,8,256]{2,1,0} dynamic-update-slice(%q0, %u, %q2, %z, %z)
}

ENTRY %main (a: f32[32,256,256], i: s32[], x: f32[8,256], s: f32[32,8,256]) -> f32[32,8,256] {
  %a = f32[32,256,256]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[8,256]{1,0} parameter(2)
  %s = f32[32,8,256]{2,1,0} parameter(3)
  %f = f32[8,256]{1,0} fusion(%a, %i, %x), kind=kOutput, calls=%fused
  ROOT %g = f32[32,8,256]{2,1,0} fusion(%s, %f, %i), kind=kLoop, calls=%update
}
"""


def test_a_fused_slice_reads_the_slice_and_an_in_place_update_writes_the_update():
    """A scanned layer's two forms: its weights sliced from the stack (the fusion reads
    one layer's, not the stack's), its activations written into the stack (the fusion
    writes one layer's, and reads none of the stack)."""
    found = {op.name: op for op in ops(SLICED)}
    assert set(found) == {"f", "g"}
    layer = 256 * 256 * F32
    activation = 8 * 256 * F32
    assert found["f"].flops == 2 * 8 * 256 * 256
    assert found["f"].dtype == "f32"
    assert found["f"].bytes == layer + 4 + activation + activation  # slice, index, x, out
    assert found["g"].flops == 0
    assert found["g"].bytes == activation + 4 + activation  # reads x and i, writes a layer


def _relayout_into(computation: str, param: str, shape: str, line: str) -> str:
    """`SLICED` with ``line`` of ``computation`` reading its parameter ``param`` (of HLO
    type ``shape``) through a nested fusion that relays it out in place (its result
    aliased to its operand), as the TPU compiler writes a scanned layer's stack."""
    relayout = (
        f"  %r = {shape}{{2,1,0}} fusion(%{param}), kind=kLoop, "
        "output_to_operand_aliasing={{}: (0, {})}, calls=%relayout\n"
    )
    text = SLICED.replace(line, relayout + line.replace(f"(%{param},", "(%r,"))
    return text.replace(
        f"%{computation} ({param}",
        f"%relayout (r0: {shape}) -> {shape} {{\n"
        f"  ROOT %r0 = {shape}{{2,1,0}} parameter(0)\n}}\n\n%{computation} ({param}",
    )


def test_an_update_through_an_in_place_relayout_writes_the_update():
    """The TPU compiler writes a scan's saved activation into the stack through a nested
    fusion that relays the stack out in place (its result aliased to its operand): the
    fusion still writes one layer's activation and reads none of the stack."""
    text = _relayout_into(
        "update", "q0", "f32[32,8,256]",
        "  ROOT %dus = f32[32,8,256]{2,1,0} dynamic-update-slice(%q0, %u, %q2, %z, %z)",
    )  # fmt: skip
    assert text.count("calls=%relayout") == 1  # the pattern is in place
    found = {op.name: op for op in ops(text)}
    activation = 8 * 256 * F32
    assert found["g"].bytes == activation + 4 + activation  # reads x and i, writes a layer


def test_a_slice_through_an_in_place_relayout_reads_the_slice():
    """The backward pass reads a layer's saved activation from the stack through the
    same in-place relayout: the fusion reads one layer's slice, not the stack (priced as
    the stack, the 70B at 8,192 tokens predicted 15.14 s a step, not 12.85)."""
    text = _relayout_into(
        "fused", "p0", "f32[32,256,256]",
        "  %ds = f32[1,256,256]{2,1,0} dynamic-slice(%p0, %p1, %z, %z)",
    )  # fmt: skip
    assert text.count("calls=%relayout") == 1  # the pattern is in place
    found = {op.name: op for op in ops(text)}
    layer, activation = 256 * 256 * F32, 8 * 256 * F32
    assert found["f"].bytes == layer + 4 + activation + activation  # slice, index, x, out


def test_an_asynchronous_fusion_is_priced_as_the_fusion():
    """A newer XLA for GPUs wraps some fusions as ``fusion-start``/``fusion-done``
    (seen compiling on an H200 with jax 0.11.2): the start is the kernel, priced as the
    fusion it calls (its result is the middle of its tuple, after its operands and
    before a context); the done launches nothing."""
    start = (
        "%gs = ((f32[32,8,256]{2,1,0}, f32[8,256]{1,0}, s32[]), f32[32,8,256]{2,1,0}, u32[]) "
        "fusion-start(%s, %f, %i), kind=kLoop, calls=%update"
    )
    text = SLICED.replace(
        "ROOT %g = f32[32,8,256]{2,1,0} fusion(%s, %f, %i), kind=kLoop, calls=%update",
        f"{start}\n  ROOT %g = f32[32,8,256]{{2,1,0}} fusion-done(%gs)",
    )
    found = {op.name: op for op in ops(text)}
    assert set(found) == {"f", "gs"}
    assert found["gs"].bytes == {op.name: op for op in ops(SLICED)}["g"].bytes


def test_an_attention_kernel_counts_its_matmuls():
    """A fused attention (a Pallas or cuDNN kernel) hides its matmuls from the HLO: they
    are counted from q, k and v's shape, causal (half the blocks)."""
    b, s, h, d = 2, 1024, 8, 128
    q = f"bf16[{b},{s},{h},{d}]{{3,2,1,0}}"
    text = f"""
HloModule m

ENTRY %main (q: {q}, k: {q}, v: {q}) -> {q} {{
  %q = {q} parameter(0)
  %k = {q} parameter(1)
  %v = {q} parameter(2)
  ROOT %pallas_call = {q} custom-call(%q, %k, %v), custom_call_target="__gpu$xla.gpu.triton", backend_config={{name = "mha_forward", num_warps = 8 : i32}}
}}
"""
    (ins,) = [i for i in instructions(text) if i.opcode == "custom-call"]
    shapes = {(i.computation, i.name): i.shape for i in instructions(text)}
    one = 2 * b * h * s * s * d  # one (s x d) @ (d x s) product per batch and head
    assert kernel_flops(ins, shapes) == (2 * one / 2, "bf16")  # QK^T and PV, causal
    backward = ins.__class__(ins.name, f"({q}, {q}, {q})", ins.opcode,
                             ins.rest.replace("mha_forward", "mha_backward"), ins.computation)  # fmt: skip
    assert kernel_flops(backward, shapes) == (5 * one / 2, "bf16")  # recompute, dV, dP, dQ, dK


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_a_context_parallel_splash_kernel_counts_its_queries_against_every_key(kv_heads):
    """Splash under context parallelism's all-gather: mask tables come first, then a
    device's queries (heads, Sq, head_dim) against the whole sequence's keys (kv heads,
    Sk, head_dim): ``2·H·Sq·Sk·D`` a product, causal (half), forward 2 products, dk and
    dv 4, dq 3."""
    h, sq, sk, d = 8, 1024, 4096, 128
    q, k = f"bf16[{h},{sq},{d}]{{2,1,0}}", f"bf16[{kv_heads},{sk},{d}]{{2,1,0}}"
    mask = "s8[1,32,256]{2,1,0}"
    text = f"""
HloModule m

ENTRY %main (m: {mask}, q: {q}, k: {k}, v: {k}) -> {q} {{
  %m = {mask} parameter(0)
  %q = {q} parameter(1)
  %k = {k} parameter(2)
  %v = {k} parameter(3)
  ROOT %splash_mha_fwd_residuals = {q} custom-call(%m, %q, %k, %v), custom_call_target="tpu_custom_call"
}}
"""
    (ins,) = [i for i in instructions(text) if i.opcode == "custom-call"]
    shapes = {(i.computation, i.name): i.shape for i in instructions(text)}
    one = 2 * h * sq * sk * d
    assert kernel_flops(ins, shapes) == (2 * one / 2, "bf16")
    for name, out, units in [("splash_mha_dkv_no_residuals", f"({k}, {k})", 4),
                             ("splash_mha_dq_no_residuals", f"(f32[512,128]{{1,0}}, {q})", 3)]:  # fmt: skip
        backward = ins.__class__(name, out, ins.opcode, ins.rest, ins.computation)
        assert kernel_flops(backward, shapes) == (units * one / 2, "bf16"), name


def scanned_mlp_loss(remat: str):
    policy = {"none": None, "full": jax.checkpoint_policies.nothing_saveable}[remat]

    def layer(x, w):
        return jnp.tanh(jnp.tanh(x @ w[0]) @ w[1]), None

    body = layer if policy is None else jax.checkpoint(layer, policy=policy)

    def loss(ws, x):
        return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)

    return loss


def test_full_remat_adds_the_forward_matmuls_once():
    """Recomputation is in the compiled program: under ``full`` (save each layer's input
    only) the backward pass computes every layer's forward again, so the step's matmul
    FLOPs grow by the forward's (each tanh needs its output: nothing is left out)."""
    layers, batch, d = 6, 64, 128
    stacked = jax.ShapeDtypeStruct((layers, 2, d, d), jnp.float32)
    x = jax.ShapeDtypeStruct((batch, d), jnp.float32)

    def flops(remat: str) -> float:
        text = jax.jit(jax.grad(scanned_mlp_loss(remat))).lower(stacked, x).compile().as_text()
        return sum(op.flops * op.runs for op in ops(text))

    forward = layers * 2 * (2 * batch * d * d)
    none, full = flops("none"), flops("full")
    assert none == 3 * forward  # forward, and the backward's two matmuls per matmul
    assert full - none == forward


class Stack(nnx.Module):
    """``layers`` scanned residual tanh blocks (weights stacked on a leading axis)."""

    def __init__(self, layers: int, d: int, f: int, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.up = nnx.Param(init(rngs.params(), (layers, d, f)))
        self.down = nnx.Param(init(rngs.params(), (layers, f, d)))

    def __call__(self, x):
        def body(x, w):
            up, down = (v.astype(jnp.bfloat16) for v in w)
            return x + jnp.tanh(x @ up) @ down, None

        return jax.lax.scan(body, x.astype(jnp.bfloat16), (self.up[...], self.down[...]))[0]


def stack_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
    optimizer.update(model, grads)
    return loss


@needs_gpu
def test_scanned_layers_gather_once_per_pass_and_reduce_once_and_their_overlap():
    """On the GPU compiler, a scanned stack in float32 computed in bfloat16: FSDP gathers
    each layer's weights once per pass (forward, backward: twice in all, in bfloat16)
    and reduce-scatters each gradient once; data parallelism all-reduces each gradient
    once. Weight gathers and gradient reductions can overlap (`_flow`): none is
    exposed whole."""
    layers, d, f = 4, 256, 1024

    def build():
        model = Stack(layers, d, f, nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(build)
    x = jax.ShapeDtypeStruct((8 * 256, d), jnp.float32)
    plans = nnx_sharding.plan(
        stack_step, model, optimizer, x, devices=8, accelerator="h100",
        layouts=["dp", "fsdp"], donate_argnums=(0, 1),
    )  # fmt: skip
    params = 2 * layers * d * f
    by = {p.layout: p for p in plans}
    fsdp, dp = by["fsdp"], by["dp"]
    assert fsdp.compiler == dp.compiler == "gpu"
    assert fsdp.collectives["all-gather"] == 2 * params * 2  # two passes, bfloat16
    assert fsdp.collectives["reduce-scatter"] == params * 2  # bfloat16 gradients, once
    assert dp.collectives["all-reduce"] - 4 == params * 2  # and the loss
    for p in (fsdp, dp):
        big = [c for c in p.detail if c.bytes > 1024]
        assert big and all(c.hidden for c in big), [(c.name, c.hidden) for c in big]
        assert p.time.exposed < p.time.comms
