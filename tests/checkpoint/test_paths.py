"""Checkpoint paths that cannot hold a checkpoint: an empty path, a file, a non-empty
directory that is not a checkpoint (or, for a Manager, not a Manager's). Each is one
clear error before anything is written: a ValueError from the library, one line and
exit status 2 from ``python -m nnx_sharding --checkpoint``, never an orbax traceback.
A checkpoint with nothing left to train exits 0, whatever its step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx

from nnx_sharding import checkpoint


def contents(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


@pytest.fixture
def places(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name -> (path, the problem the error states)."""
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    return {
        "empty": ("", "the path is empty ('')"),
        "file": (str(tmp_path / "a_file"), f"{tmp_path / 'a_file'} is a file, not a directory"),
        "foreign": (str(tmp_path / "notes"), f"{tmp_path / 'notes'} "),
    }


@pytest.mark.parametrize("case", ["empty", "file", "foreign"])
def test_save_refuses_before_writing(
    tmp_path: Path, places: dict[str, tuple[str, str]], case: str
) -> None:
    path, problem = places[case]
    before = contents(tmp_path)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # an empty path would be this directory
    try:
        for force in (False, True):
            with pytest.raises(ValueError) as info:
                checkpoint.save(path, nnx.Linear(2, 3, rngs=nnx.Rngs(0)), force=force)
            assert str(info.value).startswith(f"checkpoint.save: directory: {problem}")
        with pytest.raises(ValueError) as info:
            checkpoint.Manager(path)
        assert str(info.value).startswith(f"Manager: directory: {problem}")
    finally:
        os.chdir(cwd)
    assert contents(tmp_path) == before


def test_a_manager_refuses_a_single_checkpoint(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "ck", nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="is a checkpoint written by checkpoint.save, not a"):
        checkpoint.Manager(tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def job(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nnx_sharding", "--devices", "2", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )


def test_the_command_line_refuses_bad_checkpoint_paths(
    tmp_path: Path, places: dict[str, tuple[str, str]]
) -> None:
    before = contents(tmp_path)
    for case, (path, problem) in places.items():
        run = job("--steps", "2", "--checkpoint", path, cwd=tmp_path)
        assert run.returncode == 2, (case, run.stdout, run.stderr)
        lines = run.stderr.splitlines()
        assert len(lines) == 1, (case, run.stderr)
        assert lines[0].startswith(f"python -m nnx_sharding: error: --checkpoint: {problem}")
        assert run.stdout == "" and "Traceback" not in run.stderr, (case, run.stderr)
    assert contents(tmp_path) == before  # nothing written


def test_nothing_to_train_exits_0(tmp_path: Path) -> None:
    first = job("--steps", "4", "--checkpoint", "run", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    for steps in ("4", "2"):  # at the checkpoint's step, and before it
        again = job("--steps", steps, "--checkpoint", "run", cwd=tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr
        said = " ".join(again.stdout.split())  # rich wraps long lines
        assert f"is at step 4, --steps is {steps}: nothing to train" in said, said
