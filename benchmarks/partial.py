"""Per-call overhead of the pre-flattened partials, against `overhead.py`'s floors.

`overhead.py`'s two steps (a no-op bumping a counter, an SGD train step) on its MLP, through:

  nnx_sharding.jit_partial        jit_partial(step, model, optimizer, graph=False)(x, y)
  ... (donate)                    the same with donate_argnums=0 (train only)
  nnx.jit_partial                 flax's, graph=False (and donate_argnums=0 for "(donate)")
  ... (donate)
  cached_partial(nnx_sharding.jit)  nnx.cached_partial(nnx_sharding.jit(step), model, opt)
  ... (donate)                    over nnx_sharding.jit(step, donate_argnums=(0, 1))
  nnx.cached_partial              nnx.cached_partial(nnx.jit(step), model, optimizer)
  floor (a), floor (b)            `overhead.py`'s: a flat jax.jit over the arrays

Timing is `overhead.py`'s (`time_variants`): per round, every variant times one block of
back-to-back calls followed at once by one block of its step's floor (floor (a) for the
train step, floor (b) for the no-op step); a ratio is the median of the per-round ratios,
printed with its spread (min, quartiles, max).

With --clock cpu a block is timed by the process's CPU time (every thread of it, XLA's
included) instead of wall time: on a machine shared with other work, time spent waiting
for a core then counts for neither variant of a pair.

Run:  python benchmarks/partial.py [--depths 100] [--blocks 11] [--clock cpu] [--out DIR]
Writes partial.json (partial-cpu.json) to benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (the sibling script: its model, steps, floors and timing)
from overhead import MLP, Array, Bench, NotApplicable, StepSpec, Variant  # noqa: E402


def nnx_sharding() -> Any:
    if str(overhead.REPO) not in sys.path:
        sys.path.append(str(overhead.REPO))
    import nnx_sharding

    return nnx_sharding


def partial(make_partial: Callable[..., Callable[..., Any]], *, donates: bool = False) -> Variant:
    """``make_partial(step, model, optimizer, donate)(x, y)``; a donating variant runs only
    for steps whose floor donates."""

    def make(spec: StepSpec, model: MLP, opt: nnx.Optimizer, x: Array, y: Array) -> Bench:
        if donates and not spec.donates:
            raise NotApplicable(f"{spec.floor} does not donate")
        f = make_partial(spec.fn, model, opt, donates)
        return Bench(lambda: f(x, y), overhead.current_values(spec, model, opt))

    return make


def ours_jit_partial(fn, model, opt, donate):
    options = {"donate_argnums": 0} if donate else {}
    return nnx_sharding().jit_partial(fn, model, opt, graph=False, **options)


def flax_jit_partial(fn, model, opt, donate):
    options = {"donate_argnums": 0} if donate else {}
    return nnx.jit_partial(fn, model, opt, graph=False, **options)


def cached_ours(fn, model, opt, donate):
    options = {"donate_argnums": (0, 1)} if donate else {}
    return nnx.cached_partial(nnx_sharding().jit(fn, **options), model, opt)


def cached_flax(fn, model, opt, donate):
    return nnx.cached_partial(nnx.jit(fn), model, opt)


VARIANTS: dict[str, Variant] = {
    "nnx_sharding.jit_partial": partial(ours_jit_partial),
    "nnx_sharding.jit_partial (donate)": partial(ours_jit_partial, donates=True),
    "nnx.jit_partial": partial(flax_jit_partial),
    "nnx.jit_partial (donate)": partial(flax_jit_partial, donates=True),
    "cached_partial(nnx_sharding.jit)": partial(cached_ours),
    "cached_partial(nnx_sharding.jit) (donate)": partial(cached_ours, donates=True),
    "nnx.cached_partial": partial(cached_flax),
    "nnx_sharding.jit": overhead.VARIANTS["nnx_sharding.jit"],
    "floor (a)": overhead.VARIANTS["floor (a)"],
    "floor (b)": overhead.VARIANTS["floor (b)"],
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depths", default="100", help="comma-separated MLP depths")
    parser.add_argument("--blocks", type=int, default=11, help="paired rounds per measurement")
    parser.add_argument("--calls", type=int, default=None, help="calls per block (default: ~0.2 s)")
    parser.add_argument("--block-s", type=float, default=overhead.BLOCK_S, help="seconds a block")
    parser.add_argument("--steps", default="noop,train", help="comma-separated steps")
    parser.add_argument("--only", default="", help="comma-separated variants (floors added)")
    parser.add_argument("--out", type=Path, default=overhead.REPO / "benchmarks" / "results")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: time blocks by this process's CPU time (all its threads), which a "
        "machine shared with other work disturbs less than wall time",
    )
    args = parser.parse_args()
    if args.clock == "cpu":  # overhead's timers read time.perf_counter
        overhead.time = types.SimpleNamespace(perf_counter=time.process_time)
    depths = [int(d) for d in args.depths.split(",")]
    variants = dict(VARIANTS)
    if args.only:
        keep = set(args.only.split(",")) | {"floor (a)", "floor (b)"}
        variants = {k: v for k, v in VARIANTS.items() if k in keep}
    overhead.VARIANTS = variants  # time_variants times the variants of its module
    timing = dict(blocks=args.blocks, calls=args.calls, block_s=args.block_s, warmup=3)
    x_np = np.linspace(0, 1, 100)[:, None]
    x, y = jnp.asarray(x_np), jnp.asarray(0.8 * x_np**2 + 0.1)
    report: dict[str, Any] = {
        "machine": overhead.machine_info(),
        "settings": timing | {"clock": args.clock},
        "steps": {},
    }
    overhead.console.print(report["machine"])
    for name in args.steps.split(","):
        spec = overhead.STEPS[name]
        report["steps"][name] = {"floor": spec.floor, "variants": {}}
        for depth in depths:
            cells = overhead.time_variants(spec, depth, x, y, **timing)
            for variant, cell in cells.items():
                report["steps"][name]["variants"].setdefault(variant, {})[str(depth)] = cell
                shown = "n/a" if cell["us"] is None else f"{cell['us']:,.1f} µs"
                quartiles = " ".join(f"{r:.2f}" for r in cell["spread"])
                ratio = overhead.show(cell["ratio"], ".2f", "×")
                overhead.console.print(
                    f"depth {depth:>4}  {name:<6} {variant:<42} {shown:>12}  "
                    f"ratio {ratio} [{quartiles}]"
                )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("partial.json" if args.clock == "wall" else "partial-cpu.json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    overhead.console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
