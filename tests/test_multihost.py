"""Issue 7: the package on a mesh of 2 processes x 4 CPU devices, against one process.

`multihost_worker.py` runs under ``python -m nnx_sharding.launch`` (gloo collectives on
127.0.0.1) and writes what each process saw; the tests here compare it with the same
work done in this process on its 8 devices, and with plain ``nnx.jit`` on one device.
The launcher's own behaviour (timeouts, signals, orphans) is tested in test_launch.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_sharding import recipes

HERE = Path(__file__).resolve().parent
WORKER = HERE / "multihost_worker.py"
DOCS_SCRIPT = HERE.parent / "docs" / "scripts" / "multihost_train.py"
DIN, HIDDEN, DOUT, BATCH, STEPS = 16, 64, 8, 32, 6  # as in multihost_worker.py


def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "nnx_sharding.launch", "-n", "2", "--devices-per-process",
               "4", "--timeout", str(int(timeout)), *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout + 60)


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("multihost")
    run = launch(str(WORKER), str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [json.loads((out / f"process_{i}.json").read_text()) for i in range(2)]


def single_process_losses(step: recipes.Step, mesh: jax.sharding.Mesh, spec: P) -> np.ndarray:
    model = recipes.MLP(DIN, HIDDEN, DOUT, rngs=nnx.Rngs(0))
    batches = recipes.make_batches(STEPS, BATCH, DIN, DOUT)
    optimizer = recipes.make_optimizer(model)
    return recipes.train(step, model, optimizer, batches, STEPS, sharding=NamedSharding(mesh, spec))


def test_each_process_sees_the_global_mesh(processes):
    for i, p in enumerate(processes):
        assert (p["process_index"], p["process_count"]) == (i, 2)
        assert (p["device_count"], p["local_device_count"]) == (8, 4)


def test_jit_with_state_sharding_creates_the_model_sharded_across_processes(processes):
    expected = {  # Megatron layout on ('data': 2, 'model': 4): shards within a process
        "up/kernel": ([16, 64], "P(None, 'model')", [[16, 16]]),
        "up/bias": ([64], "P('model',)", [[16]]),
        "down/kernel": ([64, 8], "P('model',)", [[16, 8]]),
        "down/bias": ([8], "P()", [[8]]),
    }
    for p in processes:
        got = {k: (v["shape"], v["spec"], v["local_shards"]) for k, v in p["variables"].items()}
        assert got == expected
        for path, v in p["variables"].items():
            assert not v["fully_addressable"], path  # each process holds its shards only
            assert v["max_diff"] == 0.0, path  # the same values as an eager model
        # the forward pass: 16 of the 32 rows per process, equal to the eager model's
        assert p["forward_local_shards"] == [[16, 8]]
        assert p["forward_max_diff"] < 1e-5


def test_shard_map_updates_state_with_a_cross_process_psum(processes):
    for p in processes:
        assert p["stats"]["calls"] == 2
        np.testing.assert_allclose(p["stats"]["total"], p["expected_total"], rtol=1e-5)


def test_inspect_sharding_reports_global_shardings_on_every_process(processes):
    for p in processes:
        assert p["inspect_calls"] == 1
        assert p["inspected"] == {k: v["spec"] for k, v in p["variables"].items()}


def test_sharding_table_reports_global_shapes_and_all_devices(processes):
    tables = [p["table"] for p in processes]
    assert tables[0] == tables[1]  # every process builds the same, global table
    rows = {r["path"]: r for r in tables[0]}
    assert rows[".up.kernel"]["shape"] == [16, 64]
    assert rows[".up.kernel"]["total"] == 16 * 64 * 4
    assert rows[".up.kernel"]["per_device"] == 16 * 16 * 4
    assert len(rows[".up.kernel"]["devices"]) == 8
    assert all(len(set(r["devices"])) == 8 for r in tables[0])
    per_device = processes[0]["table_per_device"]
    assert len(per_device) == 8 and len(set(per_device.values())) == 1
    assert "(16, 64)" in processes[0]["table_text"]


RECIPES = {  # name: (mesh axes, step factory, batch spec), as in multihost_worker.py
    "tensor_parallel": ({"model": 8}, recipes.tensor_parallel_step, P()),
    "data_parallel": ({"data": 8}, recipes.data_parallel_step, P("data")),
    "data_tensor_parallel": ({"data": 2, "model": 4}, recipes.data_tensor_parallel_step, P("data")),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_trains_as_on_one_process(processes, name):
    axes, make_step, spec = RECIPES[name]
    mesh = recipes.make_mesh(axes)
    expected = single_process_losses(make_step(mesh), mesh, spec)
    reference = single_process_losses(recipes.reference_step(), mesh, P())
    for p in processes:
        losses = np.asarray(p["losses"][name])
        np.testing.assert_allclose(losses, expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-6)
    assert processes[0]["losses"][name] == processes[1]["losses"][name]


def test_docs_script_runs_under_the_launcher():
    """docs/multihost.md's script: both processes print the single-device losses."""
    run = launch(str(DOCS_SCRIPT))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    mesh = recipes.make_mesh({"data": 2, "model": 4})
    reference = single_process_losses(recipes.reference_step(), mesh, P())
    for i in range(2):
        printed = [
            float(line.rsplit(" ", 1)[1])
            for line in run.stdout.splitlines()
            if line.startswith(f"[p{i}] process {i}: step")
        ]
        np.testing.assert_allclose(printed, reference, atol=2e-6)  # printed to 6 decimals
    assert "Sharding of Variables on mesh {'data': 2, 'model': 4}" in run.stdout


def test_a_dead_process_stops_the_run_with_a_clear_error(tmp_path):
    """Process 1 dies before training; process 0 would wait in its first collective."""
    start = time.monotonic()
    run = launch(str(WORKER), str(tmp_path), "--crash", timeout=240)
    elapsed = time.monotonic() - start
    assert run.returncode == 7, run.stderr[-3000:]
    assert "process 1 of 2 exited with code 7" in run.stderr
    assert elapsed < 120  # start-up and the work before the crash, then a bounded stop
    assert not (tmp_path / "process_0.json").exists()  # process 0 never finished
