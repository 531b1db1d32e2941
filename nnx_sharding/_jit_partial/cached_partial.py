"""`nnx.cached_partial` over `jit`: the cached clones flattened once, as `jit_partial`.

``nnx.cached_partial(f, *nodes)`` clones ``nodes`` (sharing their Variables), splits
the clones once, and calls ``f(*clones, *args)`` with that split pending; the
``nnx.update_context`` a call enters takes it (``UpdateContext.static_cache``: a
mapping keyed by the clones). flax's contract for the clones is `jit_partial`'s: their
structure is the one cached (flax's split uses the cached graph definitions too, and
raises on a structure change made inside), only their Variables' values change. So a
call whose leading arguments are the clones runs as a `jit_partial` over them, made
once: a read of the values, jax's dispatch, a write of the changed ones.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .. import _errors
from .._callpath.outside import CallSpec
from .._nodes import is_node, is_variable
from .jit_partial import JitPartialWrapped
from .split import split_partial

MAX_CACHED = 8
"""`CachedPartials`' partials per jitted function (each holds its clones)."""

_KEEP = (
    "nnx.cached_partial flattened these arguments once, and a structure change made "
    "inside cannot reach your objects (flax raises too)"
)

_ARRAYS = (jax.Array, np.ndarray, int, float, complex, bool)


class CachedPartials:
    """The `JitPartialWrapped`s one `jit` made for the clones of ``nnx.cached_partial``s,
    keyed by the cache and the clones (at most `MAX_CACHED`, the latest kept)."""

    def __init__(self) -> None:
        self._last: tuple[Any, tuple[Any, ...], JitPartialWrapped[Any]] | None = None
        self._table: dict[tuple[int, ...], tuple[Any, JitPartialWrapped[Any] | None]] = {}

    def find(
        self,
        make: Callable[[tuple[Any, ...]], JitPartialWrapped[Any] | None],
        cache: Mapping[Any, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> JitPartialWrapped[Any] | None:
        """The partial for a call whose leading arguments are ``cache``'s clones, made by
        ``make(clones)`` the first time; None when the call must take `jit`'s path: no
        clone leads, or a graph node or Variable among the other arguments."""
        last = self._last
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
        key = (id(cache), *map(id, args[:k]))
        found = self._table.get(key)
        if found is not None and found[0] is cache:  # the cache keeps the ids its own
            partial = found[1]
        else:
            partial = make(args[:k])
            self._table.pop(key, None)
            self._table[key] = (cache, partial)
            while len(self._table) > MAX_CACHED:
                self._table.pop(next(iter(self._table)))
        if partial is not None:
            self._last = (cache, tuple(args[:k]), partial)
        return partial


def _plain(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the arguments after the clones hold no graph node and no Variable."""
    if not kwargs and all(isinstance(a, _ARRAYS) and not is_node(a) for a in args):
        return True
    rest = jax.tree_util.tree_leaves((args, kwargs), is_leaf=is_node)
    return not any(is_node(x) or is_variable(x) for x in rest)


def partial_of_jit(
    fun: Callable[..., Any],
    clones: tuple[Any, ...],
    spec: CallSpec,
    jit_options: dict[str, Any],
) -> JitPartialWrapped[Any] | None:
    """A `jit_partial` of ``fun`` over ``clones`` with the jit's options (``spec``'s
    argnums and argnames, ``jit_options``), or None where it cannot be one: shardings
    given, a clone static or donated apart from the others, a ``ref``/hijax Variable.

    Raises:
      TypeError: a clone holds an array outside a Variable, which neither path can
        write back (flax fails on it too).
    """
    split = split_partial(clones, None, "args")
    if split.constants:
        sites = [s for x, s in zip(split.items, split.sites, strict=True) if not is_variable(x)]
        raise TypeError(_errors.cached_partial_arrays([str(s) for s in sites]))
    if spec.in_shardings is not None or spec.out_shardings is not None:
        return None
    if any(x.ref or x.hijax for x in split.variables):
        return None
    k = len(clones)
    static_nums, static_names = spec.static_argnums, spec.static_argnames
    donate_nums, donate_names = spec.donate_argnums, spec.donate_argnames
    if any(i < k for i in static_nums):
        return None
    donated = {i for i in donate_nums if i < k}
    if donated and donated != set(range(k)):  # one list: donated together or not at all
        return None
    try:
        params = list(inspect.signature(fun).parameters.values())
        bound_names = {p.name for p in params[:k]}
    except (TypeError, ValueError):
        bound_names = set()

    def shift(nums: frozenset[int]) -> tuple[int, ...]:
        return tuple(i - k + 1 for i in sorted(nums) if i >= k)

    options = dict(
        static_argnums=shift(static_nums),
        static_argnames=tuple(n for n in static_names if n not in bound_names),
        donate_argnums=(0,) * bool(donated) + shift(donate_nums),
        donate_argnames=tuple(n for n in donate_names if n not in bound_names),
        **jit_options,
    )
    return JitPartialWrapped(
        fun,
        clones,
        options,
        graph=True,
        graph_updates=True,
        keep_structure=_KEEP,
        transform="jit",
        argument="args",
    )
