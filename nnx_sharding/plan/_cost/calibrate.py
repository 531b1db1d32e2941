"""Fitting an `Accelerator`'s achievable fractions to measured steps, and saving it.

The cost model prices each kernel at ``matmul_efficiency`` of peak FLOP/s and
``hbm_efficiency`` of the memory bandwidth, each collective at ``link_efficiency`` of
its link (`nnx_sharding.plan._cost.model`). `calibrate` chooses the three so that the
predictions of measured plans match their measurements: it minimises the squared
log-ratios of predicted to measured step times over a grid of fractions (each from
0.001 to 1, 16 steps a decade, refined twice around the best), the three fractions
moving together when one plan is measured (one measurement fixes one unknown), the
link's kept as given when fewer than three plans are. The rest of the accelerator
(peaks, bandwidths, memory) is the data sheet's, unchanged: the fractions carry what
the device at hand achieves. `Accelerator.save` writes the result to JSON and
`Accelerator.load` reads it back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from ... import _errors
from .._hardware.accelerators import Accelerator

_FIELDS = ("matmul_efficiency", "hbm_efficiency", "link_efficiency")


def calibrate(
    accelerator: Accelerator, measured: Sequence[tuple[Any, float]], name: str | None = None
) -> Accelerator:
    """``accelerator`` with its achievable fractions fitted to ``measured``: pairs of a
    `_cost.model.Program` (a plan's ``program``) and its measured seconds per step.

    Raises:
      ValueError: nothing measured (run `Plans.measure` first).

    >>> from nnx_sharding.plan._cost.model import Program
    >>> from nnx_sharding.plan._cost.kernels import Op
    >>> from nnx_sharding.plan._hardware.accelerators import PRESETS
    >>> gemm = Program((Op("dot", "dot", "main", 1, 1e12, "f32", 0.0),), (), {"data": 1})
    >>> fitted = calibrate(PRESETS["cpu"], [(gemm, 20.0)])  # 1e12 FLOPs in 20 s
    >>> round(fitted.matmul_efficiency, 2)
    0.05
    """
    pairs = [(p, float(t)) for p, t in measured if p is not None and t and t > 0]
    if not pairs:
        raise ValueError(_errors.plan_nothing_measured())
    start = [getattr(accelerator, f) for f in _FIELDS]

    def loss(values: Sequence[float]) -> float:
        fitted = dataclasses.replace(accelerator, **dict(zip(_FIELDS, values, strict=True)))
        return sum(math.log(p.step(fitted) / t) ** 2 for p, t in pairs)

    if len(pairs) == 1:  # one equation: one common scale of the three fractions
        top = 1.0 / max(start)
        scale = _search(lambda s: loss([v * s for v in start]), 1e-3 / min(start), top)
        best = [v * scale for v in start]
    else:
        free = 3 if len(pairs) >= 3 else 2
        best = list(start)
        for _ in range(3):  # coordinate descent: each fraction in turn, the others held
            for i in range(free):
                best[i] = _search(lambda v, i=i: loss([*best[:i], v, *best[i + 1 :]]), 1e-3, 1.0)
    values = dict(zip(_FIELDS, (min(max(v, 1e-3), 1.0) for v in best), strict=True))
    return dataclasses.replace(accelerator, name=name or f"{accelerator.name}-calibrated", **values)


def _search(f: Any, low: float, high: float) -> float:
    """The argmin of ``f`` over ``[low, high]`` on a log grid, refined twice."""
    best = low
    for _ in range(3):
        steps = 48
        grid = [low * (high / low) ** (k / steps) for k in range(steps + 1)]
        best = min(grid, key=f)
        ratio = (high / low) ** (1 / steps)
        low, high = max(low, best / ratio), min(high, best * ratio)
    return best
