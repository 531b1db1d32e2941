"""The fresh process of tests/checkpoint/test_resume.py (issue 17, item 4), and what it
shares with the test: a model that draws random numbers, its adam optimizer, the
sharded train step and the batches, indexed by step.

    python tests/checkpoint/resume_worker.py DIR STEP STEPS OUT.npz

restores the checkpoint of step STEP from the `nnx_sharding.checkpoint.Manager` in DIR
into an abstract target laid out by `LAYOUT` on 8 CPU devices, trains STEPS more steps
and writes the state as restored and as trained to ``OUT.npz`` (`flat_state`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

if __name__ == "__main__":  # a process of its own: configured before any backend starts
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import nnx_sharding  # noqa: E402
from nnx_sharding import recipes  # noqa: E402

DIN, HIDDEN, DOUT, BATCH = 16, 64, 8, 32


class Net(nnx.Module):
    """An MLP with dropout (an `nnx.Rngs` stream of its own) and input noise drawn from
    the model's `nnx.Rngs`: every call advances two Rngs counts."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(DIN, HIDDEN, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, DOUT, rngs=rngs)
        self.rngs = nnx.Rngs(noise=7)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + 0.01 * jax.random.normal(self.rngs.noise(), x.shape)
        return self.down(self.drop(nnx.relu(self.up(x))))


def make() -> tuple[Net, nnx.Optimizer[Net]]:
    """The model and its adam optimizer, as a fresh run starts them."""
    model = Net(nnx.Rngs(params=0, dropout=1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def mesh() -> jax.sharding.Mesh:
    return recipes.make_mesh({"model": 8})


def layout() -> nnx_sharding.StateSharding:
    """Megatron over the 8 devices for the kernels, ``up``'s bias and their adam
    moments; the rest (biases, counts, Rngs keys and counts) replicated."""
    return recipes.on_mesh(mesh(), recipes.megatron_sharding())


def make_step():
    """The jitted train step: in place on model and optimizer, Rngs included."""
    rules, replicated = layout(), NamedSharding(mesh(), P())

    @nnx_sharding.jit(in_shardings=(rules, rules, replicated, replicated))
    def step(model: Net, optimizer: nnx.Optimizer[Net], x: jax.Array, y: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: recipes.mse(m(x), y))(model)
        optimizer.update(model, grads)
        return loss

    return step


def batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of step ``i``: the same in every process."""
    rng = np.random.default_rng(i)
    x = rng.standard_normal((BATCH, DIN), dtype=np.float32)
    return x, np.sin(x[:, :DOUT])


def train(model: Net, optimizer: nnx.Optimizer[Net], first: int, steps: int) -> list[float]:
    """Steps ``first`` to ``first + steps``; their losses."""
    step = make_step()
    losses = []
    for i in range(first, first + steps):
        losses.append(float(step(model, optimizer, *map(jnp.asarray, batch(i)))))
    return losses


def flat_state(tree: object) -> dict[str, np.ndarray]:
    """Every Variable of ``tree`` by path, as numpy (a PRNG key as its key data), with its
    type name: ``'1/opt_state/0/mu/up/kernel:OptVariable'``."""
    out = {}
    for path, variable in nnx.to_flat_state(nnx.state(tree)):
        value = variable.get_value()
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        out[f"{'/'.join(map(str, path))}:{type(variable).__name__}"] = np.asarray(value)
    return out


def main(directory: Path, at: int, steps: int, out: Path) -> None:
    from nnx_sharding import checkpoint

    with checkpoint.Manager(directory) as manager:
        model, optimizer = manager.restore(nnx.eval_shape(make), step=at, shardings=layout())
    restored = flat_state((model, optimizer))
    specs = {
        "/".join(map(str, path)): str(v.get_value().sharding.spec)
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    losses = train(model, optimizer, at, steps)
    trained = flat_state((model, optimizer))
    np.savez(
        out,
        losses=np.asarray(losses),
        specs=np.asarray(json.dumps(specs)),
        **{f"restored|{k}": v for k, v in restored.items()},
        **{f"trained|{k}": v for k, v in trained.items()},
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
