"""The plugins' start-up noise kept off stderr (nnx_sharding/_quiet.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from nnx_sharding._cli.quiet import quiet

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


def test_importing_the_package_prints_nothing():
    # a fresh interpreter: with the GPU compiler installed and no driver, jax's CUDA
    # libraries would print "Could not find cuda drivers" here
    code = "import nnx_sharding, jax; jax.config.update('jax_platforms', 'cpu'); jax.numpy.ones(2)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (run.returncode, run.stdout, run.stderr) == (0, "", "")
