"""Messages about the planner's hardware: accelerator names, TPU topologies, devices."""

from __future__ import annotations

from collections.abc import Sequence

from .layout import format_message

__all__ = [
    "plan_bad_topology",
    "plan_bad_tpu_topology",
    "plan_no_tpu_compiler",
    "plan_too_few_cpu_devices",
    "plan_unknown_accelerator",
]


def plan_unknown_accelerator(name: str, presets: Sequence[str], aliases: Sequence[str]) -> str:
    return format_message(
        "plan",
        "accelerator",
        [f"{name!r} is not a preset"],
        f"Rule: accelerator is a preset ({', '.join(presets)}; also {', '.join(aliases)}), "
        "a TPU topology such as 'v5e:16x16', or an nnx_sharding.Accelerator.",
        [
            "use a preset's name, e.g. `accelerator='h100'`;",
            "or describe yours: `dataclasses.replace(nnx_sharding.plan.PRESETS['h100'], "
            "name='mine', hbm_bytes=...)`.",
        ],
    )


def plan_bad_topology(spec: str, kind: str) -> str:
    problem = (
        f"{spec!r} gives a topology to a {kind.upper()} preset"
        if kind != "tpu"
        else f"{spec!r} is not a TPU topology of the form 'v5e:AxB' or 'v5p:AxBxC'"
    )
    return format_message(
        "plan",
        "accelerator",
        [problem],
        "Rule: only TPU generations take a topology, written as "
        "jax.experimental.topologies.get_topology_desc takes it ('v5e:16x16', 'v5p:4x4x4').",
        [
            "write the topology as chips per dimension, e.g. `accelerator='v5e:16x16'`;",
            "or give the preset alone and the number of devices, e.g. "
            "`accelerator='h100', devices=64`.",
        ],
    )


def plan_no_tpu_compiler(spec: str) -> str:
    return format_message(
        "plan",
        "accelerator",
        [f"{spec!r} needs the TPU compiler (libtpu), which is not installed"],
        "Rule: TPU plans are compiled by the TPU's own compiler, on this machine, with no "
        "TPU attached; the planner loads it where `python -m nnx_sharding compilers "
        "--install` puts it (or from jax[tpu]).",
        [
            "install it: `python -m nnx_sharding compilers --install tpu`;",
            "or plan for a GPU preset or the CPU, e.g. `accelerator='h100'`.",
        ],
    )


def plan_bad_tpu_topology(spec: str, detail: str, failures: Sequence[str]) -> str:
    problems = [f"{spec}: {detail}"] + [f"the TPU compiler: {f}" for f in failures]
    return format_message(
        "plan",
        "accelerator",
        problems,
        "Rule: a TPU slice is a torus the TPU compiler knows, e.g. 'v5e:2x4', 'v5e:16x16', "
        "'v5p:4x4x4', 'v6e:8x8'; several slices take num_slices.",
        [
            "name a slice the compiler takes, e.g. `accelerator='v5e:4x4'`;",
            "or give a device count that is a whole slice, e.g. `devices=64`.",
        ],
    )


def plan_too_few_cpu_devices(needed: int, present: int) -> str:
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
