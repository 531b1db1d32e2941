"""The compilers' start-up noise kept off stderr (nnx_sharding.plan._hardware.stderr.py), and
none made by installing or importing the package: jax programs print what they printed
without it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

from nnx_sharding.plan._hardware.stderr import quiet

NOISE = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    "I0000 00:00:1.0 1 cudart_stub.cc:31] Could not find cuda drivers on your machine.\n"
)


def test_quiet_drops_everything_written_to_stderr_inside(capfd):
    with quiet():
        os.write(2, b"from C++\n")
        print("from Python", file=sys.stderr)
        logging.getLogger("jax._src.xla_bridge").warning("from a plugin's logger")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"
    assert logging.getLogger("jax._src.xla_bridge").level == logging.NOTSET  # restored


def test_quiet_keeps_what_is_not_known_plugin_noise(capfd):
    with quiet(keep_unknown=True):
        os.write(2, NOISE.encode() + b"a real warning\n")
        print("a Python warning", file=sys.stderr)
    assert capfd.readouterr().err == "a real warning\na Python warning\n"


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with no jax or XLA settings in its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "TPU_"))}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_importing_the_package_prints_nothing():
    code = "import nnx_sharding, jax; jax.config.update('jax_platforms', 'cpu'); jax.numpy.ones(2)"
    run = _run(code)
    assert (run.returncode, run.stdout, run.stderr) == (0, "", "")


def test_importing_the_package_loads_no_compiler_and_silences_nothing():
    """``import nnx_sharding`` defines the package: it imports no noise suppression and
    loads neither compiler (the CUDA plugin was loaded through ctypes, with stderr
    redirected, while jax was imported)."""
    code = (
        "import sys, nnx_sharding\n"
        "maps = open('/proc/self/maps').read()\n"
        "names = ('nnx_sharding.plan._hardware.stderr', 'nnx_sharding.plan', 'libtpu',\n"
        "         'jax_plugins.xla_cuda12')\n"
        "print([name for name in names if name in sys.modules])\n"
        "print([lib for lib in ('libtpu.so', 'xla_cuda_plugin.so') if lib in maps])\n"
    )
    run = _run(code)
    assert (run.returncode, run.stdout, run.stderr) == (0, "[]\n[]\n", "")


@pytest.mark.parametrize(
    "code", ["import jax; jax.devices()", "import nnx_sharding, jax; jax.devices()"]
)
def test_jax_prints_nothing_where_the_package_and_compilers_are_installed(code):
    """Where the package is installed (with its compilers, as the test command installs
    them), a jax program that starts every backend it knows prints nothing: the compilers
    are not where jax looks. Installed as packages (the former ``tpu`` and ``gpu``
    extras), jax's start printed 30 lines of their errors on a machine without a GPU."""
    run = _run(code)
    found = [name for name in ("libtpu", "jax_plugins", "jax_cuda12_plugin") if find_spec(name)]
    assert (run.returncode, run.stderr) == (0, ""), (
        f"jax finds {found} in this environment: uninstall them "
        "(`python -m nnx_sharding compilers --install` puts the planner's compilers where "
        f"jax does not look)\n{run.stderr[-3000:]}"
    )
