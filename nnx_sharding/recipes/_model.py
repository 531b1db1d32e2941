"""The model every recipe trains, its data, loss, optimizer and single-device reference."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec, Sharding

Array: TypeAlias = jax.Array
Batch: TypeAlias = tuple[Array, Array]
"""Inputs ``x`` of shape ``(batch, din)`` and targets ``y`` of shape ``(batch, dout)``."""
Step: TypeAlias = Callable[["MLP", "nnx.Optimizer[MLP]", Array, Array], Array]
"""``step(model, optimizer, x, y) -> loss``: one optimizer step, in place."""
OnStep: TypeAlias = Callable[[int, Array], None]
"""``on_step(index, loss)``, called after each step of `train`."""
M = TypeVar("M", bound=nnx.Module)


class MLP(nnx.Module):
    """``down(relu(up(x)))``: two ``nnx.Linear`` layers named for the sharding filters.

    >>> from flax import nnx
    >>> model = MLP(2, 8, 3, rngs=nnx.Rngs(0))
    >>> model(jnp.ones((4, 2))).shape
    (4, 3)
    """

    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        self.up: nnx.Linear = nnx.Linear(din, hidden, rngs=rngs)
        self.down: nnx.Linear = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return self.down(nnx.relu(self.up(x)))


def mse(prediction: Array, target: Array) -> Array:
    """The mean squared error, the loss of every recipe.

    >>> float(mse(jnp.ones(4), jnp.zeros(4)))
    1.0
    """
    return jnp.mean((prediction - target) ** 2)


def make_optimizer(model: M, learning_rate: float = 1e-2) -> nnx.Optimizer[M]:
    """``nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)``.

    Adam's moments mirror the parameters' paths (``opt_state[0].mu.up.kernel``), so a
    `StateSharding` of path filters shards them like the parameters.

    >>> from flax import nnx
    >>> optimizer = make_optimizer(MLP(2, 8, 3, rngs=nnx.Rngs(0)))
    >>> optimizer.opt_state[0].mu['up']['kernel'].shape
    (2, 8)
    """
    return nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)


def make_batches(n: int, batch: int, din: int, dout: int, *, seed: int = 0) -> list[Batch]:
    """``n`` batches of a smooth regression task, ``y = sin(x @ w)`` for a fixed ``w``.

    Made with numpy and left uncommitted on the default device: `train` (or the
    step's ``in_shardings``) places them.

    >>> [a.shape for a in make_batches(3, 16, 2, 4)[0]]
    [(16, 2), (16, 4)]
    """
    rng = np.random.default_rng(seed)  # numpy: no jax compilations for the data
    w = rng.standard_normal((din, dout), dtype=np.float32) / np.float32(np.sqrt(din))
    xs = rng.standard_normal((n, batch, din), dtype=np.float32)
    ys = np.sin(xs @ w)
    return [(jnp.asarray(xs[i]), jnp.asarray(ys[i])) for i in range(n)]


def reference_step() -> Step:
    """The plain flax step (``nnx.jit``, one device) the recipes are checked against.

    >>> from flax import nnx
    >>> model = MLP(2, 8, 3, rngs=nnx.Rngs(0))
    >>> loss = reference_step()(model, make_optimizer(model), jnp.ones((4, 2)), jnp.ones((4, 3)))
    >>> loss.shape
    ()
    """

    @nnx.jit
    def step(model: MLP, optimizer: nnx.Optimizer[MLP], x: Array, y: Array) -> Array:
        loss, grads = nnx.value_and_grad(lambda m: mse(m(x), y))(model)
        optimizer.update(model, grads)
        return loss

    return step


def train(
    step: Step,
    model: MLP,
    optimizer: nnx.Optimizer[MLP],
    batches: Sequence[Batch],
    steps: int,
    *,
    sharding: Sharding | None = None,
    on_step: OnStep | None = None,
) -> np.ndarray:
    """Runs ``steps`` steps over ``batches`` (cycled); returns the losses as floats.

    ``sharding``, if given, places the batches once up front (e.g. the step's batch
    sharding), instead of at every call of the step.

    >>> from flax import nnx
    >>> model = MLP(2, 8, 3, rngs=nnx.Rngs(0))
    >>> batches = make_batches(2, 4, 2, 3)
    >>> train(reference_step(), model, make_optimizer(model), batches, 5).shape
    (5,)
    """
    if sharding is not None:
        batches = jax.device_put(list(batches), sharding)
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        loss = step(model, optimizer, x, y)
        losses.append(loss)
        if on_step is not None:
            on_step(i, loss)
    return np.array([float(loss) for loss in losses], dtype=np.float32)


def max_param_diff(model: nnx.Module, reference: nnx.Module) -> float:
    """The largest ``|a - b|`` over all parameters of two models of the same structure.

    >>> from flax import nnx
    >>> max_param_diff(MLP(2, 8, 3, rngs=nnx.Rngs(0)), MLP(2, 8, 3, rngs=nnx.Rngs(0)))
    0.0
    """
    pairs = zip(
        nnx.to_flat_state(nnx.state(model, nnx.Param)),
        nnx.to_flat_state(nnx.state(reference, nnx.Param)),
        strict=True,
    )
    return max(
        (
            float(np.max(np.abs(np.asarray(a[...]) - np.asarray(b[...]))))
            for (_, a), (_, b) in pairs
        ),
        default=0.0,
    )


def param_specs(model: nnx.Module) -> dict[str, PartitionSpec | None]:
    """``'up.kernel' -> PartitionSpec`` of each parameter (None: not a NamedSharding).

    >>> from flax import nnx
    >>> list(param_specs(MLP(2, 8, 3, rngs=nnx.Rngs(0))))
    ['down.bias', 'down.kernel', 'up.bias', 'up.kernel']
    """
    return {
        ".".join(map(str, path)): getattr(param[...].sharding, "spec", None)
        for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
