"""Replacing a checkpoint is atomic (`checkpoint._replace`): a save that replaces one
(``force=True``), killed before, during or after its write, leaves the old checkpoint
or the new one, complete: never neither, never a mix; the next save or Manager puts
the files back in order.

Each case runs tests/checkpoint/replace_worker.py, which saves an old checkpoint, then
kills itself (SIGKILL) at one point of replacing it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from replace_worker import PARAMS, Tree

from nnx_sharding import checkpoint

WORKER = Path(__file__).with_name("replace_worker.py")
SMALL, BIG = 64, 2048  # BIG: 64 MB, written long after its temporary directory appears

# where the worker is killed -> which checkpoint is there afterwards (1: old, 2: new)
POINTS = {
    "before": 1,
    "during": 1,
    "committed": 1,
    "aside": 2,
    "swapped": 2,
    "removing": 2,
}


def killed(directory: Path, point: str, n: int, mode: str) -> str:
    run = subprocess.run(
        [sys.executable, str(WORKER), str(directory), point, str(n), mode],
        capture_output=True,
        text=True,
        timeout=300,
    )
    context = f"{point}: rc {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    assert run.returncode == -signal.SIGKILL, context
    assert "killing" in run.stdout, context
    return context


def assert_holds(tree: Tree, n: int, seed: int, context: str) -> None:
    """Every Param of ``tree`` is the one of ``Tree(n, seed)``: one save's, not a mix."""
    expected = Tree(n, seed)
    for i in range(PARAMS):
        np.testing.assert_array_equal(
            tree.w[i].get_value(), expected.w[i].get_value(), err_msg=context
        )


@pytest.mark.parametrize("point", list(POINTS))
def test_a_killed_replacing_save_leaves_the_old_or_the_new(tmp_path: Path, point: str) -> None:
    n = BIG if point == "during" else SMALL
    context = killed(tmp_path, point, n, "save")
    if point == "during":
        assert "ck.nnx-new.orbax-checkpoint-tmp" in context, context
    template = nnx.eval_shape(lambda: Tree(n, 0))
    assert_holds(checkpoint.restore(tmp_path / "ck", template), n, POINTS[point], context)
    # the next save puts things in order: the new checkpoint, nothing beside it
    checkpoint.save(tmp_path / "ck", Tree(n, 3), force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert_holds(checkpoint.restore(tmp_path / "ck", template), n, 3, context)


@pytest.mark.parametrize("point", ["during", "aside", "removing"])
def test_a_killed_replacing_manager_save(tmp_path: Path, point: str) -> None:
    n = BIG if point == "during" else SMALL
    context = killed(tmp_path, point, n, "manager")
    template = nnx.eval_shape(lambda: Tree(n, 0))
    with checkpoint.Manager(tmp_path) as manager:  # finishes an interrupted swap
        assert manager.all_steps() == [5], context
        assert_holds(manager.restore(template), n, POINTS[point], context)
    assert sorted(p.name for p in tmp_path.iterdir() if ".orbax" not in p.name) == ["5"]


def test_an_interrupted_swap_is_restored_from_where_it_stopped(tmp_path: Path) -> None:
    """Killed between the two renames: `restore` reads the new checkpoint beside the
    missing one without moving anything (every process of a run may be reading)."""
    context = killed(tmp_path, "aside", SMALL, "save")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert before == ["ck.nnx-new", "ck.nnx-old"], context
    template = nnx.eval_shape(lambda: Tree(SMALL, 0))
    assert_holds(checkpoint.restore(tmp_path / "ck", template), SMALL, 2, context)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    with pytest.raises(FileExistsError, match="a checkpoint already exists"):
        checkpoint.save(tmp_path / "ck", Tree(SMALL, 3))
