"""`StateSharding` and the resolution of sharding prefixes down to single Variables."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph as nnx_graph
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from . import _errors

ShardingLike: TypeAlias = Sharding | PartitionSpec | None
"""What may stand for one array: a sharding, a spec (needs a mesh in context), or None."""
Filter: TypeAlias = Any
"""An nnx filter: a Variable type, a tag string, a predicate ``(path, value) -> bool``, ..."""
Path: TypeAlias = tuple[Any, ...]
"""An nnx path: the attribute names and indices from a graph node down to a Variable."""

_NOT_NODES: set[type] = {tuple, list, dict, int, float, bool, complex, str, bytes, type(None)}
"""Types whose instances are never graph nodes; concrete array types join on first sight."""


def is_node(x: Any) -> bool:
    """flax's ``nnx.graph.is_graph_node``, answered from the type where it can be.

    flax's answer costs 2-4 µs for a non-node (it asks whether ``x`` is an array
    ref); `jit` asks it of every argument on every call.
    """
    kind = type(x)
    if kind in _NOT_NODES:
        return False
    if nnx_graph.is_graph_node(x):
        return True
    if isinstance(x, (jax.Array, np.ndarray)) and not isinstance(x, Tracer):
        _NOT_NODES.add(kind)  # a concrete array is never a ref: only tracers vary
    return False


@dataclasses.dataclass(frozen=True)
class AtPath:
    """Filter matching exactly one path; what an ``nnx.State`` spec is turned into."""

    path: Path

    def __call__(self, path: Path, value: Any) -> bool:
        return tuple(path) == self.path

    def __repr__(self) -> str:
        return f"AtPath({format_path(self.path) or '<root>'})"


def _is_sharding_like(x: Any) -> bool:
    return x is None or isinstance(x, (Sharding, PartitionSpec))


def _normalise_filter(f: Filter) -> Filter:
    # nnx reads a list filter as "any of"; a tuple means the same and is hashable.
    return tuple(_normalise_filter(x) for x in f) if isinstance(f, list) else f


def _state_items(state: Mapping[Any, Any], prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    for key, value in state.items():
        if isinstance(value, nnx.Variable):
            yield (*prefix, key), value.get_raw_value()
        elif isinstance(value, Mapping):
            yield from _state_items(value, (*prefix, key))
        else:
            yield (*prefix, key), value


class StateSharding:
    """Maps nnx filters to shardings; accepted wherever a sharding or spec is.

    ``spec`` is a mapping or an iterable of ``(filter, value)`` pairs, or an
    ``nnx.State`` whose leaves are the values (matched by exact path). A value is a
    ``jax.sharding.Sharding``, a ``PartitionSpec`` or None (let jax choose). The
    first matching filter wins; a Variable no filter matches is an error.

    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> s = StateSharding({nnx.Param: P(None, 'model'), ...: None})
    >>> s
    StateSharding({Param: P(None, 'model'), Ellipsis: None})
    >>> s.sharding_for(('linear', 'kernel'), nnx.Param(1.0))
    P(None, 'model')
    """

    __slots__ = ("filters", "shardings", "_predicates")

    filters: tuple[Filter, ...]
    shardings: tuple[ShardingLike, ...]

    def __init__(
        self,
        spec: Mapping[Filter, ShardingLike]
        | Iterable[tuple[Filter, ShardingLike]]
        | nnx.State[Any, Any],
    ):
        if isinstance(spec, nnx.State):
            pairs = [(AtPath(tuple(p)), v) for p, v in _state_items(spec)]
        elif isinstance(spec, Mapping):
            pairs = list(spec.items())
        else:
            pairs = _pairs(spec)
        for f, value in pairs:
            if not _is_sharding_like(value):
                raise TypeError(_errors.spec_value_not_a_sharding(f, type(value).__name__))
        self.filters = tuple(_normalise_filter(f) for f, _ in pairs)
        self.shardings = tuple(v for _, v in pairs)
        self._predicates = tuple(_predicate(f) for f in self.filters)

    def sharding_for(self, path: Path, value: Any) -> ShardingLike:
        """The sharding of the Variable ``value`` found at ``path`` (first match wins)."""
        return self.shardings[self.index_for(path, value)]

    def index_for(
        self,
        path: Path,
        value: Any,
        *,
        transform: str = "StateSharding",
        argument: str = "spec",
        where: str = "",
    ) -> int:
        """The index of the first filter that matches the Variable ``value`` at ``path``.

        ``transform``, ``argument`` and ``where`` (the path of the node, ``output[0]``)
        say in the error for a Variable no filter matches where it was looked up.
        """
        index = self.find(path, value)
        if index is not None:
            return index
        raise ValueError(
            _errors.no_filter_matched(
                f"{where}{format_path(path)}" or "<root>",
                type(value).__name__,
                self.filters,
                transform,
                argument,
            )
        )

    def find(self, path: Path, value: Any) -> int | None:
        """Like `index_for`, but None where no filter matches."""
        for i, predicate in enumerate(self._predicates):
            if predicate(path, value):
                return i
        return None

    @classmethod
    def from_metadata(
        cls, tree: Any, rules: Sequence[tuple[str, str | tuple[str, ...] | None]] | None = None
    ) -> StateSharding:
        """Shardings from Variable metadata, logical names mapped by ``rules`` (see `shard`).

        >>> from flax import nnx
        >>> init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
        >>> with nnx.use_eager_sharding(False):
        ...     model = nnx.Linear(2, 4, kernel_init=init, rngs=nnx.Rngs(0))
        >>> StateSharding.from_metadata(model, rules=[('embed', None), ('mlp', 'model')])
        StateSharding({AtPath(.bias): P(), AtPath(.kernel): P(None, 'model')})
        """
        from ._metadata import from_metadata

        return from_metadata(tree, rules)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, StateSharding)
            and self.filters == other.filters
            and self.shardings == other.shardings
        )

    def __hash__(self) -> int:
        return hash((self.filters, self.shardings))

    def __repr__(self) -> str:
        items = ", ".join(
            f"{_filter_repr(f)}: {s!r}" for f, s in zip(self.filters, self.shardings, strict=True)
        )
        return f"StateSharding({{{items}}})"


def from_flax(sharding: nnx.StateSharding) -> StateSharding:
    """flax's own ``nnx.StateSharding`` as a `StateSharding`: the same filters and
    shardings, in the same order (only its public ``filters``/``shardings`` are read).

    Each value is then checked as ours are: a Sharding, a PartitionSpec or None.

    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> from_flax(nnx.StateSharding({nnx.Param: P(None, 'model'), ...: None}))
    StateSharding({Param: P(None, 'model'), Ellipsis: None})
    """
    return StateSharding(zip(sharding.filters, sharding.shardings, strict=True))


def _is_prefix_or_flax_leaf(x: Any) -> bool:
    return isinstance(x, nnx.StateSharding) or is_prefix_leaf(x)


def accept_flax(prefix: Any) -> Any:
    """``prefix`` (in_shardings, out_specs, ...) with each flax ``nnx.StateSharding``
    in it replaced by ours (`from_flax`); ``prefix`` itself when it holds none."""
    leaves = jax.tree_util.tree_leaves(prefix, is_leaf=_is_prefix_or_flax_leaf)
    if not any(isinstance(x, nnx.StateSharding) for x in leaves):
        return prefix
    return jax.tree.map(
        lambda x: from_flax(x) if isinstance(x, nnx.StateSharding) else x,
        prefix,
        is_leaf=_is_prefix_or_flax_leaf,
    )


def _pairs(spec: Any) -> list[tuple[Filter, Any]]:
    """An iterable of ``(filter, sharding)`` pairs as a list, its form checked."""
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Iterable):
        raise TypeError(_errors.spec_not_pairs(type(spec).__name__))
    pairs = []
    for entry in spec:
        pair = tuple(entry) if isinstance(entry, Iterable) and not isinstance(entry, str) else ()
        if len(pair) != 2:
            raise TypeError(_errors.spec_entry_not_a_pair(entry))
        pairs.append(pair)
    return pairs


def _predicate(f: Filter) -> Callable[[Path, Any], bool]:
    try:
        return nnx.filterlib.to_predicate(f)
    except Exception as e:  # noqa: BLE001 - flax raises several types (or fails formatting)
        raise TypeError(_errors.bad_filter(f, e)) from None


def _filter_repr(f: Filter) -> str:
    return f.__name__ if isinstance(f, type) else repr(f)


def format_path(path: Path) -> str:
    """``('layers', 0, 'kernel')`` -> ``.layers[0].kernel`` (the keystr style)."""
    return "".join(f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]" for k in path)


def is_prefix_leaf(x: Any) -> bool:
    return _is_sharding_like(x) or isinstance(x, StateSharding) or is_node(x)


def broadcast_prefix(
    transform: str, argument: str, prefix: Any, tree: Any, where: Callable[[Any], str]
) -> list[Any]:
    """For each leaf of ``tree`` (graph nodes are leaves), the prefix entry above it.

    ``where(keypath)`` renders a key path of ``prefix`` for messages.
    """
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(prefix, is_leaf=is_prefix_leaf)[0]:
        if is_node(leaf):
            raise ValueError(
                _errors.node_in_prefix(transform, argument, where(keypath), type(leaf).__name__)
            )
        if not is_prefix_leaf(leaf):
            raise TypeError(
                _errors.format_message(
                    transform,
                    argument,
                    [f"found a {type(leaf).__name__} at {where(keypath)}"],
                    "Rule: each entry is a Sharding, a PartitionSpec, a StateSharding or None.",
                    ["wrap mesh axis names in PartitionSpec, e.g. P('data')."],
                )
            )
    out: list[Any] = []

    def expand(entry: Any, subtree: Any) -> None:
        out.extend([entry] * len(jax.tree_util.tree_leaves(subtree, is_leaf=is_node)))

    try:
        jax.tree.map(expand, prefix, tree, is_leaf=is_prefix_leaf)
    except ValueError as e:
        found = _prefix_mismatch(prefix, tree, ())
        tree_name = "output" if argument.startswith("out") else "arguments"
        detail = (
            str(e).split("\n")[0]
            if found is None
            else _errors.prefix_mismatch(where(found[0]), found[1], found[2], tree_name)
        )
        raise ValueError(_errors.not_a_prefix(transform, argument, detail, tree_name)) from None
    return out


def _children(x: Any, is_leaf: Callable[[Any], bool]) -> list[tuple[Any, Any]] | None:
    """One level of the pytree ``x``: its ``(key, child)`` pairs; None for a leaf."""
    if is_leaf(x):
        return None
    kids = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda c: c is not x)[0]
    if len(kids) == 1 and kids[0][0] == () and kids[0][1] is x:
        return None
    return [(kp[0], child) for kp, child in kids]


def _prefix_mismatch(prefix: Any, tree: Any, keypath: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``(keypath, prefix part, tree part)`` where ``prefix`` stops being a prefix of ``tree``."""
    ours = _children(prefix, is_prefix_leaf)
    if ours is None:
        return None
    theirs = _children(tree, is_node)
    if (
        theirs is None
        or type(prefix) is not type(tree)
        or [k for k, _ in ours] != [k for k, _ in theirs]
    ):
        return keypath, prefix, tree
    for (key, a), (_, b) in zip(ours, theirs, strict=True):
        if (found := _prefix_mismatch(a, b, (*keypath, key))) is not None:
            return found
    return None


def check_leaf_entries(
    transform: str,
    argument: str,
    entries: Sequence[Any],
    leaves: Sequence[Any],
    paths: Sequence[str],
) -> None:
    """A StateSharding may only stand above graph nodes."""
    for entry, leaf, path in zip(entries, leaves, paths, strict=True):
        if isinstance(entry, StateSharding) and not is_node(leaf):
            raise ValueError(
                _errors.state_sharding_at_leaf(transform, argument, path, type(leaf).__name__)
            )


def variable_shardings(
    transform: str,
    argument: str,
    nodes: Sequence[tuple[str, Any, Any]],
) -> dict[int, tuple[ShardingLike, str]]:
    """``id(variable) -> (sharding, path)`` for every Variable below the given nodes.

    ``nodes`` holds ``(where, node, entry)`` triples: the rendered argument path,
    the graph node and the prefix entry above it. A Variable reached through two
    paths with two different non-None shardings is an error listing every conflict.
    """
    chosen: dict[int, tuple[ShardingLike, str]] = {}
    conflicts: list[str] = []
    matched: set[int] = set()  # Variables some filter matched, on some path
    unmatched: dict[int, tuple[str, str, StateSharding]] = {}  # first unmatched path of each
    for where, node, entry in nodes:
        if entry is None:
            continue
        _, flat = nnx.flatten(node)
        by_path = dict(zip(flat.paths, flat.leaves, strict=True))
        aliases = [(tuple(p), value) for p, value in by_path.items()]
        if isinstance(entry, StateSharding):
            aliases += list(_alias_paths(node, by_path))
        for path, value in aliases:
            here = f"{where}{format_path(path)}"
            if isinstance(entry, StateSharding):
                # An alias path no filter matches takes the sharding of another path (an
                # nnx.State spec has exact paths for the canonical ones only).
                index = entry.find(path, value)
                if index is None:
                    unmatched.setdefault(id(value), (here, type(value).__name__, entry))
                    continue
                matched.add(id(value))
                sharding = entry.shardings[index]
            else:
                sharding = entry
            if sharding is None:
                continue
            previous = chosen.setdefault(id(value), (sharding, here))
            if previous[0] != sharding:
                conflicts.append(
                    f"the Variable at {previous[1]} gets {previous[0]!r}, "
                    f"and through the alias {here} gets {sharding!r}"
                )
    if missing := [u for i, u in unmatched.items() if i not in matched]:
        (path, type_name, entry), *more = missing
        raise ValueError(
            _errors.no_filter_matched(
                path, type_name, entry.filters, transform, argument, [m[:2] for m in more]
            )
        )
    if conflicts:
        raise ValueError(_errors.aliased_shardings(transform, argument, conflicts))
    return chosen


def _alias_paths(node: Any, by_path: Mapping[Path, Any]) -> Iterator[tuple[Path, Any]]:
    """The second and later paths to each shared Variable inside ``node``."""
    for group in nnx.find_duplicates(node):
        first, *others = (tuple(p) for p in group)
        for path, value in by_path.items():
            if path[: len(first)] == first:
                for other in others:
                    yield other + path[len(first) :], value


def incompatible_shardings(
    leaves: Sequence[Any],
    shardings: Sequence[ShardingLike],
    sites: Sequence[object],
    mesh: Mesh | AbstractMesh | None = None,
) -> list[str]:
    """Every leaf whose shape its sharding cannot split, described for an error.

    ``mesh``: the one PartitionSpecs refer to (None: the context's; with none in
    context, PartitionSpecs are not checked).
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    found = []
    for leaf, sharding, site in zip(leaves, shardings, sites, strict=True):
        if sharding is None or not hasattr(leaf, "shape"):
            continue
        if isinstance(sharding, PartitionSpec) and mesh.empty:
            continue
        shape = tuple(leaf.shape)
        try:
            if isinstance(sharding, PartitionSpec):
                sharding = NamedSharding(mesh, sharding)
            if isinstance(sharding, NamedSharding) and len(sharding.spec) > len(shape):
                raise ValueError(_errors.rank_too_low(len(sharding.spec), len(shape)))
            sharding.shard_shape(shape)
        except Exception as e:  # noqa: BLE001 - jax raises several types here
            found.append(_errors.misfit(str(site), shape, sharding, str(e)))
    return found


def mismatched_shardings(
    leaves: Sequence[Any],
    shardings: Sequence[ShardingLike],
    sites: Sequence[object],
    mesh: Mesh | AbstractMesh | None = None,
) -> list[tuple[str, Sharding, Sharding]]:
    """``(site, its sharding, the one asked for)`` for every committed array placed
    otherwise than its sharding asks (jit refuses to move those)."""
    mesh = jax.sharding.get_mesh() if mesh is None else mesh
    found = []
    for leaf, sharding, site in zip(leaves, shardings, sites, strict=True):
        if (
            sharding is None
            or not isinstance(leaf, jax.Array)
            or isinstance(leaf, Tracer)
            or not leaf.committed
        ):
            continue
        try:
            if isinstance(sharding, PartitionSpec):
                sharding = NamedSharding(mesh, sharding)
            if leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
                continue
        except Exception:  # noqa: BLE001 - not comparable (an abstract mesh): not the culprit
            continue
        found.append((str(site), leaf.sharding, sharding))
    return found
