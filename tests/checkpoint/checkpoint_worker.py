"""The 2-process run of tests/checkpoint/test_multiprocess.py (issue 17, item 3).

Every process runs this file; the test starts it with

    python -m nnx_sharding.launch -n 2 --devices-per-process 4 \
        tests/checkpoint/checkpoint_worker.py OUT SAVE_DIR RESTORE_DIR

Each process creates ``build(SAVED_SEED)`` sharded by `layout` across the 8 devices of
both processes (no process ever holds all of it) and saves it to SAVE_DIR with
`nnx_sharding.checkpoint.save`, together with the other process. Then both restore the
checkpoint that one process of 8 devices (the test) saved to RESTORE_DIR, into an
abstract target in the same layout, and each checks its own shards against
``build(RESTORED_SEED)`` made eagerly here; ``OUT/process_<i>.json`` gets the report.
The test imports `build` and `layout` from here; only running it as a script starts
``jax.distributed``.
"""

from __future__ import annotations

import functools
import json
import operator
import sys
from pathlib import Path
from typing import Any

import nnx_sharding

if __name__ == "__main__":
    nnx_sharding.initialize_distributed()  # before anything starts a jax backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nnx_sharding import recipes  # noqa: E402

DIN, HIDDEN, DOUT = 16, 64, 8
SAVED_SEED, RESTORED_SEED = 1, 2  # what the 2 processes save; what the 1 process saves


def build(seed: int) -> tuple[recipes.MLP, nnx.Optimizer[recipes.MLP]]:
    """An MLP and its adam optimizer, with distinct values in every Variable: the biases
    ``seed * arange / 8``, adam's ``mu`` and ``nu`` ``param / 2`` and ``param ** 2`` (all
    exact in float32, whatever the layout), its count and the step 3."""
    model = recipes.MLP(DIN, HIDDEN, DOUT, rngs=nnx.Rngs(seed))
    optimizer = recipes.make_optimizer(model)
    adam = optimizer.opt_state[0]
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "bias":
            param[...] = seed * jnp.arange(param.shape[0], dtype=jnp.float32) / 8
        value = param[...]
        functools.reduce(operator.getitem, path, adam.mu)[...] = value * 0.5
        functools.reduce(operator.getitem, path, adam.nu)[...] = value * value
    adam.count[...] = 3
    optimizer.step[...] = 3
    return model, optimizer


def layout() -> nnx_sharding.StateSharding:
    """Megatron over a ``model`` axis of all 8 devices: the kernels, ``up``'s bias and
    their moments split across both processes; the rest replicated."""
    return recipes.on_mesh(recipes.make_mesh({"model": 8}), recipes.megatron_sharding())


def local_report(tree: Any, expected: Any) -> dict[str, Any]:
    """Per Variable: global shape, spec, this process's shard shapes, value check."""
    want = dict(nnx.to_flat_state(nnx.state(expected)))
    report = {}
    for path, variable in nnx.to_flat_state(nnx.state(tree)):
        value = variable.get_value()
        full = np.asarray(want[path].get_value())
        shards = value.addressable_shards
        report["/".join(map(str, path))] = {
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "spec": spec_text(value.sharding.spec),
            "fully_addressable": value.is_fully_addressable,
            "local_shards": sorted({tuple(s.data.shape) for s in shards}),
            "local_devices": len(shards),
            "equal": all(np.array_equal(np.asarray(s.data), full[s.index]) for s in shards),
            "dtype_equal": str(value.dtype) == str(full.dtype),
        }
    return report


def spec_text(spec: P) -> str:
    """``spec`` without trailing Nones (``P('model', None)`` is ``P('model',)``)."""
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return str(P(*parts))


def main(out: Path, save_dir: Path, restore_dir: Path) -> None:
    from nnx_sharding import checkpoint

    me = jax.process_index()
    rules = layout()
    with jax.transfer_guard_device_to_host("disallow"):  # created sharded, never gathered
        tree = nnx_sharding.jit(lambda: build(SAVED_SEED), out_shardings=rules)()
    saved = local_report(tree, build(SAVED_SEED))
    checkpoint.save(save_dir, tree)

    target = nnx.eval_shape(lambda: build(RESTORED_SEED))
    restored = checkpoint.restore(restore_dir, target, shardings=rules)
    result = {
        "process_index": me,
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "saved": saved,
        "restored": local_report(restored, build(RESTORED_SEED)),
    }
    (out / f"process_{me}.json").write_text(json.dumps(result, indent=1))
    print(f"process {me}: wrote {out / f'process_{me}.json'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
