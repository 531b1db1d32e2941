"""`CachedCall`: the call path every transform shares.

A call first tries the fast path (`cache.fast_call`); otherwise it splits its
arguments (`outside.split_call`), runs the plan's jitted function and merges the
results back (`outside.merge_call`), then caches the split for the next call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

import jax
from flax import nnx
from jax.core import Tracer

from .._fastpath.cache import CacheKey, Entry, PlanState, fast_call, remember
from .._sharding import mismatched_shardings
from .._stages import Lowered, PlanBinding, Traced
from .boundary import call_flat, check_writable
from .outside import TAG, CallPlan, CallSpec, merge_abstract, merge_call, split_call

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class PartialRun(Protocol[R_co]):
    """A call with its first ``n_partial`` arguments bound: given the rest, it runs."""

    n_partial: int

    def __call__(self, *args: Any, **kwargs: Any) -> R_co: ...


class CachedCall(Generic[P, R]):
    """The call path every transform shares: the fast path, else split, run, merge.

    A subclass says how one `CallPlan` becomes a jax-level function (`_build`,
    a ``jax.jit`` over the flat ``(donated, kept)`` leaves whose inner function is
    made by the call path's steps 2 and 3 (`inside`)); everything else is here.
    """

    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None
    """The mesh that PartitionSpecs in the shardings refer to; None: the context's."""

    def __init__(self, fun: Callable[P, R], spec: CallSpec):
        functools.update_wrapper(self, fun)
        self.fun = fun
        self._spec = spec
        self._plans: dict[CallPlan, PlanState] = {}
        self._entries: dict[CacheKey, Entry] = {}
        self._bound: tuple[Any, ...] = ()

    def _build(self, plan: CallPlan) -> Callable[..., Any]:
        """The jitted function of one plan, taking ``plan.partition(leaves)``."""
        raise NotImplementedError

    def _state(self, plan: CallPlan) -> PlanState:
        state = self._plans.get(plan)
        if state is None:
            state = self._plans[plan] = PlanState(self._build(plan))
        return state

    def _cached_partial(
        self, cache: Mapping[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> PartialRun[R] | None:
        """For a call made by ``nnx.cached_partial`` (``cache``: its split of the clones
        that lead ``args``): the call with the clones bound and flattened once, or None
        to take the path below."""
        return None

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        call_args = (*self._bound, *args)
        with nnx.update_context(TAG) as context:  # takes the split nnx.cached_partial made
            cache = getattr(context, "static_cache", None)  # a field of nnx.UpdateContext
            if cache is not None and (run := self._cached_partial(cache, args, kwargs)):
                return run(*args[run.n_partial :], **kwargs)
            done, result, key, roots = fast_call(self._entries, self._spec, call_args, kwargs)
            if done:
                return result
            plan, leaves, sites, items = split_call(self._spec, call_args, kwargs)
            state = self._state(plan)
            out = call_flat(state.jitted, plan, leaves, sites, self.mesh)
            concrete = not any(isinstance(x, Tracer) for x in leaves)  # not inside a trace
            if concrete:
                state.wait(out, plan.partition(leaves))
            check_writable(self._spec.transform, items, sites)
            result = merge_call(leaves, *out)
        state.note(out[0])
        if concrete:
            remember(self._entries, key, plan, state, items, roots)
        return result

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        bound = object.__new__(type(self))
        bound.__dict__.update(self.__dict__)
        bound._bound = (obj,)
        return bound

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Traces for these arguments; see `jax.stages.Traced`."""
        plan, leaves, sites, traced = self._abstract("trace", args, kwargs)
        moved = mismatched_shardings(leaves, plan.shardings, sites, self.mesh)
        return Traced(traced, PlanBinding(plan, sites, self._bound, moved))

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Traces and lowers for these arguments; see `jax.stages.Lowered`."""
        return self.trace(*args, **kwargs).lower()

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The abstract outputs (modules included) of a call; changes no state."""
        _, leaves, _, out = self._abstract("eval_shape", args, kwargs)
        return merge_abstract(leaves, *out)

    def _abstract(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Splits a call and runs ``jax.jit(...).trace`` or ``.eval_shape`` on it."""
        with nnx.update_context(TAG):
            plan, leaves, sites, _ = split_call(self._spec, (*self._bound, *args), kwargs)
            state = self._state(plan)
            result = call_flat(getattr(state.jitted, method), plan, leaves, sites, self.mesh)
        out_info = result.out_info if method == "trace" else result
        state.note(out_info[0])
        return plan, leaves, sites, result
