"""Messages about the planner's decoder: its config, remat policies, knobs, microbatches."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "decoder_bad_choice",
    "decoder_bad_kv_heads",
    "decoder_bad_size",
    "decoder_unknown_knobs",
    "microbatches_indivisible",
]


def _listed(choices: Sequence[object]) -> str:
    return ", ".join(repr(c) for c in choices)


def decoder_bad_choice(where: str, field: str, value: object, choices: Sequence[object]) -> str:
    return f"{where}: {field}={value!r} is not one of {_listed(choices)}."


def decoder_bad_size(field: str, value: object) -> str:
    return f"DecoderConfig: {field}={value!r}; expected a positive integer."


def decoder_bad_kv_heads(kv_heads: int, heads: int) -> str:
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    return (
        f"DecoderConfig: kv_heads={kv_heads} does not divide heads={heads}; "
        f"choose one of {', '.join(map(str, divisors))}."
    )


def decoder_unknown_knobs(unknown: Sequence[str], accepted: Sequence[str]) -> str:
    return f"decoder_builder: unknown knobs {_listed(unknown)}; the knobs are {_listed(accepted)}."


def microbatches_indivisible(where: str, microbatches: object, batch: int) -> str:
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
    return (
        f"{where}: microbatches={microbatches!r} does not divide the batch of {batch}; "
        f"choose one of {shown}."
    )
