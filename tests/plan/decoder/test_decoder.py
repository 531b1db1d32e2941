"""The built-in decoder (nnx_sharding/plan/_decoder/): the published models' sizes, the
forward pass against a reference written out in plain JAX, tied embeddings, grouped-query
attention, the logical activation names, `decoder_builder`'s contract and its errors."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding.plan import (
    DECODER_CONFIGS,
    DECODER_RULES,
    Decoder,
    DecoderConfig,
    constrain_activation,
    decoder_builder,
    search,
)
from nnx_sharding.plan._decoder.activation_sharding import activation_spec
from nnx_sharding.plan._search.layouts import Candidate, metadata_tp, node_specs

PUBLISHED = {  # billions of parameters, to the digits the models' papers and cards give
    "llama2-7b": "6.738",
    "llama3-8b": "8.03",
    "llama3-70b": "70.6",
    "llama3-405b": "405.9",
    "maxtext-32b": "32.55",
    "mixtral-8x7b": "46.7",
    "mixtral-8x22b": "141",
    "qwen3-30b-a3b": "30.5",
    "qwen3-235b-a22b": "235",
}
ACTIVE = {"mixtral-8x7b": "12.9", "mixtral-8x22b": "39", "qwen3-30b-a3b": "3",
          "qwen3-235b-a22b": "22"}  # fmt: skip
"""Parameters a token uses, as the models' papers and cards give them (Qwen3's 30B: "3.3B
activated"; the decoder counts 3.35B, Qwen3's query and key norms left out)."""


def abstract(config: DecoderConfig) -> Decoder:
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))


def make(config: DecoderConfig, seed: int = 0) -> Decoder:
    """The decoder with random weights drawn by numpy (jax's initializers compile a
    program for each shape: seconds each on a busy CPU)."""
    model = abstract(config)
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape, dtype = var.get_value().shape, var.get_value().dtype
        base, scale = (1.0, 0.1) if str(path[-1]).endswith("norm") else (0.0, 0.3)
        var.set_value(jnp.asarray(base + scale * rng.standard_normal(shape), dtype))
    return model


@nnx.jit
def forward(model: Decoder, tokens: jax.Array) -> jax.Array:
    return model(tokens)


def counted(model: Decoder) -> int:
    return sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_named_configs_have_the_published_parameter_counts(name):
    config = DECODER_CONFIGS[name]
    model = abstract(config)  # shapes only: 405B parameters never allocated
    assert counted(model) == config.param_count()
    digits = len(PUBLISHED[name].partition(".")[2])
    assert f"{config.param_count() / 1e9:.{digits}f}" == PUBLISHED[name]


@pytest.mark.parametrize("name", list(ACTIVE))
def test_mixtures_of_experts_count_the_active_parameters_in_their_flops(name):
    c = DECODER_CONFIGS[name]
    digits = len(ACTIVE[name].partition(".")[2])
    assert f"{c.param_count(active=True) / 1e9:.{digits}f}" == ACTIVE[name]
    d, f, e, k = c.d_model, c.moe_mlp, c.experts, c.experts_per_token
    # MaxText's count: the top-k experts' three matmuls and the router, not the others
    unused = c.layers * 3 * d * f * (e - k)
    assert c.param_count(active=True) == c.param_count() - unused
    tokens = c.batch * c.seq_len
    attention = 6 * c.heads * c.layers * c.head_dim * c.seq_len**2 * c.batch
    assert c.model_flops() == 6 * c.param_count(active=True) * tokens + attention


def test_one_expert_of_one_is_the_dense_gated_mlp():
    """With one expert, top-1 and renormalised weights, the MoE decoder is the dense
    SwiGLU decoder whose MLP is that expert."""
    dense = dataclasses.replace(SMALL, gated=True, activation="silu")
    moe = dataclasses.replace(dense, experts=1, experts_per_token=1)
    model, reference = make(moe), make(dense)
    for name in ("gate", "up", "down"):
        getattr(reference.layers, name).set_value(getattr(model.layers, name)[...][:, 0])
    for name, var in vars(reference.layers).items():
        if isinstance(var, nnx.Param) and name not in ("gate", "up", "down"):
            var.set_value(getattr(model.layers, name)[...])
    for name in ("embed", "final_norm", "head"):
        getattr(reference, name).set_value(getattr(model, name)[...])
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, SMALL.vocab)
    np.testing.assert_allclose(forward(model, tokens), forward(reference, tokens), atol=2e-5)


def test_the_llama_configs_have_the_published_dimensions():
    seven = DECODER_CONFIGS["llama2-7b"]
    assert (seven.vocab, seven.d_model, seven.kv, seven.mlp, seven.tied) == (
        32000, 4096, 32, 11008, False,
    )  # fmt: skip
    for name, layers in [("llama3-8b", 32), ("llama3-70b", 80), ("llama3-405b", 126)]:
        c = DECODER_CONFIGS[name]
        assert (c.vocab, c.kv, c.rope_theta, c.layers, c.gated) == (
            128256, 8, 500000.0, layers, True,
        )  # fmt: skip
    big = DECODER_CONFIGS["maxtext-32b"]
    assert (big.heads * big.head_dim, big.mlp, big.activation, big.gated) == (
        8192, 32768, "relu", False,
    )  # fmt: skip
    assert big.tied and big.parallel_block and big.kv == big.heads


def test_every_dimension_can_be_overridden():
    c = dataclasses.replace(DECODER_CONFIGS["llama3-8b"], layers=2, vocab=1000, batch=4)
    model = abstract(c)
    assert model.layers.wq.shape == (2, 4096, 32, 128)
    assert model.embed.shape == (1000, 4096)
    assert counted(model) == c.param_count()


# --- the forward pass, against a reference written out in plain JAX --------------------


SMALL = DecoderConfig("small", 97, 32, 4, 8, 48, 2, batch=2, seq_len=12, kv_heads=2,
                      compute_dtype="float32", rope_theta=500.0)  # fmt: skip
VARIANTS = {
    "swiglu-gqa": SMALL,
    "unrolled": dataclasses.replace(SMALL, scan=False),
    "parallel-relu-tied": dataclasses.replace(
        SMALL, gated=False, activation="relu", tied=True, parallel_block=True, kv_heads=None
    ),
    "gelu": dataclasses.replace(SMALL, gated=False, activation="gelu", kv_heads=1),
}


def reference_logits(c: DecoderConfig, model: Decoder, tokens: jax.Array) -> jax.Array:
    """Llama's forward pass (RMSNorm, rotary embeddings on halves, causal softmax
    attention as jax computes it, the MLP), layer by layer, in float32."""

    def norm(x: jax.Array, scale: jax.Array) -> jax.Array:
        return x / jnp.sqrt(jnp.mean(x**2, -1, keepdims=True) + c.norm_eps) * scale

    half = c.head_dim // 2
    freq = c.rope_theta ** (-np.arange(half) / half)
    angle = np.arange(tokens.shape[1])[:, None] * freq[None, :]
    cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]

    def rotate(x: jax.Array) -> jax.Array:
        a, b = x[..., :half], x[..., half:]
        return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    act = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu}[c.activation]
    blocks = list(model.layers) if not c.scan else [None] * c.layers
    x = model.embed[...][tokens]
    for i, block in enumerate(blocks):
        w = (block or model.layers).weights()
        w = w if block is not None else {k: v[i] for k, v in w.items()}
        h = norm(x, w["attn_norm"])
        q = rotate(jnp.einsum("bsd,dhk->bshk", h, w["wq"]))
        k = rotate(jnp.einsum("bsd,dhk->bshk", h, w["wk"]))
        v = jnp.einsum("bsd,dhk->bshk", h, w["wv"])
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        attn = jnp.einsum("bshk,hkd->bsd", o, w["wo"])
        m_in = h if c.parallel_block else norm(x + attn, w["mlp_norm"])
        hidden = act(m_in @ w["gate"]) * (m_in @ w["up"]) if c.gated else act(m_in @ w["up"])
        x = x + attn + hidden @ w["down"]
    x = norm(x, model.final_norm[...])
    return x @ (model.embed[...].T if c.tied else model.head[...])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_decoder_computes_the_reference_forward_pass(name):
    c = VARIANTS[name]
    model = make(c)
    tokens = jax.random.randint(jax.random.key(1), (c.batch, c.seq_len), 0, c.vocab)
    got = forward(model, tokens)
    assert got.shape == (c.batch, c.seq_len, c.vocab)
    want = jax.jit(reference_logits, static_argnums=0)(c, model, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_keeps_float32_parameters_and_stays_close():
    """bfloat16 matmuls on float32 parameters: the logits within 1.5 times the error
    that rounding the weights alone to bfloat16 makes (1.6 % here, through 2 random
    layers)."""
    c = dataclasses.replace(SMALL, compute_dtype="bfloat16")
    model = make(c)
    assert {v.dtype for v in jax.tree.leaves(nnx.state(model, nnx.Param))} == {np.dtype("f4")}
    tokens = jax.random.randint(jax.random.key(1), (c.batch, c.seq_len), 0, c.vocab)
    got = forward(model, tokens)
    assert got.dtype == jnp.bfloat16
    want = np.asarray(jax.jit(reference_logits, static_argnums=0)(SMALL, model, tokens))

    def error(x: jax.Array) -> float:
        return float(np.sqrt(np.mean((np.asarray(x, np.float32) - want) ** 2) / np.mean(want**2)))

    rounded = make(SMALL)
    weights = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, var in nnx.to_flat_state(nnx.state(rounded, nnx.Param)):
        var.set_value(weights[path].get_value().astype(jnp.bfloat16).astype(jnp.float32))
    assert error(forward(model, tokens)) < 1.5 * error(forward(rounded, tokens))
    all_bf16 = make(dataclasses.replace(c, param_dtype="bfloat16"))
    assert {v.dtype for v in jax.tree.leaves(nnx.state(all_bf16, nnx.Param))} == {
        jnp.dtype("bfloat16")
    }


def test_tied_embeddings_are_one_matrix_for_both_ends():
    tied = dataclasses.replace(SMALL, tied=True)
    model = make(tied)
    assert not hasattr(model, "head")
    assert counted(model) == SMALL.param_count() - SMALL.vocab * SMALL.d_model
    untied = make(SMALL)
    nnx.update(untied, nnx.state(model))  # the same weights, and the head the embedding's
    untied.head.set_value(model.embed[...].T)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, SMALL.vocab)
    np.testing.assert_allclose(forward(model, tokens), forward(untied, tokens), rtol=1e-6,
                               atol=1e-6)  # fmt: skip


def test_grouped_query_attention_projects_to_the_kv_heads():
    c = dataclasses.replace(DECODER_CONFIGS["llama3-8b"], layers=2)
    model = abstract(c)
    assert model.layers.wq.shape == (2, 4096, 32, 128)
    assert model.layers.wk.shape == model.layers.wv.shape == (2, 4096, 8, 128)
    assert model.layers.wk.get_metadata()["out_sharding"] == ("layers", "embed", "kv_heads", None)
    # without grouping, keys and values have the query heads' logical name
    assert abstract(DECODER_CONFIGS["tiny"]).layers[0].wk.get_metadata()["out_sharding"] == (
        "embed", "heads", None,
    )  # fmt: skip


def test_tensor_parallel_splits_the_kv_heads_where_they_divide():
    """`DECODER_RULES` puts ``model`` on the kv heads: llama3-8b's 8 split 8 ways; over
    16 devices they do not divide, and the candidate says so."""
    model = abstract(dataclasses.replace(DECODER_CONFIGS["llama3-8b"], layers=1))
    pairs = [(tuple(p), v) for p, v in nnx.to_flat_state(nnx.state(model))]
    tp = metadata_tp(pairs, DECODER_RULES)
    assert tp[("layers", "wk")] == P(None, None, "model")
    assert tp[("layers", "wq")] == P(None, None, "model")
    specs, wrong = node_specs(Candidate("tp", {"model": 8}), pairs, tp, "model")
    assert not wrong and specs[("layers", "wv")] == P(None, None, "model")
    _, wrong = node_specs(Candidate("tp", {"model": 16}), pairs, tp, "model")
    assert [w for w in wrong if "(8) is not divisible" in w] == [
        "model.layers.wk: dimension 2 (8) is not divisible by 'model' (16)",
        "model.layers.wv: dimension 2 (8) is not divisible by 'model' (16)",
    ]


# --- logical activation names -------------------------------------------------------------


def test_activation_names_bind_to_the_axes_the_mesh_has():
    names = ("activation_batch", "activation_length", "activation_embed")
    assert activation_spec((8, 16, 64), names) is None  # no mesh: nothing to say
    x = jnp.ones((8, 16, 64))
    assert constrain_activation(x, names) is x
    cases = [
        ((("data", 2), ("fsdp", 2), ("model", 2)), P(("data", "fsdp"), None, "model")),
        ((("fsdp", 8),), P("fsdp")),
        ((("data", 2), ("model", 4)), P("data", None, "model")),
        ((("model", 8),), P(None, None, "model")),
        ((("data", 1), ("model", 3)), None),  # 64 does not split 3 ways; data is 1 device
        ((("data", 16), ("fsdp", 2)), P("fsdp")),  # 8 sequences do not split 16 ways
        ((("data", 2), ("fsdp", 8)), P("data")),  # nor 2 × 8: the first axes that divide
    ]
    for axes, expected in cases:
        mesh = jax.sharding.AbstractMesh(tuple(n for _, n in axes), tuple(a for a, _ in axes))
        with jax.sharding.use_abstract_mesh(mesh):
            assert activation_spec((8, 16, 64), names) == expected, axes


def test_the_decoder_lays_its_residual_stream_out_by_name():
    """Under a mesh of ``data`` and ``model``, the decoder constrains its activations as
    the names say: the batch over data; the residual stream's embed (32), the query heads
    (4) and the MLP's units (48) over model; not the 2 kv heads nor the 97 logits, which
    4 devices do not divide."""
    c = dataclasses.replace(SMALL, batch=4, d_model=32)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = make(c)
    tokens = jax.random.randint(jax.random.key(1), (4, 12), 0, c.vocab)
    with jax.set_mesh(mesh):
        text = jax.jit(lambda m, t: m(t)).lower(model, tokens).as_text()
    constraints = {line.split("<@mesh, ")[1] for line in text.splitlines()
                   if "sharding_constraint" in line}  # fmt: skip
    assert constraints == {
        '[{"data"}, {}, {"model"}]> : tensor<4x12x32xf32>',
        '[{"data"}, {}, {"model"}, {}]> : tensor<4x12x4x8xf32>',
        '[{"data"}, {}, {}, {}]> : tensor<4x12x2x8xf32>',
        '[{"data"}, {}, {"model"}]> : tensor<4x12x48xf32>',
        '[{"data"}, {}, {}]> : tensor<4x12x97xf32>',
    }


# --- the builder plan.search takes ----------------------------------------------------------


def test_the_builder_gives_the_step_its_abstract_arguments_and_model_flops():
    c = dataclasses.replace(SMALL, batch=8)
    built = decoder_builder(c)({"remat": "dots", "microbatches": 2})
    model, optimizer, tokens = built.args
    assert isinstance(model, Decoder) and isinstance(optimizer, nnx.Optimizer)
    assert model.config.remat == "dots"
    values = jax.tree.leaves(nnx.state((model, optimizer)))
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in values)  # never allocated
    assert (tokens.shape, tokens.dtype) == ((8, 13), jnp.int32)
    assert built.jit_options == {"donate_argnums": (0, 1)}
    n, t = counted(model), 8 * 12
    assert built.model_flops == 6 * n * t + 6 * 4 * 2 * 8 * 12**2 * 8
    # the defaults: no remat, one microbatch; the step runs as its arguments say
    default = decoder_builder(c)({})
    assert default.args[0].config.remat == "none"
    (fsdp,) = nnx_sharding.plan(default.step, *default.args, devices=8, layouts=["fsdp"],
                                rules=DECODER_RULES, **default.jit_options)  # fmt: skip
    assert fsdp.reason is None, fsdp.reason


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: decoder_builder(SMALL)({"remat": "dots", "pipeline": 2}),
         "decoder_builder: knobs: unknown knobs 'pipeline'"),
        (lambda: decoder_builder(SMALL)({"microbatches": 3}),
         "decoder_builder: knobs: microbatches=3 does not divide the batch of 2 "
         "(its divisors: 1, 2)"),
        (lambda: decoder_builder(SMALL)({"remat": "everything"}),
         "DecoderConfig: remat: 'everything' is not one of 'none', 'dots', "
         "'dots_with_context', 'context', 'offload_qkv', 'offload_input', 'full'"),
        (lambda: dataclasses.replace(SMALL, kv_heads=3),
         "DecoderConfig: kv_heads: 3 does not divide heads=4"),
        (lambda: dataclasses.replace(SMALL, activation="tanh"),
         "DecoderConfig: activation: 'tanh' is not one of 'silu', 'gelu', 'relu'"),
        (lambda: dataclasses.replace(SMALL, attention="flash"),
         "DecoderConfig: attention: 'flash' is not one of 'auto', 'blockwise', 'splash', "
         "'cudnn', 'triton'"),
        (lambda: dataclasses.replace(SMALL, layers=0),
         "DecoderConfig: layers: 0 is not a positive integer"),
        (lambda: dataclasses.replace(SMALL, experts=4, capacity_factor=0.0),
         "DecoderConfig: capacity_factor: 0.0 is not a positive number"),
        (lambda: dataclasses.replace(SMALL, experts=4, experts_per_token=5),
         "DecoderConfig: experts_per_token: 5 experts per token, with 4 experts"),
        (lambda: nnx_sharding.plan.remat_policy("dot"),
         "remat_policy: name: 'dot' is not one of 'none', 'dots', 'dots_with_context', "
         "'context', 'offload_qkv', 'offload_input', 'full'"),
    ],
)  # fmt: skip
def test_bad_knobs_and_configs_name_the_value_then_the_fixes(call, message):
    with pytest.raises(ValueError) as info:
        call()
    first, *rest = str(info.value).splitlines()
    assert first == message
    assert rest[0].startswith("Rule: ") and rest[1] == "Fixes:"


def test_the_builder_carries_the_decoders_rules_to_search():
    """`search` shards the decoder by `DECODER_RULES` without being given them (the
    embedding split over ``model`` too), as the command line does; a builder whose
    `Built` carries no rules is the reference: the jaxpr analysis alone holds more."""
    c = dataclasses.replace(SMALL, vocab=96, batch=8)
    exact = [("fsdp+tp", {"fsdp": 4, "model": 2})]
    carried = search(decoder_builder(c), devices=8, layouts=exact)
    given = search(decoder_builder(c), devices=8, layouts=exact, rules=DECODER_RULES)
    bare = search(lambda k: dataclasses.replace(decoder_builder(c)(k), rules=None), devices=8,
                  layouts=exact)  # fmt: skip
    assert carried[0].memory == given[0].memory
    assert carried[0].memory.state < bare[0].memory.state


def test_under_a_stage_axis_the_decoder_is_pipelined_and_exact():
    """The scanned decoder under a ``stage`` mesh runs its layers through
    `nnx_sharding.pipeline` (the program passes activations with collective-permutes)
    and gives the loss and gradients it gives without the mesh."""
    from jax.sharding import AxisType

    from nnx_sharding.plan._decoder.model import loss_fn

    config = dataclasses.replace(
        DECODER_CONFIGS["tiny"], scan=True, layers=4, compute_dtype="float32",
        pipeline_microbatches=4, pipeline_repeats=2,
    )  # fmt: skip
    with nnx.use_eager_sharding(False):
        model = nnx_sharding.plan.Decoder(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, config.vocab)
    grad = nnx.value_and_grad(loss_fn)
    loss, grads = grad(model, tokens)
    mesh = jax.make_mesh((2, 4), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        step = nnx.jit(grad)
        piped, piped_grads = step(model, tokens)
        text = step.lower(model, tokens).compile().as_text()
    assert "collective-permute" in text
    np.testing.assert_allclose(piped, loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(piped_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_vocabulary_tiling_gives_the_untiled_loss_and_holds_a_tile_of_logits(tied):
    """With ``vocab_tiles=4`` the loss and every gradient equal the untiled loss's, unsplit
    and under ``fsdp`` 2 × ``context`` 4 (Explicit axes); and the compiled step holds at
    least half of the float32 logits' bytes fewer temporaries (one tile in four)."""
    from jax.sharding import AxisType

    from nnx_sharding.plan._decoder.model import loss_fn

    config = dataclasses.replace(
        DECODER_CONFIGS["tiny"], vocab=2048, compute_dtype="float32", tied=tied, batch=4,
        seq_len=64,
    )  # fmt: skip
    tiled = dataclasses.replace(config, vocab_tiles=4)
    tokens = jax.random.randint(jax.random.key(0), (4, 65), 0, config.vocab)
    step = nnx.jit(nnx.value_and_grad(loss_fn))
    loss, grads = step(make(config), tokens)
    mesh = jax.make_mesh((2, 4), ("fsdp", "context"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        split_loss, split_grads = step(make(tiled), tokens)
    for got, got_grads in [(step(make(tiled), tokens)), (split_loss, split_grads)]:
        np.testing.assert_allclose(got, loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(grads), strict=True):
            # float32 sums in another order: a ten-thousandth of the gradient's scale
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))
    temps = [
        step.lower(abstract(c), tokens).compile().memory_analysis().temp_size_in_bytes
        for c in (config, tiled)
    ]
    logits = 4 * 64 * config.vocab * 4
    assert temps[1] <= temps[0] - logits / 2, (temps, logits)


@pytest.mark.parametrize("attention", ["splash", "blockwise", "triton"])
def test_the_context_policy_saves_the_attention_output_once(attention, saved_elements):
    """Under ``remat='context'`` a layer keeps one copy of the attention's output, in the
    kernel's layout: the kernel names it (splash: with its log-sum-exp, as MaxText does),
    and the decoder does not name it again in its own layout (a second copy in every
    layer)."""
    from nnx_sharding.plan._decoder.model import loss_fn

    c = dataclasses.replace(SMALL, head_dim=16, seq_len=128, layers=1, remat="context",
                            attention=attention)  # fmt: skip
    graphdef, state = nnx.split(make(c))
    tokens = jnp.zeros((c.batch, c.seq_len + 1), jnp.int32)
    saved = saved_elements(lambda s, t: loss_fn(nnx.merge(graphdef, s), t), state, tokens)
    out = c.batch * c.seq_len * c.heads * c.head_dim  # not the residual stream's size
    assert c.heads * c.head_dim != c.d_model
    assert saved.count(out) == 1, saved


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_loss_has_log_softmaxs_gradient_and_keeps_no_float32_softmax(dtype, capsys):
    """The loss's own gradient equals autodiff's through a float32 log-softmax (every
    parameter's); with bfloat16 logits its backward pass keeps them as they are (and a
    float32 log-sum-exp a token), where autodiff keeps a float32 tensor of logits."""
    from nnx_sharding.plan._decoder.model import loss_fn

    c = dataclasses.replace(SMALL, compute_dtype=dtype)

    def reference(model: Decoder, tokens: jax.Array) -> jax.Array:
        logp = jax.nn.log_softmax(model(tokens[:, :-1]).astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    model = make(c)
    tokens = jax.random.randint(jax.random.key(0), (c.batch, c.seq_len + 1), 0, c.vocab)
    (loss, grads), (want, want_grads) = (nnx.jit(nnx.value_and_grad(f))(model, tokens)
                                         for f in (loss_fn, reference))  # fmt: skip
    tol = 1e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(loss, want, rtol=tol)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(jnp.abs(b).max()))
    if dtype == "float32":
        return
    graphdef, state = nnx.split(model)
    logits = f"[{c.batch},{c.seq_len},{c.vocab}]"
    for f, kept in [(loss_fn, f"bf16{logits}"), (reference, f"f32{logits}")]:
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(
            lambda s, t, f=f: f(nnx.merge(graphdef, s), t), state, tokens
        )
        saved = capsys.readouterr().out
        assert kept in saved and (f"f32{logits}" in saved) == (f is reference), saved
