"""Messages of `jit_partial`: what its bound (partial) arguments may hold and do."""

from __future__ import annotations

from collections.abc import Sequence

from .layout import format_message

__all__ = [
    "cached_partial_arrays",
    "partial_aliases",
    "partial_output_aliases",
    "partial_metadata_changed",
    "partial_runtime_variable",
    "partial_unsupported_variable",
    "partial_static",
]


def partial_aliases(groups: Sequence[tuple[str, Sequence[str]]]) -> str:
    """Tree mode: one Variable reached through several paths of the partial arguments;
    ``groups``: per shared Variable, its type and its paths."""
    return format_message(
        "jit_partial",
        "partial_args",
        [f"one {kind} is found at {', '.join(paths)}" for kind, paths in groups],
        "Rule: with graph=False (tree mode) a module is a pytree, and a Variable reached "
        "through two paths would become two Variables inside the function.",
        [
            "pass graph=True: shared Variables stay shared, as in nnx.jit's graph mode;",
            "or give each path a Variable of its own (nnx.clone the shared part).",
        ],
        flax="Duplicate",
    )


def partial_output_aliases(paths: Sequence[str], transform: str = "jit_partial") -> str:
    """An output is a Variable of the partial arguments, or a Variable is output twice."""
    return format_message(
        transform,
        "output",
        [f"a Variable of the partial arguments (or one output twice) at {p}" for p in paths],
        "Rule: the partial arguments (bound once) are written back by their Variables; "
        "a Variable of theirs returned as an output would come back as a second, detached "
        "copy. A whole partial argument may be returned: it comes back as itself.",
        [
            "return its value instead, e.g. `model.count[...]`;",
            "or read it from the partial argument after the call (it is updated in place).",
        ],
        flax="Duplicate",
    )


def partial_metadata_changed(paths: Sequence[str]) -> str:
    return format_message(
        "jit_partial",
        "partial_args",
        [f"the function changed the metadata of the Variable at {p}" for p in paths],
        "Rule: the partial arguments are flattened once, when jit_partial is called; their "
        "Variables' metadata is part of that structure and cannot change inside.",
        [
            "change the metadata outside, then call jit_partial again;",
            "or use `nnx_sharding.jit(f, graph_updates=False)`, which re-reads the structure "
            "on every call and writes metadata changes back (with graph_updates=True, its "
            "default, they are dropped).",
        ],
        flax="Variable metadata changed inside jit",
    )


def partial_runtime_variable(wheres: Sequence[str]) -> str:
    return format_message(
        "jit_partial",
        "args",
        [f"a Variable at {w}" for w in wheres],
        "Rule: only the partial arguments (bound when jit_partial is called) may hold "
        "Variables and graph nodes; the arguments of each call are arrays and pytrees "
        "of arrays.",
        [
            "bind the module with the others: `jit_partial(f, model, other, ...)`;",
            "or use nnx_sharding.jit, which takes graph nodes in every argument.",
        ],
        flax="Found Variable in non-partial arguments",
    )


def partial_unsupported_variable(paths: Sequence[str]) -> str:
    return format_message(
        "jit_partial",
        "partial_args",
        [f"a ref or hijax Variable at {p}" for p in paths],
        "Rule: jit_partial passes each Variable's value into the program and writes the "
        "new value back; jax updates ref and hijax Variables in place instead.",
        [
            "use `nnx_sharding.jit(f, graph_updates=False)`, which takes them (with "
            "graph_updates=True, its default, it fails on hijax ones, as nnx.jit does);",
            "or create the Variables without ref=True / hijax=True.",
        ],
    )


def partial_static(n_partial: int) -> str:
    """``static_argnums`` names position 0: the partial arguments, which are traced."""
    return format_message(
        "jit_partial",
        "static_argnums",
        ["0 is the partial arguments (all of them together), which cannot be static"],
        "Rule: static_argnums counts as flax counts: 0 is the partial arguments, whose "
        "Variables are passed to the program as arrays on every call, and 1 the first "
        f"argument of a call (the parameter after the {n_partial} partial one(s) of fun).",
        [
            "remove 0 from static_argnums (the partial arguments are bound already);",
            "to make a call's argument static, count it from 1, e.g. `static_argnums=1` "
            "for the first one, or name it with `static_argnames`.",
        ],
    )


def cached_partial_arrays(paths: Sequence[str]) -> str:
    """``nnx.cached_partial`` over `jit` of a module holding arrays outside Variables."""
    return format_message(
        "jit",
        "args",
        [f"an array outside a Variable at {p}" for p in paths],
        "Rule: nnx.cached_partial caches its modules' Variables and writes their new "
        "values back into them; an array held as a plain attribute has no Variable to "
        "write into (flax's cached_partial fails on it too, with an AttributeError).",
        [
            "hold the array in a Variable: `model.offset = nnx.Variable(model.offset)`;",
            "or call the jitted function without cached_partial, `step(model, x)`: it "
            "takes plain array attributes.",
        ],
    )
