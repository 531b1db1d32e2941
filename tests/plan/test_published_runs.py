"""The cost model against published, measured runs (docs/planning/predictions.md,
"Predictions against published runs"): each run, planned exactly as published (its one
mesh, remat policy, dtypes, batch, compiler flags) and compiled for its target with no
device, fits as it ran, is predicted within 15 % of its published step time, and its
range holds the published time.

The 7B-32B steps are compiled by ``docs/scripts/calibration.py``, which rebuilds the
runs, each in a process of its own (a run's published XLA flags are read when jax
starts), where the target's compiler is installed. Their layers are scanned, so a
compile takes the time of one layer's program: the three took 69 s together on two
idle cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nnx_sharding.plan._hardware.devices import has_gpu_compiler, has_tpu_compiler

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "scripts" / "calibration.py"
GPU = pytest.mark.skipif(not has_gpu_compiler(), reason="needs nnx_sharding[gpu]")
TPU = pytest.mark.skipif(not has_tpu_compiler(), reason="needs nnx_sharding[tpu]")
RUNS = [
    pytest.param("llama2-7b", "gpu", marks=GPU),  # 8 H100s, FSDP: sets the GPUs' matmuls
    pytest.param("maxtext-32b", "tpu", marks=TPU),  # v5p-128, FSDP x TP: the TPUs'
    pytest.param("maxtext-16b", "tpu", marks=TPU),  # v5e-256, FSDP: held out, sets nothing
]


@pytest.mark.parametrize(("run", "compiler"), RUNS)
def test_a_published_run_is_predicted_within_15_percent(run, compiler, tmp_path):
    out = tmp_path / "result.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "LIBTPU_"))}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), run, "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["compiler"] == compiler
    assert row["time"] is not None, row["reason"]
    assert row["reason"] is None, row  # it fits, as it ran
    assert abs(row["ratio"] - 1) <= 0.15, row
    assert row["step_low"] <= row["published_step"] <= row["step_high"], row


MOE_SCRIPT = SCRIPT.parent / "moe_runs.py"


@TPU
def test_the_published_expert_parallel_run_is_predicted_within_25_percent(tmp_path):
    """Mixtral-8x22B on a v6e-256 as MaxText's recipe ran it (FSDP 64 × expert 4,
    capacity 1.25, the layer input and projections offloaded to the host), compiled by
    ``docs/scripts/moe_runs.py`` with the built-in decoder: it fits, as it ran, and its
    step is the published 24.706 s within 25 % (no constant was set from it). Compiled
    with the compiler's defaults: the recipe's flags make the compile several times
    slower (docs/planning/predictions.md gives both)."""
    out = tmp_path / "result.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "LIBTPU_"))}
    done = subprocess.run(
        [sys.executable, str(MOE_SCRIPT), "mixtral-8x22b", "--compiler-defaults", "--json",
         str(out)],
        env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["compiler"] == "tpu" and row["fits"], row
    assert abs(row["ratio"] - 1) <= 0.25, row
    assert row["all_to_all"] > 0  # the experts' dispatch and combine
