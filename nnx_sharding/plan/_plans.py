"""`Plans`: the candidates ranked, with ``best``, a table, a plot and a check on
the devices present (``measure``)."""

from __future__ import annotations

import dataclasses
import io
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any, overload

import jax
import jax.numpy as jnp
from flax import nnx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import _errors
from .._nodes import is_node
from .._state_sharding import StateSharding
from .._units import format_bytes, format_seconds
from ._accelerator import Accelerator
from ._calibrate import calibrate
from ._compile import Step
from ._hlo import KINDS
from ._plan import Plan, shortfall
from ._scale import Sizing, devices_for

_SHORT = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "all-to-all": "A2A",
    "collective-permute": "CP",
}


def rank(plans: Sequence[Plan]) -> list[Plan]:
    """Plans that fit first, by predicted step time (ties: by the unoverlapped time,
    then peak memory); then the others by peak memory; those not built last."""

    def key(p: Plan) -> tuple[Any, ...]:
        if p.fits and p.time is not None:
            return (0, p.time.step, p.time.serial, p.memory.peak if p.memory else 0)
        if p.memory is not None:
            return (1, p.memory.peak, 0.0, 0)
        return (2, 0.0, 0.0, 0)

    return sorted(plans, key=key)


class Plans(Sequence[Plan]):
    """The compiled candidates, ranked (see `rank`); ``print(plans)`` shows `table`."""

    def __init__(self, plans: Sequence[Plan], step: Step, title: str):
        self._plans = rank(plans)
        self._step = step
        self.title = title

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
          ValueError: none fits; names the closest plan and by how much it misses.
        """
        if self._plans and self._plans[0].fits:
            return self._plans[0]
        built = [(p.memory.peak, p) for p in self._plans if p.memory is not None]
        if not built:
            reasons = "; ".join(f"{p.label}: {p.reason}" for p in self._plans[:3])
            more = len(self._plans) - 3
            reasons += f"; and {more} more (see the table)" if more > 0 else ""
            raise ValueError(_errors.plan_no_candidate_built(reasons))
        peak, closest = min(built, key=lambda b: b[0])
        miss = shortfall(closest, self.limit)
        raise ValueError(
            _errors.plan_nothing_fits(
                format_bytes(self.limit),
                closest.label,
                format_bytes(peak),
                format_bytes(miss),
                miss,
            )
        )

    def table(self) -> Table:
        """The ranked plans as a rich table."""
        table = Table(title=self.title)
        for name, justify in (
            ("#", "right"),
            ("layout", "left"),
            ("mesh", "left"),
            ("peak/device", "right"),
            ("state", "right"),
            ("temp", "right"),
            ("FLOPs/device", "right"),
            ("collectives/device", "left"),
            ("compute", "right"),
            ("comms", "right"),
            ("step", "right"),
            ("range", "right"),
            ("no overlap", "right"),
        ):
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        measured = any(p.measured is not None for p in self._plans)
        built = [p for p in self._plans if p.memory is not None]
        common = [n for n in built[0].notes if all(n in p.notes for p in built)] if built else []
        if measured:
            table.add_column("measured", justify="right")
        table.add_column("fits / why not")
        for i, p in enumerate(self._plans, 1):
            mesh = "×".join(f"{k}={v}" for k, v in p.mesh_shape.items())
            if p.memory is None or p.time is None:
                row = [str(i), p.layout, mesh] + [""] * 10 + ([""] if measured else [])
                table.add_row(*row, f"[red]{escape(str(p.reason))}[/red]")
                continue
            comms = ", ".join(
                f"{_SHORT[k]} {format_bytes(p.collectives[k])}"
                for k in KINDS
                if p.collectives.get(k)
            )
            row = [
                str(i),
                p.layout,
                mesh,
                format_bytes(p.memory.peak),
                format_bytes(p.memory.state),
                format_bytes(p.memory.temp),
                f"{p.flops:.3g}",
                comms or "none",
                format_seconds(p.time.compute),
                format_seconds(p.time.comms),
                format_seconds(p.time.step),
                f"{format_seconds(p.time.step_low)}-{format_seconds(p.time.step_high)}",
                format_seconds(p.time.serial),
            ]
            if measured:
                row.append(format_seconds(p.measured) if p.measured is not None else "")
            status = "[green]yes[/green]" if p.fits else f"[red]no: {escape(str(p.reason))}[/red]"
            extra = [n for n in p.notes if n not in common]
            if extra:
                status += escape(" (" + "; ".join(extra) + ")")
            table.add_row(*row, status)
        if common:
            table.caption = escape("; ".join(common))
        return table

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
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError(_errors.plan_needs_matplotlib()) from e
        from matplotlib.ticker import FuncFormatter

        built = [p for p in self._plans if p.memory is not None and p.time is not None]
        fig, ax = plt.subplots(figsize=(8, 5))
        for p in built:
            x, y = _point(p)
            ax.scatter(x, y, color="C0" if p.fits else "C3")
            ax.annotate(p.label, (x, y), fontsize=7)
        front = [_point(p) for p in pareto(built)]
        ax.step(
            [x for x, _ in front],
            [y for _, y in front],
            "k--",
            where="post",
            label="Pareto front",
        )
        ax.scatter(
            [x for x, _ in front],
            [y for _, y in front],
            s=120,
            facecolors="none",
            edgecolors="k",
        )
        ax.axvline(self.limit, color="C3", label=f"memory limit ({format_bytes(self.limit)})")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_bytes(x)))
        ax.set_xlabel("peak memory per device (log scale)")
        ax.set_ylabel("predicted step time (ms)")
        ax.set_title(self.title, fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    def measure(self, k: int = 3, steps: int = 5) -> Plans:
        """Runs the ``k`` best plans that fit for real on the devices present, ``steps``
        timed steps each after one to compile; sets each one's ``measured`` (the median
        seconds per step). The arguments are copied (zeros for abstract ones): the
        caller's objects are not touched. Returns these Plans.

        Raises:
          ValueError: fewer devices present than the plans need.
        """
        chosen = [p for p in self._plans if p.fits][:k]
        for plan in chosen:
            mesh = plan.mesh()
            args = materialise(self._step, plan, mesh)
            fn = plan.jit(self._step.fun, mesh=mesh)
            jax.block_until_ready(fn(*args))
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times.append(time.perf_counter() - start)
            index = self._plans.index(plan)
            self._plans[index] = dataclasses.replace(plan, measured=statistics.median(times))
        return self

    def calibrate(self, name: str | None = None) -> Accelerator:
        """The accelerator these plans were costed on, with its achievable fractions
        (matmul, HBM, links) fitted to the plans `measure` timed (`_calibrate`). Save it
        with ``nnx_sharding.plan.save_accelerator`` and plan with it later, or see its
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
        return Plans(plans, step, self.title.replace(self._step.accelerator.name, accelerator.name))

    def devices_for(
        self,
        tokens: float,
        days: float,
        *,
        tokens_per_step: int | None = None,
        scaling: str = "weak",
        max_devices: int = 65536,
    ) -> Sizing:
        """The fewest devices that train ``tokens`` in ``days`` (`_scale`): the step is
        planned again at each device count tried, on the same accelerator, layouts and
        memory limit; with ``scaling='weak'`` (the default) the per-device batch stays
        as planned, with ``'strong'`` the global batch does.

        Raises:
          ValueError: no count tried up to ``max_devices`` meets the target.
        """
        from ._planner import plan

        step = self._step
        layouts = sorted({p.layout for p in self._plans})

        def replan(n: int, args: tuple[Any, ...]) -> Plans:
            return plan(
                step.fun, *args, devices=n, accelerator=step.accelerator,
                memory_limit=step.limit, layouts=layouts, rules=step.rules,
                num_slices=step.num_slices, **step.options,
            )  # fmt: skip

        return devices_for(
            self, replan, tokens, days, tokens_per_step=tokens_per_step, scaling=scaling,
            max_devices=max_devices,
        )  # fmt: skip


def _point(plan: Plan) -> tuple[int, float]:
    """A built plan's place on the plot: peak bytes per device, predicted milliseconds."""
    if plan.memory is None or plan.time is None:
        raise ValueError(f"{plan.label} has no figures to plot: {plan.reason}")
    return plan.memory.peak, plan.time.step * 1e3


def pareto(plans: Sequence[Plan]) -> list[Plan]:
    """The plans no other beats on both peak memory and predicted step, by memory."""
    front: list[Plan] = []
    for p in sorted(plans, key=lambda p: (p.memory.peak, p.time.step)):  # type: ignore[union-attr]
        if not front or p.time.step < front[-1].time.step:  # type: ignore[union-attr]
            front.append(p)
    return front


def materialise(step: Step, plan: Plan, mesh: Any) -> tuple[Any, ...]:
    """Concrete arguments laid out as ``plan`` says: the originals' values copied, or
    zeros where they were abstract."""
    shardings = plan.shardings(mesh)
    originals = step.originals
    out = list(step.args)
    nodes = [i for i in step.variables]
    copies = nnx.eval_shape(lambda *a: a, *[originals[i] for i in nodes]) if nodes else ()
    for i, node in zip(nodes, copies, strict=True):
        entry = shardings[i]
        assert isinstance(entry, StateSharding)
        source = dict(nnx.to_flat_state(nnx.state(originals[i])))
        for path, var in nnx.to_flat_state(nnx.state(node)):
            value = source[path].get_value()
            var.set_value(_place(value, entry.sharding_for(path, var)))
        out[i] = node
    for i, arg in enumerate(originals):
        if i in step.static or is_node(arg) or i in step.variables:
            continue
        out[i] = jax.tree.map(
            lambda x, s: _place(x, s) if hasattr(x, "shape") else x,
            arg,
            shardings[i],
            is_leaf=lambda x: hasattr(x, "shape"),
        )
    return tuple(out)


def _place(value: Any, sharding: Any) -> Any:
    if isinstance(value, jax.ShapeDtypeStruct):
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            data = jnp.zeros((*value.shape, 2), jnp.uint32)
            return jax.device_put(jax.random.wrap_key_data(data), sharding)
        return jax.jit(lambda: jnp.zeros(value.shape, value.dtype), out_shardings=sharding)()
    if hasattr(value, "shape"):
        return jax.device_put(jnp.array(value, copy=True), sharding)
    return value
