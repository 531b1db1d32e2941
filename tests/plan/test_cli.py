"""``python -m nnx_sharding plan``: the table for the built-in decoder, one-line errors."""

from __future__ import annotations

import jax
import pytest

from nnx_sharding._cli.plan import main


def test_plans_the_decoder_and_prints_the_ranked_table(capsys, tmp_path):
    plot = tmp_path / "plan.png"
    argv = ["--config", "tiny", "--devices", "8", "--accelerator", "cpu"]
    status = main([*argv, "--layouts", "dp,fsdp,tp", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert status == 0
    assert "planning tiny (" in out and "for 8 devices of cpu" in out
    for label in ("data=8", "fsdp=8", "model=8"):
        assert label in out
    assert "best: Plan(" in out
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--memory-limit", "80parsecs"], "expected a size such as 80GiB"),
        (["--accelerator", "h1000"], "h100"),
        (["--layouts", "dp,ddp"], "unknown --layouts ddp; choose among dp,zero1,fsdp,tp"),
        (["--devices", "2048"], "the command plans up to 1024 devices"),
        (["--config", "huge"], "invalid choice: 'huge'"),
        (["--tokens", "1e12"], "--tokens and --days go together"),
    ],
)
def test_a_bad_option_is_one_line_and_status_2(option, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(option)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m nnx_sharding plan: error:") and message in err
    assert err.count("\n") == 1


def test_plan_is_a_command_of_the_main_job():
    """``python -m nnx_sharding plan --help``: the command's own options."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    run = subprocess.run(
        [sys.executable, "-m", "nnx_sharding", "plan", "--help"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    # the published models' names make the --config choices long: argparse wraps the usage
    assert run.stdout.startswith("usage: python -m nnx_sharding plan [-h]")
    options = ("--config {tiny,1b,1b-wide,llama2-7b,", "--devices", "--accelerator")
    for option in (*options, "--memory-limit", "--layouts", "--plot"):
        assert option in run.stdout


def test_a_device_count_the_process_lacks_reruns_the_command(capfd):
    """This process has 8 CPU devices: planning for 2 runs the command again with 2
    (the main job's one device-count mechanism)."""
    argv = ["--config", "tiny", "--devices", "2", "--accelerator", "cpu", "--layouts", "dp"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "for 2 devices of cpu" in out and "data=2" in out and "best: Plan(" in out


def test_the_default_batch_splits_over_every_device(capfd):
    """The tiny config's batch of 8 is raised to 16 for 16 devices: every data-parallel
    layout compiles (none is left with a batch that does not divide), layers scanned."""
    assert len(jax.devices()) == 8  # jax started: the command reruns itself with 16,
    # leaving this process's 8 devices to the other tests
    argv = ["--config", "tiny", "--devices", "16", "--accelerator", "cpu", "--layouts", "dp,fsdp"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "batch 16 × 64 tokens) for 16 devices" in out
    assert "shapes do not divide" not in out and "best: Plan(" in out


def test_tokens_and_days_size_the_run_in_devices(capfd):
    """``--tokens 1e8 --days 1``: a target 2 devices meet (the tiny decoder's step is
    microseconds): the command names that count, its plan and the days it predicts."""
    argv = ["--config", "tiny", "--devices", "2", "--accelerator", "cpu", "--layouts", "dp"]
    assert main([*argv, "--batch", "8", "--tokens", "1e8", "--days", "1"]) == 0
    out = capfd.readouterr().out
    assert "1e+08 tokens in 1 days: 2 devices: dp (data=2)" in out
