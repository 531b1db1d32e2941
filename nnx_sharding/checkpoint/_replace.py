"""Replacing a checkpoint without a moment where neither the old nor the new one exists.

A checkpoint that replaces another (``save(..., force=True)``, ``Manager.save(step, ...,
force=True)``) is written beside it, at `staged` (``<name>.nnx-new``; orbax writes it
into a temporary directory and renames it there once committed), and only then swapped
in: the old one is renamed to `aside` (``<name>.nnx-old``), the new one to ``<name>``,
and the old one is removed. A process killed at any point leaves one of:

1. ``<name>`` (the old one) and perhaps an uncommitted or committed ``<name>.nnx-new``:
   the old one is the checkpoint; the new one, never swapped in, is removed later;
2. no ``<name>``, ``<name>.nnx-old`` and a committed ``<name>.nnx-new`` (killed between
   the two renames): the new one is the checkpoint (`located` reads it there);
3. ``<name>`` (the new one) and what is left of ``<name>.nnx-old``: the new one.

`located` is where a restore reads (it never changes the files, so every process of a
run may call it); `recover` puts the files back in order (case 2: the new one renamed
to ``<name>``; the leftovers removed), and runs before the next save. Renames are
atomic on local (POSIX) filesystems; on object stores (``gs://``) a rename is a copy.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import orbax.checkpoint as ocp
from etils import epath

STAGED = ".nnx-new"
ASIDE = ".nnx-old"


def staged(path: epath.Path) -> epath.Path:
    """Where the checkpoint replacing ``path`` is written before it is swapped in."""
    return path.parent / (path.name + STAGED)


def aside(path: epath.Path) -> epath.Path:
    """Where the checkpoint at ``path`` goes while its replacement is swapped in."""
    return path.parent / (path.name + ASIDE)


def committed(path: epath.Path) -> bool:
    """Whether orbax committed a checkpoint at ``path``."""
    return path.is_dir() and ocp.path.step.is_path_finalized(path)


def located(path: epath.Path) -> epath.Path:
    """Where the checkpoint saved at ``path`` is: ``path``, or, when a replacement was
    interrupted between its two renames, the committed new one beside it (case 2).
    Changes nothing on disk."""
    if not path.exists():
        if committed(staged(path)):
            return staged(path)
        if committed(aside(path)):  # not left by `replace`; an old one put back by hand
            return aside(path)
    return path


def recover(path: epath.Path) -> None:
    """Finishes or undoes a replacement of ``path`` that was interrupted: afterwards
    ``path`` is the checkpoint `located` found, and nothing of ours is beside it."""
    found = located(path)
    if found != path:
        found.rename(path)
    for leftover in (staged(path), aside(path)):
        if leftover.exists():
            leftover.rmtree()
    for temporary in path.parent.glob(f"{path.name}{STAGED}.orbax-checkpoint-tmp*"):
        temporary.rmtree()


def replace(path: epath.Path, write: Callable[[epath.Path], None], primary: bool) -> None:
    """Writes a checkpoint with ``write(directory)`` and puts it at ``path`` in place of
    what is there (a checkpoint, or an empty directory), the old one removed only once
    the new one is committed. ``primary``: this process moves the files (in a
    multi-process run, one process does; every process calls ``write``)."""
    if primary:
        recover(path)
    sync("nnx_sharding_checkpoint_replace_recovered")
    new = staged(path)
    write(new)
    if primary:
        old = aside(path)
        if path.exists():
            path.rename(old)
        new.rename(path)
        if old.exists():
            old.rmtree()
    sync("nnx_sharding_checkpoint_replace_done")


def sync(name: str) -> None:
    """A barrier of all processes (nothing to wait for in a single-process run)."""
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(name)
