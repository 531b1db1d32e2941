"""The planner's decoder-only transformer: its configs, layers, loss and training step.

``python -m nnx_sharding plan`` and ``python -m nnx_sharding aot`` build this model with
``nnx.eval_shape`` (never allocated) and compile its training step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The sizes of a decoder-only transformer and of the batch of one training step.

    >>> CONFIGS['1b'].param_count()
    1037117440
    """

    name: str
    vocab: int
    d_model: int
    heads: int
    head_dim: int
    mlp: int
    layers: int
    batch: int
    seq_len: int
    dtype: str = "float32"
    scan: bool = False
    """Stack the layers' weights and run them with ``jax.lax.scan``: compilers then build
    one layer, not ``layers`` of them (what ``python -m nnx_sharding plan`` compiles)."""

    def param_count(self) -> int:
        """Parameters, counted from the sizes (embedding, blocks, final norm, head)."""
        block = 4 * self.d_model * self.heads * self.head_dim + 2 * self.d_model * self.mlp
        block += 2 * self.d_model  # the two norm scales
        return 2 * self.vocab * self.d_model + self.layers * block + self.d_model


CONFIGS: dict[str, DecoderConfig] = {
    c.name: c
    for c in (
        DecoderConfig("tiny", 512, 128, 4, 32, 512, 2, batch=8, seq_len=64),
        DecoderConfig("1b", 32000, 2048, 16, 128, 8192, 18, batch=8, seq_len=512),
        DecoderConfig("1b-wide", 32000, 4096, 32, 128, 16384, 4, batch=8, seq_len=512),
    )
}
"""The named configs: ``tiny`` (docs, tests), ``1b`` (1.04B parameters, 18 layers of
width 2048) and ``1b-wide`` (1.07B, 4 layers of width 4096: compiles several times faster)."""

LOGICAL_AXES = {
    "batch": "data",
    "embed": "data",
    "heads": "model",
    "mlp": "model",
    "vocab": "model",
}
"""Logical axis -> mesh axis: FSDP shards the ``embed`` dimension of every matrix over
``data`` (and the batch with it), tensor parallelism splits heads, MLP units and the
vocabulary over ``model``."""


def _param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    names: tuple[str | None, ...],
    dtype: Any,
    *,
    norm: bool = False,
):
    init = nnx.initializers.ones if norm else nnx.initializers.normal(0.02)
    # logical axis names, mapped to mesh axes by `shard` (`abstract_model`)
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, dtype))


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _block_shapes(c: DecoderConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """A block's weights: their shapes and logical axis names."""
    d, h, k, f = c.d_model, c.heads, c.head_dim, c.mlp
    qkv = ((d, h, k), ("embed", "heads", None))
    return {
        "attn_norm": ((d,), (None,)),
        "wq": qkv,
        "wk": qkv,
        "wv": qkv,
        "wo": ((h, k, d), ("heads", None, "embed")),
        "mlp_norm": ((d,), (None,)),
        "up": ((d, f), ("embed", "mlp")),
        "down": ((f, d), ("mlp", "embed")),
    }


def _block(x: jax.Array, w: Mapping[str, jax.Array]) -> jax.Array:
    h = _rms_norm(x, w["attn_norm"])
    q, k, v = (jnp.einsum("bsd,dhk->bshk", h, w[name]) for name in ("wq", "wk", "wv"))
    scores = jnp.einsum("bshk,bthk->bhst", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones(scores.shape[-2:], dtype=bool))
    attn = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(scores.dtype).min), axis=-1)
    x = x + jnp.einsum("bhst,bthk,hkd->bsd", attn, v, w["wo"])
    h = _rms_norm(x, w["mlp_norm"])
    return x + jax.nn.gelu(h @ w["up"]) @ w["down"]


def _batch_parallel(x: jax.Array) -> jax.Array:
    """``x`` with its batch split over the data-parallel axes of the mesh set (``data``,
    ``fsdp``; unchanged without them): a loop's carried activations would otherwise take
    whatever sharding the compiler's propagation picks from the weights."""
    axes = tuple(a for a in ("data", "fsdp") if a in jax.sharding.get_abstract_mesh().axis_names)
    return jax.lax.with_sharding_constraint(x, P(axes)) if axes else x


class Block(nnx.Module):
    """Pre-norm causal self-attention and a GELU MLP, each around a residual. With
    ``stack=L``, the weights of L such blocks, stacked on a leading (unsharded) axis."""

    def __init__(self, c: DecoderConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        for name, (shape, names) in _block_shapes(c).items():
            if stack is not None:
                shape, names = (stack, *shape), (None, *names)
            setattr(self, name, _param(rngs, shape, names, c.dtype, norm=name.endswith("norm")))

    def weights(self) -> dict[str, jax.Array]:
        """The weights' values by name."""
        return {name: p[...] for name, p in vars(self).items() if isinstance(p, nnx.Param)}

    def __call__(self, x: jax.Array) -> jax.Array:
        return _block(x, self.weights())


class Decoder(nnx.Module):
    """A decoder-only transformer (no positional encoding: a model for sizing).

    >>> with nnx.use_eager_sharding(False):
    ...     model = nnx.eval_shape(lambda: Decoder(CONFIGS['tiny'], rngs=nnx.Rngs(0)))
    >>> tokens = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    >>> nnx.eval_shape(lambda m, t: m(t), model, tokens).shape
    (2, 5, 512)
    """

    def __init__(self, c: DecoderConfig, *, rngs: nnx.Rngs):
        self.embed = _param(rngs, (c.vocab, c.d_model), ("vocab", "embed"), c.dtype)
        self.scan = c.scan
        self.layers: Block | nnx.List[Block]  # one Block of stacked weights when scanned
        if c.scan:
            self.layers = Block(c, rngs=rngs, stack=c.layers)
        else:
            self.layers = nnx.List([Block(c, rngs=rngs) for _ in range(c.layers)])
        self.final_norm = _param(rngs, (c.d_model,), (None,), c.dtype, norm=True)
        self.head = _param(rngs, (c.d_model, c.vocab), ("embed", "vocab"), c.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed[...][tokens]
        layers = self.layers
        if isinstance(layers, Block):  # scanned (``self.scan``)
            body = lambda x, w: (_batch_parallel(_block(x, w)), None)  # noqa: E731
            x, _ = jax.lax.scan(body, _batch_parallel(x), layers.weights())
        else:
            for block in layers:
                x = block(x)
        return _rms_norm(x, self.final_norm[...]) @ self.head[...]


def loss_fn(model: Decoder, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy over ``tokens`` of shape ``(batch, seq_len + 1)``."""
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def train_step(model: Decoder, tokens: jax.Array, learning_rate: float = 1e-3) -> jax.Array:
    """One SGD step on the loss, in place; returns the loss."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - learning_rate * g, params, grads))
    return loss
