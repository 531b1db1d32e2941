"""Messages of the tools around the transforms: metadata, tables, AOT and export."""

from __future__ import annotations

from collections.abc import Sequence

from .layout import (
    PAD_FIX,
    argument_differences,
    format_message,
    jax_said,
    mesh_fixes,
    quoted,
    with_article,
)

# Metadata, tables and inspection (issue 5) -----------------------------------------------------


def not_a_node(transform: str, argument: str, type_name: str) -> str:
    return format_message(
        transform,
        argument,
        [f"found a {type_name}"],
        "Rule: the tree is a graph node (Module, Optimizer, nnx.List/nnx.Dict, ...) or an "
        "nnx.State of Variables.",
        [
            f"pass the module itself, e.g. `{transform}(model)`;",
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
        + quoted(known, "nothing")
        + ".",
        [
            "add a pair `(name, mesh axis or None)` for each such name to rules;",
            "or correct the name in the metadata, e.g. "
            "`nnx.with_partitioning(init, ('embed', 'mlp'))`.",
        ],
    )


def unknown_mesh_axes(
    transform: str,
    argument: str,
    problems: Sequence[str],
    mesh_axes: Sequence[str],
    lacking: Sequence[str] = (),
) -> str:
    """``lacking``: the axes named that the mesh lacks (the example mesh has the first)."""
    kept = [a for a in mesh_axes if a not in lacking][:1]
    names = (*kept, *lacking[:1]) or ("data", "model")
    shape = "(2, 4)" if len(names) == 2 else "(8,)"
    example = f"jax.make_mesh({shape}, ({quoted(names)}{',' * (len(names) == 1)}))"
    return format_message(
        transform,
        argument,
        list(problems),
        "Rule: a Variable's sharding names axes of the mesh it is placed on; the mesh has "
        + quoted(mesh_axes, "no axes")
        + ".",
        [
            "map the logical name to an existing mesh axis (or None) in rules;",
            f"or use a mesh that has that axis, e.g. `{example}`.",
        ],
    )


def cannot_place(
    transform: str,
    misfits: Sequence[tuple[str, str]],
    jax_message: str,
    source: str = "metadata",
) -> str:
    """``misfits``: (path, detail) of each Variable; ``source``: where the shardings came
    from, ``metadata`` or ``shardings``."""
    change = (
        "change the Variable's sharding metadata or the rules (None replicates a dimension);"
        if source == "metadata"
        else "change the filter or spec for these Variables in shardings (None leaves a "
        "Variable as it is, P() replicates it);"
    )
    return format_message(
        transform,
        "tree",
        [f"the Variable at {path} cannot be placed: {detail}" for path, detail in misfits],
        "Rule: a sharding must fit its array: one spec entry per dimension at most and each "
        f"sharded dimension divisible by its mesh axes' size. {jax_said(jax_message)}",
        [
            change,
            PAD_FIX,
        ],
    )


def _unbound_specs(
    transform: str,
    argument: str,
    found: Sequence[tuple[str, str]],
    rule: str,
    action: str,
    axis: str,
) -> str:
    """PartitionSpecs and no mesh to bind them to; ``found``: (the spec as shown, what it is
    for); ``action``: what to do under a mesh; ``axis``: the example NamedSharding's axis."""
    return format_message(
        transform,
        argument,
        [
            f"the PartitionSpec {spec} for {what} needs a mesh, and none is set"
            for spec, what in found
        ],
        rule,
        mesh_fixes(action, f"NamedSharding(mesh, P({axis!r}))"),
    )


def spec_without_mesh(transform: str, found: Sequence[tuple[str, object]]) -> str:
    """``found``: (path, PartitionSpec) of each Variable."""
    return _unbound_specs(
        transform,
        "shardings",
        [(repr(spec), f"the Variable at {path}") for path, spec in found],
        "Rule: a PartitionSpec is bound to the mesh set with `jax.set_mesh`, as in jit's "
        "in_shardings.",
        "call it",
        "model",
    )


def rules_without_metadata(transform: str, type_name: str) -> str:
    return format_message(
        transform,
        "rules",
        [f"rules were given with shardings that are {with_article(type_name)}"],
        "Rule: rules map the logical axis names of Variable metadata to mesh axes; they "
        "apply only when the shardings come from metadata (shardings is a Mesh or None).",
        [
            "drop rules: the shardings you give are used as they are;",
            "or place by metadata: `nnx_sharding.shard(model, mesh, rules=rules)`.",
        ],
    )


def old_and_new_keyword(transform: str, old: str, new: str, call: str) -> str:
    """A renamed keyword given under both names (the old one is still accepted)."""
    return format_message(
        transform,
        old,
        [f"given together with `{new}`, its new name"],
        f"Rule: `{old}` is the name `{new}` had before; it is accepted alone, with a "
        "DeprecationWarning, until the next release.",
        [f"pass the value once, as `{new}`: `{call}`."],
    )


def bad_placement(transform: str, type_name: str) -> str:
    return format_message(
        transform,
        "shardings",
        [f"found {with_article(type_name)}"],
        "Rule: shardings is a StateSharding, a jax.sharding.Sharding, a PartitionSpec, a "
        "Mesh (place by metadata) or None (metadata, on the mesh set with `jax.set_mesh`).",
        [
            "wrap filters and shardings in a StateSharding, e.g. `nnx_sharding.shard(model, "
            "nnx_sharding.StateSharding({nnx.PathContains('kernel'): P(None, 'model'), "
            "...: P()}))` inside `with jax.set_mesh(mesh):`;",
            "or give a mesh to place by the Variables' metadata, e.g. "
            "`nnx_sharding.shard(model, mesh)`.",
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


AOT_COMMAND = "python -m nnx_sharding aot"
"""The public way to an AOT report, which the `aot_*` messages suggest."""


def _mesh_option(axes: dict[str, int]) -> str:
    """``{'data': 4, 'model': 4}`` as ``--mesh`` takes it, ``data=4,model=4``."""
    return ",".join(f"{name}={size}" for name, size in axes.items())


def aot_unknown_config(transform: str, name: str, known: Sequence[str]) -> str:
    return format_message(
        transform,
        "config",
        [f"no config is named {name!r}"],
        f"Rule: the config is the name of one of: {quoted(known)}.",
        [f"name one of them, e.g. `{AOT_COMMAND} --config tiny`."],
    )


def aot_mesh_too_big(transform: str, axes: dict[str, int], size: int, devices: int) -> str:
    return format_message(
        transform,
        "mesh",
        [f"the mesh {axes} needs {size} devices, but jax has {devices}"],
        "Rule: the mesh's axis sizes multiply to at most the number of devices.",
        [
            f"use the command line, which simulates the {size} CPU devices the mesh needs: "
            f"`{AOT_COMMAND} --config NAME --devices {size} --mesh {_mesh_option(axes)}`;",
            f"or its default mesh, data=2,model=4 on 8 devices: `{AOT_COMMAND} --config NAME`.",
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
            "use a mesh whose axes divide these sizes, e.g. "
            f"`{AOT_COMMAND} --config NAME --mesh data=2,model=4`;",
            "or a config with sizes the mesh divides.",
        ],
    )


def export_spec_without_mesh(transform: str, spec: str, where: str) -> str:
    return _unbound_specs(
        transform,
        "in_shardings",
        [(spec, where)],
        "Rule: an exported program records each argument's NamedSharding; a PartitionSpec "
        "is bound to the mesh set with `jax.set_mesh`.",
        "export",
        "data",
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


def export_structure_mismatch(
    transform: str,
    got: str,
    expected: str,
    missing: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> str:
    """``missing``/``extra``: the arguments the call lacks or has beyond the program's."""
    detail = f": {argument_differences(missing, extra, 'exported')}" if missing or extra else ""
    return format_message(
        transform,
        "arguments",
        [f"the arguments have the structure {got}, the program takes {expected}{detail}"],
        "Rule: give the exported call's dynamic arguments in order (static ones are baked "
        "in), with a graph node or its nnx.State where the program takes a State.",
        [
            "pass the same kinds of arguments as at export, e.g. `call(nnx.state(model), x)`;",
            "or build them from `exported.in_tree`: "
            "`jax.tree.unflatten(exported.in_tree, arrays)`.",
        ],
    )


def export_wrong_kind(where: str, expected: str, type_name: str) -> str:
    """A problem for `export_bad_arguments`: a value of the wrong kind at ``where``."""
    return f"{where}: expected {expected}, got {with_article(type_name)}"


def export_not_arrays(transform: str, problems: Sequence[tuple[str, str]]) -> str:
    """``problems``: (where, type name) of each value that is not an array."""
    return format_message(
        transform,
        "arguments",
        [f"{where}: {with_article(t)} is not an array" for where, t in problems],
        "Rule: an exported program takes arrays (or jax.ShapeDtypeStructs), in the "
        "arguments and in the Variables of their graph nodes; other values must be static.",
        [
            "make the argument static: export `nnx_sharding.jit(fun, static_argnums=...)`;",
            "keep a non-array value of a module in a plain attribute, not in a Variable.",
        ],
    )


def export_variable_argument(transform: str, problems: Sequence[str]) -> str:
    """``problems``: where each Variable given as an argument (not inside a node) is."""
    return format_message(
        transform,
        "arguments",
        [f"{where} is a Variable, not inside a graph node" for where in problems],
        "Rule: an exported program takes each graph node's state as an `nnx.State`, keyed "
        "by the paths of its Variables; a Variable on its own has no path to key it by.",
        [
            "put it in a container and pass that: `nnx.Dict(w=v)` for the Variable `v`;",
            "or pass its value: `v[...]`.",
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
