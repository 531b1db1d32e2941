"""The FLOPs of an optimized HLO module's matmuls, counted from its text: what a
compiler without ``cost_analysis`` (the GPU's) is costed by, and what a loop's further
iterations add to the ``cost_analysis`` of one that has it."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from .hlo import ARRAY, Instr, instructions, operands, runs

_WINDOW = re.compile(r"window=\{([^}]*)\}")


def dot_flops(text: str, *, per_iteration: bool = True) -> float:
    """FLOPs of the matmuls of an optimized HLO module: ``2 · result elements ·
    contracted size`` for each ``dot`` (fused ones included) and each cuBLAS GEMM custom
    call, and for each ``convolution`` (the TPU compiler writes matmuls so) its
    multiply-adds as XLA counts them (`conv_flops`); a loop's once per iteration
    (``per_iteration=False``: once, as ``cost_analysis`` counts them)."""
    instrs = list(instructions(text))
    times = runs(instrs) if per_iteration else {}
    shapes = {(i.computation, i.name): i.shape for i in instrs}
    total = 0.0
    for ins in instrs:
        flops, _ = matmul(ins, shapes)
        total += flops * (times.get(ins.computation) or 1)
    return total


def matmul(ins: Instr, shapes: dict[tuple[str, str], str]) -> tuple[float, str]:
    """The FLOPs of one instruction's matmul (0.0 for anything else) and the HLO dtype
    of its left operand (``'bf16'``: what sets the matmul's rate); ``shapes`` maps
    (computation, name) to each instruction's result shape.

    >>> from nnx_sharding.plan._cost.hlo import Instr
    >>> dot = Instr("d", "f32[8,32]{1,0}", "dot",
    ...             "bf16[8,16]{1,0} %a, bf16[16,32]{1,0} %b), lhs_contracting_dims={1}", "c")
    >>> matmul(dot, {})
    (8192.0, 'bf16')
    """
    if ins.opcode not in ("dot", "convolution", "custom-call"):
        return 0.0, ""
    names = operands(ins.rest)
    inline = ARRAY.findall(ins.rest.split("%", 1)[0])
    first = ARRAY.findall(shapes.get((ins.computation, names[0]), "")) if names else []
    lhs = first or inline
    dims = [int(d) for d in lhs[0][1].split(",") if d] if lhs else []
    result = ARRAY.findall(ins.shape)
    if not (dims and result):
        return 0.0, ""
    out = [int(d) for d in result[0][1].split(",") if d]
    if ins.opcode == "convolution":
        flops = conv_flops(ins, dims, out)
    else:
        flops = 2.0 * math.prod(out) * _contracted(ins, dims)
    if not flops and ins.opcode == "custom-call":
        return kernel_flops(ins, shapes)
    return flops, (lhs[0][0] if flops else "")


_ATTENTION = re.compile(r"attention|flash|mha|fmha", re.IGNORECASE)
_BACKWARD = re.compile(r"bwd|backward|_dq|_dkv|grad", re.IGNORECASE)
_KERNEL_NAME = re.compile(r'\bname = "([\w.\-]+)"|"kernel_name":\s*"([\w.\-]+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_COST = re.compile(r'"cost_estimate":\{"flops":"?(\d+)')


def kernel_flops(ins: Instr, shapes: dict[tuple[str, str], str]) -> tuple[float, str]:
    """The matmul FLOPs of a custom kernel (a fused attention, a Pallas kernel), which
    the HLO does not spell out, and its operands' dtype.

    - An attention kernel (its target or name says attention, flash, mha or fmha): its
      q, k and v are its first three floating-point operands of rank 3 or more with one
      head dimension (last), k and v of one shape, q of k's but perhaps for the
      sequence (splash takes mask tables first; under context parallelism a device's
      queries meet the whole sequence's keys). Its FLOPs are ``units · 2 · (q's
      elements) · Sk``: 2 units for the forward pass (``QKᵀ`` and ``PV``); for a
      backward kernel (a name saying bwd, backward, dq or dkv) 5 when it returns dq, dk
      and dv, 4 for dk and dv, 3 for dq (each recomputes ``QKᵀ``, as flash attention
      does); halved, causal, as decoders train: their kernels skip the blocks above the
      diagonal, and under context parallelism the load-balanced layout gives each device
      half its queries' blocks.
    - Else the FLOPs of the kernel's own cost estimate (Pallas TPU kernels carry one in
      their backend config), or 0.0.
    """
    names = operands(ins.rest)
    arrays = [ARRAY.findall(shapes.get((ins.computation, n), "")) for n in names]
    target = _TARGET.search(ins.rest)
    kernel = _KERNEL_NAME.search(ins.rest)
    label = " ".join(
        [
            ins.name,
            target.group(1) if target else "",
            kernel.group(kernel.lastindex or 0) if kernel else "",
        ]
    )
    if _ATTENTION.search(label):
        found = _attention_flops(ins, [a[0] for a in arrays if a], _BACKWARD.search(label))
        if found is not None:
            return found
    cost = _COST.search(ins.rest)
    if cost:
        first = arrays[0][0][0] if arrays and arrays[0] else ""
        return float(cost.group(1)), first
    return 0.0, ""


_FLOAT = ("bf16", "f16", "f32", "f8e4m3fn", "f8e5m2")


def _attention_flops(
    ins: Instr, arrays: list[tuple[str, str]], backward: Any
) -> tuple[float, str] | None:
    """`kernel_flops` of an attention kernel whose operands (dtype, dims) are
    ``arrays``; None when its q, k and v are not found."""
    dims = [[int(d) for d in a[1].split(",") if d] for a in arrays]
    floats = [a[0] in _FLOAT and len(d) >= 3 for a, d in zip(arrays, dims, strict=True)]
    qkv = [i for i, yes in enumerate(floats) if yes]
    if len(qkv) < 3:
        return None
    q, k, v = (dims[i] for i in qkv[:3])
    if k != v or len(q) != len(k) or q[:-3] != k[:-3] or q[-1] != k[-1]:
        return None
    # before the head dimension, (S, H) or (H, S): the keys' sequence is the axis where
    # k is longer (context parallelism), the other one where q is (grouped-query heads)
    if q == k:
        keys = max(k[-2], k[-3])
    elif k[-2] > q[-2] or k[-3] > q[-3]:
        keys = k[-2] if k[-2] > q[-2] else k[-3]
    else:
        keys = k[-3] if k[-2] < q[-2] else k[-2]
    if backward:
        like = (arrays[qkv[0]], arrays[qkv[1]])  # q's or k's dtype and shape
        grads = sum(1 for a in ARRAY.findall(ins.shape) if a in like)
        units = {3: 5, 2: 4, 1: 3}.get(grads, 0)
    else:
        units = 2
    return units * 2.0 * math.prod(q) * keys * 0.5, arrays[qkv[0]][0]


def _contracted(ins: Instr, lhs: list[int]) -> int:
    """The size a ``dot`` or GEMM call sums over per result element (0: neither)."""
    if ins.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
    elif ins.opcode == "custom-call" and re.search(r"gemm|matmul", ins.rest):
        m = re.search(r'"lhs_contracting_dimensions":\[([\d",]*)\]', ins.rest)
    else:
        return 0
    if not m:
        return 0
    axes = [int(c.strip('"')) for c in m.group(1).split(",") if c.strip('"')]
    return math.prod(lhs[c] for c in axes if c < len(lhs))


def conv_flops(ins: Instr, lhs: list[int], out: list[int]) -> float:
    """``2 ×`` the multiply-adds of a ``convolution``, as XLA's cost analysis counts
    them: per result batch and feature, the input features of its group times, in each
    spatial dimension, the (result position, window position) pairs that land on an
    input element (not on padding, nor between dilated elements). The TPU compiler
    writes batched matmuls so, with a batch as a spatial dimension. 0 if unreadable."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.rest)
    if not labels or len(labels.group(1)) != len(lhs) or len(labels.group(3)) != len(out):
        return 0.0
    lhs_labels, out_labels = labels.group(1), labels.group(3)
    spatial = sorted(ch for ch in lhs_labels if ch.isdigit())
    groups = re.search(r"feature_group_count=(\d+)", ins.rest)
    fma = out[out_labels.index("b")] * out[out_labels.index("f")]
    fma *= lhs[lhs_labels.index("f")] // (int(groups.group(1)) if groups else 1)
    window = _window(ins.rest, len(spatial))
    for i, ch in enumerate(spatial):
        size, stride, (low, _), lhs_dilate, rhs_dilate = (field[i] for field in window)
        fma *= _pairs(lhs[lhs_labels.index(ch)], out[out_labels.index(ch)], size, stride, low,
                      lhs_dilate, rhs_dilate)  # fmt: skip
    return 2.0 * fma


def _window(rest: str, n: int) -> list[list[Any]]:
    """A convolution's window, per spatial dimension: size, stride, (low, high) padding,
    lhs dilation, rhs dilation (XLA's defaults where the text leaves one out)."""
    found = _WINDOW.search(rest)
    fields = dict(f.split("=", 1) for f in found.group(1).split()) if found else {}

    def ints(name: str, default: int) -> list[int]:
        text = fields.get(name)
        return [int(x) for x in text.split("x")] if text else [default] * n

    pads = fields.get("pad")
    pad = [tuple(int(v) for v in p.split("_")) for p in pads.split("x")] if pads else [(0, 0)] * n
    return [ints("size", 1), ints("stride", 1), pad, ints("lhs_dilate", 1), ints("rhs_dilate", 1)]


def _pairs(
    size_in: int,
    size_out: int,
    window: int,
    stride: int,
    low: int,
    lhs_dilate: int,
    rhs_dilate: int,
) -> int:
    """How many (result position, window position) pairs of one spatial dimension read
    an input element."""
    at = np.arange(size_out)[:, None] * stride + np.arange(window)[None, :] * rhs_dilate - low
    hit = (at >= 0) & (at <= (size_in - 1) * lhs_dilate) & (at % lhs_dilate == 0)
    return int(hit.sum())
