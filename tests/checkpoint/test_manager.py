"""Issue 17: `checkpoint.Manager` for training loops, and item 6: a save interrupted half
way (the process killed during an asynchronous save) leaves the previous step
restorable and is never offered as a checkpoint.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from ckpt_models import abstract, assert_same_values, build, values
from flax import nnx

import nnx_sharding
from nnx_sharding import checkpoint, recipes


def test_keeps_the_last_n_and_restores_the_latest(tmp_path: Path) -> None:
    saved = {}
    with checkpoint.Manager(tmp_path, max_to_keep=2) as manager:
        assert manager.latest_step() is None and manager.all_steps() == []
        for step in (10, 20, 30, 40):
            tree = build(step)
            saved[step] = values(tree)
            assert manager.save(step, tree)
        manager.wait_until_finished()
        assert manager.all_steps() == [30, 40] and manager.latest_step() == 40
        assert_same_values(manager.restore(abstract()), saved[40])
        assert_same_values(manager.restore(abstract(), step=30), saved[30])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["30", "40"]
    # a new Manager finds the steps; each step is a checkpoint of `save`'s format
    with checkpoint.Manager(tmp_path) as reopened:
        assert reopened.all_steps() == [30, 40]
    assert_same_values(checkpoint.restore(tmp_path / "30", abstract()), saved[30])


def test_force_replaces_a_step_and_older_steps_are_skipped(tmp_path: Path) -> None:
    first, second = build(1), build(2)
    with checkpoint.Manager(tmp_path, async_save=False) as manager:
        assert manager.save(5, first)
        assert manager.save(5, second, force=True)
        assert_same_values(manager.restore(abstract()), values(second))
        assert not manager.save(4, first)  # older than the latest: orbax skips it
        assert manager.all_steps() == [5]


def test_async_save_overlaps_training(tmp_path: Path) -> None:
    """Training goes on (in place, its buffers donated) while the step is written; the
    checkpoint holds the values of when save was called."""
    mesh = recipes.make_mesh({"data": 2, "model": 4})
    megatron = recipes.megatron_sharding("model")
    model, optimizer = build(3)
    x, y = recipes.make_batches(1, 8, 16, 8, seed=3)[0]
    laid_out = recipes.on_mesh(mesh, megatron)

    @nnx_sharding.jit(in_shardings=(laid_out, laid_out, None, None), donate_argnums=(0, 1))
    def step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: recipes.mse(m(x), y))(model)
        optimizer.update(model, grads)

    with jax.set_mesh(mesh), checkpoint.Manager(tmp_path) as manager:
        step(model, optimizer, x, y)
        at_save = values((model, optimizer))
        assert manager.save(1, (model, optimizer))
        kernel = model.up.kernel.get_value()
        for _ in range(3):
            step(model, optimizer, x, y)
        assert kernel.is_deleted()  # donated while the save may still be writing
        assert int(optimizer.step.get_value()) == 5
        assert manager.latest_step() == 1 and (tmp_path / "1" / "state").is_dir()  # committed
        restored = manager.restore(abstract(), shardings=megatron)
    assert_same_values(restored, at_save)
    assert int(restored[1].step.get_value()) == 2


# Run in a process of its own: commits step 1 (a small Big), then starts saving step 2
# (256 MB) asynchronously and kills itself (SIGKILL) once the save has begun.
KILLED = textwrap.dedent(
    """
    import os, signal, sys, time
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_platforms", "cpu")
    from flax import nnx
    from nnx_sharding import checkpoint

    directory, small, big = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    class Big(nnx.Module):  # 4 float32 n x n matrices: 256 MB for n = 4096
        def __init__(self, values):
            self.w = nnx.List([nnx.Param(v) for v in values])

    manager = checkpoint.Manager(directory)
    keys = jax.random.split(jax.random.key(1), 4)
    manager.save(1, Big([jax.random.uniform(k, (small, small)) for k in keys]))
    manager.wait_until_finished()
    ramp = jnp.arange(big * big, dtype=jnp.float32).reshape(big, big)
    manager.save(2, Big([ramp + i for i in range(4)]))  # returns while it is written
    # Kill as soon as orbax has made step 2's temporary directory: writing 256 MB takes
    # far longer than this loop's listdir, so the save is always caught before its commit.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        started = [name for name in os.listdir(directory) if name.startswith("2.")]
        if started or "2" in os.listdir(directory):
            break
    print("killing with", started, "in", sorted(os.listdir(directory)), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


class Big(nnx.Module):
    def __init__(self, n: int):
        self.w = nnx.List([nnx.Param(jax.numpy.zeros((n, n))) for _ in range(4)])


def test_a_save_killed_half_way_is_never_restored(tmp_path: Path) -> None:
    small, big = 64, 4096
    run = subprocess.run(
        [sys.executable, "-c", KILLED, str(tmp_path), str(small), str(big)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = sorted(p.name for p in tmp_path.iterdir())
    context = f"{found}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    assert run.returncode == -signal.SIGKILL, context
    assert "killing with ['2." in run.stdout, context
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("2.")]
    assert leftovers and not (tmp_path / "2").exists(), context  # killed before the commit
    with pytest.raises(ValueError, match="whose save never finished"):
        checkpoint.restore(leftovers[0], nnx.eval_shape(lambda: Big(big)))

    with checkpoint.Manager(tmp_path) as manager:
        assert manager.all_steps() == [1] and manager.latest_step() == 1
        restored = manager.restore(nnx.eval_shape(lambda: Big(small)))
    keys = jax.random.split(jax.random.key(1), 4)
    for key, param in zip(keys, restored.w, strict=True):
        np.testing.assert_array_equal(param.get_value(), jax.random.uniform(key, (small, small)))


def test_manager_is_a_context_manager_that_waits(tmp_path: Path) -> None:
    with checkpoint.Manager(tmp_path) as manager:
        manager.save(7, nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    assert (tmp_path / "7" / "state").is_dir()  # committed by close()
    with checkpoint.Manager(tmp_path) as manager:
        model = manager.restore(nnx.Linear(2, 3, rngs=nnx.Rngs(1)), step=np.int64(7))
    np.testing.assert_array_equal(
        model.kernel.get_value(), nnx.Linear(2, 3, rngs=nnx.Rngs(0)).kernel.get_value()
    )
    assert "steps=[7]" in repr(manager)
    assert nnx_sharding.checkpoint.Manager is checkpoint.Manager
