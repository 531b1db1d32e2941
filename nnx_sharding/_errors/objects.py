"""Messages about the caller's objects: what a transform may take and write back."""

from __future__ import annotations

from collections.abc import Sequence

from .layout import bound_method_message, format_message, listing, static_argument_message


def static_graph_node(transform: str, argument: str, type_name: str) -> str:
    return static_argument_message(
        transform,
        argument,
        f"a graph node ({type_name}) is a static argument",
        "Rule: a static argument is compiled into the program as a constant; a graph "
        "node's Variables would be baked in, and their later updates ignored.",
        "to keep part of it static, pass that plain value (a flag, a config) instead.",
    )


def wrong_trace_level(transform: str, wheres: Sequence[str]) -> str:
    return format_message(
        transform,
        "arguments",
        [f"Cannot mutate Variables from a different trace level: {listing(wheres, 5)}"],
        "Rule: as in flax, the call writes its results back into its argument's Variables, "
        "which is not possible from inside an outer jax transform (jax.jit, jax.grad, "
        "jax.vmap) for Variables created outside it (a module the outer function closes "
        "over). Nothing was written: your objects are as they were.",
        [
            "use flax's nnx.jit/nnx.grad/nnx.vmap for the outer transform and pass the "
            "module to it as an argument;",
            "or split the module (nnx.split) outside, pass its state to the outer function "
            "and nnx.merge it inside.",
        ],
    )


def bound_method(transform: str, type_name: str) -> str:
    return bound_method_message(
        transform,
        "f",
        type_name,
        "Rule: the module a method is bound to would be baked into the program as a "
        "constant (its later updates ignored), and in_specs has no entry for it.",
        [
            f"decorate the method with `@nnx_sharding.{transform}(...)` and give in_specs an "
            "entry for self first;",
            f"or call `nnx_sharding.{transform}(MyClass.method, ...)(instance, ...)`.",
        ],
    )
