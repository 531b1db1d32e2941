"""Models, layouts and snapshots shared by the checkpoint tests (issue 17, items 1, 5, 6)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Sharding

import nnx_sharding
from nnx_sharding import recipes
from nnx_sharding.recipes import MLP

Path: TypeAlias = tuple[Any, ...]
Tree: TypeAlias = Any

DIN, HIDDEN, DOUT = 16, 64, 8
_STEP = recipes.reference_step()  # compiled once per shape


def build(seed: int, hidden: int = HIDDEN) -> tuple[MLP, nnx.Optimizer[MLP]]:
    """An MLP and its adam optimizer after one step, so that every Variable (moments,
    count, step) holds something other than its initial value."""
    model = MLP(DIN, hidden, DOUT, rngs=nnx.Rngs(seed))
    optimizer = recipes.make_optimizer(model)
    x, y = recipes.make_batches(1, 8, DIN, DOUT, seed=seed)[0]
    _STEP(model, optimizer, x, y)
    return model, optimizer


def abstract(hidden: int = HIDDEN) -> tuple[MLP, nnx.Optimizer[MLP]]:
    """`build`'s structure, nothing allocated."""
    return nnx.eval_shape(lambda: build_fresh(0, hidden))


def build_fresh(seed: int, hidden: int = HIDDEN) -> tuple[MLP, nnx.Optimizer[MLP]]:
    model = MLP(DIN, hidden, DOUT, rngs=nnx.Rngs(seed))
    return model, recipes.make_optimizer(model)


def place(tree: Tree, shardings: Any) -> Tree:
    """Lays ``tree`` out as ``shardings`` (a prefix of it) says, in place."""

    @nnx_sharding.jit(in_shardings=(shardings,))
    def touch(tree: Tree) -> None:
        del tree

    touch(tree)
    return tree


def values(tree: Tree) -> dict[Path, np.ndarray]:
    """Every Variable's value as numpy, by path (a PRNG key as its key data)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(tree)):
        value = var.get_value()
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        out[tuple(path)] = np.asarray(value)
    return out


def shardings(tree: Tree) -> dict[Path, Sharding]:
    return {tuple(p): v.get_value().sharding for p, v in nnx.to_flat_state(nnx.state(tree))}


def assert_same_values(tree: Tree, expected: Mapping[Path, np.ndarray]) -> None:
    got = values(tree)
    assert sorted(got, key=str) == sorted(expected, key=str)
    for path, value in expected.items():
        np.testing.assert_array_equal(got[path], value, err_msg=str(path))


def assert_laid_out(tree: Tree, expected: Mapping[Path, Sharding]) -> None:
    """Every Variable's array is placed as ``expected`` says (equivalent shardings)."""
    for path, var in nnx.to_flat_state(nnx.state(tree)):
        value = var.get_value()
        want = expected[tuple(path)]
        assert value.sharding.is_equivalent_to(want, value.ndim), (path, value.sharding, want)


class Stateful(nnx.Module):
    """Every kind of state a checkpoint must keep: parameters, BatchNorm statistics,
    an Rngs (an rbg key and its count) used by Dropout, and a Variable shared by two
    paths."""

    def __init__(self, seed: int):
        rngs = nnx.Rngs(seed, dropout=jax.random.key(seed + 100, impl="rbg"))
        self.linear = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.same_linear = self.linear  # shared: saved once

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.drop(self.norm(self.same_linear(x)))


def used_stateful(seed: int) -> Stateful:
    """A `Stateful` after two training calls: statistics, key and count all moved."""
    model = Stateful(seed)
    for i in range(2):
        model(jnp.arange(12.0).reshape(3, 4) + i)
    return model
