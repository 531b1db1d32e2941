"""Per-call overhead of lifted jit for Flax NNX, against a flat `jax.jit` floor.

What is measured
----------------
Two steps -- a no-op that only bumps a counter, and an SGD train step -- on the MLP of Flax's
graph-overhead benchmark (width 32, BatchNorm in every block) at several depths, each run through
seven implementations in one process:

  nnx_sharding.jit        this package (n/a while it cannot be imported or fails)
  nnx.jit (graph)         flax.nnx.jit in graph mode (the default)
  nnx.jit (graph=False)   flax.nnx.jit in tree mode
  nnx.cached_partial      flax.nnx.cached_partial(nnx.jit(step), model, optimizer)
  functional jax.jit      split once; jax.jit(merge -> step -> split); the Python loop carries state
  floor (a)               jax.jit over the flat list of arrays, donated, returning all of them
  floor (b)               the same, not donated, returning only the arrays the step changes

Per-call time is the median over --blocks timed blocks of the mean time per call in a block of
back-to-back calls; each block ends with `jax.block_until_ready` on the outputs and the state.
Ratios are against floor (a) for the train step and floor (b) for the no-op step. The first call
(trace + compile) of nnx_sharding.jit and of the functional jax.jit is timed on fresh models.

Run:  python benchmarks/overhead.py [--quick] [--depths 5,20,100] [--tag gpu] [--out DIR]
  or  nox -s bench
Writes overhead[-TAG].json and overhead[-TAG].png to benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import inspect
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from rich.console import Console
from rich.table import Table

console = Console()
REPO = Path(__file__).resolve().parents[1]
BLOCK_S = 0.2  # target duration of one timed block when --calls is not given


# ---------------------------------------------------------------------------- model and steps
class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.uniform(rngs.params(), (din, dout)))
        self.b = nnx.Param(jnp.zeros((dout,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w + self.b


class Block(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.linear = Linear(din, dout, rngs=rngs)
        self.bn = nnx.BatchNorm(dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.relu(self.bn(self.linear(x)))


class Count(nnx.Variable):
    pass


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, depth: int, *, rngs: nnx.Rngs):
        self.count = Count(jnp.array(0))
        self.linear_in = Block(din, dhidden, rngs=rngs)
        self.intermediates = nnx.List([Block(dhidden, dhidden, rngs=rngs) for _ in range(depth - 2)])
        self.linear_out = Block(dhidden, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        self.count[...] += 1
        x = nnx.relu(self.linear_in(x))
        for layer in self.intermediates:
            x = nnx.relu(layer(x))
        return self.linear_out(x)


def make_model(depth: int) -> tuple[MLP, nnx.Optimizer]:
    model = MLP(1, 32, 1, depth, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)


def noop_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> None:
    model.count[...] += 1


def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: MLP) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@dataclasses.dataclass(frozen=True)
class StepSpec:
    fn: Callable[[MLP, nnx.Optimizer, jax.Array, jax.Array], Any]
    changes: type[nnx.Variable]  # the Variables the step updates: what floor (b) returns
    floor: str  # the variant the ratios are taken against


STEPS = {
    "noop": StepSpec(noop_step, Count, "floor (b)"),
    "train": StepSpec(train_step, nnx.Variable, "floor (a)"),
}


# ---------------------------------------------------------------------------- variants
@dataclasses.dataclass(frozen=True)
class Bench:
    call: Callable[[], Any]  # runs one step, returns its output
    sync: Callable[[], Any]  # the state to block on at the end of a timed block


Variant = Callable[[StepSpec, MLP, nnx.Optimizer, jax.Array, jax.Array], Bench]


def lifted(jit: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Variant:
    """A lifted jit, called as f(model, optimizer, x, y), that updates the objects in place."""

    def make(spec: StepSpec, model: MLP, opt: nnx.Optimizer, x: jax.Array, y: jax.Array) -> Bench:
        f = jit(spec.fn)
        return Bench(lambda: f(model, opt, x, y), lambda: nnx.state((model, opt)))

    return make


def nnx_sharding_jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
        sys.path.append(str(REPO))
    return importlib.import_module("nnx_sharding").jit(fn)


def tree_mode_jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    if "graph" not in inspect.signature(nnx.jit).parameters:
        raise TypeError(f"flax {flax.__version__}: nnx.jit has no `graph` parameter")
    return nnx.jit(fn, graph=False)


def cached_partial(spec: StepSpec, model: MLP, opt: nnx.Optimizer, x: jax.Array, y: jax.Array) -> Bench:
    f = nnx.cached_partial(nnx.jit(spec.fn), model, opt)
    return Bench(lambda: f(x, y), lambda: nnx.state((model, opt)))


def carried(fn: Callable[..., tuple[Any, Any]], carry: Any, *args: Any) -> Bench:
    """A Python loop threading `carry` through a pure fn(carry, *args) -> (carry, out)."""
    box = [carry]

    def call() -> Any:
        box[0], out = fn(box[0], *args)
        return out

    return Bench(call, lambda: box[0])


def functional(spec: StepSpec, model: MLP, opt: nnx.Optimizer, x: jax.Array, y: jax.Array) -> Bench:
    graphdef, state = nnx.split((model, opt))

    @jax.jit
    def fn(state: nnx.State, x: jax.Array, y: jax.Array) -> tuple[nnx.State, Any]:
        model, opt = nnx.merge(graphdef, state)
        out = spec.fn(model, opt, x, y)
        return nnx.split((model, opt))[1], out

    return carried(fn, state, x, y)


def flat(*, donate: bool, only_changed: bool) -> Variant:
    """jax.jit over the flat list of arrays: the floor for a given step.

    The arrays are split into the ones the step changes (carried, optionally donated) and the
    others (passed unchanged every call); with only_changed=False every array is carried.
    """

    def make(spec: StepSpec, model: MLP, opt: nnx.Optimizer, x: jax.Array, y: jax.Array) -> Bench:
        graphdef, state = nnx.split((model, opt))
        leaves, treedef = jax.tree.flatten(state)
        is_var = lambda v: isinstance(v, nnx.Variable)
        keep = jax.tree.leaves(
            jax.tree.map(lambda v: not only_changed or isinstance(v, spec.changes), state, is_leaf=is_var)
        )
        assert len(keep) == len(leaves), "expected one array per Variable"

        def fn(changed: list[jax.Array], fixed: list[jax.Array], x: jax.Array, y: jax.Array):
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
    "nnx.jit (graph)": lifted(nnx.jit),
    "nnx.jit (graph=False)": lifted(tree_mode_jit),
    "nnx.cached_partial": cached_partial,
    "functional jax.jit": functional,
    "floor (a)": flat(donate=True, only_changed=False),
    "floor (b)": flat(donate=False, only_changed=True),
}


# ---------------------------------------------------------------------------- timing
def per_call_us(bench: Bench, *, blocks: int, calls: int | None, block_s: float, warmup: int) -> float:
    """Median over `blocks` of the mean per-call time of `calls` back-to-back calls."""

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            out = bench.call()
        jax.block_until_ready((out, bench.sync()))
        return (time.perf_counter() - t0) / n

    for _ in range(warmup):
        run(1)
    if calls is None:  # as many calls as fit in block_s, judging by a block of 5
        calls = max(5, round(block_s / run(5)))
    return 1e6 * statistics.median(run(calls) for _ in range(blocks))


def first_call_s(variant: Variant, spec: StepSpec, depth: int, x: jax.Array, y: jax.Array) -> float:
    """Trace + compile + run of the first call, on a fresh model and a fresh step function."""
    fresh = dataclasses.replace(spec, fn=lambda *args: spec.fn(*args))  # defeat per-function caches
    bench = variant(fresh, *make_model(depth), x, y)
    t0 = time.perf_counter()
    jax.block_until_ready((bench.call(), bench.sync()))
    return time.perf_counter() - t0


def attempt(what: str, measure: Callable[[], float]) -> dict[str, Any]:
    try:
        return {"value": measure(), "error": None}
    except Exception as e:  # noqa: BLE001 -- an unfinished or incompatible variant becomes n/a
        reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:300]
        console.print(f"[yellow]{what} failed: {reason}")
        return {"value": None, "error": reason}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------- reporting
def machine_info() -> dict[str, Any]:
    try:
        ours = importlib.metadata.version("nnx_sharding")
    except importlib.metadata.PackageNotFoundError:
        ours = None
    device = jax.devices()[0]
    return {
        "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
        "nnx_sharding": ours, "python": platform.python_version(),
        "platform": device.platform, "device_kind": device.device_kind,
        "device_count": jax.device_count(), "cpu_count": os.cpu_count(),
        "nnx_graph_mode_default": bool(flax.config.nnx_graph_mode),
    }  # fmt: skip


def cell(us: float | None, r: float | None) -> str:
    if us is None:
        return "n/a"
    return f"{us:,.0f} µs ({r:.1f}×)" if us >= 100 else f"{us:.1f} µs ({r:.1f}×)"


def print_tables(steps: dict[str, Any], first: dict[str, Any], depths: list[int]) -> None:
    for name, spec in STEPS.items():
        table = Table(title=f"{name} step: time per call (ratio × {spec.floor})")
        table.add_column("variant")
        for d in depths:
            table.add_column(f"depth {d}", justify="right")
        for variant, by_depth in steps[name].items():
            table.add_row(variant, *(cell(by_depth[str(d)]["us"], by_depth[str(d)]["ratio"]) for d in depths))
        console.print(table)
    table = Table(title="first call (trace + compile): nnx_sharding.jit / functional jax.jit")
    table.add_column("step")
    for d in depths:
        table.add_column(f"depth {d}", justify="right")
    for name in STEPS:
        row = [first[name][str(d)] for d in depths]
        table.add_row(name, *(
            "n/a" if c["ratio"] is None
            else f"{c['nnx_sharding_s']:.2f} s / {c['functional_s']:.2f} s ({c['ratio']:.2f}×)"
            for c in row
        ))  # fmt: skip
    console.print(table)


def plot(steps: dict[str, Any], depths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(STEPS), figsize=(12, 4.5))
    for ax, name in zip(axes, STEPS, strict=True):
        for variant, by_depth in steps[name].items():
            points = [(d, by_depth[str(d)]["us"]) for d in depths if by_depth[str(d)]["us"] is not None]
            if points:
                style = "--" if variant.startswith("floor") else "-"
                ax.plot(*zip(*points, strict=True), style, marker="o", label=variant)
        ax.set(title=f"{name} step", xlabel="depth", ylabel="µs per call", xscale="log", yscale="log")
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="5,20,100", help="comma-separated MLP depths")
    parser.add_argument("--blocks", type=int, default=7, help="timed blocks per measurement")
    parser.add_argument("--calls", type=int, default=None, help="calls per block (default: ~0.2 s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (>= 3)")
    parser.add_argument("--quick", action="store_true", help="few short blocks, for smoke tests")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--tag", default="", help="suffix for the output files, e.g. gpu")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    blocks, block_s = (min(args.blocks, 3), BLOCK_S / 10) if args.quick else (args.blocks, BLOCK_S)
    timing = dict(blocks=blocks, calls=args.calls, block_s=block_s, warmup=max(args.warmup, 3))

    machine = machine_info()
    console.print(machine)
    # Device data, so that no variant pays a host-to-device copy per call.
    x_np = np.linspace(0, 1, 100)[:, None]
    x, y = jnp.asarray(x_np), jnp.asarray(0.8 * x_np**2 + 0.1)
    for spec in STEPS.values():  # keep one-time JAX/XLA start-up out of the first-call numbers
        first_call_s(VARIANTS["functional jax.jit"], spec, min(depths), x, y)

    steps: dict[str, Any] = {name: {v: {} for v in VARIANTS} for name in STEPS}
    first: dict[str, Any] = {name: {} for name in STEPS}
    for depth in depths:
        for name, spec in STEPS.items():
            # First-call times before anything else compiles this step at this depth.
            ours, base = (
                attempt(f"first call {v}, {name}, depth {depth}",
                        lambda v=v: first_call_s(VARIANTS[v], spec, depth, x, y))
                for v in ("nnx_sharding.jit", "functional jax.jit")
            )  # fmt: skip
            first[name][str(depth)] = {
                "nnx_sharding_s": ours["value"], "functional_s": base["value"],
                "ratio": ratio(ours["value"], base["value"]), "error": ours["error"] or base["error"],
            }  # fmt: skip
            for variant, make in VARIANTS.items():
                r = attempt(f"{variant}, {name}, depth {depth}",
                            lambda make=make: per_call_us(make(spec, *make_model(depth), x, y), **timing))  # fmt: skip
                steps[name][variant][str(depth)] = {"us": r["value"], "error": r["error"]}
                us = "n/a" if r["value"] is None else f"{r['value']:,.1f} µs"
                console.print(f"depth {depth:>4}  {name:<6} {variant:<24} {us:>14}")
            floor_us = steps[name][spec.floor][str(depth)]["us"]
            for by_depth in steps[name].values():
                by_depth[str(depth)]["ratio"] = ratio(by_depth[str(depth)]["us"], floor_us)

    print_tables(steps, first, depths)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "overhead" + (f"-{args.tag}" if args.tag else "")
    report = {
        "machine": machine,
        "settings": {"depths": depths, "quick": args.quick, **timing},
        "steps": {name: {"floor": STEPS[name].floor, "variants": steps[name]} for name in STEPS},
        "first_call": first,
    }
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(steps, depths, args.out / f"{stem}.png")
    console.print(f"wrote {args.out / stem}.json and .png")


if __name__ == "__main__":
    main()
