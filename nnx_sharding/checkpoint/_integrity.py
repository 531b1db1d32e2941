"""Checksums of every stored chunk, and the errors of damaged files and failed writes.

Arrays are stored as zarr v3 (orbax's ``use_zarr3``), each chunk encoded
``bytes -> zstd -> crc32c``: tensorstore's ``crc32c`` codec appends the CRC-32C of the
encoded chunk and checks it on every read, so a damaged chunk is an error of the read
(``DATA_LOSS: ... Digest mismatch``), never wrong values; the shard index of each chunk
file has its own ``crc32c`` (orbax's). Orbax 0.12 has no option for the chunk codecs:
`install` wraps the function that builds its zarr v3 metadata (the only change is the
added codec; the files stay standard zarr v3, readable by orbax and tensorstore alone).

`read_failure` and `write_failure` turn orbax's errors into one message: the Variable
whose data is damaged or missing, the path that could not be written.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from orbax.checkpoint._src.serialization import tensorstore_utils

CRC32C = {"name": "crc32c"}


def _with_checksum(build: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    @functools.wraps(build)  # orbax's own stays reachable as ``__wrapped__``
    def build_checksummed(*args: Any, **kwargs: Any) -> dict[str, Any]:
        metadata = build(*args, **kwargs)
        for codec in metadata.get("codecs", []):
            if codec.get("name") == "sharding_indexed":
                inner = codec.setdefault("configuration", {}).setdefault("codecs", [])
                if CRC32C not in inner:
                    inner.append(dict(CRC32C))
        return metadata

    build_checksummed.nnx_sharding_checksum = True  # type: ignore[attr-defined]
    return build_checksummed


def install() -> None:
    """Makes orbax add the ``crc32c`` codec to every zarr v3 chunk it writes (once)."""
    build = tensorstore_utils._build_zarr3_metadata  # noqa: SLF001 - see the module doc
    if not getattr(build, "nnx_sharding_checksum", False):
        tensorstore_utils._build_zarr3_metadata = _with_checksum(build)  # noqa: SLF001


def chunk_codecs(zarr_json: Mapping[str, Any]) -> list[str]:
    """The names of a stored array's chunk codecs (``zarr.json``), for tests and docs.

    >>> chunk_codecs({'codecs': [{'name': 'sharding_indexed', 'configuration': {
    ...     'codecs': [{'name': 'bytes'}, {'name': 'crc32c'}]}}]})
    ['bytes', 'crc32c']
    """
    for codec in zarr_json.get("codecs", []):
        if codec.get("name") == "sharding_indexed":
            return [c["name"] for c in codec.get("configuration", {}).get("codecs", [])]
    return [c["name"] for c in zarr_json.get("codecs", [])]


_ARRAY = re.compile(r'(?:reading|in) "([^"/]+)/')


def damaged_names(error: BaseException) -> list[str]:
    """The stored array names tensorstore's messages in ``error`` (and its causes)
    name (``Error reading shard entry ... in "up.kernel/c/0/0"``), in order, once each.

    >>> damaged_names(ValueError('DATA_LOSS: Error reading "a.b/c/0" in OCDBT ...'))
    ['a.b']
    """
    names: dict[str, None] = {}
    for e in chain(error):
        names.update(dict.fromkeys(_ARRAY.findall(str(e))))
    return list(names)


_DAMAGE = ("DATA_LOSS", "OUT_OF_RANGE", "Error reading", "Digest mismatch", "corrupt")


def is_damage(error: BaseException) -> bool:
    """Whether ``error`` (from a read) says stored data is damaged, cut short or missing
    (tensorstore's status codes and messages), not some other failure."""
    return any(mark in str(e) for e in chain(error) for mark in _DAMAGE)


def chain(error: BaseException) -> Iterable[BaseException]:
    """``error`` and its causes (``__cause__``, else ``__context__``), outermost first."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def root_line(error: BaseException, at_most: int = 300) -> str:
    """The innermost cause of ``error`` in one line: its type and the first line of its
    message (tensorstore appends its whole spec to some messages)."""
    *_, root = chain(error)
    text = (str(root).strip().splitlines() or [""])[0]
    text = text.split(" See full TensorStore details")[0]
    if len(text) > at_most:
        text = text[: at_most - 3] + "..."
    return f"{type(root).__name__}: {text}" if text else type(root).__name__


def os_error(error: BaseException) -> OSError | None:
    """The first OSError in ``error``'s chain (a full disk, a read-only directory)."""
    return next((e for e in chain(error) if isinstance(e, OSError)), None)


_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")


def fault(error: BaseException) -> tuple[int | None, str]:
    """The errno behind a failed write and its one-line cause (``No space left on
    device``): an OSError's, or the one tensorstore names in its message; else
    `root_line`."""
    found = os_error(error)
    number = found.errno if found is not None else None
    if number is None:
        match = next((m for e in chain(error) for m in [_OS_ERROR_CODE.search(str(e))] if m), None)
        number = int(match.group(1)) if match else None
    if number is None:
        return None, root_line(error)
    return number, os.strerror(number)


def collect_orphans() -> None:
    """Collects what a failed orbax read left behind, quietly.

    When one array's read fails, orbax's other reads (coroutines holding a slot of its
    byte limiter) are left unfinished on an event loop it then closes; when they are
    collected, each prints "Exception ignored ... Event loop is closed" (or the read
    error of another shard). They are collected here, at once, with those messages
    dropped (any other is printed).
    """
    hook = sys.unraisablehook

    def quiet(unraisable: Any) -> None:
        error = unraisable.exc_value
        closed = isinstance(error, RuntimeError) and "loop is closed" in str(error)
        if not (closed or (error is not None and is_damage(error))):
            hook(unraisable)

    sys.unraisablehook = quiet
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


class _QuietOrbax(logging.Filter):
    """Drops orbax's error logs (tracebacks of its background threads) while one of our
    saves is in flight: the error they report reaches the caller as one exception."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        ours = self.in_flight > 0 and record.levelno >= logging.ERROR
        return not (ours and f"{os.sep}orbax{os.sep}" in record.pathname)


_QUIET = _QuietOrbax()
logging.getLogger("absl").addFilter(_QUIET)


def quiet_begin() -> None:
    """A save of ours starts (orbax's error logs are dropped until `quiet_end`)."""
    with _QUIET.lock:
        _QUIET.in_flight += 1


def quiet_end() -> None:
    with _QUIET.lock:
        _QUIET.in_flight = max(0, _QUIET.in_flight - 1)


@contextmanager
def quiet() -> Iterator[None]:
    """`quiet_begin` ... `quiet_end` around a synchronous save."""
    quiet_begin()
    try:
        yield
    finally:
        quiet_end()
