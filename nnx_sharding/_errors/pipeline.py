"""Messages of `pipeline`: the stack, the batch, the schedule and the mesh axis."""

from __future__ import annotations

from collections.abc import Sequence

from .layout import divisors, format_message

__all__ = [
    "pipeline_bad_stack",
    "pipeline_changes_shape",
    "pipeline_layers_indivisible",
    "pipeline_microbatches_indivisible",
    "pipeline_mutates_stack",
    "pipeline_no_axis",
    "pipeline_too_few_microbatches",
]


def pipeline_bad_stack(problem: str) -> str:
    """``layers`` is not a stack of layers (Variables with one leading layer dimension)."""
    return format_message(
        "pipeline",
        "layers",
        [problem],
        "Rule: layers is a graph node whose Variables all carry the same leading layer "
        "dimension, as `nnx.vmap` makes them (`nnx.split_rngs` on the Rngs) and `nnx.scan` "
        "runs them.",
        [
            "build the stack with `nnx.vmap(lambda rngs: Layer(rngs=rngs))(rngs)` under "
            "`@nnx.split_rngs(splits=n)`;",
            "or give pipeline the stacked submodule (`model.layers`), not the whole model.",
        ],
    )


def pipeline_layers_indivisible(layers: int, stages: int, repeats: int, axis: str) -> str:
    """The stack's layers do not split into ``stages × repeats`` equal groups."""
    groups = stages * repeats
    fits = [r for r in range(1, layers + 1) if layers % (stages * r) == 0]
    return format_message(
        "pipeline",
        "layers",
        [
            f"{layers} layers do not split into {stages} stages × {repeats} repeats = "
            f"{groups} equal groups"
        ],
        f"Rule: each of the {stages} stages of mesh axis {axis!r} runs layers / (stages · "
        "repeats) consecutive layers per repeat.",
        [
            f"choose `repeats` among {', '.join(map(str, fits))};"
            if fits
            else f"use a mesh whose {axis!r} axis divides {layers};",
            f"or stack a multiple of {groups} layers.",
        ],
    )


def pipeline_microbatches_indivisible(batch: int, microbatches: int) -> str:
    """The batch does not split into ``microbatches`` equal microbatches."""
    return format_message(
        "pipeline",
        "microbatches",
        [f"microbatches={microbatches} does not divide the batch of {batch}"],
        "Rule: the batch (the leading dimension of every array of x) is split into "
        "microbatches of equal size.",
        [
            f"choose microbatches among {', '.join(map(str, divisors(batch)[:12]))};",
            "or pad the batch.",
        ],
    )


def pipeline_too_few_microbatches(microbatches: int, stages: int, repeats: int) -> str:
    """Fewer microbatches than stages: most of the pipeline idles."""
    bubble = (stages - 1) / (microbatches * repeats + stages - 1)
    return format_message(
        "pipeline",
        "microbatches",
        [
            f"microbatches={microbatches} is fewer than the {stages} stages: each stage "
            f"would idle {bubble:.0%} of the step (the bubble, (stages - 1) / (microbatches "
            "· repeats + stages - 1))"
        ],
        "Rule: microbatches >= stages, so that every stage has work once the pipeline is "
        "full (and the circular schedule can send each microbatch round again).",
        [
            f"pass `microbatches={stages}` or more (a multiple of the stages: 2-4 × is usual);",
            "or use fewer stages.",
        ],
    )


def pipeline_no_axis(axis: str, axes: Sequence[str]) -> str:
    """``axis`` was given but the mesh lacks it."""
    return format_message(
        "pipeline",
        "axis",
        [f"the mesh has no axis {axis!r}; its axes are {', '.join(map(repr, axes)) or 'none'}"],
        "Rule: the stages are the devices along one mesh axis (the mesh set with "
        "`jax.set_mesh`, or given as `mesh=`).",
        [
            "name one of the mesh's axes, e.g. `axis='stage'` for a mesh with a 'stage' axis;",
            "or add the axis to the mesh (`jax.make_mesh((4, 2), ('stage', 'data'))`).",
        ],
    )


def pipeline_mutates_stack(paths: Sequence[str]) -> str:
    """``f`` wrote to Variables of the stack instead of returning its result."""
    shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    return format_message(
        "pipeline",
        "f",
        [f"f changed the layer's Variables at {shown}"],
        "Rule: f(layer, x) returns the new x and leaves the layer as it found it: a stage "
        "holds its layers on its own devices, so a write (batch statistics, an RNG count, "
        "sown values) could not reach the stack.",
        [
            "compute with the layer's Variables and return the result only;",
            "for dropout, draw the key outside and pass it in x; use a norm without batch "
            "statistics (`nnx.LayerNorm`, `nnx.RMSNorm`).",
        ],
    )


def pipeline_changes_shape(before: str, after: str) -> str:
    """``f`` returned an x of another structure, shape or dtype."""
    return format_message(
        "pipeline",
        "f",
        [f"f(layer, x) returned {after}, but x is {before}"],
        "Rule: each layer maps x to an x of the same structure, shapes and dtypes, so that "
        "the stages can pass it on.",
        ["return an x like the one f was given (cast or reshape inside f)."],
    )
