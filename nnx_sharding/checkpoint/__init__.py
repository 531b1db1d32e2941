"""Checkpoints of sharded nnx models, on orbax: save on one layout, restore on another.

- `save`: a pytree of graph nodes (a model, ``(model, optimizer)``, a dict of them) to
  a directory, every array as it is sharded now, each device writing its own shards.
- `restore`: into a target of the same structure, abstract (``nnx.eval_shape``) or
  concrete, laid out by a `StateSharding` (or a prefix of them, as `jit` takes), the
  target's own shardings or its sharding metadata; each device reads only its shards.
  ``filter=nnx.Param`` restores part of it.
- `Manager`: numbered steps of a training loop, the last N kept, saved in the
  background; steps whose save was interrupted are never offered.

A checkpoint is an orbax checkpoint with two items: ``state`` (the arrays, by
Variable path) and ``nnx`` (their description, as JSON). Importing this module imports
orbax; ``import nnx_sharding`` alone does not. See ``docs/checkpoints.md``.
"""

from ._io import PathLike as PathLike
from ._manager import Manager as Manager
from ._restore import restore as restore
from ._save import save as save
from ._shardings import Shardings as Shardings

__all__ = ["Manager", "PathLike", "Shardings", "restore", "save"]
