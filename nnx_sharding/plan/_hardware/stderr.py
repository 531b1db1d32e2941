"""The compilers' log lines, kept off the terminal while planning and given to the plan
whose compile wrote them.

XLA logs from C++ to file descriptor 2 (the GPU compiler's "Can't reduce memory use
below ... by rematerialization" when a program exceeds the device's memory), one line
per message in absl's format, which names the thread that wrote it::

    W1127 11:00:02.499349   12508 hlo_rematerialization.cc:3231] Can't reduce ...

While `capturing` runs, descriptor 2 goes to a file; `since` reads back the warnings
and errors the calling thread has logged since an offset (each candidate compiles in
one thread, two at a time). Lines that are not absl's (a step's own prints while it is
traced) are written to the terminal when planning ends; absl's lines are kept only in
the plans they concern.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

_ABSL = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+(\d+) [^\]\s]+\] (.*)$")
_KNOWN_NOISE = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "WARNING: Logging before InitGoogle() is written to STDERR",
    "cudart_stub.cc",
)
_active: list[int] = []  # the capture file's descriptors, innermost last


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Runs its block with descriptor 2 sent to a file (see the module's docstring)."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        _active.append(sink.fileno())
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            _active.pop()
            os.dup2(saved, 2)
            os.close(saved)
            size = os.fstat(sink.fileno()).st_size
            text = os.pread(sink.fileno(), size, 0).decode(errors="replace")
            kept = [
                line
                for line in text.splitlines(keepends=True)
                if line.strip()
                and not _ABSL.match(line.strip())
                and not any(noise in line for noise in _KNOWN_NOISE)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


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
