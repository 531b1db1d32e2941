"""Messages of the simple call path: ``graph=False`` (tree mode) or ``graph_updates=False``."""

from __future__ import annotations

from typing import Any

from .layout import bound_method_message, format_message

_ONE_SHARDING = "give the graph node one sharding (or PartitionSpec) for all its Variables."


def _full(transform: str) -> str:
    """The call with the full graph protocol (the default), as the fixes suggest it."""
    return f"`nnx_sharding.{transform}(..., graph=True, graph_updates=True)`"


def _prefix_entry(
    transform: str,
    argument: str,
    what: str,
    where: str,
    rule: str,
    fixes: list[str],
    flax: str = "",
) -> str:
    """A prefix entry this path cannot take: ``what`` it is, at ``where`` (empty: the top)."""
    return format_message(
        transform, argument, [f"{what} at {where or 'the top'}"], rule, fixes, flax=flax
    )


def duplicate_variable(transform: str, first: str, second: str) -> str:
    """A Variable met twice among the inputs and outputs on the simple path."""
    return format_message(
        transform,
        "arguments and outputs",
        [f"the same Variable is at {first} and at {second}"],
        f"Rule: with graph=False or graph_updates=False, {transform} treats graph nodes as "
        "pytrees: a Variable may appear only once among the inputs and outputs (no shared "
        "references, no input Variable returned).",
        [
            "pass each Variable once, and return new objects instead of inputs;",
            "copy the second occurrence with `nnx.clone(...)` before the call;",
            f"use the full graph protocol: {_full(transform)} (the default).",
        ],
        flax="with graph_updates=False does not support Variable aliasing",
    )


def captured_variable_returned(transform: str, where: str, variable: Any) -> str:
    """The function returns a Variable it closed over (made outside its trace)."""
    return format_message(
        transform,
        "output",
        [f"{where} is a {type(variable).__name__} the function closed over"],
        "Rule: a Variable made outside the function can only be changed, not returned, "
        "when graph=False or graph_updates=False.",
        [
            "pass the Variable (or its module) as an argument instead of closing over it;",
            "return its value (`v[...]`) instead of the Variable.",
        ],
        flax="Cannot return captured Variable",
    )


def state_sharding_simple(transform: str, argument: str, where: str) -> str:
    """A StateSharding in a prefix on the simple path."""
    return _prefix_entry(
        transform,
        argument,
        "a StateSharding",
        where,
        "Rule: a StateSharding needs the graph protocol: it cannot be used with "
        "graph=False or graph_updates=False.",
        [f"use the full graph protocol: {_full(transform)};", _ONE_SHARDING],
        flax="cannot contain `StateSharding` objects when `graph=False` or `graph_updates=False`",
    )


def variable_in_prefix(transform: str, argument: str, where: str, variable: Any) -> str:
    """A Variable as a prefix entry."""
    return _prefix_entry(
        transform,
        argument,
        f"a {type(variable).__name__}",
        where,
        "Rule: a prefix gives one sharding for a whole Variable, not a Variable.",
        ["put the Variable's sharding (or PartitionSpec) at its place instead."],
        flax="Variables prefixes are not supported",
    )


def node_in_prefix_graph(transform: str, argument: str, where: str, node: Any) -> str:
    """A graph node as a prefix entry in graph mode."""
    return _prefix_entry(
        transform,
        argument,
        f"a {type(node).__name__}",
        where,
        "Rule: in graph mode a prefix may not hold graph nodes (a tree prefix made with "
        "`nnx.prefix(..., graph=False)` is for tree mode).",
        [
            f"use tree mode: `nnx_sharding.{transform}(..., graph=False)`;",
            "or, made by `nnx.prefix`, make the prefix for graph mode: "
            "`nnx.prefix(model, rules, graph=True)`;",
            f"or {_ONE_SHARDING}",
        ],
        flax="Graph nodes are not allowed as prefixes when graph=True",
    )


def bound_method_simple(transform: str, type_name: str) -> str:
    """A bound method of a graph node given to jit on the simple path."""
    return bound_method_message(
        transform,
        "fun",
        type_name,
        "Rule: with graph=False or graph_updates=False the module a method is bound to "
        "is not an argument, so its updates could not come back (flax refuses it too).",
        [
            f"decorate the method (`@nnx_sharding.{transform}(...)` in the class body);",
            f"or call `nnx_sharding.{transform}(MyClass.method, ...)(instance, ...)`;",
            f"or use the full graph protocol: {_full(transform)}, which takes bound methods.",
        ],
    )


def graph_prefix_in_tree_mode(transform: str, argument: str, where: str) -> str:
    """flax's graph-mode prefix (``nnx.prefix(..., graph=True)``) in tree mode."""
    return format_message(
        transform,
        argument,
        [f"a prefix made by `nnx.prefix(..., graph=True)` at {where or 'the top'}"],
        "Rule: in tree mode (graph=False) a graph node is a pytree, and its prefix is the "
        "tree `nnx.prefix(..., graph=False)` makes; a prefix made with graph=True is for "
        "graph=True, graph_updates=False.",
        [
            "make the prefix for tree mode: `nnx.prefix(model, rules, graph=False)`;",
            "or keep the prefix and use graph mode without graph updates: "
            f"`nnx_sharding.{transform}(..., graph=True, graph_updates=False)`;",
            f"or use the full graph protocol, {_full(transform)}, with "
            "`nnx_sharding.StateSharding(rules)` at that place.",
        ],
        flax="`TreeState` objects are only allowed as prefixes when `graph=True` and "
        "`graph_updates=False`",
    )


def node_prefix_difference(
    where: str, not_node: str | None, missing: list[Any], extra: list[Any]
) -> str:
    """One place where a prefix made by ``nnx.prefix(..., graph=True)`` does not fit:
    ``not_node`` names the type found there when it is not a graph node; else
    ``missing`` and ``extra`` are the leaf paths the node there lacks and adds."""
    if not_node is not None:
        return f"{where} is a {not_node}, not a graph node"

    def listed(paths: list[Any]) -> str:
        names = [".".join(map(str, p)) for p in paths[:3]]
        return ", ".join(names) + (", ..." if len(paths) > 3 else "")

    parts = []
    if missing:
        parts.append(f"lacks {listed(missing)}, which the prefix's node has")
    if extra:
        parts.append(f"has {listed(extra)}, which the prefix's node lacks")
    if not parts:
        parts.append(
            "has the leaves of the prefix's node, but another graph definition (a static "
            "attribute, a type or a shared reference differs)"
        )
    return f"{where} " + "; ".join(parts)


def node_prefix_mismatch(transform: str, argument: str, problems: list[str]) -> str:
    """A prefix made by ``nnx.prefix(node, ..., graph=True)`` for a node of another
    graph definition (graph mode without graph updates)."""
    return format_message(
        transform,
        argument,
        problems,
        "Rule: a prefix made by `nnx.prefix(node, rules, graph=True)` holds that node's "
        "graph definition and fits a graph node of the same definition only (flax's "
        "prefix as well); shared references count, so nodes that share Variables get "
        "their prefixes from one call.",
        [
            "make the prefix from a node built like the one at that place: "
            "`nnx.prefix(model, rules, graph=True)`;",
            "for several arguments that share Variables, make their prefixes together: "
            "`nnx.prefix((a, b), rules, graph=True)`;",
            f"or use the full graph protocol, {_full(transform)}, with "
            "`nnx_sharding.StateSharding(rules)`, which resolves its rules for each call.",
        ],
        flax="pytree structure error: different pytree metadata",
    )


def aliased_prefixes_simple(transform: str, argument: str, conflicts: list[str]) -> str:
    """A shared Variable given two prefix entries, graph mode without graph updates."""
    return format_message(
        transform,
        argument,
        conflicts,
        "Rule: with graph_updates=False, a Variable reachable from several arguments must "
        "get the same entry from each of them (None counts as an entry).",
        [
            "give every argument that reaches the Variable the same entry;",
            f"or use the full graph protocol, {_full(transform)}, "
            "where None leaves the shared Variable to its other entry.",
        ],
        flax="Inconsistent aliasing detected",
    )
