"""The planner's decoder-only transformer: its configs, layers, loss and training step.

A decoder as people train them today: RMSNorm, rotary position embeddings, a SwiGLU
(gated, three matrices), plain two-matrix or mixture-of-experts MLP
(`nnx_sharding.moe`: top-k routed SwiGLU experts), grouped-query attention (``kv_heads``),
optional tied embeddings, attention and MLP in sequence or in parallel off one norm,
float32 parameters with bfloat16 compute. Its layers are stacked and scanned
(``nnx.scan``), each rematerialized by a named policy (``nnx.remat``, `REMAT_POLICIES`).
Attention never materialises the ``seq × seq`` scores (`attention`). Parameters carry
logical axis names (`DECODER_RULES` binds them), activations logical activation names
(`ACTIVATION_RULES`). ``python -m nnx_sharding plan`` and ``python -m nnx_sharding aot``
build it with ``nnx.eval_shape`` (never allocated) and compile its training step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ..._moe import NAMES as MOE_NAMES
from ..._moe import moe, moe_shapes
from ..._pipeline import pipeline, stage_count
from .activation_sharding import constrain_activation as constrain
from .configs import ACTIVATIONS, DecoderConfig
from .context_parallel import context_attention, reorder, sequence_order
from .remat import remat_policy

RESIDUAL = ("activation_batch", "activation_length", "activation_embed")


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...], dtype: Any,
           *, norm: bool = False) -> nnx.Param[jax.Array]:  # fmt: skip
    init = nnx.initializers.ones if norm else nnx.initializers.normal(0.02)
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, dtype))


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, the result in ``x``'s dtype."""
    y = x.astype(jnp.float32)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(positions: Any, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """The rotary embedding's cosines and sines at ``positions`` (the sequence's order as
    the devices hold it), (seq, head_dim / 2) float32."""
    inv = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.asarray(positions, jnp.float32)[:, None] * inv[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """``x`` (batch, seq, heads, head_dim) rotated by position (the two halves of the
    head dimension as the pairs)."""
    cos, sin = (t[None, :, None, :] for t in rope)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _block_shapes(c: DecoderConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """A block's weights: their shapes and logical axis names."""
    d, h, k, f = c.d_model, c.heads, c.head_dim, c.mlp
    kv = ((d, c.kv, k), ("embed", "heads" if c.kv == h else "kv_heads", None))
    shapes: dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]] = {
        "attn_norm": ((d,), (None,)),
        "wq": ((d, h, k), ("embed", "heads", None)),
    }
    shapes |= {"wk": kv, "wv": kv, "wo": ((h, k, d), ("heads", None, "embed"))}
    if not c.parallel_block:
        shapes["mlp_norm"] = ((d,), (None,))
    if c.experts:  # a mixture of experts: `nnx_sharding.MoE`'s weights and names
        moe = moe_shapes(d, c.experts, c.moe_mlp, c.shared_experts)
        return shapes | {n: (shape, MOE_NAMES[n]) for n, shape in moe.items()}
    if c.gated:
        shapes["gate"] = ((d, f), ("embed", "mlp"))
    return shapes | {"up": ((d, f), ("embed", "mlp")), "down": ((f, d), ("mlp", "embed"))}


def _attention(c: DecoderConfig, h: jax.Array, w: dict[str, jax.Array], rope: Any) -> jax.Array:
    heads = ("activation_batch", "activation_length", "activation_heads", None)
    kv_heads = ("activation_batch", "activation_length", "activation_kv_heads", None)
    q = checkpoint_name(jnp.einsum("bsd,dhk->bshk", h, w["wq"]), "query_proj")
    k = checkpoint_name(jnp.einsum("bsd,dhk->bshk", h, w["wk"]), "key_proj")
    v = checkpoint_name(jnp.einsum("bsd,dhk->bshk", h, w["wv"]), "value_proj")
    q, k, v = constrain(q, heads), constrain(k, kv_heads), constrain(v, kv_heads)
    out = context_attention(_rotate(q, rope), _rotate(k, rope), v, c.context_strategy,
                            c.attention)  # fmt: skip
    out = constrain(out, heads)  # named 'context' by the kernel (attention.py)
    return checkpoint_name(jnp.einsum("bshk,hkd->bsd", out, w["wo"]), "out_proj")


def _mlp(c: DecoderConfig, h: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    if c.experts:  # the router's loss is left out: see DecoderConfig.experts
        weights = {n: w[n] for n in MOE_NAMES if n in w}
        y, _ = moe(h, weights, c.experts_per_token, capacity_factor=c.capacity_factor,
                   activation=ACTIVATIONS[c.activation])  # fmt: skip
        return y
    a = ACTIVATIONS[c.activation](checkpoint_name(h @ w["gate" if c.gated else "up"], "mlpwi_0"))
    if c.gated:
        a = a * checkpoint_name(h @ w["up"], "mlpwi_1")
    a = constrain(a, ("activation_batch", "activation_length", "activation_mlp"))
    return checkpoint_name(a @ w["down"], "mlpwo")


def _block(c: DecoderConfig, x: jax.Array, w: dict[str, jax.Array], rope: Any) -> jax.Array:
    """One layer on the residual stream ``x`` (batch, seq, d_model)."""
    dtype = jnp.dtype(c.compute_dtype)
    w = {n: a if n.endswith("norm") else a.astype(dtype) for n, a in w.items()}
    x = checkpoint_name(x, "decoder_layer_input")
    h = _rms_norm(x, w["attn_norm"], c.norm_eps)
    if c.parallel_block:
        x = x + _attention(c, h, w, rope) + _mlp(c, h, w)
    else:
        x = constrain(x + _attention(c, h, w, rope), RESIDUAL)
        x = x + _mlp(c, _rms_norm(x, w["mlp_norm"], c.norm_eps), w)
    return constrain(x, RESIDUAL)


class Block(nnx.Module):
    """One layer: attention and an MLP around the residual stream. With ``stack=L``,
    the weights of L such layers, stacked on a leading axis named ``layers`` (split
    over ``stage`` by `DECODER_RULES` under pipeline parallelism)."""

    def __init__(self, c: DecoderConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        self.config = c
        for name, (shape, names) in _block_shapes(c).items():
            if stack is not None:
                shape, names = (stack, *shape), ("layers", *names)
            norm = name.endswith("norm")
            setattr(self, name, _param(rngs, shape, names, c.param_dtype, norm=norm))

    def weights(self) -> dict[str, jax.Array]:
        """The weights' values by name."""
        return {name: p[...] for name, p in vars(self).items() if isinstance(p, nnx.Param)}

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
        return _block(self.config, x, self.weights(), rope)


class Decoder(nnx.Module):
    """A decoder-only transformer; ``model(tokens)`` gives the logits.

    >>> from nnx_sharding.plan import DECODER_CONFIGS
    >>> with nnx.use_eager_sharding(False):
    ...     model = nnx.eval_shape(lambda: Decoder(DECODER_CONFIGS['tiny'], rngs=nnx.Rngs(0)))
    >>> tokens = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    >>> nnx.eval_shape(lambda m, t: m(t), model, tokens).shape
    (2, 5, 512)
    """

    config: DecoderConfig
    embed: nnx.Param[jax.Array]
    layers: Block | nnx.List[Block]  # one Block of stacked weights when scanned
    final_norm: nnx.Param[jax.Array]
    head: nnx.Param[jax.Array]  # absent with tied embeddings

    def __init__(self, c: DecoderConfig, *, rngs: nnx.Rngs):
        self.config = c
        self.embed = _param(rngs, (c.vocab, c.d_model), ("vocab", "embed"), c.param_dtype)
        if c.scan:
            self.layers = Block(c, rngs=rngs, stack=c.layers)
        else:
            self.layers = nnx.List([Block(c, rngs=rngs) for _ in range(c.layers)])
        self.final_norm = _param(rngs, (c.d_model,), (None,), c.param_dtype, norm=True)
        if not c.tied:
            self.head = _param(rngs, (c.d_model, c.vocab), ("embed", "vocab"), c.param_dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.logits(self.hidden(tokens))

    def hidden(self, tokens: jax.Array) -> jax.Array:
        """The final norm's output (batch, seq, d_model), the sequence in its natural
        order: what the output head turns into logits."""
        c = self.config
        dtype = jnp.dtype(c.compute_dtype)
        seq = tokens.shape[1]
        # under context parallelism, the sequence in the order the devices hold it
        order = sequence_order(seq, c.context_strategy)
        if order is not None:
            tokens = reorder(tokens, order)
        x = constrain(self.embed[...][tokens].astype(dtype), RESIDUAL)
        rope = _rope(np.arange(seq) if order is None else order, c.head_dim, c.rope_theta)

        def layer(x: jax.Array, block: Block) -> jax.Array:
            return block(x, rope)

        if c.remat != "none":  # each layer rematerialized on its own
            layer = nnx.remat(layer, policy=remat_policy(c.remat), prevent_cse=not c.scan)
        layers: Any = self.layers  # one Block of stacked weights when scanned, else a List
        stages = stage_count()
        if c.scan and stages > 1:  # the stacked layers as a pipeline over 'stage'
            microbatches = c.pipeline_microbatches or stages
            run = pipeline(lambda block, x: layer(x, block), microbatches=microbatches,
                           repeats=c.pipeline_repeats)  # fmt: skip
            x = run(layers, x)
        elif c.scan:
            x = nnx.scan(layer, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, layers)
        else:
            for block in layers:
                x = layer(x, block)
        if order is not None:  # back to the natural order, for the logits
            x = constrain(reorder(x, np.argsort(order)), RESIDUAL)
        return _rms_norm(x, self.final_norm[...], c.norm_eps)

    def head_table(self) -> jax.Array:
        """The output head's weights as stored: ``head`` (d_model, vocab), or with tied
        embeddings ``embed`` (vocab, d_model)."""
        return self.embed[...] if self.config.tied else self.head[...]

    def logits(self, x: jax.Array, table: jax.Array | None = None) -> jax.Array:
        """The logits of the hidden state ``x`` (`hidden`), by the output head (or by
        ``table``, its weights as `head_table` gives them)."""
        c = self.config
        table = (self.head_table() if table is None else table).astype(c.compute_dtype)
        if c.tied:
            logits = jnp.einsum("bsd,vd->bsv", x, table)
        else:
            logits = x @ table
        return constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))


@jax.custom_vjp
def _nll_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The summed negative log-likelihood (float32) of ``targets`` under ``logits``.

    It has a gradient of its own (a ``jax.custom_vjp``, as MaxText's
    ``cross_entropy_with_logits`` has): the backward pass keeps ``logits`` as given
    (bfloat16) and a float32 log-sum-exp a token, and computes the logits' gradient from
    them in one pass, in their dtype. Autodiff through a float32 ``log_softmax`` would
    keep a float32 copy of the logits, twice the bfloat16 logits' bytes: at a large
    vocabulary, the largest tensor of a step."""
    return _nll_forward(logits, targets)[0]


def _nll_forward(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, Any]:
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(lse - picked.astype(jnp.float32)), (logits, targets, lse)


def _nll_backward(residuals: Any, g: jax.Array) -> tuple[jax.Array, Any]:
    logits, targets, lse = residuals
    p = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    hot = jnp.arange(logits.shape[-1]) == targets[..., None]
    grad = (g * (p - hot)).astype(logits.dtype)
    return grad, np.zeros(targets.shape, jax.dtypes.float0)


_nll_sum.defvjp(_nll_forward, _nll_backward)


def _tiled_nll_sum(model: Decoder, x: jax.Array, targets: jax.Array, tiles: int) -> jax.Array:
    """`_nll_sum` of ``model.logits(x)``, a tile of the tokens at a time, each tile's
    logits rematerialized in the backward pass: only one tile's logits are ever held
    (MaxText's ``num_vocab_tiling``). Tile ``j`` holds positions ``j, j + tiles, ...``,
    so every tile keeps the sequence's split over ``context``."""
    b, s, d = x.shape
    xs = x.reshape(b, s // tiles, tiles, d).transpose(2, 0, 1, 3)
    ys = targets.reshape(b, s // tiles, tiles).transpose(2, 0, 1)
    table = model.head_table()  # passed in: its gradient accumulates in its own dtype

    @jax.checkpoint
    def tile(table: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
        x = constrain(x, RESIDUAL)
        y = constrain(y, ("activation_batch", "activation_length"))
        return _nll_sum(model.logits(x, table), y)

    def step(total: jax.Array, xy: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        return total + tile(table, *xy), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (xs, ys))
    return total


def loss_fn(model: Decoder, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy (float32) over ``tokens`` of shape ``(batch, seq_len + 1)``;
    with ``vocab_tiles`` > 1 the logits a tile of tokens at a time
    (`DecoderConfig.vocab_tiles`)."""
    x = model.hidden(tokens[:, :-1])
    # the targets laid out as the logits are (the sequence over 'context'): a gather of
    # split log-probabilities by replicated targets would gather the log-probabilities
    targets = constrain(tokens[:, 1:], ("activation_batch", "activation_length"))
    tiles = model.config.vocab_tiles
    if tiles == 1:
        total = _nll_sum(model.logits(x), targets)
    else:
        total = _tiled_nll_sum(model, x, targets, tiles)
    return total / targets.size


def train_step(model: Decoder, tokens: jax.Array, learning_rate: float = 1e-3) -> jax.Array:
    """One SGD step on the loss, in place; returns the loss (``aot``'s step)."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - learning_rate * g, params, grads))
    return loss
