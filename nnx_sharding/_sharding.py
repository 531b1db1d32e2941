"""`StateSharding` and the resolution of sharding prefixes down to single Variables."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import jax
from flax import nnx
from flax.nnx import graph as nnx_graph
from jax.sharding import PartitionSpec, Sharding

from . import _errors

ShardingLike: TypeAlias = Sharding | PartitionSpec | None
"""What may stand for one array: a sharding, a spec (needs a mesh in context), or None."""
Filter: TypeAlias = Any
"""An nnx filter: a Variable type, a tag string, a predicate ``(path, value) -> bool``, ..."""
Path: TypeAlias = tuple[Any, ...]
"""An nnx path: the attribute names and indices from a graph node down to a Variable."""

is_node: Callable[[Any], bool] = nnx_graph.is_graph_node


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
        spec: Mapping[Filter, ShardingLike] | Iterable[tuple[Filter, ShardingLike]] | nnx.State,
    ):
        if isinstance(spec, nnx.State):
            pairs = [(AtPath(tuple(p)), v) for p, v in _state_items(spec)]
        elif isinstance(spec, Mapping):
            pairs = list(spec.items())
        else:
            pairs = [tuple(pair) for pair in spec]
        for f, value in pairs:
            if not _is_sharding_like(value):
                raise TypeError(
                    _errors.format_message(
                        "StateSharding",
                        "spec",
                        [f"the value for filter {f!r} is a {type(value).__name__}"],
                        "Rule: each value is a jax.sharding.Sharding, a PartitionSpec or None.",
                        ["wrap mesh axis names in PartitionSpec, e.g. P('model', None)."],
                    )
                )
        self.filters = tuple(_normalise_filter(f) for f, _ in pairs)
        self.shardings = tuple(v for _, v in pairs)
        self._predicates = tuple(nnx.filterlib.to_predicate(f) for f in self.filters)

    def sharding_for(self, path: Path, value: Any) -> ShardingLike:
        """The sharding of the Variable ``value`` found at ``path`` (first match wins)."""
        return self.shardings[self.index_for(path, value)]

    def index_for(self, path: Path, value: Any) -> int:
        """The index of the first filter that matches the Variable ``value`` at ``path``."""
        for i, predicate in enumerate(self._predicates):
            if predicate(path, value):
                return i
        raise ValueError(
            _errors.no_filter_matched(
                format_path(path) or "<root>", type(value).__name__, self.filters
            )
        )

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
        raise ValueError(_errors.not_a_prefix(transform, argument, str(e).split("\n")[0])) from None
    return out


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
    for where, node, entry in nodes:
        if entry is None:
            continue
        _, flat = nnx.flatten(node)
        by_path = dict(zip(flat.paths, flat.leaves, strict=True))
        aliases = [(tuple(p), value) for p, value in by_path.items()]
        if isinstance(entry, StateSharding):
            aliases += list(_alias_paths(node, by_path))
        for path, value in aliases:
            sharding = (
                entry.sharding_for(path, value) if isinstance(entry, StateSharding) else entry
            )
            if sharding is None:
                continue
            here = f"{where}{format_path(path)}"
            previous = chosen.setdefault(id(value), (sharding, here))
            if previous[0] != sharding:
                conflicts.append(
                    f"the Variable at {previous[1]} gets {previous[0]!r}, "
                    f"and through the alias {here} gets {sharding!r}"
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
