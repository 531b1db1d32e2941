"""Every user-facing error message, built in one place.

A message names the transform and the argument, says what was found and where
(a ``jax.tree_util.keystr`` path), states the rule, then lists numbered fixes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def _a(name: str) -> str:
    """``name`` with its indefinite article: ``an int``, ``a str``."""
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


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


def no_filter_matched(
    path: str,
    var_type: str,
    filters: Sequence[object],
    transform: str = "StateSharding",
    argument: str = "spec",
    more: Sequence[tuple[str, str]] = (),
) -> str:
    """No filter matches the Variable at ``path``; ``more``: further (path, type) pairs."""
    return format_message(
        transform,
        argument,
        [
            f"the Variable at {p} (type {t}) matches none of the filters"
            for p, t in [(path, var_type), *more]
        ],
        "Rule: every Variable of a graph node needs a sharding; filters tried, in order: "
        + ", ".join(repr(f) for f in filters)
        + ".",
        [
            "add a filter that matches it, e.g. `(nnx.Param, P())`;",
            "end the mapping with a catch-all entry `(..., None)` (None: let jax choose).",
        ],
    )


_SPEC_RULE = (
    "Rule: spec is a mapping `{filter: sharding}`, an iterable of `(filter, sharding)` pairs "
    "or an nnx.State of shardings; a filter is anything nnx accepts (a Variable type, a tag "
    "string, a predicate `(path, value) -> bool`, `...`, a tuple of these); a sharding is a "
    "jax.sharding.Sharding, a PartitionSpec or None."
)


def bad_state_sharding_spec(problem: str) -> str:
    """``StateSharding(spec)`` with a spec of the wrong form."""
    return format_message(
        "StateSharding",
        "spec",
        [problem],
        _SPEC_RULE,
        [
            "write it as a mapping, e.g. `StateSharding({nnx.Param: P('model'), ...: None})`;",
            "or as a list of pairs, e.g. `StateSharding([(nnx.Param, P()), (..., None)])`.",
        ],
    )


def spec_not_pairs(type_name: str) -> str:
    return bad_state_sharding_spec(
        f"found {_a(type_name)}, which is not a mapping, an nnx.State or an iterable of pairs"
    )


def spec_entry_not_a_pair(entry: object) -> str:
    return bad_state_sharding_spec(f"the entry {entry!r} is not a (filter, sharding) pair")


def bad_filter(filter_: object, error: BaseException) -> str:
    return format_message(
        "StateSharding",
        "spec",
        [
            f"the filter {filter_!r} ({_a(type(filter_).__name__)}) is not an nnx filter "
            f"({type(error).__name__}: {error})"
        ],
        _SPEC_RULE,
        [
            "use a Variable type (`nnx.Param`), a path filter (`nnx.PathContains('kernel')`) "
            "or `...` for everything else;",
            "or write a predicate, e.g. `lambda path, value: path[-1] == 'kernel'`.",
        ],
    )


def spec_value_not_a_sharding(filter_: object, type_name: str) -> str:
    return format_message(
        "StateSharding",
        "spec",
        [f"the value for filter {filter_!r} is a {type_name}"],
        "Rule: each value is a jax.sharding.Sharding, a PartitionSpec or None.",
        ["wrap mesh axis names in PartitionSpec, e.g. P('model', None)."],
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


def prefix_mismatch(where: str, prefix: object, tree: object, tree_name: str) -> str:
    """The detail of `not_a_prefix`: where the prefix and the tree part ways."""

    def describe(x: object) -> str:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return f"an array of shape {tuple(x.shape)}"
        n = f" of {len(x)} entries" if isinstance(x, (tuple, list, dict)) else ""
        return _a(type(x).__name__) + n

    verb = "have" if tree_name.endswith("s") else "has"
    return f"at {where} it has {describe(prefix)} where the {tree_name} {verb} {describe(tree)}"


def not_a_prefix(transform: str, argument: str, detail: str, tree_name: str = "arguments") -> str:
    """``tree_name``: what the prefix describes, ``arguments`` or ``output``."""
    entry = "positional argument" if tree_name == "arguments" else "element of the output"
    whose = tree_name + ("'" if tree_name.endswith("s") else "'s")
    return format_message(
        transform,
        argument,
        [f"is not a pytree prefix of the {tree_name} ({detail})"],
        f"Rule: the tree must match the {whose} structure down to where each "
        "sharding or spec stands; a single value applies to everything below it.",
        [
            f"give one entry per {entry}, e.g. `(StateSharding(...), P('data'))`;",
            f"use None for {'an argument' if tree_name == 'arguments' else 'an element'} "
            "that needs no sharding.",
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


def rank_too_low(spec_rank: int, rank: int) -> str:
    return f"the spec needs rank at least {spec_rank}, but the value has rank {rank}"


def misfit(where: str, shape: tuple[int, ...], sharding: object, detail: str) -> str:
    """A problem for `bad_shardings`: the array at ``where`` does not fit its sharding."""
    return f"{where}: shape {shape} with {sharding}: {detail}"


def bad_shardings(
    transform: str, argument: str, problems: Sequence[str], jax_message: str = ""
) -> str:
    said = f" (jax said: {jax_message.splitlines()[0]})" if jax_message else ""
    return format_message(
        transform,
        argument,
        list(problems),
        "Rule: a sharding must fit its array: one spec entry per dimension at most, mesh "
        "axes that exist, and each sharded dimension divisible by its mesh axes' size." + said,
        [
            "change the filter or spec for these Variables (None or P() replicates them);",
            "pad the dimension to a multiple of the mesh axis size, or use a smaller mesh axis.",
        ],
    )


def sharding_mismatch(
    transform: str, argument: str, found: Sequence[tuple[str, object, object]]
) -> str:
    """``found``: (where, the array's sharding, the sharding ``argument`` asks for)."""
    return format_message(
        transform,
        argument,
        [
            f"the array at {where} is committed to {got!r}, which does not match the "
            f"sharding {want!r} from {argument}"
            for where, got, want in found
        ],
        "Rule: jit does not move an argument that is committed to devices (placed with "
        "jax.device_put, or computed by another program): its sharding must match "
        f"{argument}.",
        [
            "move it first, e.g. `jax.device_put(x, sharding)`, or for a module "
            "`nnx.update(model, jax.device_put(nnx.state(model), shardings))`;",
            f"or ask for the sharding it has in {argument} (None takes the argument's own).",
        ],
    )


def deleted_buffers(transform: str, wheres: Sequence[str], jax_message: str) -> str:
    return format_message(
        transform,
        "arguments",
        [f"the array at {w} has been deleted (donated to an earlier call?)" for w in wheres],
        "Rule: donation consumes buffers: a call with donate_argnums/donate_argnames deletes "
        "the donated arrays and gives the argument's Variables new ones; any other "
        "reference to the old arrays (e.g. an `nnx.clone` of the donated module, which "
        f"shares its buffers) can no longer be read. (jax said: {jax_message.splitlines()[0]})",
        [
            "read the donated module itself after the call, not a second reference kept from "
            "before it;",
            "give the second reference buffers of its own before donating, e.g. "
            "`graphdef, state = nnx.split(model); "
            "copy = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))`;",
            "or do not donate that argument.",
        ],
    )


def argnums_out_of_range(
    transform: str, argument: str, bad: Sequence[int], params: Sequence[str]
) -> str:
    return format_message(
        transform,
        argument,
        [
            f"{i} is out of range: the function takes {len(params)} positional arguments "
            f"({', '.join(params) or 'none'})"
            for i in bad
        ],
        f"Rule: {argument} index the function's positional parameters, from -n to n - 1 "
        "(as in jax.jit).",
        [
            f"use the position of a parameter, counting from 0 (a method's self is 0 when "
            f"{transform} decorates it in the class body);",
            "or name the parameter in static_argnames/donate_argnames.",
        ],
    )


def unknown_argnames(
    transform: str, argument: str, bad: Sequence[str], params: Sequence[str], why: str
) -> str:
    return format_message(
        transform,
        argument,
        [f"{name!r} is {why}" for name in bad],
        f"Rule: {argument} name parameters the function takes by keyword; it takes "
        + (", ".join(params) or "none")
        + ".",
        [
            "correct the name;",
            "or give a positional-only parameter by position in static_argnums/donate_argnums.",
        ],
    )


def static_and_donated(transform: str, both: Sequence[object]) -> str:
    return format_message(
        transform,
        "static_argnums/static_argnames and donate_argnums/donate_argnames",
        [f"the argument {b!r} is both static and donated" for b in both],
        "Rule: a static argument is part of the compilation key, not a buffer of the "
        "program, so it cannot be donated (jax.jit rejects this too).",
        [
            "drop it from donate_argnums/donate_argnames to keep it static;",
            "or drop it from static_argnums/static_argnames to pass (and donate) its arrays.",
        ],
    )


def not_callable(transform: str, fun: object) -> str:
    return format_message(
        transform,
        "fun",
        [f"expected a callable, got {fun!r} ({_a(type(fun).__name__)})"],
        f"Rule: {transform} wraps a function (or any callable), as jax.jit does.",
        [
            f"pass the function, e.g. `{transform}(forward)`;",
            f"to give options first, use `{transform}(static_argnums=1)(forward)` "
            "or `functools.partial`.",
        ],
    )


def argument_structure(missing: Sequence[str], extra: Sequence[str]) -> str:
    """A problem for `structure_mismatch`: arguments missing or not expected."""
    parts = [f"{w} is missing" for w in missing]
    parts += [f"{w} is not among the arguments it was lowered for" for w in extra]
    return "the argument structure differs: " + "; ".join(parts)


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


def structure_changed(
    transform: str, argument: str, wheres: Sequence[str], why: str, where_else: str
) -> str:
    """The function changed the graph structure of inputs whose structure must stay."""
    return format_message(
        transform,
        argument,
        [f"the function changed the graph structure of {w}" for w in wheres],
        f"Rule: {why}, so the function may update Variable values but not add, remove or "
        "replace attributes, Variables or submodules.",
        [
            f"make the structure change outside the {where_else};",
            "or return the new objects as outputs instead of attaching them to an input.",
        ],
    )


def no_mesh(transform: str, why: str, how: str) -> str:
    """No ``mesh=`` argument and no mesh set with ``jax.set_mesh``."""
    return format_message(
        transform,
        "mesh",
        ["no mesh was given and none is set in the context"],
        f"Rule: {why}: the `mesh=` argument, or the one set with `jax.set_mesh`.",
        [f"pass one, e.g. `{how}`;", "or call it inside `with jax.set_mesh(mesh):`."],
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


# Abstract models, AOT reports and export (issue 6) ---------------------------------------------


def aot_unknown_config(transform: str, name: str, known: Sequence[str]) -> str:
    return format_message(
        transform,
        "config",
        [f"no config is named {name!r}"],
        "Rule: config is a DecoderConfig or the name of one of: "
        + ", ".join(repr(k) for k in known)
        + ".",
        [
            "use one of those names, e.g. `aot_report('1b', {'data': 2, 'model': 4})`;",
            "or pass your own `DecoderConfig(...)`.",
        ],
    )


def aot_mesh_too_big(transform: str, axes: dict[str, int], size: int, devices: int) -> str:
    return format_message(
        transform,
        "mesh",
        [f"the mesh {axes} needs {size} devices, but jax has {devices}"],
        "Rule: the mesh's axis sizes multiply to at most the number of devices.",
        [
            "use smaller axes, e.g. `{'data': 2, 'model': 4}` for 8 devices;",
            "or simulate more CPU devices: `jax.config.update('jax_num_cpu_devices', 8)` "
            "before jax starts.",
        ],
    )


def aot_indivisible(transform: str, config: str, problems: Sequence[str]) -> str:
    return format_message(
        transform,
        "mesh",
        [f"config {config!r}: {p}" for p in problems],
        "Rule: each sharded dimension is a multiple of its mesh axis' size (batch and embed "
        "over 'data', heads, mlp and vocab over 'model').",
        [
            "use a mesh whose axes divide these sizes, e.g. `{'data': 2, 'model': 4}`;",
            "or a config with sizes the mesh divides.",
        ],
    )


def export_spec_without_mesh(transform: str, spec: str) -> str:
    return format_message(
        transform,
        "in_shardings",
        [f"the PartitionSpec {spec} needs a mesh, and none is set"],
        "Rule: an exported program records each argument's NamedSharding; a PartitionSpec "
        "is bound to the mesh set with `jax.set_mesh`.",
        [
            "export inside `with jax.set_mesh(mesh):`;",
            "or give NamedShardings, e.g. `NamedSharding(mesh, P('data'))`.",
        ],
    )


def export_bad_key(transform: str, key: str, type_name: str) -> str:
    return format_message(
        transform,
        "in_tree/out_tree",
        [f"a State key {key} is a {type_name}"],
        "Rule: the States in a serialized program are keyed by attribute names (str) and "
        "list indices (int).",
        [
            "use string keys in nnx.Dict attributes of exported modules;",
            "or keep such containers out of the exported function's arguments.",
        ],
    )


def export_structure_mismatch(transform: str, got: str, expected: str) -> str:
    return format_message(
        transform,
        "arguments",
        [f"the arguments have the structure {got}, the program takes {expected}"],
        "Rule: give the exported call's dynamic arguments in order (static ones are baked "
        "in), with a graph node or its nnx.State where the program takes a State.",
        [
            "pass the same kinds of arguments as at export, e.g. `call(nnx.state(model), x)`;",
            "or build them from `exported.in_tree`: "
            "`jax.tree.unflatten(exported.in_tree, arrays)`.",
        ],
    )


def export_bad_arguments(transform: str, problems: Sequence[str]) -> str:
    return format_message(
        transform,
        "arguments",
        list(problems),
        "Rule: every array the program takes is given, with the shape and dtype it was "
        "exported for (`exported.in_avals`).",
        [
            "pass the state of a model built like the exported one;",
            "or export again for the new shapes.",
        ],
    )


def export_too_few_devices(transform: str, needed: int, available: int) -> str:
    return format_message(
        transform,
        "devices",
        [f"the program was exported for {needed} devices, but jax has {available}"],
        "Rule: a sharded program runs on as many devices as it was exported for.",
        [
            "run it where that many devices exist, e.g. "
            f"`jax.config.update('jax_num_cpu_devices', {needed})` on CPU;",
            "or export it for fewer devices.",
        ],
    )
