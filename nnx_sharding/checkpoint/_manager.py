"""`Manager`: numbered checkpoints of a training loop, over orbax's ``CheckpointManager``."""

from __future__ import annotations

import operator
import types
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError

from .. import _errors
from .._state_sharding import Filter
from . import _exit, _integrity, _replace
from ._io import PathLike, StepSource, as_path, check_manager_directory, handlers, save_args
from ._restore import restore_from
from ._save import probe, write, write_failure
from ._shardings import Shardings
from ._state import Tree, savable

T = TypeVar("T")


class Manager:
    """Numbered checkpoints in one directory: ``directory/<step>``, each a checkpoint of
    `save`'s format (so ``checkpoint.restore(directory / '<step>', ...)`` reads it too).

    A thin layer over ``orbax.checkpoint.CheckpointManager``: it keeps the last
    ``max_to_keep`` steps (None: all), and with ``async_save`` (the default) `save`
    returns once the arrays are copied off the devices, writing them in the
    background while training goes on; the next `save`, `restore`,
    `latest_step`, `all_steps`, `wait_until_finished` or `close` waits for it. A
    step is offered (`latest_step`, `all_steps`, `restore`) only once orbax has
    committed it: a save interrupted half way (the process killed) leaves an
    uncommitted temporary directory, which is never read (orbax removes it later).
    A Manager still open when the program ends is closed then, before Python stops
    its threads: the save in the background is committed first (`close`, or ``with``,
    does it earlier). Every chunk of every array is stored with its checksum, which
    `restore` verifies.

    In a multi-process run every process makes the Manager and calls its methods, with
    the same directory and steps.

    Args:
      directory: where the steps go: a new directory (created), an empty one, or
        one a Manager wrote; anything else (a file, other files, ``''``) is a
        ValueError, before anything is written.
      max_to_keep: how many of the newest steps to keep (None: keep all).
      async_save: write in the background (True) or return when committed (False).

    >>> import shutil, tempfile
    >>> from flax import nnx
    >>> from nnx_sharding import checkpoint
    >>> model, directory = nnx.Linear(2, 3, rngs=nnx.Rngs(0)), tempfile.mkdtemp()
    >>> with checkpoint.Manager(directory, max_to_keep=2) as manager:
    ...     for step in (1, 2, 3):
    ...         _ = manager.save(step, model)
    ...     manager.all_steps()
    [2, 3]
    >>> shutil.rmtree(directory)
    """

    def __init__(
        self, directory: PathLike, *, max_to_keep: int | None = None, async_save: bool = True
    ):
        transform = "Manager"
        self.directory: epath.Path = as_path(directory, transform)
        check_manager_directory(transform, self.directory)
        self._closed = False
        self._pending: int | None = None  # the step being saved in the background
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        try:
            if jax.process_index() == 0:
                self._recover()
            _replace.sync("nnx_sharding_checkpoint_manager_recovered")
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_handlers=handlers()
            )
        except OSError as e:  # a directory that cannot be created or read
            raise write_failure(transform, self.directory, e) from None
        _exit.track(self)

    def _recover(self) -> None:
        """Finishes the replacements of steps interrupted between their renames."""
        if self.directory.is_dir():
            for path in list(self.directory.iterdir()):
                name = path.name
                for suffix in (_replace.STAGED, _replace.ASIDE):
                    if name.endswith(suffix) and name[: -len(suffix)].isdigit():
                        _replace.recover(self.directory / name[: -len(suffix)])

    def save(self, step: int, tree: Tree, *, force: bool = False) -> bool:
        """Saves ``tree`` (as `save` does) as ``step``; with ``async_save``, in the
        background.

        Returns:
          Whether a save was started: False when orbax skips the step, which it does
          for a step older than the latest (unless ``force``).

        Raises:
          FileExistsError: ``step`` exists and ``force`` is False (with ``force``, it
            is replaced: the new one is written beside it, synchronously, and swapped
            in once committed, as `save` does).
          OSError: the previous save in the background failed, or this one could
            not start (a directory that is not writable, a full disk): one error
            naming the path; the steps committed before stay restorable.
          TypeError: as `save`; or ``step`` is not an int >= 0.

        >>> import shutil, tempfile
        >>> from flax import nnx
        >>> from nnx_sharding import checkpoint
        >>> with checkpoint.Manager(directory := tempfile.mkdtemp()) as manager:
        ...     manager.save(10, nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
        True
        >>> shutil.rmtree(directory)
        """
        transform = "Manager.save"
        step = _check_step(transform, step)
        arrays, described = savable(transform, tree)
        self._wait(transform)  # the previous save first (orbax waits for it too)
        if step in self._manager.all_steps():
            if not force:
                raise FileExistsError(
                    _errors.checkpoint_exists(transform, str(self.directory), step)
                )
            self._replace(transform, step, arrays, described)
            return True
        probe(transform, self._step_path(step), self._name(step))
        _integrity.quiet_begin()  # until `_wait`: the error reaches the caller once
        self._pending = step
        try:
            started = self._manager.save(step, args=save_args(arrays, described), force=force)
        except StepAlreadyExistsError:  # the same step still being saved in the background
            self._settled()
            raise FileExistsError(
                _errors.checkpoint_exists(transform, str(self.directory), step)
            ) from None
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
            self._settled()
            raise write_failure(transform, self._step_path(step), e, self._name(step)) from None
        if not started:
            self._settled()
        return bool(started)

    def _replace(self, transform: str, step: int, arrays: Any, described: Any) -> None:
        """Replaces the committed ``step``: written beside it, swapped in once committed."""
        _replace.replace(
            self._step_path(step),
            lambda to: write(transform, to, arrays, described, self._name(step)),
            jax.process_index() == 0,
        )
        self._manager.reload()

    def _step_path(self, step: int) -> epath.Path:
        name_format = ocp.path.step.standard_name_format()  # the Manager's step names
        return ocp.path.step.build_step_path(self.directory, name_format, step)

    def _name(self, step: int) -> str:
        return f"step {step} of {self.directory}"

    def _settled(self) -> None:
        """The pending save is over (committed or failed)."""
        if self._pending is not None:
            self._pending = None
            _integrity.quiet_end()

    def _wait(self, transform: str) -> None:
        """Waits for the save in the background; its failure as one OSError naming
        its step (what it left is removed; the steps committed before are kept)."""
        step = self._pending
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - orbax re-raises the background error
            if step is None:
                raise write_failure(transform, self.directory, e) from None
            path = self._step_path(step)
            raise write_failure(transform, path, e, self._name(step)) from None
        finally:
            self._settled()

    def restore(
        self,
        target: T,
        *,
        step: int | None = None,
        shardings: Shardings = None,
        filter: Filter | None = None,  # noqa: A002 - the name nnx uses for its filters
        allow_type_change: bool = False,
    ) -> T:
        """Restores ``step`` (None: the latest) into ``target``, as `restore` does.

        A save still being written in the background is waited for first.

        Raises:
          FileNotFoundError: no committed step (step=None), or not that one.
          ValueError, TypeError: as `restore`.

        >>> import shutil, tempfile
        >>> from flax import nnx
        >>> from nnx_sharding import checkpoint
        >>> abstract = nnx.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
        >>> with checkpoint.Manager(directory := tempfile.mkdtemp()) as manager:
        ...     _ = manager.save(1, nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
        ...     model = manager.restore(abstract)
        >>> type(model.kernel.get_value()).__name__
        'ArrayImpl'
        >>> shutil.rmtree(directory)
        """
        transform = "Manager.restore"
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(_errors.no_steps(transform, str(self.directory)))
            step = steps[-1]
        else:
            step = _check_step(transform, step)
            if step not in steps:
                raise FileNotFoundError(
                    _errors.unknown_step(transform, str(self.directory), step, steps)
                )
        source = StepSource(transform, self._manager, step)
        return restore_from(source, target, shardings, filter, allow_type_change)

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none.

        A save still being written in the background is waited for first: until it
        is committed, its step is not a checkpoint.
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """The committed steps kept, oldest first (waiting, as `latest_step` does)."""
        self._wait("Manager.all_steps")
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Blocks until the save in the background, if any, is committed.

        Raises:
          OSError: that save failed (naming the directory and the cause).
        """
        self._wait("Manager.wait_until_finished")

    def close(self) -> None:
        """Waits for the save in the background, then releases orbax's resources.
        Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        _exit.untrack(self)
        try:
            self._wait("Manager.close")
        finally:
            self._manager.close()

    def close_at_exit(self) -> None:
        """`close`, when the interpreter ends with the Manager open (`_exit`)."""
        self.close()

    def __enter__(self) -> Manager:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Manager({str(self.directory)!r}, steps={self.all_steps()})"


def _check_step(transform: str, step: Any) -> int:
    """``step`` as an int (numpy and jax integers too); TypeError unless one >= 0."""
    try:
        value = -1 if isinstance(step, bool) else operator.index(step)
    except TypeError:
        value = -1
    if value < 0:
        raise TypeError(_errors.bad_step(transform, step))
    return value
