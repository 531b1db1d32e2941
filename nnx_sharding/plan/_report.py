"""The plans as people read them: a rich table, JSON and a plot of step time against
memory. Functions of ranked plans, which `Plans` shows."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from rich.markup import escape
from rich.table import Table

from .. import _errors
from .._units import format_bytes, format_seconds
from ._cost.hlo import KINDS
from ._plan import Plan

_SHORT = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "all-to-all": "A2A",
    "collective-permute": "CP",
}


def table(plans: Sequence[Plan], title: str, pruned: bool = True) -> Table:
    """``plans`` (ranked) as a rich table titled ``title``; with ``pruned=False``, the
    plans `search` left uncompiled (``Plan.pruned``) are counted in the caption instead
    of shown.

    Columns for knobs (`search`), whether a row was ``compiled`` (when `search` left
    some uncompiled: their figures are blank, never estimated) and the model's
    TFLOP/s per device (when the builder counted the model's FLOPs) are added when
    they say something."""
    shown = [p for p in plans if pruned or p.pruned is None]
    hidden = len(plans) - len(shown)
    knobs = any(p.knobs for p in plans)
    marks = any(p.pruned is not None for p in plans)
    model = any(p.model_flops is not None for p in plans)
    measured = any(p.measured is not None for p in plans)
    names = list(dict.fromkeys(k for p in plans for k in p.knobs))
    table = Table(title=title)
    columns = [("#", "right"), ("layout", "left"), ("mesh", "left")]
    columns += [(", ".join(names), "left")] * knobs + [("compiled", "left")] * marks
    columns += [
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
    ]
    columns += [("model TFLOP/s/device", "right")] * model
    columns += [("measured", "right")] * measured + [("fits / why not", "left")]
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    built = [p for p in plans if p.memory is not None]
    common = [n for n in built[0].notes if all(n in p.notes for p in built)] if built else []
    rows = {id(p): i for i, p in enumerate(shown, 1)}
    for i, p in enumerate(shown, 1):
        mesh = "×".join(f"{k}={v}" for k, v in p.mesh_shape.items())
        head = [str(i), p.layout, mesh]
        head += [", ".join(str(p.knobs.get(k, "")) for k in names)] * knobs
        head += ["yes" if p.compiled else "no"] * marks
        if p.memory is None or p.time is None:
            blank = [""] * (len(columns) - len(head) - 1)
            table.add_row(*head, *blank, f"[red]{escape(_why(p, rows))}[/red]")
            continue
        comms = ", ".join(
            f"{_SHORT[k]} {format_bytes(p.collectives[k])}" for k in KINDS if p.collectives.get(k)
        )
        row = head + [
            format_bytes(p.memory.peak),
            format_bytes(p.memory.state),
            format_bytes(p.memory.temp),
            f"{p.flops:.3g}",
            comms or "none",
            format_seconds(p.time.compute),
            format_seconds(p.time.comms),
            format_seconds(p.time.step),
            f"{format_seconds(_or(p.time.step_low, p.time.step))}-"
            f"{format_seconds(_or(p.time.step_high, p.time.step))}",
            format_seconds(p.time.serial),
        ]
        if model:
            tflops = p.model_tflops_per_device
            row.append(f"{tflops:.3g}" if tflops is not None else "")
        if measured:
            row.append(format_seconds(p.measured) if p.measured is not None else "")
        status = "[green]yes[/green]" if p.fits else f"[red]no: {escape(str(p.reason))}[/red]"
        extra = [n for n in p.notes if n not in common]
        if extra:
            status += escape(" (" + "; ".join(extra) + ")")
        table.add_row(*row, status)
    caption = list(common)
    if hidden:
        caption.append(f"{hidden} plans left uncompiled are not shown (to_json lists them)")
    if caption:
        table.caption = escape("; ".join(caption))
    return table


def plot(plans: Sequence[Plan], title: str, limit: int, path: str) -> None:
    """Predicted step time against peak memory per device of ``plans``, saved to ``path``: the
    memory limit drawn, the Pareto front (no plan both faster and smaller) marked.
    Needs matplotlib (the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(_errors.plan_needs_matplotlib()) from e
    from matplotlib.ticker import FuncFormatter

    built = [p for p in plans if p.memory is not None and p.time is not None]
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
    ax.axvline(limit, color="C3", label=f"memory limit ({format_bytes(limit)})")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_bytes(x)))
    ax.set_xlabel("peak memory per device (log scale)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _point(plan: Plan) -> tuple[int, float]:
    """A built plan's place on the plot: peak bytes per device, predicted milliseconds."""
    if plan.memory is None or plan.time is None:
        raise ValueError(f"{plan.label} has no figures to plot: {plan.reason}")
    return plan.memory.peak, plan.time.step * 1e3


def _why(p: Plan, rows: Mapping[int, int]) -> str:
    """A row's reason, short where it was pruned (the plan that shows it by row)."""
    by = rows.get(id(p.pruned_by)) if p.pruned_by is not None else None
    if p.pruned == "time" and by is not None:
        return f"not compiled: no faster than #{by}" + (", which fits" if p.pruned_by.fits else "")  # type: ignore[union-attr]
    if p.pruned == "memory" and by is not None:
        return f"not compiled, does not fit: needs at least #{by}'s memory"
    if p.pruned == "pareto" and by is not None:
        return f"not compiled: #{by} beats its candidate on memory and time"
    if p.pruned == "state" and p.state_bytes is not None:
        return f"not compiled, does not fit: its state alone is {format_bytes(p.state_bytes)}"
    return str(p.reason)


def plan_json(p: Plan) -> dict[str, Any]:
    """One plan as `Plans.to_json` writes it."""
    memory: dict[str, Any] = {"state": p.state_bytes, "temp": None, "peak": None}
    if p.memory is not None:
        memory = {**dataclasses.asdict(p.memory), "peak": p.memory.peak}
    time_: dict[str, Any] | None = None
    if p.time is not None:
        time_ = {**dataclasses.asdict(p.time), "step": p.time.step, "serial": p.time.serial}
        for extra in ("step_low", "step_high"):  # where the cost model gives a range
            if hasattr(p.time, extra):
                time_[extra] = getattr(p.time, extra)
    return {
        "layout": p.layout,
        "mesh_shape": dict(p.mesh_shape),
        "knobs": dict(p.knobs),
        "compiled": p.compiled,
        "pruned": p.pruned,
        "fits": None if p.pruned in ("time", "memory", "pareto") else p.fits,  # inferred
        "reason": p.reason,
        "compiler": p.compiler,
        "accelerator": p.accelerator,
        "memory": memory,
        "flops": p.flops if p.compiled else None,
        "collectives": dict(p.collectives),
        "time": time_,
        "model_flops": p.model_flops,
        "model_tflops_per_device": p.model_tflops_per_device,
        "notes": list(p.notes),
        "compile_seconds": p.compile_seconds,
    }


def pareto(plans: Sequence[Plan]) -> list[Plan]:
    """The plans no other beats on both peak memory and predicted step, by memory."""
    front: list[Plan] = []
    for p in sorted(plans, key=lambda p: (p.memory.peak, p.time.step)):  # type: ignore[union-attr]
        if not front or p.time.step < front[-1].time.step:  # type: ignore[union-attr]
            front.append(p)
    return front


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
