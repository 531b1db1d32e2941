"""A replacing save killed at one point of its course (tests/checkpoint/test_replace.py).

    python tests/checkpoint/replace_worker.py DIRECTORY POINT N MODE

MODE ``save``: `checkpoint.save` writes `tree` ``(N, 1)`` (the old checkpoint) to
``DIRECTORY/ck``, then replaces it with `tree` ``(N, 2)`` (``force=True``); MODE
``manager``: the same as step 5 of a Manager in DIRECTORY. The process kills itself
(SIGKILL) at POINT of the replacement:

- ``before``: as the new checkpoint's write starts;
- ``during``: once orbax has made the new one's temporary directory (a big N makes the
  write last);
- ``committed``: the new one committed beside the old, before any rename;
- ``aside``: the old one renamed aside, the new one not yet in its place;
- ``swapped``: the new one in place, the old one not yet removed;
- ``removing``: half of the old one's files removed.

It prints ``not killed`` if POINT never came.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
from etils import epath  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_sharding import checkpoint  # noqa: E402
from nnx_sharding.checkpoint import _save  # noqa: E402

PARAMS = 4


class Tree(nnx.Module):
    """``PARAMS`` n x n Params, each holding values of its own for a ``seed``: a
    checkpoint that mixed two saves would hold some Params of each."""

    def __init__(self, n: int, seed: int):
        ramp = jnp.arange(n * n, dtype=jnp.float32).reshape(n, n)
        self.w = nnx.List([nnx.Param(ramp + 1000.0 * seed + i) for i in range(PARAMS)])


def die(why: str) -> None:
    print("killing", why, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str, directory: Path, name: str) -> None:
    """Makes this process kill itself at ``point`` of replacing ``directory / name``."""
    gpath = type(epath.Path(directory))
    if point == "before":
        _save.checkpointer = lambda *a, **k: die("before the write")  # type: ignore[assignment]
    elif point == "during":

        def watch() -> None:
            while True:
                started = [n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n]
                if started:
                    die(f"during the write: {sorted(os.listdir(directory))}")

        threading.Thread(target=watch, daemon=True).start()
    elif point in ("committed", "aside"):
        rename = gpath.rename
        source = name if point == "committed" else name + ".nnx-new"

        def renaming(self, target):  # type: ignore[no-untyped-def]
            if self.name == source:
                die(f"{point}: {sorted(os.listdir(directory))}")
            return rename(self, target)

        gpath.rename = renaming  # type: ignore[method-assign]
    elif point in ("swapped", "removing"):
        rmtree = gpath.rmtree

        def removing(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if self.name == name + ".nnx-old":
                if point == "removing":
                    files = sorted(p for p in Path(self).rglob("*") if p.is_file())
                    for file in files[: len(files) // 2]:
                        file.unlink()
                die(f"{point}: {sorted(os.listdir(directory))}")
            return rmtree(self, *args, **kwargs)

        gpath.rmtree = removing  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown point {point!r}")


def main() -> None:
    directory, point, n, mode = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    directory.mkdir(parents=True, exist_ok=True)
    if mode == "save":
        checkpoint.save(directory / "ck", Tree(n, 1))
        arm(point, directory, "ck")
        checkpoint.save(directory / "ck", Tree(n, 2), force=True)
    else:
        manager = checkpoint.Manager(directory)
        manager.save(5, Tree(n, 1))
        manager.wait_until_finished()
        arm(point, directory, "5")
        manager.save(5, Tree(n, 2), force=True)
        manager.close()
    print("not killed", flush=True)


if __name__ == "__main__":
    main()
