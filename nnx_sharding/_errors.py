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


def bad_shardings(transform: str, argument: str, problems: Sequence[str], jax_message: str) -> str:
    return format_message(
        transform,
        argument,
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


def shard_map_without_mesh(transform: str) -> str:
    return format_message(
        transform,
        "mesh",
        ["no mesh was given and none is set in the context"],
        "Rule: shard_map maps over the axes of a mesh: the `mesh=` argument, or the one "
        "set with `jax.set_mesh`.",
        [
            "pass `mesh=jax.make_mesh(...)`;",
            "or call it inside `with jax.set_mesh(mesh):`.",
        ],
    )


def structure_changed(transform: str, wheres: Sequence[str]) -> str:
    return format_message(
        transform,
        "arguments",
        [f"the function changed the graph structure of {w}" for w in wheres],
        "Rule: inside shard_map each device holds its own shard of a module, so the "
        "function may update Variable values but not add, remove or replace attributes, "
        "Variables or submodules.",
        [
            "make the structure change outside the shard_map, before or after the call;",
            "or return the new objects as outputs instead of attaching them to an input.",
        ],
    )


def cannot_infer_specs(transform: str, axes: Sequence[str]) -> str:
    return format_message(
        transform,
        "in_specs",
        [f"in_specs is None, but mesh axis {a!r} is not Explicit" for a in axes],
        "Rule: in_specs can be left out only when every manual mesh axis is of type "
        "AxisType.Explicit, so that each argument's sharding is part of its type.",
        [
            "give in_specs, e.g. `in_specs=(StateSharding({nnx.Param: P(None, 'model'), "
            "...: P()}), P('data'))`;",
            "or make the mesh with `axis_types=(AxisType.Explicit,) * n` and shard the "
            "arguments on it.",
        ],
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
    )


_FLAT_KEY = re.compile(r"\b(donated|kept)\[(\d+)\]")


def name_leaves(message: str, donated: Sequence[object], kept: Sequence[object]) -> str:
    """Replaces jax's flat key paths (``kept[3]``) by the caller's Variable paths."""
    sites = {"donated": donated, "kept": kept}

    def site(m: re.Match[str]) -> str:
        group, index = sites[m.group(1)], int(m.group(2))
        return str(group[index]) if index < len(group) else m.group(0)

    return _FLAT_KEY.sub(site, message)


# Metadata, tables and inspection (issue 5) -----------------------------------------------------


def not_a_node(transform: str, argument: str, type_name: str) -> str:
    return format_message(
        transform,
        argument,
        [f"found a {type_name}"],
        "Rule: the tree is a graph node (Module, Optimizer, nnx.List/nnx.Dict, ...) or an "
        "nnx.State of Variables.",
        [
            "pass the module itself, e.g. `shard(model)`;",
            "or its state, e.g. `nnx.state(model)`.",
        ],
    )


def bad_rules(transform: str, detail: str) -> str:
    return format_message(
        transform,
        "rules",
        [detail],
        "Rule: rules is a sequence of (logical axis name, mesh axis or None) pairs, the "
        "form of flax's `nnx.logical_axis_rules`.",
        [
            "write it as a list of pairs, e.g. `[('embed', None), ('mlp', 'model')]`;",
            "map a logical name to several mesh axes with a tuple, e.g. `('batch', ('data', "
            "'fsdp'))`.",
        ],
    )


def unknown_logical_axes(transform: str, problems: Sequence[str], known: Sequence[str]) -> str:
    return format_message(
        transform,
        "rules",
        list(problems),
        "Rule: with rules given, every name in a Variable's sharding metadata (out_sharding, "
        "set by `nnx.with_partitioning`) is a logical axis name the rules map; rules map: "
        + (", ".join(repr(k) for k in known) or "nothing")
        + ".",
        [
            "add a pair `(name, mesh axis or None)` for each such name to rules;",
            "or correct the name in the metadata, e.g. "
            "`nnx.with_partitioning(init, ('embed', 'mlp'))`.",
        ],
    )


def unknown_mesh_axes(
    transform: str, argument: str, problems: Sequence[str], mesh_axes: Sequence[str]
) -> str:
    return format_message(
        transform,
        argument,
        list(problems),
        "Rule: a Variable's sharding names axes of the mesh it is placed on; the mesh has "
        + (", ".join(repr(a) for a in mesh_axes) or "no axes")
        + ".",
        [
            "map the logical name to an existing mesh axis (or None) in rules;",
            "or use a mesh that has that axis, e.g. `jax.make_mesh((2, 4), ('data', 'model'))`.",
        ],
    )


def no_mesh(transform: str) -> str:
    return format_message(
        transform,
        "mesh",
        ["no mesh was given and none is set"],
        "Rule: PartitionSpecs from metadata need a mesh to become shardings.",
        [
            "pass one, e.g. `shard(model, mesh)`;",
            "or call it inside `with jax.set_mesh(mesh):`.",
        ],
    )


def cannot_place(transform: str, path: str, detail: str, jax_message: str) -> str:
    return format_message(
        transform,
        "tree",
        [f"the Variable at {path} cannot be placed: {detail}"],
        "Rule: a sharding must fit its array: one spec entry per dimension at most and each "
        f"sharded dimension divisible by its mesh axes' size. (jax said: "
        f"{jax_message.splitlines()[0] if jax_message else 'nothing'})",
        [
            "change the Variable's sharding metadata or the rules (None replicates a dimension);",
            "pad the dimension to a multiple of the mesh axis size, or use a smaller mesh axis.",
        ],
    )


def unknown_paths(transform: str, missing: Sequence[str], available: Sequence[str]) -> str:
    shown = ", ".join(available[:12]) + (", ..." if len(available) > 12 else "")
    return format_message(
        transform,
        "paths",
        [f"no Variable at {p}" for p in missing],
        f"Rule: paths name rows of the table, in the `.layers[0].kernel` style; rows: {shown}.",
        [
            "copy a path from the table's `path` column;",
            "or give the path as a tuple of keys, e.g. `('layers', 0, 'kernel')`.",
        ],
    )


def not_drawable(transform: str, problems: Sequence[str]) -> str:
    return format_message(
        transform,
        "paths",
        list(problems),
        "Rule: jax draws device grids of 1-D and 2-D arrays whose sharding has devices.",
        [
            "leave such Variables out of paths (the table still lists them);",
            "for an abstract model, call it inside `with jax.set_mesh(mesh):` so that its "
            "abstract mesh gets devices.",
        ],
    )
