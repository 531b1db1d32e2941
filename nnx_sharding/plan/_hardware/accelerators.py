"""What an accelerator can do, for the planner's cost model: `Accelerator` and its presets.

Every figure is per device, dense (no structured sparsity), from public data sheets; the
sources are listed in ``docs/planning/cost_model.md`` ("Cost model constants"):

========== ========= ========= ========= ========= ================ ================ =====
preset     bf16      fp32      HBM       HBM B/s   in node, 1 way   across nodes     node
           FLOP/s    FLOP/s                        B/s, latency     B/s, latency
========== ========= ========= ========= ========= ================ ================ =====
h100       989e12    67e12     80 GB     3.35e12   450e9, 5 us      50e9, 10 us      8
h200       989e12    67e12     141 GB    4.8e12    450e9, 5 us      50e9, 10 us      8
a100-80gb  312e12    19.5e12   80 GB     2.039e12  300e9, 5 us      25e9, 10 us      8
b200       2.25e15   75e12     180 GB    8e12      900e9, 5 us      50e9, 10 us      8
v5e        197e12    --        16 GB     8.19e11   1e11, 1 us       3.125e9, 10 us   slice
v5p        459e12    --        95 GiB    2.765e12  2e11, 1 us       6.25e9, 10 us    slice
v6e        918e12    --        32000 MiB 1.64e12   2e11, 1 us       3.125e9, 10 us   slice
cpu        (nominal) 1e12      16 GiB    1e11      1e10, 10 us      1e10, 10 us      8
========== ========= ========= ========= ========= ================ ================ =====

The TPU's "in node" figure is two links' worth, one to each neighbour along an axis of
the slice's torus (50 GB/s a link each way on v5e, 100 GB/s on v5p and v6e): a slice
is one torus whatever its hosts, and the cost model counts the links of the axes a
group spans (`nnx_sharding.plan._cost.model`). "Across nodes" is the data-centre network
(DCN) between slices, per chip. Latencies are order-of-magnitude assumptions (NCCL and
ICI hop latencies), not data-sheet figures.

Each preset also says what fraction of those peaks a training step achieves
(`GPU_EFFICIENCY`, `TPU_EFFICIENCY`: matmuls, HBM, links), set from published,
measured runs and public microbenchmarks; `Plans.calibrate` fits them to your own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

from ... import _errors

__all__ = ["PRESETS", "Accelerator", "resolve_accelerator"]

AcceleratorKind = Literal["gpu", "tpu", "cpu"]
DTypeName = str  # a numpy dtype name: "bfloat16", "float32", "int8", ...


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator model, as the planner's cost model sees it (figures per device).

    Attributes:
        name: the preset's name (``"h100"``) or your own.
        kind: ``"gpu"``, ``"tpu"`` or ``"cpu"``: which compiler plans for it.
        flops: peak dense FLOP/s per dtype name (``"bfloat16"``, ``"float32"``, ...).
        hbm_bytes: memory per device, in bytes.
        hbm_bandwidth: memory bandwidth per device, bytes per second.
        intra_bandwidth: bytes per second one device sends into a collective whose
            devices share a node (NVLink; a TPU slice's ICI ring).
        inter_bandwidth: the same across nodes (InfiniBand per GPU; DCN per TPU chip).
        intra_latency: seconds each collective costs before its first byte, in a node.
        inter_latency: the same across nodes.
        devices_per_node: devices that share the fast link (a GPU host). A TPU slice is
            one ICI torus whatever its size: only the chips of other slices are across
            the network; for TPUs this is the chips per host, used for nothing else.
        matmul_efficiency: the fraction of peak FLOP/s a large matmul achieves.
        hbm_efficiency: the fraction of ``hbm_bandwidth`` a large copy achieves.
        link_efficiency: the fraction of a link's bandwidth a large collective achieves
            (its bus bandwidth over the link's).
        kernel_overhead: seconds each kernel costs beyond its roofline (a GPU's launch
            and tail; 0 for TPUs, which run the whole step as one program).
        torus_wrap: TPUs: a slice whose every axis is a multiple of this closes each
            axis into a ring (4 on v4 and v5p: slices of whole 4x4x4 cubes; 16 on v5e
            and v6e: the full 16x16 pod); 0 for none.
        spread: the relative uncertainty of the three efficiencies, which sets the range
            ``Time.step_low``..``Time.step_high``.
        host_bandwidth: bytes per second one device moves to or from its host's memory
            (the host link: PCIe), where offloaded activations go; 0: not known, and
            host transfers are not priced.
        host_efficiency: the fraction of ``host_bandwidth`` an offloaded activation's
            copy achieves.
        host_bytes: the host's memory per device (the host's RAM over its devices),
            which the offloaded activations must fit in; 0: not known, not checked.

    >>> from nnx_sharding.plan._hardware.accelerators import PRESETS
    >>> h100 = PRESETS["h100"]
    >>> h100.peak_flops("bfloat16") / 1e12
    989.0
    >>> mine = dataclasses.replace(h100, name="h100-pcie", hbm_bandwidth=2.0e12)
    >>> mine.hbm_bandwidth
    2000000000000.0
    """

    name: str
    kind: AcceleratorKind
    flops: Mapping[DTypeName, float] = dataclasses.field(hash=False)
    hbm_bytes: int
    hbm_bandwidth: float
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float
    inter_latency: float
    devices_per_node: int
    matmul_efficiency: float = 1.0
    hbm_efficiency: float = 1.0
    link_efficiency: float = 1.0
    kernel_overhead: float = 0.0
    torus_wrap: int = 0
    spread: float = 0.0
    host_bandwidth: float = 0.0
    host_efficiency: float = 1.0
    host_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "tpu", "cpu"):
            raise ValueError(_errors.accelerator_bad_kind(self.kind))
        if not self.flops:
            raise ValueError(_errors.accelerator_no_flops(self.name))
        bad = [k for k, v in self.flops.items() if not (v > 0 and math.isfinite(v))]
        numbers = {
            "hbm_bytes": self.hbm_bytes,
            "hbm_bandwidth": self.hbm_bandwidth,
            "intra_bandwidth": self.intra_bandwidth,
            "inter_bandwidth": self.inter_bandwidth,
            "devices_per_node": self.devices_per_node,
        }
        bad += [k for k, v in numbers.items() if not (v > 0 and math.isfinite(v))]
        fractions = {
            "matmul_efficiency": self.matmul_efficiency,
            "hbm_efficiency": self.hbm_efficiency,
            "link_efficiency": self.link_efficiency,
            "host_efficiency": self.host_efficiency,
        }
        bad += [k for k, v in fractions.items() if not (0 < v <= 1)]
        latencies = {
            "intra_latency": self.intra_latency,
            "inter_latency": self.inter_latency,
            "kernel_overhead": self.kernel_overhead,
            "torus_wrap": self.torus_wrap,
            "host_bandwidth": self.host_bandwidth,
            "host_bytes": self.host_bytes,
        }
        bad += [k for k, v in latencies.items() if not (v >= 0 and math.isfinite(v))]
        bad += [] if 0 <= self.spread < 1 else ["spread"]
        if bad:
            raise ValueError(_errors.accelerator_bad_figures(self.name, bad))
        # A read-only copy: the preset objects are shared by every caller.
        object.__setattr__(self, "flops", _ReadOnlyDict(self.flops))

    def peak_flops(self, dtype: object = "bfloat16") -> float:
        """Peak dense FLOP/s for matmuls in ``dtype`` (a name or anything `numpy.dtype` takes).

        A dtype the table lacks falls back, in order, to: ``float32``'s figure for
        ``float64`` and ``float16``/``bfloat16`` to each other (the same tensor cores),
        then the lowest figure listed (the conservative choice).

        >>> PRESETS["v5e"].peak_flops("float32") == PRESETS["v5e"].peak_flops("bfloat16")
        True
        """
        name = _dtype_name(dtype)
        if name in self.flops:
            return float(self.flops[name])
        for alias in _FALLBACKS.get(name, ()):
            if alias in self.flops:
                return float(self.flops[alias])
        return float(min(self.flops.values()))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes this accelerator to ``path`` as JSON (`load` reads it back): a
        calibrated one (`Plans.calibrate`) is planned with again so.

        >>> import tempfile
        >>> where = os.path.join(tempfile.mkdtemp(), "h100.json")
        >>> PRESETS["h100"].save(where)
        >>> Accelerator.load(where) == PRESETS["h100"]
        True
        """
        data = dataclasses.asdict(self)
        data["flops"] = dict(self.flops)
        with open(path, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Accelerator:
        """The accelerator `save` wrote to ``path``."""
        with open(path) as f:
            data = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class _ReadOnlyDict(dict):
    """A dict that refuses changes (and still copies, pickles and compares as a dict)."""

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError(_errors.accelerator_read_only_flops())

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]
    __ior__ = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[type, tuple[dict[str, float]]]:
        return (_ReadOnlyDict, (dict(self),))


_FALLBACKS: dict[str, tuple[str, ...]] = {
    "float16": ("bfloat16",),
    "bfloat16": ("float16",),
    "float64": ("float32",),
    "float8_e4m3fn": ("int8",),
    "float8_e5m2": ("int8",),
}


def _dtype_name(dtype: object) -> str:
    if isinstance(dtype, str):
        try:
            return np.dtype(dtype).name
        except TypeError:
            import jax.numpy as jnp  # bfloat16 and the float8 types are ml_dtypes'

            try:
                return np.dtype(getattr(jnp, dtype, dtype)).name
            except TypeError:  # a name no dtype has: the lowest figure (see peak_flops)
                return dtype
    return np.dtype(dtype).name  # type: ignore[arg-type]


_GB = 10**9
_GIB = 2**30
_GPU_HOST = (64e9, 250 * _GB)
"""A GPU's host link and host memory: PCIe Gen5 x16 one way; a DGX's 2 TB over 8 GPUs."""


#: Achievable fractions of peak on NVIDIA GPUs (sources in docs/planning/cost_model.md,
#: "Cost model constants"). Matmuls: what a training step's GEMMs and flash attention
#: sustain, set from the 8xH100 calibration run (MaxText llama2-7b, 492 TFLOP/s of model
#: FLOPs per GPU; the prediction against it: docs/planning/predictions.md); public
#: benchmarks put large random bf16 GEMMs alone higher (about 83 % of peak on A100, less
#: on the power-limited H100). HBM: copy and STREAM benchmarks reach 3.0-3.1 of the
#: H100's 3.35 TB/s. Links: nccl-tests' all-reduce bus bandwidth on 8 H100s, about 370 of
#: 450 GB/s. A kernel's launch and tail: a few microseconds without CUDA graphs.
GPU_EFFICIENCY: dict[str, Any] = dict(
    matmul_efficiency=0.6,
    hbm_efficiency=0.9,
    link_efficiency=0.82,
    kernel_overhead=2e-6,
    spread=0.1,
)
#: The same for TPUs. Matmuls: set from the v5p-128 calibration run (MaxText 32B, 328
#: TFLOP/s of model FLOPs per chip; the prediction against it, as for the GPUs); the MXUs
#: of v5e and v6e are taken to sustain the same fraction. HBM as the GPUs'; ICI links 0.9
#: (the calibration run hides its collectives: it cannot set this figure).
TPU_EFFICIENCY: dict[str, Any] = dict(
    matmul_efficiency=0.8,
    hbm_efficiency=0.9,
    link_efficiency=0.9,
    kernel_overhead=0.0,
    spread=0.1,
)


def _gpu(name: str, bf16: float, fp32: float, hbm: int, hbm_bw: float, nvlink: float, ib: float,
         host: tuple[float, int]):  # fmt: skip
    flops = {"bfloat16": bf16, "float16": bf16, "float32": fp32, "int8": 2 * bf16}
    if name in ("h100", "h200", "b200"):
        flops["float8_e4m3fn"] = flops["float8_e5m2"] = 2 * bf16
    return Accelerator(
        name=name,
        kind="gpu",
        flops=flops,
        hbm_bytes=hbm,
        hbm_bandwidth=hbm_bw,
        intra_bandwidth=nvlink,
        inter_bandwidth=ib,
        intra_latency=5e-6,
        inter_latency=10e-6,
        devices_per_node=8,
        host_bandwidth=host[0],
        host_bytes=host[1],
        **GPU_EFFICIENCY,
    )


def _tpu(
    name: str,
    bf16: float,
    hbm: int,
    hbm_bw: float,
    ici: float,
    dcn: float,
    per_host: int,
    wrap: int,
    host: tuple[float, int],
):
    return Accelerator(
        name=name,
        kind="tpu",
        # The MXU takes bf16 operands; float32 matmuls run as bf16 passes at best.
        flops={"bfloat16": bf16, "float32": bf16, "int8": 2 * bf16},
        hbm_bytes=hbm,
        hbm_bandwidth=hbm_bw,
        intra_bandwidth=ici,
        inter_bandwidth=dcn,
        intra_latency=1e-6,
        inter_latency=10e-6,
        devices_per_node=per_host,
        torus_wrap=wrap,
        host_bandwidth=host[0],
        host_bytes=host[1],
        **TPU_EFFICIENCY,
    )


#: The presets by name; `resolve_accelerator` also takes a few aliases and TPU topologies.
PRESETS: Mapping[str, Accelerator] = MappingProxyType(
    {
        # NVIDIA H100 SXM5 data sheet: 989 TFLOP/s bf16 dense (1,979 is with sparsity),
        # 67 TFLOP/s fp32, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s both ways; one
        # 400 Gb/s InfiniBand NIC per GPU across nodes (DGX H100).
        # Host link: PCIe Gen5 x16, 128 GB/s both ways (64e9 one way); host memory: a
        # DGX H100's 2 TB over its 8 GPUs (Google Cloud's a3-highgpu-8g: 1,872 GB).
        "h100": _gpu("h100", 989e12, 67e12, 80 * _GB, 3.35e12, 450e9, 50e9, _GPU_HOST),
        # NVIDIA H200 SXM: the H100's compute, 141 GB HBM3e at 4.8 TB/s; the H100's
        # host link (PCIe Gen5 x16) and a DGX H200's 2 TB of host memory.
        "h200": _gpu("h200", 989e12, 67e12, 141 * _GB, 4.8e12, 450e9, 50e9, _GPU_HOST),
        # NVIDIA A100 SXM4 80GB: 312 TFLOP/s bf16, 19.5 fp32, 2,039 GB/s, NVLink 3
        # 600 GB/s both ways; 200 Gb/s HDR InfiniBand per GPU (DGX A100).
        # PCIe Gen4 x16 (64 GB/s both ways); a DGX A100's 2 TB of host memory.
        "a100-80gb": _gpu(
            "a100-80gb", 312e12, 19.5e12, 80 * _GB, 2.039e12, 300e9, 25e9, (32e9, 250 * _GB)
        ),  # fmt: skip
        # NVIDIA HGX B200: 2.25 PFLOP/s bf16 dense per GPU (18 PFLOP/s fp8 sparse per
        # 8), 75 TFLOP/s fp32, 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s both ways;
        # 400 Gb/s ConnectX-7 per GPU (DGX B200).
        # PCIe Gen5 x16 to the host; a DGX B200's 2 TB of host memory (4 TB optional).
        "b200": _gpu("b200", 2.25e15, 75e12, 180 * _GB, 8e12, 900e9, 50e9, _GPU_HOST),
        # Google Cloud TPU v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, 2-D torus;
        # ICI 1,600 Gb/s per chip over 4 links (5e10 B/s per link one way); 8 per host.
        # Host link: the JAX scaling book's 1.6e10 B/s of PCIe per chip; host memory: the
        # ct5lp-hightpu-4t machine's 192 GB over its 4 chips.
        "v5e": _tpu(
            "v5e", 197e12, 16 * _GB, 8.19e11, 2 * 5e10, 2.5e10 / 8, 8, 16, (1.6e10, 48 * _GB)
        ),  # fmt: skip
        # TPU v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2,575 GiB/s, 3-D torus, ICI
        # 1,200 GB/s per chip both ways over 6 links (1e11 per link one way), DCN 50 Gb/s
        # per chip; 4 chips per host.
        # Host link: the scaling book's 1.6e10 B/s of PCIe per
        # chip; host memory: 448 GB per 4-chip host (Google Cloud's TPU7x page's table).
        "v5p": _tpu(
            "v5p", 459e12, 95 * _GIB, 2.765e12, 2 * 1e11, 6.25e9, 4, 4, (1.6e10, 112 * _GB)
        ),  # fmt: skip
        # TPU v6e (Trillium), Google Cloud's v6e page: 918 TFLOP/s bf16, 32 GB HBM at
        # 1,638 GB/s, 2-D torus, ICI 800 GB/s per chip both ways over 4 links (1e11 per
        # link one way), DCN 100 Gb/s per chip; 8 chips per host (or 4). Its memory is
        # what the TPU compiler lets a program use ("exceeds available HBM (31.25G)"),
        # 31.25 GiB. Host link: PCIe Gen5, the scaling book's 3.2e10 B/s per chip; host
        # memory: the ct6e-standard-4t machine's 720 GB over its 4 chips.
        "v6e": _tpu(
            "v6e", 918e12, int(31.25 * _GIB), 1.638e12, 2 * 1e11, 12.5e9, 8, 16, (3.2e10, 180 * _GB)
        ),  # fmt: skip
        # TPU7x (Ironwood), Google Cloud's TPU7x page, per chip: 2,307 TFLOP/s bf16, 192 GB
        # HBM at 7,380 GB/s, 3-D torus, ICI 1,200 GB/s both ways (6 links: 1e11 one
        # way each), DCN 100 Gb/s; 4 chips and 960 GB per host. jax sees each chip as
        # two devices (its two TensorCores), so every figure here is half the chip's.
        # Its PCIe link is not published: v6e's 3.2e10 per chip, shared by its two.
        "tpu7x": _tpu(
            "tpu7x", 2307e12 / 2, 96 * _GB, 3.69e12, 1e11, 6.25e9, 8, 4, (1.6e10, 120 * _GB)
        ),  # fmt: skip
        # A nominal CPU device, for plans compiled on simulated CPU devices: the figures
        # only rank candidates; they describe no particular machine.
        "cpu": Accelerator(
            name="cpu",
            kind="cpu",
            flops={"float32": 1e12, "bfloat16": 1e12},
            hbm_bytes=16 * _GIB,
            hbm_bandwidth=1e11,
            intra_bandwidth=1e10,
            inter_bandwidth=1e10,
            intra_latency=10e-6,
            inter_latency=10e-6,
            devices_per_node=8,
        ),
    }
)

_ALIASES = {
    "h100-sxm": "h100",
    "h100-80gb": "h100",
    "h200-sxm": "h200",
    "a100": "a100-80gb",
    "a100-sxm-80gb": "a100-80gb",
    "v5litepod": "v5e",
    "v5lite": "v5e",
    "trillium": "v6e",
    "ironwood": "tpu7x",
    "tpu-v5e": "v5e",
    "tpu-v5p": "v5p",
    "tpu-v6e": "v6e",
}


def resolve_accelerator(spec: str | Accelerator) -> tuple[Accelerator, str | None]:
    """The `Accelerator` a name stands for, and the TPU topology it names (or None).

    ``spec``: an `Accelerator` (returned as is), a preset name (case-insensitive, a few
    aliases such as ``"a100"`` or ``"trillium"``), or a TPU topology as
    ``jax.experimental.topologies.get_topology_desc`` takes it: ``"v5e:16x16"``,
    ``"v5p:4x4x4"``, ``"v6e:8x8"``.

    Raises:
        ValueError: an unknown name (the message lists the presets), or a topology
            given for a GPU or CPU preset, or a topology that is not ``AxB[xC]``.

    >>> accelerator, topology = resolve_accelerator("v5e:16x16")
    >>> accelerator.name, topology
    ('v5e', 'v5e:16x16')
    >>> resolve_accelerator("H100")[0].name
    'h100'
    """
    if isinstance(spec, Accelerator):
        return spec, None
    if not isinstance(spec, str):
        raise TypeError(_errors.plan_bad_accelerator_type(spec))
    text = spec.strip().lower()
    name, _, shape = text.partition(":")
    name = _ALIASES.get(name, name)
    if name not in PRESETS:
        raise ValueError(_errors.plan_unknown_accelerator(spec, sorted(PRESETS), sorted(_ALIASES)))
    accelerator = PRESETS[name]
    if not shape:
        return accelerator, None
    dims = shape.split("x")
    if accelerator.kind != "tpu" or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(_errors.plan_bad_topology(spec, accelerator.kind))
    return accelerator, f"{name}:{shape}"
