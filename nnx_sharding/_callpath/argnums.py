"""Reading ``static_argnums``/``donate_argnums`` and their names, as ``jax.jit`` does."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .. import _errors


def _as_tuple(x: int | str | Iterable[Any] | None) -> tuple[Any, ...]:
    if x is None:
        return ()
    return (x,) if isinstance(x, (int, str)) else tuple(x)


def shift_argnums(argnums: int | Sequence[int] | None) -> tuple[int, ...]:
    """A bound method's argnums as positions of its function, ``self`` first."""
    return tuple(n + 1 if n >= 0 else n for n in _as_tuple(argnums))


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


def check_argnums(transform: str, fun: Callable[..., Any], options: dict[str, Any]) -> None:
    """Validates ``static_argnums`` etc. against ``fun``'s signature, as ``jax.jit`` does."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    n = len(positional)
    for kind in ("static", "donate"):
        name = f"{kind}_argnums"
        nums = _as_tuple(options.get(name))
        if not any(p.kind is p.VAR_POSITIONAL for p in params):
            if bad := [i for i in nums if not -n <= i < n]:
                raise ValueError(_errors.argnums_out_of_range(transform, name, bad, positional))
        name = f"{kind}_argnames"
        names = _as_tuple(options.get(name))
        if bad := [a for a in names if a in positional and a not in keywords]:
            why = "a positional-only parameter"
            raise ValueError(_errors.unknown_argnames(transform, name, bad, keywords, why))
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            if bad := [a for a in names if a not in keywords]:
                why = "not a parameter of the function"
                raise ValueError(_errors.unknown_argnames(transform, name, bad, keywords, why))


def check_overlap(
    transform: str,
    static: tuple[frozenset[int], frozenset[str]],
    donate: tuple[frozenset[int], frozenset[str]],
) -> None:
    """An argument cannot be both static and donated (``jax.jit`` rejects it too)."""
    # names include the positional ones resolved from numbers: prefer them
    both = sorted(static[1] & donate[1]) or sorted(static[0] & donate[0])
    if both:
        raise ValueError(_errors.static_and_donated(transform, both))


Argnums = tuple[frozenset[int], frozenset[str]]

JIT_DEFAULTS: dict[str, Any] = dict(
    in_shardings=None,
    out_shardings=None,
    static_argnums=None,
    static_argnames=None,
    donate_argnums=None,
    donate_argnames=None,
    keep_unused=False,
    device=None,
    backend=None,
    inline=False,
    compiler_options=None,
)
"""``jax.jit``'s keywords as `jit` and `jit_partial` take them, with their defaults."""

COMPILER_KEYWORDS = ("keep_unused", "device", "backend", "inline", "compiler_options")
"""The keywords of `JIT_DEFAULTS` that go to ``jax.jit`` unchanged."""


def read_argnums(
    transform: str, fun: Callable[..., Any], options: dict[str, Any]
) -> tuple[Argnums, Argnums]:
    """The static and the donated arguments of ``options`` (``jax.jit``'s keywords) as
    (positions, names) each, checked against ``fun``'s signature and against each other."""
    check_argnums(transform, fun, options)
    static = resolve_argnums(fun, options.get("static_argnums"), options.get("static_argnames"))
    donate = resolve_argnums(fun, options.get("donate_argnums"), options.get("donate_argnames"))
    check_overlap(transform, static, donate)
    return static, donate
