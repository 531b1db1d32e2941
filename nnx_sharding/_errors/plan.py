"""Messages about planning itself: its arguments, the accelerator's figures, the plans."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = [
    "plan_cannot_replan",
    "accelerator_bad_figures",
    "accelerator_bad_kind",
    "accelerator_no_flops",
    "accelerator_read_only_flops",
    "plan_bad_accelerator_type",
    "plan_bad_device_count",
    "plan_bad_devices",
    "plan_bad_memory_limit",
    "plan_mesh_too_few_devices",
    "plan_needs_matplotlib",
    "plan_no_candidate_built",
    "plan_nothing_fits",
    "plan_nothing_measured",
    "plan_target_unreachable",
    "plan_unknown_layouts",
]


def accelerator_bad_kind(kind: str) -> str:
    return f"Accelerator: kind: {kind!r} is not one of 'gpu', 'tpu', 'cpu'."


def accelerator_no_flops(name: str) -> str:
    return (
        f"Accelerator {name!r}: flops: give at least one dtype's peak, "
        "e.g. flops={'bfloat16': 989e12}."
    )


def accelerator_bad_figures(name: str, bad: Sequence[str]) -> str:
    return (
        f"Accelerator {name!r}: these figures must be positive and finite (latencies, "
        f"kernel_overhead and torus_wrap may be 0; efficiencies are fractions in (0, 1], "
        f"spread in [0, 1)): {', '.join(bad)}."
    )


def accelerator_read_only_flops() -> str:
    return "Accelerator.flops is read-only: use dataclasses.replace(..., flops=...)"


def plan_bad_accelerator_type(got: object) -> str:
    return (
        f"plan: accelerator: expected a preset name, a TPU topology such as "
        f"'v5e:16x16', or an nnx_sharding.Accelerator, got {type(got).__name__}."
    )


def plan_bad_memory_limit(text: object) -> str:
    return (
        f"plan: memory_limit={text!r} is not a size. It takes a positive number of bytes "
        "(an int, e.g. 85899345920) or a string with a unit: '80GiB', '16 GB', '512MiB' "
        "(units B, KB, MB, GB, TB and KiB, MiB, GiB, TiB)."
    )


def plan_bad_devices(n: int, num_slices: int) -> str:
    return f"plan: devices: {n} devices in {num_slices} slices; both must be >= 1."


def plan_bad_device_count(n: int) -> str:
    return f"plan: devices={n}; expected a positive number of devices"


def plan_unknown_layouts(unknown: Sequence[str], layouts: Iterable[str]) -> str:
    return f"plan: unknown layouts {list(unknown)}; the layouts are {', '.join(layouts)}"


def plan_mesh_too_few_devices(label: str, n: int, have: int) -> str:
    return (
        f"Plan.mesh: the plan {label} needs {n} devices and jax has "
        f"{have}. Fixes: 1. run it where there are {n} devices; 2. to run it on "
        f"simulated CPU devices, set the environment variables JAX_PLATFORMS=cpu "
        f"and JAX_NUM_CPU_DEVICES={n} before jax is imported."
    )


def plan_no_candidate_built(reasons: str) -> str:
    return f"plan: no candidate could be built. {reasons}"


def plan_nothing_fits(
    limit: str, closest: str, needs: str, miss: str, miss_bytes: int, advice: str = ""
) -> str:
    return (
        f"plan: no layout fits in {limit} per device. The closest is "
        f"{closest}, which needs {needs} per device: "
        f"{miss} ({miss_bytes:,} bytes) too many.{' ' + advice if advice else ''} Fixes: "
        "1. plan for more devices (devices=...); 2. raise memory_limit if the devices have "
        "more memory; 3. shrink the batch or the model, or donate the state "
        "(donate_argnums=...)."
    )


def plan_needs_matplotlib() -> str:
    return "Plans.plot needs matplotlib: pip install 'nnx_sharding[bench]'"


def plan_nothing_measured() -> str:
    return (
        "Plans.calibrate: no plan has a measured step time: run plans.measure() on the "
        "devices to calibrate for first (it times the best plans that fit)."
    )


def plan_target_unreachable(tokens: float, days: float, tried: str) -> str:
    return (
        f"Plans.devices_for: no device count tried trains {tokens:.3g} tokens in {days:g} "
        f"days ({tried}). Give more days, fewer tokens, or a larger max_devices."
    )


def plan_cannot_replan() -> str:
    """`Plans.devices_for` on plans that no planner made (built by hand)."""
    return (
        "devices_for: these Plans were not made by plan or search, so there is no step to "
        "plan again at other device counts. Fix: call devices_for on what "
        "nnx_sharding.plan(...) or nnx_sharding.plan.search(...) returned."
    )
