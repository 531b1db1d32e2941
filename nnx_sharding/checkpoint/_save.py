"""`save`: a pytree of graph nodes written as one orbax checkpoint, as sharded now."""

from __future__ import annotations

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
        replace(path, lambda to: write(transform, to, arrays, described), jax.process_index() == 0)
    else:
        write(transform, path, arrays, described)


def write(transform: str, path: epath.Path, arrays: Nested, described: Json) -> None:
    """Writes a new checkpoint at ``path`` (orbax: into a temporary directory, renamed
    once complete); a failure is one OSError naming ``path``, nothing left behind."""
    try:
        checkpointer().save(path, args=save_args(arrays, described))
    except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
        raise write_failure(transform, path, e) from None


def write_failure(transform: str, path: epath.Path, error: BaseException) -> OSError:
    """``error``, raised while writing ``path``, as one OSError naming the path (the
    errno of the OSError behind it, if any); uncommitted leftovers are removed."""
    for temporary in path.parent.glob(f"{path.name}.orbax-checkpoint-tmp*"):
        try:
            temporary.rmtree()
        except OSError:
            pass  # a directory that cannot be written cannot be cleaned either
    cause = _integrity.os_error(error)
    message = _errors.write_failed(transform, str(path), _integrity.root_line(error))
    if cause is None or cause.errno is None:
        return OSError(message)
    return OSError(cause.errno, message)  # PermissionError, ... by the errno
