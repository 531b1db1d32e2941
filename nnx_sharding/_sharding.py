"""The resolution of sharding prefixes down to single Variables.

A prefix (``in_shardings``, ``out_specs``, ...) is checked and made hashable when the
transform is created (`prefixes`), then broadcast over each call's arguments or output
(`broadcast_prefix`) and resolved per Variable (`variable_shardings`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence, Set
from typing import Any

import jax
from flax import nnx
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding
from jax.tree_util import SequenceKey, keystr

from . import _errors
from ._nodes import alias_paths, format_path, is_node
from ._state_sharding import StateSharding, from_flax, is_sharding_like
from ._types import ShardingLike


def is_prefix_leaf(x: Any) -> bool:
    return is_sharding_like(x) or isinstance(x, StateSharding) or is_node(x)


@functools.cache
def _tree_state_type() -> type | None:
    """The type of what ``nnx.prefix`` returns for a graph node (flax's ``TreeState``),
    found through that public function; None on a flax without it (before 0.12.8)."""
    prefix = getattr(nnx, "prefix", None)
    return None if prefix is None else type(prefix(nnx.Dict(), {...: None}, graph=True))


def is_tree_state(x: Any) -> bool:
    """Whether ``x`` is what ``nnx.prefix(node, ..., graph=True)`` returns (flax's
    ``TreeState``), by the very type flax builds, not by its name."""
    kind = _tree_state_type()
    return kind is not None and isinstance(x, kind)


def _is_given_leaf(x: Any) -> bool:
    """A leaf of a prefix as given: ours, flax's ``nnx.StateSharding``, ``nnx.prefix``'s."""
    return is_prefix_leaf(x) or isinstance(x, nnx.StateSharding) or is_tree_state(x)


def accept_flax(prefix: Any) -> Any:
    """``prefix`` (in_shardings, out_specs, ...) with each flax ``nnx.StateSharding``
    in it replaced by ours (`from_flax`), and each tree ``nnx.prefix`` made of a graph
    node by a `StateSharding` of its ``nnx.State`` (exact paths); ``prefix`` itself
    when it holds neither."""
    leaves = jax.tree_util.tree_leaves(prefix, is_leaf=_is_given_leaf)
    if not any(isinstance(x, nnx.StateSharding) or is_tree_state(x) for x in leaves):
        return prefix

    def convert(x: Any) -> Any:
        if isinstance(x, nnx.StateSharding):
            return from_flax(x)
        return StateSharding(x.state) if is_tree_state(x) else x

    return jax.tree.map(convert, prefix, is_leaf=_is_given_leaf)


class Prefix:
    """A prefix as given to a transform, in a hashable wrapper (it is part of the
    `CallSpec`, so of every plan's key): equal when of the same structure with equal
    entries, or, where an entry cannot be hashed, only to itself.

    ``has_states``: whether an ``nnx.State`` is among its subtrees (see `broadcast_prefix`).
    """

    __slots__ = ("tree", "has_states", "_key", "_hash")

    def __init__(self, tree: Any):
        self.tree = tree
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_prefix_leaf)
        self._key = (treedef, tuple(leaves))
        try:
            self._hash: int | None = hash(self._key)
        except TypeError:
            self._hash = None
        with_states = jax.tree_util.tree_leaves(tree, is_leaf=_is_prefix_or_state)
        self.has_states = any(isinstance(x, nnx.State) for x in with_states)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Prefix):
            return NotImplemented
        if self._hash is None or other._hash is None:
            return self is other
        return self._hash == other._hash and self._key == other._key

    def __hash__(self) -> int:
        return id(self) if self._hash is None else self._hash

    def __repr__(self) -> str:
        return f"Prefix({self.tree!r})"


def _is_prefix_or_state(x: Any) -> bool:
    return is_prefix_leaf(x) or isinstance(x, nnx.State)


def prefixes(
    transform: str,
    in_prefix: Any,
    out_prefix: Any,
    static_argnums: Set[int] = frozenset(),
    names: tuple[str, str] = ("in_shardings", "out_shardings"),
) -> tuple[Prefix | None, Prefix | None]:
    """A transform's two prefixes, checked and made hashable when it is created.

    flax's StateShardings and ``nnx.prefix`` trees are converted (`accept_flax`); a
    graph node in a prefix is an error now rather than at the first call.
    ``static_argnums``: the positions the input prefix skips, for naming arguments.
    A list at the top of the input prefix reads as a tuple, as in ``jax.jit``.
    """
    out: list[Prefix | None] = []
    for name, prefix in zip(names, (in_prefix, out_prefix), strict=True):
        if prefix is None or isinstance(prefix, Prefix):
            out.append(prefix)
            continue
        if name == names[0] and type(prefix) is list:
            prefix = tuple(prefix)
        prefix = accept_flax(prefix)
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(prefix, is_leaf=is_prefix_leaf)[
            0
        ]:
            if is_node(leaf):
                where = (
                    _argument_at(keypath, static_argnums)
                    if name == names[0]
                    else f"output{keystr(keypath)}"
                )
                raise ValueError(_errors.node_in_prefix(transform, name, where, leaf))
        out.append(Prefix(prefix))
    return out[0], out[1]


def _argument_at(keypath: tuple[Any, ...], static_argnums: Set[int]) -> str:
    """A key path of an input prefix as the argument it stands for: ``args[2].x``."""
    if not keypath:
        return "args"
    head, rest = keypath[0], keypath[1:]
    if not isinstance(head, SequenceKey):
        return f"args{keystr(keypath)}"
    dynamic = (i for i in itertools.count() if i not in static_argnums)
    return f"args[{next(itertools.islice(dynamic, head.idx, None))}]{keystr(rest)}"


class FromState(StateSharding):
    """A `StateSharding` read off ``state``, an ``nnx.State`` that stands above a graph
    node in a prefix (by exact paths); `shard_map` lays such a node's outputs out as
    that State, which is what its out_specs give jax there."""

    __slots__ = ("state",)

    def __init__(self, state: nnx.State[Any, Any]):
        super().__init__(state)
        self.state = state


def _states_at_nodes(prefix: Any, tree: Any) -> Any:
    """``prefix`` with each ``nnx.State`` above a graph node of ``tree`` as a `FromState`
    (above anything else, a State is a pytree like any other)."""

    def convert(entry: Any, subtree: Any) -> Any:
        if isinstance(entry, nnx.State) and is_node(subtree):
            return FromState(entry)
        return entry

    try:
        return jax.tree.map(convert, prefix, tree, is_leaf=_is_prefix_or_state)
    except ValueError:
        return prefix  # not a prefix of the tree: `broadcast_prefix` says where


def broadcast_prefix(
    transform: str,
    argument: str,
    prefix: Any,
    tree: Any,
    where: Callable[[Any], str],
    tree_name: str | None = None,
) -> list[Any]:
    """For each leaf of ``tree`` (graph nodes are leaves), the prefix entry above it.

    ``prefix`` is a `Prefix` or a prefix as given; ``where(keypath)`` renders a key
    path of ``prefix`` for messages; ``tree_name`` names ``tree`` in them (default:
    ``output`` for an ``out_*`` argument, else ``arguments``).
    """
    if isinstance(prefix, Prefix):
        prefix, has_states = prefix.tree, prefix.has_states
    else:
        has_states = True
    if has_states:
        prefix = _states_at_nodes(prefix, tree)
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(prefix, is_leaf=is_prefix_leaf)[0]:
        if is_node(leaf):
            raise ValueError(_errors.node_in_prefix(transform, argument, where(keypath), leaf))
        if not is_prefix_leaf(leaf):
            raise TypeError(
                _errors.bad_prefix_entry(transform, argument, where(keypath), type(leaf).__name__)
            )
    out: list[Any] = []

    def expand(entry: Any, subtree: Any) -> None:
        out.extend([entry] * len(jax.tree_util.tree_leaves(subtree, is_leaf=is_node)))

    try:
        jax.tree.map(expand, prefix, tree, is_leaf=is_prefix_leaf)
    except ValueError as e:
        found = _prefix_mismatch(prefix, tree, ())
        tree_name = tree_name or ("output" if argument.startswith("out") else "arguments")
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
            aliases += list(alias_paths(node, by_path))
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
