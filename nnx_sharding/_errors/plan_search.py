"""Messages about `plan.search`'s knobs and builders, candidates given exactly, and
what would fit when nothing does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "plan_bad_candidate_axes",
    "plan_bad_candidate_sizes",
    "plan_bad_layout_spec",
    "plan_jit_no_step",
    "plan_nothing_fits_state",
    "search_bad_built",
    "search_bad_knob_value",
    "search_bad_knob_values",
    "search_bad_microbatches",
    "search_bad_prune",
    "search_bad_space",
    "search_builder_failed",
    "search_unread_knobs",
]


def plan_bad_layout_spec(spec: object) -> str:
    return (
        f"plan: layouts: {spec!r} is neither a layout name nor a candidate "
        "(name, {axis: size, ...}), e.g. ('fsdp+tp', {'fsdp': 16, 'model': 4})."
    )


def plan_bad_candidate_axes(name: str, sizes: Mapping[str, object], axes: Sequence[str]) -> str:
    return (
        f"plan: layouts: ({name!r}, {sizes!r}) gives the axes {sorted(sizes)}; "
        f"{name!r} has the axes {list(axes)}, each with its size."
    )


def plan_bad_candidate_sizes(name: str, sizes: Mapping[str, object], n: int) -> str:
    return (
        f"plan: layouts: ({name!r}, {sizes!r}): the sizes must be positive integers "
        f"whose product is the {n} devices planned for."
    )


def plan_jit_no_step(label: str) -> str:
    return f"Plan.jit: the plan {label} has no step of its own; pass the step: plan.jit(step)."


def plan_nothing_fits_state(limit: str, closest: str, needs: str) -> str:
    return (
        f"plan: no layout fits in {limit} per device: on every candidate the state alone "
        f"exceeds it (the smallest, {closest}, needs {needs}). Fixes: 1. plan for more "
        "devices (devices=...); 2. raise memory_limit if the devices have more memory; "
        "3. shrink the model or its optimizer state."
    )


def search_bad_space(space: object) -> str:
    return (
        f"plan.search: space: expected a mapping of knob names to lists of values, e.g. "
        f"{{'remat': ['none', 'full'], 'microbatches': [1, 2]}}, got {type(space).__name__}."
    )


def search_bad_knob_values(name: str, values: object) -> str:
    return (
        f"plan.search: space[{name!r}] = {values!r}: expected a non-empty list of values "
        f"to try, e.g. {{{name!r}: [...]}}."
    )


def search_bad_microbatches(value: object, batch: int | None, choices: Sequence[int] | None) -> str:
    if batch is None or choices is None:
        return f"plan.search: microbatches={value!r}: expected a positive integer."
    return (
        f"plan.search: microbatches={value!r} does not divide the batch of {batch}; "
        f"choose among {', '.join(map(str, choices))}."
    )


def search_bad_knob_value(name: str, value: object, choices: Sequence[object]) -> str:
    return (
        f"plan.search: {name}={value!r} is not a value the builder takes; choose among "
        f"{', '.join(map(repr, choices))}."
    )


def search_builder_failed(knobs: str, error: BaseException) -> str:
    text = str(error).strip().splitlines()
    detail = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return f"plan.search: the builder failed for {knobs or 'its defaults'}: {detail}"


def search_bad_built(knobs: str, got: object) -> str:
    return (
        f"plan.search: the builder returned {type(got).__name__} for "
        f"{knobs or 'its defaults'}; expected Built(step, args) or a (step, args) tuple."
    )


def search_unread_knobs(unread: Sequence[str], reads: Sequence[str]) -> str:
    known = ", ".join(reads) if reads else "none"
    return (
        f"plan.search: the builder never reads the knob(s) {', '.join(map(repr, unread))} "
        f"of the space; the knobs it reads: {known}."
    )


def search_bad_prune(value: object) -> str:
    return f"plan.search: prune={value!r}; choose among True, False, 'pareto'."
