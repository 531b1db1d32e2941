"""`nnx_sharding.MoE` and `moe`: routing and the load-balancing loss against formulas,
the dropping and dropless paths against a per-token loop, and the layer under
``expert`` 4 × ``fsdp`` 2 (Explicit and Auto axes) against the single-device layer:
output, loss and gradients; bad input."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding._moe import capacity, route

D, E, K, F = 16, 8, 2, 32
RULES = (("experts", "expert"), ("embed", "fsdp"), ("expert_mlp", None), ("mlp", None))


def layer_of(**kw) -> nnx_sharding.MoE:
    return nnx_sharding.MoE(D, experts=E, k=K, mlp=F, shared=1, rngs=nnx.Rngs(0), **kw)


def tokens(b: int = 8, s: int = 12) -> jax.Array:
    return jax.random.normal(jax.random.key(1), (b, s, D))


def reference(layer: nnx_sharding.MoE, x: np.ndarray) -> np.ndarray:
    """A loop over sequences, tokens and their choices, with MaxText's capacity."""
    params = [(n, p) for n, p in vars(layer).items() if isinstance(p, nnx.Param)]
    w = {n: np.asarray(p[...], np.float64) for n, p in params}
    x = np.asarray(x, np.float64)
    b, s, _ = x.shape
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    out = np.zeros_like(x)
    for i in range(b):
        logits = x[i] @ w["router"]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        taken = np.zeros(E, int)
        cf = layer.capacity_factor
        cap = math.inf if cf is None else capacity(s, E, K, cf)
        for t in range(s):
            top = np.argsort(-probs[t], kind="stable")[:K]
            weights = probs[t, top] / probs[t, top].sum()
            for e, g in zip(top, weights, strict=True):
                taken[e] += 1
                if taken[e] > cap:
                    continue  # dropped
                h = silu(x[i, t] @ w["gate"][e]) * (x[i, t] @ w["up"][e])
                out[i, t] += g * (h @ w["down"][e])
        shared = silu(x[i] @ w["shared_gate"]) * (x[i] @ w["shared_up"])
        out[i] += shared @ w["shared_down"]
    return out


@pytest.mark.parametrize("kw", [{"capacity_factor": 1.0}, {}, {"grouped": "dense"}],
                         ids=["dropping", "dropless", "dense"])  # fmt: skip
def test_layer_equals_a_loop_over_tokens(kw):
    layer, x = layer_of(**kw), tokens(2, 12)
    y, _ = layer(x)
    np.testing.assert_allclose(y, reference(layer, x), rtol=1e-4, atol=1e-5)


def test_dropping_drops_what_the_capacity_leaves_out():
    layer, x = layer_of(capacity_factor=0.5), tokens(2, 12)
    dropless, _ = layer_of()(x)
    y, _ = layer(x)
    assert capacity(12, E, K, 0.5) == 1
    np.testing.assert_allclose(y, reference(layer, x), rtol=1e-4, atol=1e-5)
    assert float(jnp.max(jnp.abs(y - dropless))) > 1e-3  # tokens were dropped


def test_route_loss_and_weights():
    x = tokens(2, 12)
    router = jax.random.normal(jax.random.key(2), (D, E))
    w, chosen, loss = route(x, router, K)
    np.testing.assert_allclose(jnp.sum(w, -1), 1.0, rtol=1e-6)
    probs = jax.nn.softmax(x @ router, -1)
    f = jnp.mean(jnp.sum(jax.nn.one_hot(chosen, E), 2), 1)  # (b, E): fractions, sum to K
    expected = E * jnp.mean(jnp.sum(f * jnp.mean(probs, 1), -1))
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    raw, _, _ = route(x, router, K, renormalize=False)
    np.testing.assert_allclose(raw, jnp.take_along_axis(probs, chosen, -1), rtol=1e-5)
    _, _, uniform = route(x, jnp.zeros((D, E)), K)  # uniform routing: the loss is k
    assert float(uniform) == pytest.approx(K)


def mesh(kind: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("expert", "fsdp"), axis_types=(kind, kind))


def value_and_grads(layer, x):
    def loss(m, x):
        y, aux = m(x)
        return jnp.sum(y**2) + aux, (y, aux)

    return nnx.value_and_grad(loss, has_aux=True)(layer, x)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("kw", [{"capacity_factor": 1.0}, {}, {"grouped": "dense"}],
                         ids=["dropping", "dropless", "dense"])  # fmt: skip
def test_expert_parallel_equals_one_device(kw, kind):
    layer, x = layer_of(**kw), tokens()
    (_, (y0, aux0)), g0 = value_and_grads(layer, x)
    m = mesh(kind)
    with jax.set_mesh(m):
        sharded = nnx_sharding.shard(nnx.clone(layer), m, rules=RULES)
        assert sharded.gate.get_value().sharding.spec == P("expert", "fsdp", None)
        xs = jax.device_put(x, P(("expert", "fsdp")))
        (_, (y1, aux1)), g1 = nnx_sharding.jit(value_and_grads)(sharded, xs)
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux1, aux0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_expert_parallel_drops_what_one_device_drops():
    """The capacity is per sequence, so a split batch drops the same assignments."""
    layer, x = layer_of(capacity_factor=0.5), tokens()
    y0, _ = layer(x)
    m = mesh(AxisType.Auto)
    with jax.set_mesh(m):
        sharded = nnx_sharding.shard(nnx.clone(layer), m, rules=RULES)
        xs = jax.device_put(x, P(("expert", "fsdp")))
        y1, _ = nnx_sharding.jit(lambda m, x: m(x))(sharded, xs)
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match=r"MoE: k: 9 experts per token, with 8 experts"):
        nnx_sharding.MoE(D, experts=E, k=9, mlp=F, rngs=nnx.Rngs(0))
    layer = layer_of(capacity_factor=0.01)
    with pytest.raises(ValueError, match=r"capacity_factor: 0.01 with 12 tokens.*= 0 tokens"):
        layer(tokens(2, 12))
    layer = nnx_sharding.MoE(D, experts=6, k=2, mlp=F, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh(AxisType.Auto)):
        with pytest.raises(ValueError, match=r"6 experts over the mesh axis 'expert' of 4"):
            layer(tokens())
    with pytest.raises(ValueError, match=r"grouped: 'sparse'"):
        layer_of(grouped="sparse")  # at construction, not at the first call
    with pytest.raises(ValueError, match=r"capacity_factor: -1 is not a positive number"):
        layer_of(capacity_factor=-1)
    with pytest.raises(ValueError, match=r"x: an array of shape \(8, 16\); the layer's width"):
        layer_of()(tokens()[:, 0])


def test_the_layer_says_its_capacity_and_rules():
    assert layer_of(capacity_factor=1.25).capacity(4096) == capacity(4096, E, K, 1.25) == 1280
    assert layer_of().capacity(4096) is None
    assert dict(nnx_sharding.MoE.RULES)["experts"] == "expert"
