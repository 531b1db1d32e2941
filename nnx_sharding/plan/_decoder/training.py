"""Training steps: gradient accumulation over microbatches, the decoder's AdamW step,
and `decoder_builder`, the step builder `plan.search` takes.

Gradient accumulation is a ``jax.lax.scan`` over microbatches inside the step, as
MaxText writes it (``gradient_accumulation_steps``), rather than ``optax.MultiSteps``:
the step stays one optimizer update per call, so what the planner compiles is one
optimizer step of the whole batch, and its memory is one microbatch's activations plus
one float32 gradient accumulator; ``optax.MultiSteps`` instead calls the step once per
microbatch, its update skipped on all but the last, and keeps the accumulator in the
optimizer state (one more copy of the parameters, in every checkpoint).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ... import _errors
from .._built import Built
from .activation_sharding import activation_spec
from .configs import DECODER_RULES, DecoderConfig
from .model import Decoder, loss_fn

KNOBS: dict[str, Any] = {
    "remat": "none",
    "microbatches": 1,
    "pipeline_microbatches": None,
    "pipeline_repeats": 1,
    "context_strategy": "all_gather",
}
"""The knobs `decoder_builder`'s ``build`` takes, and their defaults."""


def accumulate_gradients(
    loss: Callable[..., jax.Array], model: nnx.Module, batch: Any, microbatches: int
) -> tuple[jax.Array, nnx.State[Any, Any]]:
    """``nnx.value_and_grad(loss)(model, batch)`` (gradients of the ``nnx.Param``\\ s),
    computed ``microbatches`` rows of the batch at a time and averaged: a scan whose
    float32 accumulator is the only extra memory. For a loss that is a mean over equal
    microbatches, the big batch's loss and gradients.

    Every array of ``batch`` is split on its leading axis: microbatch ``i`` takes rows
    ``i, i + microbatches, ...``, so that each keeps the batch's data-parallel split.

    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> mse = lambda m, x: jnp.mean(m(x) ** 2)
    >>> x = jnp.arange(8.0).reshape(4, 2)
    >>> loss, grads = accumulate_gradients(mse, model, x, 2)
    >>> bool(jnp.allclose(loss, mse(model, x)))
    True
    """
    leaves = jax.tree.leaves(batch)
    size = leaves[0].shape[0] if leaves else 0
    if not isinstance(microbatches, int) or microbatches < 1 or size % microbatches:
        raise ValueError(
            _errors.microbatches_indivisible("accumulate_gradients", microbatches, size)
        )
    if microbatches == 1:
        return nnx.value_and_grad(loss)(model, batch)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def split(x: jax.Array) -> jax.Array:
        # rows (r // k, r % k), then microbatch-major: the batch's split stays on axis 1
        x = x.reshape(size // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
        spec = activation_spec(x.shape, (None, "activation_batch", *[None] * (x.ndim - 2)))
        return x if spec is None else jax.lax.with_sharding_constraint(x, spec)

    def one(p: nnx.State, micro: Any) -> jax.Array:
        return loss(nnx.merge(graphdef, p, rest), micro)

    def step(carry: Any, micro: Any) -> tuple[Any, None]:
        total, grads = carry
        value, g = jax.value_and_grad(one)(params, micro)
        grads = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g)
        return (total + value.astype(jnp.float32), grads), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    start = (jnp.zeros((), jnp.float32), zeros)
    (total, grads), _ = jax.lax.scan(step, start, jax.tree.map(split, batch))
    grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype), grads, params)
    return total / microbatches, grads


def make_train_step(
    microbatches: int = 1, loss: Callable[..., jax.Array] = loss_fn
) -> Callable[[nnx.Module, nnx.Optimizer, Any], jax.Array]:
    """``step(model, optimizer, batch) -> loss``: the gradients of ``loss`` (the
    decoder's next-token loss by default) over ``microbatches`` microbatches
    (`accumulate_gradients`), then one optimizer update, in place.

    >>> import optax
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> step = make_train_step(2, lambda m, x: jnp.mean(m(x) ** 2))
    >>> float(step(model, optimizer, jnp.ones((4, 2)))) > 0
    True
    """

    def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> jax.Array:
        value, grads = accumulate_gradients(loss, model, batch, microbatches)
        optimizer.update(model, grads)
        return value

    return train_step


def decoder_builder(config: DecoderConfig) -> Callable[[Mapping[str, Any]], Built]:
    """A step builder for ``config``: ``build(knobs)`` gives the decoder's AdamW step
    with ``knobs`` applied (``remat``: a name in `REMAT_POLICIES`, default ``'none'``;
    ``microbatches``: gradient accumulation, default 1; ``pipeline_microbatches`` and
    ``pipeline_repeats``: the pipeline's, under a mesh with a ``stage`` axis;
    ``context_strategy``: the attention's under a ``context`` axis; see
    `DecoderConfig`), its abstract arguments (the
    model, the optimizer, the ``(batch, seq_len + 1)`` int32 tokens; built with
    ``nnx.eval_shape``, never allocated), ``donate_argnums=(0, 1)``,
    `DecoderConfig.model_flops`, `DECODER_RULES` (which `search` uses unless given
    other ``rules``) and the sequence length (``sequence``: context parallelism splits it).

    >>> from nnx_sharding.plan import DECODER_CONFIGS
    >>> build = decoder_builder(DECODER_CONFIGS['tiny'])
    >>> built = build({'remat': 'dots', 'microbatches': 2})
    >>> built.args[2].shape, built.jit_options
    ((8, 65), {'donate_argnums': (0, 1)})
    """

    def build(knobs: Mapping[str, Any]) -> Built:
        unknown = [k for k in knobs if k not in KNOBS]
        if unknown:
            raise ValueError(_errors.decoder_unknown_knobs(unknown, KNOBS))
        # each knob asked for by name: a search learns which ones the step reads
        knobs = {name: knobs.get(name, default) for name, default in KNOBS.items()}
        c = dataclasses.replace(
            config,
            remat=knobs["remat"],
            pipeline_microbatches=knobs["pipeline_microbatches"],
            pipeline_repeats=knobs["pipeline_repeats"],
            context_strategy=knobs["context_strategy"],
        )
        k = knobs["microbatches"]
        if not isinstance(k, int) or isinstance(k, bool) or k < 1 or c.batch % k:
            raise ValueError(_errors.microbatches_indivisible("decoder_builder", k, c.batch))

        import optax

        def create() -> tuple[Decoder, nnx.Optimizer]:
            model = Decoder(c, rngs=nnx.Rngs(0))
            return model, nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

        with nnx.use_eager_sharding(False):
            model, optimizer = nnx.eval_shape(create)
        tokens = jax.ShapeDtypeStruct((c.batch, c.seq_len + 1), jnp.int32)
        return Built(
            step=make_train_step(k),
            args=(model, optimizer, tokens),
            jit_options={"donate_argnums": (0, 1)},
            model_flops=c.model_flops(),
            rules=DECODER_RULES,
            sequence=c.seq_len,
        )

    return build
