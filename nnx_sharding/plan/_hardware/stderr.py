"""The compilers' output on file descriptor 2, kept off the terminal: their start-up
noise where they are loaded (`quiet`), and their log lines while planning, each given
to the plan whose compile wrote it (`capturing`, `offset`, `since`).

On a machine without those accelerators, jax's CUDA plugin logs "Could not find cuda
drivers" from C++ when its library loads, and libtpu logs host-discovery errors when
asked for a topology: `quiet` runs such a call with descriptor 2, ``sys.stderr`` and
jax's plugin loggers silenced.

XLA logs from C++ to descriptor 2 (the GPU compiler's "Can't reduce memory use below ...
by rematerialization" when a program exceeds the device's memory), one line per message
in absl's format, which names the thread that wrote it::

    W1127 11:00:02.499349   12508 hlo_rematerialization.cc:3231] Can't reduce ...

While `capturing` runs, descriptor 2 goes to a file; `since` reads back the warnings
and errors the calling thread has logged since an offset (each candidate compiles in
one thread, two at a time). Lines that are not absl's (a step's own prints while it is
traced) are written to the terminal when planning ends; absl's lines are kept only in
the plans they concern.

Importing this module does nothing else (importing ``nnx_sharding`` does not import it).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

KNOWN_NOISE = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "WARNING: Logging before InitGoogle() is written to STDERR",
    "cudart_stub.cc",
)
"""Lines the compilers' libraries print when they start on a machine without their
accelerator: never shown."""
_PLUGIN_LOGGERS = ("jax._src.xla_bridge", "jax._src.compiler", "jax_plugins", "absl")
_ABSL = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+(\d+) [^\]\s]+\] (.*)$")
_active: list[int] = []  # the capture file's descriptors, innermost last


@contextlib.contextmanager
def quiet(keep_unknown: bool = False) -> Iterator[None]:
    """Runs its block with file descriptor 2, ``sys.stderr`` and jax's plugin loggers
    silenced; with ``keep_unknown``, lines other than `KNOWN_NOISE` are written to
    stderr afterwards."""
    loggers = [logging.getLogger(name) for name in _PLUGIN_LOGGERS]
    levels = [logger.level for logger in loggers]
    text = io.StringIO()
    with _redirected() as sink:
        try:
            for logger in loggers:
                logger.setLevel(logging.CRITICAL + 1)
            with contextlib.redirect_stderr(text):
                yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)
            _flush_c_stdio()  # C++ logging buffered in stdio goes to the sink, not later
    if keep_unknown:
        _write_unknown(sink.text + text.getvalue(), absl=True)


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Runs its block with descriptor 2 sent to a file (see the module's docstring)."""
    with _redirected() as sink:
        _active.append(sink.fd)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            _active.pop()
    _write_unknown(sink.text, absl=False)


def offset() -> int:
    """Where the capture file ends now (0 when nothing is captured)."""
    return os.fstat(_active[-1]).st_size if _active else 0


def since(start: int) -> list[str]:
    """The warnings and errors this thread has logged since ``start``, each once, in
    the order written (none when nothing is captured)."""
    if not _active:
        return []
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    fd = _active[-1]
    size = os.fstat(fd).st_size
    text = os.pread(fd, max(size - start, 0), start).decode(errors="replace")
    me = str(threading.get_native_id())
    out: list[str] = []
    for line in text.splitlines():
        found = _ABSL.match(line.strip())
        if found and found[1] in "WEF" and found[2] == me and found[3] not in out:
            out.append(found[3].strip())
    return out


class _Sink:
    """Where descriptor 2 went: the file's descriptor while redirected, its text after."""

    def __init__(self, fd: int):
        self.fd, self.text = fd, ""


@contextlib.contextmanager
def _redirected() -> Iterator[_Sink]:
    """Descriptor 2 sent to a temporary file while the block runs; what it received is
    the sink's ``text`` once the block has left."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as file:
        sink = _Sink(file.fileno())
        os.dup2(sink.fd, 2)
        try:
            yield sink
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.text = os.pread(sink.fd, os.fstat(sink.fd).st_size, 0).decode(errors="replace")


def _write_unknown(text: str, absl: bool) -> None:
    """``text``'s lines to stderr, but for `KNOWN_NOISE` and, unless ``absl``, absl's."""
    kept = [
        line
        for line in text.splitlines(keepends=True)
        if line.strip()
        and (absl or not _ABSL.match(line.strip()))
        and not any(noise in line for noise in KNOWN_NOISE)
    ]
    if kept:
        sys.stderr.write("".join(kept))
        sys.stderr.flush()


def _flush_c_stdio() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
