"""Messages of the planner's records (``plan/``): a `Plan` (its mesh, its jit), the
`Plans` (the best, the plot) and the device counts sized for a training run."""

from __future__ import annotations

from collections.abc import Sequence

from .layout import format_message

__all__ = [
    "plan_cannot_replan",
    "plan_jit_no_step",
    "plan_mesh_too_few_devices",
    "plan_needs_matplotlib",
    "plan_no_candidate_built",
    "plan_no_tokens",
    "plan_nothing_fits",
    "plan_nothing_fits_state",
    "plan_target_unreachable",
]


def plan_mesh_too_few_devices(label: str, n: int, have: int, given: bool = False) -> str:
    """``given``: the devices were given to `Plan.mesh` (else: those jax has)."""
    if given:
        problem = (
            f"the plan {label} needs {n} devices; {have} {'was' if have == 1 else 'were'} given"
        )
        fixes = [
            f"give it {n}, e.g. `plan.mesh(jax.devices()[:{n}])`;",
            f"or leave devices out: the first {n} that jax has.",
        ]
    else:
        problem = f"the plan {label} needs {n} devices and jax has {have}"
        fixes = [
            f"run it where there are {n} devices;",
            "to run it on simulated CPU devices, set the environment variables "
            f"`JAX_PLATFORMS=cpu` and `JAX_NUM_CPU_DEVICES={n}` before jax is imported.",
        ]
    return format_message(
        "Plan.mesh",
        "devices",
        [problem],
        "Rule: a plan's mesh has the number of devices it was planned for.",
        fixes,
    )


def plan_jit_no_step(label: str) -> str:
    """`Plan.jit` without ``fun``, on a plan that keeps no step: one made by hand, not by
    `plan` or `search`."""
    return format_message(
        "Plan.jit",
        "fun",
        [f"the plan {label} has no step of its own"],
        "Rule: a plan that plan or search made keeps its step; one made otherwise has none.",
        ["pass the step: `plan.jit(step)`."],
    )


_NO_FIT_RULE = (
    "Rule: a plan fits when the compiler's peak memory per device is within memory_limit; "
    "best is the fastest plan that fits."
)
_MORE_MEMORY = [
    "plan for more devices (`devices=...`);",
    "raise memory_limit if the devices have more memory;",
]
"""The first fixes for a step that fits nowhere."""


def plan_nothing_fits_state(limit: str, closest: str, needs: str) -> str:
    """`Plans.best` where every candidate went uncompiled, its state alone above the
    limit; ``closest``: the smallest of them, which ``needs`` that much."""
    return format_message(
        "Plans.best",
        "memory_limit",
        [
            f"no layout fits in {limit} per device: on every candidate the state alone "
            f"exceeds it (the smallest, {closest}, needs {needs})"
        ],
        _NO_FIT_RULE,
        [*_MORE_MEMORY, "or shrink the model or its optimizer state."],
    )


def plan_no_candidate_built(reasons: Sequence[str], more: int) -> str:
    """``reasons``: the first candidates' ``label: reason``; ``more``: how many others."""
    shown = "; ".join(reasons) + (f"; and {more} more (see the table)" if more > 0 else "")
    return format_message(
        "Plans.best",
        "plans",
        [f"no candidate could be built: {shown}"],
        "Rule: best is the fastest plan that fits, among the candidates compiled; a "
        "candidate is not compiled when its shapes do not divide over its mesh, or the "
        "step fails to lower or compile for it.",
        [
            "give the batch and the model sizes that the mesh axes divide (each "
            "reason names the dimension);",
            "or plan for another device count, or other layouts (`layouts=[...]`).",
        ],
    )


def plan_nothing_fits(
    limit: str,
    closest: str,
    needs: str,
    miss: str,
    miss_bytes: int,
    beyond: tuple[str, str, str | None] | None = None,
) -> str:
    """``beyond``: compiled beyond the space searched, the first plan that fits (label,
    peak, the knob values to search), else the lightest (label, peak, None)."""
    problem = (
        f"no layout fits in {limit} per device; the closest is {closest}, which needs "
        f"{needs} per device: {miss} ({miss_bytes:,} bytes) too many"
    )
    found = []
    if beyond is not None and beyond[2] is None:
        problem += (
            f"; compiled beyond the space searched, the lightest, {beyond[0]}, still "
            f"needs {beyond[1]}"
        )
    elif beyond is not None:
        found = [
            f"search {beyond[2]}: compiled beyond the space searched, {beyond[0]} fits, "
            f"needing {beyond[1]} per device;"
        ]
    return format_message(
        "Plans.best",
        "memory_limit",
        [problem],
        _NO_FIT_RULE,
        [
            *found,
            *_MORE_MEMORY,
            "or shrink the batch or the model, or donate the state (`donate_argnums=...`).",
        ],
    )


def plan_needs_matplotlib() -> str:
    """`Plans.plot` where matplotlib is not installed."""
    return format_message(
        "Plans.plot",
        "path",
        ["matplotlib is not installed"],
        "Rule: the plot is drawn with matplotlib, which the bench extra installs.",
        ["install it: `pip install 'nnx_sharding[bench]'`."],
    )


def plan_target_unreachable(tokens: float, days: float, tried: str) -> str:
    """No device count up to max_devices trains ``tokens`` in ``days``; ``tried``: the days
    each count tried needs."""
    return format_message(
        "Plans.devices_for",
        "days",
        [f"no device count tried trains {tokens:.3g} tokens in {days:g} days ({tried})"],
        "Rule: devices_for plans the step again at more devices, doubling, up to "
        "max_devices, and keeps the fewest that meet the target.",
        ["give more days or fewer tokens;", "or a larger max_devices (`max_devices=...`)."],
    )


def plan_cannot_replan() -> str:
    """`Plans.devices_for` on plans that no planner made (built by hand)."""
    return format_message(
        "Plans.devices_for",
        "plans",
        ["these Plans were not made by plan or search"],
        "Rule: devices_for plans the step again at other device counts: it needs the step "
        "and the planner's arguments, which only the Plans that plan or search return keep.",
        [
            "call devices_for on what `nnx_sharding.plan(...)` or "
            "`nnx_sharding.plan.search(...)` returned."
        ],
    )


def plan_no_tokens() -> str:
    """`Plans.devices_for` with no ``tokens_per_step`` for a step without token arguments."""
    return format_message(
        "Plans.devices_for",
        "tokens_per_step",
        ["no integer array argument to count tokens from"],
        "Rule: the tokens of a step are counted from its first integer array argument "
        "(the (batch, seq) tokens), unless tokens_per_step says how many.",
        ["pass it: `plans.devices_for(tokens, days, tokens_per_step=...)`."],
    )
