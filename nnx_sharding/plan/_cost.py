"""The cost model: per-device memory as the compiler reports it, and a step time
predicted from FLOPs, bytes accessed and collectives on an `Accelerator`.

- ``compute`` = FLOPs / peak FLOP/s (of the parameters' dtype); ``memory`` = bytes
  accessed / HBM bandwidth (a roofline: the slower of the two bounds the step).
- Each collective costs its ring volume over the link its replica group spans (inside
  one node: ``intra_bandwidth``; else ``inter_bandwidth``): all-reduce ``2(n-1)/n``,
  all-gather, reduce-scatter and all-to-all ``(n-1)/n`` of the full array, a
  collective-permute the array once; plus the link's latency, once per collective
  (the alpha-beta model of nccl-tests: time = latency + bytes x factor / bandwidth).
- ``step`` = ``max(compute, memory)`` + exposed comms. Collectives over the ``model``
  axis (tensor parallelism's activations) sit on the critical path and are all
  exposed; the others (gradient reductions, FSDP's gathers) overlap with compute, and
  only what exceeds it is exposed. ``serial`` is the unoverlapped sum
  ``max(compute, memory) + comms``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from .. import _errors
from ._hlo import Collective


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes of one step: ``state`` (the graph nodes' Variables, from the
    shardings), and from the compiler's ``memory_analysis``: ``arguments`` (all
    inputs), ``outputs``, ``alias`` (outputs written into donated inputs), ``temp``;
    ``peak`` = arguments + outputs - alias + temp."""

    state: int
    arguments: int
    outputs: int
    alias: int
    temp: int

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.alias + self.temp


@dataclasses.dataclass(frozen=True)
class Time:
    """Predicted seconds per step (see the module's docstring for the model)."""

    compute: float
    memory: float
    comms: float
    exposed: float

    @property
    def step(self) -> float:
        """The overlapped estimate: ``max(compute, memory) + exposed``."""
        return max(self.compute, self.memory) + self.exposed

    @property
    def serial(self) -> float:
        """The unoverlapped sum: ``max(compute, memory) + comms``."""
        return max(self.compute, self.memory) + self.comms


_FACTOR = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


def spanned_axes(group: Sequence[int], mesh_shape: Mapping[str, int]) -> set[str]:
    """The mesh axes along which the devices of ``group`` (positions in the mesh's
    device order) differ."""
    if not group:
        return set()
    names = list(mesh_shape)
    coords = np.array(np.unravel_index(np.asarray(group), tuple(mesh_shape.values())))
    return {names[a] for a in range(len(names)) if len(set(coords[a].tolist())) > 1}


def collective_time(c: Collective, accelerator, crosses_nodes: bool) -> float:
    """Seconds for one collective: latency + ring volume / bandwidth of the link."""
    n = c.group_size
    if n <= 1:
        return 0.0
    bandwidth = accelerator.inter_bandwidth if crosses_nodes else accelerator.intra_bandwidth
    latency = accelerator.inter_latency if crosses_nodes else accelerator.intra_latency
    return latency + c.bytes * _FACTOR[c.kind](n) / bandwidth


def crosses_nodes(group: Sequence[int], per_node: int) -> bool:
    """Whether ``group``'s devices sit on more than one node of ``per_node`` devices."""
    return len({i // max(per_node, 1) for i in group}) > 1


def predict(
    flops: float,
    bytes_accessed: float,
    found: Sequence[Collective],
    mesh_shape: Mapping[str, int],
    accelerator,
    dtype: str,
) -> Time:
    """The predicted `Time` of one step on ``accelerator``."""
    compute = flops / accelerator.peak_flops(dtype)
    memory = bytes_accessed / accelerator.hbm_bandwidth
    critical = overlappable = 0.0
    for c in found:
        group = max(c.groups, key=len, default=())
        across = crosses_nodes(group, accelerator.devices_per_node)
        seconds = collective_time(c, accelerator, across)
        if "model" in spanned_axes(group, mesh_shape):
            critical += seconds
        else:
            overlappable += seconds
    hidden_by = max(compute, memory)
    exposed = critical + max(0.0, overlappable - hidden_by)
    return Time(compute, memory, critical + overlappable, exposed)


def parse_bytes(text: str | int) -> int:
    """``'80GiB'``, ``'80 GB'``, ``'1.5e9'`` or an int -> bytes.

    >>> parse_bytes('80GiB'), parse_bytes('16 GB'), parse_bytes(1024)
    (85899345920, 16000000000, 1024)
    """
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool) and text > 0:
        return int(text)
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    units |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    if isinstance(text, str):
        s = text.strip().lower().replace(" ", "")
        number = s.rstrip("kmgtib")
        unit = s[len(number) :]
        try:
            value = float(number)
        except ValueError:
            value = -1.0
        if unit in units and value > 0:
            return int(value * units[unit])
    raise ValueError(_errors.plan_bad_memory_limit(text))
