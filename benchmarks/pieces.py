"""Where a fast call's time goes: each piece of `nnx_sharding.jit`'s fast path, timed alone.

The no-op step of `overhead.py` (the graph-overhead MLP with `nnx.Optimizer(sgd)`) is jitted
and warmed up; then each piece of `cache.fast_call` runs on its own, in the order a call runs
them, beside the whole call. Its "jax dispatch" is what floor (b) of `overhead.py` (a flat
`jax.jit` over the same arrays, returning the changed one) costs too; the ratios to floor (b)
are `overhead.py`'s. Each figure is the median over --rounds interleaved rounds (every piece
once per round) of the mean of a block of calls, with min and max.

It also times the cheapest exact primitives for the snapshot's checks, on the same
containers: the list of keys (one C-level list comparison), the identity of every container
value (``all(map(is_, ...))``, streamed or on a gathered list, or the objects
``gc.get_referents`` lists compared as pointer arrays, `pointers`), every Variable's
metadata against a copy (one list comparison) and reading the Variables' values. An exact
check that looks at every entry cannot cost less than their sum in pure Python; with jax's
dispatch of the arrays (which floor (b) pays too) it bounds the fast call from below.

This reads the package's private modules (`cache`, `snapshot`): it measures them.

Run:  python benchmarks/pieces.py [--depth 100] [--rounds 11] [--out DIR]
Writes pieces-depth<D>.json to benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from itertools import chain
from operator import is_
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (the model, the steps and the floors)

import nnx_sharding  # noqa: E402
from nnx_sharding._fastpath import cache as _cache
from nnx_sharding._fastpath import slots as _slots  # noqa: E402
from nnx_sharding._fastpath.pointers import same_objects  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BLOCK_S = 0.05


def block(fn: Callable[[], Any], calls: int) -> float:
    """The mean time of ``calls`` back-to-back calls of ``fn``, in µs, with the arrays the
    last call returned ready (jax dispatches asynchronously)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return 1e6 * (time.perf_counter() - t0) / calls


def pieces(depth: int) -> dict[str, Callable[[], Any]]:
    """The pieces of one fast call of the no-op step at ``depth``, each a thunk."""
    spec = overhead.STEPS["noop"]
    x_np = np.linspace(0, 1, 100)[:, None]
    x, y = jnp.asarray(x_np), jnp.asarray(0.8 * x_np**2 + 0.1)
    model, opt = overhead.make_model(depth)
    f = nnx_sharding.jit(spec.fn)
    for _ in range(3):
        f(model, opt, x, y)
    (entry,) = f._entries.values()
    args = (model, opt, x, y)
    key, leaves, roots = _cache.fast_key(f._spec, args, {})
    snapshot = entry.snapshot
    arguments = entry.arguments(leaves)
    assert arguments is not None
    out = entry.state.jitted(*arguments)
    # The cheapest exact primitives for the same checks.
    dicts = snapshot._dicts
    saved = [*chain.from_iterable(map(dict.values, dicts))]
    referents = gc.get_referents(*dicts)
    read = _slots.value_reader()
    keys = [*chain.from_iterable(dicts)]
    saved_keys = list(keys)
    metadata = [*map(_slots.metadata_dict, snapshot._variables)]
    copies = [dict(m) for m in metadata]

    def quiet(fn: Callable[[], Any]) -> Callable[[], None]:
        return lambda: (fn(), None)[1]  # nothing for `block` to wait on

    return {
        "whole call": lambda: (f(*args), model.count.get_raw_value())[1],
        "cache key": quiet(lambda: _cache.fast_key(f._spec, args, {})),
        "container check": snapshot._containers_fresh,
        "metadata and pytree check": snapshot._leaves_fresh,
        "trace state": quiet(_cache.trace_state),
        "reading the arguments": quiet(lambda: entry.arguments(leaves)),
        "jax dispatch": lambda: entry.state.jitted(*arguments),
        "write-back and output": lambda: entry.merge(*out),
        "bound: keys (list ==)": lambda: [*chain.from_iterable(dicts)] == saved_keys,
        "bound: values' identity (streamed)": lambda: all(
            map(is_, chain.from_iterable(map(dict.values, dicts)), saved)
        ),
        "bound: values' identity (gathered, then compared)": lambda: all(
            map(is_, [*chain.from_iterable(map(dict.values, dicts))], saved)
        ),
        "bound: values' identity (referents, pointers compared)": lambda: same_objects(
            gc.get_referents(*dicts), referents
        ),
        "bound: metadata (list ==)": lambda: (
            [*map(_slots.metadata_dict, snapshot._variables)] == copies
        ),
        "bound: reading the values": quiet(lambda: [*map(read, snapshot._variables)]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depth", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    thunks = pieces(args.depth)
    calls = {name: max(5, round(BLOCK_S / (block(fn, 5) / 1e6))) for name, fn in thunks.items()}
    times: dict[str, list[float]] = {name: [] for name in thunks}
    for _ in range(args.rounds):
        for name, fn in thunks.items():
            times[name].append(block(fn, calls[name]))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    table = Table(title=f"fast call of the no-op step, depth {args.depth}: µs (median, min-max)")
    for column in ("piece", "µs", "spread"):
        table.add_column(column, justify="left" if column == "piece" else "right")
    for name, ts in times.items():
        table.add_row(name, f"{median[name]:,.1f}", f"{min(ts):,.1f}-{max(ts):,.1f}")
    console = Console()
    console.print(table)
    # The cheaper of the two ways to compare the values' identities.
    values = min(v for name, v in median.items() if name.startswith("bound: values"))
    bound = values + sum(
        v for name, v in median.items() if name.startswith("bound:") and "values'" not in name
    )
    dispatch = median["jax dispatch"]  # what floor (b) pays too: jax's dispatch of the arrays
    console.print(
        f"The checks cannot cost less than {bound:,.1f} µs in pure Python: a fast call costs at "
        f"least jax's dispatch ({dispatch:,.1f} µs) plus that, {1 + bound / dispatch:.2f}x the "
        f"dispatch. Whole call: {median['whole call'] / dispatch:.2f}x the dispatch."
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"pieces-depth{args.depth}.json"
    report = {"depth": args.depth, "rounds": args.rounds, "us": times, "median_us": median}
    path.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
