"""Attention that never materialises the ``seq × seq`` scores
(nnx_sharding/plan/_decoder/attention.py): the blockwise attention and the splash
kernel's wrapper against jax's own attention, memory that grows linearly with the
sequence, and the kernel each target's compiler gets."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding.plan import DecoderConfig, blockwise_attention, decoder_builder
from nnx_sharding.plan._cost.kernels import ops
from nnx_sharding.plan._decoder.attention import (
    attention_kernel,
    splash_attention,
    triton_attention,
)
from nnx_sharding.plan._hardware.devices import compile_devices, has_gpu_compiler, has_tpu_compiler


def reference(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def qkv(b: int, s: int, h: int, kv: int, d: int) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(b, s, h, d), (b, s, kv, d), (b, s, kv, d), (b, s, h, d)]
    return tuple(jax.random.normal(key, shape) for key, shape in zip(keys, shapes, strict=True))


@pytest.mark.parametrize("block", [16, 64], ids=["10 block pairs", "one block"])
@pytest.mark.parametrize("kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_blockwise_attention_and_its_gradients_are_jaxs(monkeypatch, block, kv):
    monkeypatch.setattr("nnx_sharding.plan._decoder.attention.BLOCK", block)
    q, k, v, cotangent = qkv(2, 64, 4, kv, 8)
    out, vjp = jax.vjp(jax.jit(blockwise_attention), q, k, v)
    want, want_vjp = jax.vjp(reference, q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(vjp(cotangent), want_vjp(cotangent), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def compiled_grad(attention, s: int) -> jax.stages.Compiled:
    x = jax.ShapeDtypeStruct((1, s, 2, 64), jnp.float32)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(attention(q, k, v))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()


def test_blockwise_memory_grows_linearly_with_the_sequence():
    """Forward and backward at 1024 and 2048 tokens (2 heads of 64): the blockwise
    attention's temporaries grow by less than its 3 inputs do; jax's XLA attention's by
    more than one float32 ``heads × seq × seq`` buffer of scores, which the blockwise
    attention never holds."""
    temp = {}
    for name, attention in [("blockwise", blockwise_attention), ("xla", reference)]:
        for s in (1024, 2048):
            compiled = compiled_grad(attention, s)
            temp[name, s] = compiled.memory_analysis().temp_size_in_bytes
            squares = re.findall(rf"\[[\d,]*{s},{s}\]", compiled.as_text())
            assert bool(squares) == (name == "xla"), (name, s, squares[:3])
    inputs = 3 * (2048 - 1024) * 2 * 64 * 4
    scores = 2 * (2048**2 - 1024**2) * 4
    assert temp["blockwise", 2048] - temp["blockwise", 1024] < inputs, temp
    assert temp["xla", 2048] - temp["xla", 1024] > scores, temp


@pytest.mark.parametrize(
    ("kernel", "seq", "head_dim"),
    [(splash_attention, 256, 128), (triton_attention, 128, 64)],
    ids=["splash (TPU)", "triton (GPU)"],
)
def test_the_pallas_wrappers_compute_jaxs_attention_split_over_the_mesh(kernel, seq, head_dim):
    """Pallas's splash kernel and its GPU flash-attention kernel, interpreted on the
    CPU: their scaling, layout and grouped heads as jax's attention; under a mesh, batch
    over ``data`` and heads over ``model``, the 2 kv heads repeated where 4 ``model``
    devices do not divide them."""
    q, k, v, _ = qkv(2, seq, 4, 2, head_dim)
    want = reference(q, k, v)
    got = jax.jit(lambda q, k, v: kernel(q, k, v, interpret=True))
    np.testing.assert_allclose(got(q, k, v), want, rtol=2e-5, atol=2e-5)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(got(q, k, v), want, rtol=2e-5, atol=2e-5)


# --- the kernel each target's compiler gets, in a decoder's training step ---------------------

LONG = DecoderConfig("long", 256, 256, 2, 128, 512, 1, batch=8, seq_len=1536, kv_heads=1)


def compile_step(accelerator: str, config: DecoderConfig) -> str:
    """The optimized HLO of the decoder's AdamW step for 8 compile-only devices of
    ``accelerator``, the batch over ``fsdp``."""
    devices, compiler, _ = compile_devices(accelerator, 8)
    assert compiler in ("tpu", "gpu"), compiler
    mesh = Mesh(np.array(devices), ("fsdp",), axis_types=(AxisType.Auto,))
    built = decoder_builder(config)({"remat": "full"})
    step = nnx_sharding.jit(built.step, in_shardings=(P(), P(), P("fsdp")), **built.jit_options)
    with jax.set_mesh(mesh):
        return step.lower(*built.args).compile().as_text()


def squares(text: str, s: int) -> list[str]:
    return re.findall(rf"\[[\d,]*{s},{s}\][^\s]*", text)


@pytest.mark.skipif(not has_tpu_compiler(), reason="needs nnx_sharding[tpu]")
def test_the_tpu_compiler_gets_the_splash_kernel():
    with jax.set_mesh(Mesh(np.array(compile_devices("v5e:2x4", 8)[0]), ("fsdp",))):
        assert attention_kernel("auto", 2048, 128, jnp.bfloat16) == "splash"
        assert attention_kernel("auto", 2048, 64, jnp.bfloat16) == "blockwise"
    text = compile_step("v5e:2x4", LONG)
    assert re.search(r"splash_mha\S* = .* custom-call\(", text)
    assert not squares(text, 1536), squares(text, 1536)[:3]


@pytest.mark.skipif(not has_gpu_compiler(), reason="needs nnx_sharding[gpu]")
def test_compile_only_gpus_get_pallas_flash_attention_for_cudnns():
    """cuDNN's fused attention does not trace without a GPU (jax asks the cuDNN library
    and the local GPU while tracing): Pallas's flash-attention kernel (Triton), the same
    algorithm with the same FLOPs, is compiled in its place, and the cost model counts
    its FLOPs as the causal attention's."""
    with jax.set_mesh(Mesh(np.array(compile_devices("h100", 8)[0]), ("fsdp",))):
        assert attention_kernel("auto", 2048, 128, jnp.bfloat16) == "cudnn"
        assert attention_kernel("auto", 2048, 128, jnp.float32) == "blockwise"
    text = compile_step("h100", LONG)
    assert "cudnn$fmha" not in text
    assert "triton" in text
    assert not squares(text, 1536), squares(text, 1536)[:3]
    # per device: 1 sequence, 2 heads (the kv head repeated); one unit is 2·B·H·S²·D,
    # halved for the mask; forward 2 units (twice: remat 'full'), backward 5
    unit = 2 * 1 * 2 * 1536**2 * 128 / 2
    kernels = sorted(op.flops for op in ops(text) if op.opcode == "custom-call" and op.flops)
    assert kernels == [2 * unit, 2 * unit, 5 * unit]
    with pytest.raises(Exception, match="cuDNN"):
        compile_step("h100", dataclasses.replace(LONG, attention="cudnn"))


def test_the_cpu_gets_the_blockwise_attention():
    assert attention_kernel("auto", 2048, 128, jnp.bfloat16) == "blockwise"
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: nnx_sharding.plan.Decoder(LONG, rngs=nnx.Rngs(0)))
    tokens = jax.ShapeDtypeStruct((1, 1536), jnp.int32)
    text = nnx_sharding.jit(lambda m, t: m(t)).lower(model, tokens).compile().as_text()
    assert not squares(text, 1536), squares(text, 1536)[:3]
