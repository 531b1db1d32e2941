"""`StateSharding`: nnx filters mapped to shardings, and the forms it is given in."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeAlias

from flax import nnx
from jax.sharding import PartitionSpec, Sharding

from . import _errors
from ._logical import Rules, metadata_pairs
from ._nodes import Path, format_path
from ._types import ShardingLike

Filter: TypeAlias = Any
"""An nnx filter: a Variable type, a tag string, a predicate ``(path, value) -> bool``, ..."""


@dataclasses.dataclass(frozen=True)
class AtPath:
    """Filter matching exactly one path; what an ``nnx.State`` spec is turned into."""

    path: Path

    def __call__(self, path: Path, value: Any) -> bool:
        return tuple(path) == self.path

    def __repr__(self) -> str:
        return f"AtPath({format_path(self.path) or '<root>'})"


def is_sharding_like(x: Any) -> bool:
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
            if not is_sharding_like(value):
                raise TypeError(_errors.spec_value_not_a_sharding(f, value))
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
    def from_metadata(cls, tree: Any, rules: Rules | None = None) -> StateSharding:
        """Shardings from Variable metadata, logical names mapped by ``rules`` (see `shard`).

        >>> from flax import nnx
        >>> init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
        >>> with nnx.use_eager_sharding(False):
        ...     model = nnx.Linear(2, 4, kernel_init=init, rngs=nnx.Rngs(0))
        >>> StateSharding.from_metadata(model, rules=[('embed', None), ('mlp', 'model')])
        StateSharding({AtPath(.bias): P(), AtPath(.kernel): P(None, 'model')})
        """
        pairs = metadata_pairs("StateSharding.from_metadata", tree, rules)
        return cls([(AtPath(path), spec) for path, spec in pairs])

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
