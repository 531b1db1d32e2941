"""The compiles a search runs: the points `Schedule` gives, `WORKERS` at a time, with the
compilers' output captured, and a progress bar over them."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

from .._cost.hlo import remat_copies
from .._hardware.stderr import capturing
from .._plan import Plan
from .._step import Step
from .compile import compile_candidate
from .knobs import label
from .layouts import Candidate
from .pruning import Outcome, Schedule

WORKERS = 2
"""Compiles at a time: while one is traced and lowered (Python, holding the GIL), the
other is in the compiler (which releases it)."""


def drive(
    schedule: Schedule, work: Sequence[tuple[Step, Candidate]], progress: bool
) -> dict[int, Plan]:
    """Compiles the units ``schedule`` gives, `WORKERS` at a time (one traced while the
    other compiles), with the compilers' output captured, each worker with its own GPU
    kernel cache (`compiler_options`); the compiled plans by unit."""
    done: dict[int, Plan] = {}
    bar = Progress(progress, schedule.open_count())
    with (
        bar,
        capturing(),
        tempfile.TemporaryDirectory(prefix="nnx_sharding-kernels-") as folder,
        ThreadPoolExecutor(max_workers=WORKERS) as pool,
    ):
        free = [os.path.join(folder, f"kernels-{k}.bin") for k in range(WORKERS)]
        running: dict[Any, tuple[int, str]] = {}
        try:
            while True:
                while free:
                    i = schedule.next(busy=[unit for unit, _ in running.values()])
                    if i is None:
                        break
                    kernels = free.pop()
                    running[pool.submit(compile_candidate, *work[i], kernels)] = (i, kernels)
                    bar.show(work[i][1], work[i][0].knobs)
                if not running:
                    break
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in finished:
                    i, kernels = running.pop(future)
                    free.append(kernels)
                    plan = done[i] = future.result()
                    before = len(schedule.pruned)
                    schedule.record(i, outcome(plan))
                    bar.advance(1 + len(schedule.pruned) - before)
        except BaseException:  # an interrupt or an error: start no other candidate
            for future in running:
                future.cancel()
            raise
    return done


def outcome(plan: Plan) -> Outcome:
    """What `Schedule` needs to know of a compiled plan."""
    if plan.memory is None or plan.time is None:
        return Outcome(None)
    program = plan.program
    names = (
        [k.name for k in program.kernels] + [c.name for c in program.collectives] if program else []
    )
    return Outcome(plan.fits, plan.time.step, plan.memory.peak, remat_copies(names) > 0)


class Progress:
    """A progress bar over the points to compile (those pruned count as done)."""

    def __init__(self, show: bool, total: int):
        self._show, self._total = show, total
        self._bar: Any = None

    def __enter__(self) -> Progress:
        if self._show:
            from rich.progress import Progress as Bar

            self._bar = Bar(transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task("compiling", total=self._total)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def show(self, candidate: Candidate, knobs: Mapping[str, Any]) -> None:
        if self._bar is not None:
            what = candidate.label + (f" {label(knobs)}" if knobs else "")
            self._bar.update(self._task, description=f"compiling {what}")

    def advance(self, count: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, count)
