"""Every user-facing error message, built in one place.

A message names the transform and the argument, says what was found and where
(a ``jax.tree_util.keystr`` path), states the rule, then lists numbered fixes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def format_message(
    transform: str,
    argument: str,
    problems: Sequence[str],
    rule: str,
    fixes: Sequence[str],
) -> str:
    """Assembles the standard message layout; every ``problems`` entry is listed."""
    lines = [f"{transform}: {argument}: " + (problems[0] if len(problems) == 1 else "")]
    if len(problems) > 1:
        lines[0] += f"{len(problems)} problems:"
        lines += [f"  - {p}" for p in problems]
    lines.append(rule)
    lines.append("Fixes:")
    lines += [f"  {i}. {fix}" for i, fix in enumerate(fixes, 1)]
    return "\n".join(lines)


def no_filter_matched(path: str, var_type: str, filters: Sequence[object]) -> str:
    return format_message(
        "StateSharding",
        "spec",
        [f"the Variable at {path} (type {var_type}) matches none of the filters"],
        "Rule: every Variable of a graph node needs a sharding; filters tried, in order: "
        + ", ".join(repr(f) for f in filters)
        + ".",
        [
            "add a filter that matches it, e.g. `(nnx.Param, P())`;",
            "end the mapping with a catch-all entry `(..., None)` (None: let jax choose).",
        ],
    )


def node_in_prefix(transform: str, argument: str, path: str, type_name: str) -> str:
    return format_message(
        transform,
        argument,
        [f"found a graph node of type {type_name} at {path}"],
        "Rule: shardings and specs are given as a pytree prefix of the arguments; at a graph "
        "node's position put a StateSharding, one Sharding or PartitionSpec for all its "
        "Variables, or None.",
        [
            "replace the module with `StateSharding({nnx.Param: P(...), ...})`;",
            "to reuse the shardings a module already carries, use "
            "`StateSharding(nnx.get_named_sharding(nnx.state(model), mesh))`.",
        ],
    )


def state_sharding_at_leaf(transform: str, argument: str, path: str, type_name: str) -> str:
    return format_message(
        transform,
        argument,
        [f"a StateSharding stands at {path}, where the argument is a {type_name}"],
        "Rule: a StateSharding applies only at the position of a graph node (Module, "
        "Variable, Rngs, Optimizer, nnx.List/nnx.Dict).",
        [
            "give a Sharding or PartitionSpec for plain arrays;",
            "move the StateSharding to the position of the module it describes.",
        ],
    )


def not_a_prefix(transform: str, argument: str, detail: str) -> str:
    return format_message(
        transform,
        argument,
        [f"is not a pytree prefix of the arguments ({detail})"],
        "Rule: the tree must match the arguments' structure down to where each "
        "sharding or spec stands; a single value applies to everything below it.",
        [
            "give one entry per positional argument, e.g. `(StateSharding(...), P('data'))`;",
            "use None for an argument that needs no sharding.",
        ],
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
    )


def bad_static(transform: str, argument: str, type_name: str, err: str) -> str:
    return format_message(
        transform,
        argument,
        [f"the static argument of type {type_name} is not hashable ({err})"],
        "Rule: static arguments are part of the compilation key, so they must be hashable.",
        [
            "pass it as a dynamic argument (drop it from static_argnums/static_argnames);",
            "convert it to a hashable value (a tuple instead of a list, a frozen dataclass).",
        ],
    )


def bad_shardings(transform: str, problems: Sequence[str], jax_message: str) -> str:
    return format_message(
        transform,
        "in_shardings",
        list(problems),
        "Rule: a sharding must fit its array: one spec entry per dimension at most, mesh "
        "axes that exist, and each sharded dimension divisible by its mesh axes' size. "
        f"(jax said: {jax_message.splitlines()[0]})",
        [
            "change the filter or spec for these Variables (None or P() replicates them);",
            "pad the dimension to a multiple of the mesh axis size, or use a smaller mesh axis.",
        ],
    )


def structure_mismatch(transform: str, differences: Sequence[str]) -> str:
    return format_message(
        transform,
        "arguments",
        list(differences),
        "Rule: a Compiled object runs only with arguments of the structure it was "
        "lowered for: the same module graphs, array shapes, dtypes and static arguments.",
        [
            "call the JitWrapped instead, which compiles again for new structures;",
            "or lower and compile again with the new arguments.",
        ],
    )


_FLAT_KEY = re.compile(r"\b(donated|kept)\[(\d+)\]")


def name_leaves(message: str, donated: Sequence[object], kept: Sequence[object]) -> str:
    """Replaces jax's flat key paths (``kept[3]``) by the caller's Variable paths."""
    sites = {"donated": donated, "kept": kept}

    def site(m: re.Match[str]) -> str:
        group, index = sites[m.group(1)], int(m.group(2))
        return str(group[index]) if index < len(group) else m.group(0)

    return _FLAT_KEY.sub(site, message)
