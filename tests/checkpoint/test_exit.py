"""A Manager left open when the program ends: its pending save is committed, with no
traceback, and the process ends (`checkpoint._exit`).

Without the exit hook, the script below loses step 2 (left as
``2.orbax-checkpoint-tmp``, with ``RuntimeError: cannot schedule new futures after
interpreter shutdown`` on stderr) or, now and then, never ends: each run is stopped
after `TIMEOUT` seconds, and the script runs `RUNS` times.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_sharding import checkpoint
from nnx_sharding.plan._hardware.stderr import KNOWN_NOISE

RUNS = 9
AT_ONCE = 3
TIMEOUT = 90
N = 1024  # a 4 MiB Param: long enough a write that the script ends while it goes on

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    from flax import nnx
    from nnx_sharding import checkpoint

    class Big(nnx.Module):
        def __init__(self, n, step):
            self.w = nnx.Param(jnp.arange(n * n, dtype=jnp.float32).reshape(n, n) + step)

    n = int(sys.argv[2])
    manager = checkpoint.Manager(sys.argv[1])
    manager.save(1, Big(n, 1))
    manager.wait_until_finished()
    manager.save(2, Big(n, 2))  # returns at once; the script ends while it is written
    print("end of script", flush=True)
    """
)


class Big(nnx.Module):
    def __init__(self, n: int, step: int):
        self.w = nnx.Param(jnp.arange(n * n, dtype=jnp.float32).reshape(n, n) + step)


def test_an_open_manager_commits_its_pending_save_at_exit(tmp_path: Path) -> None:
    directories = [tmp_path / f"run{i}" for i in range(RUNS)]
    results: list[tuple[int | None, str, str]] = []
    for first in range(0, RUNS, AT_ONCE):
        runs = [
            subprocess.Popen(
                [sys.executable, "-c", SCRIPT, str(directory), str(N)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            )
            for directory in directories[first : first + AT_ONCE]
        ]
        for run in runs:
            try:
                out, err = run.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                run.kill()
                out, err = run.communicate()
                results.append((None, out, err))  # hung at exit
            else:
                results.append((run.returncode, out, err))
    expected = np.asarray(Big(N, 2).w.get_value())
    template = nnx.eval_shape(lambda: Big(N, 0))
    for directory, (returncode, out, err) in zip(directories, results, strict=True):
        context = f"{directory.name}: rc {returncode}\n{sorted(os.listdir(directory))}\n{err}"
        assert returncode == 0 and "end of script" in out, context
        assert "Traceback" not in err and "RuntimeError" not in err, context
        assert sorted(os.listdir(directory)) == ["1", "2"], context  # committed, nothing left
        with checkpoint.Manager(directory) as manager:
            assert manager.all_steps() == [1, 2], context
            restored = manager.restore(template, step=2)
        np.testing.assert_array_equal(restored.w.get_value(), expected, err_msg=context)


def test_closing_twice_and_closing_at_exit_do_nothing_more(tmp_path: Path) -> None:
    manager = checkpoint.Manager(tmp_path)
    manager.save(1, Big(8, 1))
    manager.close()
    manager.close()
    manager.close_at_exit()
    assert sorted(os.listdir(tmp_path)) == ["1"]


FAILING = textwrap.dedent(
    """
    import resource, signal, sys
    import jax
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    from flax import nnx
    from nnx_sharding import checkpoint

    manager = checkpoint.Manager(sys.argv[1])
    manager.save(1, nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    manager.wait_until_finished()
    # no file of this process may grow past 1 MiB from here: the 4 MiB save fails
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    noise = jax.random.uniform(jax.random.key(0), (1024, 1024))  # does not compress
    manager.save(2, nnx.Dict(w=nnx.Param(noise)))
    print("end of script", flush=True)
    """
)


def _noise(line: str) -> bool:
    """Python warnings, and what the CUDA plugin (the ``gpu`` extra) prints on a machine
    without a driver whenever jax is imported."""
    return "Warning" in line or any(known in line for known in KNOWN_NOISE)


def test_a_pending_save_that_fails_at_exit_is_one_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", FAILING, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    context = f"rc {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert run.returncode == 0 and "end of script" in run.stdout, context
    assert [line for line in run.stderr.splitlines() if not _noise(line)] == [
        "nnx_sharding.checkpoint: at exit: [Errno 27] Manager.close: directory: could not "
        f"write the checkpoint step 2 of {tmp_path}: File too large"
    ], context
    assert sorted(os.listdir(tmp_path)) == ["1"], context
