"""Devices to compile for: compile-only TPUs and GPUs when their compilers are installed,
else the process's CPU devices.

No accelerator is needed: ``jax.experimental.topologies.get_topology_desc`` describes
devices that the real TPU compiler (``libtpu``, the ``nnx_sharding[tpu]`` extra) or GPU
compiler (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt``, the ``nnx_sharding[gpu]``
extra) lowers and compiles for, on a machine that has none of them. A GPU is described
by a ``stream_executor.GpuTargetConfigProto`` in text format, shipped here as package
data (``gpu_targets/*.txtpb``) per GPU preset.

The plugins print their initialisation errors (no driver, no TPU host) on stderr; the
calls here run with stderr and jax's plugin logging silenced (`nnx_sharding._cli.quiet`).

Two processes that load ``libtpu`` at once fail on its lock file (``/tmp/libtpu_lockfile``)
unless ``ALLOW_MULTIPLE_LIBTPU_LOAD`` is set: importing this module sets it (unless the
environment already says otherwise), so that planning runs in parallel processes.

On a machine without CUDA, the CUDA plugin refuses to register itself when jax's platforms
are left unset (its CUDA version check fails), and jax then has no GPU topology; the
planner registers it again with that check skipped (`_register_cuda_plugin`), so the GPU
compiler is used whether or not ``JAX_PLATFORMS`` is set.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import math
import os
from collections.abc import Iterator
from typing import Literal

import jax

from .. import _errors
from .._cli.quiet import quiet
from .._types import Device
from ._accelerator import Accelerator, resolve_accelerator

# Before libtpu is first loaded (a jax backend or a TPU topology): processes planning in
# parallel would otherwise fail on libtpu's lock file.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

__all__ = ["compile_devices", "default_tpu_topology", "has_gpu_compiler", "has_tpu_compiler"]

Compiler = Literal["tpu", "gpu", "cpu"]

#: GPU presets with a target description under gpu_targets/ (file name: preset + .txtpb).
GPU_TARGETS = ("h100", "h200", "a100-80gb", "b200")

# Torus dimensions of the TPU generations get_topology_desc knows (2-D: v5e, v6e).
_TPU_DIMS = {"v5e": 2, "v6e": 2, "v5p": 3, "v4": 3}


def has_tpu_compiler() -> bool:
    """Whether ``libtpu`` (the ``nnx_sharding[tpu]`` extra) is installed."""
    return importlib.util.find_spec("libtpu") is not None


def has_gpu_compiler() -> bool:
    """Whether jax's CUDA plugin (the ``nnx_sharding[gpu]`` extra) is installed."""
    try:
        return all(
            importlib.util.find_spec(name) is not None
            for name in ("jax_plugins.xla_cuda12", "jax_cuda12_plugin")
        )
    except ModuleNotFoundError:
        return False


def gpu_target_config(name: str) -> str:
    """The ``GpuTargetConfigProto`` text of a GPU preset (see `GPU_TARGETS`)."""
    files = importlib.resources.files("nnx_sharding.plan") / "gpu_targets"
    return (files / f"{name}.txtpb").read_text()


def default_tpu_topology(generation: str, chips: int) -> list[str]:
    """Topology names for ``chips`` chips of a TPU generation, the squarest first.

    >>> default_tpu_topology("v5e", 8)
    ['v5e:2x4', 'v5e:1x8']
    >>> default_tpu_topology("v5p", 16)[0]
    'v5p:2x2x4'
    """
    ndim = _TPU_DIMS.get(generation, 2)
    shapes: set[tuple[int, ...]] = set()

    def split(n: int, k: int, low: int) -> Iterator[tuple[int, ...]]:
        if k == 1:
            if n >= low:
                yield (n,)
            return
        for d in range(low, n + 1):
            if n % d == 0:
                for rest in split(n // d, k - 1, d):
                    yield (d, *rest)

    shapes.update(split(chips, ndim, 1))
    ranked = sorted(shapes, key=lambda s: (max(s) / min(s), s))
    return [f"{generation}:" + "x".join(map(str, s)) for s in ranked]


@functools.cache
def _tpu_topology(
    name: str, num_slices: int, host: tuple[int, ...] | None = None
) -> tuple[Device, ...]:
    from jax.experimental import topologies

    kwargs: dict[str, object] = {"num_slices": num_slices} if num_slices > 1 else {}
    if host is not None:
        kwargs["chips_per_host_bounds"] = list(host)
    with quiet():
        return tuple(topologies.get_topology_desc(name, "tpu", **kwargs).devices)


def _small_slice(accelerator: Accelerator, name: str) -> tuple[int, ...] | None:
    """A slice of at most one host's chips as a host of its own (``v5e:1x1``, ``v5e:1x2``,
    which the TPU compiler's default host of 2x2 chips does not divide), else None."""
    dims = [int(d) for d in name.partition(":")[2].split("x") if d.isdigit()]
    if not dims or math.prod(dims) > accelerator.devices_per_node:
        return None
    return tuple(dims + [1] * (3 - len(dims)))


@functools.cache
def _gpu_topology(name: str, topology: str) -> tuple[Device, ...]:
    from jax.experimental import topologies

    text = gpu_target_config(name)
    with quiet():
        try:
            described = topologies.get_topology_desc(
                platform="cuda", target_config=text, topology=topology
            )
        except NotImplementedError:  # the plugin did not register: no CUDA here
            if not _register_cuda_plugin():
                raise
            described = topologies.get_topology_desc(
                platform="cuda", target_config=text, topology=topology
            )
        return tuple(described.devices)


def _register_cuda_plugin() -> bool:
    """Registers jax's CUDA plugin for compiling only; whether it registered.

    With jax's platforms unset, the plugin's ``initialize`` (the entry point jax calls for
    every installed plugin) first checks the CUDA libraries and, on a machine without
    them, raises before registering: jax then knows no ``cuda`` topology. Compiling needs
    none of those libraries, so this calls ``initialize`` again with that check skipped
    (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``, set only for the call). A backend jax starts
    later still finds no GPU and falls back to the CPU, as it did before.
    """
    import importlib

    try:
        plugin = importlib.import_module("jax_plugins.xla_cuda12")
    except ImportError:
        return False
    saved = os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    try:
        plugin.initialize()
    except Exception:  # noqa: BLE001 - the plugin cannot register: the caller's fallback
        return False
    finally:
        if saved is None:
            del os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"]
        else:
            os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = saved
    return True


def compile_devices(
    accelerator: Accelerator | str,
    n: int,
    topology: str | None = None,
    num_slices: int = 1,
) -> tuple[list[Device], Compiler, str | None]:
    """``n`` devices to lower and compile for, whose compiler, and a note (or None).

    - TPU: compile-only devices of ``topology`` (``"v5e:16x16"``; by default the
      squarest slice of ``n / num_slices`` chips the TPU compiler accepts), with
      ``num_slices`` slices; needs the ``nnx_sharding[tpu]`` extra.
    - GPU presets: compile-only GPUs, ``num_slices`` × hosts × ``devices_per_node``;
      without the ``nnx_sharding[gpu]`` extra, the CPU devices below, and the note says so.
    - CPU: the process's CPU devices (simulate them with ``JAX_NUM_CPU_DEVICES``).

    Raises:
        ValueError: the TPU compiler is missing, the topology is not one the TPU compiler
            takes, or fewer than ``n`` CPU devices are present.

    >>> devices, compiler, note = compile_devices("cpu", 1)
    >>> devices == jax.devices("cpu")[:1], compiler, note
    (True, 'cpu', None)
    """
    if isinstance(accelerator, str):
        accelerator, named = resolve_accelerator(accelerator)
        topology = topology or named
    if n < 1 or num_slices < 1:
        raise ValueError(_errors.plan_bad_devices(n, num_slices))
    if accelerator.kind == "tpu":
        return _tpu_devices(accelerator, n, topology, num_slices)
    if accelerator.kind == "gpu":
        name = accelerator.name
        if name not in GPU_TARGETS:
            note = (
                f"compiled for simulated CPU devices: no GPU target description for "
                f"{name!r} (there is one for {', '.join(GPU_TARGETS)})"
            )
            return _cpu_devices(n), "cpu", note
        if not has_gpu_compiler():
            note = (
                f"compiled for simulated CPU devices: install the GPU compiler for "
                f"{name}'s own figures (pip install 'nnx_sharding[gpu]')"
            )
            return _cpu_devices(n), "cpu", note
        per_host = min(accelerator.devices_per_node, math.ceil(n / num_slices))
        hosts = math.ceil(n / (num_slices * per_host))
        shape = f"{num_slices}x{hosts}x{per_host}"
        try:
            devices = _gpu_topology(name, shape)
        except Exception as e:  # the plugin failed to describe the GPUs: say why
            note = f"compiled for simulated CPU devices: the GPU compiler failed: {_first(e)}"
            return _cpu_devices(n), "cpu", note
        return list(devices[:n]), "gpu", None
    return _cpu_devices(n), "cpu", None


def _tpu_devices(
    accelerator: Accelerator, n: int, topology: str | None, num_slices: int
) -> tuple[list[Device], Compiler, str | None]:
    if not has_tpu_compiler():
        raise ValueError(_errors.plan_no_tpu_compiler(topology or accelerator.name))
    generation = (topology or accelerator.name).partition(":")[0]
    if topology is not None:
        names = [topology]
    elif n % num_slices:
        raise ValueError(
            _errors.plan_bad_tpu_topology(
                f"{accelerator.name}", f"{n} chips do not split into {num_slices} slices", []
            )
        )
    else:
        names = default_tpu_topology(generation, n // num_slices)
    failures = []
    for name in names:
        try:
            devices = _tpu_topology(name, num_slices)
        except Exception as e:  # the TPU compiler rejects this layout: try the next
            host = _small_slice(accelerator, name)
            try:
                if host is None:
                    raise
                devices = _tpu_topology(name, num_slices, host)
            except Exception:
                failures.append(f"{name}: {_first(e)}")
                continue
        if len(devices) < n:
            raise ValueError(
                _errors.plan_bad_tpu_topology(
                    name, f"it has {len(devices)} chips, fewer than the {n} asked for", []
                )
            )
        note = None
        if len(devices) > n:
            note = f"planned for the first {n} of {name}'s {len(devices)} chips"
        return list(devices[:n]), "tpu", note
    if topology is not None:
        detail = "the TPU compiler rejects it: " + failures[0].partition(": ")[2]
        raise ValueError(_errors.plan_bad_tpu_topology(topology, detail, []))
    raise ValueError(
        _errors.plan_bad_tpu_topology(
            f"{n} {generation} chips", "the TPU compiler takes none of their layouts", failures
        )
    )


def _cpu_devices(n: int) -> list[Device]:
    with quiet():  # the first call starts every backend jax finds
        devices = jax.devices("cpu")
    if len(devices) < n:
        raise ValueError(_errors.plan_too_few_cpu_devices(n, len(devices)))
    return list(devices[:n])


def _first(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
