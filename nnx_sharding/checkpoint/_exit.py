"""Managers still open when the interpreter ends: their pending saves are committed.

When the main module ends, Python first runs ``threading``'s exit callbacks, newest
first, then joins the non-daemon threads, and only then runs ``atexit`` handlers. One of
those callbacks is ``concurrent.futures``' (registered when ``concurrent.futures.thread``
is imported), which stops its thread pools for good; orbax's background save needs them
to commit (its finishing steps submit work to thread pools), so a save still pending
then fails ("cannot schedule new futures after interpreter shutdown") and its step is
lost, and its thread may wait forever. An ``atexit`` handler runs too late.

`track` therefore registers, once, a callback of the same kind, after importing
``concurrent.futures.thread``: being newer, it runs before the pools are stopped, and
closes every Manager still open (each waits for its save to be committed). The hook is
``threading._register_atexit``, the one ``concurrent.futures`` itself uses; Python has
no public hook that runs before it (``atexit`` runs after). Where the interpreter lacks
it, ``atexit`` is used: the best available there.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit callback must be older than ours
import sys
import threading
import weakref
from typing import Protocol


class Closable(Protocol):
    def close_at_exit(self) -> None: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()
_registered = False
_lock = threading.Lock()


def track(manager: Closable) -> None:
    """Closes ``manager`` at interpreter exit if it is still open then."""
    global _registered
    with _lock:
        _open.add(manager)
        if not _registered:
            register = getattr(threading, "_register_atexit", None)
            try:
                (register or atexit.register)(_close_all)
            except RuntimeError:  # already shutting down: nothing to run it later
                atexit.register(_close_all)
            _registered = True


def untrack(manager: Closable) -> None:
    with _lock:
        _open.discard(manager)


def _close_all() -> None:
    """Commits every open Manager's pending save; a save that fails is one line on
    stderr (the exit goes on: raising here would leave the other Managers open)."""
    with _lock:
        managers = list(_open)
        _open.clear()
    for manager in managers:
        try:
            manager.close_at_exit()
        except Exception as e:  # noqa: BLE001 - reported, the exit goes on
            first = (str(e).splitlines() or [type(e).__name__])[0]
            print(f"nnx_sharding.checkpoint: at exit: {first}", file=sys.stderr)
