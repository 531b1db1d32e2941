"""The fast path: reuse a call's split while its module graphs stay unchanged.

The full protocol (`outside`) walks every object graph twice per call. When the
same modules come back with the same structure, the split is known already: the
flat list of Variables, the plan and the jitted function. An `Entry` keeps them,
with a `Snapshot` that proves "unchanged" at C speed: the identity of every value
in every mutable container (module ``__dict__``, lists, dicts, States) of the graphs.

A call takes the fast path (`fast_call`) only when the trace that jax will reuse
reported no structure change (`OutPlan.fast`), at the jax trace level the split was
cached at (outside any jax transform, where its Variables may be written). Should
jax need a new trace during a fast call (new shapes, say), the trace runs to its end
and raises `NeedsTrace` if its plan is not fast (`outside.checked_on_fast_calls`),
before the program runs; the call is then redone on the full protocol.
`call.CachedCall` (every transform) and `_stages.Compiled` call through here.
"""

from __future__ import annotations

import operator
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, TypeAlias

import jax
from flax import nnx
from jax.extend.core import get_opaque_trace_state

from .._callpath.boundary import host_callbacks
from .._callpath.outside import (
    FAST_CALL,
    CallPlan,
    CallSpec,
    Leaf,
    NeedsTrace,
    OutPlan,
    is_host_type,
    merge_call,
    partition_args,
    split_call,
)
from .._nodes import is_node
from . import slots as _slots
from .pointers import same_objects
from .snapshot import Snapshot, Uncacheable

MAX_ENTRIES = 64
"""Cached splits per transform; an entry also goes when one of its modules dies."""
UNWRITTEN = object()
"""`Entry.merge`'s answer where the fast path cannot write a call's updates back."""
CacheKey: TypeAlias = tuple[Any, ...]
"""The treedef, root ids and static arguments of a call (`fast_key`)."""


class PlanState:
    """One plan's jax function, and whether all its traces allow the fast path.

    ``jitted`` is a ``jax.jit`` function, or a ``jax.stages.Compiled`` with ``waits``
    given: whether its one program has host callbacks (see `wait`).
    """

    def __init__(self, jitted: Callable[..., Any], waits: bool | None = None):
        self.jitted = jitted
        self.fast = True
        self._known = waits  # None: looked up per trace, in `_waits`
        self._waits: dict[int, tuple[OutPlan, bool]] = {}  # by id: one OutPlan per trace

    def note(self, out_plan: OutPlan) -> None:
        """Called with every trace's `OutPlan`: one that changed structure ends it."""
        self.fast = self.fast and out_plan.fast

    def wait(self, out: tuple[Any, ...], args: tuple[list[Leaf], list[Leaf]]) -> None:
        """Waits for the program's results if it calls back into Python at run time.

        A host callback is the one way the user's function can raise once its program
        runs. jax dispatches asynchronously and reports such an error only when the
        results are read; waiting here raises it before `merge` writes anything back,
        so the caller's Variables keep their values. Programs without callbacks stay
        asynchronous. Looked up once per trace (``out[0]``; jax's trace cache answers).
        """
        if self._known is not None:
            if self._known:
                jax.block_until_ready(out[1:])
            return
        known = self._waits.get(id(out[0]))
        if known is None:
            jaxpr = self.jitted.trace(*args).jaxpr  # type: ignore[attr-defined]
            known = self._waits[id(out[0])] = (out[0], host_callbacks(jaxpr.jaxpr))
        if known[1]:
            jax.block_until_ready(out[1:])


def fast_key(
    spec: CallSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[CacheKey | None, list[Any], list[Any]]:
    """The cache key of a call (None: not cacheable), its leaves and its graph nodes."""
    _, dyn_args, dyn_kwargs, statics = partition_args(spec, args, kwargs)
    call_leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs), is_leaf=is_node)
    roots = [leaf for leaf in call_leaves if is_node(leaf)]
    key: CacheKey | None = (treedef, tuple(map(id, roots)), statics)
    try:
        hash(key)
    except TypeError:
        key = None
    return key, call_leaves, roots


def fast_call(
    entries: dict[CacheKey, Entry], spec: CallSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bool, Any, CacheKey | None, list[Any]]:
    """Runs a call through its cached split, if one is cached and still valid.

    Returns ``(done, result, key, roots)``. When not done, the caller takes the full
    path and then `remember`s it under ``key``. What jax raises here, bar a run-time
    error of the program, comes from its argument checks or a new trace (`NeedsTrace`)
    before the program runs: the full path redoes the call and, should it fail again,
    names the argument.
    """
    key, call_leaves, roots = fast_key(spec, args, kwargs)
    entry = None if key is None else entries.get(key)
    if entry is None or not entry.state.fast or not entry.valid(roots):
        return False, None, key, roots
    if trace_state() != entry.trace:  # inside an outer jax transform: flax's checks apply
        return False, None, key, roots
    arguments = entry.arguments(call_leaves)
    if arguments is None:
        return False, None, key, roots
    donated, kept = arguments
    FAST_CALL.active = True
    try:
        out = entry.state.jitted(donated, kept)
    except jax.errors.JaxRuntimeError:  # the program ran (synchronously) and failed
        raise
    except (NeedsTrace, TypeError, ValueError, RuntimeError):
        return False, None, key, roots
    finally:
        FAST_CALL.active = False
    entry.state.wait(out, (donated, kept))
    result = entry.merge(*out)
    if result is UNWRITTEN:  # the full path's merge, after its split (nothing was written)
        entry.state.fast = False
        result = merge_call(split_call(spec, args, kwargs)[1], *out)
    return True, result, key, roots


def remember(
    entries: dict[CacheKey, Entry],
    key: CacheKey | None,
    plan: CallPlan,
    state: PlanState,
    items: list[Any],
    roots: list[Any],
) -> None:
    """Caches a call's split (``items`` from `outside.split_call`), if it can be."""
    if key is None or not state.fast:  # a plan that changes structure is never fast again
        return
    slots, offset = [], 0
    for graphdef, size in zip(plan.graphdefs, plan.sizes, strict=True):
        slots.append(offset if graphdef is None else None)
        offset += size
    try:
        entry = Entry(plan, state, items, slots, roots, lambda _: entries.pop(key, None))
    except (Uncacheable, TypeError):  # TypeError: a root that takes no weak reference
        return
    entries.pop(key, None)
    entries[key] = entry
    while len(entries) > MAX_ENTRIES:
        entries.pop(next(iter(entries)))


class Entry:
    """A cached split: what `outside.split_call` would return, minus the walk."""

    def __init__(
        self,
        plan: CallPlan,
        state: PlanState,
        items: list[Any],
        call_slots: list[int | None],
        roots: list[Any],
        on_death: Callable[[weakref.ref[Any]], object],
    ):
        self.plan = plan
        self.state = state
        self.items = items
        self.snapshot = Snapshot(tuple(roots))
        self.trace = trace_state()  # where its Variables may be written
        self.roots = [weakref.ref(r, on_death) for r in roots]
        # Each call's flat leaves are picked, in one C-level step per jit argument, from
        # `sources`: the Variables' current values, the arrays the graphs hold outside
        # Variables (plain array attributes: read where they are, `Leaves`), the call's
        # leaves, then constants (graph leaves in containers that are checked by identity).
        self.variables = [x for x in items if isinstance(x, nnx.Variable)]
        if any(v.ref or v.hijax for v in self.variables):  # updated in place, by jax
            raise Uncacheable("a ref or hijax Variable")
        slot_source = {slot: c for c, slot in enumerate(call_slots) if slot is not None}
        found = [
            i
            for i, x in enumerate(items)
            if i not in slot_source and not isinstance(x, nnx.Variable)
        ]
        self.leaves = Leaves(plan, roots, self.snapshot, found)
        source_of: list[int] = []
        n_var, n_leaf, n_call, k = len(self.variables), len(self.leaves), len(call_slots), 0
        constants: list[Leaf] = []
        for i, x in enumerate(items):
            if isinstance(x, nnx.Variable):
                source_of.append(k)
                k += 1
            elif i in slot_source:  # an argument's arrays come from each call, not the first
                source_of.append(n_var + n_leaf + slot_source[i])
            elif i in self.leaves.index:
                source_of.append(n_var + self.leaves.index[i])
            else:
                source_of.append(n_var + n_leaf + n_call + len(constants))
                constants.append(self.leaves.constants[i])
        self.constants = constants
        n_sources = n_var + n_leaf + n_call + len(constants)
        self.pick_donated, self.pick_kept = (
            _picker(idx, n_sources) for idx in plan.partition(source_of)
        )
        self._read = _slots.value_reader()
        self._writer: tuple[OutPlan, Callable[[list[Leaf]], bool]] | None = None
        self._seen: list[Leaf] | None = None  # see `arguments`
        self._value_at = {  # flat input index -> position among the values read
            i: k
            for k, i in enumerate(i for i, x in enumerate(items) if isinstance(x, nnx.Variable))
        }
        self._value_at.update((i, n_var + k) for i, k in self.leaves.index.items())

    def valid(self, roots: list[Any]) -> bool:
        """Same objects as when cached, with the same structure."""
        return (
            all(ref() is root for ref, root in zip(self.roots, roots, strict=True))
            and self.snapshot.fresh()
        )

    def arguments(self, call_leaves: list[Any]) -> tuple[list[Leaf], list[Leaf]] | None:
        """The jitted function's ``(donated, kept)`` for this call; None when a Variable
        or a graph leaf holds a numpy array or a Python or numpy number (set since the
        last call): the full path converts it (`_graph.as_jax`), as flax's call does.

        The values are checked only where they are not the very objects that the last
        call left (`_seen`: read then, with what it wrote back since).
        """
        values = [*map(self._read, self.variables)]
        if self.leaves:
            values += self.leaves.read()
        if not (self._seen is not None and same_objects(values, self._seen)):
            if any(map(is_host_type, {*map(type, values)})):
                return None
        self._seen = values
        sources = values + call_leaves
        if self.constants:
            sources += self.constants
        return self.pick_donated(sources), self.pick_kept(sources)

    def merge(self, out_plan: OutPlan, changed: list[Leaf], out_flat: list[Leaf]) -> Any:
        """Writes the changed Variables and arrays back and builds the output.

        Returns `UNWRITTEN`, having written nothing, where flax's merge would do more
        than store an array (`slots.attribute_writer`): then the
        caller merges in full (`fast_call`), and later calls of this plan take the full path.
        """
        assert out_plan.in_changed is not None and out_plan.out_sources is not None
        if self._writer is None or self._writer[0] is not out_plan:  # one OutPlan a trace
            self._writer = (out_plan, self._write_back(out_plan.in_changed))
        if not self._writer[1](changed):
            return UNWRITTEN
        outputs = iter(out_flat)
        roots = [ref() for ref in self.roots]
        out_leaves = [
            next(outputs) if source is None else roots[source] for source in out_plan.out_sources
        ]
        return jax.tree_util.tree_unflatten(out_plan.out_treedef, out_leaves)

    def _write_back(self, in_changed: tuple[int, ...]) -> Callable[[list[Leaf]], bool]:
        """``values -> written``: writes the values of the flat inputs ``in_changed`` and
        records them as seen (`arguments`); False (nothing written) where the fast path
        cannot write one of them."""
        at_variables = [
            j for j, i in enumerate(in_changed) if isinstance(self.items[i], nnx.Variable)
        ]
        write_variables = _slots.writer([self.items[in_changed[j]] for j in at_variables])
        positions = [self._value_at.get(i, -1) for i in in_changed]

        def record(values: list[Leaf]) -> None:
            if self._seen is not None:
                deque(map(self._seen.__setitem__, positions, values), 0)

        if len(at_variables) == len(in_changed):
            return lambda values: (write_variables(values), record(values), True)[2]
        pick_variables = _picker(at_variables, len(in_changed))
        at_leaves = [j for j in range(len(in_changed)) if j not in set(at_variables)]
        write_leaves = self.leaves.writer([in_changed[j] for j in at_leaves])
        if write_leaves is None:
            return lambda values: False
        pick_leaves = _picker(at_leaves, len(in_changed))

        def write(values: list[Leaf]) -> bool:
            write_variables(pick_variables(values))
            write_leaves(pick_leaves(values))
            record(values)
            return True

        return write


def trace_state() -> Any:
    """jax's current trace state, as flax compares it before writing a Variable."""
    return get_opaque_trace_state(convention="nnx")


def _picker(indices: list[int], n: int) -> Callable[[list[Leaf]], list[Leaf]]:
    """``lambda xs: [xs[i] for i in indices]`` for lists ``xs`` of length ``n``, at C speed."""
    if indices == list(range(n)):  # all of them, in order: the list built for this call
        return lambda xs: xs
    if len(indices) == 0:
        return lambda xs: []
    if len(indices) == 1:
        (i,) = indices
        return lambda xs: [xs[i]]
    get = operator.itemgetter(*indices)
    return lambda xs: list(get(xs))


class Leaves:
    """The arrays a cached split's graphs hold outside Variables (plain array attributes,
    flax's graph leaves), by flat input index: read where they are on each call, and
    written back there, as flax's merge writes them, where that is a plain store.

    The graphs are flattened once more (at cache time, and only when they hold such
    leaves) for each leaf's path. A leaf in one of the containers the `Snapshot` checks
    by identity (a module's ``__dict__``, a dict) is read on each call, and the snapshot
    lets it be replaced by another concrete array; any other (in a list, a tuple, a
    registered pytree) is a constant, checked by identity.
    """

    def __init__(self, plan: CallPlan, roots: list[Any], snapshot: Snapshot, found: list[int]):
        self.snapshot = snapshot
        self.index: dict[int, int] = {}  # flat input index -> position among `read()`
        self.constants: dict[int, Leaf] = {}  # flat input index -> its current leaf
        self._containers: list[Any] = []
        self._keys: list[Any] = []
        self._positions: list[int] = []  # in the snapshot
        self._owners: list[Any] = []
        self._names: list[str | None] = []  # `slots.attribute_writer`'s
        if not found:
            return
        wanted = set(found)
        for i, (root, path, leaf) in _graph_leaves(plan, roots).items():
            if i not in wanted:
                continue
            try:
                owner = _child_at(root, path[:-1])
                container, key = _container(owner, path[-1])
            except (KeyError, IndexError, TypeError):
                self.constants[i] = leaf
                continue
            position = snapshot.position(container, key)
            if position is None or container[key] is not leaf:
                self.constants[i] = leaf
                continue
            self.index[i] = len(self._containers)
            self._containers.append(container)
            self._keys.append(key)
            self._positions.append(position)
            self._owners.append(owner)
            self._names.append(_slots.attribute_writer(owner, path[-1]))
        if len(self.index) + len(self.constants) != len(found):
            raise Uncacheable("a graph leaf that was not found again")
        snapshot.allow_arrays(self._positions)

    def __len__(self) -> int:
        return len(self._containers)

    def read(self) -> list[Leaf]:
        return [*map(operator.getitem, self._containers, self._keys)]

    def writer(self, indices: list[int]) -> LeafWriter | None:
        """Writes the leaves at flat input ``indices``; None if one cannot be stored."""
        at = [self.index.get(i) for i in indices]
        if None in at or any(self._names[k] is None for k in at):  # type: ignore[index]
            return None
        return LeafWriter(
            self.snapshot,
            [self._owners[k] for k in at],  # type: ignore[index]
            [self._names[k] for k in at],  # type: ignore[index]
            [self._positions[k] for k in at],  # type: ignore[index]
        )


class LeafWriter:
    """Stores new arrays in module attributes, as flax's merge does (`slots`)."""

    def __init__(
        self, snapshot: Snapshot, owners: list[Any], names: list[Any], positions: list[int]
    ):
        self.snapshot = snapshot
        self.owners = owners
        self.names = names
        self.positions = positions

    def __call__(self, values: list[Leaf]) -> None:
        for owner, name, position, value in zip(
            self.owners, self.names, self.positions, values, strict=True
        ):
            object.__setattr__(owner, name, value)
            self.snapshot.wrote(position, value)


def _graph_leaves(plan: CallPlan, roots: list[Any]) -> dict[int, tuple[Any, tuple[Any, ...], Leaf]]:
    """``flat input index -> (root, path, leaf)`` for every leaf of the graph nodes, as
    `outside.split_call` flattens them (one split context: shared nodes once)."""
    found: dict[int, tuple[Any, tuple[Any, ...], Leaf]] = {}
    nodes, offset = iter(roots), 0
    with nnx.split_context() as ctx:
        for graphdef, size in zip(plan.graphdefs, plan.sizes, strict=True):
            if graphdef is not None:
                root = next(nodes)
                flat = ctx.flatten(root)[1]
                if len(flat.leaves) != size:
                    raise Uncacheable("a graph that changed its structure")
                for k, (path, leaf) in enumerate(zip(flat.paths, flat.leaves, strict=True)):
                    found[offset + k] = (root, tuple(path), leaf)
            offset += size
    return found


def _child_at(node: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        container, name = _container(node, key)
        node = container[name]
    return node


def _container(node: Any, key: Any) -> tuple[Any, Any]:
    """Where ``node`` keeps its child ``key``, as flax flattens it: ``(mapping, key)``."""
    if isinstance(node, nnx.Pytree):
        return vars(node), str(key)
    if isinstance(node, nnx.State):
        return node.raw_mapping, key
    if type(node) in (dict, list, tuple):
        return node, key
    raise TypeError(type(node).__name__)
