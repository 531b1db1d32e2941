"""Models and helpers shared by the hardening tests (issue 8) in this folder.

Only what more than one test file uses: the mesh and inputs, the models, `case` (one
row of a misuse table) and the misuse helpers both misuse files use, `Boom` (the user's
own error), and `record` / `assert_unchanged`: what a failed call must leave alone
(structure, object identity, values), and the check that it did.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding import StateSharding

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
X = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)
XX = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)


def named(*spec):
    return NamedSharding(MESH, P(*spec))


# --- models ---------------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.linear = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.linear(x))


class Counter(nnx.Module):
    """A Linear plus a call counter updated in place."""

    def __init__(self, seed: int = 0):
        self.lin = nnx.Linear(4, 3, rngs=nnx.Rngs(seed))
        self.count = nnx.BatchStat(jnp.array(0))

    def __call__(self, x):
        self.count[...] += 1
        return self.lin(x)


class Shared(nnx.Module):
    """The same Linear under two attribute names."""

    def __init__(self):
        self.first = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.second = self.first


def forward(model, x):
    return model(x)


def clone(node):
    """A copy with buffers of its own (`nnx.clone` shares the original's buffers)."""
    graphdef, state = nnx.split(node)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a.copy(), state))


# --- "unchanged": structure, object identity, values -----------------------------------


def _numpy(value):
    if isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    return np.array(value)


def record(*nodes):
    """What a failed call must leave alone: per node its graphdef; every graph object
    (Modules, nnx.List/Dict, Variables) with its path and identity; every value."""
    objects = [
        (i, path, obj)
        for i, node in enumerate(nodes)
        for path, obj in nnx.iter_graph(node)
        if isinstance(obj, (nnx.Pytree, nnx.Variable))
    ]
    variables = [obj for _, _, obj in objects if isinstance(obj, nnx.Variable)]
    return {
        "graphdefs": [nnx.graphdef(node) for node in nodes],
        "objects": [(i, path, id(obj)) for i, path, obj in objects],
        "keep_alive": [obj for _, _, obj in objects],  # ids stay unique while we compare
        "values": [_numpy(v.get_raw_value()) for v in variables],
    }


def assert_unchanged(before, *nodes):
    after = record(*nodes)
    assert after["graphdefs"] == before["graphdefs"], "structure changed"
    assert after["objects"] == before["objects"], "graph objects replaced, added or removed"
    assert len(after["values"]) == len(before["values"])
    for got, want in zip(after["values"], before["values"], strict=True):
        np.testing.assert_array_equal(got, want)


def variables_of(node):
    return [v for _, v in nnx.iter_graph(node) if isinstance(v, nnx.Variable)]


def assert_same_values(node, reference):
    got, want = variables_of(node), variables_of(reference)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(_numpy(a.get_raw_value()), _numpy(b.get_raw_value()), 1e-6, 1e-6)


# --- misuse tables ------------------------------------------------------------------


def case(case_id: str, trigger: Callable[[], Any], error, patterns: list[str], *, bug: str = ""):
    """One misuse: ``trigger()`` raises ``error`` whose message matches every regex in
    ``patterns``. ``bug``: a diagnosis; the case is then a strict xfail."""
    marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
    return pytest.param(trigger, error, patterns, id=case_id, marks=marks)


def jit_call(fun, *args, in_mesh: bool = True, **options):
    """``nnx_sharding.jit(fun, **options)(*args)``, inside ``MESH`` unless told not to.

    The arguments are built by the caller, outside the mesh: flax places Variables
    created inside a mesh on it eagerly (committed), which jit would then refuse to move.
    """
    with jax.set_mesh(MESH) if in_mesh else contextlib.nullcontext():
        return nnx_sharding.jit(fun, **options)(*args)


def kernel_spec(spec, rest=None) -> StateSharding:
    """``spec`` for kernels, ``rest`` for every other Variable."""
    return StateSharding({nnx.PathContains("kernel"): spec, ...: rest})


def _with_string_variable():
    model = Counter()
    model.label = nnx.Variable("not an array")
    return model


def _scaled(model, n, x):
    return model(x) * n


# --- errors ---------------------------------------------------------------------------


class Boom(Exception):
    """The user's own error, raised inside the transformed function."""


def check_misuse(trigger: Any, error: type[BaseException], patterns: list[str]) -> None:
    """A misuse-table case: ``trigger()`` raises ``error`` whose message matches every
    regex of ``patterns``."""
    with pytest.raises(error) as info:
        trigger()
    message = str(info.value)
    missing = [p for p in patterns if not re.search(p, message)]
    assert not missing, f"the message lacks {missing}:\n{message}"
