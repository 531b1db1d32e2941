"""Messages of the planner's hardware (``plan/_hardware/``): accelerators and their
figures, accelerator names and TPU topologies, the devices to compile for, the compilers."""

from __future__ import annotations

from collections.abc import Sequence

from .layout import choice_message, format_message

__all__ = [
    "accelerator_bad_figures",
    "accelerator_bad_kind",
    "accelerator_no_flops",
    "accelerator_read_only_flops",
    "compiler_no_libtpu",
    "plan_bad_accelerator_type",
    "plan_bad_devices",
    "plan_bad_topology",
    "plan_bad_tpu_topology",
    "plan_no_tpu_compiler",
    "plan_too_few_cpu_devices",
    "plan_unknown_accelerator",
]

_FROM_PRESET = (
    "or start from a preset and change what differs: "
    "`dataclasses.replace(nnx_sharding.plan.PRESETS['h100'], name='mine', hbm_bytes=...)`."
)
"""The last fix of a message about an accelerator's figures, or its name."""


def _figures_message(name: str, argument: str, problem: str, rule: str, fix: str) -> str:
    """A figure of the Accelerator ``name`` that cannot be: ``fix``, then `_FROM_PRESET`."""
    transform = f"Accelerator {name!r}" if name else "Accelerator"
    return format_message(transform, argument, [problem], rule, [fix, _FROM_PRESET])


def accelerator_bad_kind(kind: object) -> str:
    """An `Accelerator` whose kind names no compiler the planner knows."""
    return choice_message(
        "Accelerator",
        "kind",
        kind,
        ["gpu", "tpu", "cpu"],
        "Rule: kind says whose compiler the planner compiles for: a GPU's, a TPU's or the CPU's.",
    )


def accelerator_no_flops(name: str) -> str:
    """An `Accelerator` with an empty ``flops``: no peak, so no step time."""
    return _figures_message(
        name,
        "flops",
        "it gives no dtype's peak",
        "Rule: flops maps each dtype the steps compute in to the accelerator's peak FLOP/s "
        "for it, e.g. {'bfloat16': 989e12}.",
        "give at least one dtype's peak, e.g. `flops={'bfloat16': 989e12}`;",
    )


def accelerator_bad_figures(name: str, bad: Sequence[str]) -> str:
    """An `Accelerator` whose figures ``bad`` (field names) are out of their ranges, e.g.
    a bandwidth of 0 or an efficiency above 1."""
    return _figures_message(
        name,
        "figures",
        f"{', '.join(bad)} {'are' if len(bad) > 1 else 'is'} out of range",
        "Rule: these figures must be positive and finite (latencies, kernel_overhead and "
        "torus_wrap may be 0; efficiencies are fractions in (0, 1], spread in [0, 1)).",
        "give each its measured or published figure;",
    )


def accelerator_read_only_flops() -> str:
    """An `Accelerator`'s ``flops`` changed in place (the presets are shared)."""
    return format_message(
        "Accelerator",
        "flops",
        ["it is read-only"],
        "Rule: an Accelerator is frozen, its flops too: the presets are shared by every caller.",
        ["make a changed copy: `dataclasses.replace(accelerator, flops={...})`."],
    )


def _accelerator_message(problem: str, presets: str = "") -> str:
    """`plan`'s accelerator is not one it knows; ``presets``: the names it knows."""
    return format_message(
        "plan",
        "accelerator",
        [problem],
        "Rule: accelerator is a preset's name, a TPU topology such as 'v5e:16x16', or an "
        "nnx_sharding.Accelerator." + (f" The presets: {presets}." if presets else ""),
        ["name a preset, e.g. `accelerator='h100'`;", _FROM_PRESET],
    )


def plan_bad_accelerator_type(got: object) -> str:
    """`resolve_accelerator` given ``got``, neither a str nor an `Accelerator`."""
    return _accelerator_message(f"got {type(got).__name__}")


def plan_unknown_accelerator(name: str, presets: Sequence[str], aliases: Sequence[str]) -> str:
    """``name`` is no preset and no alias; ``presets`` and ``aliases``: those there are."""
    known = f"{', '.join(presets)}; also {', '.join(aliases)}"
    return _accelerator_message(f"{name!r} is not a preset", known)


def _topology_message(problems: Sequence[str], rule: str, fixes: Sequence[str]) -> str:
    """`plan`'s accelerator is a TPU topology it cannot plan for: ``fixes``, then the way
    around TPUs."""
    last = "or plan for a GPU preset or the CPU, e.g. `accelerator='h100'`."
    return format_message("plan", "accelerator", problems, rule, [*fixes, last])


def plan_bad_topology(spec: str, kind: str) -> str:
    """``spec`` (``name:AxB``) gives a topology to a GPU or CPU preset (``kind``), or
    gives a TPU one that is not chips per dimension."""
    problem = (
        f"{spec!r} gives a topology to a {kind.upper()} preset"
        if kind != "tpu"
        else f"{spec!r} is not a TPU topology of the form 'v5e:AxB' or 'v5p:AxBxC'"
    )
    return _topology_message(
        [problem],
        "Rule: only TPU generations take a topology, written as "
        "jax.experimental.topologies.get_topology_desc takes it ('v5e:16x16', 'v5p:4x4x4').",
        [
            "write the topology as chips per dimension, e.g. `accelerator='v5e:16x16'`;",
            "or give the preset alone and the number of devices, e.g. "
            "`accelerator='h100', devices=64`;",
        ],
    )


def plan_no_tpu_compiler(spec: str) -> str:
    """A TPU plan (for ``spec``) where neither `compilers_dir` nor jax[tpu] has libtpu."""
    return _topology_message(
        [f"{spec!r} needs the TPU compiler (libtpu), which is not installed"],
        "Rule: TPU plans are compiled by the TPU's own compiler, on this machine, with no "
        "TPU attached; the planner loads it where `python -m nnx_sharding compilers "
        "--install` puts it (or from jax[tpu]).",
        ["install it: `python -m nnx_sharding compilers --install tpu`;"],
    )


def plan_bad_tpu_topology(spec: str, detail: str, failures: Sequence[str]) -> str:
    """No slice the TPU compiler takes for ``spec``: ``detail`` says why, ``failures``
    what the compiler said of each layout tried."""
    return _topology_message(
        [f"{spec}: {detail}"] + [f"the TPU compiler: {f}" for f in failures],
        "Rule: a TPU slice is a torus the TPU compiler knows, e.g. 'v5e:2x4', 'v5e:16x16', "
        "'v5p:4x4x4', 'v6e:8x8'; several slices take num_slices.",
        [
            "name a slice the compiler takes, e.g. `accelerator='v5e:4x4'`;",
            "or give a device count that is a whole slice, e.g. `devices=64`;",
        ],
    )


def plan_bad_devices(n: int, num_slices: int) -> str:
    """`compile_devices` asked for fewer than one device, or one slice (compare
    `plan_bad_device_count`, for `plan`'s own argument)."""
    return format_message(
        "plan",
        "devices",
        [f"{n} devices in {num_slices} slices"],
        "Rule: a plan is for at least one device, in at least one slice (num_slices: the "
        "TPU slices, or the GPU clusters, the devices are split into).",
        ["give both as counts, e.g. `devices=8, num_slices=1`."],
    )


def plan_too_few_cpu_devices(needed: int, present: int) -> str:
    """Plans compiled for ``needed`` simulated CPU devices in a process that has
    ``present``."""
    return format_message(
        "plan",
        "devices",
        [f"planning for {needed} devices needs {needed} CPU devices; this process has {present}"],
        "Rule: without a TPU or GPU compiler, the plans are compiled for simulated CPU "
        "devices, whose number is fixed when jax starts.",
        [
            f"set `JAX_NUM_CPU_DEVICES={needed}` in the environment before jax is "
            "imported (or `jax.config.update('jax_num_cpu_devices', "
            f"{needed})` before jax's first use);",
            f"or use the command line, which starts itself with enough: `python -m "
            f"nnx_sharding plan --devices {needed} ...`;",
            "or install a compiler for your accelerator: `python -m nnx_sharding compilers "
            "--install gpu` (or `tpu`).",
        ],
    )


def compiler_no_libtpu(jax_version: str) -> str:
    """``python -m nnx_sharding compilers --install tpu`` with a jax whose ``tpu`` extra
    names no libtpu."""
    return format_message(
        "python -m nnx_sharding compilers",
        "tpu",
        [f"jax {jax_version} names no libtpu in its tpu extra"],
        "Rule: the TPU compiler installed is the libtpu that jax[tpu] pins, the one this jax "
        "release was built and tested with.",
        [
            "install jax's own pin instead: `pip install 'jax[tpu]'` (every jax program of "
            "the environment then loads it);",
            "or upgrade jax to a release whose tpu extra names libtpu.",
        ],
    )
