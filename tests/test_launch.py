"""``python -m nnx_sharding.launch``: 2 CPU processes with gloo, failures, timeouts, no orphans."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# Every worker script starts by writing its pid to DIR/pid<process id> (DIR is argv[1]).
PRELUDE = """\
import os, sys, time
from pathlib import Path
_pid_file = Path(sys.argv[1], "pid" + os.environ["NNX_SHARDING_PROCESS_ID"])
_pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
_pid_file.with_suffix(".tmp").replace(_pid_file)
RANK = int(os.environ["NNX_SHARDING_PROCESS_ID"])
"""

# A global (4,) array over 2 processes x 2 CPU devices; its jitted sum is a gloo collective.
DISTRIBUTED = """\
import jax
import numpy as np
import nnx_sharding

nnx_sharding.initialize_distributed()
nnx_sharding.initialize_distributed()  # a no-op once initialized
mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
sharding = jax.sharding.NamedSharding(mesh, jax.P("x"))
local = np.arange(2 * RANK, 2 * RANK + 2, dtype=np.float32) + 1  # [1, 2] and [3, 4]
x = jax.make_array_from_process_local_data(sharding, local, (4,))
total = jax.jit(lambda a: a.sum())
"""


def _script(tmp_path: Path, body: str, distributed: bool = False) -> Path:
    path = tmp_path / "worker.py"
    parts = [PRELUDE, DISTRIBUTED if distributed else "", textwrap.dedent(body)]
    path.write_text("\n".join(parts))
    return path


def _launch(*args: object, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    cmd = [sys.executable, "-m", "nnx_sharding.launch", *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - start


def _pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp_path.glob("pid[0-9]*"))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # an orphan that its new parent has not reaped yet is a zombie: dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _assert_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], "orphaned workers"


def test_two_processes_sum_over_gloo(tmp_path: Path) -> None:
    body = """
    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
    print("sum", float(total(x)), "of", jax.process_index())
    """
    script = _script(tmp_path, body, distributed=True)
    done, _ = _launch("-n", 2, "--devices-per-process", 2, script, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "[p0] sum 10.0 of 0" in lines
    assert "[p1] sum 10.0 of 1" in lines
    _assert_gone(_pids(tmp_path))


def test_args_environment_and_output_relay(tmp_path: Path) -> None:
    body = """
    env = [os.environ[k] for k in ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES",
           "JAX_CPU_COLLECTIVES_IMPLEMENTATION", "NNX_SHARDING_NUM_PROCESSES")]
    print("argv", sys.argv[2:], "env", env)
    print("address", os.environ["JAX_COORDINATOR_ADDRESS"].startswith("127.0.0.1:"))
    print("to stderr", RANK, file=sys.stderr)
    sys.stdout.write("no newline at the end")
    """
    script = _script(tmp_path, body)
    args = ("--foo", "bar", "-n", "5")
    done, _ = _launch("-n", 2, "--devices-per-process", 3, script, tmp_path, *args)
    assert done.returncode == 0, done.stderr
    out, err = done.stdout.splitlines(), done.stderr.splitlines()
    for i in range(2):
        env = ["cpu", "3", "gloo", "2"]
        assert f"[p{i}] argv {list(args)} env {env}" in out
        assert f"[p{i}] address True" in out
        assert f"[p{i}] no newline at the end" in out
        assert f"[p{i}] to stderr {i}" in err


def test_a_dead_worker_stops_one_blocked_in_a_collective(tmp_path: Path) -> None:
    # Without the launcher, process 0 would wait ~100 s (jax's heartbeat timeout) and abort.
    body = """
    print("first", float(total(x)))
    if RANK == 1:
        os._exit(3)
    print("second", float(total(x)))  # blocks: process 1 never joins
    """
    script = _script(tmp_path, body, distributed=True)
    done, elapsed = _launch("-n", 2, "--devices-per-process", 2, script, tmp_path)
    assert done.returncode == 3, done.stderr
    assert elapsed < 60
    message = "nnx_sharding.launch: process 1 of 2 exited with code 3; stopping the others"
    assert f"{message} (process 0)" in done.stderr.splitlines()
    assert "[p0] first 10.0" in done.stdout.splitlines()
    assert "second" not in done.stdout
    _assert_gone(_pids(tmp_path))


def test_a_worker_killed_by_a_signal(tmp_path: Path) -> None:
    body = """
    if RANK == 1:
        os.kill(os.getpid(), 9)
    time.sleep(600)
    """
    done, elapsed = _launch("-n", 2, "--grace", 1, _script(tmp_path, body), tmp_path)
    assert done.returncode == 128 + signal.SIGKILL, done.stderr
    assert "process 1 of 2 was killed by SIGKILL" in done.stderr
    assert elapsed < 60
    _assert_gone(_pids(tmp_path))


def test_timeout_stops_all(tmp_path: Path) -> None:
    # jax.distributed.initialize makes SIGTERM a preemption notice: the workers need SIGKILL.
    body = """
    time.sleep(600)
    """
    script = _script(tmp_path, body, distributed=True)
    done, elapsed = _launch(
        "-n", 2, "--devices-per-process", 2, "--timeout", 8, "--grace", 1, script, tmp_path
    )
    assert done.returncode == 124, done.stderr
    assert "nnx_sharding.launch: timed out after 8 s; stopping all 2 processes" in done.stderr
    assert elapsed < 8 + 1 + 20  # + starting python and importing the launcher on a busy machine
    _assert_gone(_pids(tmp_path))


def _start_sleepers(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """Starts the launcher on 2 workers that sleep; returns it once both are running."""
    script = _script(tmp_path, "time.sleep(600)")
    cmd = [sys.executable, "-m", "nnx_sharding.launch", "-n", "2", "--grace", "1"]
    launcher = subprocess.Popen(
        [*cmd, str(script), str(tmp_path)], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = _pids(tmp_path)
    if len(pids) < 2:
        launcher.kill()
    assert len(pids) == 2 and all(map(_alive, pids))
    return launcher, pids


def test_workers_die_with_a_killed_launcher(tmp_path: Path) -> None:
    launcher, pids = _start_sleepers(tmp_path)
    launcher.kill()  # SIGKILL: no chance to stop its workers itself
    launcher.communicate()
    _assert_gone(pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_launcher_stops_its_workers(tmp_path: Path, sig: signal.Signals) -> None:
    launcher, pids = _start_sleepers(tmp_path)
    launcher.send_signal(sig)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + sig
    assert f"nnx_sharding.launch: got {sig.name}; stopping all 2 processes" in err
    _assert_gone(pids)


@pytest.mark.parametrize(
    "args",
    [["-n", "0", "worker.py"], ["-n", "2"], ["-n", "2", "no_such_script.py"]],
    ids=["n0", "no-script", "missing-script"],
)
def test_bad_options(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "worker.py").write_text("")
    start = time.monotonic()
    cmd = [sys.executable, "-m", "nnx_sharding.launch", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert time.monotonic() - start < 60
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("nnx_sharding.launch: error: ")
