"""Per-call overhead of lifted jit for Flax NNX, against a flat `jax.jit` floor.

Two steps -- a no-op that only bumps a counter, and an SGD train step -- on the MLP of Flax's
graph-overhead benchmark (width 32, BatchNorm in every block) at several depths, each run in one
process through these implementations:

  nnx_sharding.jit        this package (n/a while it cannot be imported or fails)
  ... (donate)            the same with donate_argnums=(0, 1), as floor (a) donates (train only)
  ... Compiled            jit(step).lower(...).compile(), called with the modules
  nnx.jit (graph)         flax.nnx.jit in graph mode (the default)
  nnx.jit (graph=False)   flax.nnx.jit in tree mode
  nnx.cached_partial      flax.nnx.cached_partial(nnx.jit(step), model, optimizer)
  functional jax.jit      split once; jax.jit(merge -> step -> split); the Python loop carries state
  floor (a)               jax.jit over the flat list of arrays, donated, returning all of them
  floor (b)               the same, not donated, returning only the arrays the step changes

Per-call time is the median over --blocks rounds of the mean time per call in a block of
back-to-back calls; each block ends with `jax.block_until_ready` on the outputs and the state.
In each round every variant times one block followed at once by one block of its floor (floor
(a) for the train step, floor (b) for the no-op step); the ratio is taken within that pair, so
that a change in machine load hits both alike. A ratio is the median over the rounds, printed
with its spread (min, quartiles, max). The first call (trace + compile) of nnx_sharding.jit and
of the functional jax.jit is timed on fresh models and step functions: the median of
--first-reps, alternating.

Run:  python benchmarks/overhead.py [--quick] [--depths 5,20,100] [--tag gpu] [--out DIR]
  or  nox -s bench
Writes overhead[-TAG].json, overhead[-TAG].png (time per call over the floor, by depth) and
overhead[-TAG].md (the tables of docs/performance.md) to benchmarks/results/ (or --out). Then
`python benchmarks/overhead_report.py benchmarks/results/overhead.json --docs` puts the run
into docs/performance.md and docs/assets/ (see overhead_report.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib
import importlib.metadata
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import Array
from overhead_report import write as write_report  # benchmarks/, the script's directory
from rich.console import Console
from rich.table import Table

console = Console()
REPO = Path(__file__).resolve().parents[1]
BLOCK_S = 0.2  # target duration of one timed block when --calls is not given


# ----------------------------------------------------------------------------- model and steps
class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.uniform(rngs.params(), (din, dout)))
        self.b = nnx.Param(jnp.zeros((dout,)))

    def __call__(self, x: Array) -> Array:
        return x @ self.w + self.b


class Block(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.linear = Linear(din, dout, rngs=rngs)
        self.bn = nnx.BatchNorm(dout, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return nnx.relu(self.bn(self.linear(x)))


class Count(nnx.Variable):
    pass


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, depth: int, *, rngs: nnx.Rngs):
        self.count = Count(jnp.array(0))
        self.linear_in = Block(din, dhidden, rngs=rngs)
        self.intermediates = nnx.List(
            [Block(dhidden, dhidden, rngs=rngs) for _ in range(depth - 2)]
        )
        self.linear_out = Block(dhidden, dout, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        self.count[...] += 1
        x = nnx.relu(self.linear_in(x))
        for layer in self.intermediates:
            x = nnx.relu(layer(x))
        return self.linear_out(x)


def make_model(depth: int) -> tuple[MLP, nnx.Optimizer]:
    model = MLP(1, 32, 1, depth, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)


def noop_step(model: MLP, optimizer: nnx.Optimizer, x: Array, y: Array) -> None:
    model.count[...] += 1


def train_step(model: MLP, optimizer: nnx.Optimizer, x: Array, y: Array) -> Array:
    loss, grads = nnx.value_and_grad(lambda model: jnp.mean((model(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


@dataclasses.dataclass(frozen=True)
class StepSpec:
    fn: Callable[[MLP, nnx.Optimizer, Array, Array], Any]
    changes: type[nnx.Variable]  # the Variables the step updates: what floor (b) returns
    floor: str  # the variant the ratios are taken against
    donates: bool  # whether the floor donates; variants that donate run only then


STEPS = {
    "noop": StepSpec(noop_step, Count, "floor (b)", donates=False),
    "train": StepSpec(train_step, nnx.Variable, "floor (a)", donates=True),
}


class NotApplicable(Exception):
    """A variant that does not apply to a step: n/a in the table, without a warning."""


# ----------------------------------------------------------------------------- variants
@dataclasses.dataclass(frozen=True)
class Bench:
    call: Callable[[], Any]  # runs one step, returns its output
    sync: Callable[[], Any]  # the state to block on at the end of a timed block


Variant = Callable[[StepSpec, MLP, nnx.Optimizer, Array, Array], Bench]
BlockTimer = Callable[[], float]  # times one block of calls: µs per call
T = TypeVar("T")
JitFn = Callable[[Callable[..., Any]], Callable[..., Any]]


def lifted(jit: JitFn, *, partial: bool = False, donates: bool = False) -> Variant:
    """A lifted jit updating model and optimizer in place: f(model, opt, x, y), or with
    partial=True nnx.cached_partial(f, model, opt)(x, y). A jit that donates (donates=True)
    runs only for steps whose floor donates."""

    def make(spec: StepSpec, model: MLP, opt: nnx.Optimizer, x: Array, y: Array) -> Bench:
        if donates and not spec.donates:
            raise NotApplicable(f"{spec.floor} does not donate")
        f = jit(spec.fn)
        if partial:
            f_xy = nnx.cached_partial(f, model, opt)
            call = lambda: f_xy(x, y)
        else:
            call = lambda: f(model, opt, x, y)
        return Bench(call, current_values(spec, model, opt))

    return make


def current_values(spec: StepSpec, model: MLP, opt: nnx.Optimizer) -> Callable[[], list[Array]]:
    """What a block waits on for an in-place variant: the current arrays of the Variables the
    step changes, as the floors wait on the arrays they carry. The Variables are found once;
    `nnx.state` per block would cost ~45 ms at depth 100 and swamp the per-call figures."""
    variables = [v for _, v in nnx.iter_graph((model, opt)) if isinstance(v, spec.changes)]
    return lambda: [v.get_raw_value() for v in variables]


def nnx_sharding_jit(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
        sys.path.append(str(REPO))
    return importlib.import_module("nnx_sharding").jit(fn, **options)


def compiled(spec: StepSpec, model: MLP, opt: nnx.Optimizer, x: Array, y: Array) -> Bench:
    """``nnx_sharding.jit(step).lower(...).compile()``, called with the modules."""
    program = nnx_sharding_jit(spec.fn).lower(model, opt, x, y).compile()
    return Bench(lambda: program(model, opt, x, y), current_values(spec, model, opt))


def tree_mode_jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    if "graph" not in inspect.signature(nnx.jit).parameters:
        raise TypeError(f"flax {flax.__version__}: nnx.jit has no `graph` parameter")
    return nnx.jit(fn, graph=False)


def carried(fn: Callable[..., tuple[Any, Any]], carry: Any, *args: Any) -> Bench:
    """A Python loop threading `carry` through a pure fn(carry, *args) -> (carry, out)."""
    box = [carry]

    def call() -> Any:
        box[0], out = fn(box[0], *args)
        return out

    return Bench(call, lambda: box[0])


def functional(spec: StepSpec, model: MLP, opt: nnx.Optimizer, x: Array, y: Array) -> Bench:
    graphdef, state = nnx.split((model, opt))

    @jax.jit
    def fn(state: nnx.State, x: Array, y: Array) -> tuple[nnx.State, Any]:
        model, opt = nnx.merge(graphdef, state)
        out = spec.fn(model, opt, x, y)
        return nnx.split((model, opt))[1], out

    return carried(fn, state, x, y)


def flat(*, donate: bool, only_changed: bool) -> Variant:
    """jax.jit over the flat list of arrays. The arrays the step changes (all of them unless
    only_changed) are carried by the loop, optionally donated; the rest are passed every call."""

    def make(spec: StepSpec, model: MLP, opt: nnx.Optimizer, x: Array, y: Array) -> Bench:
        graphdef, state = nnx.split((model, opt))
        leaves, treedef = jax.tree.flatten(state)
        keep = jax.tree.leaves(
            jax.tree.map(
                lambda v: not only_changed or isinstance(v, spec.changes),
                state,
                is_leaf=lambda v: isinstance(v, nnx.Variable),
            )
        )
        assert len(keep) == len(leaves), "expected one array per Variable"

        def fn(changed: list[Array], fixed: list[Array], x: Array, y: Array):
            changed_it, fixed_it = iter(changed), iter(fixed)
            leaves = [next(changed_it) if k else next(fixed_it) for k in keep]
            model, opt = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            out = spec.fn(model, opt, x, y)
            new_leaves = jax.tree.leaves(nnx.split((model, opt))[1])
            return [a for a, k in zip(new_leaves, keep, strict=True) if k], out

        jitted = jax.jit(fn, donate_argnums=0 if donate else ())
        changed = [a for a, k in zip(leaves, keep, strict=True) if k]
        fixed = [a for a, k in zip(leaves, keep, strict=True) if not k]
        return carried(jitted, changed, fixed, x, y)

    return make


VARIANTS: dict[str, Variant] = {
    "nnx_sharding.jit": lifted(nnx_sharding_jit),
    "nnx_sharding.jit (donate)": lifted(
        functools.partial(nnx_sharding_jit, donate_argnums=(0, 1)), donates=True
    ),
    "nnx_sharding Compiled": compiled,
    "nnx.jit (graph)": lifted(nnx.jit),
    "nnx.jit (graph=False)": lifted(tree_mode_jit),
    "nnx.cached_partial": lifted(nnx.jit, partial=True),
    "functional jax.jit": functional,
    "floor (a)": flat(donate=True, only_changed=False),
    "floor (b)": flat(donate=False, only_changed=True),
}


# ----------------------------------------------------------------------------- timing
def block_timer(bench: Bench, calls: int | None, block_s: float, warmup: int) -> BlockTimer:
    """Warms `bench` up and returns a function timing one block: the mean per-call time (µs)
    of `calls` back-to-back calls (as many as fit in `block_s` when None)."""

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            out = bench.call()
        jax.block_until_ready((out, bench.sync()))
        return 1e6 * (time.perf_counter() - t0) / n

    for _ in range(warmup):
        run(1)
    n = calls or max(5, round(block_s / (run(5) / 1e6)))
    return lambda: run(n)


Timing = dict[str, Any]  # per variant: "us", "ratio", "spread" (ratios), "error"


def spread(values: list[float]) -> list[float]:
    """min, first quartile, median, third quartile, max."""
    if len(values) < 2:
        return values * 5 if values else []
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [min(values), q1, q2, q3, max(values)]


def time_variants(
    spec: StepSpec, depth: int, x: Array, y: Array, *, blocks: int, **timing: Any
) -> dict[str, Timing]:
    """Per-call µs of every variant and its ratio to the step's floor, from `blocks` rounds.

    In each round every variant times one block, each followed at once by one block of
    the floor: a ratio is taken within such a pair, so that a change in machine load hits
    both of its blocks alike. A variant's ratio is the median of its per-round ratios,
    with their spread; its µs the median of its blocks.
    """
    timers: dict[str, BlockTimer] = {}
    results: dict[str, Timing] = {}
    for name, make in VARIANTS.items():
        timer, err = attempt(
            f"{name} ({spec.fn.__name__}, depth {depth})",
            lambda make=make: block_timer(make(spec, *make_model(depth), x, y), **timing),
        )
        if timer is None:
            results[name] = {"us": None, "ratio": None, "spread": [], "error": err}
        else:
            timers[name] = timer
    floor = timers.get(spec.floor)
    samples: dict[str, list[float]] = {name: [] for name in timers}
    ratios: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(blocks):
        for name, timer in timers.items():
            if name == spec.floor:
                continue
            us = timer()
            samples[name].append(us)
            if floor is not None:
                floor_us = floor()
                samples[spec.floor].append(floor_us)
                ratios[name].append(us / floor_us)
    for name, us in samples.items():
        ratio_spread = [1.0] * 5 if name == spec.floor else spread(ratios[name])
        results[name] = {
            "us": statistics.median(us) if us else None,
            "ratio": ratio_spread[2] if ratio_spread else None,
            "spread": ratio_spread,
            "error": None,
        }
    return results


def first_calls_s(
    makes: list[Variant], spec: StepSpec, depth: int, x: Array, y: Array, reps: int
) -> list[float]:
    """Per variant, the median over `reps` rounds of its `first_call_s`, alternating."""
    times: list[list[float]] = [[] for _ in makes]
    for _ in range(reps):
        for make, out in zip(makes, times, strict=True):
            out.append(first_call_s(make, spec, depth, x, y))
    return [statistics.median(t) for t in times]


def first_call_s(make: Variant, spec: StepSpec, depth: int, x: Array, y: Array) -> float:
    """Trace + compile + run of the first call, on a fresh model and a fresh step function."""
    fresh = dataclasses.replace(spec, fn=lambda *args: spec.fn(*args))  # defeat per-function caches
    bench = make(fresh, *make_model(depth), x, y)
    gc.collect()
    t0 = time.perf_counter()
    jax.block_until_ready((bench.call(), bench.sync()))
    return time.perf_counter() - t0


def attempt(what: str, measure: Callable[[], T]) -> tuple[T | None, str | None]:
    """measure(), or (None, reason): an unfinished or incompatible variant becomes n/a."""
    try:
        return measure(), None
    except NotApplicable as e:
        return None, f"not applicable: {e}"
    except Exception as e:
        reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:300]
        console.print(f"[yellow]{what} failed: {reason}")
        return None, reason


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ----------------------------------------------------------------------------- reporting
def machine_info() -> dict[str, Any]:
    try:
        ours = importlib.metadata.version("nnx_sharding")
    except importlib.metadata.PackageNotFoundError:
        ours = None
    device = jax.devices()[0]
    info = {m.__name__: m.__version__ for m in (jax, flax, optax)} | {"nnx_sharding": ours}
    info |= {"platform": device.platform, "device_kind": device.device_kind}
    info |= {"device_count": jax.device_count(), "cpu_count": os.cpu_count()}
    return info | {"nnx_graph_mode_default": bool(flax.config.nnx_graph_mode)}


CellFormat = Callable[[dict[str, Any]], str]


def show(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def per_call_cell(c: dict[str, Any]) -> str:
    us = show(c["us"], ",.0f" if (c["us"] or 0) >= 100 else ".1f", " µs")
    if not c["spread"] or c["ratio"] == 1.0:
        return f"{us} ({show(c['ratio'], '.2f', '×')})"
    low, q1, _, q3, high = c["spread"]
    return f"{us} ({c['ratio']:.2f}×, IQR {q1:.2f}–{q3:.2f}, {low:.2f}–{high:.2f})"


def first_call_cell(c: dict[str, Any]) -> str:
    ours, base = show(c["nnx_sharding_s"], ".2f", " s"), show(c["functional_s"], ".2f", " s")
    return f"{ours} / {base} ({show(c['ratio'], '.2f', '×')})"


def print_table(title: str, rows: dict[str, Any], depths: list[int], cell: CellFormat) -> None:
    table = Table(title=title)
    table.add_column("")
    for d in depths:
        table.add_column(f"depth {d}", justify="right")
    for name, by_depth in rows.items():
        cells = [by_depth[str(d)] for d in depths]
        table.add_row(name, *map(cell, cells))
    console.print(table)


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depths", default="5,20,100", help="comma-separated MLP depths")
    parser.add_argument("--blocks", type=int, default=11, help="paired rounds per measurement")
    parser.add_argument("--calls", type=int, default=None, help="calls per block (default: ~0.2 s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (>= 3)")
    parser.add_argument("--quick", action="store_true", help="few short blocks, for smoke tests")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--tag", default="", help="suffix for the output files, e.g. gpu")
    parser.add_argument(
        "--first-reps", type=int, default=3, help="first calls timed per variant (0: none)"
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated variants to time (the floors always run), e.g. "
        "'nnx_sharding.jit,nnx_sharding.jit (donate)'",
    )
    args = parser.parse_args()
    if args.variants:
        wanted = {v.strip() for v in args.variants.split(",")} | {"floor (a)", "floor (b)"}
        if unknown := wanted - VARIANTS.keys():
            parser.error(f"unknown variants: {sorted(unknown)}; known: {list(VARIANTS)}")
        for name in [v for v in VARIANTS if v not in wanted]:
            del VARIANTS[name]
    depths = [int(d) for d in args.depths.split(",")]
    blocks, block_s = (min(args.blocks, 3), BLOCK_S / 10) if args.quick else (args.blocks, BLOCK_S)
    timing = dict(blocks=blocks, calls=args.calls, block_s=block_s, warmup=max(args.warmup, 3))
    if args.quick:
        args.first_reps = 1
    machine = machine_info()
    console.print(machine)

    x_np = np.linspace(0, 1, 100)[:, None]  # on the device once: no per-call host-to-device copy
    x, y = jnp.asarray(x_np), jnp.asarray(0.8 * x_np**2 + 0.1)
    for spec in STEPS.values():  # keep one-time JAX/XLA start-up out of the first-call numbers
        first_call_s(functional, spec, min(depths), x, y)

    steps: dict[str, Any] = {name: {v: {} for v in VARIANTS} for name in STEPS}
    first: dict[str, Any] = {name: {} for name in STEPS}
    for depth in depths:
        for name, spec in STEPS.items():
            # First calls before anything else compiles this step at this depth.
            pair = [lifted(nnx_sharding_jit), functional]
            firsts, err = (None, "not timed (--first-reps 0)")
            if args.first_reps > 0:
                firsts, err = attempt(
                    f"first calls ({name}, depth {depth})",
                    functools.partial(first_calls_s, pair, spec, depth, x, y, args.first_reps),
                )
            ours, base = firsts or (None, None)
            first[name][str(depth)] = {
                "nnx_sharding_s": ours,
                "functional_s": base,
                "ratio": ratio(ours, base),
                "error": err,
            }
            for variant, cell in time_variants(spec, depth, x, y, **timing).items():
                steps[name][variant][str(depth)] = cell
                shown = "n/a" if cell["us"] is None else f"{cell['us']:,.1f} µs"
                quartiles = " ".join(f"{r:.2f}" for r in cell["spread"])
                console.print(
                    f"depth {depth:>4}  {name:<6} {variant:<26} {shown:>14}  "
                    f"ratio {show(cell['ratio'], '.2f', '×')} [{quartiles}]"
                )

    for name, spec in STEPS.items():
        title = f"{name} step: time per call (ratio × {spec.floor})"
        print_table(title, steps[name], depths, per_call_cell)
    title = "first call, trace + compile: nnx_sharding.jit / functional jax.jit (ratio)"
    print_table(title, first, depths, first_call_cell)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("overhead" + (f"-{args.tag}" if args.tag else ""))
    report = {
        "machine": machine,
        "settings": {"depths": depths, "quick": args.quick, "first_reps": args.first_reps} | timing,
        "steps": {n: {"floor": s.floor, "variants": steps[n]} for n, s in STEPS.items()},
        "first_call": first,
    }
    Path(f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    write_report(report, stem)  # the plot and the Markdown tables
    console.print(f"wrote {stem}.json, {stem}.png and {stem}.md")


if __name__ == "__main__":
    main()
