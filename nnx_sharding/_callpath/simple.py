"""The simple call path: ``graph=False`` (tree mode) or ``graph_updates=False``.

flax 0.12.8 runs ``nnx.jit`` and ``nnx.shard_map`` on its full graph protocol only
when both ``graph`` and ``graph_updates`` are on; otherwise it takes a simpler path,
which this module gives with flax's semantics:

- tree mode (``graph=False``): graph nodes are pytrees. Inside the function every
  module and Variable is a fresh copy; a Variable appearing twice (a shared
  reference, an input returned as an output) is an error (`check_aliases`);
- graph mode without graph updates: each graph node is flattened into a `TreeNode`
  (shared references kept across all arguments), and merged back inside;
- in both, only Variable *values* come back: a Variable whose value changed inside
  (or that was donated) is written back to the caller's Variable at the same path.
  Structure changes inside (new attributes, swapped submodules) are not seen by the
  caller, and an output graph node is a new object.

`resolve_mode` decides the mode, once, when a transform is made (as flax does: the
``nnx.set_graph_mode`` / ``nnx.set_graph_updates`` contexts, then flax's config).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeAlias

import jax
from flax import nnx
from flax.errors import TraceContextError
from jax.tree_util import keystr

from .. import _errors
from .._nodes import is_variable
from .._sharding import is_tree_state
from .._state_sharding import StateSharding

KeyPath: TypeAlias = tuple[Any, ...]
"""A ``jax.tree_util`` key path."""


def resolve_mode(graph: bool | None, graph_updates: bool | None) -> tuple[bool, bool]:
    """``(graph, graph_updates)``: None takes flax's context, then its config."""
    if graph is None:
        mode = getattr(nnx, "set_graph_mode", None)
        graph = True if mode is None else bool(mode.current_value())
    if graph_updates is None:
        updates = getattr(nnx, "set_graph_updates", None)
        graph_updates = True if updates is None else bool(updates.current_value())
    return bool(graph), bool(graph_updates)


def _is_node_or_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable) or nnx.graph.is_graph_node(x)


def check_prefix(transform: str, name: str, prefix: Any, graph: bool) -> None:
    """flax's rules for a prefix (in_shardings, out_specs...) on the simple path."""

    def visit(path: KeyPath, leaf: Any) -> None:
        where = keystr(path)
        if isinstance(leaf, nnx.Variable):
            raise ValueError(_errors.variable_in_prefix(transform, name, where, leaf))
        if isinstance(leaf, (StateSharding, nnx.StateSharding)):
            raise ValueError(_errors.state_sharding_simple(transform, name, where))
        if is_tree_state(leaf) and not graph:  # graph mode takes it (`node_prefixes`)
            raise ValueError(_errors.graph_prefix_in_tree_mode(transform, name, where))
        if graph and nnx.graph.is_graph_node(leaf):
            raise ValueError(_errors.node_in_prefix_graph(transform, name, where, leaf))

    jax.tree_util.tree_map_with_path(
        visit,
        prefix,
        is_leaf=lambda x: (
            x is None
            or _is_node_or_variable(x)
            or is_tree_state(x)
            or isinstance(x, (StateSharding, nnx.StateSharding))
        ),
    )


def node_prefixes(prefix: Any) -> Any:
    """``prefix`` with each prefix made by ``nnx.prefix(node, ..., graph=True)`` (flax's
    ``TreeState``: the node's graph definition, and its entries by path) as the `TreeNode`
    that `to_tree` makes of such a node, its entries in place of the node's leaves: a
    prefix of the arguments (or outputs) as this path gives them to jax. It fits a node
    of the same graph definition only, as flax's does."""
    if not any(map(is_tree_state, jax.tree_util.tree_leaves(prefix, is_leaf=is_tree_state))):
        return prefix

    def convert(x: Any) -> Any:
        if not is_tree_state(x):
            return x
        flat = list(nnx.to_flat_state(x.state))
        return TreeNode(x.graphdef, tuple(tuple(p) for p, _ in flat), [v for _, v in flat])

    return jax.tree.map(convert, prefix, is_leaf=lambda y: y is None or is_tree_state(y))


def check_node_prefixes(
    transform: str, argument: str, prefix: Any, tree: Any, name: Callable[[KeyPath], str]
) -> None:
    """Each `TreeNode` of ``prefix`` (made by `node_prefixes`) against what is at its
    place in ``tree`` (converted by `to_tree`): a node of the same graph definition, or a
    ValueError (flax's type: jax refuses the prefix) naming the place (``name(path)``)
    and what differs. Other mismatches are left to jax's message."""
    try:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(prefix, is_leaf=_none_or_node)
        subtrees = treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        return
    found = []
    for (path, entry), sub in zip(leaves, subtrees, strict=True):
        if not isinstance(entry, TreeNode):
            continue
        if not isinstance(sub, TreeNode):
            found.append(_errors.node_prefix_difference(name(path), type(sub).__name__, [], []))
        elif sub.graphdef != entry.graphdef:
            missing = sorted(set(entry.paths) - set(sub.paths), key=str)
            extra = sorted(set(sub.paths) - set(entry.paths), key=str)
            found.append(_errors.node_prefix_difference(name(path), None, missing, extra))
    if found:
        raise ValueError(_errors.node_prefix_mismatch(transform, argument, found))


def _none_or_node(x: Any) -> bool:
    return x is None or isinstance(x, TreeNode)


def _none_or_tree_state(x: Any) -> bool:
    return x is None or is_tree_state(x)


def _entries(entry: Any) -> Callable[[KeyPath, nnx.Variable], Any]:
    """``(path in its node, Variable) -> its entry`` for a prefix leaf. For a prefix made
    by ``nnx.prefix(..., graph=True)`` that is, as in flax's check, the function
    ``nnx.prefix`` was given (kept by the prefix as ``prefix_fn``): a Variable shared
    with a node that comes first gets an entry by its path here as well, though the
    prefix holds it there only. Without one, the prefix's entry at that path."""
    if not is_tree_state(entry):
        return lambda path, variable: entry
    given = getattr(getattr(entry, "prefix_fn", None), "value", None)
    if callable(given):
        return lambda path, variable: given(tuple(path), variable)
    table = {tuple(p): v for p, v in nnx.to_flat_state(entry.state)}
    return lambda path, variable: table.get(tuple(path))


def argument_name(path: KeyPath) -> str:
    """A key path into ``(args, kwargs)`` as ``args[0]`` or ``kwargs['x']``."""
    if not path:
        return "arguments"
    head = "args" if getattr(path[0], "idx", None) == 0 else "kwargs"
    return head + keystr(path[1:])


def unique_leaves(prefix: Any, none_leaf: bool = True) -> list[Any]:
    """The distinct leaves of a prefix, in order: one group of updates each."""
    leaves = jax.tree_util.tree_leaves(prefix, is_leaf=lambda x: x is None and none_leaf)
    out: dict[Any, None] = {}
    for leaf in leaves:
        try:
            out.setdefault(leaf)
        except TypeError:  # unhashable: by identity
            out.setdefault(_ById(leaf))
    return [x.x if isinstance(x, _ById) else x for x in out]


@dataclasses.dataclass(frozen=True, eq=False)
class _ById:
    x: Any


# ---------------------------------------------------------------------------------------
# graph nodes as pytrees (graph mode without graph updates)


@dataclasses.dataclass(frozen=True)
class TreeNode:
    """A graph node flattened: its graphdef and paths (static), its leaves (data)."""

    graphdef: Any
    paths: tuple[KeyPath, ...]
    leaves: list[Any]


jax.tree_util.register_dataclass(
    TreeNode, data_fields=["leaves"], meta_fields=["graphdef", "paths"]
)


def to_tree(tree: Any) -> Any:
    """Each graph node and Variable of ``tree`` as a `TreeNode`; shared references
    between them are kept (one split context for the whole tree)."""
    with nnx.split_context() as ctx:

        def convert(x: Any) -> Any:
            if not _is_node_or_variable(x):
                return x
            graphdef, flat = ctx.flatten(x)
            return TreeNode(graphdef, tuple(map(tuple, flat.paths)), list(flat.leaves))

        return jax.tree.map(convert, tree, is_leaf=_is_node_or_variable)


def from_tree(tree: Any) -> Any:
    """The inverse of `to_tree`: each `TreeNode` merged back, keeping its Variables."""
    with nnx.merge_context() as ctx:

        def convert(x: Any) -> Any:
            if not isinstance(x, TreeNode):
                return x
            return ctx.unflatten(x.graphdef, list(x.leaves))

        return jax.tree.map(
            convert, tree, is_leaf=lambda x: isinstance(x, TreeNode) or _is_node_or_variable(x)
        )


def check_consistent(
    transform: str, argument: str, groups: dict[str, Any], prefixes: dict[str, Any]
) -> None:
    """flax's rule for graph mode with a prefix: a Variable reachable from several
    arguments gets the same prefix entry from each (None counts as an entry). A prefix
    made by ``nnx.prefix(..., graph=True)`` gives each Variable its own entry."""
    seen: dict[int, list[tuple[str, Any]]] = {}
    for name, tree in groups.items():
        for base, entry, sub in prefix_of(prefixes[name], tree, whole=_none_or_tree_state):
            entry_of = _entries(entry)
            for path, leaf in jax.tree_util.tree_leaves_with_path(
                sub, is_leaf=_is_node_or_variable
            ):
                if not _is_node_or_variable(leaf):
                    continue
                where = name + keystr(base + tuple(path))
                for local, value in nnx.iter_graph(leaf, graph=True):
                    if isinstance(value, nnx.Variable):
                        site = where + "".join(f".{p}" for p in local)
                        seen.setdefault(id(value), []).append((site, entry_of(local, value)))
    conflicts = []
    for sites in seen.values():
        entries = [e for _, e in sites]
        if any(e is not entries[0] and e != entries[0] for e in entries[1:]):
            conflicts.append(
                "one Variable gets "
                + ", ".join(f"{e!r} as {site}" for site, e in dict(sites).items())
            )
    if conflicts:
        raise ValueError(_errors.aliased_prefixes_simple(transform, argument, conflicts))


# ---------------------------------------------------------------------------------------
# aliasing and updates


def _variables(groups: dict[str, Any]) -> Iterator[tuple[str, KeyPath, nnx.Variable, str]]:
    """``(group, key path, Variable, where)``: ``where`` names a Variable of a `TreeNode`
    by its path in the graph node (``args[0].linear.kernel``), not in the `TreeNode`."""
    for name, tree in groups.items():
        for base, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=_node_or_variable):
            if isinstance(leaf, nnx.Variable):
                yield name, base, leaf, name + keystr(base)
            elif isinstance(leaf, TreeNode):  # one jax leaf per node leaf, in order
                inside = jax.tree_util.tree_leaves_with_path(leaf, is_leaf=is_variable)
                for (sub, item), local in zip(inside, leaf.paths, strict=True):
                    if isinstance(item, nnx.Variable):
                        at = "".join(f".{k}" if isinstance(k, str) else f"[{k}]" for k in local)
                        yield name, (*base, *sub), item, name + keystr(base) + at


def _node_or_variable(x: Any) -> bool:
    return isinstance(x, (TreeNode, nnx.Variable))


def _writable(variable: nnx.Variable) -> bool:
    try:
        variable.set_raw_value(variable.get_raw_value())
    except TraceContextError:
        return False
    return True


def check_aliases(
    transform: str, groups: dict[str, Any], returned: str | None = None
) -> dict[tuple[str, KeyPath], nnx.Variable]:
    """Every Variable of ``groups`` by ``(group, path)``; raises flax's ValueError if
    one appears twice, or if the ``returned`` group holds a Variable the function
    closed over (it cannot be returned: jax would leak its tracer)."""
    seen: dict[int, str] = {}
    out: dict[tuple[str, KeyPath], nnx.Variable] = {}
    for name, path, variable, where in _variables(groups):
        if name == returned and not _writable(variable):
            raise ValueError(_errors.captured_variable_returned(transform, where, variable))
        if id(variable) in seen:
            raise ValueError(_errors.duplicate_variable(transform, seen[id(variable)], where))
        seen[id(variable)] = where
        out[(name, path)] = variable
    return out


@dataclasses.dataclass
class Updates:
    """The changed Variables of one prefix group: paths (static), Variables (data)."""

    paths: tuple[tuple[str, KeyPath], ...]
    variables: list[nnx.Variable]


jax.tree_util.register_dataclass(Updates, data_fields=["variables"], meta_fields=["paths"])


def changed(post: nnx.Variable, pre: nnx.Variable) -> bool:
    """Whether a Variable's value (any of its leaves) was replaced."""
    post_leaves, post_def = jax.tree.flatten(post)
    pre_leaves, pre_def = jax.tree.flatten(pre)
    return post_def != pre_def or any(
        a is not b for a, b in zip(post_leaves, pre_leaves, strict=False)
    )


def prefix_of(
    prefix: Any, tree: Any, whole: Callable[[Any], bool] | None = None
) -> list[tuple[KeyPath, Any, Any]]:
    """``(path, prefix leaf, subtree)`` for each leaf of ``prefix``: None, and what
    ``whole`` says is a leaf (default: None only)."""
    keyed, treedef = jax.tree_util.tree_flatten_with_path(prefix, is_leaf=whole or _none)
    subtrees = treedef.flatten_up_to(tree)
    return [(tuple(p), leaf, sub) for (p, leaf), sub in zip(keyed, subtrees, strict=True)]


def get_updates(
    current: dict[str, Any],
    snapshot: dict[str, Any],
    prefixes: dict[str, Any],
    groups: list[Any],
    keep: Callable[[str, KeyPath], bool],
) -> list[Updates]:
    """The Variables of ``current`` that changed from ``snapshot`` (or that ``keep``
    says come back: donated ones), one `Updates` per entry of ``groups``."""
    out = [Updates((), []) for _ in groups]
    for name in current:
        cur = prefix_of(prefixes[name], current[name])
        snap = [s for _, _, s in prefix_of(prefixes[name], snapshot[name])]
        for (base, leaf, sub), sub_snap in zip(cur, snap, strict=True):
            pairs = zip(
                jax.tree_util.tree_leaves_with_path(sub, is_leaf=is_variable),
                jax.tree_util.tree_leaves(sub_snap, is_leaf=is_variable),
                strict=True,
            )
            for (path, c), s in pairs:
                if not isinstance(c, nnx.Variable) or c.hijax or c.ref:
                    continue
                full = base + tuple(path)
                if changed(c, s) or keep(name, full):
                    group = out[_group_index(groups, leaf)]
                    group.paths = (*group.paths, (name, full))
                    group.variables.append(c)
    return out


def _group_index(groups: list[Any], leaf: Any) -> int:
    for i, g in enumerate(groups):
        if g is leaf:
            return i
    for i, g in enumerate(groups):
        try:
            if g == leaf:
                return i
        except Exception:  # noqa: BLE001 - arrays compare elementwise
            continue
    raise AssertionError(f"no update group for {leaf!r}")


def _none(x: Any) -> bool:
    return x is None


def apply_updates(
    transform: str,
    variables: dict[tuple[str, KeyPath], nnx.Variable],
    updates: Iterable[Updates],
) -> None:
    """Writes each update to the caller's Variable at its path."""
    for group in updates:
        for key, update in zip(group.paths, group.variables, strict=True):
            variables[key].update_from_state(update)


def copy_tree(tree: Any) -> Any:
    """A copy of a pytree with fresh graph nodes and Variables (tree mode's inputs)."""
    return jax.tree.map(lambda x: x, tree)


def keep_variables(tree: Any) -> Any:
    """A copy of a pytree's containers, keeping its Variable objects."""
    return jax.tree.map(lambda x: x, tree, is_leaf=is_variable)


# ---------------------------------------------------------------------------------------
# the call, and its binding to the stages (`_stages.Binding`)


class SimpleCall:
    """What a simple-path transform does around its jax function (``jax.jit``/
    ``jax.shard_map`` of `inner`): convert, check aliases, call, write back, convert."""

    def __init__(
        self,
        transform: str,
        fun: Callable[..., Any],
        graph: bool,
        prefixes: dict[str, Any],
        groups: list[Any],
        keep: Callable[[str, KeyPath], bool] = lambda name, path: False,
        out_prefix: Any = None,
    ):
        self.transform = transform
        self.fun = fun
        self.graph = graph
        self.given = prefixes  # of the arguments, as given
        self.prefixes = {k: node_prefixes(v) for k, v in prefixes.items()}  # as jax gets them
        self.out_prefix = node_prefixes(out_prefix)  # of the output, as jax gets it
        self.groups = groups
        self.keep = keep
        self.in_name = "in_shardings" if transform == "jit" else "in_specs"
        self.out_name = "out_shardings" if transform == "jit" else "out_specs"

    def inner(self, *args: Any, **kwargs: Any) -> tuple[Any, list[Updates]]:
        """The function jax traces: the user's, on copies, returning the updates too."""
        args, kwargs = copy_tree((args, kwargs))
        inputs = {"args": args, "kwargs": kwargs}
        current, snapshot = keep_variables(inputs), copy_tree(inputs)
        if self.graph:
            args, kwargs = from_tree((args, kwargs))
        out = self.fun(*args, **kwargs)
        if self.graph:
            out = to_tree(out)
            if self.out_prefix is not None:
                check_node_prefixes(
                    self.transform, self.out_name, self.out_prefix, out, lambda p: "out" + keystr(p)
                )
        check_aliases(self.transform, {**current, "out": out}, returned="out")
        updates = get_updates(current, snapshot, self.prefixes, self.groups, self.keep)
        return out, updates

    def prepare(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], check: bool = True
    ) -> tuple[tuple[Any, ...], dict[str, Any], dict[tuple[str, KeyPath], nnx.Variable]]:
        """The arguments jax gets, and the caller's Variables by path."""
        if self.graph:
            converted = to_tree((args, kwargs))
            if self.prefixes["args"] is not None:
                prefix = (self.prefixes["args"], None)
                check_node_prefixes(self.transform, self.in_name, prefix, converted, argument_name)
                inputs = {"args": args, "kwargs": kwargs}
                check_consistent(self.transform, self.in_name, inputs, self.given)
            args, kwargs = converted
        variables = check_aliases(self.transform, {"args": args, "kwargs": kwargs}) if check else {}
        return args, kwargs, variables

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Calls ``fn`` (jitted, shard-mapped or compiled) with the caller's arguments."""
        args, kwargs, variables = self.prepare(args, kwargs)
        out, updates = fn(*args, **kwargs)
        apply_updates(self.transform, variables, updates)
        return from_tree(out) if self.graph else out

    def finish(self, out: Any) -> Any:
        return from_tree(out) if self.graph else out

    # the `_stages.Binding` protocol: the simple path's stages are `_stages`' classes

    def arguments(self, infos: Any) -> Any:
        """jax's ``args_info`` -> the caller's ``(args, kwargs)``, each graph node as an
        ``nnx.State`` of ``ArgInfo`` by path (as on the full path)."""
        if self.graph:  # each node's own leaves, as jax flattened them
            return jax.tree.map(_node_state, infos, is_leaf=lambda x: isinstance(x, TreeNode))
        return jax.tree.map(_as_state, infos, is_leaf=_is_node_or_variable)

    def outputs(self, member: Any, inputs: Callable[[], list[Any]]) -> Any:
        """A member in the program's ``(output, updates)`` structure -> the output's,
        graph nodes as modules (outputs are new objects here: ``inputs`` unused)."""
        return self.finish(member[0])

    def lowering_error(self, error: ValueError) -> str | None:
        return None

    def runner(self, compiled: Any, waits: bool) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.run(compiled, args, kwargs)


def _node_state(x: Any) -> Any:
    """A `TreeNode` whose Variables hold per-Variable values -> an ``nnx.State`` of
    those values by path (a Variable: its value); anything else as it is."""
    if not isinstance(x, TreeNode):
        return x
    values = [v.get_value() if isinstance(v, nnx.Variable) else v for v in x.leaves]
    if list(x.paths) == [()]:
        return values[0]
    return nnx.from_flat_state(list(zip(x.paths, values, strict=True)))


def _as_state(x: Any) -> Any:
    """A graph node whose Variables hold per-Variable values -> an ``nnx.State`` of
    those values by path, a Variable its value; anything else as it is."""
    if isinstance(x, nnx.Variable):
        return x.get_value()
    if not _is_node_or_variable(x):
        return x
    flat = nnx.to_flat_state(nnx.state(x))
    return nnx.from_flat_state([(path, v.get_value()) for path, v in flat])
