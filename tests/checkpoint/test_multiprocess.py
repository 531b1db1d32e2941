"""Issue 17, item 3: a checkpoint saved by 2 processes x 4 devices restores on 1 process
x 8 devices, and the reverse, with equal values.

`checkpoint_worker.py` runs under ``python -m nnx_sharding.launch`` (gloo collectives on
127.0.0.1). Before launching it, this process (8 devices) saves ``build(RESTORED_SEED)``
sharded over its 8 devices; the two processes then save ``build(SAVED_SEED)`` sharded
across all 8 devices of both, together, and restore this process's checkpoint into the
same layout, each checking its own shards. Here the 2-process checkpoint is restored
into the same layout, into another mesh and onto one device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from checkpoint_worker import RESTORED_SEED, SAVED_SEED, build, layout
from flax import nnx

import nnx_sharding
from nnx_sharding import checkpoint, recipes

WORKER = Path(__file__).resolve().parent / "checkpoint_worker.py"
EXPECTED_SPECS = {  # Megatron on ('model': 8): kernels, up's bias and their moments split
    "0/up/kernel": ([16, 64], "P(None, 'model')", [[16, 8]]),
    "0/up/bias": ([64], "P('model',)", [[8]]),
    "0/down/kernel": ([64, 8], "P('model',)", [[8, 8]]),
    "0/down/bias": ([8], "P()", [[8]]),
    "1/opt_state/0/mu/up/kernel": ([16, 64], "P(None, 'model')", [[16, 8]]),
    "1/opt_state/0/nu/down/kernel": ([64, 8], "P('model',)", [[8, 8]]),
    "1/opt_state/0/count": ([], "P()", [[]]),
    "1/step": ([], "P()", [[]]),
}


def launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "nnx_sharding.launch", "-n", "2", "--devices-per-process",
               "4", "--timeout", str(int(timeout)), *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout + 60)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The checkpoint the 2 processes saved, and what each process reported."""
    tmp = tmp_path_factory.mktemp("multiprocess")
    here = nnx_sharding.jit(lambda: build(RESTORED_SEED), out_shardings=layout())()
    checkpoint.save(tmp / "from_1_process", here)
    done = launch(str(WORKER), str(tmp), str(tmp / "from_2_processes"), str(tmp / "from_1_process"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp / "from_2_processes", [
        json.loads((tmp / f"process_{i}.json").read_text()) for i in range(2)
    ]


def flat(tree: Any) -> dict[str, Any]:
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(tree))}


def assert_equal_trees(got: Any, expected: Any) -> None:
    got, expected = flat(got), flat(expected)
    assert sorted(got) == sorted(expected)
    for path, value in expected.items():
        assert got[path].dtype == value.dtype, path
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(value), err_msg=path)


def test_the_processes_saved_a_model_split_across_them(run):
    _, processes = run
    for i, p in enumerate(processes):
        assert (p["process_index"], p["process_count"], p["device_count"]) == (i, 2, 8)
        for path, (shape, spec, shards) in EXPECTED_SPECS.items():
            v = p["saved"][path]
            assert (v["shape"], v["spec"], v["local_shards"]) == (shape, spec, shards), path
            assert v["local_devices"] == 4 and not v["fully_addressable"], path
        assert all(v["equal"] for v in p["saved"].values())


@pytest.mark.parametrize("axes", [{"model": 8}, {"data": 2, "model": 4}])
def test_one_process_restores_what_two_saved(run, axes):
    directory, _ = run
    rules = recipes.on_mesh(recipes.make_mesh(axes), recipes.megatron_sharding())
    abstract = nnx.eval_shape(lambda: build(SAVED_SEED))
    restored = checkpoint.restore(directory, abstract, shardings=rules)
    assert_equal_trees(restored, build(SAVED_SEED))
    kernel = restored[0].up.kernel[...]
    assert kernel.sharding.spec == rules.sharding_for(("up", "kernel"), None).spec
    assert len(kernel.sharding.device_set) == 8


def test_one_process_restores_what_two_saved_onto_one_device(run):
    directory, _ = run
    restored = checkpoint.restore(directory, nnx.eval_shape(lambda: build(SAVED_SEED)))
    assert_equal_trees(restored, build(SAVED_SEED))
    assert all(len(v.sharding.device_set) == 1 for v in flat(restored).values())


def test_two_processes_restore_what_one_saved(run):
    _, processes = run
    for p in processes:
        assert sorted(p["restored"]) == sorted(p["saved"])
        for path, (shape, spec, shards) in EXPECTED_SPECS.items():
            v = p["restored"][path]
            assert (v["shape"], v["spec"], v["local_shards"]) == (shape, spec, shards), path
            assert v["local_devices"] == 4 and not v["fully_addressable"], path
        unequal = [path for path, v in p["restored"].items() if not v["equal"]]
        assert unequal == [], unequal
        assert all(v["dtype_equal"] for v in p["restored"].values())
