"""Messages of the transforms: jit, shard_map, StateSharding and the stages."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from .layout import (
    PAD_FIX,
    argument_differences,
    format_message,
    jax_said,
    quoted,
    static_argument_message,
    with_article,
    wrap_in_spec,
)


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
        + quoted(filters)
        + ".",
        [
            "add a filter that matches it, e.g. `(nnx.Param, P())`;",
            "end the mapping with a catch-all entry `(..., None)` (None: let jax choose).",
        ],
        flax="No axis found for path",
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
        f"found {with_article(type_name)}, which is not a mapping, an nnx.State or an "
        "iterable of pairs"
    )


def spec_entry_not_a_pair(entry: object) -> str:
    return bad_state_sharding_spec(f"the entry {entry!r} is not a (filter, sharding) pair")


def bad_filter(filter_: object, error: BaseException) -> str:
    return format_message(
        "StateSharding",
        "spec",
        [
            f"the filter {filter_!r} ({with_article(type(filter_).__name__)}) is not an nnx filter "
            f"({type(error).__name__}: {error})"
        ],
        _SPEC_RULE,
        [
            "use a Variable type (`nnx.Param`), a path filter (`nnx.PathContains('kernel')`) "
            "or `...` for everything else;",
            "or write a predicate, e.g. `lambda path, value: path[-1] == 'kernel'`.",
        ],
    )


def spec_value_not_a_sharding(filter_: object, value: object) -> str:
    """``value``: what was given; axis names (a str or a tuple of them) are shown wrapped."""
    names = value if isinstance(value, (tuple, list)) else (value,)
    if names and all(n is None or isinstance(n, str) for n in names):
        wrapped = f"P({quoted(names)})"
    else:
        wrapped = "P('model', None)"
    return format_message(
        "StateSharding",
        "spec",
        [f"the value for filter {filter_!r} is {with_article(type(value).__name__)}"],
        "Rule: each value is a jax.sharding.Sharding, a PartitionSpec or None.",
        [wrap_in_spec(wrapped)],
    )


def bad_static(transform: str, argument: str, type_name: str, err: str) -> str:
    return static_argument_message(
        transform,
        argument,
        f"the static argument of type {type_name} is not hashable ({err})",
        "Rule: static arguments are part of the compilation key, so they must be hashable.",
        "convert it to a hashable value (a tuple instead of a list, a frozen dataclass).",
        flax="Non-hashable static arguments are not supported",
    )


def rank_too_low(spec_rank: int, rank: int) -> str:
    return f"the spec needs rank at least {spec_rank}, but the value has rank {rank}"


def misfit(where: str, shape: tuple[int, ...], sharding: object, detail: str) -> str:
    """A problem for `bad_shardings`: the array at ``where`` does not fit its sharding."""
    return f"{where}: shape {shape} with {sharding}: {detail}"


def bad_shardings(
    transform: str, argument: str, problems: Sequence[str], jax_message: str = ""
) -> str:
    said = f" {jax_said(jax_message)}" if jax_message else ""
    return format_message(
        transform,
        argument,
        list(problems),
        "Rule: a sharding must fit its array: one spec entry per dimension at most, mesh "
        "axes that exist, and each sharded dimension divisible by its mesh axes' size." + said,
        [
            "change the filter or spec for these Variables (None or P() replicates them);",
            PAD_FIX,
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
            "`nnx_sharding.shard(model, shardings)` (inside `with jax.set_mesh(mesh):` "
            "for PartitionSpecs);",
            f"or ask for the sharding it has in {argument} (None takes the argument's own).",
        ],
        flax="Sharding passed to jit does not match the sharding on the respective arg",
    )


def deleted_buffers(transform: str, wheres: Sequence[str], jax_message: str) -> str:
    return format_message(
        transform,
        "arguments",
        [f"the array at {w} has been deleted (donated to an earlier call?)" for w in wheres],
        "Rule: donation consumes buffers: a call with donate_argnums/donate_argnames deletes "
        "the donated arrays and gives the argument's Variables new ones; any other "
        "reference to the old arrays (e.g. an `nnx.clone` of the donated module, which "
        f"shares its buffers) can no longer be read. {jax_said(jax_message)}",
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
        flax=f"only accepts {len(params)} positional arguments",
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
        flax=f"invalid argnames {set(bad)!r} in {argument}",
    )


def static_and_donated(transform: str, both: Sequence[object]) -> str:
    kind = "argnames" if all(isinstance(b, str) for b in both) else "argnums"
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
        flax=f"static_{kind} and donate_{kind} cannot intersect",
    )


def not_callable(
    transform: str,
    fun: object,
    options: str = "static_argnums=1",
    like: str = "",
    decorator: bool = True,
) -> str:
    """``options``: an example of the transform's other arguments; ``like``: jax's
    counterpart (default ``jax.<transform>``); ``decorator``: whether
    ``transform(options)`` returns a decorator."""
    fixes = [f"pass the function first, e.g. `{transform}(forward, {options})`;"]
    if decorator:
        fixes.append(
            f"to give options first, use `{transform}({options})(forward)` or `functools.partial`."
        )
    return format_message(
        transform,
        "fun",
        [f"expected a callable, got {fun!r} ({with_article(type(fun).__name__)})"],
        f"Rule: {transform} wraps a function (or any callable), as {like or 'jax.' + transform} "
        "does.",
        fixes,
    )


def argument_structure(missing: Sequence[str], extra: Sequence[str]) -> str:
    """A problem for `structure_mismatch`: arguments missing or not expected."""
    return "the argument structure differs: " + argument_differences(missing, extra, "lowered")


def compiled_difference(path: str, kind: str, here: object = None, there: object = None) -> str:
    """A problem for `structure_mismatch`: the graph node at ``path`` differs from the one
    the program was compiled for. ``kind``: added, removed, type, value or shared; ``here``
    and ``there``: what the call and the program have (type names; values for value)."""
    return {
        "added": f"{path}: not in the compiled program (here: {with_article(str(here))})",
        "removed": f"{path}: missing (the compiled program has {with_article(str(there))} there)",
        "type": f"{path}: {with_article(str(here))} here, "
        f"{with_article(str(there))} in the compiled program",
        "value": f"{path}: {here!r} here, {there!r} in the compiled program",
        "shared": f"{path}: {here} here, {there} in the compiled program",
    }[kind]


def structure_mismatch(transform: str, differences: Sequence[str], types: bool = False) -> str:
    """``types``: the differences are of array shapes or dtypes only."""
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
        flax="Argument types differ from the types for which this computation was compiled"
        if types
        else "Function compiled with input pytree does not match the input pytree it was "
        "called with",
    )


def graph_change(kind: str, path: str, type_name: str = "") -> str:
    """One change for `structure_changed`: ``kind`` is added, removed, replaced or changed."""
    what = {
        "added": f"added {with_article(type_name)} at {path}" if type_name else f"added {path}",
        "removed": f"removed the {type_name} at {path}" if type_name else f"removed {path}",
        "replaced": f"replaced the {type_name} at {path} by another object",
        "changed": f"changed the attribute {path}",
    }
    return what[kind]


def structure_changed(
    transform: str,
    argument: str,
    wheres: Sequence[str],
    why: str,
    where_else: str,
    changes: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """The function changed the graph structure of inputs whose structure must stay.

    ``changes``: per argument in ``wheres``, what changed (`graph_change`), if known.
    """
    changes = changes or {}
    return format_message(
        transform,
        argument,
        [
            f"the function changed the graph structure of {w}"
            + (f" ({'; '.join(changes[w])})" if changes.get(w) else "")
            for w in wheres
        ],
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
            "give in_specs, e.g. `in_specs=(P(), P('data'))` for a replicated module and a "
            "batch split over 'data' (a StateSharding at a module's position shards its "
            "Variables);",
            "or make the mesh with `axis_types=(AxisType.Explicit,) * n` and shard the "
            "arguments on it.",
        ],
    )


def spec_axes_not_manual(
    transform: str,
    argument: str,
    problems: Sequence[str],
    mesh_axes: Sequence[str],
    manual: Sequence[str],
) -> str:
    """Specs that name mesh axes the mesh lacks, or that are not manual."""
    return format_message(
        transform,
        argument,
        list(problems),
        "Rule: a spec names manual axes of the mesh; the mesh has "
        + quoted(mesh_axes, "no axes")
        + ", and the manual ones are "
        + quoted(manual, "none")
        + ".",
        [
            "correct the axis name, e.g. `P('data')`, or replicate with `P()`;",
            "or make the axis manual: leave it out of `auto`, or add it to `axis_names`.",
        ],
        flax=f"{argument} argument must refer to an axis marked as manual",
    )


def unknown_axis(where: str, spec: object, axis: str, manual: bool) -> str:
    """A problem for `spec_axes_not_manual`."""
    why = "which is not an axis of the mesh" if not manual else "which is not a manual axis"
    return f"{where}: {spec!r} names {axis!r}, {why}"


_SPEC_KEY = re.compile(r"\bout_specs((?:\[[^\]\[]*\])+)")
_INDEX = re.compile(r"\[(\d+)\]")


def name_spec_paths(message: str, in_sites: Sequence[object], out_sites: Mapping[str, str]) -> str:
    """Replaces the spec paths of ``jax.shard_map``'s messages by the caller's.

    The package's shard_map gives jax ``out_specs=(in_specs, out_prefix)``: jax's
    ``out_specs[0][i]`` is the spec of flat input leaf ``i`` (``in_sites[i]``), and
    ``out_specs[1]...`` is ``out_sites['...']``, a place in the caller's out_specs.
    """

    def site(m: re.Match[str]) -> str:
        keys = m.group(1)
        if keys.startswith("[0]") and (i := _INDEX.fullmatch(keys[3:])):
            index = int(i.group(1))
            if index < len(in_sites):
                return (
                    f"the in_specs entry of {in_sites[index]} (inputs, updated or not, "
                    "leave shard_map laid out by their in_specs)"
                )
        if keys.startswith("[1]") and keys[3:] in out_sites:
            return f"the out_specs entry at {out_sites[keys[3:]]}"
        return m.group(0)

    return _SPEC_KEY.sub(site, message)


_FLAT_KEY = re.compile(r"\b(donated|kept)\[(\d+)\]")


def name_leaves(message: str, donated: Sequence[object], kept: Sequence[object]) -> str:
    """Replaces jax's flat key paths (``kept[3]``) by the caller's Variable paths."""
    sites = {"donated": donated, "kept": kept}

    def site(m: re.Match[str]) -> str:
        group, index = sites[m.group(1)], int(m.group(2))
        return str(group[index]) if index < len(group) else m.group(0)

    return _FLAT_KEY.sub(site, message)
