"""Messages of the planner's cost model (``plan/_cost/``): the memory limit, calibration."""

from __future__ import annotations

from .layout import format_message

__all__ = ["plan_bad_memory_limit", "plan_nothing_measured"]


def plan_bad_memory_limit(text: object) -> str:
    """`parse_bytes` refused ``text`` (`plan`'s and `search`'s memory_limit): neither a
    positive int nor a positive number with a unit it knows."""
    return format_message(
        "plan",
        "memory_limit",
        [f"{text!r} is not a size"],
        "Rule: memory_limit is the memory of one device: a positive number of bytes (an int, "
        "e.g. 85899345920) or a string with a unit, '80GiB', '16 GB', '512MiB' (units B, KB, "
        "MB, GB, TB and KiB, MiB, GiB, TiB).",
        [
            "write it with a unit, e.g. `memory_limit='80GiB'`;",
            "or leave it out: the accelerator's own memory (its hbm_bytes) is the limit.",
        ],
    )


def plan_nothing_measured() -> str:
    """`calibrate` (`Plans.calibrate`) with no step time measured: nothing to fit the
    fractions to."""
    return format_message(
        "Plans.calibrate",
        "plans",
        ["no plan has a measured step time"],
        "Rule: calibrate fits the accelerator's achievable fractions (matmul, HBM, links) to "
        "step times measured on the devices to calibrate for.",
        ["measure first, on those devices: `plans.measure()` (it times the best plans that fit)."],
    )
