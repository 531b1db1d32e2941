"""`save`: a pytree of graph nodes written as one orbax checkpoint, as sharded now."""

from __future__ import annotations

from ._io import PathLike, as_path, check_destination, checkpointer, save_args
from ._state import Tree, savable


def save(directory: PathLike, tree: Tree, *, force: bool = False) -> None:
    """Saves the whole state of ``tree`` to ``directory``, each array as it is sharded now.

    ``tree`` is a pytree of graph nodes: a model, ``(model, optimizer)``, a dict of
    them. Every Variable of ``nnx.state(tree)`` is saved by its path: parameters,
    batch statistics, an ``nnx.Optimizer``'s step and optax state, ``nnx.Rngs``' keys
    and counts; a Variable shared by two paths is saved once. Each device writes its
    own shards (orbax); no array is gathered. The checkpoint is written to a temporary
    directory and renamed to ``directory`` once complete, so an interrupted save
    leaves nothing `restore` accepts. It returns when the checkpoint is committed.

    In a multi-process run every process calls it, with the same ``directory``.

    Args:
      directory: where to write; it must not exist, or be an empty directory.
      tree: the pytree of graph nodes to save, with concrete arrays.
      force: replace a checkpoint already at ``directory`` (never a directory of
        other files). The old one is deleted first, as orbax does: if this save is
        interrupted, neither remains.

    Raises:
      FileExistsError: ``directory`` holds a checkpoint (without ``force``) or other
        files.
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
    arrays, described = savable("checkpoint.save", tree)
    path = as_path(directory)
    replace = check_destination("checkpoint.save", path, force)
    checkpointer().save(path, args=save_args(arrays, described), force=replace)
