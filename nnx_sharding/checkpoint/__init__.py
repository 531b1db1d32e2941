"""Checkpoints of sharded nnx models, on orbax: save on one layout, restore on another.

- `save`: a pytree of graph nodes (a model, ``(model, optimizer)``, a dict of them) to
  a directory, every array as it is sharded now, each device writing its own shards.
- `restore`: into a target of the same structure, abstract (``nnx.eval_shape``) or
  concrete, laid out by a `StateSharding` (or a prefix of them, as `jit` takes), the
  target's own shardings or its sharding metadata; each device reads only its shards.
  ``filter=nnx.Param`` restores part of it.
- `Manager`: numbered steps of a training loop, the last N kept, saved in the
  background; steps whose save was interrupted are never offered, and a Manager still
  open when the program ends commits its pending save first.

A save interrupted at any point leaves the previous checkpoint or the new one, complete
(a replaced checkpoint is removed only once its successor is committed). Every chunk of
every array is stored with its CRC-32C, which every read checks; `restore` also checks
each Variable's path, shape, dtype and type before reading, and reads every array
before setting any Variable: on an error the target is as it was.

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
