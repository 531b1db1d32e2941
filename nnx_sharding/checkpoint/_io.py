"""The orbax side: a checkpoint's two items, the checks of a directory, the reads.

A checkpoint is an orbax composite checkpoint with the items ``state`` (the arrays, a
``PyTreeSave`` of a nested dict by Variable path) and ``nnx`` (a ``JsonSave`` of their
description, `_state.to_json`). A `Source` is where a restore reads them: a directory
(`DirectorySource`) or a Manager's step (`StepSource`). Orbax writes a checkpoint into
a temporary directory and renames it once complete; a directory it has not committed
is never read (`DirectorySource.check`, and the Manager offers committed steps only).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol, TypeAlias

import jax
import orbax.checkpoint as ocp
from etils import epath

from .. import _errors
from . import _integrity
from ._replace import ASIDE, STAGED, located
from ._state import Json, Nested

_integrity.install()  # every chunk written with its crc32c, checked on every read

PathLike: TypeAlias = str | os.PathLike[str]
"""A checkpoint directory: a local path, or a URL orbax can write (``gs://...``)."""
TreeMetadata: TypeAlias = Mapping[str, Any]
"""orbax's metadata of the saved arrays: a nested dict of ``ArrayMetadata`` (shape, dtype)."""

STATE = "state"
NNX = "nnx"


def as_path(directory: PathLike, transform: str = "checkpoint") -> epath.Path:
    """``directory`` as an absolute ``epath.Path``, ``~`` expanded (URLs are kept as they
    are); ValueError for an empty path (it would mean the current directory)."""
    text = os.fspath(directory)
    if not text.strip():
        raise ValueError(_errors.empty_checkpoint_path(transform, text))
    return epath.Path(text if "://" in text else os.path.abspath(os.path.expanduser(text)))


READ_FRACTION = 0.05
"""The bytes orbax may be reading at once, as a part of the arrays restored (`read_gb`)."""


def handlers(read_gb: float | None = None) -> dict[str, ocp.CheckpointHandler]:
    """The handler of each item, for `checkpointer` and the Manager: ``read_gb`` caps
    the bytes being read at once (orbax's ``restore_concurrent_gb``; None: its default)."""
    state = ocp.PyTreeCheckpointHandler(
        restore_concurrent_gb=read_gb,  # type: ignore[arg-type]
        use_zarr3=True,  # for tensorstore's crc32c codec (`_integrity`)
    )
    return {STATE: state, NNX: ocp.JsonCheckpointHandler()}


def checkpointer(read_gb: float | None = None) -> ocp.Checkpointer:
    """A synchronous orbax Checkpointer of our two items (every process calls it)."""
    items = handlers(read_gb)
    composite = ocp.CompositeCheckpointHandler(state=items[STATE], nnx=items[NNX])
    return ocp.Checkpointer(composite)


def read_gb(abstract: Nested) -> float:
    """How many GB orbax may be reading at once to restore ``abstract``: `READ_FRACTION`
    of all its arrays, and more than the largest (orbax wants a read, at most one array,
    to be strictly less than its cap).

    By default orbax reads every shard into a host buffer at once before putting it on
    its device: the buffers of a whole model, beside the model. Capped, the buffers are
    reused (measured: docs/checkpoints.md, "A model too big for one device").
    """
    sizes = [x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)]
    return (max([READ_FRACTION * sum(sizes), *sizes]) + 1024) / 1e9


def save_args(arrays: Nested, described: Json) -> ocp.args.Composite:
    return ocp.args.Composite(
        **{STATE: ocp.args.PyTreeSave(arrays), NNX: ocp.args.JsonSave(described)}
    )


def read_args(abstract: Nested) -> ocp.args.Composite:
    """Reads the arrays ``abstract`` names (``jax.ShapeDtypeStruct``\\ s with shardings),
    each shard by the devices that hold it, and nothing else of the checkpoint."""
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    return ocp.args.Composite(
        **{
            STATE: ocp.args.PyTreeRestore(
                item=abstract, restore_args=restore_args, partial_restore=True
            )
        }
    )


def json_args() -> ocp.args.Composite:
    return ocp.args.Composite(**{NNX: ocp.args.JsonRestore()})


def is_ours(path: epath.Path) -> bool:
    """Whether ``path`` has the two items of a checkpoint of this package."""
    return (path / STATE).is_dir() and (path / NNX).is_dir()


def listing(path: epath.Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


def check_destination(transform: str, path: epath.Path, force: bool) -> bool:
    """Whether a save to ``path`` replaces something there (an empty directory, or with
    ``force`` a checkpoint). Raises, before anything is written, ValueError for a file
    or a directory of other files, FileExistsError for a checkpoint without ``force``."""
    found_at = located(path)
    if not found_at.exists():
        return False
    if found_at != path:  # a replacement interrupted between its renames (`_replace`)
        if not force:
            raise FileExistsError(_errors.checkpoint_exists(transform, str(path)))
        return True
    if not path.is_dir():
        raise ValueError(_errors.overwrite_foreign(transform, str(path), None))
    found = listing(path)
    if not found:
        return True  # an empty directory: made for the checkpoint
    if not is_ours(path):
        raise ValueError(_errors.overwrite_foreign(transform, str(path), found))
    if not force:
        raise FileExistsError(_errors.checkpoint_exists(transform, str(path)))
    return True


def is_step_name(name: str) -> bool:
    """Whether ``name`` is what a Manager keeps in its directory: a step (``12``), one
    being written (``12.orbax-checkpoint-tmp-...``), one being replaced (`_replace`)."""
    step = name.split(".", 1)[0]
    rest = name[len(step) :]
    return step.isdigit() and (
        rest in ("", STAGED, ASIDE) or rest.startswith((".orbax-checkpoint-tmp", STAGED + "."))
    )


def check_manager_directory(transform: str, path: epath.Path) -> None:
    """Raises ValueError, before anything is written, unless ``path`` is missing, an
    empty directory, or one holding a Manager's steps only."""
    if not path.exists():
        return
    if not path.is_dir():
        raise ValueError(_errors.manager_not_a_directory(transform, str(path)))
    if is_ours(path):
        raise ValueError(_errors.manager_on_checkpoint(transform, str(path)))
    if foreign := [name for name in listing(path) if not is_step_name(name)]:
        raise ValueError(_errors.manager_foreign(transform, str(path), foreign))


class Source(Protocol):
    """Where `_restore.restore` reads a checkpoint."""

    transform: str
    name: str  # the directory, or the step in it, for messages

    def contents(self) -> tuple[TreeMetadata, Json]:
        """orbax's metadata of the arrays and the JSON item; reads no array."""
        ...

    def read(self, abstract: Nested) -> Nested:
        """The arrays ``abstract`` names, placed as its ShapeDtypeStructs say."""
        ...


class DirectorySource:
    """A checkpoint directory, checked before anything is read: it exists, orbax
    committed it, and it has our two items."""

    def __init__(self, transform: str, directory: PathLike):
        self.transform = transform
        self.name = str(as_path(directory, transform))
        # a replacement interrupted between its renames: the committed new one (`_replace`)
        self.path = located(as_path(directory, transform))
        self._checkpointer = checkpointer()

    def check(self) -> None:
        path = self.path
        if not path.exists():
            raise FileNotFoundError(_errors.checkpoint_not_found(self.transform, self.name))
        if not path.is_dir():
            raise ValueError(_errors.foreign_checkpoint(self.transform, self.name, None))
        if not ocp.path.step.is_path_finalized(path):
            raise ValueError(_errors.incomplete_checkpoint(self.transform, self.name))
        if not is_ours(path):
            steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and is_ours(p))
            raise ValueError(
                _errors.foreign_checkpoint(self.transform, self.name, listing(path), steps)
            )

    def contents(self) -> tuple[TreeMetadata, Json]:
        self.check()
        items = self._checkpointer.metadata(self.path).item_metadata
        tree = None if items is None else items[STATE]
        described = self._checkpointer.restore(self.path, args=json_args())[NNX]
        return _tree_of(tree), described

    def read(self, abstract: Nested) -> Nested:
        return read(self.path, abstract)


class StepSource:
    """A committed step of an orbax ``CheckpointManager``."""

    def __init__(self, transform: str, manager: ocp.CheckpointManager, step: int):
        self.transform = transform
        self.manager = manager
        self.step = step
        self.name = f"step {step} of {manager.directory}"

    def contents(self) -> tuple[TreeMetadata, Json]:
        tree = self.manager.item_metadata(self.step)[STATE]
        described = self.manager.restore(self.step, args=json_args())[NNX]
        return _tree_of(tree), described

    def read(self, abstract: Nested) -> Nested:
        # The Manager's handlers have orbax's default read cap: read the step directly.
        name_format = ocp.path.step.standard_name_format()  # the Manager's step names
        return read(
            ocp.path.step.build_step_path(self.manager.directory, name_format, self.step),
            abstract,
        )


def read(path: epath.Path, abstract: Nested) -> Nested:
    """The arrays ``abstract`` names from the checkpoint at ``path``, with `read_gb`."""
    return checkpointer(read_gb(abstract)).restore(path, args=read_args(abstract))[STATE]


def _tree_of(metadata: Any) -> TreeMetadata:
    """The nested dict of a ``TreeMetadata`` (empty when orbax found none)."""
    tree = getattr(metadata, "tree", metadata)
    return tree if isinstance(tree, Mapping) else {}
