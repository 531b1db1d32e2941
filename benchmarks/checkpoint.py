"""Restoring a sharded checkpoint: `nnx_sharding.checkpoint.restore` against orbax's own.

Issue 17, item 2. A model of --size-gib GiB of float32 Variables (a stack of `nnx.Linear`,
width --width) is created sharded 8 ways on a ``('model',)`` mesh of 8 CPU devices and
saved once with `nnx_sharding.checkpoint.save`. Then each restore runs in a fresh process
of its own, so that its peak memory is its own:

  ours      checkpoint.restore(dir, nnx.eval_shape(lambda: Model(...)), shardings=StateSharding)
  orbax     ocp.StandardCheckpointer().restore(<the array item of the same checkpoint>,
            a hand-built tree of jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding))
  orbax, no checksums     (with --unchecked) orbax restoring a second copy of the
            checkpoint saved without the crc32c codec on its chunks (orbax's own zarr v3
            chunks): what verifying the checksums costs, orbax / this
  orbax, N GB in flight   (with --orbax-limit-gb N) the same with
            StandardCheckpointer(restore_concurrent_gb=N): orbax reads every shard into a
            host buffer before copying it onto its device, all at once unless this bounds
            the bytes in flight; a reference for the peak memory, not in the ratio

Every chunk `nnx_sharding.checkpoint.save` writes carries its CRC-32C (tensorstore's
``crc32c`` codec), verified by whoever reads it: ours and orbax read the same
checksummed files, so the ratio ours / orbax includes the verification on both sides.
Both restore into the same layout: kernels ``P(None, 'model')``, biases ``P('model')``.
Time: the wall time of the restore call and `jax.block_until_ready` on what it returns
(the abstract target is made before the clock starts, for both). Memory: the process's
peak resident set (``ru_maxrss``) after the restore, raw and net of the same figure taken
after importing jax, flax and orbax, creating the mesh and the target; the net peak is
reported as a multiple of the model's size (the restored arrays themselves are 1.0×:
CPU devices live in the process's memory). The rounds are interleaved, their order
alternating (ours, orbax; orbax, ours; ...), so that a change in machine load hits both;
the time ratio ours / orbax is taken within each round and reported as the median of
the rounds with their min and max (--quick's model is too small for its memory figures to
mean anything). The files are read from the page cache alike (the
checkpoint was just written); the machine's load average is recorded before and after.

Run:  python benchmarks/checkpoint.py [--quick] [--size-gib 1] [--rounds 7] [--tag cpu]
                                      [--orbax-limit-gb 0.1] [--unchecked]
  or  nox -s bench_checkpoint
Writes checkpoint[-TAG].json to benchmarks/results/ (or --out). --dir keeps the
checkpoint (default: a temporary directory, removed at the end).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEVICES = 8
GIB = 2**30
TIME_LIMIT = 1.2  # issue 17: ours / orbax restore time
MEMORY_LIMIT = 1.3  # issue 17: our net peak memory / the model's size


# ----------------------------------------------------------------------------- the model
# Everything from here to `main` runs in the worker processes, which import jax.
def start_jax() -> None:
    """8 CPU devices, configured before anything starts a jax backend."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", DEVICES)
    if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
        sys.path.append(str(REPO))


def make_mesh() -> Any:
    """A ``('model',)`` mesh of the 8 devices (an Auto axis, as the recipes')."""
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh((DEVICES,), ("model",), axis_types=(AxisType.Auto,))


def model_class() -> type:
    from flax import nnx

    class Model(nnx.Module):
        """``layers`` Linear layers of ``width`` -> ``width``."""

        def __init__(self, width: int, layers: int, *, rngs: nnx.Rngs):
            self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(layers)])

    return Model


def layout(mesh: Any) -> Any:
    """The StateSharding of the model: kernels by columns, biases split alike."""
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import nnx_sharding

    return nnx_sharding.StateSharding(
        {
            nnx.PathContains("kernel"): NamedSharding(mesh, P(None, "model")),
            ...: NamedSharding(mesh, P("model")),
        }
    )


def abstract_model(width: int, layers: int) -> Any:
    from flax import nnx

    return nnx.eval_shape(lambda: model_class()(width, layers, rngs=nnx.Rngs(0)))


def orbax_target(directory: Path, width: int, layers: int, mesh: Any) -> tuple[Path, Any]:
    """The array item of our checkpoint in ``directory`` and the hand-built tree of
    sharded ``jax.ShapeDtypeStruct`` that orbax's StandardCheckpointer restores it into:
    the layout `nnx_sharding.checkpoint` writes (see `ITEM`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    kernel = jax.ShapeDtypeStruct(
        (width, width), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))
    )
    bias = jax.ShapeDtypeStruct((width,), jnp.float32, sharding=NamedSharding(mesh, P("model")))
    layer = {"kernel": kernel, "bias": bias}
    return directory / ITEM, {"layers": {str(i): dict(layer) for i in range(layers)}}


ITEM = "state"
"""Where `nnx_sharding.checkpoint.save` puts the arrays, under its directory."""


# ----------------------------------------------------------------------------- the workers
def worker_save(directory: Path, width: int, layers: int, plain: bool = False) -> dict[str, Any]:
    """Creates the model sharded (never whole on one device) and saves it once;
    ``plain``: without the crc32c codec on the chunks (orbax's own zarr v3 layout)."""
    import jax
    from flax import nnx

    import nnx_sharding
    from nnx_sharding import checkpoint
    from nnx_sharding.checkpoint import _integrity

    if plain:  # orbax's metadata builder as it was before `_integrity.install`
        build = _integrity.tensorstore_utils._build_zarr3_metadata
        _integrity.tensorstore_utils._build_zarr3_metadata = build.__wrapped__

    mesh = make_mesh()
    rules = layout(mesh)
    Model = model_class()
    t0 = time.perf_counter()
    model = nnx_sharding.jit(lambda: Model(width, layers, rngs=nnx.Rngs(0)), out_shardings=rules)()
    jax.block_until_ready(nnx.state(model))
    created = time.perf_counter() - t0
    t0 = time.perf_counter()
    checkpoint.save(directory, model, force=True)
    saved = time.perf_counter() - t0
    nbytes = sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(model)))
    files = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    return {"create_s": created, "save_s": saved, "model_bytes": nbytes, "files_bytes": files}


def worker_restore(
    which: str, directory: Path, width: int, layers: int, limit_gb: float | None
) -> dict[str, Any]:
    """One restore, ours or orbax's, timed; the process's peak memory before and after."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from nnx_sharding import checkpoint

    mesh = make_mesh()
    if which == "ours":
        target, rules = abstract_model(width, layers), layout(mesh)
        restore = lambda: checkpoint.restore(directory, target, shardings=rules)
    else:
        item, tree = orbax_target(directory, width, layers, mesh)
        limit = {} if limit_gb is None else {"restore_concurrent_gb": limit_gb}
        checkpointer = ocp.StandardCheckpointer(**limit)
        restore = lambda: checkpointer.restore(item, tree)
    before = peak_rss()
    t0 = time.perf_counter()
    restored = jax.block_until_ready(restore())
    seconds = time.perf_counter() - t0
    after = peak_rss()
    if which == "ours":
        arrays = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(restored))]
    else:
        arrays = jax.tree.leaves(restored)
    check = arrays[0]  # the layout asked for, on all 8 devices
    assert len(check.sharding.device_set) == DEVICES, check.sharding
    return {
        "seconds": seconds,
        "rss_before": before,
        "rss_after": after,
        "restored_bytes": sum(a.nbytes for a in arrays),
    }


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("which", choices=["save", "ours", "orbax"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("width", type=int)
    parser.add_argument("layers", type=int)
    parser.add_argument("--limit-gb", type=float)
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args(argv)
    start_jax()
    if args.which == "save":
        result = worker_save(args.directory, args.width, args.layers, args.plain)
    else:
        result = worker_restore(args.which, args.directory, args.width, args.layers, args.limit_gb)
    print("RESULT " + json.dumps(result))


# ----------------------------------------------------------------------------- the driver
def in_subprocess(
    which: str,
    directory: Path,
    width: int,
    layers: int,
    limit_gb: float | None = None,
    plain: bool = False,
) -> dict[str, Any]:
    """Runs one worker in a fresh process; its RESULT."""
    command = [sys.executable, __file__, "--worker", which, str(directory), str(width), str(layers)]
    if limit_gb is not None:
        command += ["--limit-gb", str(limit_gb)]
    if plain:
        command += ["--plain"]
    run = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        sys.exit(f"the {which} worker failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def machine_info() -> dict[str, Any]:
    versions = {}
    for name in ("jax", "flax", "orbax-checkpoint", "nnx_sharding"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return versions | {"cpu_count": os.cpu_count(), "memory_gib": round(pages / GIB, 1)}


def shape_for(size_gib: float, width: int) -> int:
    """The number of layers of ``width`` whose float32 Variables make ``size_gib`` GiB."""
    per_layer = 4 * (width * width + width)
    return max(1, math.ceil(size_gib * GIB / per_layer))


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    size = report["model_bytes"]
    table = Table(
        title=f"restore of {size / GIB:.3f} GiB, 8-way sharded ({report['rounds']} rounds)"
    )
    for column in ("", "time (median, min–max)", "peak RSS raw", "net peak", "net / model size"):
        table.add_column(column, justify="right" if column else "left")
    for which in report["variants"]:
        r = report[which]
        t, net = r["seconds"], r["net_peak_bytes"]
        table.add_row(
            which,
            f"{t['median']:.2f} s ({t['min']:.2f}–{t['max']:.2f})",
            f"{r['rss_after_bytes']['median'] / GIB:.2f} GiB",
            f"{net['median'] / GIB:.2f} GiB ({net['min'] / GIB:.2f}–{net['max'] / GIB:.2f})",
            f"{net['median'] / size:.2f}× (max {net['max'] / size:.2f}×)",
        )
    ratio = report["time_ratio"]
    table.add_row(
        "ours / orbax",
        f"{ratio['median']:.2f}× ({ratio['min']:.2f}–{ratio['max']:.2f})",
        "",
        "",
        f"{report['memory_ratio']['median']:.2f}× ours",
    )
    if "checksum_cost_ratio" in report:
        cost = report["checksum_cost_ratio"]
        table.add_row(
            "verifying (orbax / no checksums)",
            f"{cost['median']:.2f}× ({cost['min']:.2f}–{cost['max']:.2f})",
            "",
            "",
            "",
        )
    console = Console(width=max(Console().width, 120))
    console.print(table)
    verdicts = report["verdicts"]
    console.print(
        f"time ≤ {TIME_LIMIT}× orbax: {'yes' if verdicts['time'] else 'NO'}; "
        f"net peak < {MEMORY_LIMIT}× the model: {'yes' if verdicts['memory'] else 'NO'}; "
        f"load average {report['load_before']} -> {report['load_after']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gib", type=float, default=1.0, help="model size (1 GiB)")
    parser.add_argument("--width", type=int, default=4096, help="layer width (4096)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (7)")
    parser.add_argument("--quick", action="store_true", help="a 16 MiB model and 2 rounds")
    parser.add_argument("--dir", type=Path, help="where to save (default: a temporary dir)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--tag", default="", help="suffix for the output file, e.g. cpu")
    parser.add_argument(
        "--orbax-limit-gb",
        type=float,
        help="also time orbax with restore_concurrent_gb=N (bytes in flight, GB)",
    )
    parser.add_argument(
        "--unchecked",
        action="store_true",
        help="also time orbax on a copy saved without checksums (what verifying costs)",
    )
    args = parser.parse_args()
    if args.quick:
        args.size_gib, args.width, args.rounds = 1 / 64, 512, 2
    layers = shape_for(args.size_gib, args.width)
    machine = machine_info()
    print(machine)
    scratch = None if args.dir else Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    directory = (args.dir or scratch / "checkpoint").resolve()  # type: ignore[operator]
    try:
        load_before = [round(x, 2) for x in os.getloadavg()]
        saved = in_subprocess("save", directory, args.width, layers)
        print(f"saved {saved['model_bytes'] / GIB:.3f} GiB ({layers} x Linear({args.width}, "
              f"{args.width})) in {saved['save_s']:.1f} s to {directory}")  # fmt: skip
        variants = {"ours": ("ours", None, directory), "orbax": ("orbax", None, directory)}
        if args.unchecked:
            plain = directory.parent / (directory.name + "-no-checksums")
            in_subprocess("save", plain, args.width, layers, plain=True)
            variants["orbax, no checksums"] = ("orbax", None, plain)
        if args.orbax_limit_gb is not None:
            variants[f"orbax, {args.orbax_limit_gb:g} GB in flight"] = (
                "orbax",
                args.orbax_limit_gb,
                directory,
            )
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        ratios, verify = [], []
        for i in range(args.rounds):
            order = list(variants) if i % 2 == 0 else list(reversed(variants))
            for name in order:
                which, limit, where = variants[name]
                runs[name].append(in_subprocess(which, where, args.width, layers, limit))
            ours, orbax = runs["ours"][-1]["seconds"], runs["orbax"][-1]["seconds"]
            ratios.append(ours / orbax)
            if args.unchecked:
                verify.append(orbax / runs["orbax, no checksums"][-1]["seconds"])
            times = ", ".join(f"{name} {runs[name][-1]['seconds']:.2f} s" for name in variants)
            print(f"round {i + 1}: {times}; ours / orbax {ratios[-1]:.2f}")
        load_after = [round(x, 2) for x in os.getloadavg()]
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    size = saved["model_bytes"]
    report: dict[str, Any] = {
        "machine": machine,
        "settings": dict(
            size_gib=args.size_gib,
            width=args.width,
            layers=layers,
            rounds=args.rounds,
            quick=args.quick,
            orbax_limit_gb=args.orbax_limit_gb,
        ),
        "model_bytes": size,
        "save": saved,
        "rounds": args.rounds,
        "variants": list(runs),
        "load_before": load_before,
        "load_after": load_after,
    }
    for which, results in runs.items():
        net = [r["rss_after"] - r["rss_before"] for r in results]
        report[which] = {
            "seconds": summary([r["seconds"] for r in results]),
            "rss_before_bytes": summary([r["rss_before"] for r in results]),
            "rss_after_bytes": summary([r["rss_after"] for r in results]),
            "net_peak_bytes": summary(net),
            "net_peak_over_model": summary([n / size for n in net]),
            "runs": results,
        }
    report["time_ratio"] = summary(ratios)
    if verify:  # orbax on checksummed files / orbax on the same without checksums
        report["checksum_cost_ratio"] = summary(verify)
    report["memory_ratio"] = report["ours"]["net_peak_over_model"]
    report["verdicts"] = {
        "time": report["time_ratio"]["median"] <= TIME_LIMIT,
        "memory": report["memory_ratio"]["max"] < MEMORY_LIMIT,
    }
    print_table(report)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("checkpoint" + (f"-{args.tag}" if args.tag else "") + ".json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker_main(sys.argv[2:])
    else:
        main()
