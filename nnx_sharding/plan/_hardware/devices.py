"""Devices to compile for: compile-only TPUs and GPUs when their compilers are installed,
else the process's CPU devices.

No accelerator is needed: ``jax.experimental.topologies.get_topology_desc`` describes
devices that the real TPU compiler (``libtpu``) or GPU compiler (jax's CUDA PJRT plugin)
lowers and compiles for, on a machine that has none of them. Both are installed by
``python -m nnx_sharding compilers --install`` where no other program loads them, and
loaded from there on the first call here (`nnx_sharding.plan._hardware.compilers`). A GPU is
described by a ``stream_executor.GpuTargetConfigProto`` in text format, shipped here as
package data (``gpu_targets/*.txtpb``) per GPU preset.

The compilers print their initialisation errors (no driver, no TPU host) on stderr; the
calls here that load them run with stderr and jax's plugin logging silenced
(`stderr.quiet`).
"""

from __future__ import annotations

import functools
import importlib.resources
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ... import _errors
from ..._types import Device
from . import compilers
from .accelerators import Accelerator, resolve_accelerator
from .stderr import quiet

__all__ = ["compile_devices", "default_tpu_topology", "has_gpu_compiler", "has_tpu_compiler"]
__all__ += ["mesh_in_order", "order_devices"]

Compiler = Literal["tpu", "gpu", "cpu"]

#: GPU presets with a target description under gpu_targets/ (file name: preset + .txtpb).
GPU_TARGETS = ("h100", "h200", "a100-80gb", "b200")

# Torus dimensions of the TPU generations get_topology_desc knows (2-D: v5e, v6e).
_TPU_DIMS = {"v5e": 2, "v6e": 2, "v5p": 3, "v4": 3, "tpu7x": 3}
_DEVICES_PER_CHIP = {"tpu7x": 2}
"""TPU generations whose chips jax sees as more than one device (Ironwood's two
TensorCores)."""


def has_tpu_compiler() -> bool:
    """Whether the TPU compiler (``libtpu``) is installed (`compilers.tpu_library`)."""
    return compilers.tpu_library() is not None


def has_gpu_compiler() -> bool:
    """Whether the GPU compiler (jax's CUDA PJRT plugin) is installed
    (`compilers.cuda_library`)."""
    return compilers.cuda_library() is not None


def gpu_target_config(name: str) -> str:
    """The ``GpuTargetConfigProto`` text of a GPU preset (see `GPU_TARGETS`)."""
    files = importlib.resources.files("nnx_sharding.plan._hardware") / "gpu_targets"
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
    library = compilers.tpu_library()
    if library is None:
        raise ValueError(_errors.plan_no_tpu_compiler(name))
    with quiet(), compilers.tpu_library_env(library):
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
    """Compile-only GPUs: those of the CUDA plugin jax registered itself (``jax[cuda12]``
    on a machine with CUDA), else of the plugin `compilers.cuda_library` finds, registered
    now (the first ``get_topology_desc`` also lets jax register the plugins it finds)."""
    from jax.experimental import topologies

    text = gpu_target_config(name)
    with quiet():
        try:
            described = topologies.get_topology_desc(
                platform="cuda", target_config=text, topology=topology
            )
        except NotImplementedError:  # jax knows no CUDA plugin: register the planner's
            library = compilers.cuda_library()
            if library is None:
                raise
            compilers.register_cuda(library)
            described = topologies.get_topology_desc(
                platform="cuda", target_config=text, topology=topology
            )
        return tuple(described.devices)


def compile_devices(
    accelerator: Accelerator | str,
    n: int,
    topology: str | None = None,
    num_slices: int = 1,
) -> tuple[list[Device], Compiler, str | None]:
    """``n`` devices to lower and compile for, whose compiler, and a note (or None).

    - TPU: compile-only devices of ``topology`` (``"v5e:16x16"``; by default the
      squarest slice of ``n / num_slices`` chips the TPU compiler accepts), with
      ``num_slices`` slices; needs the TPU compiler
      (``python -m nnx_sharding compilers --install tpu``).
    - GPU presets: compile-only GPUs, ``num_slices`` × hosts × ``devices_per_node``;
      without the GPU compiler (``... compilers --install gpu``), the CPU devices below,
      and the note says so.
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
                f"{name}'s own figures (python -m nnx_sharding compilers --install gpu)"
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
        per_chip = _DEVICES_PER_CHIP.get(generation, 1)
        names = default_tpu_topology(generation, max(n // num_slices // per_chip, 1))
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


def order_devices(devices: Sequence[Any]) -> list[Any]:
    """``devices`` node by node: by slice (TPU multi-slice), then host, then id. A mesh
    filled in this order, row-major, puts its innermost axes inside a node and its
    outermost (``data``) across nodes, as the cost model's node of consecutive devices
    assumes.

    >>> class D:
    ...     def __init__(self, id, host): self.id, self.process_index = id, host
    >>> [d.id for d in order_devices([D(3, 1), D(0, 0), D(2, 1), D(1, 0)])]
    [0, 1, 2, 3]
    """

    def key(d: Any) -> tuple[int, int, int]:
        return (getattr(d, "slice_index", 0) or 0, getattr(d, "process_index", 0), d.id)

    return sorted(devices, key=key)


def mesh_in_order(devices: Sequence[Any], shape: Mapping[str, int]) -> Mesh:
    """A mesh of ``AxisType.Auto`` axes over the first devices node by node
    (`order_devices`), shaped ``shape``: the innermost axes inside a node, which
    ``jax.make_mesh`` would reorder. ``devices`` must hold enough of them."""
    grid = np.array(order_devices(devices)[: math.prod(shape.values())], dtype=object)
    grid = grid.reshape(tuple(shape.values()))
    return Mesh(grid, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))
