"""Hardening (issue 8), item 5, property-based: random module graphs through an identity
and a mutating `jit`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hardening_common import (
    MESH,
    Shared,
    assert_same_values,
    assert_unchanged,
    record,
    variables_of,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding import StateSharding


class Tally(nnx.Variable):
    """A Variable type of the user's own."""


class Node(nnx.Module):
    def __init__(self, children: dict[str, Any], statics: dict[str, Any]):
        for name, value in {**children, **statics}.items():
            setattr(self, name, value)


VARIABLE_TYPES = [nnx.Param, nnx.BatchStat, nnx.Cache, Tally]
SHAPES = [(8,), (4, 2), (8, 3)]  # leading dimension divisible by both mesh axes
SPECS = [P(), P("model"), P("data")]

names = st.sampled_from("abcde")
variable = st.tuples(
    st.just("var"),
    st.integers(0, len(VARIABLE_TYPES) - 1),
    st.sampled_from(SHAPES),
    st.sampled_from(["float32", "int32"]),
    st.integers(0, len(SPECS) - 1),
    st.integers(0, 100),
)
reference = st.tuples(st.just("ref"), st.integers(0, 63))
statics = st.dictionaries(
    st.sampled_from(["label", "size", "dims"]),
    st.one_of(st.integers(-3, 3), st.text("xyz", max_size=3), st.tuples(st.integers(0, 3))),
    max_size=2,
)
graphs = st.tuples(
    st.just("module"),
    st.dictionaries(
        names,
        st.recursive(
            st.one_of(variable, reference),
            lambda inner: st.one_of(
                st.tuples(st.just("module"), st.dictionaries(names, inner, max_size=3), statics),
                st.tuples(st.just("list"), st.lists(inner, max_size=3)),
                st.tuples(st.just("dict"), st.dictionaries(names, inner, max_size=3)),
            ),
            max_leaves=8,
        ),
        min_size=1,
        max_size=3,
    ),
    statics,
)
"""A recipe: ``("module", {name: child}, {name: static})``; a child is a recipe, a
``("list", [...])``, a ``("dict", {...})``, a Variable ``("var", type, shape, dtype,
spec, seed)``, or ``("ref", k)``: the k-th (mod n) object completed so far, shared."""


def build(recipe, place: bool = True):
    """A fresh graph from a recipe; equal recipes give equal, unshared graphs. ``place``:
    put each Variable on MESH with its spec (committed), else leave it uncommitted."""
    done: list[Any] = []

    def make(r):
        kind = r[0]
        if kind == "ref":
            if not done:
                return make(("var", 0, (8,), "float32", 0, r[1]))
            return done[r[1] % len(done)]
        if kind == "var":
            _, t, shape, dtype, spec, seed = r
            value = (jnp.arange(math.prod(shape)) + seed).reshape(shape).astype(dtype)
            if place:
                value = jax.device_put(value, NamedSharding(MESH, SPECS[spec]))
            obj = VARIABLE_TYPES[t](value)
        elif kind == "module":
            obj = Node({k: make(v) for k, v in r[1].items()}, r[2])
        elif kind == "list":
            obj = nnx.List([make(c) for c in r[1]])
        else:
            obj = nnx.Dict({k: make(v) for k, v in r[1].items()})
        done.append(obj)
        return obj

    return make(recipe)


def unique_variables(root):
    seen, out = set(), []
    for _, v in nnx.iter_graph(root):
        if isinstance(v, nnx.Variable) and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def mutate(root, grow: bool):
    """Updates every Variable once (shared ones too); may add a Variable to the root."""
    total = jnp.zeros(())
    for v in unique_variables(root):
        v[...] = v[...] * 2 + 1
        total = total + v[...].sum().astype(jnp.float32)
    if grow:
        root.grown = nnx.Param(total)
    return root, total


def specs(root):
    return [getattr(v.get_raw_value().sharding, "spec", None) for v in variables_of(root)]


def sharing(root):
    """The aliasing pattern: every group of paths that reach one object."""
    return sorted(sorted(map(tuple, group)) for group in nnx.find_duplicates(root))


PROPERTY = settings(
    max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@PROPERTY
@given(recipe=graphs)
def test_identity_jit_keeps_graphs_exactly(recipe):
    root = build(recipe)
    before, placed = record(root), specs(root)
    out = nnx_sharding.jit(lambda m: m)(root)
    assert out is root
    assert_unchanged(before, root)
    assert specs(root) == placed


@PROPERTY
@given(recipe=graphs, grow=st.booleans())
def test_mutating_jit_matches_eager_and_keeps_identity_and_sharding(recipe, grow):
    root, ref = build(recipe), build(recipe)
    before, placed, aliasing = record(root), specs(root), sharing(root)
    f = nnx_sharding.jit(mutate, static_argnums=1)
    for _ in range(1 if grow else 2):  # a second call takes the fast path
        out, total = f(root, grow)
        ref_out, ref_total = mutate(ref, grow)
        assert out is root
        np.testing.assert_allclose(total, ref_total, rtol=1e-6)
    assert nnx.graphdef(root) == nnx.graphdef(ref)
    assert_same_values(root, ref)
    kept = {oid for _, _, oid in record(root)["objects"]}
    assert all(oid in kept for _, _, oid in before["objects"]), "an input object was replaced"
    if not grow:
        assert record(root)["objects"] == before["objects"]
        assert sharing(root) == aliasing
        assert specs(root) == placed


@PROPERTY
@given(
    recipe=graphs,
    by_type=st.lists(st.sampled_from([None, *SPECS]), min_size=len(VARIABLE_TYPES), max_size=4),
)
def test_state_sharding_by_type_places_every_variable(recipe, by_type):
    root, ref = build(recipe, place=False), build(recipe, place=False)
    wanted = dict(zip(VARIABLE_TYPES, by_type, strict=True))
    f = nnx_sharding.jit(mutate, static_argnums=1, in_shardings=(StateSharding(wanted),))
    aliasing = sharing(root)
    with jax.set_mesh(MESH):
        f(root, False)
    mutate(ref, False)
    assert nnx.graphdef(root) == nnx.graphdef(ref)
    assert sharing(root) == aliasing
    assert_same_values(root, ref)
    for v in variables_of(root):
        spec = wanted[type(v)]
        if spec is not None:
            assert v.get_raw_value().sharding == NamedSharding(MESH, spec), type(v).__name__


def test_state_sharding_from_nnx_state_of_a_graph_with_shared_variables():
    model = Shared()
    sharding = StateSharding(nnx.get_named_sharding(nnx.state(model), MESH))
    nnx_sharding.jit(bump_first, in_shardings=sharding)(model)
    assert model.first is model.second
    np.testing.assert_allclose(model.first.kernel[...], Shared().first.kernel[...] + 1.0)


def bump_first(model):
    model.first.kernel[...] += 1.0
