"""`shard_map`: ``jax.shard_map`` over NNX graph nodes, with NNX semantics.

A call runs through the same cached path as `jit` (`_cache.CachedCall`): the
arguments are split into flat arrays, and the plan's jitted function wraps one
``jax.shard_map`` over them. Inside, each device merges its own shards back into
modules, runs the function and splits the result again:

- the inputs' leaves come back whole, each with the spec it came in with, so a
  Variable update inside the body reaches the caller laid out as that Variable is;
- the output's graph nodes come back as one list of leaves per `StateSharding`
  filter, so the user's ``out_specs`` prefix (a StateSharding becomes the tuple
  of its specs) matches whatever number of Variables each filter catches.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence, Set
from typing import Any, ParamSpec, TypeVar, overload

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jax.tree_util import keystr

from . import _errors
from ._cache import CachedCall
from ._graph import (
    FAST_CALL,
    CallPlan,
    CallSpec,
    InnerSplit,
    Leaf,
    NeedsTrace,
    changed_structure,
    merge_inputs,
    snapshots,
    split_inner,
    value_of,
)
from ._sharding import ShardingLike, StateSharding, is_node, is_prefix_leaf

P = ParamSpec("P")
R = TypeVar("R")
Specs = Any
"""A pytree prefix of PartitionSpecs, `StateSharding`s and Nones (None: replicated)."""
AxisName = str


def _spec(entry: ShardingLike) -> PartitionSpec:
    """One prefix entry as jax wants it: None replicates, a NamedSharding gives its spec."""
    if entry is None:
        return PartitionSpec()
    return entry.spec if isinstance(entry, NamedSharding) else entry


def _jax_prefix(specs: Specs) -> Any:
    """The user's out_specs with each StateSharding replaced by the tuple of its specs."""

    def convert(entry: Any) -> Any:
        if isinstance(entry, StateSharding):
            return tuple(_spec(s) for s in entry.shardings)
        return _spec(entry)

    return jax.tree.map(convert, specs, is_leaf=is_prefix_leaf)


def _manual_part(entry: Any, manual: Set[AxisName]) -> Any:
    names = entry if isinstance(entry, tuple) else (entry,)
    kept = tuple(n for n in names if n is not None and n in manual)
    return None if not kept else kept[0] if len(kept) == 1 else kept


class ShardMapFn(CachedCall[P, R]):
    """A shard-mapped function over NNX graph nodes; what `shard_map` returns.

    Calls run under ``jax.jit``; ``trace``, ``lower`` and ``eval_shape`` work as on
    a `JitWrapped`.
    """

    def __init__(
        self,
        fun: Callable[P, R],
        *,
        out_specs: Specs,
        in_specs: Specs | None = None,
        mesh: Mesh | AbstractMesh | None = None,
        axis_names: Set[AxisName] = frozenset(),
        check_vma: bool = True,
        auto: Set[AxisName] = frozenset(),
    ):
        spec = CallSpec(
            "shard_map",
            in_shardings=in_specs,
            out_shardings=out_specs,
            in_name="in_specs",
            out_name="out_specs",
        )
        super().__init__(fun, spec)
        self.mesh = mesh
        self.axis_names = frozenset(axis_names)
        self.check_vma = check_vma
        self._auto = frozenset(auto)
        self._infer = in_specs is None
        self._out_prefix = _jax_prefix(out_specs)
        keyed = jax.tree_util.tree_flatten_with_path(out_specs, is_leaf=is_prefix_leaf)[0]
        self._state_sharding_sites = [
            f"output{keystr(kp)}" for kp, x in keyed if isinstance(x, StateSharding)
        ]

    def _mesh(self) -> Mesh | AbstractMesh:
        if self.mesh is not None:
            return self.mesh
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                _errors.no_mesh(
                    "shard_map", "shard_map maps over the axes of a mesh", "mesh=jax.make_mesh(...)"
                )
            )
        return mesh

    def _manual_axes(self, mesh: Mesh | AbstractMesh) -> frozenset[AxisName]:
        if self._auto:
            return frozenset(mesh.axis_names) - self._auto
        return self.axis_names or frozenset(mesh.axis_names)

    def _in_specs(
        self, plan: CallPlan, leaves: Sequence[Leaf], mesh: Mesh | AbstractMesh
    ) -> list[PartitionSpec]:
        """One spec per flat leaf: from in_specs, or read off explicitly sharded types."""
        if not self._infer:
            return [_spec(s) for s in plan.shardings]
        manual = self._manual_axes(mesh)
        types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
        if wrong := sorted(a for a in manual if types[a] != AxisType.Explicit):
            raise TypeError(_errors.cannot_infer_specs("shard_map", wrong))
        return [
            PartitionSpec(*(_manual_part(e, manual) for e in jax.typeof(leaf).sharding.spec))
            for leaf in leaves
        ]

    def _build(self, plan: CallPlan) -> Callable[..., Any]:
        def outer(donated: list[Leaf], kept: list[Leaf]) -> tuple[Any, list[Leaf], list[Leaf]]:
            if FAST_CALL.active:
                raise NeedsTrace
            leaves = plan.join(donated, kept)
            mesh = self._mesh()
            in_specs = self._in_specs(plan, leaves, mesh)
            if not self._infer and AxisType.Explicit in mesh.axis_types:
                # on Explicit axes jax.shard_map takes arguments already laid out by spec
                leaves = [
                    jax.reshard(x, NamedSharding(mesh, s))
                    for x, s in zip(leaves, in_specs, strict=True)
                ]
            found: list[tuple[Any, list[int]]] = []

            def body(leaves: list[Leaf]) -> tuple[list[Leaf], Any]:
                args, kwargs, call_leaves = merge_inputs(plan, leaves)
                before = snapshots(call_leaves)
                split = split_inner(plan, call_leaves, before, self.fun(*args, **kwargs))
                if not split.kept_structure:
                    wheres = changed_structure(plan, before)
                    raise ValueError(
                        _errors.structure_changed(
                            "shard_map",
                            "arguments",
                            wheres,
                            "inside shard_map each device holds its own shard of a module",
                            "shard_map, before or after the call",
                        )
                    )
                grouped, order = self._group(split)
                changed = tuple(
                    i
                    for i in plan.state_indices
                    if value_of(split.in_items[i]) is not leaves[i] or plan.donate[i]
                )
                found.append((split.out_plan(changed), order))
                return [value_of(x) for x in split.in_items], grouped

            mapped = jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(in_specs,),
                out_specs=(in_specs, self._out_prefix),
                axis_names=self._manual_axes(mesh),
                check_vma=self.check_vma,
            )
            in_full, grouped = mapped(list(leaves))
            out_plan, order = found[-1]
            out_flat: list[Leaf] = [None] * len(order)
            for j, value in zip(order, jax.tree.leaves(grouped), strict=True):
                out_flat[j] = value
            return out_plan, [in_full[i] for i in out_plan.in_changed], out_flat

        outer.__name__ = getattr(self.fun, "__name__", "fun")
        return jax.jit(outer, donate_argnums=0 if any(plan.donate) else ())

    def _group(self, split: InnerSplit) -> tuple[Any, list[int]]:
        """The output leaves arranged to match ``out_specs``, and their flat order.

        Each graph node of the output becomes a tuple with one list of leaves per
        filter of its StateSharding (one list for a plain spec).
        """
        nodes = {w for w, x in zip(split.out_wheres, split.out_leaves, strict=True) if is_node(x)}
        if stray := [w for w in self._state_sharding_sites if w not in nodes]:
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
        indices = jax.tree_util.tree_unflatten(split.out_treedef, per_leaf)
        values = [value_of(x) for x in split.out_items]
        return jax.tree.map(lambda j: values[j], indices), jax.tree.leaves(indices)


@overload
def shard_map(
    f: Callable[P, R],
    /,
    *,
    out_specs: Specs,
    in_specs: Specs | None = None,
    mesh: Mesh | AbstractMesh | None = None,
    axis_names: Set[AxisName] = frozenset(),
    check_vma: bool = True,
    check_rep: bool | None = None,
    auto: Set[AxisName] | None = None,
) -> ShardMapFn[P, R]: ...
@overload
def shard_map(
    f: None = None,
    /,
    *,
    out_specs: Specs,
    in_specs: Specs | None = None,
    mesh: Mesh | AbstractMesh | None = None,
    axis_names: Set[AxisName] = frozenset(),
    check_vma: bool = True,
    check_rep: bool | None = None,
    auto: Set[AxisName] | None = None,
) -> Callable[[Callable[P, R]], ShardMapFn[P, R]]: ...
def shard_map(
    f: Callable[P, R] | None = None,
    /,
    *,
    out_specs: Specs,
    in_specs: Specs | None = None,
    mesh: Mesh | AbstractMesh | None = None,
    axis_names: Set[AxisName] = frozenset(),
    check_vma: bool = True,
    check_rep: bool | None = None,
    auto: Set[AxisName] | None = None,
) -> Any:
    """``jax.shard_map`` for functions of NNX graph nodes.

    Inside ``f`` every module holds its per-device shards. Variable updates reach
    the caller's Variables, laid out by each Variable's in-spec; shared references
    and outputs that are input objects behave as in `jit`. The structure of input
    modules must not change inside ``f``.

    Args:
      f: the function; omit it to use ``shard_map(...)`` as a decorator factory.
      out_specs: pytree prefix of the output; at a graph node a `StateSharding` of
        PartitionSpecs, or one PartitionSpec for all its Variables. None replicates.
      in_specs: the same for the positional arguments (keyword arguments are
        replicated). None (the default) reads each argument's spec off its type,
        which needs every manual mesh axis to be ``AxisType.Explicit``.
      mesh: the mesh; None takes the one set with ``jax.set_mesh``.
      axis_names: the mesh axes ``f`` is manual over; empty means all of them.
      check_vma: as in ``jax.shard_map``.
      check_rep, auto: the deprecated spellings of ``check_vma`` and of the axes
        *not* in ``axis_names`` (from ``jax.experimental.shard_map``).

    Returns:
      A `ShardMapFn`.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> import nnx_sharding
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> @nnx_sharding.shard_map(mesh=mesh, in_specs=(P(), P('data')), out_specs=P('data'))
    ... def forward(model, x):
    ...     return model(x)
    >>> forward(model, jnp.ones((4, 2))).shape
    (4, 3)
    """
    if check_rep is not None:
        warnings.warn(
            "shard_map: `check_rep` is deprecated; use `check_vma`.",
            DeprecationWarning,
            stacklevel=2,
        )
        check_vma = check_rep
    if auto is not None:
        warnings.warn(
            "shard_map: `auto` is deprecated; pass the manual axes as `axis_names`.",
            DeprecationWarning,
            stacklevel=2,
        )
    options: dict[str, Any] = dict(
        out_specs=out_specs,
        in_specs=in_specs,
        mesh=mesh,
        axis_names=axis_names,
        check_vma=check_vma,
        auto=auto or frozenset(),
    )
    if f is None:
        return lambda g: ShardMapFn(g, **options)
    return ShardMapFn(f, **options)
