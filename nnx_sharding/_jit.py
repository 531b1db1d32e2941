"""`jit`: ``jax.jit`` over NNX graph nodes, with NNX semantics."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax
from flax import nnx

from ._cache import CacheKey, Entry, PlanState, fast_key, remember
from ._graph import (
    FAST_CALL,
    TAG,
    CallPlan,
    CallSpec,
    NeedsTrace,
    call_flat,
    make_inner,
    merge_abstract,
    merge_call,
    split_call,
)
from ._stages import Lowered, Traced

P = ParamSpec("P")
R = TypeVar("R")
Shardings = Any
"""A pytree prefix of shardings, PartitionSpecs, `StateSharding`s and Nones."""


def _as_tuple(x: int | str | Iterable[Any] | None) -> tuple[Any, ...]:
    if x is None:
        return ()
    return (x,) if isinstance(x, (int, str)) else tuple(x)


def resolve_argnums(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] | None,
    argnames: str | Iterable[str] | None,
) -> tuple[frozenset[int], frozenset[str]]:
    """Completes positions from names and names from positions, as ``jax.jit`` does."""
    nums, names = set(_as_tuple(argnums)), set(_as_tuple(argnames))
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return frozenset(nums), frozenset(names)
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params) is False:
        nums = {n % len(positional) if n < 0 and positional else n for n in nums}
    nums |= {positional.index(n) for n in names if n in positional}
    names |= {positional[i] for i in nums if 0 <= i < len(positional)}
    return frozenset(nums), frozenset(names)


class JitWrapped(Generic[P, R]):
    """A jitted function over NNX graph nodes; what `jit` returns.

    Call it like the wrapped function. ``trace``, ``lower`` and ``eval_shape``
    take the same arguments and return the stage objects or abstract outputs.
    """

    def __init__(
        self,
        fun: Callable[P, R],
        *,
        in_shardings: Shardings = None,
        out_shardings: Shardings = None,
        static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Iterable[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Iterable[str] | None = None,
        keep_unused: bool = False,
        device: jax.Device | None = None,
        backend: str | None = None,
        inline: bool = False,
        compiler_options: dict[str, Any] | None = None,
    ):
        functools.update_wrapper(self, fun)
        self.fun = fun
        static = resolve_argnums(fun, static_argnums, static_argnames)
        donate = resolve_argnums(fun, donate_argnums, donate_argnames)
        self._spec = CallSpec(
            "jit", *static, *donate, in_shardings=in_shardings, out_shardings=out_shardings
        )
        self._jit_options = dict(
            keep_unused=keep_unused,
            device=device,
            backend=backend,
            inline=inline,
            compiler_options=compiler_options,
        )
        self._plans: dict[CallPlan, PlanState] = {}
        self._entries: dict[CacheKey, Entry] = {}
        self._bound: tuple[Any, ...] = ()

    def _state(self, plan: CallPlan) -> PlanState:
        """The ``jax.jit`` function of one plan; created once, then cached."""
        state = self._plans.get(plan)
        if state is None:
            options: dict[str, Any] = {k: v for k, v in self._jit_options.items() if v}
            if any(s is not None for s in plan.shardings):
                options["in_shardings"] = plan.partition(plan.shardings)
            if any(plan.donate):
                options["donate_argnums"] = 0
            state = PlanState(jax.jit(make_inner(self.fun, plan), **options))
            self._plans[plan] = state
        return state

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        args = (*self._bound, *args)
        key, call_leaves, roots = fast_key(self._spec, args, kwargs)
        entry = self._entries.get(key)
        if entry is not None and entry.state.fast and entry.valid(roots):
            leaves = entry.leaves(call_leaves)
            FAST_CALL.active = True
            try:
                out = entry.state.jitted(*entry.plan.partition(leaves))
            except NeedsTrace:
                pass
            else:
                return entry.merge(*out)
            finally:
                FAST_CALL.active = False
        with nnx.update_context(TAG):
            plan, leaves, sites, items = split_call(self._spec, args, kwargs)
            state = self._state(plan)
            out = call_flat(state.jitted, plan, leaves, sites)
            result = merge_call(leaves, *out)
        state.note(out[0])
        remember(self._entries, key, plan, state, items, roots)
        return result

    def __get__(self, obj: Any, objtype: type | None = None) -> JitWrapped[P, R]:
        if obj is None:
            return self
        bound = object.__new__(type(self))
        bound.__dict__.update(self.__dict__)
        bound._bound = (obj,)
        return bound

    def trace(self, *args: P.args, **kwargs: P.kwargs) -> Traced:
        """Traces for these arguments; see `jax.stages.Traced`."""
        plan, _, sites, traced = self._abstract("trace", args, kwargs)
        return Traced(traced, plan, sites, self._bound)

    def lower(self, *args: P.args, **kwargs: P.kwargs) -> Lowered:
        """Traces and lowers for these arguments; see `jax.stages.Lowered`."""
        return self.trace(*args, **kwargs).lower()

    def eval_shape(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        """The abstract outputs (modules included) of a call; changes no state."""
        _, leaves, _, out = self._abstract("eval_shape", args, kwargs)
        return merge_abstract(leaves, *out)

    def _abstract(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Splits a call and runs ``jax.jit(...).trace`` or ``.eval_shape`` on it."""
        with nnx.update_context(TAG):
            plan, leaves, sites, _ = split_call(self._spec, (*self._bound, *args), kwargs)
            state = self._state(plan)
            result = call_flat(getattr(state.jitted, method), plan, leaves, sites)
        out_info = result.out_info if method == "trace" else result
        state.note(out_info[0])
        return plan, leaves, sites, result


@overload
def jit(
    fun: Callable[P, R],
    *,
    in_shardings: Shardings = None,
    out_shardings: Shardings = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    keep_unused: bool = False,
    device: jax.Device | None = None,
    backend: str | None = None,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
) -> JitWrapped[P, R]: ...
@overload
def jit(
    fun: None = None,
    *,
    in_shardings: Shardings = None,
    out_shardings: Shardings = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    keep_unused: bool = False,
    device: jax.Device | None = None,
    backend: str | None = None,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
) -> Callable[[Callable[P, R]], JitWrapped[P, R]]: ...
def jit(fun: Callable[P, R] | None = None, **options: Any) -> Any:
    """``jax.jit`` for functions of NNX graph nodes; call-compatible with ``flax.nnx.jit``.

    Arguments and outputs may mix arrays and graph nodes (Modules, Variables, Rngs,
    Optimizers, ``nnx.List``/``nnx.Dict``) at any depth. Shared references are kept;
    Variable updates and structure changes made inside reach the caller's objects;
    an output that is an input object comes back as that very object.

    Args:
      fun: the function; omit it to use ``jit(...)`` as a decorator factory.
      in_shardings: pytree prefix of the positional arguments; at a graph node a
        `StateSharding`, or one Sharding/PartitionSpec/None for all its Variables.
      out_shardings: the same for the output.
      static_argnums, static_argnames, donate_argnums, donate_argnames, keep_unused,
        device, backend, inline, compiler_options: as in ``jax.jit``; a donated
        module's Variables receive the new buffers.

    Returns:
      A `JitWrapped`.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import nnx_sharding
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> @nnx_sharding.jit
    ... def forward(model, x):
    ...     return model(x)
    >>> forward(model, jnp.ones((1, 2))).shape
    (1, 3)
    """
    if fun is None:
        return lambda f: JitWrapped(f, **options)
    return JitWrapped(fun, **options)
