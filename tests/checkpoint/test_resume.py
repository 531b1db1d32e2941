"""Issue 17, item 4: training resumes exactly from a checkpoint, in a fresh process.

This process trains `resume_worker.Net` (dropout and input noise: its `nnx.Rngs` counts
advance every step) with adam for 10 steps, sharded over 8 devices, saves model and
optimizer with `nnx_sharding.checkpoint.Manager`, and trains 10 more. A fresh process
(`resume_worker.py`) restores step 10 into an abstract target and trains the same 10
steps: its parameters, adam's state (mu, nu, count), the optimizer's step and every Rngs
key and count must equal this process's, bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from resume_worker import flat_state, make, train

from nnx_sharding import checkpoint

WORKER = Path(__file__).resolve().parent / "resume_worker.py"
STEPS = 10


def fresh_process(*args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    run = subprocess.run(
        [sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """(state at step 10, losses and state after 20 steps here, the fresh process's npz)."""
    tmp = tmp_path_factory.mktemp("resume")
    model, optimizer = make()
    losses = train(model, optimizer, 0, STEPS)
    with checkpoint.Manager(tmp / "ckpt") as manager:
        manager.save(STEPS, (model, optimizer))
        manager.wait_until_finished()
        at_10 = flat_state((model, optimizer))
        losses += train(model, optimizer, STEPS, STEPS)
    fresh_process(str(tmp / "ckpt"), str(STEPS), str(STEPS), str(tmp / "fresh.npz"))
    with np.load(tmp / "fresh.npz") as npz:
        fresh = {name: npz[name] for name in npz.files}
    return at_10, losses, flat_state((model, optimizer)), fresh


def part(fresh: dict[str, np.ndarray], which: str) -> dict[str, np.ndarray]:
    return {k.split("|", 1)[1]: v for k, v in fresh.items() if k.startswith(f"{which}|")}


def assert_same_state(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(expected)  # the same Variables, of the same types
    for path, value in expected.items():
        assert got[path].dtype == value.dtype, path
        np.testing.assert_array_equal(got[path], value, err_msg=path)


def test_the_state_covers_params_adam_step_and_rngs(runs):
    at_10, _, _, _ = runs
    kinds = {path.rsplit(":", 1)[1] for path in at_10}
    assert {"Param", "OptVariable", "OptArray", "OptState", "RngKey", "RngCount"} <= kinds
    counts = {p: int(v) for p, v in at_10.items() if p.endswith(":RngCount")}
    assert counts == {"0/drop/rngs/count:RngCount": 10, "0/rngs/noise/count:RngCount": 10}
    assert int(at_10["1/step:OptState"]) == 10 and int(at_10["1/opt_state/0/count:OptArray"]) == 10


def test_the_fresh_process_restores_step_10_exactly(runs):
    at_10, _, _, fresh = runs
    assert_same_state(part(fresh, "restored"), at_10)
    specs = json.loads(str(fresh["specs"]))  # the layout asked for, not one device
    assert specs["up/kernel"] == "P(None, 'model')" and specs["down/kernel"] == "P('model', None)"


def test_training_resumes_exactly(runs):
    _, losses, after_20, fresh = runs
    np.testing.assert_array_equal(fresh["losses"], np.asarray(losses[STEPS:]))
    assert_same_state(part(fresh, "trained"), after_20)
    counts = {p: int(v) for p, v in after_20.items() if p.endswith(":RngCount")}
    assert set(counts.values()) == {2 * STEPS}
