"""libtpu's own log: the device memory of each TPU program it compiles, as the compiler
counts it when it decides whether the program fits.

The TPU compiler's ``memory_analysis`` gives the device's temporaries as
``temp_size_in_bytes``, which counts their fragmentation twice, and a peak that, once a
program offloads activations to the host, counts the host's buffers instead of the
chip's. Its own report of a compile, which libtpu logs at INFO, counts each once::

    I1129 21:09:10.039874    2412 deepsea_compiler_backend.cc:2171] Total hbm usage >= 30.25G:
        reserved        250.00M
        program          18.00G
        arguments        12.00G

    Output size 12.00G; shares 12.00G with arguments.

    Total host usage >= 20.00G:
        reserved             0B
        program          20.00G
        arguments            0B

(The offloaded Llama 3.1 recipes on v6e fit by this report and not by
``temp_size_in_bytes``: docs/planning/predictions.md, "Host offload and long
context".) libtpu logs it for each program above a trivial size, to a file of its own
per process (``$TPU_LOG_DIR``, else ``/tmp/tpu_logs``), buffered unless its
``logbuflevel`` flag is -1, which the planner sets when it loads libtpu (`LIBTPU_ARGS`).
Each report is one message, so its lines stay together when two candidates compile at
once, but they name no compile: the thread that logs it is libtpu's, not the caller's.
So programs that offload compile one at a time (`compiling`), and a compile's report
is the one logged during it whose arguments and host bytes are the compile's own
(`program_bytes`); programs that do not offload log no host bytes, so theirs never
match.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import threading
from collections.abc import Iterator

LIBTPU_ARGS = "--logbuflevel=-1"
"""libtpu's flag that writes its log as it goes (else its INFO lines wait in a buffer)."""

_REPORT = re.compile(
    r"Total hbm usage >= \S+:\s*\n\s*reserved\s+\S+\s*\n\s*program\s+(\S+)\s*\n"
    r"\s*arguments\s+(\S+)\s*\n(?:.*\n){0,4}?\s*Total host usage >= \S+:\s*\n"
    r"\s*reserved\s+\S+\s*\n\s*program\s+(\S+)"
)
_SIZE = re.compile(r"^(\d+(?:\.(\d+))?)([BKMGT])$")
_UNITS = {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclasses.dataclass(frozen=True)
class Mark:
    """Where this process's libtpu log ended: its file (None when there is none) and
    its size then."""

    path: str | None
    size: int


def log_file() -> str | None:
    """This process's libtpu INFO log, the newest if it rotated; None when there is none."""
    folder = os.environ.get("TPU_LOG_DIR") or "/tmp/tpu_logs"
    found = glob.glob(os.path.join(folder, f"*.log.INFO.*.{os.getpid()}"))
    return max(found, key=os.path.getmtime) if found else None


def mark() -> Mark:
    """Where this process's libtpu log ends now."""
    path = log_file()
    return Mark(path, os.path.getsize(path) if path else 0)


_OFFLOADING = threading.Lock()  # held by the compile of a program that offloads


@contextlib.contextmanager
def compiling(offloads: bool) -> Iterator[Mark | None]:
    """Runs its block, a TPU compile, and yields where libtpu's log ended as it began,
    when the program ``offloads`` activations to the host (else None): then with no
    other compile of such a program in this process beside it, so that the one report
    logged meanwhile with the program's host bytes is its own."""
    if not offloads:
        yield None
        return
    with _OFFLOADING:
        yield mark()


def program_bytes(since: Mark, arguments: int, host: int) -> int | None:
    """The device bytes of the program compiled since ``since`` whose report gives
    ``arguments`` bytes of arguments and ``host`` bytes of host buffers, to the report's
    precision; None when libtpu logged no such report, or more than one (two programs
    with the same arguments and host bytes compiled at once: see `compiling`)."""
    path = log_file()
    if path is None:
        return None
    start = since.size if path == since.path else 0
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    found = {
        parsed[0]
        for program, args, on_host in reports(text)
        if _matches(args, arguments)
        and _matches(on_host, host)
        and (parsed := _bytes(program)) is not None
    }
    return found.pop() if len(found) == 1 else None


def reports(text: str) -> list[tuple[str, str, str]]:
    """The memory reports in ``text``: each program's device bytes, its arguments' and
    its host buffers', as libtpu prints them.

    >>> reports('Total hbm usage >= 2.0G:\\n reserved 1M\\n program 1.5G\\n arguments 0.5G\\n'
    ...         '\\nTotal host usage >= 1.0G:\\n reserved 0B\\n program 1.0G\\n')
    [('1.5G', '0.5G', '1.0G')]
    """
    return [m.groups() for m in _REPORT.finditer(text)]


def _bytes(size: str) -> tuple[int, float] | None:
    """A size as libtpu prints it (``18.10G``, ``608.5K``, ``0B``): its bytes, and half
    its last printed digit in bytes (what its rounding may hide); None for what is not a
    size (a program with no host buffers prints ``unknown size``)."""
    found = _SIZE.match(size)
    if found is None:
        return None
    unit = _UNITS[found[3]]
    decimals = len(found[2] or "")
    return round(float(found[1]) * unit), 0.5 * unit * 10.0**-decimals


def _matches(size: str, count: int) -> bool:
    parsed = _bytes(size)
    return parsed is not None and abs(parsed[0] - count) <= parsed[1] + 1
