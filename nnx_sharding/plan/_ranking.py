"""`Plans`: the candidates ranked, with ``best``, shown as a table, JSON or a plot
(`_report`), checked on the devices present (``measure``, `_measure`), repriced,
calibrated and sized (`_sizing`)."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

from rich.console import Console
from rich.table import Table

from .. import _errors
from .._units import format_bytes
from ._cost.calibrate import calibrate
from ._hardware.accelerators import Accelerator
from ._measure import time_steps
from ._plan import Plan, shortfall
from ._report import plan_json, plot, table
from ._sizing import Sizing, devices_for
from ._step import Step


def rank(plans: Sequence[Plan]) -> list[Plan]:
    """Plans that fit first, by predicted step time (ties: by the unoverlapped time,
    then peak memory); then the others compiled, by peak memory; then those left
    uncompiled as no faster than one that fits, then those uncompiled as not fitting
    (by their state); those not built last."""
    order = {"time": 2, "pareto": 2, "memory": 3, "state": 3}

    def key(p: Plan) -> tuple[Any, ...]:
        if p.fits and p.time is not None:
            return (0, p.time.step, p.time.serial, p.memory.peak if p.memory else 0)
        if p.memory is not None:
            return (1, p.memory.peak, 0.0, 0)
        if p.pruned is not None:
            return (order[p.pruned], p.state_bytes or 0, 0.0, 0)
        return (4, 0.0, 0.0, 0)

    return sorted(plans, key=key)


class Plans(Sequence[Plan]):
    """The candidates, ranked (see `rank`); ``print(plans)`` shows `table`.

    Attributes:
      title: the table's title (devices, accelerator, compiler, memory limit).
      advice: when no plan fits, the plans `search` compiled beyond its space (more
        remat, more microbatches) to say what would fit; not ranked with the others.
      space: the knob space searched (None for `plan`).
    """

    def __init__(
        self,
        plans: Sequence[Plan],
        step: Step,
        title: str,
        *,
        advice: Sequence[Plan] = (),
        space: Mapping[str, Sequence[Any]] | None = None,
        planner: Callable[..., Plans] | None = None,
    ):
        """``planner``: `plan` itself, which `devices_for` calls again at other device
        counts (given by the planner, which this module cannot import: it imports this)."""
        self._planner = planner
        self._plans = rank(plans)
        self._step = step
        self.title = title
        self.advice: tuple[Plan, ...] = tuple(advice)
        self.space: Mapping[str, Sequence[Any]] | None = space

    @overload
    def __getitem__(self, i: int) -> Plan: ...
    @overload
    def __getitem__(self, i: slice) -> list[Plan]: ...
    def __getitem__(self, i: int | slice) -> Plan | list[Plan]:
        return self._plans[i]

    def __len__(self) -> int:
        return len(self._plans)

    def __iter__(self) -> Iterator[Plan]:
        return iter(self._plans)

    @property
    def limit(self) -> int:
        """The memory limit per device, bytes."""
        return self._step.limit

    @property
    def best(self) -> Plan:
        """The fastest plan that fits.

        Raises:
          ValueError: none fits; names the closest plan, by how much it misses and,
            after `search`, the knob values with which it was compiled and fits (see
            `advice`).
        """
        if self._plans and self._plans[0].fits:
            return self._plans[0]
        built = [(p.memory.peak, p) for p in self._plans if p.memory is not None]
        too_big = [p for p in self._plans if p.pruned == "state" and p.state_bytes]
        if not built and too_big:
            smallest = min(too_big, key=lambda p: p.state_bytes or 0)
            raise ValueError(
                _errors.plan_nothing_fits_state(
                    format_bytes(self.limit),
                    smallest.label,
                    format_bytes(smallest.state_bytes or 0),
                )
            )
        if not built:
            reasons = [f"{p.label}: {p.reason}" for p in self._plans[:3]]
            raise ValueError(_errors.plan_no_candidate_built(reasons, len(self._plans) - 3))
        peak, closest = min(built, key=lambda b: b[0])
        miss = shortfall(closest, self.limit)
        raise ValueError(
            _errors.plan_nothing_fits(
                format_bytes(self.limit),
                closest.label,
                format_bytes(peak),
                format_bytes(miss),
                miss,
                self._advice(),
            )
        )

    def _advice(self) -> tuple[str, str, str | None] | None:
        """What `advice` shows, as `plan_nothing_fits` takes it: the first plan that fits
        (label, peak, the knob values to search), else the lightest (label, peak, None);
        None without any."""
        fitting = [(p.memory.peak, p) for p in self.advice if p.fits and p.memory is not None]
        if fitting:
            peak, p = fitting[0]
            knobs = ", ".join(f"{k}={v!r}" for k, v in p.knobs.items())
            return p.label, format_bytes(peak), knobs
        built = [(p.memory.peak, p) for p in self.advice if p.memory is not None]
        if built:
            peak, p = min(built, key=lambda b: b[0])
            return p.label, format_bytes(peak), None
        return None

    def table(self, pruned: bool = True) -> Table:
        """The ranked plans as a rich table; with ``pruned=False``, the plans `search`
        left uncompiled (``Plan.pruned``) are counted in the caption instead of shown.

        Columns for knobs (`search`), whether a row was ``compiled`` (when `search` left
        some uncompiled: their figures are blank, never estimated) and the model's
        TFLOP/s per device (when the builder counted the model's FLOPs) are added when
        they say something."""
        return table(self._plans, self.title, pruned)

    def to_json(self, path: str | None = None) -> str:
        """Every plan (and the `advice`) as JSON text, also written to ``path`` if given.

        Per plan: ``layout``, ``mesh_shape``, ``knobs``, ``compiled``, ``pruned``,
        ``fits`` (null where it was not compiled, but for a state above the limit),
        ``reason``, ``compiler``,
        ``memory`` (``state``, ``arguments``, ``outputs``, ``alias``, ``temp``,
        ``peak``: bytes per device, the compiler's; only ``state``, from the shardings,
        where it was not compiled), ``flops`` (per device per step), ``collectives``
        (kind -> bytes), ``time`` (``compute``, ``memory``, ``comms``, ``exposed``,
        ``step``, ``serial``: seconds, predicted from the compiler's figures),
        ``model_flops`` (per device per step, counted from the model),
        ``model_tflops_per_device`` (``model_flops / time.step / 1e12``), ``notes`` and
        ``compile_seconds``.

        >>> import json, jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from nnx_sharding.plan import plan
        >>> model = nnx.eval_shape(lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
        >>> x = jax.ShapeDtypeStruct((2, 4), jnp.float32)
        >>> plans = plan(lambda m, x: m(x).sum(), model, x, devices=2, layouts=['dp'])
        >>> row = json.loads(plans.to_json())['plans'][0]
        >>> row['layout'], row['mesh_shape'], row['compiled'], row['memory']['peak'] > 0
        ('dp', {'data': 2}, True, True)
        """
        document = {
            "title": self.title,
            "memory_limit": self.limit,
            "space": None if self.space is None else {k: list(v) for k, v in self.space.items()},
            "plans": [plan_json(p) for p in self._plans],
            "advice": [plan_json(p) for p in self.advice],
        }
        text = json.dumps(document, indent=1, default=str)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    def __rich__(self) -> Table:
        return self.table()

    def __str__(self) -> str:
        console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
        console.print(self.table())
        return console.export_text()

    def __repr__(self) -> str:
        return f"Plans({len(self)} plans, best: {self._plans[0].label if self else None})"

    def plot(self, path: str) -> None:
        """Predicted step time against peak memory per device, saved to ``path``: the
        memory limit drawn, the Pareto front (no plan both faster and smaller) marked.
        Needs matplotlib (the ``bench`` extra)."""
        plot(self._plans, self.title, self.limit, path)

    def measure(self, k: int = 3, steps: int = 5) -> Plans:
        """Runs the ``k`` best plans that fit for real on the devices present, ``steps``
        timed steps each after one to compile; sets each one's ``measured`` (the median
        seconds per step). The arguments are copied (small random floats and zero
        integers for abstract ones, `_measure.materialise`): the caller's objects are not
        touched. Returns these Plans.

        Raises:
          ValueError: fewer devices present than the plans need.
        """
        for plan in [p for p in self._plans if p.fits][:k]:
            step = plan.source if plan.source is not None else self._step
            index = self._plans.index(plan)
            self._plans[index] = dataclasses.replace(plan, measured=time_steps(plan, step, steps))
        return self

    def calibrate(self, name: str | None = None) -> Accelerator:
        """The accelerator these plans were costed on, with its achievable fractions
        (matmul, HBM, links) fitted to the plans `measure` timed (`_cost.calibrate`). Save
        it with `Accelerator.save` and plan with it later (`Accelerator.load`), or see its
        predictions here with `reprice`.

        Raises:
          ValueError: no plan was measured.
        """
        measured = [(p.program, p.measured) for p in self._plans if p.measured is not None]
        return calibrate(self._step.accelerator, measured, name)

    def reprice(self, accelerator: Accelerator) -> Plans:
        """These plans, each priced anew on ``accelerator`` (measurements kept) and
        ranked again; the compiled programs are not recompiled."""
        plans = [
            dataclasses.replace(p, time=p.program.time(accelerator), accelerator=accelerator.name)
            if p.program is not None
            else p
            for p in self._plans
        ]
        step = dataclasses.replace(self._step, accelerator=accelerator)
        title = self.title.replace(self._step.accelerator.name, accelerator.name)
        return Plans(plans, step, title, planner=self._planner)

    def devices_for(
        self,
        tokens: float,
        days: float,
        *,
        tokens_per_step: int | None = None,
        scaling: str = "weak",
        max_devices: int = 65536,
    ) -> Sizing:
        """The fewest devices that train ``tokens`` in ``days`` (`_sizing`): the step is
        planned again at each device count tried, on the same accelerator, layouts and
        memory limit; with ``scaling='weak'`` (the default) the per-device batch stays
        as planned, with ``'strong'`` the global batch does.

        Raises:
          ValueError: no count tried up to ``max_devices`` meets the target.
        """
        plan = self._planner
        if plan is None:
            raise ValueError(_errors.plan_cannot_replan())
        step = self._step
        layouts = sorted({p.layout for p in self._plans})
        planned = self._plans[0].devices if self._plans else len(step.devices)

        def best_at(n: int, args: tuple[Any, ...]) -> Plan:
            if n == planned:
                return self.best
            return plan(
                step.fun, *args, devices=n, accelerator=step.accelerator,
                memory_limit=step.limit, layouts=layouts, rules=step.rules,
                num_slices=step.num_slices, **step.options,
            ).best  # fmt: skip

        return devices_for(
            step, planned, best_at, tokens, days, tokens_per_step=tokens_per_step,
            scaling=scaling, max_devices=max_devices,
        )  # fmt: skip
