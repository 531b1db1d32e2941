"""Messages of the planner's search (``plan/_search/``): `plan`'s and `search`'s
arguments, layouts and candidates given exactly, knobs and builders."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from .layout import choice_message, fixes_of, format_message, microbatches_message, quoted

__all__ = [
    "plan_bad_candidate",
    "plan_bad_device_count",
    "plan_bad_layout_spec",
    "plan_unknown_layouts",
    "search_bad_built",
    "search_bad_knob_value",
    "search_bad_knob_values",
    "search_bad_microbatches",
    "search_bad_prune",
    "search_bad_space",
    "search_builder_failed",
    "search_unread_knobs",
]


def _layouts_rule(layouts: Sequence[str]) -> str:
    return (
        f"Rule: layouts lists layout names ({quoted(layouts)}), each planned on every split "
        "of the devices, and candidates given exactly, (name, {axis: size, ...}), e.g. "
        "('fsdp+tp', {'fsdp': 16, 'model': 4}), whose sizes multiply to the devices."
    )


def _candidate(name: str, axes: Sequence[str], sizes: Mapping[str, object], n: int) -> str:
    """``(name, {axis: size})`` on ``n`` devices: the sizes given for the inner axes where
    they are positive integers that divide ``n``, the rest on the outermost axis."""
    inner = [sizes.get(a) for a in axes[1:]]
    counts = [s for s in inner if isinstance(s, int) and not isinstance(s, bool) and s > 0]
    if len(counts) == len(inner) and n % math.prod(counts) == 0:
        chosen = {axes[0]: n // math.prod(counts), **dict(zip(axes[1:], counts, strict=True))}
    else:
        chosen = {axes[0]: n, **dict.fromkeys(axes[1:], 1)}
    return repr((name, chosen))


def plan_bad_layout_spec(spec: object, layouts: Sequence[str]) -> str:
    """An entry of layouts that is neither a name (a str) nor a ``(name, {axis: size})``
    pair; ``layouts``: the names there are."""
    return format_message(
        "plan",
        "layouts",
        [f"{spec!r} is neither a layout name nor a candidate (name, {{axis: size, ...}})"],
        _layouts_rule(layouts),
        [
            "name a layout, e.g. `layouts=['fsdp']`;",
            "or give a candidate's axis sizes, e.g. `layouts=[('fsdp', {'fsdp': 8})]`.",
        ],
    )


def plan_unknown_layouts(unknown: Sequence[str], layouts: Iterable[str]) -> str:
    """Names in layouts (or a candidate's name) that `LAYOUTS` does not have."""
    return format_message(
        "plan",
        "layouts",
        [f"unknown layouts {list(unknown)}"],
        _layouts_rule(list(layouts)),
        [
            "name those it knows, e.g. `layouts=['dp', 'fsdp']`;",
            "or leave layouts out: every layout is planned.",
        ],
    )


def plan_bad_candidate(name: str, sizes: Mapping[str, object], axes: Sequence[str], n: int) -> str:
    """A candidate given exactly, ``(name, sizes)``, whose axes are not ``name``'s
    ``axes``, or whose sizes are not positive integers that multiply to ``n``."""
    given = f"({name!r}, {sizes!r})"
    if set(sizes) != set(axes):
        problem = f"{given} gives the axes {sorted(sizes)}; {name!r} has the axes {list(axes)}"
    else:
        problem = f"the sizes of {given} are not positive integers whose product is {n}"
    return format_message(
        "plan",
        "layouts",
        [problem],
        f"Rule: a candidate given exactly gives each of its layout's axes a size; the sizes "
        f"must be positive integers whose product is the {n} devices planned for.",
        [f"give its axes sizes that multiply to {n}, e.g. `{_candidate(name, axes, sizes, n)}`."],
    )


def plan_bad_device_count(n: object) -> str:
    """`plan`'s or `search`'s devices given as a count below 1 (`plan_bad_devices` is
    `compile_devices`' own)."""
    return format_message(
        "plan",
        "devices",
        [f"{n!r} is not a positive number of devices"],
        "Rule: devices is how many devices to plan for, or the devices themselves.",
        ["give a count, e.g. `devices=8`, or leave it out for the devices jax has."],
    )


_SPACE_RULE = (
    "Rule: space maps the names of knobs the builder reads to the values to try, e.g. "
    "{'remat': ['none', 'full'], 'microbatches': [1, 2]}; search compiles their product."
)


def search_bad_space(space: object) -> str:
    """A space that is not a mapping, or one whose knob name is not a str."""
    names = [k for k in space if not isinstance(k, str)] if isinstance(space, Mapping) else []
    return format_message(
        "plan.search",
        "space",
        [f"the knob name {names[0]!r} is not a str" if names else f"got {type(space).__name__}"],
        _SPACE_RULE,
        [
            "write it as a mapping, e.g. "
            "`space={'remat': ['none', 'full'], 'microbatches': [1, 2]}`."
        ],
    )


def search_bad_knob_values(name: str, values: object) -> str:
    """``space[name]`` that is one value (a str, a number), or an empty list."""
    listed = f"[{values!r}]" if isinstance(values, (str, bytes, int, float)) else "[...]"
    return format_message(
        "plan.search",
        "space",
        [f"space[{name!r}] = {values!r} is not a non-empty list of values"],
        _SPACE_RULE,
        [f"list the values to try, e.g. `space={{{name!r}: {listed}}}`."],
    )


def search_bad_microbatches(value: object, batch: int | None) -> str:
    """``batch``: the step's batch, which ``value`` does not divide (None: ``value`` is
    not a positive integer)."""
    return microbatches_message(
        "plan.search", "space", value, batch, lambda k: f"space={{'microbatches': [{k}]}}"
    )


def search_bad_knob_value(name: str, value: object, choices: Sequence[object]) -> str:
    """A value of the space that the builder's declared ``choices`` do not list."""
    return format_message(
        "plan.search",
        "space",
        [f"{name}={value!r} is not a value the builder takes"],
        f"Rule: the builder declares the values each knob takes (`build.choices`); {name} "
        f"takes {quoted(choices)}.",
        [f"search those, e.g. `space={{{name!r}: {list(choices)[:2]!r}}}`."],
    )


def search_builder_failed(knobs: str, error: BaseException) -> str:
    """The builder raised ``error``; its fixes, where it has some, are the message's."""
    text = str(error).strip().splitlines()
    detail = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return format_message(
        "plan.search",
        "build",
        [f"the builder failed for {knobs or 'its defaults'}: {detail}"],
        "Rule: search calls the builder with each point's knob values before it compiles "
        "anything; an error the builder raises stops the search.",
        fixes_of(str(error)) or ["fix the builder for these knob values, or search others."],
    )


def search_bad_built(knobs: str, got: object) -> str:
    """The builder returned ``got``, neither a `Built` nor a ``(step, args)`` pair, at the
    point ``knobs`` (as `label` writes it)."""
    return format_message(
        "plan.search",
        "build",
        [f"the builder returned {type(got).__name__} for {knobs or 'its defaults'}"],
        "Rule: a builder returns Built(step, args), or a (step, args) tuple: the step and the "
        "arguments (abstract or concrete) to compile it for.",
        ["return them, e.g. `return nnx_sharding.plan.Built(step, (model, x))`."],
    )


def search_unread_knobs(unread: Sequence[str], reads: Sequence[str]) -> str:
    """Knobs of the space that the builder, called at each point, never read; ``reads``:
    those it did."""
    known = ", ".join(reads) if reads else "none"
    return format_message(
        "plan.search",
        "space",
        [f"the builder never reads the knob(s) {quoted(unread)} of the space"],
        "Rule: a knob of the space changes the step only if the builder reads it "
        f"(`knobs[name]`, `knobs.get(name, default)`); the knobs it reads: {known}.",
        [
            f"read it in the builder, e.g. `knobs.get({unread[0]!r}, default)`;",
            "or search only the knobs it reads.",
        ],
    )


def search_bad_prune(value: object) -> str:
    """A prune other than True, False or 'pareto'."""
    return choice_message(
        "plan.search",
        "prune",
        value,
        [True, False, "pareto"],
        "Rule: prune leaves uncompiled the points shown not to be the fastest that fits "
        "(True), with the candidates beaten at the same knobs too ('pareto'), or none (False).",
    )
