"""Causal attention that never materialises the ``seq × seq`` scores, on every target.

Which kernel each target gets (``implementation='auto'``), found by compiling for the
compile-only devices the planner uses (no accelerator present):

- TPU: Pallas's splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``),
  in a ``shard_map`` over the batch and head axes as MaxText runs it: it compiles for
  compile-only TPUs (libtpu compiles the Mosaic kernel). It needs the sequence and the
  head dimension in multiples of 128; other shapes get the blockwise attention.
- GPU: cuDNN's fused attention (``jax.nn.dot_product_attention(implementation='cudnn')``)
  where it traces: on a GPU with cuDNN, in bfloat16 or float16. It does not trace for
  compile-only GPUs: jax checks the cuDNN library's version and the local GPU's compute
  capability while tracing, and raises without them. There Pallas's flash-attention
  kernel for GPUs (``jax.experimental.pallas.ops.gpu.attention``, Triton) is compiled
  in its place, for shapes it takes (`triton_attention`): the same algorithm, the same
  memory, and FLOPs the cost model counts as it counts cuDNN's. So a plan made with no
  GPU prices the step that runs on one with cuDNN, not the slower blockwise attention's
  (measured: docs/planning/predictions.md, "Measured on a GPU"). In float32, the
  blockwise attention below.
- CPU, and every shape the kernels above do not take: `blockwise_attention`, written in
  JAX: flash attention's algorithm, blocks of queries and keys, a running softmax, and a
  backward pass (``jax.custom_vjp``) that recomputes each block's probabilities from the
  saved log-sum-exp. It visits only the blocks on or below the diagonal, so its FLOPs
  are the causal count (plus the diagonal blocks' upper halves).

Each kernel names its output ``'context'`` once (``checkpoint_name``): splash and the
blockwise attention name their residuals, the output and its log-sum-exp, as MaxText
names splash's, so a remat policy that saves ``context`` keeps what their backward
passes need; cuDNN and Triton name their output (their own residuals carry no name,
so a policy that saves ``context`` still runs their forward kernel again). The caller
names nothing again: a second name on the output in the caller's layout would save a
second copy of it in every layer (docs/planning/predictions.md, "Host offload and long
context").
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from ... import _errors
from .activation_sharding import activation_spec

ATTENTION = ("auto", "blockwise", "splash", "cudnn", "triton")
"""The attention implementations a `DecoderConfig` may name."""
BLOCK = 512
"""The blockwise attention's block of queries and of keys (the largest divisor of the
sequence up to this)."""
_NEG = -0.7 * float(np.finfo(np.float32).max)


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, implementation: str = "auto"
) -> jax.Array:
    """Causal softmax attention of ``q`` (batch, seq, heads, head_dim) over ``k`` and
    ``v`` (batch, seq, kv_heads, head_dim; ``kv_heads`` divides ``heads``: grouped-query
    attention), scaled by ``1/sqrt(head_dim)``; the kernel as `attention_kernel` picks,
    its output named ``'context'`` (the module's docstring says how).

    >>> q = jnp.ones((1, 8, 4, 16)); kv = jnp.ones((1, 8, 2, 16))
    >>> causal_attention(q, kv, kv).shape
    (1, 8, 4, 16)
    """
    kernel = attention_kernel(implementation, q.shape[1], q.shape[-1], q.dtype)
    if kernel == "splash":
        return splash_attention(q, k, v)
    if kernel == "cudnn":
        try:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            return checkpoint_name(out, "context")
        except Exception:  # noqa: BLE001 - no GPU or cuDNN to trace for (compile-only)
            if implementation == "cudnn":
                raise
        kernel = "triton" if _triton_shapes(q.shape[1], q.shape[-1]) else "blockwise"
    if kernel == "triton":
        return checkpoint_name(triton_attention(q, k, v), "context")
    return blockwise_attention(q, k, v)


def attention_kernel(implementation: str, seq: int, head_dim: int, dtype: Any) -> str:
    """The kernel ``implementation`` gets for these shapes on the current target (the
    platform of the mesh set with ``jax.set_mesh``, else jax's default backend):
    ``'splash'``, ``'cudnn'`` (tried while tracing; where it does not trace, ``'triton'``
    for the shapes it takes, else ``'blockwise'``) or ``'blockwise'``.

    >>> attention_kernel('auto', 4096, 128, jnp.bfloat16)  # on the CPU
    'blockwise'
    """
    if implementation not in ATTENTION:
        raise ValueError(
            _errors.decoder_bad_choice("attention", "implementation", implementation, ATTENTION)
        )
    if implementation != "auto":
        return implementation
    platform = _platform()
    if platform == "tpu" and seq % 128 == 0 and head_dim % 128 == 0:
        return "splash"
    if platform in ("gpu", "cuda") and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "blockwise"


def _platform() -> str:
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


# --- Pallas splash attention (TPU) -----------------------------------------------------------


def splash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool = False
) -> jax.Array:
    """`attention` by Pallas's TPU splash kernel, batch and heads split over the mesh
    as the activations are (``activation_batch``, ``activation_heads``); ``interpret``
    runs the kernel in Pallas's interpreter (any backend: how it is tested)."""
    h = q.shape[2]
    spec = activation_spec(q.shape, ("activation_batch", None, "activation_heads", None))
    entries = (*(spec or ()), None, None, None, None)
    head_axes = entries[2]
    if head_axes is not None and k.shape[2] % (h // local_count(h, head_axes)):
        # kv heads that the heads' split does not divide: every query head gets its copy
        k, v = repeat_kv(k, v, h)
    local = functools.partial(splash_local, interpret=interpret)
    if spec is None:
        return local(q, k, v)
    part = P(entries[0], None, head_axes)
    return jax.shard_map(
        local, mesh=jax.sharding.get_abstract_mesh(), in_specs=(part, part, part),
        out_specs=part, check_vma=False,
    )(q, k, v)  # fmt: skip


def splash_blocks(seq: int) -> Any:
    """Splash attention's block sizes for a (per-device) query sequence of ``seq``: 512
    where it divides, else 128."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    block = 512 if seq % 512 == 0 else 128
    return sk.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip


def splash_local(q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Splash attention on one device's arrays (no mesh): the kernel `splash_attention`
    and the context-parallel Ulysses strategy run."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    s = q.shape[1]
    sizes = splash_blocks(s)
    mask = sm.MultiHeadMask([sm.CausalMask((s, s))] * q.shape[2])
    kernel = sk.make_splash_mha(
        mask,
        head_shards=1,
        q_seq_shards=1,
        block_sizes=sizes,
        interpret=interpret,
        residual_checkpoint_name="context",  # saved with the output by dots_with_context
    )
    return run_splash(kernel, q, k, v)


def run_splash(kernel: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """A splash ``kernel`` (`make_splash_mha`'s) over (batch, seq, heads, head_dim)
    arrays, a key and value per query head: the queries scaled (splash does not scale
    them), the heads put before the sequence, the batch mapped over."""
    q = q * jnp.asarray(1 / math.sqrt(q.shape[-1]), q.dtype)
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
    out: jax.Array = jax.vmap(kernel)(q, k, v)  # type: ignore[assignment]
    return jnp.swapaxes(out, 1, 2)


def local_count(n: int, axes: Any) -> int:
    """``n`` split over mesh ``axes`` (a name, a tuple of names or None) of the current
    mesh: the count on each device."""
    if axes is None:
        return n
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    return n // math.prod(sizes[a] for a in (axes if isinstance(axes, tuple) else (axes,)))


def repeat_kv(k: jax.Array, v: jax.Array, heads: int) -> tuple[jax.Array, jax.Array]:
    """Key and value (batch, seq, kv_heads, head_dim) repeated to ``heads`` heads, each
    kv head's copies beside it (grouped-query attention's groups): for kernels with no
    grouped-query form, and splits the kv heads do not divide."""
    if k.shape[2] == heads:
        return k, v
    return jnp.repeat(k, heads // k.shape[2], axis=2), jnp.repeat(v, heads // v.shape[2], axis=2)


# --- Pallas flash attention (GPU, Triton) --------------------------------------------------


def _triton_shapes(seq: int, head_dim: int) -> bool:
    """Shapes Pallas's GPU attention takes: a sequence of whole 128-blocks, a power-of-two
    head dimension of 64 to 256."""
    return seq % 128 == 0 and head_dim in (64, 128, 256)


def triton_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool = False
) -> jax.Array:
    """`attention` by Pallas's GPU flash-attention kernel (Triton), batch and heads
    split over the mesh as the activations are; ``interpret`` runs it in Pallas's
    interpreter (any backend: how it is tested). Key and value heads are repeated to
    the query heads (the kernel has no grouped-query form)."""
    spec = activation_spec(q.shape, ("activation_batch", None, "activation_heads", None))
    local = functools.partial(triton_local, interpret=interpret)
    if spec is None:
        return local(q, k, v)
    k, v = repeat_kv(k, v, q.shape[2])  # before the split, as the kernel's heads are
    return jax.shard_map(
        local, mesh=jax.sharding.get_abstract_mesh(), in_specs=(spec, spec, spec),
        out_specs=spec, check_vma=False,
    )(q, k, v)  # fmt: skip


def triton_local(q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Pallas's GPU attention on one device's arrays (no mesh), key and value heads
    repeated to the query heads."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    d = q.shape[3]
    k, v = repeat_kv(k, v, q.shape[2])
    out: jax.Array = gpu_attention.mha(
        q, k, v, segment_ids=None, sm_scale=1 / math.sqrt(d), causal=True, interpret=interpret,
    )  # fmt: skip
    return out


def local_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, kernel: str, *, interpret: bool = False
) -> jax.Array:
    """Causal attention on one device's arrays (no mesh) by ``kernel``, as
    `attention_kernel` names it (``'cudnn'`` falls back as `causal_attention` does);
    ``interpret``: Pallas's kernels in its interpreter."""
    if kernel == "splash":
        return splash_local(q, k, v, interpret=interpret)
    if kernel == "cudnn":
        try:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            return checkpoint_name(out, "context")
        except Exception:  # noqa: BLE001 - no GPU or cuDNN to trace for (compile-only)
            kernel = "triton" if _triton_shapes(q.shape[1], q.shape[-1]) else "blockwise"
    if kernel == "triton":
        return checkpoint_name(triton_local(q, k, v, interpret=interpret), "context")
    return blockwise_attention(q, k, v)


# --- blockwise attention in JAX (every target) ------------------------------------------------


def block_size(seq: int) -> int:
    """The blockwise attention's block for a sequence: its largest divisor up to `BLOCK`."""
    return max(b for b in range(1, min(BLOCK, seq) + 1) if seq % b == 0)


def causal_pairs(q_start: np.ndarray, k_start: np.ndarray, block: int) -> np.ndarray:
    """The (query block, key block) pairs a causal mask leaves work in: key block ``j``
    starts at or before query block ``i``'s last position; ``q_start`` and ``k_start``
    are the blocks' first positions in the whole sequence. Shape (pairs, 2), row by row.

    >>> causal_pairs(np.array([0, 2]), np.array([0, 2]), 2).tolist()
    [[0, 0], [1, 0], [1, 1]]
    """
    rows = [(i, j) for i in range(len(q_start)) for j in range(len(k_start))
            if k_start[j] <= q_start[i] + block - 1]  # fmt: skip
    return np.array(rows, np.int32).reshape(-1, 2)


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    b, s, h, d = q.shape
    return q.reshape(b, s, kv_heads, h // kv_heads, d)


def _scores(qi: jax.Array, kj: jax.Array, q0: jax.Array, k0: jax.Array) -> jax.Array:
    """Scaled, causally masked scores of a query block starting at position ``q0`` and a
    key block starting at ``k0``, float32, (batch, kv_heads, group, block, block)."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qi, kj, preferred_element_type=jnp.float32)
    s = s / math.sqrt(qi.shape[-1])
    rows = q0 + jnp.arange(qi.shape[1])[:, None]
    cols = k0 + jnp.arange(kj.shape[1])[None, :]
    return jnp.where(cols <= rows, s, _NEG)


def _slice(x: jax.Array, index: jax.Array, block: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis)


def _put(x: jax.Array, update: jax.Array, index: jax.Array, block: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, update.astype(x.dtype), index * block, axis)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """`attention` in blocks of queries and keys (flash attention's algorithm in JAX):
    memory linear in the sequence, the backward pass recomputing each block.

    >>> q, k = jnp.ones((1, 6, 2, 4)), jnp.ones((1, 6, 1, 4))
    >>> ref = jax.nn.dot_product_attention(q, k, k, is_causal=True)
    >>> bool(jnp.allclose(blockwise_attention(q, k, k), ref))
    True
    """
    block = block_size(q.shape[1])
    start = np.arange(0, q.shape[1], block, dtype=np.int32)
    return flash(q, k, v, jnp.asarray(start), jnp.asarray(start),
                 jnp.asarray(causal_pairs(start, start, block)), block)  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def flash(
    q: jax.Array, k: jax.Array, v: jax.Array, q_start: jax.Array, k_start: jax.Array,
    pairs: jax.Array, block: int,
) -> jax.Array:  # fmt: skip
    """Causal attention of ``q`` over ``k`` and ``v`` whose blocks of ``block`` start at
    the positions ``q_start`` and ``k_start`` (int32, one per block: any order, as a
    context-parallel device holds them), visiting only ``pairs`` (`causal_pairs`): the
    blockwise attention's kernel, for any layout of the sequence."""
    return flash_forward(q, k, v, q_start, k_start, pairs, block)[0]


def flash_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, q_start: jax.Array, k_start: jax.Array,
    pairs: jax.Array, block: int,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """`flash`'s output and its log-sum-exp (batch, kv_heads, group, seq), float32; a
    query no pair reaches gets 0 and a log-sum-exp of ``_NEG`` (it attends to nothing
    here: how a ring step's partial result merges)."""
    b, s, h, d = q.shape
    kvh = k.shape[2]
    qg = _grouped(q, kvh)
    o = jnp.zeros(qg.shape, jnp.float32)  # (b, s, kvh, g, d)
    m = jnp.full((b, kvh, h // kvh, s), _NEG, jnp.float32)
    t0 = jnp.zeros_like(m)  # the running sum of exponentials

    def step(carry: Any, ij: jax.Array) -> tuple[Any, None]:
        o, m, total = carry
        i, j = ij[0], ij[1]
        sc = _scores(_slice(qg, i, block, 1), _slice(k, j, block, 1), q_start[i], k_start[j])
        m_old, t_old = _slice(m, i, block, 3), _slice(total, i, block, 3)
        m_new = jnp.maximum(m_old, sc.max(-1))
        p = jnp.exp(sc - m_new[..., None])
        alpha = jnp.exp(m_old - m_new)
        pv = jnp.einsum(
            "bhgqk,bkhd->bqhgd", p.astype(v.dtype), _slice(v, j, block, 1),
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        scale = jnp.moveaxis(alpha, 3, 1)[..., None]  # (b, q, kvh, g, 1)
        o = _put(o, _slice(o, i, block, 1) * scale + pv, i, block, 1)
        m = _put(m, m_new, i, block, 3)
        total = _put(total, t_old * alpha + p.sum(-1), i, block, 3)
        return (o, m, total), None

    (o, m, total), _ = jax.lax.scan(step, (o, m, t0), pairs)
    empty = total == 0
    total = jnp.where(empty, 1.0, total)
    o = o / jnp.moveaxis(total, 3, 1)[..., None]
    lse = jnp.where(empty, _NEG, m + jnp.log(total))
    return o.reshape(b, s, h, d).astype(q.dtype), lse


def flash_backward(
    res: tuple[Any, ...], do: jax.Array, dlse: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gradients of `flash`'s ``q``, ``k`` and ``v`` from the output's cotangent
    ``do`` (and the log-sum-exp's, ``dlse``), given ``res``: ``(q, k, v, out, lse,
    q_start, k_start, pairs, block)`` with ``out`` and ``lse`` those of the whole
    attention (a ring step's gradients use the final ones)."""
    q, k, v, out, lse, q_start, k_start, pairs = res[:8]
    block: int = res[8]
    b, s, h, d = q.shape
    kvh = k.shape[2]
    qg, og, dog = (_grouped(t, kvh) for t in (q, out, do))
    # D_i = rowsum(dO ∘ O): the softmax's correction, (b, kvh, g, s); minus the
    # log-sum-exp's cotangent (d lse / d s = p)
    delta = jnp.moveaxis(jnp.sum(dog.astype(jnp.float32) * og.astype(jnp.float32), -1), 1, 3)
    if dlse is not None:
        delta = delta - dlse
    dq = jnp.zeros(qg.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)

    def step(carry: Any, ij: jax.Array) -> tuple[Any, None]:
        dq, dk, dv = carry
        i, j = ij[0], ij[1]
        qi, doi = _slice(qg, i, block, 1), _slice(dog, i, block, 1)
        kj, vj = _slice(k, j, block, 1), _slice(v, j, block, 1)
        p = jnp.exp(_scores(qi, kj, q_start[i], k_start[j]) - _slice(lse, i, block, 3)[..., None])
        f32 = {"preferred_element_type": jnp.float32}
        dvj = jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do.dtype), doi, **f32)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", doi, vj, **f32)
        ds = p * (dp - _slice(delta, i, block, 3)[..., None]) / math.sqrt(d)
        dqi = jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(q.dtype), kj, **f32)
        dkj = jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), qi, **f32)
        dq = _put(dq, _slice(dq, i, block, 1) + dqi, i, block, 1)
        dk = _put(dk, _slice(dk, j, block, 1) + dkj, j, block, 1)
        dv = _put(dv, _slice(dv, j, block, 1) + dvj, j, block, 1)
        return (dq, dk, dv), None

    (dq, dk, dv), _ = jax.lax.scan(step, (dq, dk, dv), pairs)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _fwd(
    q: jax.Array, k: jax.Array, v: jax.Array, q_start: jax.Array, k_start: jax.Array,
    pairs: jax.Array, block: int,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:  # fmt: skip
    out, lse = flash_forward(q, k, v, q_start, k_start, pairs, block)
    # named as splash's residuals are in MaxText: a remat policy that saves the
    # attention's output ('context') keeps what the backward pass needs with it
    out, lse = checkpoint_name(out, "context"), checkpoint_name(lse, "context")
    return out, (q, k, v, out, lse, q_start, k_start, pairs)


def _bwd(block: int, res: tuple[jax.Array, ...], do: jax.Array) -> tuple[Any, ...]:
    dq, dk, dv = flash_backward((*res, block), do)
    return dq, dk, dv, None, None, None


flash.defvjp(_fwd, _bwd)
