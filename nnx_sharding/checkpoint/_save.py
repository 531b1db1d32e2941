"""`save`: a pytree of graph nodes written as one orbax checkpoint, as sharded now."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import jax
from etils import epath

from .. import _errors
from . import _integrity
from ._io import PathLike, as_path, check_destination, checkpointer, save_args
from ._replace import replace
from ._state import Json, Nested, Tree, savable


def save(directory: PathLike, tree: Tree, *, force: bool = False) -> None:
    """Saves the whole state of ``tree`` to ``directory``, each array as it is sharded now.

    ``tree`` is a pytree of graph nodes: a model, ``(model, optimizer)``, a dict of
    them. Every Variable of ``nnx.state(tree)`` is saved by its path: parameters,
    batch statistics, an ``nnx.Optimizer``'s step and optax state, ``nnx.Rngs``' keys
    and counts; a Variable shared by two paths is saved once. Each device writes its
    own shards (orbax); no array is gathered. The checkpoint is written to a temporary
    directory and renamed to ``directory`` once complete, so an interrupted save
    leaves nothing `restore` accepts. It returns when the checkpoint is committed.
    Every chunk of every array is stored with its CRC-32C checksum, which `restore`
    verifies.

    In a multi-process run every process calls it, with the same ``directory``.

    Args:
      directory: where to write; it must not exist, or be an empty directory.
      tree: the pytree of graph nodes to save, with concrete arrays.
      force: replace a checkpoint already at ``directory`` (never a directory of
        other files). The new one is written beside it and swapped in (renamed) once
        committed, and only then is the old one removed: a save interrupted at any
        point leaves the old checkpoint or the new one, complete.

    Raises:
      FileExistsError: ``directory`` holds a checkpoint (without ``force``).
      ValueError: ``directory`` is empty (``''``), a file, or a directory of other
        files; nothing is written.
      OSError: the checkpoint could not be written (a directory that is not writable,
        a full disk): one error naming the path; a checkpoint it was replacing is kept.
      TypeError: a leaf of ``tree`` is not a graph node, a Variable holds no
        concrete array (abstract, a tracer, deleted by donation, a Python value), or a
        module holds an array outside a Variable (``nnx.data``).

    >>> import shutil, tempfile
    >>> from flax import nnx
    >>> from nnx_sharding import checkpoint
    >>> directory = tempfile.mkdtemp()
    >>> checkpoint.save(directory, nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> checkpoint.save(directory, nnx.Linear(2, 3, rngs=nnx.Rngs(1)), force=True)
    >>> shutil.rmtree(directory)
    """
    transform = "checkpoint.save"
    arrays, described = savable(transform, tree)
    path = as_path(directory, transform)
    if check_destination(transform, path, force):
        replace(
            path,
            lambda to: write(transform, to, arrays, described, str(path)),
            jax.process_index() == 0,
        )
    else:
        write(transform, path, arrays, described)


def write(
    transform: str, path: epath.Path, arrays: Nested, described: Json, name: str | None = None
) -> None:
    """Writes a new checkpoint at ``path`` (orbax: into a temporary directory, renamed
    once complete); a failure is one OSError naming ``name`` (default: ``path``),
    nothing left behind."""
    probe(transform, path, name)
    try:
        with _integrity.quiet():
            checkpointer().save(path, args=save_args(arrays, described))
    except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
        raise write_failure(transform, path, e, name) from None


def probe(transform: str, path: epath.Path, name: str | None = None) -> None:
    """Raises `write_failure` unless a directory can be made beside ``path`` (a local
    one; its parents are made). Orbax, failing to make its temporary directory, leaves
    its writer threads waiting minutes for it (and the interpreter's exit with them)."""
    text = os.fspath(path)
    if "://" in text:
        return
    try:
        parent = Path(text).parent
        parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".nnx-checkpoint-probe-", dir=parent))
    except OSError as e:
        raise write_failure(transform, path, e, name) from None


def write_failure(
    transform: str, path: epath.Path, error: BaseException, name: str | None = None
) -> OSError:
    """``error``, raised while writing ``path``, as one OSError naming it (``name``:
    how, e.g. ``step 2 of DIR``), with the errno behind it; uncommitted leftovers are
    removed."""
    for temporary in path.parent.glob(f"{path.name}.orbax-checkpoint-tmp*"):
        try:
            temporary.rmtree()
        except OSError:
            pass  # a directory that cannot be written cannot be cleaned either
    number, cause = _integrity.fault(error)
    message = _errors.write_failed(transform, name or str(path), cause)
    if number is None:
        return OSError(message)
    return OSError(number, message)  # PermissionError, ... by the errno
