"""Context parallelism: causal attention with the sequence split over the ``context`` axis.

Three strategies, as MaxText names them (``context_parallel_strategy``):

- ``all_gather`` (MaxText's default): each device gathers every key and value over
  ``context`` and attends with its own queries; the gradients of the keys and values
  are reduce-scattered back (the all-gather's transpose).
- ``ring``: keys and values go round the ``context`` ring with ``jax.lax.ppermute``,
  one device's worth a step; each step's block attention overlaps the next transfer, and
  no device ever holds more than two devices' keys and values. The backward pass sends
  the keys and values round again with their gradients travelling beside them.
- ``ulysses``: an all-to-all trades the sequence split for a split of the heads, each
  device attends over the whole sequence for its heads with the target's kernel
  (`attention_kernel`), and a second all-to-all trades back. The heads on each device
  must divide by the context axis.

Causal work is balanced for ``all_gather`` and ``ring`` (MaxText's
``context_parallel_load_balance``): the decoder lays the sequence out so that device
``i`` of ``C`` holds chunks ``i`` and ``2C-1-i`` of ``2C`` (`sequence_order`), and every
device then has the same number of unmasked blocks. On TPUs ``all_gather`` runs splash
attention with that layout's causal mask (MaxText's ``LoadBalancedCausalMask``: each
query at its position, split over ``context``); ``ulysses`` runs the target's own kernel
over the whole sequence (splash on TPUs, cuDNN or Pallas's Triton kernel on GPUs).
Elsewhere, and always for ``ring``, they run the blockwise attention (`flash`), whose
blocks can start at any position: on TPUs the compiler stashes its causal masks in a
buffer as long as the loop, so a ``ring`` plan there is priced far above what a ring
kernel would take (MaxText's ring on TPUs is Tokamax's kernel, which jax does not ship).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from ... import _errors
from .activation_sharding import activation_spec, place
from .attention import (
    attention_kernel,
    block_size,
    causal_attention,
    causal_pairs,
    flash,
    flash_backward,
    flash_forward,
    local_attention,
    local_count,
    repeat_kv,
    run_splash,
    splash_blocks,
)

CONTEXT = "context"
"""Context parallelism's mesh axis: the sequence split over it."""
CONTEXT_STRATEGIES = ("all_gather", "ulysses", "ring")
"""The context-parallel attention strategies (MaxText's names)."""
_BALANCED = ("all_gather", "ring")


def context_size() -> int:
    """The ``context`` axis's size on the mesh set with ``jax.set_mesh``; 1 without one.

    >>> context_size()
    1
    """
    return int(jax.sharding.get_abstract_mesh().shape.get(CONTEXT, 1))


def sequence_order(seq: int, strategy: str, parts: int | None = None) -> np.ndarray | None:
    """The positions in the order the devices of the ``context`` axis hold them (device
    ``i`` of ``C``: chunks ``i`` and ``2C-1-i`` of ``2C``, for ``all_gather`` and ``ring``,
    load-balanced), or None where the order is the natural one (no context split, or
    ``ulysses``). ``parts``: the context axis's size (default: `context_size`).

    Raises:
      ValueError: the sequence does not split into the chunks the strategy needs.

    >>> sequence_order(8, 'ring', parts=2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    check_strategy(strategy, seq, parts)
    parts = context_size() if parts is None else parts
    if parts == 1 or strategy not in _BALANCED:
        return None
    chunk = seq // (2 * parts)
    order = [c for i in range(parts) for c in (i, 2 * parts - 1 - i)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in order])


def reorder(x: jax.Array, order: np.ndarray) -> jax.Array:
    """``x[:, order]`` (a permutation of the sequence axis), on Explicit axes too (there
    ``x`` is first gathered along the sequence: the gather's layout is otherwise
    ambiguous).

    >>> reorder(jnp.arange(4)[None], np.array([2, 3, 0, 1])).tolist()
    [[2, 3, 0, 1]]
    """
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and all(t == AxisType.Explicit for t in mesh.axis_types):
        spec = (*jax.typeof(x).sharding.spec, None, None)
        x = jax.sharding.reshard(x, P(spec[0], None, *spec[2 : x.ndim]))
    return x[:, order]


def check_strategy(strategy: str, seq: int, parts: int | None = None) -> None:
    """Raises a ValueError unless ``strategy`` is one of `CONTEXT_STRATEGIES` and the
    sequence splits as it needs over ``parts`` devices (default: `context_size`)."""
    if strategy not in CONTEXT_STRATEGIES:
        raise ValueError(
            _errors.decoder_bad_choice(
                "DecoderConfig", "context_strategy", strategy, CONTEXT_STRATEGIES
            )  # fmt: skip
        )
    parts = context_size() if parts is None else parts
    chunks = parts * (2 if strategy in _BALANCED else 1)
    if parts > 1 and seq % chunks:
        raise ValueError(_errors.context_bad_seq(strategy, seq, parts, chunks))


def context_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, context_strategy: str = "all_gather",
    implementation: str = "auto", *, interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """Causal attention (`causal_attention`'s contract) of a sequence split over the
    ``context`` axis of the mesh set with ``jax.set_mesh``, by ``context_strategy`` (one
    of `CONTEXT_STRATEGIES`), the sequence in `sequence_order`; without a context split,
    `causal_attention` (``implementation``: its kernel, as there). On TPUs ``all_gather``
    runs splash attention with a load-balanced causal mask (as MaxText does) and
    ``ulysses`` splash over the whole sequence; ``interpret`` runs splash in Pallas's
    interpreter (any backend: how it is tested). The output is named ``'context'`` once,
    by the kernel or the ring, as `causal_attention`'s is.

    Raises:
      ValueError: an unknown strategy, a sequence the strategy cannot split, or (for
        ``ulysses``) heads per device that the context axis does not divide.

    >>> q = jnp.ones((1, 8, 4, 16)); kv = jnp.ones((1, 8, 2, 16))
    >>> context_attention(q, kv, kv, 'ring').shape  # no mesh: no split
    (1, 8, 4, 16)
    """
    strategy = context_strategy
    seq, heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    check_strategy(strategy, seq)
    parts = context_size()
    if parts == 1:
        return causal_attention(q, k, v, implementation)
    names = ("activation_batch", "activation_length", "activation_heads", None)
    spec = activation_spec(q.shape, names) or P()
    kv_spec = activation_spec(k.shape, (*names[:2], "activation_kv_heads", None)) or P()
    if _heads_axes(spec) != _heads_axes(kv_spec):  # kv heads the head split does not divide
        k, v = repeat_kv(k, v, heads)
        kv_spec = spec
    kernel = attention_kernel(implementation, seq, head_dim, q.dtype)
    extra: tuple[Any, ...] = ()
    splash: Any = None
    if strategy == "ulysses":
        local_heads = local_count(heads, _heads_axes(spec))
        if local_heads % parts:
            raise ValueError(_errors.context_ulysses_heads(heads, local_heads, parts))
        local: Any = functools.partial(_ulysses, parts=parts, kernel=kernel,
                                       interpret=interpret)  # fmt: skip
    elif strategy == "all_gather" and kernel == "splash" and (seq // parts) % 128 == 0:
        heads_here = local_count(heads, _heads_axes(spec))
        splash, extra = _balanced_splash(seq, parts, heads_here, interpret)
        natural = np.argsort(np.asarray(sequence_order(seq, strategy, parts)))
        local = functools.partial(_all_gather_splash, natural)
    else:
        static = (seq, parts, block_size(seq // (2 * parts)))
        local = functools.partial(_all_gather if strategy == "all_gather" else _ring, static)

    @jax.jit  # inlined when traced; called eagerly, the arrays are placed on the mesh
    def run(q: jax.Array, k: jax.Array, v: jax.Array, *extra: Any) -> jax.Array:
        q, k, v = place(q, spec), place(k, kv_spec), place(v, kv_spec)
        return jax.shard_map(
            local, mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(spec, kv_spec, kv_spec, *extra_specs), out_specs=spec, check_vma=False,
        )(q, k, v, *extra)  # fmt: skip

    extra_specs: tuple[Any, ...] = (splash,) if extra else ()
    return run(q, k, v, *extra)


def _heads_axes(spec: Any) -> Any:
    entries = (*(spec or ()), None, None, None)
    return entries[2]


# --- the load-balanced layout's blocks ------------------------------------------------------


@functools.cache
def _tables(seq: int, parts: int, block: int) -> dict[str, Any]:
    """Static tables of the load-balanced layout, indexed by device (and ring step):
    each device's block starts, and the pairs of blocks with work in them."""
    order = sequence_order(seq, "all_gather", parts)
    assert order is not None
    local = seq // parts
    starts = order[::block].reshape(parts, local // block).astype(np.int32)  # per device
    gathered = starts.reshape(-1)
    pairs = np.stack([causal_pairs(starts[i], gathered, block) for i in range(parts)])
    ring = []  # step t: device i holds device (i - t)'s keys and values
    for t in range(parts):
        rows = [causal_pairs(starts[i], starts[(i - t) % parts], block) for i in range(parts)]
        ring.append(np.stack(rows))  # the same count on every device: balanced
    return {"block": block, "starts": starts, "gathered": gathered, "pairs": pairs, "ring": ring}


def _mine(table: np.ndarray) -> jax.Array:
    """This device's row of a table indexed by the context axis."""
    return jnp.asarray(table)[jax.lax.axis_index(CONTEXT)]


# --- the strategies, on one device's arrays (inside shard_map) --------------------------------


def _all_gather(
    static: tuple[int, int, int], q: jax.Array, k: jax.Array, v: jax.Array
) -> jax.Array:
    tables = _tables(*static)
    k, v = (jax.lax.all_gather(t, CONTEXT, axis=1, tiled=True) for t in (k, v))
    starts, gathered = _mine(tables["starts"]), jnp.asarray(tables["gathered"])
    return flash(q, k, v, starts, gathered, _mine(tables["pairs"]), tables["block"])


def _balanced_splash(
    seq: int, parts: int, heads: int, interpret: bool
) -> tuple[Any, tuple[Any, ...]]:
    """Splash's kernel for the load-balanced layout (MaxText's ``LoadBalancedCausalMask``):
    the causal mask of the queries at `sequence_order`'s positions over the keys in order,
    split over ``context`` by query; (its shard_map spec, (the kernel,))."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.CausalMask((seq, seq))
    order = sequence_order(seq, "all_gather", parts)
    assert order is not None
    mask.q_sequence = order.astype(np.int32)  # each query's position in the sequence
    kernel = sk.make_splash_mha(
        sm.MultiHeadMask([mask] * heads), head_shards=1, q_seq_shards=parts,
        block_sizes=splash_blocks(seq // parts), residual_checkpoint_name="context",
        interpret=interpret,
    )  # fmt: skip
    sharding = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), P(None, CONTEXT))
    return kernel.manual_sharding_spec(sharding), (kernel,)


def _all_gather_splash(
    natural: np.ndarray, q: jax.Array, k: jax.Array, v: jax.Array, kernel: Any
) -> jax.Array:
    """All-gather with splash: the gathered keys and values put back in order (the
    devices hold them load-balanced), this device's queries against them."""
    k, v = (jax.lax.all_gather(t, CONTEXT, axis=1, tiled=True)[:, natural] for t in (k, v))
    k, v = repeat_kv(k, v, q.shape[2])  # splash's multi-head form: a key and value per head
    return run_splash(kernel, q, k, v)


def _ulysses(
    q: jax.Array, k: jax.Array, v: jax.Array, *, parts: int, kernel: str, interpret: bool
) -> jax.Array:
    if k.shape[2] % parts:  # kv heads the context axis does not divide: one per query head
        k, v = repeat_kv(k, v, q.shape[2])
    # the sequence split traded for a head split, attention, and back
    q, k, v = (jax.lax.all_to_all(t, CONTEXT, 2, 1, tiled=True) for t in (q, k, v))
    out = local_attention(q, k, v, kernel, interpret=interpret)
    return jax.lax.all_to_all(out, CONTEXT, 1, 2, tiled=True)


def _shift(x: Any, parts: int) -> Any:
    """``x`` passed one step round the ring (device ``i`` to ``i + 1``)."""
    perm = [(i, (i + 1) % parts) for i in range(parts)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, CONTEXT, perm), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(static: tuple[int, int, int], q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return _ring_forward(static, q, k, v)[0]


def _ring_forward(
    static: tuple[int, int, int], q: jax.Array, k: jax.Array, v: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    tables, parts, block = _tables(*static), static[1], static[2]
    mine = jax.lax.axis_index(CONTEXT)
    starts = jnp.asarray(tables["starts"])
    out = jnp.zeros(q.shape, jnp.float32)
    lse = jnp.zeros((), jnp.float32)
    kv = (k, v)
    for t in range(parts):
        nxt = _shift(kv, parts) if t < parts - 1 else kv  # sent while this step computes
        src = (mine - t) % parts
        pairs = _mine(tables["ring"][t])
        o_t, lse_t = flash_forward(q, *kv, starts[mine], starts[src], pairs, block)
        if t == 0:
            out, lse = o_t.astype(jnp.float32), lse_t
        else:  # the two partial softmaxes merged by their log-sum-exps
            new = jnp.logaddexp(lse, lse_t)
            out = out * _per_query(jnp.exp(lse - new)) + o_t * _per_query(jnp.exp(lse_t - new))
            lse = new
        kv = nxt
    # named as the kernels' residuals are (attention.py): saved by the 'context' policies
    out = checkpoint_name(out.astype(q.dtype), "context")
    lse = checkpoint_name(lse, "context")
    return out, (q, k, v, out, lse)


def _per_query(w: jax.Array) -> jax.Array:
    """A (batch, kv_heads, group, seq) weight as (batch, seq, heads, 1)."""
    b, kvh, g, s = w.shape
    return jnp.moveaxis(w, 3, 1).reshape(b, s, kvh * g, 1)


def _ring_backward(
    static: tuple[int, int, int], res: tuple[jax.Array, ...], do: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    tables, parts, block = _tables(*static), static[1], static[2]
    q, k, v, out, lse = res
    mine = jax.lax.axis_index(CONTEXT)
    starts = jnp.asarray(tables["starts"])
    dq = jnp.zeros(q.shape, jnp.float32)
    kv = (k, v)
    grads = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for t in range(parts):
        nxt = _shift(kv, parts) if t < parts - 1 else kv  # sent while this step computes
        src = (mine - t) % parts
        res_t = (q, *kv, out, lse, starts[mine], starts[src], _mine(tables["ring"][t]), block)
        dq_t, dk_t, dv_t = flash_backward(res_t, do)
        dq = dq + dq_t
        # the keys' gradients travel with the keys, and the last step brings them home
        grads = _shift((grads[0] + dk_t, grads[1] + dv_t), parts)
        kv = nxt
    return dq.astype(q.dtype), grads[0].astype(k.dtype), grads[1].astype(v.dtype)


_ring.defvjp(_ring_forward, _ring_backward)
