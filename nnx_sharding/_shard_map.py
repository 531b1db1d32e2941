"""`shard_map`: ``jax.shard_map`` over NNX graph nodes, with NNX semantics.

A call runs through the same cached path as `jit` (`call.CachedCall`): the
arguments are split into flat arrays, and the plan's jitted function wraps one
``jax.shard_map`` over them. Inside, each device merges its own shards back into
modules, runs the function and splits the result again:

- the inputs' leaves come back whole, each with the spec it came in with, so a
  Variable update inside the body reaches the caller laid out as that Variable is;
  those not laid out so yet come back too, even unchanged, as from flax's shard_map
  (`_shard_map_layout.misplaced`: decided per trace, from their types);
- the output's graph nodes come back as one list of leaves per `StateSharding`
  filter, so the user's ``out_specs`` prefix (a StateSharding becomes the tuple
  of its specs) matches whatever number of Variables each filter catches; jit's
  out_shardings then keep each output's spec as written (`_shard_map_layout.Flat`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any, ParamSpec, TypeVar, overload

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jax.tree_util import keystr

from . import _errors
from ._callpath.call import CachedCall
from ._callpath.changes import graph_changes, graph_objects
from ._callpath.inside import (
    changed_inputs,
    changed_structure,
    merge_inputs,
    snapshots,
    split_inner,
)
from ._callpath.outside import CallPlan, CallSpec, Leaf, checked_on_fast_calls, value_of
from ._callpath.simple import SimpleCall, check_prefix, node_prefixes, resolve_mode, unique_leaves
from ._nodes import bound_node, is_node
from ._shard_map_layout import (
    AxisName,
    Flat,
    Specs,
    abstract_mesh,
    axes_of,
    group_outputs,
    in_sites,
    jax_prefix,
    manual_part,
    misplaced,
    spec_of,
)
from ._sharding import is_prefix_leaf, prefixes
from ._stages import Lowered, Traced
from ._state_sharding import StateSharding

P = ParamSpec("P")
R = TypeVar("R")


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
        if not callable(fun):
            raise TypeError(_errors.not_callable("shard_map", fun, "out_specs=P()"))
        if (owner := bound_node(fun)) is not None:
            raise ValueError(_errors.bound_method("shard_map", type(owner).__name__))
        in_prefix, out_prefix = prefixes(
            "shard_map", in_specs, out_specs, names=("in_specs", "out_specs")
        )
        spec = CallSpec(
            "shard_map",
            in_shardings=in_prefix,
            out_shardings=out_prefix,
            in_name="in_specs",
            out_name="out_specs",
        )
        super().__init__(fun, spec)
        self.mesh = mesh
        self.axis_names: frozenset[AxisName] = frozenset(axis_names)
        self.check_vma = check_vma
        self._auto = frozenset(auto)
        self._infer = in_specs is None
        out_specs = None if out_prefix is None else out_prefix.tree
        keyed = jax.tree_util.tree_flatten_with_path(out_specs, is_leaf=is_prefix_leaf)[0]
        self._state_sharding_sites = [
            f"output{keystr(kp)}" for kp, x in keyed if isinstance(x, StateSharding)
        ]
        # Each spec of out_specs: (its key path in the prefix jax gets, its name here).
        self._out_spec_sites: list[tuple[str, str, Any]] = []
        for kp, entry in keyed:
            where = f"output{keystr(kp)}"
            if isinstance(entry, StateSharding):
                self._out_spec_sites += [
                    (f"{keystr(kp)}[{k}]", f"{where} (filter {f!r} of its StateSharding)", s)
                    for k, (f, s) in enumerate(zip(entry.filters, entry.shardings, strict=True))
                ]
            elif is_prefix_leaf(entry) and not is_node(entry):
                self._out_spec_sites.append((keystr(kp), where, entry))
            else:
                raise TypeError(
                    _errors.bad_prefix_entry("shard_map", "out_specs", where, type(entry).__name__)
                )
        self._out_prefix = jax_prefix(out_specs)

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

    def _check_out_specs(self, mesh: Mesh | AbstractMesh) -> None:
        """Every axis out_specs names is a manual axis of ``mesh`` (jax's own check
        names the specs by the package's internal layout)."""
        manual = self._manual_axes(mesh)
        problems = []
        for _, where, entry in self._out_spec_sites:
            spec = spec_of(entry)
            for part in spec:
                for axis in part if isinstance(part, tuple) else (part,):
                    if isinstance(axis, str) and axis not in manual:
                        problems.append(
                            _errors.unknown_axis(where, spec, axis, axis in mesh.axis_names)
                        )
        if problems:
            raise ValueError(
                _errors.spec_axes_not_manual(
                    "shard_map",
                    "out_specs",
                    problems,
                    mesh.axis_names,
                    [a for a in mesh.axis_names if a in manual],
                )
            )

    def _in_specs(
        self, plan: CallPlan, leaves: Sequence[Leaf], mesh: Mesh | AbstractMesh
    ) -> list[PartitionSpec]:
        """One spec per flat leaf: from in_specs, or read off explicitly sharded types."""
        if not self._infer:
            return [spec_of(s) for s in plan.shardings]
        manual = self._manual_axes(mesh)
        types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
        if wrong := sorted(a for a in manual if types[a] != AxisType.Explicit):
            raise TypeError(_errors.cannot_infer_specs("shard_map", wrong))
        return [
            PartitionSpec(*(manual_part(e, manual) for e in jax.typeof(leaf).sharding.spec))
            for leaf in leaves
        ]

    def _build(self, plan: CallPlan) -> Callable[..., Any]:
        @checked_on_fast_calls
        def outer(donated: list[Leaf], kept: list[Leaf]) -> tuple[Any, Flat, Flat]:
            leaves = plan.join(donated, kept)
            mesh = self._mesh()
            self._check_out_specs(mesh)
            in_specs = self._in_specs(plan, leaves, mesh)
            # Every input leaves laid out by its in_spec, as from flax's shard_map: those
            # not laid out so yet come back even if unchanged (later calls move nothing).
            unplaced = (
                frozenset()
                if self._infer
                else frozenset(
                    i
                    for i in plan.state_indices
                    if misplaced(leaves[i], in_specs[i], abstract_mesh(mesh))
                )
            )
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
                objects = graph_objects(plan, call_leaves)
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
                            graph_changes(objects, graph_objects(plan, call_leaves)),
                        )
                    )
                grouped, order = group_outputs(split, self._state_sharding_sites)
                values = [value_of(x) for x in split.in_items]
                changed = changed_inputs(plan, split.in_items, values, leaves, unplaced)
                found.append((split.out_plan(changed), order))
                return values, grouped

            body.__name__ = getattr(self.fun, "__name__", "fun")
            body.__qualname__ = getattr(self.fun, "__qualname__", body.__name__)
            mapped = jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(in_specs,),
                out_specs=(in_specs, self._out_prefix),
                axis_names=self._manual_axes(mesh),
                check_vma=self.check_vma,
            )
            try:
                in_full, grouped = mapped(list(leaves))
            except (ValueError, TypeError) as e:
                if "out_specs[" not in str(e):  # jax names a spec by our layout: rename it
                    raise
                out_sites = {key: where for key, where, _ in self._out_spec_sites}
                message = _errors.name_spec_paths(str(e), in_sites(plan, leaves), out_sites)
                if message == str(e):
                    raise
                raise type(e)(message).with_traceback(e.__traceback__) from None
            out_plan, order = found[-1]
            every = out_plan.in_changed is None  # a full merge takes every input back
            picked = frozenset(range(len(in_full)) if every else out_plan.in_changed)
            changed = [x if i in picked else None for i, x in enumerate(in_full)]
            return out_plan, Flat(changed, range(len(picked))), Flat(grouped, order)

        outer.__name__ = getattr(self.fun, "__name__", "fun")
        outer.__qualname__ = getattr(self.fun, "__qualname__", outer.__name__)
        options: dict[str, Any] = {"donate_argnums": 0 if any(plan.donate) else ()}
        if (out_shardings := self._out_shardings(plan)) is not None:
            options["out_shardings"] = out_shardings
        return jax.jit(outer, **options)

    def _out_shardings(self, plan: CallPlan) -> Any:
        """jit's out_shardings: for the output its out_specs, and for the inputs returned
        their in_specs, as written, so that each keeps its spec's spelling (``P(None)``),
        as from ``jax.shard_map`` itself (and flax's). Only where every axis of the mesh
        is manual (otherwise jit chooses the rest), and for a mesh from the context, only
        if one is set when the plan is first called."""
        mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
        if mesh.empty or self._manual_axes(mesh) != frozenset(mesh.axis_names):
            return None
        self._check_out_specs(mesh)  # before jax's own check, which names no output

        def on_mesh(spec: PartitionSpec) -> Any:
            # PartitionSpecs alone: jit reads them on the mesh set with jax.set_mesh
            return NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec

        def fit(specs: Sequence[Any]) -> bool:  # else jax.shard_map's error says which
            known = {*mesh.axis_names, None}
            return all(isinstance(s, PartitionSpec) and axes_of(s) <= known for s in specs)

        specs = [] if self._infer else [spec_of(s) for s in plan.shardings]
        inputs = Flat([on_mesh(s) for s in specs], ()) if specs and fit(specs) else None
        outputs = self._out_prefix
        if not fit(jax.tree.leaves(outputs)):
            return None if inputs is None else (None, inputs, None)
        return (None, inputs, Flat(jax.tree.map(on_mesh, outputs), ()))


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
    graph: bool | None = None,
    graph_updates: bool | None = None,
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
    graph: bool | None = None,
    graph_updates: bool | None = None,
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
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """``jax.shard_map`` for functions of NNX graph nodes.

    Inside ``f`` every module holds its per-device shards. Afterwards every input
    Variable, updated or not, holds its array laid out by its in-spec (as with
    flax's shard_map), so later calls move nothing; shared references and outputs
    that are input objects behave as in `jit`. The structure of input modules must
    not change inside ``f``. Outputs keep their out_specs as written (``P(None)``).

    One case is not seen: with ``AxisType.Auto`` mesh axes, an input already on
    the mesh but laid out otherwise stays so (its type does not show the layout, and
    checking each array on every call would cost the fast path); the program then
    moves it on each call.

    Args:
      f: the function; omit it to use ``shard_map(...)`` as a decorator factory.
      out_specs: pytree prefix of the output (tuples, lists, dicts...); at a graph
        node a `StateSharding` of PartitionSpecs (flax's ``nnx.StateSharding`` is
        converted into one; so is a tree from ``nnx.prefix(model, {filter: spec})``,
        and an ``nnx.State`` of specs, matched by exact path), or one PartitionSpec
        for all its Variables. None replicates. A graph node in it is an error.
      in_specs: the same for the positional arguments (keyword arguments are
        replicated). None (the default) reads each argument's spec off its type,
        which needs every manual mesh axis to be ``AxisType.Explicit``.
      mesh: the mesh; None takes the one set with ``jax.set_mesh``.
      axis_names: the mesh axes ``f`` is manual over; empty means all of them.
      check_vma: as in ``jax.shard_map``.
      check_rep, auto: the deprecated spellings of ``check_vma`` and of the axes
        *not* in ``axis_names`` (from ``jax.experimental.shard_map``).
      graph, graph_updates: as in ``flax.nnx.shard_map`` and `jit`: unless both are
        True, flax's simple path (graph nodes as pytrees, only Variable values come
        back, no `StateSharding`; with ``graph=False`` no shared Variables either),
        run eagerly as flax runs it. None (the default): the ``nnx.set_graph_mode`` /
        ``nnx.set_graph_updates`` contexts, then flax's config, when `shard_map` is
        called.

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
    graph, graph_updates = resolve_mode(graph, graph_updates)  # once, as flax does
    if not (graph and graph_updates):
        del options["auto"]

        def make(g: Callable[P, R]) -> ShardMapFn[P, R]:
            return SimpleShardMapFn(g, options, graph=graph)

    else:

        def make(g: Callable[P, R]) -> ShardMapFn[P, R]:
            return ShardMapFn(g, **options)

    return make if f is None else make(f)


class SimpleShardMapFn(ShardMapFn[P, R]):
    """`ShardMapFn` on flax's simple path: ``graph=False`` (tree mode) or
    ``graph_updates=False`` (`simple`): one eager ``jax.shard_map``, as flax runs it."""

    def __init__(self, fun: Callable[P, R], options: Mapping[str, Any], *, graph: bool):
        """``options``: `shard_map`'s keywords (``out_specs``, ``in_specs``, ``mesh``,
        ``axis_names``, ``check_vma``)."""
        out_specs, in_specs = options["out_specs"], options.get("in_specs")
        mesh, check_vma = options.get("mesh"), options.get("check_vma", True)
        axis_names = options.get("axis_names", frozenset())
        if not callable(fun):
            raise TypeError(_errors.not_callable("shard_map", fun, "out_specs=P()"))
        if (owner := bound_node(fun)) is not None:
            raise ValueError(_errors.bound_method("shard_map", type(owner).__name__))
        functools.update_wrapper(self, fun)
        check_prefix("shard_map", "in_specs", in_specs, graph)
        check_prefix("shard_map", "out_specs", out_specs, graph)
        self.fun, self.graph = fun, graph
        self.mesh = mesh
        self.axis_names = frozenset(axis_names)
        self.check_vma = check_vma
        groups = unique_leaves(in_specs, none_leaf=False)
        arg_prefixes = {"args": in_specs, "kwargs": None}
        self._call = call = SimpleCall(
            "shard_map", fun, graph, arg_prefixes, groups, out_prefix=out_specs
        )

        @functools.wraps(fun)
        def inner(*args: Any) -> Any:
            return call.inner(*args)

        # graph mode: each nnx.prefix(..., graph=True) as the TreeNode of its node
        mapped: dict[str, Any] = dict(
            out_specs=(node_prefixes(out_specs), groups),
            axis_names=set(axis_names),
            check_vma=check_vma,
        )
        if mesh is not None:
            mapped["mesh"] = mesh
        if in_specs is not None:
            mapped["in_specs"] = node_prefixes(in_specs)
        self.inner = jax.shard_map(inner, **mapped)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._call.run(self.inner, args, kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs, _ = self._call.prepare(args, kwargs, not self.graph)
        out, _ = jax.eval_shape(self.inner, *args, **kwargs)
        return self._call.finish(out)

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Traces for these arguments (under ``jax.jit``); see `jax.stages.Traced`."""
        args, kwargs, _ = self._call.prepare(args, kwargs, not self.graph)
        return Traced(jax.jit(self.inner).trace(*args, **kwargs), self._call)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Traces and lowers for these arguments; see `jax.stages.Lowered`."""
        return self.trace(*args, **kwargs).lower()
