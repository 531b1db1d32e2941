"""Messages about sharding prefixes: their entries, their structure, aliased Variables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax import nnx

from .layout import format_message, with_article, wrap_in_spec


def node_in_prefix(transform: str, argument: str, path: str, node: object) -> str:
    """A graph node (or a Variable) where a prefix wants a sharding entry."""
    return format_message(
        transform,
        argument,
        [f"found a graph node of type {type(node).__name__} at {path}"],
        "Rule: shardings and specs are given as a pytree prefix of the arguments; at a graph "
        "node's position put a StateSharding, one Sharding or PartitionSpec for all its "
        "Variables, or None.",
        [
            "replace the module with a StateSharding of its Variables' shardings, e.g. "
            "`StateSharding({nnx.PathContains('kernel'): P(None, 'model'), ...: P()})`;",
            "or with flax's form of it, "
            "`nnx.prefix(model, {nnx.PathContains('kernel'): P(None, 'model'), ...: P()})` "
            "(made in graph mode, the default);",
            "to use the shardings its Variables' metadata names, "
            "`StateSharding.from_metadata(model, rules)` (rules map logical axis names to mesh "
            "axes; leave them out where the names are mesh axes).",
        ],
        flax="Variables prefixes are not supported"
        if isinstance(node, nnx.Variable)
        else "Graph nodes are not allowed as prefixes",
    )


def state_sharding_at_leaf(transform: str, argument: str, path: str, type_name: str) -> str:
    return format_message(
        transform,
        argument,
        [f"a StateSharding stands at {path}, where the argument is {with_article(type_name)}"],
        "Rule: a StateSharding applies only at the position of a graph node (Module, "
        "Variable, Rngs, Optimizer, nnx.List/nnx.Dict).",
        [
            "give a Sharding or PartitionSpec for plain arrays;",
            "move the StateSharding to the position of the module it describes.",
        ],
    )


def prefix_mismatch(where: str, prefix: object, tree: object, tree_name: str) -> str:
    """The detail of `not_a_prefix`: where the prefix and the tree part ways."""

    def describe(x: Any) -> str:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return f"an array of shape {tuple(x.shape)}"
        n = f" of {len(x)} entries" if isinstance(x, (tuple, list, dict)) else ""
        return with_article(type(x).__name__) + n

    verb = "have" if tree_name.endswith("s") else "has"
    return f"at {where} it has {describe(prefix)} where the {tree_name} {verb} {describe(tree)}"


_PREFIX_FIXES = {
    "arguments": (
        "give one entry per positional argument, e.g. `(StateSharding(...), P('data'))`;",
        "use None for an argument that needs no sharding;",
        "pass the arguments positionally: as in `jax.jit`, the entries stand for the "
        "positional arguments only, and an argument passed by keyword is not one.",
    ),
    "output": (
        "give one entry per element of the output, e.g. `(StateSharding(...), P('data'))`;",
        "use None for an element that needs no sharding.",
    ),
    "target": (
        "give one entry per element of the target, e.g. `(StateSharding(...), None)` for "
        "`(model, optimizer)`, or one StateSharding for all of it;",
        "use None for an element that keeps its own placement.",
    ),
}


def not_a_prefix(transform: str, argument: str, detail: str, tree_name: str = "arguments") -> str:
    """``tree_name``: what the prefix describes: ``arguments``, ``output`` or ``target``."""
    whose = tree_name + ("'" if tree_name.endswith("s") else "'s")
    return format_message(
        transform,
        argument,
        [f"is not a pytree prefix of the {tree_name} ({detail})"],
        f"Rule: the tree must match the {whose} structure down to where each "
        "sharding or spec stands; a single value applies to everything below it.",
        list(_PREFIX_FIXES[tree_name]),
        flax="pytree structure error",
    )


def aliased_shardings(transform: str, argument: str, conflicts: Sequence[str]) -> str:
    return format_message(
        transform,
        argument,
        list(conflicts),
        "Rule: a Variable reachable through several paths (a shared reference) must "
        "receive one sharding.",
        [
            "make the filters give the same sharding on every path to the shared Variable;",
            "or give the sharding at one path only and None at the others.",
        ],
        flax="Inconsistent aliasing detected",
    )


def bad_prefix_entry(transform: str, argument: str, where: str, type_name: str) -> str:
    return format_message(
        transform,
        argument,
        [f"found {with_article(type_name)} at {where}"],
        "Rule: each entry is a Sharding, a PartitionSpec, a StateSharding or None.",
        [wrap_in_spec("P('data')")],
        flax=f"{argument} argument must be a pytree of `jax.sharding.PartitionSpec` instances"
        if transform == "shard_map"
        else f"{argument} leaf specifications are expected to be PartitionSpec instances or None",
    )


def state_sharding_above(transform: str, argument: str, wheres: Sequence[str]) -> str:
    return format_message(
        transform,
        argument,
        [f"a StateSharding stands at {w}, which is not a single graph node" for w in wheres],
        "Rule: in shard_map's out_specs a StateSharding goes at the position of exactly "
        "one graph node of the output.",
        [
            "repeat the StateSharding at each graph node's position, e.g. `(s, s)`;",
            "or use one PartitionSpec, which applies to every Variable below it.",
        ],
        flax="pytree structure error",
    )
