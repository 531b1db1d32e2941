"""What the command lines share: one-line errors, option types, simulated CPU devices.

Every command of ``python -m nnx_sharding`` runs on simulated CPU devices, as many as
its mesh needs. `cpu_devices_or_rerun` gives the process that count before jax starts
a backend; when the backend is already up with another count (a command called from
Python, or after some jax work), it runs the same command line again in a fresh
``python -m nnx_sharding`` process set to that count and returns its exit status.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

MESH_AXES = ("data", "model")
"""The mesh axes the commands take, outermost first (``model``, tensor parallelism, inside)."""
CHILD_ENV = "NNX_SHARDING_CLI_DEVICES"
"""Set in a command re-run by `cpu_devices_or_rerun` to its device count (no second re-run)."""
_DEVICE_FLAGS = ("JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS", "JAX_PLATFORM_NAME")


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        """One line on stderr (not argparse's usage block), exit status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive(text: str) -> int:
    """An option's positive integer; anything else is argparse's one-line error.

    >>> positive('4')
    4
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def mesh_axes(text: str, names: Sequence[str] = MESH_AXES) -> dict[str, int]:
    """``--mesh``'s value, ``data=2,model=4``, as ``{'data': 2, 'model': 4}``.

    The axes come out in the order of ``names`` (`MESH_AXES`: ``model`` innermost),
    whatever the order given; a name not in ``names`` is refused.

    >>> mesh_axes('model=4, data=2')
    {'data': 2, 'model': 4}
    """
    axes: dict[str, int] = {}
    for item in text.split(","):
        name, eq, size = (part.strip() for part in item.partition("="))
        if not eq or name not in names:
            raise argparse.ArgumentTypeError(
                f"expected NAME=SIZE pairs with NAME in {tuple(names)}, e.g. data=2,model=4; "
                f"got {item.strip()!r}"
            )
        if name in axes:
            raise argparse.ArgumentTypeError(f"axis {name!r} is given twice")
        if not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(f"expected a positive size for {name!r}, got {size!r}")
        axes[name] = int(size)
    return {name: axes[name] for name in names if name in axes}


def mesh_text(axes: Mapping[str, int]) -> str:
    """The mesh as ``--mesh`` takes it.

    >>> mesh_text({'data': 2, 'model': 4})
    'data=2,model=4'
    """
    return ",".join(f"{name}={size}" for name, size in axes.items())


def use_cpu_devices(count: int) -> bool:
    """Gives this process ``count`` simulated CPU devices, if jax has not started yet.

    Returns:
      True when the process has ``count`` CPU devices now; False when jax's backend
      had already started with another platform or count (jax cannot change it then).
    """
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)  # raises once a backend is up
    except RuntimeError:
        return jax.default_backend() == "cpu" and jax.device_count() == count
    jax.config.update("jax_platforms", "cpu")
    return True


def cpu_devices_or_rerun(count: int, argv: Sequence[str]) -> int | None:
    """Gives the command ``python -m nnx_sharding ARGV`` its ``count`` CPU devices.

    Args:
      count: the simulated CPU devices the command needs.
      argv: the command line after ``python -m nnx_sharding`` (e.g. ``['aot', ...]``).

    Returns:
      None when this process has ``count`` CPU devices (the caller runs the command);
      otherwise the exit status of the command, run again in a fresh process with
      ``count`` devices, its output going to this process's stdout and stderr.
    """
    if use_cpu_devices(count):
        return None
    if os.environ.get(CHILD_ENV):  # a fresh process whose jax started anyway: no loop
        import jax

        sys.stderr.write(
            f"python -m nnx_sharding: error: needs {count} CPU devices, but jax started "
            f"with {jax.device_count()} {jax.default_backend()} devices before the command ran\n"
        )
        return 2
    env = {k: v for k, v in os.environ.items() if k not in _DEVICE_FLAGS}
    env[CHILD_ENV] = str(count)
    command = [sys.executable, "-m", "nnx_sharding", *argv]
    try:  # the child writes straight to this process's files, as it goes
        out, err = sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # streams without a file (pytest's capture)
        child = subprocess.run(command, env=env, capture_output=True, text=True)
        sys.stdout.write(child.stdout)
        sys.stderr.write(child.stderr)
        return child.returncode
    sys.stdout.flush()
    sys.stderr.flush()
    return subprocess.run(command, env=env, stdout=out, stderr=err).returncode


def add_devices_option(parser: argparse.ArgumentParser) -> None:
    """``--devices N``: how many simulated CPU devices a command runs on."""
    parser.add_argument(
        "--devices",
        type=positive,
        metavar="N",
        help="simulated CPU devices (default: the mesh's size; without --mesh, 8)",
    )
