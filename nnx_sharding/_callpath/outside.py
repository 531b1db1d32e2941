"""The call path's steps 1 and 4, outside the program: split a call into arrays, merge it back.

A call ``f(*args, **kwargs)`` whose arguments hold NNX graph nodes crosses the
jax boundary in four steps, flax's ``update_context`` protocol (public API):

1. ``split_call`` (outside): the arguments become a hashable `CallPlan` (graph
   definitions, static arguments, per-array donation and sharding) plus a flat list
   of arrays. Graph nodes are split together, so shared references stay shared.
2. ``merge_inputs`` (inside, at trace time): fresh inner copies of the nodes.
3. ``split_outputs`` (inside): the inputs, possibly updated, and the outputs are
   split again; the result's static half, an `OutPlan`, travels back through the
   output pytree's treedef, so it is also there on calls that hit jax's cache.
4. ``merge_call`` (outside): updates and structure changes are written into the
   caller's objects; outputs that are input objects come back as those objects.

Steps 2 and 3 are `inside`'s; this module holds the plans and steps 1 and 4.
``split_call`` and ``merge_call`` must run inside ``nnx.update_context(TAG)``.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, TypeAlias

import jax
import numpy as np
from flax import nnx
from jax.tree_util import DictKey, SequenceKey, keystr

from .. import _errors
from .._nodes import format_path, is_node
from .._sharding import broadcast_prefix, check_leaf_entries, variable_shardings
from .._types import PyTreeDef, ShardingLike

TAG = "nnx_sharding"
Leaf: TypeAlias = Any
"""One array-like value that crosses the jax boundary."""
GraphDef: TypeAlias = Any
"""An ``nnx.GraphDef``, or None where an output leaf is not a graph node."""


class Site(NamedTuple):
    """Where a flat leaf comes from: the argument, and the Variable path inside a node."""

    where: str
    path: tuple[Any, ...] | None

    def __str__(self) -> str:
        return self.where if self.path is None else self.where + format_path(self.path)


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """How one transform reads its arguments; fixed when the transform is created."""

    transform: str
    static_argnums: frozenset[int] = frozenset()
    static_argnames: frozenset[str] = frozenset()
    donate_argnums: frozenset[int] = frozenset()
    donate_argnames: frozenset[str] = frozenset()
    in_shardings: Any = None
    out_shardings: Any = None
    in_name: str = "in_shardings"  # what the two prefixes are called in messages
    out_name: str = "out_shardings"


@dataclasses.dataclass(frozen=True, eq=True)
class CallPlan:
    """The static half of a split call; equal plans share one compiled program."""

    spec: CallSpec
    treedef: PyTreeDef  # of (dynamic args, dynamic kwargs); graph nodes are leaves
    graphdefs: tuple[GraphDef, ...]  # one per treedef leaf; None for array leaves
    sizes: tuple[int, ...]  # flat leaves per treedef leaf
    statics: tuple[tuple[int | str, Hashable], ...]
    wheres: tuple[str, ...]  # per treedef leaf: ``args[0]``, ``kwargs['x']``
    donate: tuple[bool, ...]  # per flat leaf
    shardings: tuple[ShardingLike, ...]  # per flat leaf

    def __hash__(self) -> int:  # graph definitions are slow to hash: once per plan
        try:
            return self.__dict__["_hash"]
        except KeyError:
            fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
            try:
                value = hash(fields)
            except TypeError:  # a module holds an unhashable static attribute (a list)
                value = hash(tuple(f for f in fields if not isinstance(f, tuple)))
            object.__setattr__(self, "_hash", value)
            return value

    @functools.cached_property
    def state_indices(self) -> tuple[int, ...]:
        """The flat indices of the leaves read from graph nodes (Variables)."""
        flags = [
            g is not None for g, n in zip(self.graphdefs, self.sizes, strict=True) for _ in range(n)
        ]
        return tuple(i for i, flag in enumerate(flags) if flag)

    def partition(self, leaves: Sequence[Leaf]) -> tuple[list[Leaf], list[Leaf]]:
        """Flat leaves -> (donated, kept): the two arguments of the jitted function."""
        donated = [x for x, d in zip(leaves, self.donate, strict=True) if d]
        kept = [x for x, d in zip(leaves, self.donate, strict=True) if not d]
        return donated, kept

    def join(self, donated: Sequence[Leaf], kept: Sequence[Leaf]) -> list[Leaf]:
        """The inverse of `partition`: (donated, kept) -> flat leaves."""
        d, k = iter(donated), iter(kept)
        return [next(d) if flag else next(k) for flag in self.donate]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class OutPlan:
    """Static result of the inner split; a pytree node without children."""

    in_graphdefs: tuple[GraphDef, ...]  # updated input nodes (None for array inputs)
    in_sizes: tuple[int, ...]
    out_treedef: PyTreeDef
    out_graphdefs: tuple[GraphDef, ...]
    out_sizes: tuple[int, ...]
    # Set when the inputs kept their structure: the flat indices of the input leaves
    # returned (changed or donated ones); the others are the inputs themselves.
    in_changed: tuple[int, ...] | None
    # Set when every output graph node is an input node: per output leaf, the index
    # of that input among the call's graph nodes, or None for an array.
    out_sources: tuple[int | None, ...] | None

    @property
    def fast(self) -> bool:
        """Whether `cache.Entry.merge` can stand in for `merge_call`."""
        return self.in_changed is not None and self.out_sources is not None


class NeedsTrace(Exception):
    """Raised at trace time during a fast-path call (see `cache`): redo it in full."""


class _FastCall(threading.local):
    active: bool = False


FAST_CALL = _FastCall()

Inner: TypeAlias = Callable[[list[Leaf], list[Leaf]], tuple[OutPlan, list[Leaf], list[Leaf]]]
"""The function a transform gives ``jax.jit``: ``(donated, kept) -> (OutPlan, in, out)``."""


def checked_on_fast_calls(inner: Inner) -> Inner:
    """``inner``, raising `NeedsTrace` at the end of a trace made during a fast call
    (`cache.fast_call`) whose `OutPlan` the fast path cannot write back.

    The trace is checked afterwards, not refused at once: once a trace raises, jax runs
    every later call with those argument types on its Python path, and a call whose
    arrays moved (placed by in_shardings on the first call) traces again on the next.
    """

    @functools.wraps(inner)
    def checked(donated: list[Leaf], kept: list[Leaf]) -> tuple[OutPlan, list[Leaf], list[Leaf]]:
        fast, FAST_CALL.active = FAST_CALL.active, False
        try:
            if fast:  # a context of its own: a trace given up must not leave its
                with nnx.update_context(TAG):  # references in the one the full path uses
                    out = inner(donated, kept)
            else:
                out = inner(donated, kept)
        finally:
            FAST_CALL.active = fast
        if fast and not out[0].fast:
            raise NeedsTrace
        return out

    return checked


def _where(keypath: tuple[Any, ...], positions: Sequence[int]) -> str:
    """Renders a key path of ``(dyn_args, dyn_kwargs)`` as ``args[2].x`` / ``kwargs['y']``."""
    if not keypath:
        return "arguments"
    head, rest = keypath[0], keypath[1:]
    if isinstance(head, SequenceKey) and head.idx == 0:
        if not rest:
            return "args"
        first = rest[0]
        index = positions[first.idx] if isinstance(first, SequenceKey) else first
        return f"args[{index}]{keystr(rest[1:])}"
    return f"kwargs{keystr(rest)}" if rest else "kwargs"


def value_of(leaf: Any) -> Leaf:
    return leaf.get_raw_value() if isinstance(leaf, nnx.Variable) else leaf


HOST_TYPES = frozenset({np.ndarray, int, float, complex, bool})
"""The types of graph leaves that are no jax arrays yet (with numpy's scalars)."""


def is_host_type(kind: type) -> bool:
    """Whether graph leaves of this type are numpy arrays or Python or numpy numbers:
    values that flax's graph-mode call gives back as jax arrays."""
    return kind in HOST_TYPES or issubclass(kind, np.generic)


def as_jax(value: Leaf) -> Leaf:
    """A numpy array or a Python or numpy number as a jax array, as ``jax.jit`` makes
    it (a Python number weakly typed): flax's graph-mode calls pass every graph leaf
    through ``jax.jit`` and write its result back, so they leave no such value in a
    graph, even one the function did not change."""
    return jax.numpy.asarray(value) if is_host_type(type(value)) else value


def check_statics(transform: str, statics: Sequence[tuple[int | str, Any]]) -> None:
    """Raises for a static argument that holds a graph node or is not hashable."""
    for key, value in statics:
        name = f"args[{key}]" if isinstance(key, int) else f"kwargs[{key!r}]"
        for leaf in jax.tree_util.tree_leaves(value, is_leaf=is_node):
            if is_node(leaf) or isinstance(leaf, nnx.Variable):
                raise ValueError(_errors.static_graph_node(transform, name, type(leaf).__name__))
        try:
            hash(value)
        except TypeError as e:
            kind = type(value).__name__
            raise ValueError(_errors.bad_static(transform, name, kind, str(e))) from None


def partition_args(
    spec: CallSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[int], tuple[Any, ...], dict[str, Any], tuple[tuple[int | str, Hashable], ...]]:
    """Positions of the dynamic args, the dynamic args and kwargs, the static ones."""
    positions = [i for i in range(len(args)) if i not in spec.static_argnums]
    dyn_args = tuple(args[i] for i in positions)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in spec.static_argnames}
    statics = tuple((i, args[i]) for i in sorted(spec.static_argnums) if i < len(args))
    statics += tuple((k, kwargs[k]) for k in sorted(spec.static_argnames) if k in kwargs)
    return positions, dyn_args, dyn_kwargs, statics


def split_call(
    spec: CallSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[CallPlan, list[Leaf], list[Site], list[Any]]:
    """Step 1. Returns the plan, the flat leaves, the `Site` of each flat leaf and the
    object each flat leaf was read from (a Variable, or the array itself)."""
    positions, dyn_args, dyn_kwargs, statics = partition_args(spec, args, kwargs)
    check_statics(spec.transform, statics)

    keyed, treedef = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs), is_leaf=is_node)
    wheres = [_where(kp, positions) for kp, _ in keyed]
    call_leaves = [leaf for _, leaf in keyed]
    n_arg_leaves = len(jax.tree_util.tree_leaves(dyn_args, is_leaf=is_node))
    entries = [None] * len(call_leaves)
    if spec.in_shardings is not None:
        entries[:n_arg_leaves] = broadcast_prefix(
            spec.transform,
            spec.in_name,
            spec.in_shardings,
            dyn_args,
            lambda kp: _where((SequenceKey(0), *kp), positions),
        )
        check_leaf_entries(spec.transform, spec.in_name, entries, call_leaves, wheres)
    table = variable_shardings(
        spec.transform,
        spec.in_name,
        [(w, x, e) for w, x, e in zip(wheres, call_leaves, entries, strict=True) if is_node(x)],
    )
    donated_top = {SequenceKey(positions.index(i)) for i in spec.donate_argnums if i in positions}
    donated_top |= {DictKey(k) for k in spec.donate_argnames}

    graphdefs, sizes, leaves, sites, donate, shardings, items = [], [], [], [], [], [], []
    with nnx.split_context(TAG) as ctx:
        for (kp, leaf), where, entry in zip(keyed, wheres, entries, strict=True):
            is_donated = len(kp) > 1 and kp[1] in donated_top
            if is_node(leaf):
                graphdef, flat = ctx.flatten(leaf)
                graphdefs.append(graphdef)
                sizes.append(len(flat.leaves))
                items += flat.leaves
                for path, item in zip(flat.paths, flat.leaves, strict=True):
                    leaves.append(as_jax(value_of(item)))  # merge_call writes it back
                    sites.append(Site(where, tuple(path)))
                    shardings.append(table.get(id(item), (None,))[0])
                    donate.append(is_donated)
            else:
                graphdefs.append(None)
                sizes.append(1)
                leaves.append(leaf)
                items.append(leaf)
                sites.append(Site(where, None))
                shardings.append(entry)
                donate.append(is_donated)
    plan = CallPlan(
        spec,
        treedef,
        tuple(graphdefs),
        tuple(sizes),
        statics,
        tuple(wheres),
        tuple(donate),
        tuple(shardings),
    )
    return plan, leaves, sites, items


def chunks(leaves: Sequence[Leaf], sizes: Sequence[int]) -> list[Sequence[Leaf]]:
    """Flat leaves cut into one run per treedef leaf (``sizes`` from a `CallPlan`)."""
    out, start = [], 0
    for size in sizes:
        out.append(leaves[start : start + size])
        start += size
    return out


def unflatten_all(
    ctx: Any, graphdefs: Sequence[GraphDef], leaves: Sequence[Leaf], sizes: Sequence[int]
) -> list[Any]:
    return [
        chunk[0] if graphdef is None else ctx.unflatten(graphdef, list(chunk))
        for graphdef, chunk in zip(graphdefs, chunks(leaves, sizes), strict=True)
    ]


def full_inputs(
    out_plan: OutPlan, leaves: Sequence[Leaf], in_flat: Sequence[Leaf]
) -> Sequence[Leaf]:
    if out_plan.in_changed is None:
        return in_flat
    full = list(leaves)
    for i, value in zip(out_plan.in_changed, in_flat, strict=True):
        full[i] = value
    return full


def _merge(ctx: Any, out_plan: OutPlan, in_flat: Sequence[Leaf], out_flat: Sequence[Leaf]) -> Any:
    unflatten_all(ctx, out_plan.in_graphdefs, in_flat, out_plan.in_sizes)
    out_leaves = unflatten_all(ctx, out_plan.out_graphdefs, out_flat, out_plan.out_sizes)
    return jax.tree_util.tree_unflatten(out_plan.out_treedef, out_leaves)


def merge_call(
    leaves: Sequence[Leaf], out_plan: OutPlan, in_flat: Sequence[Leaf], out_flat: Sequence[Leaf]
) -> Any:
    """Step 4 (outside): write updates into the caller's objects, build the output.

    ``leaves`` are the flat leaves the call was made with. Every Variable of the
    inputs is written, as flax writes them: `boundary.check_writable` first.
    """
    with nnx.merge_context(TAG, inner=False) as ctx:
        return _merge(ctx, out_plan, full_inputs(out_plan, leaves, in_flat), out_flat)


def merge_abstract(
    leaves: Sequence[Leaf], out_plan: OutPlan, in_flat: Sequence[Leaf], out_flat: Sequence[Leaf]
) -> Any:
    """Like `merge_call` but into new objects: for abstract (shape-only) outputs."""
    return merge_new(abstract_leaves(leaves, weak_type=True), out_plan, in_flat, out_flat)


def merge_new(
    leaves: Sequence[Any], out_plan: OutPlan, in_flat: Sequence[Any], out_flat: Sequence[Any]
) -> Any:
    """The output built into new objects from per-leaf values of any kind (avals,
    shardings, formats): ``leaves`` stand for the inputs, ``in_flat`` and ``out_flat``
    for the program's outputs, as in `merge_call`."""
    with nnx.merge_context() as ctx:
        return _merge(ctx, out_plan, full_inputs(out_plan, leaves, in_flat), out_flat)


def abstract_leaves(leaves: Sequence[Leaf], weak_type: bool = False) -> list[Leaf]:
    """Each array (or aval) as a ``jax.ShapeDtypeStruct``; other leaves as they are.
    ``weak_type``: keep each one's weak type, as ``jax.eval_shape`` does (the stages'
    ``out_info``, as jax's, has none)."""
    return [
        jax.ShapeDtypeStruct(
            x.shape, x.dtype, weak_type=weak_type and getattr(x, "weak_type", False)
        )
        if hasattr(x, "shape")
        else x
        for x in leaves
    ]
