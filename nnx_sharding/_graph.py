"""The call path shared by every transform: split a call into arrays, merge it back.

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

``split_call`` and ``merge_call`` must run inside ``nnx.update_context(TAG)``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, TypeAlias

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import DictKey, SequenceKey, keystr

from . import _errors
from ._sharding import (
    ShardingLike,
    broadcast_prefix,
    check_leaf_entries,
    format_path,
    is_node,
    variable_shardings,
)
from ._snapshot import Snapshot, Uncacheable

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


@dataclasses.dataclass(frozen=True, eq=True)
class CallPlan:
    """The static half of a split call; equal plans share one compiled program."""

    spec: CallSpec
    treedef: jax.tree_util.PyTreeDef  # of (dynamic args, dynamic kwargs); graph nodes are leaves
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

    def partition(self, leaves: Sequence[Leaf]) -> tuple[list[Leaf], list[Leaf]]:
        """Flat leaves -> (donated, kept): the two arguments of the jitted function."""
        donated = [x for x, d in zip(leaves, self.donate, strict=True) if d]
        kept = [x for x, d in zip(leaves, self.donate, strict=True) if not d]
        return donated, kept

    def join(self, donated: Sequence[Leaf], kept: Sequence[Leaf]) -> list[Leaf]:
        d, k = iter(donated), iter(kept)
        return [next(d) if flag else next(k) for flag in self.donate]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class OutPlan:
    """Static result of the inner split; a pytree node without children."""

    in_graphdefs: tuple[GraphDef, ...]  # updated input nodes (None for array inputs)
    in_sizes: tuple[int, ...]
    out_treedef: jax.tree_util.PyTreeDef
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
        """Whether `_cache.Entry.merge` can stand in for `merge_call`."""
        return self.in_changed is not None and self.out_sources is not None


class NeedsTrace(Exception):
    """Raised at trace time during a fast-path call (see `_cache`): redo it in full."""


class _FastCall(threading.local):
    active: bool = False


FAST_CALL = _FastCall()


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


def _value(leaf: Any) -> Leaf:
    return leaf.get_raw_value() if isinstance(leaf, nnx.Variable) else leaf


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
    for key, value in statics:
        try:
            hash(value)
        except TypeError as e:
            name = f"args[{key}]" if isinstance(key, int) else f"kwargs[{key!r}]"
            raise ValueError(
                _errors.bad_static(spec.transform, name, type(value).__name__, str(e))
            ) from None

    keyed, treedef = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs), is_leaf=is_node)
    wheres = [_where(kp, positions) for kp, _ in keyed]
    call_leaves = [leaf for _, leaf in keyed]
    n_arg_leaves = len(jax.tree_util.tree_leaves(dyn_args, is_leaf=is_node))
    entries = [None] * len(call_leaves)
    if spec.in_shardings is not None:
        entries[:n_arg_leaves] = broadcast_prefix(
            spec.transform,
            "in_shardings",
            spec.in_shardings,
            dyn_args,
            lambda kp: _where((SequenceKey(0), *kp), positions),
        )
        check_leaf_entries(spec.transform, "in_shardings", entries, call_leaves, wheres)
    table = variable_shardings(
        spec.transform,
        "in_shardings",
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
                    leaves.append(_value(item))
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


def _chunks(leaves: Sequence[Leaf], sizes: Sequence[int]) -> list[Sequence[Leaf]]:
    out, start = [], 0
    for size in sizes:
        out.append(leaves[start : start + size])
        start += size
    return out


def _unflatten_all(
    ctx: Any, graphdefs: Sequence[GraphDef], leaves: Sequence[Leaf], sizes: Sequence[int]
) -> list[Any]:
    return [
        chunk[0] if graphdef is None else ctx.unflatten(graphdef, list(chunk))
        for graphdef, chunk in zip(graphdefs, _chunks(leaves, sizes), strict=True)
    ]


def merge_inputs(plan: CallPlan, leaves: Sequence[Leaf]) -> tuple[tuple, dict, list[Any]]:
    """Step 2 (inside the trace). Returns the call's args, kwargs and its inner leaves."""
    with nnx.merge_context(TAG, inner=True) as ctx:
        call_leaves = _unflatten_all(ctx, plan.graphdefs, leaves, plan.sizes)
    dyn_args, kwargs = jax.tree_util.tree_unflatten(plan.treedef, call_leaves)
    args = list(dyn_args)
    for key, value in plan.statics:
        if isinstance(key, int):
            args.insert(key, value)
        else:
            kwargs[key] = value
    return tuple(args), kwargs, call_leaves


def inner_shardings(
    plan: CallPlan, call_leaves: Sequence[Any]
) -> dict[int, tuple[ShardingLike, str]]:
    """``id(inner Variable) -> (sharding, path)`` for the freshly merged inputs."""
    table: dict[int, tuple[ShardingLike, str]] = {}
    if all(s is None for s in plan.shardings):
        return table
    chunks = _chunks(plan.shardings, plan.sizes)
    with nnx.split_context() as ctx:
        for leaf, chunk, where in zip(call_leaves, chunks, plan.wheres, strict=True):
            if is_node(leaf):
                _, flat = ctx.flatten(leaf)
                for path, item, sharding in zip(flat.paths, flat.leaves, chunk, strict=True):
                    if sharding is not None:
                        table[id(item)] = (sharding, where + format_path(path))
    return table


def split_outputs(
    plan: CallPlan,
    call_leaves: Sequence[Any],
    in_leaves: Sequence[Leaf],
    before: Snapshot | None,
    in_table: dict[int, tuple[ShardingLike, str]],
    out: Any,
) -> tuple[OutPlan, list[Leaf], list[Leaf]]:
    """Step 3 (inside the trace): the updated inputs and the outputs, split together.

    ``in_leaves`` are the leaves the inputs were merged from, ``before`` a snapshot
    of their graphs and ``in_table`` their shardings, all taken before the call.
    """
    transform = plan.spec.transform
    keyed, out_treedef = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_node)
    out_leaves = [leaf for _, leaf in keyed]
    wheres = [f"output{keystr(kp)}" for kp, _ in keyed]
    entries = [None] * len(out_leaves)
    if plan.spec.out_shardings is not None:
        entries = broadcast_prefix(
            transform,
            "out_shardings",
            plan.spec.out_shardings,
            out,
            lambda kp: f"output{keystr(kp)}",
        )
        check_leaf_entries(transform, "out_shardings", entries, out_leaves, wheres)
    out_table = variable_shardings(
        transform,
        "out_shardings",
        [(w, x, e) for w, x, e in zip(wheres, out_leaves, entries, strict=True) if is_node(x)],
    )

    conflicts: list[str] = []

    def constrain(item: Any, sharding: ShardingLike) -> Leaf:
        value = _value(item)
        (inner, in_site), (outer, out_site) = (
            in_table.get(id(item), (None, "")),
            out_table.get(id(item), (None, "")),
        )
        if inner is not None and outer is not None and inner != outer:
            conflicts.append(
                f"the Variable at {in_site} gets {inner!r} as an input, "
                f"and as {out_site} gets {outer!r} as an output"
            )
        sharding = sharding if sharding is not None else (outer if outer is not None else inner)
        if sharding is None or not isinstance(value, jax.Array):
            return value
        return jax.lax.with_sharding_constraint(value, sharding)

    def split_all(leaves: Sequence[Any], entries: Sequence[ShardingLike]):
        graphdefs, sizes, values, flat_leaves = [], [], [], []
        for leaf, entry in zip(leaves, entries, strict=True):
            if is_node(leaf):
                graphdef, flat = ctx.flatten(leaf)
                graphdefs.append(graphdef)
                sizes.append(len(flat.leaves))
                values += [_value(item) for item in flat.leaves]
                flat_leaves += [constrain(item, None) for item in flat.leaves]
            else:
                graphdefs.append(None)
                sizes.append(1)
                values.append(leaf)
                flat_leaves.append(constrain(leaf, entry))
        return tuple(graphdefs), tuple(sizes), values, flat_leaves

    with nnx.split_context(TAG) as ctx:
        in_graphdefs, in_sizes, values, in_flat = split_all(call_leaves, [None] * len(call_leaves))
        out_graphdefs, out_sizes, _, out_flat = split_all(out_leaves, entries)
    if conflicts:
        raise ValueError(
            _errors.aliased_shardings(transform, "in_shardings/out_shardings", conflicts)
        )

    in_changed = None
    if before is not None and before.fresh():
        is_state = [
            g is not None
            for g, size in zip(plan.graphdefs, plan.sizes, strict=True)
            for _ in range(size)
        ]
        in_changed = tuple(
            i
            for i, (new, old) in enumerate(zip(values, in_leaves, strict=True))
            # changed, resharded (constrained) or donated: the caller needs the new array
            if is_state[i] and (new is not old or in_flat[i] is not old or plan.donate[i])
        )
        in_flat = [in_flat[i] for i in in_changed]
    inputs = [leaf for leaf in call_leaves if is_node(leaf)]
    sources = [
        None if not is_node(leaf) else next((k for k, x in enumerate(inputs) if x is leaf), -1)
        for leaf in out_leaves
    ]
    out_sources = None if -1 in sources else tuple(sources)
    out_plan = OutPlan(
        in_graphdefs, in_sizes, out_treedef, out_graphdefs, out_sizes, in_changed, out_sources
    )
    return out_plan, in_flat, out_flat


def make_inner(fun: Callable[..., Any], plan: CallPlan) -> Callable[..., Any]:
    """The function jax traces: steps 2 and 3 around ``fun``."""

    def inner(donated: list[Leaf], kept: list[Leaf]) -> tuple[OutPlan, list[Leaf], list[Leaf]]:
        if FAST_CALL.active:
            raise NeedsTrace
        leaves = plan.join(donated, kept)
        args, kwargs, call_leaves = merge_inputs(plan, leaves)
        in_table = inner_shardings(plan, call_leaves)
        try:
            before = Snapshot(tuple(leaf for leaf in call_leaves if is_node(leaf)))
        except Uncacheable:
            before = None
        out = fun(*args, **kwargs)
        return split_outputs(plan, call_leaves, leaves, before, in_table, out)

    inner.__name__ = getattr(fun, "__name__", "fun")
    inner.__qualname__ = getattr(fun, "__qualname__", inner.__name__)
    return inner


def call_flat(
    fn: Callable[..., Any], plan: CallPlan, leaves: Sequence[Leaf], sites: Sequence[Site]
) -> Any:
    """Calls a jax-level function (jitted, traced or compiled) on the flat leaves.

    jax's errors about one flat argument (``kept[3]``) are re-raised naming the
    caller's argument and Variable path instead.
    """
    try:
        return fn(*plan.partition(leaves))
    except (ValueError, TypeError) as e:
        message = _errors.name_leaves(str(e), *plan.partition(sites))
        if message == str(e):
            wrong = incompatible_shardings(leaves, plan.shardings, sites)
            if not wrong:
                raise
            message = _errors.bad_shardings(plan.spec.transform, wrong, str(e))
        raise type(e)(message).with_traceback(e.__traceback__) from None


def incompatible_shardings(
    leaves: Sequence[Leaf], shardings: Sequence[ShardingLike], sites: Sequence[Site]
) -> list[str]:
    """Every leaf whose shape its sharding cannot split, described for an error."""
    found = []
    for leaf, sharding, site in zip(leaves, shardings, sites, strict=True):
        if sharding is None or not hasattr(leaf, "shape"):
            continue
        try:
            if isinstance(sharding, PartitionSpec):
                sharding = NamedSharding(jax.sharding.get_abstract_mesh(), sharding)
            sharding.shard_shape(tuple(leaf.shape))
        except Exception as e:  # noqa: BLE001 - jax raises several types here
            found.append(f"{site}: shape {tuple(leaf.shape)} with {sharding}: {e}")
    return found


def _full_inputs(
    out_plan: OutPlan, leaves: Sequence[Leaf], in_flat: Sequence[Leaf]
) -> Sequence[Leaf]:
    if out_plan.in_changed is None:
        return in_flat
    full = list(leaves)
    for i, value in zip(out_plan.in_changed, in_flat, strict=True):
        full[i] = value
    return full


def _merge(ctx: Any, out_plan: OutPlan, in_flat: Sequence[Leaf], out_flat: Sequence[Leaf]) -> Any:
    _unflatten_all(ctx, out_plan.in_graphdefs, in_flat, out_plan.in_sizes)
    out_leaves = _unflatten_all(ctx, out_plan.out_graphdefs, out_flat, out_plan.out_sizes)
    return jax.tree_util.tree_unflatten(out_plan.out_treedef, out_leaves)


def merge_call(
    leaves: Sequence[Leaf], out_plan: OutPlan, in_flat: Sequence[Leaf], out_flat: Sequence[Leaf]
) -> Any:
    """Step 4 (outside): write updates into the caller's objects, build the output.

    ``leaves`` are the flat leaves the call was made with.
    """
    with nnx.merge_context(TAG, inner=False) as ctx:
        return _merge(ctx, out_plan, _full_inputs(out_plan, leaves, in_flat), out_flat)


def merge_abstract(
    leaves: Sequence[Leaf], out_plan: OutPlan, in_flat: Sequence[Leaf], out_flat: Sequence[Leaf]
) -> Any:
    """Like `merge_call` but into new objects: for abstract (shape-only) outputs."""
    leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x for x in leaves]
    with nnx.merge_context() as ctx:
        return _merge(ctx, out_plan, _full_inputs(out_plan, leaves, in_flat), out_flat)
