"""How `shard_map` lays out what crosses ``jax.shard_map`` and the jit around it.

- Specs: a prefix entry as jax wants it (`spec_of`); out_specs with each StateSharding
  as the tuple of its specs (`jax_prefix`), since each output graph node goes out as
  one list of leaves per filter (or as the nnx.State its out_specs entry was: `as_state`).
- Inputs: which are not yet laid out by their in_spec, so come back (`misplaced`).
- Outputs: `Flat`, the output leaves in the order the `OutPlan` lists them, which cross
  jit's boundary as the out_specs tree, so that jit's out_shardings can keep each spec
  as written.
- Errors: each input leaf's name in the caller's arguments (`in_sites`).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any, TypeAlias, cast

import jax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from . import _errors
from ._callpath.inside import InnerSplit
from ._callpath.outside import CallPlan, Leaf, unflatten_all, value_of
from ._nodes import format_path, is_node
from ._sharding import FromState, is_prefix_leaf
from ._state_sharding import StateSharding
from ._types import ShardingLike

Specs: TypeAlias = Any
"""A pytree prefix of PartitionSpecs, `StateSharding`s and Nones (None: replicated)."""
AxisName: TypeAlias = str


def spec_of(entry: ShardingLike) -> PartitionSpec:
    """One prefix entry as jax wants it: None replicates, a NamedSharding gives its spec."""
    if entry is None:
        return PartitionSpec()
    if isinstance(entry, NamedSharding):
        return entry.spec
    # a PartitionSpec; any other Sharding goes to jax.shard_map as given, which rejects it
    return cast(PartitionSpec, entry)


def jax_prefix(specs: Specs) -> Any:
    """The user's out_specs with each StateSharding replaced by the tuple of its specs."""

    def convert(entry: Any) -> Any:
        if isinstance(entry, StateSharding):
            return tuple(spec_of(s) for s in entry.shardings)
        return spec_of(entry)

    return jax.tree.map(convert, specs, is_leaf=is_prefix_leaf)


class _Order:
    """Where each leaf of a `Flat` goes: pytree metadata equal to any other `_Order`, so
    that jit's out_shardings, which cannot know it, match the output all the same.

    ``order[i]``: the place in the list of the ``i``-th leaf of the tree.
    """

    __slots__ = ("order", "identity")

    def __init__(self, order: Sequence[int]):
        self.order = tuple(order)
        self.identity = self.order == tuple(range(len(self.order)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Order)

    def __hash__(self) -> int:
        return 0


class Flat(list):  # type: ignore[type-arg]
    """The output leaves in the order the `OutPlan` lists them, crossing jit's boundary
    as the tree that ``jax.shard_map`` returned them in (the ``out_specs`` tree): so
    ``out_shardings`` built from ``out_specs`` keep each spec as written, ``P(None)``
    included (jit would otherwise give the compiler's normal form, ``P()``).
    """

    __slots__ = ("grouped", "_order")

    def __init__(self, grouped: Any, order: Sequence[int] | _Order):
        self._order = order if isinstance(order, _Order) else _Order(order)
        self.grouped = grouped
        leaves = jax.tree.leaves(grouped)
        if self._order.identity:
            super().__init__(leaves)
            return
        flat: list[Any] = [None] * len(self._order.order)
        for j, value in zip(self._order.order, leaves, strict=False):
            flat[j] = value
        super().__init__(flat)


jax.tree_util.register_pytree_node(
    Flat,
    lambda flat: ((flat.grouped,), flat._order),
    lambda order, children: Flat(children[0], order),
)


def axes_of(spec: PartitionSpec) -> set[Any]:
    """The mesh axis names a spec names (None among them for an unsharded dimension)."""
    return {a for part in spec for a in (part if isinstance(part, tuple) else (part,))}


def abstract_mesh(mesh: Mesh | AbstractMesh) -> AbstractMesh:
    return mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh


def _typed(spec: PartitionSpec, ndim: int, axes: Set[AxisName]) -> list[tuple[Any, ...]]:
    """Per dimension, the mesh axes of ``axes`` that ``spec`` shards it over."""
    parts = [*spec, *[None] * (ndim - len(spec))]
    return [
        tuple(a for a in (p if isinstance(p, tuple) else (p,)) if a in axes) for p in parts[:ndim]
    ]


def misplaced(leaf: Leaf, spec: PartitionSpec, mesh: AbstractMesh) -> bool:
    """Whether the traced input ``leaf`` is known not to be laid out by ``spec`` on
    ``mesh``: it is on no mesh or another one, or (the axes its type shows, Explicit
    ones) it is sharded otherwise. A committed array on the mesh's Auto axes shows no
    layout in its type: taken as laid out (see `ShardMapFn`)."""
    aval = jax.typeof(leaf)
    sharding = getattr(aval, "sharding", None)
    if sharding is None or sharding.mesh != mesh:
        return True
    explicit = {
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    }
    ndim = len(getattr(aval, "shape", ()))
    return bool(explicit) and _typed(sharding.spec, ndim, explicit) != _typed(spec, ndim, explicit)


def manual_part(entry: Any, manual: Set[AxisName]) -> Any:
    names = entry if isinstance(entry, tuple) else (entry,)
    kept = tuple(n for n in names if n is not None and n in manual)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def as_state(entry: FromState, groups: tuple[list[int], ...], where: str) -> nnx.State:
    """A node's output indices grouped by the filters of ``entry`` (one path each),
    laid out as the State it was read off: the tree its out_specs give jax there."""
    found = {f.path: group[0] for f, group in zip(entry.filters, groups, strict=True) if group}
    keyed, treedef = jax.tree_util.tree_flatten_with_path(entry.state, is_leaf=lambda x: x is None)
    paths = [tuple(getattr(key, "key", key) for key in keypath) for keypath, _ in keyed]
    if missing := [p for p in paths if p not in found]:
        detail = (
            f"the nnx.State at {where} has {format_path(missing[0])}, which the graph node lacks"
        )
        raise ValueError(_errors.not_a_prefix("shard_map", "out_specs", detail, "output"))
    return jax.tree_util.tree_unflatten(treedef, [found[p] for p in paths])


def in_sites(plan: CallPlan, leaves: Sequence[Leaf]) -> list[str]:
    """The caller's name of each flat input leaf (``args[0].linear.kernel``); for errors."""
    with nnx.merge_context() as ctx:
        nodes = unflatten_all(ctx, plan.graphdefs, leaves, plan.sizes)
    sites: list[str] = []
    with nnx.split_context() as ctx:
        for node, graphdef, where in zip(nodes, plan.graphdefs, plan.wheres, strict=True):
            if graphdef is None:
                sites.append(where)
            else:
                sites += [where + format_path(p) for p in ctx.flatten(node)[1].paths]
    return sites


def group_outputs(split: InnerSplit, state_sharding_sites: Sequence[str]) -> tuple[Any, list[int]]:
    """`ShardMapFn`'s output leaves arranged to match ``out_specs``, and their flat order.

    Each graph node of the output becomes a tuple with one list of leaves per
    filter of its StateSharding (one list for a plain spec).
    """
    nodes = {w for w, x in zip(split.out_wheres, split.out_leaves, strict=True) if is_node(x)}
    if stray := [w for w in state_sharding_sites if w not in nodes]:
        raise ValueError(_errors.state_sharding_above("shard_map", "out_specs", stray))
    per_leaf: list[Any] = []
    for leaf, entry in zip(split.out_leaves, split.out_entries, strict=True):
        n = len(entry.filters) if isinstance(entry, StateSharding) else 1
        per_leaf.append(tuple([] for _ in range(n)) if is_node(leaf) else None)
    for j, (item, k, path) in enumerate(
        zip(split.out_items, split.out_owner, split.out_paths, strict=True)
    ):
        entry = split.out_entries[k]
        if per_leaf[k] is None:
            per_leaf[k] = j
        else:
            assert path is not None  # a leaf of a graph node
            group = (
                entry.index_for(
                    path,
                    item,
                    transform="shard_map",
                    argument="out_specs",
                    where=split.out_wheres[k],
                )
                if isinstance(entry, StateSharding)
                else 0
            )
            per_leaf[k][group].append(j)
    for k, entry in enumerate(split.out_entries):
        if isinstance(entry, FromState) and per_leaf[k] is not None:
            per_leaf[k] = as_state(entry, per_leaf[k], split.out_wheres[k])
    indices = jax.tree_util.tree_unflatten(split.out_treedef, per_leaf)
    values = [value_of(x) for x in split.out_items]
    return jax.tree.map(lambda j: values[j], indices), jax.tree.leaves(indices)
