"""Messages of `MoE` and `moe`: the experts per token, the capacity, the expert axis."""

from __future__ import annotations

from .layout import divisors, format_message

__all__ = [
    "moe_bad_capacity",
    "moe_bad_grouped",
    "moe_bad_input",
    "moe_bad_k",
    "moe_experts_indivisible",
]


def moe_bad_input(shape: tuple[int, ...], d_model: int) -> str:
    """``x`` is not ``(batch, seq, d_model)``."""
    return format_message(
        "MoE",
        "x",
        [f"an array of shape {tuple(shape)}; the layer's width is {d_model}"],
        "Rule: x is (batch, seq, d_model): the experts' capacity and the router's loss are "
        "per sequence.",
        [
            "give tokens without a sequence one: `layer(x[:, None, :])`, and take `y[:, 0]`;",
            f"or build the layer with `d_model={shape[-1] if shape else d_model}`.",
        ],
    )


def moe_bad_k(k: object, experts: int, transform: str = "MoE", argument: str = "k") -> str:
    """Experts per token not an integer in ``1..experts``."""
    return format_message(
        transform,
        argument,
        [f"{k!r} experts per token, with {experts} experts"],
        f"Rule: each token goes to {argument} distinct experts, 1 <= {argument} <= experts "
        f"({experts}).",
        [
            f"pass `{argument}=min({argument}, {experts})` (Mixtral: 2 of 8; Qwen3-MoE: 8 of 128);",
            "or more experts.",
        ],
    )


def moe_bad_grouped(grouped: object) -> str:
    """An unknown ``grouped``."""
    return format_message(
        "MoE",
        "grouped",
        [f"{grouped!r} is not a way to compute the experts"],
        "Rule: 'ragged' (grouped matmuls, jax.lax.ragged_dot) or 'dense' (every expert on "
        "every token, weighted).",
        ["pass `grouped='ragged'`;", "or `grouped='dense'` where ragged_dot does not compile."],
    )


def moe_bad_capacity(
    capacity_factor: object, seq: int | None, experts: int, k: int, transform: str = "MoE"
) -> str:
    """A capacity factor that is not positive, or so small that every token is dropped."""
    return format_message(
        transform,
        "capacity_factor",
        [
            f"{capacity_factor!r} with {seq} tokens per sequence, {experts} experts and "
            f"k={k}: each expert would take int(ceil({k} · {seq} / {experts}) · "
            f"{capacity_factor!r}) = 0 tokens per sequence, so every assignment would be "
            "dropped"
            if isinstance(capacity_factor, (int, float)) and capacity_factor > 0 and seq
            else f"{capacity_factor!r} is not a positive number"
        ],
        "Rule: each expert takes int(ceil(k · seq / experts) · capacity_factor) tokens of "
        "each sequence (MaxText's capacity); capacity_factor must make that at least 1.",
        [
            "pass `capacity_factor=1.25` or more (1.0 is an even share, 1.25 MaxText's usual);",
            "or `capacity_factor=None`: dropless, every assignment computed.",
        ],
    )


def moe_experts_indivisible(experts: int, axis_size: int) -> str:
    """The experts do not split evenly over the ``expert`` mesh axis."""
    return format_message(
        "MoE",
        "experts",
        [f"{experts} experts over the mesh axis 'expert' of {axis_size} devices"],
        "Rule: each device of the 'expert' axis holds experts / axis_size whole experts.",
        [
            f"use a mesh whose 'expert' axis is one of {', '.join(map(str, divisors(experts)))};",
            f"or build the layer with a multiple of {axis_size} experts.",
        ],
    )
