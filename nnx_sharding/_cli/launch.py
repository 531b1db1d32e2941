"""Run a script as N ``jax.distributed`` CPU processes on this machine (tests and docs).

``python -m nnx_sharding.launch -n 2 --devices-per-process 4 SCRIPT [ARGS...]`` starts
``python SCRIPT ARGS...`` N times on 127.0.0.1 with CPU devices and gloo collectives,
relays their output prefixed ``[p0] ``, ``[p1] ``..., and stops them all when one fails,
when ``--timeout`` passes or when the launcher is interrupted. The script calls
:func:`initialize_distributed`, which also works unchanged on a real cluster.

The launcher process never starts a jax backend (running it as ``-m nnx_sharding.launch``
imports the package, and so jax, and nothing more).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, NoReturn, TextIO, TypeVar

PROG = "nnx_sharding.launch"
USAGE = (
    "python -m nnx_sharding.launch -n N [--devices-per-process D] [--timeout SECONDS] "
    "SCRIPT [ARGS...]"
)
DESCRIPTION = "runs SCRIPT as N jax.distributed CPU processes on this machine"
NUM_PROCESSES_ENV = "NNX_SHARDING_NUM_PROCESSES"
PROCESS_ID_ENV = "NNX_SHARDING_PROCESS_ID"
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
TIMEOUT_EXIT_CODE = 124
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_POLL_SECONDS = 0.05
_T = TypeVar("_T")

Worker = subprocess.Popen[str]


def initialize_distributed(**kwargs: Any) -> None:
    """Initializes ``jax.distributed``, under ``nnx_sharding.launch`` or on a cluster.

    Call it first thing, before any jax computation (as ``jax.distributed.initialize``).
    It is a no-op when ``jax.distributed`` is already initialized.

    - Under ``python -m nnx_sharding.launch`` (``NNX_SHARDING_PROCESS_ID`` is set), the
      coordinator address, process count and process id come from the launcher; these
      replace the same keys in ``kwargs`` and cluster auto-detection is skipped.
    - Otherwise it is ``jax.distributed.initialize(**kwargs)``: with no arguments jax
      detects the cluster itself (SLURM, Open MPI, Cloud TPU, GKE...).

    So one script runs unchanged on a laptop and on a cluster::

        import nnx_sharding
        nnx_sharding.initialize_distributed()

    Args:
      **kwargs: Passed on to ``jax.distributed.initialize`` (``coordinator_address``,
        ``num_processes``, ``process_id``, ``initialization_timeout``...).
    """
    import jax  # here: nothing in the launcher's own code needs jax

    if jax.distributed.is_initialized():
        return
    if PROCESS_ID_ENV in os.environ:
        kwargs.update(
            coordinator_address=os.environ[COORDINATOR_ENV],
            num_processes=int(os.environ[NUM_PROCESSES_ENV]),
            process_id=int(os.environ[PROCESS_ID_ENV]),
            cluster_detection_method="deactivate",
        )
    jax.distributed.initialize(**kwargs)


def free_port() -> int:
    """Returns a TCP port of 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker_env(process_id: int, num_processes: int, devices: int, address: str) -> dict[str, str]:
    """Returns the environment of one worker: this one plus the jax and launcher settings."""
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(devices),
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        COORDINATOR_ENV: address,
        NUM_PROCESSES_ENV: str(num_processes),
        PROCESS_ID_ENV: str(process_id),
        "PYTHONUNBUFFERED": "1",  # relay lines as they are printed
    }


def _die_with_parent() -> Callable[[], None] | None:
    """Returns a ``preexec_fn`` that makes a child get SIGKILL when the launcher dies (Linux).

    Linux sends it when the thread that started the child ends: call from the main thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork, not in the child
    launcher = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def _relay(pipe: IO[str], out: TextIO, prefix: str, lock: threading.Lock) -> None:
    """Copies each line of ``pipe`` to ``out`` with ``prefix``, until the pipe closes."""
    with pipe:
        for line in pipe:
            with lock, contextlib.suppress(OSError):  # keep draining the worker's pipe
                out.write(prefix + line if line.endswith("\n") else f"{prefix}{line}\n")
                out.flush()


def _say(message: str, lock: threading.Lock) -> None:
    with lock:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _names(indices: Sequence[int], total: int) -> str:
    if len(indices) == total and total > 1:
        return f"all {total} processes"
    word = "process" if len(indices) == 1 else "processes"
    return f"{word} {', '.join(map(str, indices))}"


def _describe(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name} (exit code {128 - code})"


def _signal_group(worker: Worker, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(worker.pid, sig)  # each worker leads its own process group


def _stop(workers: Sequence[Worker], grace: float) -> None:
    """SIGTERMs the running workers' process groups, then SIGKILLs them after ``grace`` s."""
    running = [w for w in workers if w.poll() is None]
    for worker in running:
        _signal_group(worker, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(w.poll() is None for w in running) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    for worker in running:
        _signal_group(worker, signal.SIGKILL)  # also whatever the worker left in its group
        worker.wait()


def _supervise(
    workers: Sequence[Worker], timeout: float, grace: float, lock: threading.Lock
) -> int:
    """Waits for the workers; returns the launcher's exit code."""
    deadline = time.monotonic() + timeout
    total = len(workers)
    while True:
        codes = [w.poll() for w in workers]
        running = [i for i, code in enumerate(codes) if code is None]
        failure = next(((i, code) for i, code in enumerate(codes) if code), None)
        if failure is not None:
            failed, code = failure
            others = f"; stopping the others ({_names(running, total)})" if running else ""
            _say(f"process {failed} of {total} {_describe(code)}{others}", lock)
            _stop(workers, grace)
            return code if code >= 0 else 128 - code
        if not running:
            return 0
        if time.monotonic() >= deadline:
            _say(f"timed out after {timeout:g} s; stopping {_names(running, total)}", lock)
            _stop(workers, grace)
            return TIMEOUT_EXIT_CODE
        time.sleep(_POLL_SECONDS)


class _Interrupted(Exception):
    """The launcher got the signal ``args[0]`` (SIGINT or SIGTERM)."""


def _raise_interrupted(signum: int, frame: object) -> NoReturn:
    raise _Interrupted(signum)


def launch(
    script: str,
    args: Sequence[str],
    num_processes: int,
    devices_per_process: int = 1,
    timeout: float = 600.0,
    grace: float = 5.0,
) -> int:
    """Runs ``python script *args`` as ``num_processes`` supervised ``jax.distributed`` workers.

    SIGINT and SIGTERM of the launcher stop the workers only where :func:`main` installed
    its handlers; on Linux the workers get SIGKILL whenever the launcher dies.

    Args:
      script: Path of the Python script every worker runs.
      args: Arguments passed to the script.
      num_processes: Number of worker processes.
      devices_per_process: CPU devices of each worker.
      timeout: Seconds after which all workers are stopped.
      grace: Seconds between SIGTERM and SIGKILL when stopping workers.

    Returns:
      0 when every worker exits 0; the first failing worker's exit code (128 + signal
      number when killed by a signal); 124 on timeout; 128 + signal number when interrupted.
    """
    address = f"127.0.0.1:{free_port()}"
    lock = threading.Lock()
    workers: list[Worker] = []
    readers: list[threading.Thread] = []
    preexec = _die_with_parent()
    try:
        for i in range(num_processes):
            workers.append(
                subprocess.Popen(
                    [sys.executable, script, *args],
                    env=worker_env(i, num_processes, devices_per_process, address),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    encoding="utf-8",
                    errors="replace",
                    start_new_session=True,
                    preexec_fn=preexec,
                )
            )
        for i, worker in enumerate(workers):  # threads only after all forks
            for pipe, out in ((worker.stdout, sys.stdout), (worker.stderr, sys.stderr)):
                assert pipe is not None
                relay_args = (pipe, out, f"[p{i}] ", lock)
                reader = threading.Thread(target=_relay, args=relay_args, daemon=True)
                reader.start()
                readers.append(reader)
        return _supervise(workers, timeout, grace, lock)
    except _Interrupted as interrupt:
        running = [i for i, w in enumerate(workers) if w.poll() is None]
        name = signal.Signals(interrupt.args[0]).name
        _say(f"got {name}; stopping {_names(running, len(workers))}", lock)
        _stop(workers, grace)
        return 128 + int(interrupt.args[0])
    finally:
        for worker in workers:  # only left running if starting or stopping went wrong
            if worker.poll() is None:
                _signal_group(worker, signal.SIGKILL)
                worker.wait()
        for reader in readers:
            reader.join(timeout=5.0)  # a grandchild may still hold a pipe open


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _checked(kind: Callable[[str], _T], what: str, ok: Callable[[_T], bool]) -> Callable[[str], _T]:
    def parse(text: str) -> _T:
        with contextlib.suppress(ValueError):
            if ok(value := kind(text)):
                return value
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point: parses ``argv`` and runs :func:`launch`; returns its code."""
    parser = _Parser(
        prog=PROG,
        usage=USAGE,
        description=f"{DESCRIPTION[0].upper()}{DESCRIPTION[1:]}: relays their output, "
        "stops them all when one fails. The script calls "
        "nnx_sharding.initialize_distributed() first.",
    )
    count = _checked(int, "a positive integer", lambda v: v > 0)
    seconds = _checked(float, "a positive number", lambda v: v > 0)
    pause = _checked(float, "a number >= 0", lambda v: v >= 0)
    add = parser.add_argument
    add("-n", "--num-processes", metavar="N", type=count, required=True, help="process count")
    add("--devices-per-process", metavar="D", type=count, default=1, help="CPU devices each (1)")
    add("--timeout", metavar="SECONDS", type=seconds, default=600.0, help="then stop all (600)")
    add("--grace", metavar="SECONDS", type=pause, default=5.0, help="SIGTERM to SIGKILL (5)")
    add("script", metavar="SCRIPT", nargs="?", help="the script every process runs")
    add("args", metavar="ARGS", nargs=argparse.REMAINDER, help="the script's arguments")
    ns = parser.parse_args(argv)
    if ns.script is None:
        parser.error("missing SCRIPT")
    if not os.path.isfile(ns.script):
        parser.error(f"no such script: {ns.script}")
    handlers = {
        sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        return launch(
            ns.script, ns.args, ns.num_processes, ns.devices_per_process, ns.timeout, ns.grace
        )
    except _Interrupted as interrupt:  # a second signal while stopping: workers got SIGKILL
        return 128 + int(interrupt.args[0])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
