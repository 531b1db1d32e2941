"""The decoder's training step (nnx_sharding/plan/_decoder/training.py, remat.py): gradient
accumulation gives the big batch's step, and each remat policy recomputes what it says."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_sharding
from nnx_sharding.plan import (
    DECODER_RULES,
    REMAT_POLICIES,
    Decoder,
    DecoderConfig,
    accumulate_gradients,
    make_train_step,
)
from nnx_sharding.plan._decoder.model import loss_fn

CONFIG = DecoderConfig("steps", 61, 32, 4, 8, 48, 2, batch=8, seq_len=16, kv_heads=2,
                       compute_dtype="float32")  # fmt: skip


def make(config: DecoderConfig = CONFIG) -> tuple[Decoder, nnx.Optimizer, jax.Array]:
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)  # numpy's draws: no program compiled per shape
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var.get_value().shape
        base, scale = (1.0, 0.1) if str(path[-1]).endswith("norm") else (0.0, 0.3)
        var.set_value(jnp.asarray(base + scale * rng.standard_normal(shape), jnp.float32))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    tokens = jnp.asarray(rng.integers(0, config.vocab, (config.batch, config.seq_len + 1)))
    return model, optimizer, tokens


def params(model: Decoder) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def one_batch() -> tuple[float, dict, dict]:
    """The big batch's loss, gradients and parameters after one step."""
    model, optimizer, tokens = make()
    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, tokens)
    nnx.jit(lambda m, o, g: o.update(m, g))(model, optimizer, grads)
    flat = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    return float(loss), flat, params(model)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accumulating_microbatches_is_one_big_batch(one_batch, k):
    """The loss and the parameters after one step of ``k`` microbatches: the big batch's,
    to 1e-5 in float32."""
    want_loss, _, want_params = one_batch
    model, optimizer, tokens = make()
    loss = nnx.jit(make_train_step(k))(model, optimizer, tokens)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    got = params(model)
    for path, value in want_params.items():
        np.testing.assert_allclose(got[path], value, rtol=1e-5, atol=1e-7, err_msg=str(path))


def test_accumulated_gradients_are_the_big_batchs(one_batch):
    """To 1e-5 of each gradient's largest entry: entries that are sums of terms that
    cancel keep float32's rounding of the terms, not of the sum."""
    want_loss, want_grads, _ = one_batch
    model, _, tokens = make()
    loss, grads = nnx.jit(accumulate_gradients, static_argnums=(0, 3))(loss_fn, model, tokens, 4)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    for path, var in nnx.to_flat_state(grads):
        scale = np.abs(want_grads[path]).max()
        np.testing.assert_allclose(var.get_value(), want_grads[path], rtol=1e-5,
                                   atol=1e-5 * scale, err_msg=str(path))  # fmt: skip


def test_accumulation_keeps_the_batch_split_over_the_data_axes():
    """4 microbatches under FSDP on 8 devices, run for real through `Plan.jit` (each
    microbatch takes every fourth sequence, so that every device keeps its own rows):
    the big batch's step on one device."""
    model, optimizer, tokens = make(dataclasses.replace(CONFIG, batch=32))
    step = make_train_step(4)
    (fsdp,) = nnx_sharding.plan(step, model, optimizer, tokens, devices=8, layouts=["fsdp"],
                                rules=DECODER_RULES, donate_argnums=(0, 1))  # fmt: skip
    assert fsdp.reason is None, fsdp.reason
    loss = fsdp.jit(step)(model, optimizer, tokens)
    reference, ref_optimizer, _ = make(dataclasses.replace(CONFIG, batch=32))
    want = nnx.jit(make_train_step(1))(reference, ref_optimizer, tokens)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    got = params(model)
    for path, value in params(reference).items():
        np.testing.assert_allclose(got[path], value, rtol=1e-5, atol=1e-6, err_msg=str(path))


def test_a_microbatch_count_that_does_not_divide_the_batch_names_its_divisors():
    model, _, tokens = make()
    with pytest.raises(ValueError) as info:
        accumulate_gradients(loss_fn, model, tokens, 3)
    message = str(info.value)
    assert message.splitlines()[0] == (
        "accumulate_gradients: microbatches: 3 does not divide the batch of 8 "
        "(its divisors: 1, 2, 4, 8)"
    )
    assert "  1. choose one, e.g. `microbatches=2`;" in message


# --- remat policies -----------------------------------------------------------------------------

REMAT = dataclasses.replace(CONFIG, scan=False, seq_len=64, layers=3)


def compiled(config: DecoderConfig, *, forward: bool = False) -> jax.stages.Compiled:
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    tokens = jax.ShapeDtypeStruct((config.batch, config.seq_len + 1), jnp.int32)
    fun = loss_fn if forward else nnx.grad(loss_fn)
    return nnx.jit(fun).lower(model, tokens).compile()


def flops(config: DecoderConfig, **kwargs: bool) -> float:
    return compiled(config, **kwargs).cost_analysis()["flops"]


def test_full_remat_recomputes_each_blocks_forward_pass():
    """The CPU compiler's FLOPs (the layers unrolled, one attention block: no loop for
    ``cost_analysis`` to count once). ``full`` adds each block's forward pass (measured:
    the forward pass less that of the same model with one layer fewer), but for what the
    backward pass never reads: the outputs of the attention's and the MLP's last
    projections. ``dots`` adds less; ``dots_with_context`` less again (the attention's
    forward pass is not run again: its output and log-sum-exp are kept)."""
    by_policy = {name: flops(dataclasses.replace(REMAT, remat=name)) for name in REMAT_POLICIES}
    one_fewer = dataclasses.replace(REMAT, layers=REMAT.layers - 1)
    block = flops(REMAT, forward=True) - flops(one_fewer, forward=True)
    c, tokens = REMAT, REMAT.batch * REMAT.seq_len
    unread = 2 * tokens * (c.heads * c.head_dim * c.d_model + c.mlp * c.d_model)
    added = (by_policy["full"] - by_policy["none"]) / c.layers
    assert block - unread <= added <= block, (block, unread, added)
    assert by_policy["none"] < by_policy["dots_with_context"] < by_policy["dots"]
    assert by_policy["dots"] < by_policy["full"]


def test_remat_policies_trade_memory_in_the_scanned_decoder():
    """The layers scanned: what each policy keeps per layer for the backward pass shows in
    the temporaries; ``none`` keeps most, ``full`` only each layer's input."""
    config = dataclasses.replace(CONFIG, seq_len=256, layers=4, mlp=256)
    temp = {
        name: compiled(dataclasses.replace(config, remat=name)).memory_analysis().temp_size_in_bytes
        for name in REMAT_POLICIES
    }
    assert temp["none"] > temp["dots_with_context"] >= temp["dots"] > temp["full"], temp
