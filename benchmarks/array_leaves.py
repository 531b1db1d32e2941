"""flax's example ``07_array_leaves.py``: a model whose state is plain array attributes.

The model of flax's ``examples/nnx_toy_examples/07_array_leaves.py`` keeps its parameters
and its call counter in plain ``jax.Array`` attributes (``self.w = jax.random.normal(...)``,
``self.count += 1``), not in Variables; its ``nnx.Optimizer`` selects them with a path
filter. Its train step (gradient of the loss, ``optimizer.update``) is jitted by

  flax.nnx.jit            flax in graph mode, as the example runs it (the baseline)
  nnx_sharding.jit        this package
  ... (donate)            the same with donate_argnums=(0, 1)

(flax's tree mode, ``nnx.jit(graph=False)``, is left out: it does not write the plain
arrays back, so the example does not train under it.)

and run on the example's batches (numpy arrays, as its data generator yields them). In
each of --rounds rounds every variant times one block of back-to-back steps (ending with
`jax.block_until_ready` on the model's arrays), each followed at once by one block of the
baseline; a ratio is taken within that pair. The table gives the median per-step time and
the median ratio with its spread (min, quartiles, max).

Before timing, every variant runs the same 20 steps from the same initial model as the
baseline: the final arrays must be bit-identical (`tests/test_cache.py` asserts it too).

Run:  python benchmarks/array_leaves.py [--rounds 11] [--out DIR]
Writes array_leaves.json to benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import nnx_sharding  # noqa: E402

BLOCK_S = 0.2
BASELINE = "flax.nnx.jit"


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = jax.random.normal(rngs.params(), (din, dout))
        self.b = jnp.zeros((dout,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w + self.b


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
        self.count = jnp.array(0)
        self.linear1 = Linear(din, dhidden, rngs=rngs)
        self.linear2 = Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        self.count += 1
        return self.linear2(nnx.relu(self.linear1(x)))


def is_param(path: tuple[Any, ...], value: Any) -> bool:
    return path[-1] in ("w", "b")


def make_model() -> tuple[MLP, nnx.Optimizer]:
    model = MLP(din=1, dhidden=32, dout=1, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(1e-3), wrt=is_param)


def train_step(model: MLP, optimizer: nnx.Optimizer, batch: tuple[Any, Any]) -> None:
    x, y = batch

    def loss_fn(model: MLP) -> jax.Array:
        return jnp.mean((y - model(x)) ** 2)

    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, is_param))(model)
    optimizer.update(model, grads)


def batches(n: int, batch_size: int = 32, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """The example's data: X in [0, 1], Y = 0.8 X^2 + 0.1 + noise, random batches."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, 100)[:, None]
    y = 0.8 * x**2 + 0.1 + rng.normal(0, 0.1, size=x.shape)
    picks = [rng.choice(len(x), size=batch_size) for _ in range(n)]
    return [(x[idx], y[idx]) for idx in picks]


VARIANTS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    BASELINE: nnx.jit,
    "nnx_sharding.jit": nnx_sharding.jit,
    "nnx_sharding.jit (donate)": functools.partial(nnx_sharding.jit, donate_argnums=(0, 1)),
}


def final_arrays(jit: Callable[[Callable[..., Any]], Callable[..., Any]], steps: int) -> list[Any]:
    model, optimizer = make_model()
    step = jit(train_step)
    for batch in batches(steps):
        step(model, optimizer, batch)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, optimizer)))]


def timer(jit: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], float]:
    """Warms a variant up and returns a function timing one block: µs per step."""
    model, optimizer = make_model()
    step = jit(train_step)
    data = batches(64)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            step(model, optimizer, data[i % len(data)])
        jax.block_until_ready((model.count, model.linear1.w, model.linear2.w))
        return 1e6 * (time.perf_counter() - t0) / n

    for _ in range(3):
        run(1)
    n = max(5, round(BLOCK_S / (run(5) / 1e6)))
    return lambda: run(n)


def quartiles(values: list[float]) -> list[float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [min(values), q1, q2, q3, max(values)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    console = Console()

    reference = final_arrays(VARIANTS[BASELINE], 20)
    for name, jit in VARIANTS.items():
        got = final_arrays(jit, 20)
        same = len(got) == len(reference) and all(
            a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got, reference, strict=True)
        )
        if not same:
            raise SystemExit(f"{name}: after 20 steps the arrays differ from {BASELINE}'s")
    console.print(f"every variant's arrays after 20 steps are bit-identical to {BASELINE}'s")

    timers = {name: timer(jit) for name, jit in VARIANTS.items()}
    us: dict[str, list[float]] = {name: [] for name in timers}
    ratios: dict[str, list[float]] = {name: [] for name in timers if name != BASELINE}
    for _ in range(args.rounds):
        for name, run in timers.items():
            if name == BASELINE:
                continue
            mine, base = run(), timers[BASELINE]()
            us[name].append(mine)
            us[BASELINE].append(base)
            ratios[name].append(mine / base)

    table = Table(title=f"07_array_leaves.py train step, {args.rounds} paired rounds")
    for column in ("variant", "µs per step (median)", f"ratio to {BASELINE}", "min-q1-q3-max"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for name, times in us.items():
        if name == BASELINE:
            table.add_row(name, f"{statistics.median(times):,.0f}", "1", "")
            continue
        spread = quartiles(ratios[name])
        table.add_row(
            name,
            f"{statistics.median(times):,.0f}",
            f"{spread[2]:.3f}",
            "-".join(f"{v:.3f}" for v in (spread[0], spread[1], spread[3], spread[4])),
        )
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "array_leaves.json"
    report = {
        "rounds": args.rounds,
        "us": us,
        "ratios": ratios,
        "median_ratio": {name: statistics.median(r) for name, r in ratios.items()},
    }
    path.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
