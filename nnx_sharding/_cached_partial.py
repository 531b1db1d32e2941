"""`nnx.cached_partial` over `jit`: the cached clones flattened once, as `jit_partial`.

``nnx.cached_partial(f, *nodes)`` clones ``nodes`` (sharing their Variables) and calls
``f(*clones, *args)`` with its own split of them pending (`_slots.take_static_cache`).
Nothing but cached_partial holds the clones, so their structure cannot change between
calls: `jit`'s call takes them as `jit_partial` takes its partial arguments.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import jax
import numpy as np

from ._partial import JitPartialWrapped, is_variable
from ._sharding import is_node

MAX_CACHED = 8
"""`cached_partial_call`'s partials per jitted function (each holds its clones)."""

_KEEP = (
    "nnx.cached_partial flattened these arguments once, and a structure change made "
    "inside cannot reach your objects (flax raises too)"
)


def cached_partial_call(
    wrapped: Any, cache: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> JitPartialWrapped[Any] | None:
    """For ``nnx.cached_partial(jit(f), *nodes)(*args)``: a `JitPartialWrapped` over the
    leading arguments that are cached_partial's clones (``cache``'s keys), made once;
    None when the call must take `jit`'s full path: no clone leads, a graph node or
    Variable among the other arguments, a clone that is static or donated apart from
    the others, shardings given, or a bound method.

    ``wrapped`` is a `jit` `JitWrapped` (its ``fun``, ``_spec``, ``_bound`` and
    ``_jit_options``). The clones are nothing but cached_partial's (it made them), so
    their structure is fixed: the `jit_partial` contract holds by construction.
    """
    last = wrapped.__dict__.get("_cached_partial_last")
    if last is not None and last[0] is cache:  # the same cached_partial as last time
        clones, partial = last[1], last[2]
        k = len(clones)
        if len(args) >= k and all(map(operator.is_, clones, args)):
            return partial if _plain(args[k:], kwargs) else None
    k = 0
    while k < len(args) and is_node(args[k]) and args[k] in cache:
        k += 1
    if k == 0 or not _plain(args[k:], kwargs):
        return None
    table: dict[tuple[Any, ...], Any] = wrapped.__dict__.setdefault("_cached_partials", {})
    key = (id(cache), *map(id, args[:k]))
    found = table.get(key)
    if found is not None and found[0] is cache:
        partial = found[1]
    else:
        partial = _from_jit(wrapped, args[:k])
        table.pop(key, None)
        table[key] = (cache, partial)
        while len(table) > MAX_CACHED:
            table.pop(next(iter(table)))
    if partial is not None:
        wrapped.__dict__["_cached_partial_last"] = (cache, tuple(args[:k]), partial)
    return partial


_ARRAYS = (jax.Array, np.ndarray, int, float, complex, bool)


def _plain(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the arguments after the clones hold no graph node and no Variable."""
    if not kwargs and all(isinstance(a, _ARRAYS) and not is_node(a) for a in args):
        return True
    rest = jax.tree_util.tree_leaves((args, kwargs), is_leaf=is_node)
    return not any(is_node(x) or is_variable(x) for x in rest)


def _from_jit(wrapped: Any, clones: tuple[Any, ...]) -> JitPartialWrapped[Any] | None:
    """``wrapped``'s options as `jit_partial` counts them (``0``: the clones), or None."""
    spec, k = wrapped._spec, len(clones)
    if wrapped._bound or spec.in_shardings is not None or spec.out_shardings is not None:
        return None
    if any(i < k for i in spec.static_argnums):
        return None
    donated = {i for i in spec.donate_argnums if i < k}
    if donated and donated != set(range(k)):  # one list: donated together or not at all
        return None
    try:
        params = list(inspect.signature(wrapped.fun).parameters.values())
        bound_names = {p.name for p in params[:k]}
    except (TypeError, ValueError):
        bound_names = set()
    shift = lambda nums: tuple(i - k + 1 for i in sorted(nums) if i >= k)  # noqa: E731
    return JitPartialWrapped(
        wrapped.fun,
        clones,
        static_argnums=shift(spec.static_argnums),
        static_argnames=tuple(n for n in spec.static_argnames if n not in bound_names),
        donate_argnums=(0,) * bool(donated) + shift(spec.donate_argnums),
        donate_argnames=tuple(n for n in spec.donate_argnames if n not in bound_names),
        graph=True,
        graph_updates=True,
        keep_structure=_KEEP,
        transform="jit",
        argument="args",
        **wrapped._jit_options,
    )
