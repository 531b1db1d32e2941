"""Messages of the simple call path: ``graph=False`` (tree mode) or ``graph_updates=False``."""

from __future__ import annotations

from typing import Any

from ._layout import bound_method_message, format_message

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
        [f"use tree mode: `nnx_sharding.{transform}(..., graph=False)`;", _ONE_SHARDING],
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


def graph_prefix_unsupported(transform: str, argument: str, where: str) -> str:
    """flax's graph-mode tree prefix (``nnx.prefix(..., graph=True)``)."""
    return _prefix_entry(
        transform,
        argument,
        "a prefix made by `nnx.prefix(..., graph=True)`",
        where,
        "Rule: nnx_sharding takes a prefix of a graph node's Variables as a StateSharding "
        "(graph=True, graph_updates=True) or as a tree prefix in tree mode (graph=False); "
        "flax's graph-mode tree prefix is not supported.",
        [
            f"use the full graph protocol, {_full(transform)}, with "
            "`nnx_sharding.StateSharding(rules)` at that place;",
            f"or tree mode, `nnx_sharding.{transform}(..., graph=False)`, with "
            "`nnx.prefix(model, rules, graph=False)`;",
            f"or {_ONE_SHARDING}",
        ],
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
