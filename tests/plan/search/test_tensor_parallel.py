"""Tensor-parallel shardings from the step's jaxpr, for models without sharding metadata
(nnx_sharding/plan/_search/tensor_parallel.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_sharding.plan._search.tensor_parallel import tensor_parallel_specs

D, H, F = 32, 8, 128


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d: int = D, f: int = F):
        self.up = nnx.Linear(d, f, rngs=rngs)
        self.down = nnx.Linear(f, d, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


class Block(nnx.Module):
    """A pre-norm transformer block of flax's own layers (no sharding metadata)."""

    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(H, D, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = MLP(rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(jax.nn.gelu(self.ln2(x)))


class LM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, vocab: int = 64):
        self.embed = nnx.Embed(vocab, D, rngs=rngs)
        self.block = Block(rngs)
        self.head = nnx.Linear(D, vocab, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.block(self.embed(tokens)))


MLP_SPECS = {
    ("up", "kernel"): P(None, "model"),  # column-parallel
    ("up", "bias"): P("model"),  # sharded with its columns
    ("down", "kernel"): P("model", None),  # row-parallel: one all-reduce after it
    ("down", "bias"): P(),
}
BLOCK_SPECS = {
    ("ln1", "scale"): P(),
    ("ln1", "bias"): P(),
    ("attn", "query", "kernel"): P(None, "model", None),  # [embed, heads, head_dim]
    ("attn", "query", "bias"): P("model", None),
    ("attn", "key", "kernel"): P(None, "model", None),
    ("attn", "key", "bias"): P("model", None),
    ("attn", "value", "kernel"): P(None, "model", None),
    ("attn", "value", "bias"): P("model", None),
    ("attn", "out", "kernel"): P("model", None, None),  # [heads, head_dim, embed]
    ("attn", "out", "bias"): P(),
    ("ln2", "scale"): P(),
    ("ln2", "bias"): P(),
    **{("mlp", *path): spec for path, spec in MLP_SPECS.items()},
}


def forward(model, x):
    return model(x)


def _abstract(make):
    return nnx.eval_shape(lambda: make(nnx.Rngs(0)))


def test_mlp_forward_pairs_column_then_row():
    model = _abstract(MLP)
    x = jax.ShapeDtypeStruct((4, D), jnp.float32)
    specs, data = tensor_parallel_specs(forward, (model, x), {})
    assert specs == MLP_SPECS
    assert data is None


def test_transformer_block_splits_heads_and_mlp_units():
    block = _abstract(Block)
    x = jax.ShapeDtypeStruct((2, 8, D), jnp.float32)
    (specs, _) = tensor_parallel_specs(forward, (block, x), {})
    assert specs == BLOCK_SPECS


def test_train_step_shards_optimizer_state_with_its_parameters():
    def build(rngs):
        model = MLP(rngs)
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(lambda: build(nnx.Rngs(0)))

    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    x = jax.ShapeDtypeStruct((4, D), jnp.float32)
    specs, opt_specs, x_spec, y_spec = tensor_parallel_specs(step, (model, optimizer, x, x), {})
    assert specs == MLP_SPECS
    expected = {("step",): P(), ("opt_state", 0, "count"): P()}
    for moment in ("mu", "nu"):
        expected.update({("opt_state", 0, moment, *p): s for p, s in MLP_SPECS.items()})
    assert opt_specs == expected
    assert (x_spec, y_spec) == (None, None)


def test_embeddings_and_vocabulary_projection_stay_replicated():
    lm = _abstract(LM)
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)

    def step(model, tokens):
        def loss(model):
            logits = model(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

        loss, grads = nnx.value_and_grad(loss)(model)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model), grads))
        return loss

    specs, _ = tensor_parallel_specs(step, (lm, tokens), {})
    expected = {("block", *p): s for p, s in BLOCK_SPECS.items()}
    expected.update(
        {
            ("embed", "embedding"): P(),  # gathered by token: whole
            ("head", "kernel"): P(),  # the softmax needs the whole vocabulary
            ("head", "bias"): P(),
        }
    )
    assert specs == expected


def test_a_weight_pairs_once_three_layers_leave_the_last_replicated():
    class Deep(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(D, F, rngs=rngs)
            self.b = nnx.Linear(F, F, rngs=rngs)
            self.c = nnx.Linear(F, D, rngs=rngs)

        def __call__(self, x):
            return self.c(jax.nn.relu(self.b(jax.nn.relu(self.a(x)))))

    specs, _ = tensor_parallel_specs(
        forward, (_abstract(Deep), jax.ShapeDtypeStruct((4, D), jnp.float32)), {}
    )
    assert specs == {
        ("a", "kernel"): P(None, "model"),
        ("a", "bias"): P("model"),
        ("b", "kernel"): P("model", None),
        ("b", "bias"): P(),
        ("c", "kernel"): P(),  # b's output dimension cannot also be split: no partner
        ("c", "bias"): P(),
    }


def test_stacked_layers_under_scan_keep_the_layer_dimension_whole():
    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Param(jnp.zeros((3, D, F)))
            self.down = nnx.Param(jnp.zeros((3, F, D)))

        def __call__(self, x):
            def layer(x, weights):
                up, down = weights
                return x + jax.nn.relu(x @ up) @ down, None

            return jax.lax.scan(layer, x, (self.up[...], self.down[...]))[0]

    stack = nnx.eval_shape(lambda: Stack(nnx.Rngs(0)))
    specs, _ = tensor_parallel_specs(forward, (stack, jax.ShapeDtypeStruct((4, D), "float32")), {})
    assert specs == {("up",): P(None, None, "model"), ("down",): P(None, "model", None)}


def test_keyword_arguments_and_static_values_are_traced_but_not_returned():
    def step(model, x, *, scale, extra):
        return model(x) * scale + extra(x)

    model, extra = _abstract(MLP), _abstract(lambda r: MLP(r, f=64))
    x = jax.ShapeDtypeStruct((4, D), jnp.float32)
    result = tensor_parallel_specs(step, (model, x), {"scale": 2.0, "extra": extra})
    assert result == (MLP_SPECS, None)


def _compiled_forward_collectives(model, x, specs):
    mesh = Mesh(np.array(jax.devices()[:8]), ("model",))
    graphdef, state = nnx.split(model)
    shardings = nnx.from_flat_state(
        [
            (path, var.replace(NamedSharding(mesh, specs[path])))
            for path, var in nnx.to_flat_state(state)
        ]
    )
    replicated = NamedSharding(mesh, P())
    fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x), in_shardings=(shardings, replicated))
    hlo = fn.lower(state, x).compile().as_text()
    ops = re.findall(
        r"= [^=]*? (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(", hlo
    )
    return sorted(ops)


def test_compiled_mlp_forward_needs_one_all_reduce_and_gathers_no_weight():
    model = MLP(nnx.Rngs(0))
    x = jax.ShapeDtypeStruct((16, D), jnp.float32)
    specs, _ = tensor_parallel_specs(forward, (model, x), {})
    assert _compiled_forward_collectives(model, x, specs) == ["all-reduce"]


def test_compiled_block_forward_needs_one_all_reduce_per_sublayer():
    block = Block(nnx.Rngs(0))
    x = jax.ShapeDtypeStruct((2, 8, D), jnp.float32)
    specs, _ = tensor_parallel_specs(forward, (block, x), {})
    assert _compiled_forward_collectives(block, x, specs) == ["all-reduce", "all-reduce"]


def test_a_scaled_or_cast_kernel_is_still_a_weight():
    class Scaled(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Param(jnp.zeros((D, F)))
            self.gain = nnx.Param(jnp.ones((F,)))
            self.down = nnx.Param(jnp.zeros((F, D)))

        def __call__(self, x):
            up = (self.up[...] * self.gain[...]).astype(jnp.bfloat16)  # weight-norm style
            h = jax.nn.relu(x.astype(jnp.bfloat16) @ up)
            return h @ (self.down[...] * 0.5).astype(jnp.bfloat16)

    model = nnx.eval_shape(lambda: Scaled(nnx.Rngs(0)))
    specs, _ = tensor_parallel_specs(forward, (model, jax.ShapeDtypeStruct((4, D), "float32")), {})
    assert specs == {("up",): P(None, "model"), ("gain",): P("model"), ("down",): P("model", None)}
