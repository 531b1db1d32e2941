"""`Traced`, `Lowered`, `Compiled`: jax's stage objects, taking and returning modules.

Each wraps the ``jax.stages`` object of the flat call plus the `CallPlan` that
turns module arguments into that flat call (pre-process, `_graph.split_call`) and
its results back into modules (post-process, `_graph.merge_call`). jax's
introspection passes through unchanged; ``args_info`` and ``out_info`` are given
in the caller's structure, with each graph node as an ``nnx.State`` or an
abstract module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from flax import nnx

from . import _errors
from ._graph import (
    TAG,
    CallPlan,
    Leaf,
    Site,
    call_flat,
    chunks,
    merge_abstract,
    merge_call,
    split_call,
)


def _passthrough(name: str, stage: str) -> property:
    def get(self: _Stage) -> Any:
        return getattr(self._jax, name)

    return property(get, doc=f"See `jax.stages.{stage}.{name}`.")


def _differences(plan: CallPlan, expected: CallPlan) -> list[str]:
    found = []
    if plan.treedef != expected.treedef:
        missing = [w for w in expected.wheres if w not in plan.wheres]
        extra = [w for w in plan.wheres if w not in expected.wheres]
        if missing or extra:
            found.append(_errors.argument_structure(missing, extra))
        else:  # the same positions, other containers (a list for a tuple, say)
            found.append(f"argument structure {plan.treedef} differs from {expected.treedef}")
    for i, (a, b) in enumerate(zip(plan.graphdefs, expected.graphdefs, strict=False)):
        if a != b:
            found.append(f"the graph node at {plan.wheres[i]} has another structure")
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


class _Stage:
    """Common to the three stages: the jax object, the plan and the leaf labels."""

    _STAGE = ""

    def __init__(
        self, jax_stage: Any, plan: CallPlan, sites: Sequence[Site], bound: tuple[Any, ...] = ()
    ):
        self._jax = jax_stage
        self._plan = plan
        self._sites = tuple(sites)
        self._bound = bound  # the object of a bound method, passed first

    @property
    def args_info(self) -> Any:
        """See `jax.stages.Lowered.args_info`; graph nodes as ``nnx.State`` of ``ArgInfo``."""
        donated, kept = self._jax.args_info[0]
        infos = self._plan.join(donated, kept)
        return arrange(self._plan, self._sites, infos)

    @property
    def out_info(self) -> Any:
        """See `jax.stages.Traced.out_info`; graph nodes as abstract modules."""
        avals = jax.tree_util.tree_leaves(self._jax.in_avals)
        n_donated = sum(self._plan.donate)
        leaves = self._plan.join(avals[:n_donated], avals[n_donated:])
        return merge_abstract(leaves, *self._jax.out_info)

    in_tree = property(lambda self: self._jax.in_tree, doc="See `jax.stages.Lowered.in_tree`.")
    in_avals = property(lambda self: self._jax.in_avals, doc="See `jax.stages.Lowered.in_avals`.")
    out_tree = property(lambda self: self._jax.out_tree, doc="See `jax.stages.Lowered.out_tree`.")
    donate_argnums = property(
        lambda self: self._jax.donate_argnums, doc="See `jax.stages.Lowered.donate_argnums`."
    )


def arrange(
    plan: CallPlan,
    sites: Sequence[Site],
    values: Sequence[Any],
    to_state: Callable[[Iterable[tuple[Any, Any]]], nnx.State] = nnx.from_flat_state,
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

    _STAGE = "Traced"
    jaxpr = _passthrough("jaxpr", "Traced")
    out_avals = _passthrough("out_avals", "Traced")
    fun_name = _passthrough("fun_name", "Traced")
    lojax = _passthrough("lojax", "Traced")

    _moved: Sequence[tuple[str, Any, Any]] = ()
    """``(where, sharding, wanted)`` of committed arguments on another sharding than
    in_shardings asks (`_sharding.mismatched_shardings`), for jax's error at lowering."""

    def lower(self, *, lowering_platforms: tuple[str, ...] | None = None) -> Lowered:
        """See `jax.stages.Traced.lower`."""
        try:
            lowered = self._jax.lower(lowering_platforms=lowering_platforms)
        except ValueError as e:
            if not self._moved or "does not match the sharding" not in str(e):
                raise
            spec = self._plan.spec
            message = _errors.sharding_mismatch(spec.transform, spec.in_name, self._moved)
            raise ValueError(message).with_traceback(e.__traceback__) from None
        return Lowered(lowered, self._plan, self._sites, self._bound)


class Lowered(_Stage):
    """A lowered call; mirrors `jax.stages.Lowered`."""

    _STAGE = "Lowered"

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
        return Compiled(self._jax.compile(compiler_options), self._plan, self._sites, self._bound)


class Compiled(_Stage):
    """A compiled call; mirrors `jax.stages.Compiled`, called with modules."""

    _STAGE = "Compiled"
    input_shardings = _passthrough("input_shardings", "Compiled")
    output_shardings = _passthrough("output_shardings", "Compiled")
    input_formats = _passthrough("input_formats", "Compiled")
    output_formats = _passthrough("output_formats", "Compiled")

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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the program on the same kinds of arguments as the `JitWrapped`."""
        spec = self._plan.spec
        with nnx.update_context(TAG):
            plan, leaves, sites, _ = split_call(spec, (*self._bound, *args), kwargs)
            wrong = _differences(plan, self._plan) if plan != self._plan else []
            donated, kept = plan.partition(leaves)
            if not wrong:
                wrong = _aval_differences(
                    [*donated, *kept],
                    [*plan.partition(sites)[0], *plan.partition(sites)[1]],
                    jax.tree_util.tree_leaves(self._jax.in_avals),
                )
            if wrong:
                raise TypeError(_errors.structure_mismatch(spec.transform, wrong))
            return merge_call(leaves, *call_flat(self._jax, plan, leaves, sites))

    call = __call__
