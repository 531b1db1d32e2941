"""Context parallelism (nnx_sharding/plan/_decoder/context_parallel.py): each strategy
equals unsplit causal attention, forward and gradients, in float32 with grouped-query
heads, on 8 simulated CPU devices; the decoder under a ``context`` axis equals the
decoder without one; the load-balanced layout gives every device the same causal work;
and the strategies' errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding.plan import (
    CONTEXT_STRATEGIES,
    DECODER_CONFIGS,
    Decoder,
    DecoderConfig,
    context_attention,
    sequence_order,
)
from nnx_sharding.plan._decoder.model import loss_fn

COLLECTIVE = {"all_gather": "all-gather", "ring": "collective-permute", "ulysses": "all-to-all"}
"""The collective each strategy's program must hold (XLA:CPU's HLO opcode)."""


def _qkv(seq: int = 64, heads: int = 8, kv_heads: int = 2, batch: int = 2):
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(batch, seq, n, 16) for n in (heads, kv_heads, kv_heads)]
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]


def _loss(out: jax.Array) -> jax.Array:
    return jnp.sum(out * jnp.cos(out))  # a cotangent that is not uniform


@pytest.mark.parametrize("strategy", CONTEXT_STRATEGIES)
@pytest.mark.parametrize(
    ("axes", "kind"),
    [({"context": 8}, AxisType.Auto), ({"data": 2, "context": 2, "model": 2}, AxisType.Explicit)],
    ids=["cp8", "dp2cp2tp2-explicit"],
)
def test_each_strategy_equals_unsplit_attention(strategy, axes, kind):
    """Output and the gradients of q, k and v equal one device's causal attention
    (``jax.nn.dot_product_attention``), the sequence laid out as `sequence_order` says,
    and the program holds the strategy's collective."""
    q, k, v = _qkv()
    reference = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    grads = jax.grad(lambda *a: _loss(jax.nn.dot_product_attention(*a, is_causal=True)),
                     (0, 1, 2))(q, k, v)  # fmt: skip
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(kind,) * len(axes))
    order = sequence_order(64, strategy, parts=axes["context"])
    back = None if order is None else np.argsort(order)

    def split(q, k, v):
        if order is not None:
            q, k, v = (t[:, order] for t in (q, k, v))
        out = context_attention(q, k, v, strategy)
        if back is not None:
            out = jax.sharding.reshard(out, P()) if kind == AxisType.Explicit else out
            out = out[:, back]
        return out

    with jax.set_mesh(mesh):
        out = jax.jit(split)(q, k, v)
        split_grads = jax.jit(jax.grad(lambda *a: _loss(split(*a)), (0, 1, 2)))(q, k, v)
        text = jax.jit(split).lower(q, k, v).compile().as_text()
    np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-5)
    for ours, ref in zip(split_grads, grads, strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=5e-5)
    assert COLLECTIVE[strategy] in text


@pytest.mark.parametrize("strategy", CONTEXT_STRATEGIES)
def test_the_decoder_under_a_context_axis_is_exact(strategy):
    """The decoder's loss and every gradient under ``fsdp`` 2 × ``context`` 4 equal the
    unsplit decoder's (rotary positions follow the load-balanced layout; the logits come
    back in the natural order)."""
    config = dataclasses.replace(
        DECODER_CONFIGS["tiny"], compute_dtype="float32", kv_heads=2, seq_len=64, batch=4,
        context_strategy=strategy,
    )  # fmt: skip
    with nnx.use_eager_sharding(False):
        model = Decoder(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 65), 0, config.vocab)
    grad = nnx.value_and_grad(loss_fn)
    loss, grads = grad(model, tokens)
    mesh = jax.make_mesh((2, 4), ("fsdp", "context"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        split_loss, split_grads = nnx_sharding.jit(grad)(model, tokens)
        logits = nnx_sharding.jit(lambda m, t: m(t))(model, tokens[:, :-1])
    np.testing.assert_allclose(split_loss, loss, rtol=1e-6)
    np.testing.assert_allclose(logits, model(tokens[:, :-1]), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(split_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("parts", [2, 4, 8])
def test_the_load_balanced_layout_gives_every_device_the_same_causal_work(parts):
    """Device ``i`` holds chunks ``i`` and ``2C-1-i``: the unmasked (query, key) pairs of
    its queries, ``sum(p + 1)`` over its positions, are the same on every device, and
    the layout is a permutation of the sequence."""
    seq = 128
    order = sequence_order(seq, "all_gather", parts=parts)
    assert sorted(order.tolist()) == list(range(seq))
    work = [int(np.sum(chunk + 1)) for chunk in np.split(order, parts)]
    assert work == [seq * (seq + 1) // 2 // parts] * parts
    natural = [int(np.sum(chunk + 1)) for chunk in np.split(np.arange(seq), parts)]
    assert natural[-1] > natural[0]  # what the layout balances
    assert sequence_order(seq, "ulysses", parts=parts) is None  # heads split: no imbalance


def test_the_strategies_errors():
    """An unknown strategy, a sequence the axis cannot split, Ulysses over heads the
    axis does not divide: each a ValueError naming what to change."""
    q, k, v = _qkv(heads=4)
    mesh = jax.make_mesh((8,), ("context",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="context_strategy"):
            context_attention(q, k, v, "zigzag")
        with pytest.raises(ValueError, match="16 equal chunks"):
            context_attention(q[:, :40], k[:, :40], v[:, :40], "ring")
        with pytest.raises(ValueError, match="4 query heads"):
            context_attention(q, k, v, "ulysses")
    with pytest.raises(ValueError, match="context_strategy"):
        DecoderConfig("x", 8, 8, 2, 4, 8, 1, context_strategy="zigzag")


@pytest.mark.parametrize("strategy", ["all_gather", "ulysses"])
def test_splash_under_each_strategy_equals_unsplit_attention(strategy):
    """On TPUs ``all_gather`` runs splash with the load-balanced causal mask and
    ``ulysses`` splash over the whole sequence: both, in Pallas's interpreter on 8 CPU
    devices (``context`` 4 × ``model`` 2), equal unsplit attention, forward and
    gradients."""
    q, k, v = _qkv(seq=512, heads=8, kv_heads=2, batch=1)
    q, k, v = (jnp.concatenate([t] * 8, axis=-1) for t in (q, k, v))  # head_dim 128
    reference = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    grads = jax.grad(lambda *a: _loss(jax.nn.dot_product_attention(*a, is_causal=True)),
                     (0, 1, 2))(q, k, v)  # fmt: skip
    mesh = jax.make_mesh((4, 2), ("context", "model"), axis_types=(AxisType.Auto,) * 2)
    order = sequence_order(512, strategy, parts=4)
    back = None if order is None else np.argsort(order)

    def split(q, k, v):
        if order is not None:
            q, k, v = (t[:, order] for t in (q, k, v))
        out = context_attention(q, k, v, strategy, "splash", interpret=True)
        return out if back is None else out[:, back]

    with jax.set_mesh(mesh):
        out = jax.jit(split)(q, k, v)
        split_grads = jax.jit(jax.grad(lambda *a: _loss(split(*a)), (0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-4)
    for ours, ref in zip(split_grads, grads, strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("strategy", CONTEXT_STRATEGIES)
def test_the_context_policy_keeps_each_strategys_output(strategy, saved_elements):
    """Under the ``context`` remat policy each strategy keeps its output and log-sum-exp
    for the backward pass, once each: without them the backward pass would run the
    strategy's forward again (the ring's whole ring of transfers)."""
    from nnx_sharding.plan._decoder.remat import remat_policy

    q, k, v = _qkv()
    mesh = jax.make_mesh((2,), ("context",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        f = jax.checkpoint(lambda *a: _loss(context_attention(*a, strategy)),
                           policy=remat_policy("context"))  # fmt: skip
        saved = saved_elements(f, q, k, v)
    b, s, h, _ = q.shape
    assert saved.count(q.size) == 1, saved  # the output
    assert saved.count(b * s * h) == 1, saved  # its log-sum-exp, one per query and head
