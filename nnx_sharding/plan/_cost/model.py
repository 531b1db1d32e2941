"""The cost model: per-device memory as the compiler reports it, and a step time
predicted from the optimized program's own kernels and collectives on an `Accelerator`.

- **Kernels.** Each op of the optimized program (a fusion, a GEMM, a copy: `kernels.ops`)
  costs ``max(its matmul FLOPs / (matmul_efficiency · peak FLOP/s of its operands'
  dtype), its bytes / (hbm_efficiency · HBM bandwidth)) + kernel_overhead``, once per
  run (a loop's body once per iteration). ``busy`` is their sum: a sum of per-op
  rooflines, not a roofline of sums. ``compute`` and ``memory`` are the two bounds
  summed on their own.
- **Collectives** cost ``latency + volume / (link_efficiency · bandwidth)`` with
  nccl-tests' ring volumes (all-reduce ``2(n-1)/n``, all-gather, reduce-scatter and
  all-to-all ``(n-1)/n`` of the full array, a collective-permute the array once) over
  the link the group spans (`collective_time`): inside a node, NVLink; a TPU slice is
  one ICI torus whatever its hosts, and a group gets one link per direction along each
  torus axis it spans, two where it spans a whole wrapped axis; a group across nodes
  (GPU hosts, TPU slices) sends its share over the per-device network, hierarchically:
  ``max(in-node ring, across-node ring of (n_nodes-1)/n_nodes over the group's
  per-node devices' network links)``; an all-to-all's across-node share is each
  device's own, ``(n_nodes-1)/n_nodes`` of its buffer to the devices of other nodes
  over its own network link (the experts' dispatch and combine).
- **Overlap.** Tensor parallelism's activations (a group spanning the ``model`` axis,
  but not the compiler's collective matmuls, which it writes as collective-permutes
  interleaved with the matmul's pieces) wait on the next kernel: exposed. The others
  (FSDP's gathers, gradient reductions, data parallelism's all-reduce, collective
  matmuls) overlap with the kernels of the program they run in (one layer's loop body
  per iteration, or the whole step for an unrolled program); what exceeds them is
  exposed, and so are, once per run of the loop, its first collective (a layer's
  gather before any kernel of it can start) and its last (the last layer's gradients).
- ``step = busy + exposed``; ``serial = busy + comms``. ``step_low`` pools the overlap
  over the whole step with no edges and the efficiencies ``spread`` higher;
  ``step_high`` takes them ``spread`` lower.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ... import _errors
from .hlo import Collective
from .host import Transfer
from .kernels import Op


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes of one step: ``state`` (the graph nodes' Variables, from the
    shardings), and from the compiler's ``memory_analysis``: ``arguments`` (all
    inputs), ``outputs``, ``alias`` (outputs written into donated inputs), ``temp``
    (see `_search.compile.temporaries`); ``peak`` = arguments + outputs - alias + temp.
    ``host``: bytes per device the step keeps in the host's memory (activations
    offloaded by the remat policy: the compiler's ``host_temp_size_in_bytes``), not in
    ``peak``.

    >>> Memory(state=8, arguments=8, outputs=8, alias=8, temp=4).peak
    12
    """

    state: int
    arguments: int
    outputs: int
    alias: int
    temp: int
    host: int = 0

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.alias + self.temp


@dataclasses.dataclass(frozen=True)
class Time:
    """Predicted seconds per step (see the module's docstring for the model).

    ``compute``: the kernels' FLOPs at the achievable FLOP/s; ``memory``: their bytes at
    the achievable HBM bandwidth; ``busy``: the sum of each kernel's slower bound (with
    neither given, the slower of the two sums); ``comms``: every collective, serially;
    ``exposed``: the collectives' and host transfers' time not hidden under kernels;
    ``host``: the transfers to and from the host's memory (offloaded activations), on
    the host link, serially; ``step_low`` and ``step_high``: the range the model is sure
    of (``step`` where not given).

    >>> t = Time(compute=1.0, memory=0.5, comms=0.4, exposed=0.1)
    >>> t.busy, t.step, t.serial, t.step_low
    (1.0, 1.1, 1.4, 1.1)
    """

    compute: float
    memory: float
    comms: float
    exposed: float
    busy: float | None = None
    step_low: float | None = None
    step_high: float | None = None
    host: float = 0.0

    def __post_init__(self) -> None:
        if self.busy is None:
            object.__setattr__(self, "busy", max(self.compute, self.memory))
        for name in ("step_low", "step_high"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.step)

    @property
    def step(self) -> float:
        """The predicted step: ``busy + exposed``."""
        return self.busy + self.exposed  # type: ignore[operator]

    @property
    def serial(self) -> float:
        """With no overlap at all: ``busy + comms``."""
        return self.busy + self.comms  # type: ignore[operator]


_FACTOR = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}
_DTYPES = {
    "bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64", "s8": "int8",
    "u8": "int8", "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
    # a boolean mask (a one-hot dispatch) converted inside the matmul's fusion
    "pred": "bfloat16",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where each device of a mesh (by position in the mesh's device order) sits: its
    node (a GPU host; a TPU slice) and, on TPUs, its coordinates in the slice's torus
    and the torus's size per axis."""

    nodes: tuple[int, ...]
    coords: tuple[tuple[int, ...], ...] = ()
    dims: tuple[int, ...] = ()

    def node(self, i: int) -> int:
        """The node of the device at position ``i`` (0 past the devices known)."""
        return self.nodes[i] if i < len(self.nodes) else 0

    @classmethod
    def of(cls, devices: Sequence[Any], per_node: int) -> Topology:
        """TPU devices: nodes by ``slice_index``, every chip of a slice in one node (the
        ICI torus), placed by their ``coords``; others (GPUs, whose compile-only devices
        have ``coords`` too, and CPUs): consecutive runs of ``per_node`` devices.

        >>> Topology.of([None] * 16, 8).nodes[7:9]
        (0, 1)
        """
        tpu = all(getattr(d, "platform", None) == "tpu" for d in devices)
        if devices and tpu and all(getattr(d, "coords", None) is not None for d in devices):
            coords = tuple(tuple(int(c) for c in d.coords) for d in devices)
            nodes = tuple(int(getattr(d, "slice_index", 0) or 0) for d in devices)
            dims = tuple(max(c[a] for c in coords) + 1 for a in range(len(coords[0])))
            return cls(nodes, coords, dims)
        return cls(tuple(i // max(per_node, 1) for i in range(len(devices))))


def spanned_axes(group: Sequence[int], mesh_shape: Mapping[str, int]) -> set[str]:
    """The mesh axes along which the devices of ``group`` (positions in the mesh's
    device order) differ."""
    if not group:
        return set()
    names = list(mesh_shape)
    coords = np.array(np.unravel_index(np.asarray(group), tuple(mesh_shape.values())))
    return {names[a] for a in range(len(names)) if len(set(coords[a].tolist())) > 1}


def crosses_nodes(group: Sequence[int], per_node: int) -> bool:
    """Whether ``group``'s devices sit on more than one node of ``per_node`` devices."""
    return len({i // max(per_node, 1) for i in group}) > 1


def collective_time(
    c: Collective, accelerator: Any, topology: Topology | None = None, efficiency: float = 1.0
) -> float:
    """Seconds for one collective (see the module's docstring): latency + ring volume
    over the link its largest group spans, at ``accelerator.link_efficiency`` (times
    ``efficiency``, for the range). Without ``topology``, nodes of
    ``accelerator.devices_per_node`` consecutive devices.

    >>> from nnx_sharding.plan._hardware.accelerators import PRESETS
    >>> h100 = PRESETS["h100"]
    >>> gather = Collective("all-gather", 8 * 10**9, (tuple(range(8)),), "ag")
    >>> round(collective_time(gather, h100) * 1e3, 1)  # 7/8 of 8 GB at 0.82 x 450 GB/s
    19.0
    """
    if topology is None:
        last = max((i for g in c.groups for i in g), default=0)
        topology = Topology(tuple(i // accelerator.devices_per_node for i in range(last + 1)))
    group = _group(c, topology)
    n = len(group)
    if n <= 1:
        return 0.0
    eff = min(accelerator.link_efficiency * efficiency, 1.0)
    nodes = [topology.node(i) for i in group]
    count = len(set(nodes))
    per_node = max(n // count, 1)
    factor = _FACTOR[c.kind]
    if c.kind == "collective-permute":  # one partner, one link, one way
        if count > 1:
            return accelerator.inter_latency + c.bytes / (accelerator.inter_bandwidth * eff)
        one_way = accelerator.intra_bandwidth / (2 if topology.coords else 1)
        return accelerator.intra_latency + c.bytes / (one_way * eff)
    inside = 0.0
    if per_node > 1:
        local = group[:per_node] if count > 1 else group
        inside = c.bytes * factor(per_node) / (_ring_bandwidth(local, accelerator, topology) * eff)
    if count == 1:
        return accelerator.intra_latency + inside
    if c.kind == "all-to-all":  # every device sends its own share to the other nodes
        across = c.bytes * factor(count) / (accelerator.inter_bandwidth * eff)
    else:
        across = c.bytes * factor(count) / (per_node * accelerator.inter_bandwidth * eff)
    return accelerator.inter_latency + max(inside, across)


def _group(c: Collective, topology: Topology | None = None) -> tuple[int, ...]:
    """The collective's largest group; for a collective-permute, a pair that moves, one
    that crosses nodes of ``topology`` where any does (all pairs send at once: the
    slowest link sets the time, as a pipeline's stages across nodes do)."""
    if c.kind == "collective-permute":
        moving = [g for g in c.groups if len(set(g)) > 1]
        crossing = [g for g in moving if topology and len({topology.node(i) for i in g}) > 1]
        return tuple((crossing or moving or [()])[0])
    return tuple(max(c.groups, key=len, default=()))


def _ring_bandwidth(group: Sequence[int], accelerator: Any, topology: Topology) -> float:
    """Bytes per second a device of ``group`` sends into a ring over its node's fast
    link: NVLink's; on a TPU torus, one link per direction along each axis the group
    spans, two where it spans a whole axis that wraps (a slice whose every axis is a
    multiple of ``accelerator.torus_wrap``: full cubes on v5p, the full pod on v5e)."""
    if not topology.coords:
        return accelerator.intra_bandwidth
    link = accelerator.intra_bandwidth / 2  # one link, one way
    wrap = accelerator.torus_wrap
    torus = wrap > 0 and all(d % wrap == 0 for d in topology.dims if d > 1)
    total = 0.0
    for a, size in enumerate(topology.dims):
        spanned = {topology.coords[i][a] for i in group if i < len(topology.coords)}
        if len(spanned) <= 1:
            continue
        wraps = torus and len(spanned) == size
        total += 2 * link if wraps else link
    return total or link


def critical(c: Collective, mesh_shape: Mapping[str, int]) -> bool:
    """Whether ``c`` waits on the kernels next to it and they on it (tensor parallelism's
    activations): as the program's data flow says (`overlap.hidden`), or, for a
    collective not judged so, a group spanning the ``model`` axis that is not a
    collective-permute.

    >>> tp = Collective("all-reduce", 1024, ((0, 1), (2, 3)), "ar")
    >>> critical(tp, {"data": 2, "model": 2}), critical(tp, {"model": 2, "data": 2})
    (True, False)
    """
    if c.hidden is not None:
        return not c.hidden
    if c.kind == "collective-permute":
        return False
    return "model" in spanned_axes(_group(c), mesh_shape)


@dataclasses.dataclass(frozen=True)
class Program:
    """What the cost model reads from one compiled candidate: its kernels, its
    collectives, its mesh, where its devices sit, and how often each loop is entered;
    `time` prices it on any `Accelerator` (as `Plans.calibrate` does, for fitted ones)."""

    kernels: tuple[Op, ...]
    collectives: tuple[Collective, ...]
    mesh_shape: Mapping[str, int]
    topology: Topology | None = None
    entries: Mapping[str, int] | None = None
    transfers: tuple[Transfer, ...] = ()

    def step(self, accelerator: Any) -> float:
        """The predicted step on ``accelerator`` (`Time.step`, without its range)."""
        e = _estimate(self.kernels, self.collectives, self.mesh_shape, accelerator,
                      self.topology, self.entries, 1.0, self.transfers)  # fmt: skip
        return e[2] + e[4]

    def time(self, accelerator: Any) -> Time:
        """The predicted `Time` on ``accelerator``."""
        return predict(
            self.kernels, self.collectives, self.mesh_shape, accelerator, self.topology,
            self.entries, self.transfers,
        )  # fmt: skip


def predict(
    kernels: Sequence[Op],
    found: Sequence[Collective],
    mesh_shape: Mapping[str, int],
    accelerator: Any,
    topology: Topology | None = None,
    entries: Mapping[str, int] | None = None,
    transfers: Sequence[Transfer] = (),
) -> Time:
    """The predicted `Time` of one step on ``accelerator`` from the program's
    ``kernels`` (`kernels.ops`) and its collectives (`hlo.collectives`, one per run);
    ``entries``: how many times each program (a loop's body) is entered, for the loop's
    first and last collective (default: once); ``transfers``: its copies to and from
    the host (`host.transfers`).

    >>> from nnx_sharding.plan._hardware.accelerators import PRESETS
    >>> gemm = Op("dot", "fusion", "main", 1, 2 * 4096**3, "bf16", 3 * 2 * 4096**2)
    >>> t = predict([gemm], [], {"data": 8}, PRESETS["h100"])
    >>> t.compute == 2 * 4096**3 / (PRESETS["h100"].matmul_efficiency * 989e12)
    True
    """
    args = (kernels, found, mesh_shape, accelerator, topology, entries)
    nominal = _estimate(*args, 1.0, transfers)
    spread = accelerator.spread
    low = _estimate(*args, 1 + spread, transfers)
    high = _estimate(*args, 1 - spread, transfers)
    compute, memory, busy, comms, exposed, _, host = nominal
    return Time(
        compute=compute,
        memory=memory,
        comms=comms,
        exposed=exposed,
        busy=busy,
        step_low=min(low[2] + low[5], busy + exposed),
        step_high=max(high[2] + high[4], busy + exposed),
        host=host,
    )


def _estimate(
    kernels: Sequence[Op],
    found: Sequence[Collective],
    mesh_shape: Mapping[str, int],
    accelerator: Any,
    topology: Topology | None,
    entries: Mapping[str, int] | None,
    scale: float,
    transfers: Sequence[Transfer] = (),
) -> tuple[float, float, float, float, float, float, float]:
    """(compute, memory, busy, comms, exposed per program with edges, exposed pooled
    over the whole step without edges, host transfers), with every efficiency times
    ``scale``. A program's host transfers hide under its kernels as its collectives do
    (another link, the same room: each is held against the kernels on its own)."""
    mm = min(accelerator.matmul_efficiency * scale, 1.0)
    hbm = min(accelerator.hbm_efficiency * scale, 1.0) * accelerator.hbm_bandwidth
    compute = memory = busy = 0.0
    per_program: dict[str, float] = {}
    per_run: dict[tuple[str, str], float] = {}
    for op in kernels:
        flops = op.flops / (
            mm * accelerator.peak_flops(_DTYPES.get(op.dtype, op.dtype or "bfloat16"))
        )
        moved = op.bytes / hbm
        t = (max(flops, moved) + accelerator.kernel_overhead) * op.runs
        compute += flops * op.runs
        memory += moved * op.runs
        busy += t
        per_program[op.computation] = per_program.get(op.computation, 0.0) + t
        per_run[(op.computation, op.name)] = t / max(op.runs, 1)
    comms = exposed_critical = 0.0
    overlapped: dict[str, list[float]] = {}
    priced: dict[tuple[str, int, tuple[tuple[int, ...], ...]], float] = {}
    for c in found:  # a scanned program's collectives repeat: each kind priced once
        key = (c.kind, c.bytes, c.groups)
        seconds = priced.get(key)
        if seconds is None:
            seconds = priced[key] = collective_time(c, accelerator, topology, scale)
        comms += seconds
        if critical(c, mesh_shape):  # less what runs beside it (a collective matmul's)
            room = sum(per_run.get((c.computation, name), 0.0) for name in c.beside)
            exposed_critical += max(0.0, seconds - room)
        else:
            overlapped.setdefault(c.computation, []).append(seconds)
    runs = {op.computation: op.runs for op in kernels}
    exposed = pooled = exposed_critical
    for program, times in overlapped.items():
        total = sum(times)
        entered = max(entries.get(program, 1) if entries else 1, 1)
        each = max(len(times) // max(runs.get(program, 1), 1), 1)  # collectives a run
        edges = (times[0] + (times[each - 1] if each > 1 else 0.0)) * entered
        exposed += min(total, max(0.0, total - per_program.get(program, 0.0)) + edges)
    pooled += max(0.0, sum(sum(t) for t in overlapped.values()) - busy)
    host = 0.0
    if transfers and accelerator.host_bandwidth > 0:
        link = min(accelerator.host_efficiency * scale, 1.0) * accelerator.host_bandwidth
        per: dict[str, float] = {}
        for t in transfers:
            per[t.computation] = per.get(t.computation, 0.0) + t.bytes * t.runs / link
        host = sum(per.values())
        exposed += sum(max(0.0, s - per_program.get(p, 0.0)) for p, s in per.items())
        pooled += max(0.0, host - busy)
    return compute, memory, busy, comms, exposed, pooled, host


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
