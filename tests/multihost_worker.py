"""The 2-process run of tests/test_multihost.py: the package on a mesh spanning processes.

Every process runs this file; tests/test_multihost.py starts it with

    python -m nnx_sharding.launch -n 2 --devices-per-process 4 \
        tests/multihost_worker.py OUT [--crash]

and compares what each process writes to ``OUT/process_<i>.json`` with the same work
done by one process on 8 devices. Each process only ever reads its own shards: the
sharded work runs under ``jax.transfer_guard_device_to_host("disallow")``, so an
accidental gather of remote state to this host fails the run. Only replicated
scalars are read (after the guard). With ``--crash``, process 1 exits with status 7
just before the training, leaving process 0 to wait for it in a collective.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import nnx_sharding

nnx_sharding.initialize_distributed()  # before anything starts a jax backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nnx_sharding import recipes  # noqa: E402

DIN, HIDDEN, DOUT, BATCH, STEPS = 16, 64, 8, 32, 6


def global_array(sharding: NamedSharding, full: np.ndarray) -> jax.Array:
    """The global array whose value is ``full``, from this process's rows only."""
    rows = [index[0] for index in sharding.addressable_devices_indices_map(full.shape).values()]
    start = min(r.start or 0 for r in rows)
    stop = max(full.shape[0] if r.stop is None else r.stop for r in rows)
    return jax.make_array_from_process_local_data(sharding, full[start:stop], full.shape)


def max_local_diff(array: jax.Array, expected: np.ndarray) -> float:
    """The largest difference between this process's shards and ``expected`` there."""
    shards = array.addressable_shards
    return float(max(np.max(np.abs(np.asarray(s.data) - expected[s.index])) for s in shards))


def variables_report(model: nnx.Module, reference: nnx.Module) -> dict[str, Any]:
    """Per Variable: global shape, spec, this process's shard shapes, value check."""
    expected = dict(nnx.to_flat_state(nnx.state(reference)))
    report = {}
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        value = variable.get_value()
        report["/".join(map(str, path))] = {
            "shape": list(value.shape),
            "spec": str(value.sharding.spec),
            "fully_addressable": value.is_fully_addressable,
            "local_shards": sorted({tuple(s.data.shape) for s in value.addressable_shards}),
            "max_diff": max_local_diff(value, np.asarray(expected[path].get_value())),
        }
    return report


def train(step: recipes.Step, mesh: jax.sharding.Mesh, batch_spec: P) -> list[float]:
    """STEPS adam steps of the recipe, each process feeding its own rows of the batch."""
    model = recipes.MLP(DIN, HIDDEN, DOUT, rngs=nnx.Rngs(0))
    optimizer = recipes.make_optimizer(model)
    sharding = NamedSharding(mesh, batch_spec)
    losses = []
    batches = recipes.make_batches(STEPS, BATCH, DIN, DOUT)
    for x, y in batches:
        inputs = [global_array(sharding, np.asarray(a)) for a in (x, y)]
        with jax.transfer_guard_device_to_host("disallow"):
            losses.append(step(model, optimizer, *inputs))
    return [float(loss) for loss in losses]  # replicated scalars: read locally


class Stats(nnx.Module):
    def __init__(self) -> None:
        self.total = nnx.BatchStat(jnp.zeros(()))
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))


def main(out: Path, crash: bool) -> None:
    me = jax.process_index()
    result: dict[str, Any] = {
        "process_index": me,
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
    }
    mesh = recipes.make_mesh({"data": 2, "model": 4})
    rules = recipes.on_mesh(mesh, recipes.megatron_sharding())
    reference = recipes.MLP(DIN, HIDDEN, DOUT, rngs=nnx.Rngs(0))  # on this process only
    x_full = np.asarray(recipes.make_batches(1, BATCH, DIN, DOUT)[0][0])
    x = global_array(NamedSharding(mesh, P("data")), x_full)
    seen: list[Any] = []

    with jax.transfer_guard_device_to_host("disallow"):
        # jit + StateSharding: the model is created sharded; no process holds all of it.
        model = nnx_sharding.jit(
            lambda: recipes.MLP(DIN, HIDDEN, DOUT, rngs=nnx.Rngs(0)), out_shardings=rules
        )()
        forward = nnx_sharding.jit(lambda m, x: m(x), out_shardings=NamedSharding(mesh, P("data")))
        y = forward(model, x)

        # shard_map: statistics of the global batch, updated in place.
        @nnx_sharding.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
        def accumulate(stats: Stats, x: jax.Array) -> None:
            stats.total[...] += jax.lax.psum(jnp.sum(x), "data")
            stats.calls[...] += 1

        stats = Stats()
        for _ in range(2):
            accumulate(stats, x)

        # inspect_sharding inside jit: reported at compile time, on every process.
        @nnx_sharding.jit(in_shardings=(rules,))
        def inspect(m: recipes.MLP) -> None:
            nnx_sharding.inspect_sharding(m, callback=seen.append)

        inspect(model)
        table = nnx_sharding.sharding_table(model)

    result["variables"] = variables_report(model, reference)
    result["forward_max_diff"] = max_local_diff(y, np.asarray(reference(jnp.asarray(x_full))))
    result["forward_local_shards"] = sorted({tuple(s.data.shape) for s in y.addressable_shards})
    result["stats"] = {"total": float(stats.total[...]), "calls": int(stats.calls[...])}
    result["expected_total"] = float(2 * x_full.sum())
    result["inspected"] = (
        {
            "/".join(map(str, path)): str(sharding.get_value().spec)
            for path, sharding in nnx.to_flat_state(seen[0])
        }
        if seen
        else None
    )
    result["inspect_calls"] = len(seen)
    result["table"] = [
        {"path": r.path, "shape": list(r.shape), "per_device": r.bytes_per_device,
         "total": r.total_bytes, "devices": list(r.devices)}
        for r in table.rows
    ]  # fmt: skip
    result["table_per_device"] = {str(k): v for k, v in table.per_device.items()}
    result["table_text"] = table.to_text()

    if crash and me == 1:
        os._exit(7)
    tp_mesh, dp_mesh = recipes.make_mesh({"model": 8}), recipes.make_mesh({"data": 8})
    result["losses"] = {
        "tensor_parallel": train(recipes.tensor_parallel_step(tp_mesh), tp_mesh, P()),
        "data_parallel": train(recipes.data_parallel_step(dp_mesh), dp_mesh, P("data")),
        "data_tensor_parallel": train(recipes.data_tensor_parallel_step(mesh), mesh, P("data")),
    }
    (out / f"process_{me}.json").write_text(json.dumps(result, indent=1))
    print(f"process {me}: wrote {out / f'process_{me}.json'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), crash="--crash" in sys.argv[2:])
