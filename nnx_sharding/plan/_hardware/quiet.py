"""Keeps the planner's compilers' start-up noise off stderr, where they are loaded.

On a machine without those accelerators, jax's CUDA plugin logs "Could not find cuda
drivers" from C++ when its library loads, and libtpu logs host-discovery errors when
asked for a topology. None of it concerns the user: `quiet` runs such a call with file
descriptor 2, ``sys.stderr`` and jax's plugin loggers silenced. Importing this module
does nothing else (importing ``nnx_sharding`` does not import it).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

# Lines the CUDA plugin's libraries print when they find no driver.
_KNOWN_NOISE = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "cudart_stub.cc",
)
_PLUGIN_LOGGERS = ("jax._src.xla_bridge", "jax._src.compiler", "jax_plugins", "absl")


@contextlib.contextmanager
def quiet(keep_unknown: bool = False) -> Iterator[None]:
    """Runs its block with file descriptor 2, ``sys.stderr`` and jax's plugin loggers
    silenced; with ``keep_unknown``, lines other than the known plugin noise are written
    to stderr afterwards."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    loggers = [logging.getLogger(name) for name in _PLUGIN_LOGGERS]
    levels = [logger.level for logger in loggers]
    saved = os.dup(2)
    text = io.StringIO()
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            for logger in loggers:
                logger.setLevel(logging.CRITICAL + 1)
            with contextlib.redirect_stderr(text):
                yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)
            _flush_c_stdio()  # C++ logging buffered in stdio goes to the sink, not later
            os.dup2(saved, 2)
            os.close(saved)
            if keep_unknown:
                sink.seek(0)
                captured = sink.read().decode(errors="replace") + text.getvalue()
                kept = [
                    line
                    for line in captured.splitlines(keepends=True)
                    if line.strip() and not any(noise in line for noise in _KNOWN_NOISE)
                ]
                if kept:
                    sys.stderr.write("".join(kept))
                    sys.stderr.flush()


def _flush_c_stdio() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
