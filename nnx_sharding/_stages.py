"""`Traced`, `Lowered`, `Compiled`: jax's stage objects, taking and returning modules.

Each wraps the ``jax.stages`` object of the flat call plus a `Binding`: what maps
the program's flat inputs and outputs to the caller's. Every call path gives the
same three classes: `PlanBinding` here for the full graph path (the `CallPlan`
that `outside.split_call` makes and `outside.merge_call` undoes), and `simple.SimpleCall`
for the simple path (``graph=False`` or ``graph_updates=False``). jax's
introspection passes through unchanged; ``args_info`` and the members jax
unflattens with ``out_tree`` are given in the caller's structure, with each graph
node as an ``nnx.State`` (arguments) or as a module (outputs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import jax
from flax import nnx

from . import _errors
from ._callpath.boundary import call_flat, check_writable, host_callbacks
from ._callpath.changes import compiled_differences
from ._callpath.outside import (
    TAG,
    CallPlan,
    Leaf,
    Site,
    abstract_leaves,
    chunks,
    merge_call,
    merge_new,
    split_call,
    unflatten_all,
)
from ._fastpath.cache import CacheKey, Entry, PlanState, fast_call, remember
from ._types import PyTreeDef

if TYPE_CHECKING:
    from jax.extend.core import ClosedJaxpr


def _abstract_nodes(plan: CallPlan, leaves: Sequence[Any]) -> list[Any]:
    """The call's graph nodes rebuilt from ``plan`` with abstract leaves (None for arrays)."""
    with nnx.merge_context() as ctx:
        nodes = unflatten_all(ctx, plan.graphdefs, abstract_leaves(leaves), plan.sizes)
    return [n if g is not None else None for n, g in zip(nodes, plan.graphdefs, strict=True)]


def _node_differences(
    plan: CallPlan, expected: CallPlan, leaves: Sequence[Any], expected_leaves: Sequence[Any]
) -> list[str]:
    """How each graph node argument differs from the one compiled for, attribute by
    attribute (`changes.compiled_differences`)."""
    try:
        called = _abstract_nodes(plan, leaves)
        compiled = dict(
            zip(expected.wheres, _abstract_nodes(expected, expected_leaves), strict=True)
        )
    except Exception:  # noqa: BLE001 - cannot rebuild them: say only where
        called, compiled = [None] * len(plan.wheres), {}
    found = []
    for where, a, b, node in zip(
        plan.wheres, plan.graphdefs, expected.graphdefs, called, strict=False
    ):
        if a == b:
            continue
        other = compiled.get(where)
        details = (
            compiled_differences(where, other, node)
            if node is not None and other is not None
            else []
        )
        found.append(
            f"the graph node at {where} has another structure"
            + (": " + "; ".join(details) if details else "")
        )
    return found


def _differences(
    plan: CallPlan, expected: CallPlan, leaves: Sequence[Any], expected_leaves: Sequence[Any]
) -> list[str]:
    """What makes a call's plan differ from the one compiled for; ``leaves`` and
    ``expected_leaves``: the flat leaves of each (concrete or abstract)."""
    found = []
    if plan.treedef != expected.treedef:
        missing = [w for w in expected.wheres if w not in plan.wheres]
        extra = [w for w in plan.wheres if w not in expected.wheres]
        if missing or extra:
            found.append(_errors.argument_structure(missing, extra))
        else:  # the same positions, other containers (a list for a tuple, say)
            found.append(f"argument structure {plan.treedef} differs from {expected.treedef}")
    found += _node_differences(plan, expected, leaves, expected_leaves)
    if plan.statics != expected.statics:
        found.append(f"static arguments {plan.statics!r} differ from {expected.statics!r}")
    if not found and (plan.shardings != expected.shardings or plan.donate != expected.donate):
        found.append("the shardings or donation of the arguments differ")
    return found or ["the arguments differ from those the program was lowered for"]


def _aval_differences(
    leaves: Sequence[Leaf], sites: Sequence[Site], expected: Sequence[Any]
) -> list[str]:
    found = []
    for leaf, label, aval in zip(leaves, sites, expected, strict=False):
        shape, dtype = getattr(leaf, "shape", ()), getattr(leaf, "dtype", None)
        if tuple(shape) != tuple(aval.shape) or (dtype is not None and dtype != aval.dtype):
            found.append(
                f"{label}: got {dtype}{list(shape)}, compiled for {aval.dtype}{list(aval.shape)}"
            )
    return found


class Binding(Protocol):
    """How a program's flat inputs and outputs map to the caller's; a call path's."""

    def arguments(self, infos: Any) -> Any:
        """jax's ``args_info`` of the program -> the caller's ``(args, kwargs)``."""
        ...

    def outputs(self, member: Any, inputs: Callable[[], list[Any]]) -> Any:
        """A member jax gives in the program's output structure -> ``out_tree``'s: the
        function's output, each graph node as it comes back holding the member's value
        for each Variable. ``inputs()``: per flat input of the program, in jax's order,
        the value for a Variable returned as it came."""
        ...

    def lowering_error(self, error: ValueError) -> str | None:
        """The message for an error of jax's ``lower``, or None to raise it as is."""
        ...

    def runner(self, compiled: Any, waits: bool) -> Callable[..., Any]:
        """The function `Compiled.__call__` is: the caller's arguments, ``compiled``."""
        ...


class _Stage:
    """Common to the three stages: the jax object and the binding."""

    def __init__(self, jax_stage: Any, binding: Binding, waits: bool = False):
        self._jax = jax_stage
        self._binding = binding
        self._waits = waits  # the program has host callbacks: see `cache.PlanState.wait`

    @property
    def args_info(self) -> Any:
        """See `jax.stages.Lowered.args_info`; graph nodes as ``nnx.State`` of ``ArgInfo``."""
        return self._binding.arguments(self._jax.args_info)

    @property
    def out_info(self) -> Any:
        """See `jax.stages.Traced.out_info`; graph nodes as abstract modules."""
        return self._binding.outputs(self._jax.out_info, self._passed_through)

    def _passed_through(self) -> list[Any]:
        """Per input leaf, the ``out_info`` entry of an input returned as it came, as
        jax's own stage writes its outputs' (here `jax.stages.Lowered.out_info`'s)."""
        return abstract_leaves(self._in_leaves(self._jax.in_avals))

    def _in_leaves(self, member: Any) -> list[Any]:
        """A member jax gives in the program's input structure, as its flat leaves."""
        return self._jax.in_tree.flatten_up_to(member)

    @property
    def in_tree(self) -> PyTreeDef:
        """See `jax.stages.Lowered.in_tree`."""
        return self._jax.in_tree

    @property
    def in_avals(self) -> Any:
        """See `jax.stages.Lowered.in_avals`."""
        return self._jax.in_avals

    @property
    def out_tree(self) -> PyTreeDef:
        """See `jax.stages.Lowered.out_tree`: the structure of the function's output,
        graph nodes included, as `out_info` gives it."""
        return jax.tree.structure(self.out_info)

    @property
    def donate_argnums(self) -> tuple[int, ...]:
        """See `jax.stages.Lowered.donate_argnums`."""
        return self._jax.donate_argnums


def arrange(
    plan: CallPlan,
    sites: Sequence[Site],
    values: Sequence[Any],
    to_state: Callable[[list[tuple[Any, Any]]], Any] = nnx.from_flat_state,
) -> Any:
    """Per-leaf values -> the caller's ``(args, kwargs)``; graph nodes become States."""
    call_leaves = [
        chunk[0]
        if graphdef is None
        else to_state([(site.path, v) for site, v in zip(here, chunk, strict=True)])
        for graphdef, chunk, here in zip(
            plan.graphdefs, chunks(values, plan.sizes), chunks(sites, plan.sizes), strict=True
        )
    ]
    return jax.tree_util.tree_unflatten(plan.treedef, call_leaves)


class Traced(_Stage):
    """A traced call; mirrors `jax.stages.Traced`."""

    @property
    def jaxpr(self) -> ClosedJaxpr:
        """See `jax.stages.Traced.jaxpr`."""
        return self._jax.jaxpr

    @property
    def out_avals(self) -> Any:
        """See `jax.stages.Traced.out_avals`; structured as `out_tree`."""
        return self._binding.outputs(
            self._jax.out_avals, lambda: self._in_leaves(self._jax.in_avals)
        )

    def _passed_through(self) -> list[Any]:
        # jax.stages.Traced.out_info keeps each aval's weak type
        return [
            jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
            for a in self._in_leaves(self._jax.in_avals)
        ]

    @property
    def fun_name(self) -> str:
        """See `jax.stages.Traced.fun_name`."""
        return self._jax.fun_name

    @property
    def lojax(self) -> Any:
        """See `jax.stages.Traced.lojax`."""
        return self._jax.lojax

    def lower(self, *, lowering_platforms: tuple[str, ...] | None = None) -> Lowered:
        """See `jax.stages.Traced.lower`."""
        try:
            lowered = self._jax.lower(lowering_platforms=lowering_platforms)
        except ValueError as e:
            message = self._binding.lowering_error(e)
            if message is None:
                raise
            raise ValueError(message).with_traceback(e.__traceback__) from None
        return Lowered(lowered, self._binding, host_callbacks(self._jax.jaxpr.jaxpr))


class Lowered(_Stage):
    """A lowered call; mirrors `jax.stages.Lowered`."""

    def as_text(self, dialect: str | None = None, *, debug_info: bool = False) -> str:
        """See `jax.stages.Lowered.as_text`."""
        return self._jax.as_text(dialect, debug_info=debug_info)

    def compiler_ir(self, dialect: str | None = None) -> Any | None:
        """See `jax.stages.Lowered.compiler_ir`."""
        return self._jax.compiler_ir(dialect)

    def cost_analysis(self) -> Any | None:
        """See `jax.stages.Lowered.cost_analysis`."""
        return self._jax.cost_analysis()

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Compiled:
        """See `jax.stages.Lowered.compile`."""
        compiled = self._jax.compile(compiler_options)
        return Compiled(compiled, self._binding, self._waits)


class Compiled(_Stage):
    """A compiled call; mirrors `jax.stages.Compiled`, called with modules."""

    def _passed_through(self) -> list[Any]:
        # jax.stages.Compiled.out_info gives each output its format
        formats = self._in_leaves(self.input_formats)
        return [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=f if f.sharding else None)
            for a, f in zip(self._in_leaves(self._jax.in_avals), formats, strict=True)
        ]

    @property
    def input_shardings(self) -> Any:
        """See `jax.stages.Compiled.input_shardings`."""
        return self._jax.input_shardings

    @property
    def output_shardings(self) -> Any:
        """See `jax.stages.Compiled.output_shardings`; structured as `out_tree`."""
        return self._binding.outputs(
            self._jax.output_shardings, lambda: self._in_leaves(self.input_shardings)
        )

    @property
    def input_formats(self) -> Any:
        """See `jax.stages.Compiled.input_formats`."""
        return self._jax.input_formats

    @property
    def output_formats(self) -> Any:
        """See `jax.stages.Compiled.output_formats`; structured as `out_tree`."""
        return self._binding.outputs(
            self._jax.output_formats, lambda: self._in_leaves(self.input_formats)
        )

    def as_text(self) -> str | None:
        """See `jax.stages.Compiled.as_text`."""
        return self._jax.as_text()

    def cost_analysis(self) -> Any | None:
        """See `jax.stages.Compiled.cost_analysis`."""
        return self._jax.cost_analysis()

    def memory_analysis(self) -> Any | None:
        """See `jax.stages.Compiled.memory_analysis`."""
        return self._jax.memory_analysis()

    def runtime_executable(self) -> Any | None:
        """See `jax.stages.Compiled.runtime_executable`."""
        return self._jax.runtime_executable()

    @functools.cached_property
    def _run(self) -> Callable[..., Any]:
        return self._binding.runner(self._jax, self._waits)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the program on the same kinds of arguments as the `JitWrapped`."""
        return self._run(*args, **kwargs)

    call = __call__


# ---------------------------------------------------------------------------------------
# the full graph path's binding


class PlanBinding:
    """The `Binding` of the full graph path: a `CallPlan` and its leaves' labels.

    Args:
        plan: the call's plan (`outside.split_call`).
        sites: each flat leaf's label, in the plan's order.
        bound: the object of a bound method, passed first.
        moved: ``(where, sharding, wanted)`` of committed arguments on another sharding
            than in_shardings asks (`_sharding.mismatched_shardings`), for jax's error
            at lowering.
    """

    def __init__(
        self,
        plan: CallPlan,
        sites: Sequence[Site],
        bound: tuple[Any, ...] = (),
        moved: Sequence[tuple[str, Any, Any]] = (),
    ):
        self.plan = plan
        self.sites = tuple(sites)
        self.bound = bound
        self.moved = moved

    def _join(self, leaves: Sequence[Any]) -> list[Any]:
        """Leaves in the program's ``(donated, kept)`` order -> the plan's order."""
        n_donated = sum(self.plan.donate)
        return self.plan.join(leaves[:n_donated], leaves[n_donated:])

    def arguments(self, infos: Any) -> Any:
        donated, kept = infos[0]
        return arrange(self.plan, self.sites, self.plan.join(donated, kept), _state_or_value)

    def outputs(self, member: Any, inputs: Callable[[], list[Any]]) -> Any:
        return merge_new(self._join(inputs()), *member)

    def lowering_error(self, error: ValueError) -> str | None:
        if not self.moved or "does not match the sharding" not in str(error):
            return None
        spec = self.plan.spec
        return _errors.sharding_mismatch(spec.transform, spec.in_name, self.moved)

    def runner(self, compiled: Any, waits: bool) -> Callable[..., Any]:
        return _PlanRunner(self, compiled, waits)


def _state_or_value(pairs: list[tuple[Any, Any]]) -> Any:
    """A graph node's ``(path, value)`` pairs as an ``nnx.State``; a Variable argument
    (its one value at the empty path) as that value."""
    if [path for path, _ in pairs] == [()]:
        return pairs[0][1]
    return nnx.from_flat_state(pairs)


class _PlanRunner:
    """`Compiled.__call__` on the full graph path: checks the arguments against the
    plan, runs, writes back; repeated calls take `cache`'s fast path."""

    def __init__(self, binding: PlanBinding, compiled: Any, waits: bool):
        self._binding = binding
        self._jax = compiled
        self._state = PlanState(compiled, waits=waits)
        self._entries: dict[CacheKey, Entry] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        expected = self._binding.plan
        spec = expected.spec
        call_args = (*self._binding.bound, *args)
        with nnx.update_context(TAG):  # it also takes the split nnx.cached_partial made
            done, result, key, roots = fast_call(self._entries, spec, call_args, kwargs)
            if done:
                return result
            plan, leaves, sites, items = split_call(spec, call_args, kwargs)
            wrong = []
            if plan != expected:
                in_avals = self._binding._join(self._jax.in_tree.flatten_up_to(self._jax.in_avals))
                wrong = _differences(plan, expected, leaves, in_avals)
            donated, kept = plan.partition(leaves)
            types = not wrong
            if not wrong:
                donated_sites, kept_sites = plan.partition(sites)
                wrong = _aval_differences(
                    [*donated, *kept],
                    [*donated_sites, *kept_sites],
                    jax.tree_util.tree_leaves(self._jax.in_avals),
                )
            if wrong:
                raise TypeError(_errors.structure_mismatch(spec.transform, wrong, types))
            out = call_flat(self._jax, plan, leaves, sites)
            self._state.wait(out, (donated, kept))  # a run-time error: nothing written back
            check_writable(spec.transform, items, sites)
            result = merge_call(leaves, *out)
        self._state.note(out[0])
        remember(self._entries, key, plan, self._state, items, roots)
        return result
