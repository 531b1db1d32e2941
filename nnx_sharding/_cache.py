"""The fast path: reuse a call's split while its module graphs stay unchanged.

The full protocol (`_graph`) walks every object graph twice per call. When the
same modules come back with the same structure, the split is known already: the
flat list of Variables, the plan and the jitted function. An `Entry` keeps them,
with a `Snapshot` that proves "unchanged" at C speed: the identity of every value
in every mutable container (module ``__dict__``, lists, dicts, States) of the graphs.

A call takes the fast path (`fast_call`) only when the trace that jax will reuse
reported no structure change (`OutPlan.fast`), at the jax trace level the split was
cached at (outside any jax transform, where its Variables may be written). Should
jax need a new trace during a fast call (new shapes, say), the trace runs to its end
and raises `NeedsTrace` if its plan is not fast (`_graph.checked_on_fast_calls`),
before the program runs; the call is then redone on the full protocol.
`_call.CachedCall` (every transform) and `_stages.Compiled` call through here.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import numpy as np
from flax import nnx
from jax.extend.core import get_opaque_trace_state

from . import _slots
from ._boundary import host_callbacks
from ._graph import (
    FAST_CALL,
    CallPlan,
    CallSpec,
    Leaf,
    NeedsTrace,
    OutPlan,
    partition_args,
)
from ._sharding import is_node
from ._snapshot import Snapshot, Uncacheable

MAX_ENTRIES = 64
"""Cached splits per transform; an entry also goes when one of its modules dies."""
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
    return True, entry.merge(*out), key, roots


def remember(
    entries: dict[CacheKey, Entry],
    key: CacheKey | None,
    plan: CallPlan,
    state: PlanState,
    items: list[Any],
    roots: list[Any],
) -> None:
    """Caches a call's split (``items`` from `_graph.split_call`), if it can be."""
    if key is None:
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
    """A cached split: what `_graph.split_call` would return, minus the walk."""

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
        # `sources`: the Variables' current values, then the call's leaves, then constants
        # (arrays that graph nodes hold outside Variables).
        self.variables = [x for x in items if isinstance(x, nnx.Variable)]
        if any(v.ref or v.hijax for v in self.variables):  # updated in place, by jax
            raise Uncacheable("a ref or hijax Variable")
        source_of: list[int] = []
        constants: list[Leaf] = []
        slot_source = {slot: c for c, slot in enumerate(call_slots) if slot is not None}
        n_var, n_call, k = len(self.variables), len(call_slots), 0
        for i, x in enumerate(items):
            if isinstance(x, nnx.Variable):
                source_of.append(k)
                k += 1
            elif i in slot_source:  # an argument's arrays come from each call, not the first
                source_of.append(n_var + slot_source[i])
            else:
                source_of.append(n_var + n_call + len(constants))
                constants.append(x)
        self.constants = constants
        n_sources = n_var + n_call + len(constants)
        self.pick_donated, self.pick_kept = (
            _picker(idx, n_sources) for idx in plan.partition(source_of)
        )
        self._read = _slots.value_reader()
        self._writer: tuple[OutPlan, Callable[[list[Leaf]], None]] | None = None

    def valid(self, roots: list[Any]) -> bool:
        """Same objects as when cached, with the same structure."""
        return (
            all(ref() is root for ref, root in zip(self.roots, roots, strict=True))
            and self.snapshot.fresh()
        )

    def arguments(self, call_leaves: list[Any]) -> tuple[list[Leaf], list[Leaf]] | None:
        """The jitted function's ``(donated, kept)`` for this call; None when a Variable
        holds a numpy array (set since the last call): the full path converts it."""
        sources = [*map(self._read, self.variables)]
        if np.ndarray in {*map(type, sources)}:
            return None
        sources += call_leaves
        sources += self.constants
        return self.pick_donated(sources), self.pick_kept(sources)

    def merge(self, out_plan: OutPlan, changed: list[Leaf], out_flat: list[Leaf]) -> Any:
        """Writes the changed Variables back and builds the output."""
        assert out_plan.in_changed is not None and out_plan.out_sources is not None
        if self._writer is None or self._writer[0] is not out_plan:  # one OutPlan a trace
            changed_vars = [self.items[i] for i in out_plan.in_changed]
            self._writer = (out_plan, _slots.writer(changed_vars))
        self._writer[1](changed)
        outputs = iter(out_flat)
        roots = [ref() for ref in self.roots]
        out_leaves = [
            next(outputs) if source is None else roots[source] for source in out_plan.out_sources
        ]
        return jax.tree_util.tree_unflatten(out_plan.out_treedef, out_leaves)


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
