"""A loop's body runs once per iteration, and the planner counts it so: the collectives
and matmuls inside ``jax.lax.scan`` count their trip count times, and a decoder whose
layers are scanned plans as the same decoder unrolled (what the targets' compilers give
for each, compared)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding.plan._cost import flops, hlo
from nnx_sharding.plan._decoder.configs import DecoderConfig
from nnx_sharding.plan._decoder.model import Decoder, loss_fn
from nnx_sharding.plan._hardware.devices import has_gpu_compiler, has_tpu_compiler

F32 = 4


def test_nested_loops_count_their_body_per_iteration():
    """A psum and a matmul inside a scan of 4 inside a scan of 3: 12 of each."""
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))

    def body(a, w):
        def inner(a, _):
            return jax.lax.psum(a @ w, "x"), None

        return jax.lax.scan(inner, a, None, length=4)[0], None

    def f(a, w):
        return jax.lax.scan(body, a, jnp.stack([w] * 3))[0]

    g = jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    a = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
    text = jax.jit(g).lower(a, a.update(shape=(64, 64))).compile().as_text()
    found = hlo.collectives(text, 4)
    assert [c.kind for c in found] == ["all-reduce"] * 12
    assert {c.bytes for c in found} == {32 * 64 * F32}
    assert flops.dot_flops(text) == 12 * 2 * 32 * 64 * 64
    assert flops.dot_flops(text, per_iteration=False) == 2 * 32 * 64 * 64


# float32 compute (a step that equals the single-device one to 1e-5), layers unrolled
# unless a test scans them, and a two-matrix GELU MLP: the shapes the formulas below use
PINNED = {"compute_dtype": "float32", "scan": False, "gated": False, "activation": "gelu"}
CONFIG = DecoderConfig("loops", vocab=64, d_model=32, heads=8, head_dim=4, mlp=64, layers=3,
                       batch=8, seq_len=16, **PINNED)  # fmt: skip
RULES = [("heads", "model"), ("mlp", "model"), ("vocab", None), ("embed", None)]


@functools.cache  # the GPU's plans serve three tests
def _plans(scan: bool, accelerator: str) -> dict[str, nnx_sharding.plan.Plan]:
    config = dataclasses.replace(CONFIG, scan=scan)

    def build() -> tuple[Decoder, nnx.Optimizer]:
        model = Decoder(config, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

    def step(model: Decoder, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return loss

    with nnx.use_eager_sharding(False):
        model, optimizer = nnx.eval_shape(build)
    tokens = jax.ShapeDtypeStruct((config.batch, config.seq_len + 1), jnp.int32)
    plans = nnx_sharding.plan(
        step, model, optimizer, tokens, devices=8, accelerator=accelerator,
        layouts=["dp", "zero1", "fsdp", "tp"], rules=RULES, donate_argnums=(0, 1),
    )  # fmt: skip
    assert all(p.reason is None for p in plans), [p.reason for p in plans]
    return {p.layout: p for p in plans}


def test_a_scanned_decoder_computes_as_the_unrolled_one():
    """The same weights, the layers stacked and scanned: the same loss and gradients."""
    with nnx.use_eager_sharding(False):  # logical axis names: nothing to place
        unrolled = Decoder(CONFIG, rngs=nnx.Rngs(0))
        scanned = Decoder(dataclasses.replace(CONFIG, scan=True), rngs=nnx.Rngs(1))
    blocks = [block.weights() for block in unrolled.layers]
    for name in scanned.layers.weights():
        getattr(scanned.layers, name).set_value(jnp.stack([b[name] for b in blocks]))
    for name in ("embed", "final_norm", "head"):
        getattr(scanned, name).set_value(getattr(unrolled, name)[...])
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, CONFIG.vocab)
    (a, ga), (b, gb) = (nnx.value_and_grad(loss_fn)(m, tokens) for m in (unrolled, scanned))
    np.testing.assert_allclose(a, b, rtol=1e-6)
    for name in ("up", "wq"):
        stacked = jnp.stack([getattr(ga.layers[i], name)[...] for i in range(CONFIG.layers)])
        np.testing.assert_allclose(stacked, getattr(gb.layers, name)[...], rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not has_gpu_compiler(), reason="needs the GPU compiler")
def test_a_scanned_decoder_plans_as_the_unrolled_one_on_the_gpu_compiler():
    """The GPU compiler's figures: the same state and collectives, except where the
    scanned backward pass, a loop of its own, cannot reuse what the forward pass's loop
    computed: FSDP gathers each layer's weights again, tensor parallelism each block's
    input (Megatron's sequence parallelism, which the decoder's activation layout is),
    and the attention's backward pass recomputes ``QKᵀ`` (the unrolled program shares
    the forward pass's: one batched matmul per layer fewer)."""
    unrolled, scanned = _plans(False, "h100"), _plans(True, "h100")
    layer_bytes = CONFIG.layers * (4 * 32 * 8 * 4 + 2 * 32 * 64 + 2 * 32) * F32
    activation = CONFIG.batch * CONFIG.seq_len * CONFIG.d_model * F32
    # QKᵀ per device: batch · heads (one of them split 8 ways) · seq² · head_dim
    scores = 2 * CONFIG.batch * CONFIG.heads * CONFIG.seq_len**2 * CONFIG.head_dim / 8
    for layout in ("dp", "zero1", "fsdp", "tp"):
        a, b = unrolled[layout], scanned[layout]
        assert a.compiler == b.compiler == "gpu"
        assert b.flops == pytest.approx(a.flops + CONFIG.layers * scores, rel=1e-9), layout
        assert b.memory.state == a.memory.state, layout
        expected = dict(a.collectives)
        if layout == "fsdp":
            expected["all-gather"] += layer_bytes
        if layout == "tp":  # the inputs of attention and of the MLP, per layer
            expected["all-gather"] += CONFIG.layers * 2 * activation
        assert b.collectives == expected, layout


@pytest.mark.skipif(not has_tpu_compiler(), reason="needs the TPU compiler")
def test_a_scanned_decoder_plans_as_the_unrolled_one_on_the_tpu_compiler():
    """The TPU compiler writes no trip count: it is read from the loop's condition. The
    same state and gradient reductions (all-reduced, or reduce-scattered by FSDP), the
    same tensor-parallel reduce-scatters; the FLOPs within 15 % (``cost_analysis`` counts
    the loop once: the other iterations add their matmuls, not their elementwise work)."""
    unrolled, scanned = _plans(False, "v5e:2x4"), _plans(True, "v5e:2x4")
    for layout in ("dp", "zero1", "fsdp", "tp"):
        a, b = unrolled[layout], scanned[layout]
        assert a.compiler == b.compiler == "tpu"
        assert b.flops == pytest.approx(a.flops, rel=0.15), layout
        assert any("loop" in note for note in b.notes), layout  # the iterations added
        assert b.memory.state == a.memory.state, layout
    pairs = [("dp", "all-reduce"), ("tp", "reduce-scatter"), ("fsdp", "reduce-scatter")]
    for layout, kind in pairs:
        assert scanned[layout].collectives[kind] == unrolled[layout].collectives[kind], layout


@pytest.mark.skipif(not has_gpu_compiler(), reason="needs the GPU compiler")
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_tensor_parallel_reduce_scatters_once_per_block_and_pass_on_the_gpu_compiler(scan):
    """Megatron's count with sequence parallelism (the residual stream split over
    ``model`` between blocks): one reduce-scatter of ``tokens · d_model`` floats per
    attention and per MLP block, forward and backward (4 per layer), where plain Megatron
    all-reduces. The GPU compiler sums the q, k and v input gradients before reducing
    them; the CPU compiler reduces each (6 per layer, tests/plan/test_exact.py). What is
    still all-reduced is the norms' statistics: at most 2 floats per token."""
    tp = _plans(scan, "h100")["tp"]
    tokens = CONFIG.batch * CONFIG.seq_len
    scatters = [c for c in tp.detail if c.kind == "reduce-scatter"]
    assert [c.bytes for c in scatters] == [tokens * CONFIG.d_model * F32] * (CONFIG.layers * 4)
    assert all(c.group_size == 8 for c in scatters)
    reduces = [c for c in tp.detail if c.kind == "all-reduce"]
    assert reduces and max(c.bytes for c in reduces) <= 2 * tokens * F32


def _layer(m: nnx.Linear, x: jax.Array) -> jax.Array:
    return jnp.tanh(m(x))


LOOPS = {  # name: (step, the body's runs the planner counts)
    "fori_loop(2, 5)": (lambda m, x: jax.lax.fori_loop(2, 5, lambda i, y: _layer(m, y), x), 3),
    "steps of 3 below 10 (runs 4)": (
        lambda m, x: jax.lax.while_loop(
            lambda c: c[0] < 10, lambda c: (c[0] + 3, _layer(m, c[1])), (0, x)
        )[1],
        4,
    ),
    "a float doubling below 1000 (runs 10)": (
        lambda m, x: jax.lax.while_loop(
            lambda c: c[0] < 1000.0, lambda c: (c[0] * 2.0, _layer(m, c[1])), (1.0, x)
        )[1],
        1,
    ),
}


@pytest.mark.skipif(not has_tpu_compiler(), reason="needs the TPU compiler")
@pytest.mark.parametrize("name", list(LOOPS))
def test_the_tpu_compilers_loops_count_only_what_their_condition_and_counter_prove(name):
    """The TPU compiler writes no trip count. A loop ``i < N`` whose body steps an
    integer ``i`` by a constant ``c`` runs ``ceil((N - start) / c)`` times (4 for steps
    of 3 below 10); any other loop is counted once, never more than it runs (not 1000
    times for a float that doubles)."""
    step, counted = LOOPS[name]
    model = nnx.eval_shape(lambda: nnx.Linear(256, 256, use_bias=False, rngs=nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    (dp,) = nnx_sharding.plan(step, model, x, accelerator="v5e:2x4", layouts=["dp"])
    once = 2 * 64 * 256 * 256 / 8  # one iteration's matmul, its batch split 8 ways
    assert round(dp.flops / once) == counted, dp.flops / once


@pytest.mark.skipif(not has_tpu_compiler(), reason="needs the TPU compiler")
def test_the_tpu_compilers_convolution_matmuls_count_as_their_multiply_adds():
    """The TPU compiler writes batched matmuls and their gradients as convolutions with
    windows and padding; each counts the multiply-adds that read an input element."""
    from jax.experimental import topologies

    from nnx_sharding.plan._hardware.devices import compile_devices  # noqa: F401 - sets libtpu up

    device = topologies.get_topology_desc("v5e:2x4", "tpu").devices[0]
    one = jax.sharding.SingleDeviceSharding(device)
    b, s, d, h, k = 4, 16, 64, 8, 32

    def attention(x: jax.Array, w: jax.Array) -> jax.Array:
        q = jnp.einsum("bsd,dhk->bshk", x, w)  # a projection per head, as the decoder's
        scores = jnp.einsum("bshk,bthk->bhst", q, q)
        return jnp.sum(jnp.einsum("bhst,bthk->bshk", scores, q) ** 2)

    x = jax.ShapeDtypeStruct((b, s, d), jnp.float32, sharding=one)
    w = jax.ShapeDtypeStruct((d, h, k), jnp.float32, sharding=one)
    text = jax.jit(jax.grad(attention, argnums=(0, 1))).lower(x, w).compile().as_text()
    assert "convolution(" in text
    projection = 2 * b * s * d * h * k
    batched = 2 * b * h * s * s * k  # each: b·h batches of (s × k) @ (k × s)
    # forward: the projection and 2 batched matmuls; backward: 2 matmuls for each
    assert flops.dot_flops(text) == 3 * projection + 3 * 2 * batched
