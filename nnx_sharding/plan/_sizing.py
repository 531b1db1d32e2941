"""How many devices a training target needs: `devices_for`, re-planning the step at
each device count it tries.

A target is ``tokens`` to train on within ``days``. At ``N`` devices the best plan that
fits predicts a step of ``s`` seconds for ``tokens_per_step`` tokens, so training takes
``tokens / tokens_per_step · s`` seconds. By default the per-device batch stays as
planned (``scaling='weak'``, as published scaling runs keep it): the data arguments'
leading dimension (the batch) grows with ``N``, and the tokens per step with it. With
``scaling='strong'`` the global batch stays and is split ever finer. Counts are tried
from the planned one upwards: first the count the planned one's speed says is needed
(rounded up to a power of two times it), then doubling until the target is met (or
``max_devices``), then halving back while it still is, each count planned anew.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _errors
from ._plan import Plan
from ._step import Step

DAY = 86400.0


@dataclasses.dataclass(frozen=True)
class Sizing:
    """The answer of `devices_for`: the fewest ``devices`` tried that meet the target,
    their best ``plan``, the ``days`` it predicts (and its range, from the step's), and
    every count ``tried`` with its days (None where nothing fit or built)."""

    devices: int
    plan: Plan
    days: float
    days_low: float
    days_high: float
    tokens_per_step: int
    tried: tuple[tuple[int, float | None], ...]

    def __str__(self) -> str:
        tried = ", ".join(f"{n}: {'-' if d is None else f'{d:.3g} d'}" for n, d in self.tried)
        return (
            f"{self.devices} devices: {self.plan.label}, {self.days:.3g} days "
            f"({self.days_low:.3g}-{self.days_high:.3g}); tried {tried}"
        )


def tokens_in(args: tuple[Any, ...], static: frozenset[int], variables: dict) -> int:
    """Tokens per step read from the arguments: the size of the first integer array
    argument (a ``(batch, seq)`` token array; a ``(batch, seq + 1)`` one counts its
    extra column too: pass ``tokens_per_step`` to be exact).

    >>> import jax.numpy as jnp
    >>> tokens_in((jax.ShapeDtypeStruct((8, 1025), jnp.int32),), frozenset(), {})
    8200
    """
    for i, arg in enumerate(args):
        if i in static or i in variables:
            continue
        for leaf in jax.tree.leaves(arg):
            dtype = getattr(leaf, "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, np.integer) and leaf.shape:
                return math.prod(leaf.shape)
    raise ValueError(_errors.plan_no_tokens())


def scaled(args: tuple[Any, ...], skip: set[int], factor: int) -> tuple[Any, ...]:
    """The arguments with every data array's leading dimension times ``factor``
    (abstract: ``ShapeDtypeStruct``s), graph nodes and static ones as they are.

    >>> import jax.numpy as jnp
    >>> scaled((jax.ShapeDtypeStruct((8, 1025), jnp.int32), 3), {1}, 4)[0].shape
    (32, 1025)
    """

    def grow(x: Any) -> Any:
        if hasattr(x, "shape") and hasattr(x, "dtype") and len(x.shape) > 0:
            return jax.ShapeDtypeStruct((x.shape[0] * factor, *x.shape[1:]), x.dtype)
        return x

    return tuple(a if i in skip else jax.tree.map(grow, a) for i, a in enumerate(args))


def devices_for(
    step: Step,
    planned: int,
    best_at: Callable[[int, tuple[Any, ...]], Plan],
    tokens: float,
    days: float,
    *,
    tokens_per_step: int | None = None,
    scaling: str = "weak",
    max_devices: int = 65536,
) -> Sizing:
    """The fewest devices (of the counts tried) that train ``tokens`` in ``days``; see
    the module's docstring. ``step`` was planned at ``planned`` devices; ``best_at(n,
    args)`` is the best plan of the step at ``n`` devices given ``args`` (a ValueError
    where none fits)."""
    n0 = planned
    per_step0 = tokens_per_step or tokens_in(step.originals, step.static, step.variables)
    skip = set(step.static) | set(step.variables)
    results: dict[int, tuple[Any, float] | None] = {}

    def at(n: int) -> tuple[Any, float] | None:
        if n in results:
            return results[n]
        factor = n // n0 if scaling == "weak" else 1
        per_step = per_step0 * factor
        try:
            best = best_at(n, scaled(step.originals, skip, factor))
        except ValueError:  # nothing fits, nothing built, a count the target refuses
            results[n] = None
            return None
        results[n] = (best, tokens / per_step * best.time.step / DAY, per_step)  # type: ignore[assignment]
        return results[n]

    first = at(n0)
    n = n0
    if first is None or first[1] > days:
        need = n0 * 2 ** max(1, math.ceil(math.log2((first[1] / days) if first else 2)))
        n = min(need, max_devices)
        while n <= max_devices and ((r := at(n)) is None or r[1] > days):
            n *= 2
    while n // 2 >= n0 and (r := at(n // 2)) is not None and r[1] <= days:
        n //= 2
    ok = [(k, v) for k, v in sorted(results.items()) if v is not None and v[1] <= days]
    tried = tuple((k, None if v is None else v[1]) for k, v in sorted(results.items()))
    if not ok:
        shown = ", ".join(f"{k}: {'-' if d is None else f'{d:.3g} days'}" for k, d in tried)
        raise ValueError(_errors.plan_target_unreachable(tokens, days, shown))
    count, (best, need_days, per_step) = ok[0]  # type: ignore[misc]
    ratio = need_days / best.time.step
    return Sizing(
        devices=count,
        plan=best,
        days=need_days,
        days_low=best.time.step_low * ratio,
        days_high=best.time.step_high * ratio,
        tokens_per_step=per_step,
        tried=tried,
    )
