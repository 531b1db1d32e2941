"""`restore`'s core: the target checked against the checkpoint, then one read.

Every check runs before any array is read or any Variable written, so a failure
leaves the caller's objects as they were: the target's values, the filter, the
checkpoint's contents (orbax's metadata of the arrays: paths, shapes, dtypes, against
the target's Variables, every mismatch listed), and the shardings (each bound to a
mesh and fitting its array). Then orbax reads exactly the selected arrays, each
shard onto the devices that hold it (a ``jax.ShapeDtypeStruct`` with a sharding per
Variable), and the Variables are set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp
from flax import nnx

from .. import _errors
from .._nodes import Path
from .._state_sharding import Filter
from . import _integrity
from ._io import DirectorySource, PathLike, Source
from ._shardings import Shardings, resolve
from ._state import Entry, Key, check_values, from_json, stored_key, variables, where

T = TypeVar("T")
Predicate = Callable[[Path, Any], bool]


def selector(transform: str, filter_: Filter | None) -> Predicate | None:
    """The predicate of ``filter_``; None (restore everything) for None."""
    if filter_ is None:
        return None
    try:
        return nnx.filterlib.to_predicate(filter_)
    except Exception as e:  # noqa: BLE001 - flax raises several types for a bad filter
        raise TypeError(_errors.bad_restore_filter(transform, filter_, e)) from None


def restore_from(
    source: Source,
    target: T,
    shardings: Shardings,
    filter_: Filter | None,
    allow_type_change: bool = False,
) -> T:
    """Restores ``target`` from ``source``; see `checkpoint.restore` for the contract."""
    transform = source.transform
    found = variables(transform, "target", target)
    check_values(transform, "target", found, restoring=True)
    abstract_paths = [where("target", p) for p, v in found if _abstract(v)]
    if abstract_paths and len(abstract_paths) < len(found):
        concrete_paths = [where("target", p) for p, v in found if not _abstract(v)]
        raise ValueError(_errors.mixed_target(transform, abstract_paths, concrete_paths))
    predicate = selector(transform, filter_)
    selected = [(p, v) for p, v in found if predicate is None or predicate(p, v)]
    if not selected:
        raise ValueError(_errors.selects_nothing(transform, filter_))
    chosen = {p for p, _ in selected}
    if left_abstract := [where("target", p) for p, v in found if p not in chosen and _abstract(v)]:
        raise ValueError(_errors.abstract_not_restored(transform, left_abstract))
    metadata, described = source.contents()
    entries = from_json(described)
    if entries is None:
        raise ValueError(_errors.foreign_checkpoint(transform, source.name, ["no 'nnx' item"]))
    saved = ocp.tree.to_flat_dict(metadata)
    compare(transform, source.name, selected, saved, entries, strict=predicate is None)
    if not allow_type_change:
        check_types(transform, source.name, selected, entries)
    shapes = [_struct(v.get_raw_value()) for _, v in selected]
    placed = resolve(transform, target, shardings, selected, shapes)
    abstract = ocp.tree.from_flat_dict(
        {
            stored_key(path): jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
            for (path, _), s, sharding in zip(selected, shapes, placed, strict=True)
        }
    )
    try:
        restored = ocp.tree.to_flat_dict(source.read(abstract))
    except Exception as e:  # noqa: BLE001 - tensorstore's errors come wrapped by orbax
        if not _integrity.is_damage(e):
            raise
        error = damaged(transform, source.name, selected, e)
        del e
        _integrity.collect_orphans()
        raise error from None
    result = nnx.clone(target) if abstract_paths else target
    by_path = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(result))}
    for path, _ in selected:
        by_path[path].set_value(restored[stored_key(path)])
    return result


def compare(
    transform: str,
    name: str,
    selected: Sequence[tuple[Path, nnx.Variable]],
    saved: Mapping[Key, Any],
    entries: Mapping[Key, Entry],
    strict: bool,
) -> None:
    """Raises ValueError listing every selected Variable the checkpoint lacks or has with
    another shape or dtype, and (``strict``) every Variable it has that the target lacks.

    A typed PRNG key is compared by its logical shape and dtype (``key<fry>``), which
    the JSON item records; orbax's metadata has its key data's.
    """
    problems: list[str] = []
    dtypes = False  # some dtype differs
    for path, var in selected:
        value, here = var.get_raw_value(), where("target", path)
        key = stored_key(path)
        if key not in saved:
            mine = _errors.describe_variable(type(var).__name__, value.shape, str(value.dtype))
            problems.append(_errors.mismatch_detail("missing", here, here=mine))
            continue
        shape, dtype = _saved_struct(saved[key], entries.get(key))
        if tuple(value.shape) != shape:
            problems.append(
                _errors.mismatch_detail("shape", here, str(tuple(value.shape)), str(shape))
            )
        if str(value.dtype) != dtype:
            dtypes = True
            problems.append(_errors.mismatch_detail("dtype", here, str(value.dtype), dtype))
    if strict:
        targeted = {stored_key(p) for p, _ in selected}
        for key in saved:
            if key in targeted:
                continue
            entry = entries.get(key)
            shape, dtype = _saved_struct(saved[key], entry)
            theirs = _errors.describe_variable(entry.type if entry else "array", shape, dtype)
            path = entry.path if entry else key
            problems.append(_errors.mismatch_detail("extra", where("target", path), there=theirs))
    if problems:
        raise ValueError(_errors.checkpoint_mismatch(transform, name, problems, dtypes))


def check_types(
    transform: str,
    name: str,
    selected: Sequence[tuple[Path, nnx.Variable]],
    entries: Mapping[Key, Entry],
) -> None:
    """Raises TypeError listing every selected Variable whose type differs from the
    type saved at its path (compared by class name, as the JSON item records it)."""
    problems = [
        _errors.type_detail(where("target", path), type(var).__name__, entry.type)
        for path, var in selected
        for entry in [entries.get(stored_key(path))]
        if entry is not None and entry.type != type(var).__name__
    ]
    if problems:
        raise TypeError(_errors.variable_types_differ(transform, name, problems))


def damaged(
    transform: str, name: str, selected: Sequence[tuple[Path, nnx.Variable]], error: Exception
) -> ValueError:
    """The read of the arrays failed: a damaged chunk (its checksum), a file cut short
    or missing. A ValueError naming the Variables tensorstore named."""
    by_name = {".".join(stored_key(path)): where("target", path) for path, _ in selected}
    paths = [by_name[n] for n in _integrity.damaged_names(error) if n in by_name]
    return ValueError(
        _errors.damaged_checkpoint(transform, name, paths, _integrity.root_line(error))
    )


def _saved_struct(metadata: Any, entry: Entry | None) -> tuple[tuple[int, ...], str]:
    """The logical shape and dtype of a saved array: a PRNG key's from the JSON item."""
    if entry is not None and entry.dtype.startswith("key<"):
        return tuple(entry.shape), entry.dtype
    return tuple(getattr(metadata, "shape", ())), str(getattr(metadata, "dtype", "?"))


def _abstract(var: nnx.Variable) -> bool:
    return isinstance(var.get_raw_value(), jax.ShapeDtypeStruct)


def _struct(value: Any) -> jax.ShapeDtypeStruct:
    """The shape and dtype of a target value (a PRNG key's are its logical ones)."""
    return jax.ShapeDtypeStruct(tuple(value.shape), value.dtype)


def restore(
    directory: PathLike,
    target: T,
    *,
    shardings: Shardings = None,
    filter: Filter | None = None,  # noqa: A002 - the name nnx uses for its filters
    allow_type_change: bool = False,
) -> T:
    """Restores the checkpoint at ``directory`` into ``target``, laid out as asked.

    ``target`` has the structure of what `save` saved: the same graph nodes in the
    same pytree, with Variables of the same paths, shapes and dtypes. It is either
    abstract (``nnx.eval_shape``: nothing allocated) or concrete. Each array is read
    straight into its sharding, every device reading only its own shards, so a model
    too big for one device is never assembled anywhere.

    Where each Variable goes (first that applies):

    1. ``shardings``: a `StateSharding`, a Sharding or PartitionSpec, or a pytree
       prefix of ``target`` holding these, as `jit`'s ``in_shardings`` (a None entry,
       or a StateSharding filter mapped to None, falls through to 2);
    2. the target's own placement: a concrete value's sharding, an abstract one's
       (``nnx.eval_shape`` under ``jax.set_mesh``), else its sharding metadata
       (``nnx.with_partitioning``) on the mesh set with ``jax.set_mesh``;
    3. replicated over the mesh set with ``jax.set_mesh``, else one device (the first
       local one).

    PartitionSpecs are bound to the mesh set with ``jax.set_mesh``.

    Args:
      directory: what `save` wrote (for a Manager's checkpoints, `Manager.restore`).
      target: a pytree of graph nodes, abstract or concrete.
      shardings: where the Variables go; see above.
      filter: an nnx filter (``nnx.Param``, ``nnx.PathContains('encoder')``, ...):
        only the Variables it selects are read, and the checkpoint's others are not;
        the target's other Variables keep their values (in an abstract target, that
        is an error). None (the default): restore every Variable, and the checkpoint
        must have exactly the target's.
      allow_type_change: restore a value into a Variable of another type than the one
        saved at its path (a saved ``Param`` into a ``BatchStat``); without it, that
        is a TypeError.

    Returns:
      A concrete tree of ``target``'s structure. A concrete target is updated in place
      and returned itself (as `jit` returns its inputs); for an abstract one (every
      Variable holding a ``jax.ShapeDtypeStruct``), a new tree (``nnx.clone``), the
      target left abstract.

    Raises:
      FileNotFoundError: nothing exists at ``directory``.
      ValueError: ``directory`` is not a committed checkpoint of `save` (an interrupted
        save, a Manager's directory, other files); the target does not match it (every
        Variable missing on either side, every shape and dtype difference, by path);
        a sharding does not divide its array, or a PartitionSpec has no mesh or names
        axes it lacks; an abstract Variable the filter leaves out; a filter that
        selects no Variable; a target part abstract, part concrete.
        The stored data of a Variable is damaged (a chunk whose CRC-32C checksum
        does not match) or cut short: the error names it.
      TypeError: ``target`` is not a pytree of graph nodes of arrays, or ``filter``
        is not an nnx filter; a Variable's type differs from the one saved at its
        path (every such path listed, with both types), unless ``allow_type_change``.

    Every check runs before anything is read, and every array is read before any
    Variable is set: on an error the target is as it was.

    >>> import shutil, tempfile
    >>> from flax import nnx
    >>> from nnx_sharding import checkpoint
    >>> directory = tempfile.mkdtemp()
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> checkpoint.save(directory, model)
    >>> abstract = nnx.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
    >>> restored = checkpoint.restore(directory, abstract)
    >>> bool((restored.kernel[...] == model.kernel[...]).all())
    True
    >>> shutil.rmtree(directory)
    """
    source = DirectorySource("checkpoint.restore", directory)
    return restore_from(source, target, shardings, filter, allow_type_change)
