"""The main job, ``python -m nnx_sharding``: run in a subprocess, as a user would."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nnx_sharding import __main__ as cli
from nnx_sharding.__main__ import parse

ROOT = Path(__file__).resolve().parent.parent


def job(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    return subprocess.run(
        [sys.executable, "-m", "nnx_sharding", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def final_losses(out: str) -> tuple[float, float]:
    found = re.search(r"final loss ([\d.]+), single-device reference ([\d.]+)", out)
    assert found, out
    return float(found[1]), float(found[2])


def assert_placed_and_matching(run, rows: dict[str, str]) -> None:
    """Each parameter's row of the printed table (shape, spec, shard), and the final
    loss the single-device reference's."""
    for path, row in rows.items():
        assert re.search(rf"{re.escape(path)}\s+│ {row}", run.stdout), (path, run.stdout)
    loss, reference = final_losses(run.stdout)
    assert loss == pytest.approx(reference, rel=1e-5)
    assert "Traceback" not in run.stderr


def test_default_mesh_trains_tensor_parallel_on_8_devices():
    run = job("--steps", "20")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "tensor parallel" in out and "{'model': 8}" in out and "20/20" in out
    rows = {
        "up.kernel": r"\(16, 128\)\s+│ P\(None, 'model'\)\s+│ \(16, 16\)",
        "up.bias": r"\(128,\)\s+│ P\('model',\)\s+│ \(16,\)",
        "down.kernel": r"\(128, 8\)\s+│ P\('model',\)\s+│ \(16, 8\)",
        "down.bias": r"\(8,\)\s+│ P\(\)\s+│ \(8,\)",
    }
    assert_placed_and_matching(run, rows)


def test_2d_mesh_and_device_count():
    run = job("--devices", "8", "--mesh", "model=4,data=2", "--steps", "10")
    assert run.returncode == 0, run.stderr
    assert "data x tensor parallel on mesh {'data': 2, 'model': 4}" in run.stdout
    loss, reference = final_losses(run.stdout)
    assert loss == pytest.approx(reference, rel=1e-5)


def test_stage_mesh_trains_the_pipeline_beside_the_same_model_without_it():
    run = job("--mesh", "data=2,stage=4", "--steps", "5")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    title = "pipeline parallel (GPipe, 4 stages × 8 microbatches) on mesh {'stage': 4, 'data': 2}"
    assert title in out and "8 residual blocks of 16 -> 8, batch 64" in out and "5/5" in out
    rows = {
        "blocks.kernel": r"\(8, 16, 16\)\s+│ P\('stage',\)\s+│ \(2, 16, 16\)",
        "blocks.bias": r"\(8, 16\)\s+│ P\('stage',\)\s+│ \(2, 16\)",
        "up.kernel": r"\(16, 16\)\s+│ P\(\)\s+│ \(16, 16\)",
    }
    assert_placed_and_matching(run, rows)


def test_expert_mesh_trains_the_moe_beside_the_same_model_without_it():
    run = job("--mesh", "data=2,expert=4", "--steps", "5")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    title = "expert parallel (MoE, 8 experts, top-2, dropless) on mesh {'expert': 4, 'data': 2}"
    assert title in out and "2 residual MoE blocks (8 experts" in out and "5/5" in out
    assert "load balancing, sequences of 8 tokens, batch 32" in out
    rows = {
        "blocks.0.gate": r"\(8, 16, 32\)\s+│ P\('expert', None, None\)\s+│ \(2, 16, 32\)",
        "blocks.1.down": r"\(8, 32, 16\)\s+│ P\('expert', None, None\)\s+│ \(2, 32, 16\)",
        "blocks.0.router": r"\(16, 8\)\s+│ P\(\)\s+│ \(16, 8\)",
        "up.kernel": r"\(16, 16\)\s+│ P\(\)\s+│ \(16, 16\)",
    }
    assert_placed_and_matching(run, rows)


def test_devices_alone_sets_the_model_axis():
    run = job("--devices", "4", "--steps", "5")
    assert run.returncode == 0, run.stderr
    assert "on mesh {'model': 4}" in run.stdout and "5/5" in run.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
        (["--steps", "ten"], "argument --steps: expected a positive integer, got 'ten'"),
        (["--devices", "-1"], "argument --devices: expected a positive integer, got '-1'"),
        (["--mesh", "data=3,model=4", "--devices", "8"], "has 12 devices, but --devices is 8"),
        (["--mesh", "batch=8"], "with NAME in ('stage', 'expert', 'data', 'model')"),
        (["--mesh", "stage=3"], "--mesh stage=3: the pipeline's 8 residual blocks do not split"),
        (["--mesh", "stage=16", "--devices", "16"], "do not split into 16 stages (stage=1, 2, 4"),
        (["--mesh", "expert=3"], "--mesh expert=3: the 8 experts do not split over 3 devices"),
        (["--mesh", "expert=16", "--devices", "16"], "over 16 devices (expert=1, 2, 4 or 8)"),
        (["--mesh", "stage=2,expert=4"], "pipelines (stage) or splits experts (expert), not both"),
        (["--mesh", "data=2,data=4"], "axis 'data' is given twice"),
        (["--mesh", "data=two"], "expected a positive size for 'data', got 'two'"),
        (["--mesh", "model"], "got 'model'"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_options_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        parse(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m nnx_sharding: error: ")
    assert message in err


def test_options_and_their_defaults():
    assert vars(parse([])) == {"devices": 8, "steps": 300, "mesh": {"model": 8}}
    assert parse(["--mesh", "model=2,data=2"]).devices == 4  # the mesh's size
    assert parse(["--mesh", "model=2, data=2"]).mesh == {"data": 2, "model": 2}
    assert vars(parse(["--mesh", "data=2,stage=4"])) == {
        "devices": 8, "steps": 300, "mesh": {"stage": 4, "data": 2}
    }  # fmt: skip
    assert parse(["--mesh", "data=2,expert=4"]).mesh == {"expert": 4, "data": 2}


@pytest.mark.parametrize(
    "argv",
    [["--steps", "0"], ["--mesh", "data=3,model=4", "--devices", "8"], ["--mesh", "stage=3"]],
)
def test_bad_options_from_the_command_line(argv):
    run = job(*argv)
    assert run.returncode == 2
    assert run.stdout == "" and len(run.stderr.splitlines()) == 1, run.stderr
    assert "Traceback" not in run.stderr


def test_help_lists_the_options_the_commands_and_the_launcher():
    run = job("--help")
    assert run.returncode == 0 and run.stderr == "", run.stderr
    out = run.stdout
    assert out.startswith("usage: python -m nnx_sharding [--devices N] [--steps N] [--mesh AXES]")
    assert "python -m nnx_sharding {aot,plan,compilers} [--help] ..." in out
    for option in ("--devices N", "--steps N", "--mesh AXES", "--checkpoint DIR"):
        assert option in out
    commands = out[out.index("commands (") : out.index("launcher")]
    assert re.search(r"^  aot +compile a sharded transformer's training step", commands, re.M)
    assert re.search(r"^  plan +plan the built-in decoder's layout on N devices", commands, re.M)
    assert re.search(r"^  compilers +say where the planner's TPU and GPU compilers", commands, re.M)
    assert "python -m nnx_sharding COMMAND --help" in commands
    launcher = out[out.index("launcher") :]
    assert "python -m nnx_sharding.launch -n N [--devices-per-process D]" in launcher
    assert "[--timeout SECONDS] SCRIPT [ARGS...]" in launcher  # an option stays whole
    assert "runs SCRIPT as N jax.distributed CPU processes" in launcher
    assert max(map(len, out.splitlines())) <= 88, out
    # the launcher's own help: the usage the main help shows
    launch = subprocess.run(
        [sys.executable, "-m", "nnx_sharding.launch", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert launch.returncode == 0
    assert launch.stdout.startswith(f"usage: {cli.LAUNCH_USAGE}\n")


def test_a_new_command_is_one_entry(monkeypatch, capsys):
    """--help and the dispatch both come from SUBCOMMANDS."""
    monkeypatch.setitem(cli.SUBCOMMANDS, "echo", (f"{__name__}:echo_main", "prints its arguments"))
    with pytest.raises(SystemExit) as raised:
        parse(["--help"])
    assert raised.value.code == 0
    out = capsys.readouterr().out
    assert "{aot,plan,compilers,echo}" in out
    assert re.search(r"^  echo +prints its arguments$", out, re.M)
    assert cli.main(["echo", "a", "--b"]) == 7
    assert capsys.readouterr().out == "['a', '--b']\n"


def echo_main(argv):
    print(list(argv))
    return 7


def test_the_job_on_a_device_count_jax_does_not_have_runs_in_a_fresh_process(capsys):
    """This process has 8 devices: --devices 2 re-runs the command with 2."""
    assert cli.main(["--devices", "2", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "on mesh {'model': 2}" in out and "3/3" in out


def test_aot_subcommand_reports_and_refuses_bad_options():
    bad = job("aot", "--config", "nope")
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "unknown --config 'nope'" in bad.stderr
    ok = job("aot", "--config", "1b-wide", "--mesh", "data=2,model=4", timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "1,067,487,232" in ok.stdout and "memory_analysis" in ok.stdout


def test_checkpoint_option_and_its_absence():
    assert parse(["--checkpoint", "ckpt"]).checkpoint == "ckpt"
    assert not hasattr(parse([]), "checkpoint")  # without it, the options are as they were


def restored_at(directory: Path, step: int) -> dict[str, np.ndarray]:
    """The checkpoint of ``step`` in ``directory`` (the job's model and optimizer) as numpy."""
    from flax import nnx

    from nnx_sharding import checkpoint
    from nnx_sharding.recipes import MLP, make_optimizer

    def fresh():
        model = MLP(16, 128, 8, rngs=nnx.Rngs(0))
        return model, make_optimizer(model)

    with checkpoint.Manager(directory) as manager:
        assert step in manager.all_steps(), manager.all_steps()
        tree = manager.restore(nnx.eval_shape(fresh), step=step)
    return {
        "/".join(map(str, path)): np.asarray(variable.get_value())
        for path, variable in nnx.to_flat_state(nnx.state(tree))
    }


def test_checkpoint_resumes_the_run_exactly(tmp_path):
    """--steps 10 then --steps 20 from its checkpoint: the uninterrupted run's numbers."""
    whole = job("--steps", "20", "--checkpoint", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    assert "resumed" not in whole.stdout
    first = job("--steps", "10", "--checkpoint", str(tmp_path / "split"))
    assert first.returncode == 0, first.stderr
    second = job("--steps", "20", "--checkpoint", str(tmp_path / "split"))
    assert second.returncode == 0, second.stderr
    assert "resumed from step 10" in second.stdout, second.stdout
    assert "20/20" in second.stdout and "max |loss difference| over steps 11-20" in second.stdout
    assert final_losses(second.stdout) == final_losses(whole.stdout)
    # the parameters, adam's state and the step: bit for bit
    got, expected = restored_at(tmp_path / "split", 20), restored_at(tmp_path / "whole", 20)
    assert sorted(got) == sorted(expected) and int(got["1/step"]) == 20
    for path, value in expected.items():
        np.testing.assert_array_equal(got[path], value, err_msg=path)
    # the checkpoint is done: a third run has nothing to train
    done = job("--steps", "20", "--checkpoint", str(tmp_path / "split"))
    assert done.returncode == 0 and "nothing to train" in done.stdout, done.stdout + done.stderr
    # another mesh, another model: refused, with the mismatches and no traceback
    other = job("--mesh", "model=4", "--steps", "30", "--checkpoint", str(tmp_path / "split"))
    assert other.returncode == 1, other.stdout + other.stderr
    assert "cannot resume from step 20" in other.stdout and "shape (16, 64)" in other.stdout
    assert "Traceback" not in other.stderr


def test_checkpoint_of_a_stage_mesh_resumes_in_the_pipeline_layout(tmp_path):
    """Saved from the pipeline's layout (the blocks over 'stage'), restored into it."""
    first = job("--mesh", "stage=4,data=2", "--steps", "4", "--checkpoint", str(tmp_path))
    assert first.returncode == 0, first.stderr
    second = job("--mesh", "stage=4,data=2", "--steps", "8", "--checkpoint", str(tmp_path))
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from step 4" in second.stdout and "over steps 5-8" in second.stdout
    loss, reference = final_losses(second.stdout)
    assert loss == pytest.approx(reference, rel=1e-5)
    # the MLP of another mesh does not fit it: refused, with no traceback
    other = job("--mesh", "model=8", "--steps", "12", "--checkpoint", str(tmp_path))
    assert other.returncode == 1 and "cannot resume from step 8" in other.stdout
    assert "Traceback" not in other.stderr


def test_checkpoint_of_an_expert_mesh_resumes_on_another_split(tmp_path):
    """Saved with the experts over expert=4 (x data=2), resumed with them over expert=8:
    the same model, laid out anew; the MLP of a mesh without experts is refused."""
    first = job("--mesh", "expert=4,data=2", "--steps", "3", "--checkpoint", str(tmp_path))
    assert first.returncode == 0, first.stderr
    second = job("--mesh", "expert=8", "--steps", "6", "--checkpoint", str(tmp_path))
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from step 3" in second.stdout and "over steps 4-6" in second.stdout
    loss, reference = final_losses(second.stdout)
    assert loss == pytest.approx(reference, rel=1e-5)
    other = job("--mesh", "model=8", "--steps", "9", "--checkpoint", str(tmp_path))
    assert other.returncode == 1 and "cannot resume from step 6" in other.stdout
    assert "Traceback" not in other.stderr
