"""Host offload's transfers, read from the optimized HLO: the asynchronous copies between
the device's memory and the host's (memory space 5, ``S(5)`` in a layout).

Offloading remat policies (``save_and_offload_only_these_names``) make the compilers
write each saved activation into a stacked buffer in the host's memory and read it back
for the backward pass: on TPUs ``dynamic-update-slice-start`` and ``dynamic-slice-start``
(or ``copy-start``), on GPUs a ``fusion-start`` around the same update or slice. Each is
one `Transfer` of the device-side array's bytes over the host link, running beside the
kernels of its program (the layer's loop body): `_cost.model` prices it on
`Accelerator.host_bandwidth` and exposes only what the program's kernels cannot hide.
"""

from __future__ import annotations

import dataclasses
import re

from .hlo import Instr, control, instructions, runs

_STARTS = frozenset({"copy-start", "dynamic-slice-start", "dynamic-update-slice-start",
                     "fusion-start"})  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One copy between the device and the host: ``bytes`` each time, ``runs`` times a
    step, beside the kernels of ``computation`` (its program); ``to_host`` its direction."""

    name: str
    computation: str
    runs: int
    bytes: int
    to_host: bool


def is_transfer(ins: Instr) -> bool:
    """Whether ``ins`` starts a copy between the device's memory and the host's."""
    return ins.opcode in _STARTS and "S(5)" in ins.shape


def transfers(text: str) -> list[Transfer]:
    """Every host transfer of the optimized HLO module ``text``.

    >>> text = '''
    ... ENTRY %main (a: bf16[4,8], b: bf16[1,8]) -> bf16[4,8] {
    ...   %a = bf16[4,8]{1,0:S(5)} parameter(0)
    ...   %b = bf16[1,8]{1,0} parameter(1)
    ...   %s = ((bf16[4,8]{1,0:S(5)}, bf16[1,8]{1,0}), bf16[4,8]{1,0:S(5)}, u32[]) \\
    ... dynamic-update-slice-start(%a, %b)
    ...   ROOT %d = bf16[4,8]{1,0:S(5)} dynamic-update-slice-done(%s)
    ... }'''
    >>> [(t.name, t.bytes, t.to_host) for t in transfers(text)]
    [('s', 16, True)]
    """
    instrs = list(instructions(text))
    times = runs(instrs)
    owner = control(instrs)
    found = []
    for ins in instrs:
        if not is_transfer(ins) or owner.get(ins.computation) != ins.computation:
            continue
        arrays = _ARRAY.findall(ins.shape)
        moved = 0
        for dtype, dims, layout in arrays:
            if "S(5)" in (layout or "") or not dims:
                continue  # the host's side, or a scalar: the device's array crosses the link
            count = 1
            for d in dims.split(","):
                count *= int(d)
            moved += count * _BYTES.get(dtype, 4)
        if ins.opcode == "copy-start":  # (destination, source, context)
            to_host = "S(5)" in (arrays[0][2] or "")
        else:
            to_host = "update" in ins.name or ins.opcode == "dynamic-update-slice-start"
        found.append(Transfer(ins.name, ins.computation, times.get(ins.computation) or 1,
                              moved, to_host))  # fmt: skip
    return found
