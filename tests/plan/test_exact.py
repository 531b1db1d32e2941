"""Exact where exactness is possible: on 8 CPU devices, each plan of a small transformer
runs one real step under `Plan.jit` with the single-device loss and parameters, holds
exactly `memory.state` bytes of state per device, and moves the bytes that formulas
written from the shapes say its collectives must."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_sharding
from nnx_sharding.plan._decoder.configs import DecoderConfig
from nnx_sharding.plan._decoder.model import Decoder, loss_fn

# float32 compute (a step that equals the single-device one to 1e-5), layers unrolled
# unless a test scans them, and a two-matrix GELU MLP: the shapes the formulas below use
PINNED = {"compute_dtype": "float32", "scan": False, "gated": False, "activation": "gelu"}
CONFIG = DecoderConfig("exact", vocab=64, d_model=32, heads=8, head_dim=4, mlp=64, layers=2,
                       batch=8, seq_len=16, **PINNED)  # fmt: skip
RULES = [("heads", "model"), ("mlp", "model"), ("vocab", None), ("embed", None)]
LAYOUTS = ["dp", "zero1", "fsdp", "tp", "dp+tp"]
F32 = 4


def train_step(model: Decoder, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss


def make_state() -> tuple[Decoder, nnx.Optimizer, jax.Array]:
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    tokens = jax.random.randint(
        jax.random.key(1), (CONFIG.batch, CONFIG.seq_len + 1), 0, CONFIG.vocab
    )
    return model, optimizer, tokens


def param_bytes() -> int:
    return CONFIG.param_count() * F32


@pytest.fixture(scope="module")
def plans() -> nnx_sharding.plan.Plans:
    with nnx.use_eager_sharding(False):
        model, optimizer, tokens = nnx.eval_shape(make_state)
    return nnx_sharding.plan(
        train_step,
        model,
        optimizer,
        tokens,
        devices=8,
        layouts=LAYOUTS,
        rules=RULES,
        donate_argnums=(0, 1),
    )


@pytest.fixture(scope="module")
def reference() -> tuple[float, nnx.State]:
    with nnx.use_eager_sharding(False):
        model, optimizer, tokens = make_state()
        loss = nnx.jit(train_step)(model, optimizer, tokens)
    return float(loss), nnx.state(model, nnx.Param)


def pick(plans: nnx_sharding.plan.Plans, layout: str, **mesh: int) -> nnx_sharding.plan.Plan:
    found = [p for p in plans if p.layout == layout and (not mesh or dict(p.mesh_shape) == mesh)]
    assert len(found) == 1, [p.label for p in plans]
    assert found[0].reason is None, found[0].reason
    return found[0]


CASES = [("dp", {}), ("zero1", {}), ("fsdp", {}), ("tp", {}), ("dp+tp", {"data": 2, "model": 4})]


@pytest.mark.parametrize(("layout", "mesh"), CASES, ids=[c[0] for c in CASES])
def test_one_step_is_the_single_device_step(plans, reference, layout, mesh):
    plan = pick(plans, layout, **mesh)
    with nnx.use_eager_sharding(False):
        model, optimizer, tokens = make_state()
    loss = plan.jit(train_step)(model, optimizer, tokens)
    ref_loss, ref_params = reference
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    got = nnx.to_flat_state(nnx.state(model, nnx.Param))
    want = dict(nnx.to_flat_state(ref_params))
    for path, var in got:
        np.testing.assert_allclose(
            np.asarray(var.get_value()), np.asarray(want[path].get_value()), rtol=1e-5,
            atol=1e-7, err_msg=str(path),
        )  # fmt: skip
    # each device's live bytes of state equal memory.state exactly
    per_device: dict[int, int] = {}
    for node in (model, optimizer):
        for _, var in nnx.to_flat_state(nnx.state(node)):
            value = var.get_value()
            if isinstance(value, jax.Array):
                for shard in value.addressable_shards:
                    per_device[shard.device.id] = per_device.get(shard.device.id, 0) + (
                        shard.data.nbytes
                    )
    assert len(per_device) == 8
    assert set(per_device.values()) == {plan.memory.state}, per_device


def test_state_bytes_follow_the_layout(plans):
    """Parameters plus the momentum: 2 copies (and the step counter), split as each
    layout says."""
    full = 2 * param_bytes()
    dp, zero1, fsdp = (pick(plans, name) for name in ("dp", "zero1", "fsdp"))
    assert dp.memory.state == full + 4  # the optimizer's uint32 step, replicated
    # FSDP: every matrix an eighth; the norm scales (d_model = 32) are split too
    assert fsdp.memory.state == full // 8 + 4
    # ZeRO-1: parameters whole, the momentum an eighth
    assert zero1.memory.state == param_bytes() + param_bytes() // 8 + 4


def within(value: float, expected: float, tolerance: float = 0.01) -> bool:
    return abs(value - expected) <= tolerance * expected


def test_data_parallel_reduces_every_gradient(plans):
    dp = pick(plans, "dp")
    assert within(dp.collectives["all-reduce"], param_bytes()), dp.collectives
    assert dp.collectives["all-gather"] == 0


def test_fsdp_gathers_the_parameters_and_scatters_their_gradients(plans):
    fsdp = pick(plans, "fsdp")
    assert within(fsdp.collectives["all-gather"], param_bytes()), fsdp.collectives
    assert within(fsdp.collectives["reduce-scatter"], param_bytes()), fsdp.collectives


def test_zero1_scatters_gradients_and_gathers_updated_parameters(plans):
    zero1 = pick(plans, "zero1")
    assert within(zero1.collectives["reduce-scatter"], param_bytes()), zero1.collectives
    assert within(zero1.collectives["all-gather"], param_bytes()), zero1.collectives


def test_tensor_parallel_reduce_scatters_activations_per_block_and_pass(plans):
    """Megatron with sequence parallelism (the decoder splits the residual stream over
    ``model`` between blocks): where plain Megatron all-reduces an activation, one
    reduce-scatter of ``tokens · d_model`` floats: one per attention and one per MLP block
    in the forward pass; in the backward pass one per MLP block and one per projection of
    the attention's input (q, k and v: the CPU compiler reduces each partial input
    gradient on its own rather than their sum; the GPU compiler reduces the sum,
    Megatron's 4 per layer: tests/plan/cost/test_loops.py). Each block's input is gathered
    again (at least once per block, forward); all that is all-reduced is the norms'
    statistics, one float per token."""
    tp = pick(plans, "tp")
    tokens = CONFIG.batch * CONFIG.seq_len
    activation = tokens * CONFIG.d_model * F32
    scatters = [c for c in tp.detail if c.kind == "reduce-scatter"]
    assert [c.bytes for c in scatters] == [activation] * CONFIG.layers * (2 + 1 + 3)
    assert all(c.group_size == 8 for c in scatters)
    gathers = [c for c in tp.detail if c.kind == "all-gather" and c.bytes == activation]
    assert len(gathers) >= CONFIG.layers * 2
    reduces = [c for c in tp.detail if c.kind == "all-reduce" and c.bytes > 4]
    assert {c.bytes for c in reduces} == {tokens * F32}


def test_candidates_are_every_factorisation(plans):
    assert sorted(p.label for p in plans) == sorted(
        [
            "dp (data=8)",
            "zero1 (data=8)",
            "fsdp (fsdp=8)",
            "tp (model=8)",
            "dp+tp (data=4×model=2)",
            "dp+tp (data=2×model=4)",
        ]
    )
    assert math.prod(plans[0].mesh_shape.values()) == 8
    assert jnp.dtype(jnp.float32).itemsize == F32
