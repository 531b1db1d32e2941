"""The collectives of an optimized HLO module, read from its text.

Every collective instruction is found (async ``-start`` forms and tuple-shaped ones
included), with the bytes it moves and the devices of each of its replica groups.
What a compiler writes in another form is counted as what it runs: the CPU compiler's
reduce-scatter (an all-reduce whose every user takes a slice at an offset computed from
``partition-id``) and the TPU compiler's (an ``all-reduce-scatter`` fusion around an
all-reduce) both count as ``reduce-scatter``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import TypeAlias

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""The collective kinds, named as in HLO."""

_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OPCODES = {k: k for k in KINDS} | {f"{k}-start": k for k in KINDS}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the program: its kind, the full size in bytes of the array(s)
    it reduces or gathers (before any ring factor), and its replica groups (device
    positions in the mesh's device order; for a collective-permute, the pairs)."""

    kind: str
    bytes: int
    groups: tuple[tuple[int, ...], ...]
    name: str

    @property
    def group_size(self) -> int:
        """Devices per group (2 for a collective-permute's pairs)."""
        return max((len(g) for g in self.groups), default=1)


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    rest: str
    computation: str


def shape_bytes(shape: str) -> list[int]:
    """The bytes of each array in an HLO shape: ``f32[4,8]`` -> ``[128]``; a tuple -> each."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(size * _DTYPE_BYTES[dtype])
    return out


def _instructions(text: str) -> Iterator[_Instr]:
    computation = ""
    for line in text.splitlines():
        if line.rstrip().endswith("{") and "=" not in line.split("(")[0]:
            m = _COMPUTATION.match(line)
            computation = m.group(1) if m else computation
            continue
        m = _INSTRUCTION.match(line)
        if m:
            yield _Instr(m.group(1), m.group(2), m.group(3), m.group(4), computation)


def _operands(rest: str) -> list[str]:
    """The names of an instruction's operands (``%x`` inside its parentheses)."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _brace_block(text: str, start: int) -> str:
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "{"
        depth -= text[i] == "}"
        if depth == 0:
            return text[start : i + 1]
    return text[start:]


def replica_groups(rest: str, devices: int) -> tuple[tuple[int, ...], ...]:
    """The replica groups of an instruction, in any of HLO's three forms: explicit
    ``{{0,1},{2,3}}``, iota ``[2,2]<=[2,2]T(1,0)``, or ``mesh['axis_0'=2,...] {'axis_1'}``.
    None given (``{}``) means one group of every device."""
    if "source_target_pairs=" in rest:
        start = rest.index("source_target_pairs=") + len("source_target_pairs=")
        pairs = re.findall(r"\{(\d+),(\d+)\}", _brace_block(rest, start))
        return tuple((int(a), int(b)) for a, b in pairs)
    if "replica_groups=" not in rest:
        return (tuple(range(devices)),)
    text = rest[rest.index("replica_groups=") + len("replica_groups=") :]
    if text.startswith("mesh["):
        sizes = [int(s) for s in re.findall(r"'[^']*'=(\d+)", text[: text.index("]")])]
        names = re.findall(r"'([^']*)'=", text[: text.index("]")])
        spanned = re.findall(r"'([^']*)'", text[text.index("]") + 1 : text.index("}") + 1])
        ids = np.arange(math.prod(sizes)).reshape(sizes)
        axes = [names.index(s) for s in spanned if s in names]
        kept = [a for a in range(len(sizes)) if a not in axes]
        ids = ids.transpose(kept + axes).reshape(-1, math.prod(sizes[a] for a in axes))
        return tuple(tuple(int(i) for i in g) for g in ids)
    if text.startswith("["):
        m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        if m:
            shape = [int(s) for s in m.group(1).split(",")]
            dims = [int(s) for s in m.group(2).split(",")]
            ids = np.arange(math.prod(dims)).reshape(dims)
            if m.group(3):
                ids = ids.transpose([int(s) for s in m.group(3).split(",")])
            ids = ids.reshape(shape[0], -1)
            return tuple(tuple(int(i) for i in g) for g in ids)
    if text.startswith("{"):
        block = _brace_block(text, 0)
        groups = re.findall(r"\{([\d,\s]*)\}", block[1:-1])
        found = tuple(tuple(int(i) for i in g.split(",") if i.strip()) for g in groups)
        if found and any(found):
            return found
    return (tuple(range(devices)),)


def collectives(text: str, devices: int) -> list[Collective]:
    """Every collective of the optimized HLO module ``text`` of a program on ``devices``.

    Tuple-shaped collectives count each array of the tuple; an async pair counts once
    (its ``-start``); an all-reduce the program only slices, per device, counts as
    a reduce-scatter (see the module's docstring).
    """
    instrs = list(_instructions(text))
    users: dict[tuple[str, str], list[_Instr]] = {}
    by_name: dict[tuple[str, str], _Instr] = {}
    for ins in instrs:
        by_name[(ins.computation, ins.name)] = ins
        for op in _operands(ins.rest):
            users.setdefault((ins.computation, op), []).append(ins)
    pid = _partition_scalars(instrs)
    # computations that a fusion named all-reduce-scatter calls (the TPU compiler's form)
    scatter_calls = {
        c
        for ins in instrs
        if ins.opcode == "fusion" and "all-reduce-scatter" in ins.name
        for c in re.findall(r"calls=%?([\w.\-]+)", ins.rest)
    }
    found: list[Collective] = []
    for ins in instrs:
        kind = _OPCODES.get(ins.opcode)
        if kind is None:
            continue
        groups = replica_groups(ins.rest, devices)
        sizes = _sizes(ins, kind, by_name)
        if kind == "all-reduce" and ins.computation in scatter_calls:
            found += [Collective("reduce-scatter", b, groups, ins.name) for b in sizes]
            continue
        if kind == "all-reduce":
            elements = _elements(ins, users, len(sizes))
            for size, element_users in zip(sizes, elements, strict=True):
                sliced = bool(element_users) and all(_slices(u, size, pid) for u in element_users)
                found.append(
                    Collective("reduce-scatter" if sliced else "all-reduce", size, groups, ins.name)
                )
            continue
        found += [Collective(kind, b, groups, ins.name) for b in sizes]
    return found


def _sizes(ins: _Instr, kind: str, by_name: dict[tuple[str, str], _Instr]) -> list[int]:
    """Full array bytes: the result for all-reduce and all-gather (gathered), the
    operands for reduce-scatter, all-to-all and collective-permute."""
    if kind in ("all-reduce", "all-gather"):
        sizes = shape_bytes(ins.shape)
        if ins.opcode.endswith("-start") and kind == "all-gather":
            # (operands, results) tuple of an async all-gather: the results half
            sizes = sizes[len(sizes) // 2 :]
        return sizes
    operands = [by_name.get((ins.computation, op)) for op in _operands(ins.rest)]
    sizes = [b for op in operands if op is not None for b in shape_bytes(op.shape)]
    return sizes or shape_bytes(ins.shape)


Users: TypeAlias = dict[tuple[str, str], list[_Instr]]


def _elements(ins: _Instr, users: Users, n: int) -> list[list[_Instr]]:
    """The users of each array of an all-reduce's result (through get-tuple-element)."""
    direct = users.get((ins.computation, ins.name), [])
    if n == 1 and not all(u.opcode == "get-tuple-element" for u in direct):
        return [[u for u in direct if not u.opcode.endswith("-done")] + _done_users(ins, users)]
    out: list[list[_Instr]] = [[] for _ in range(n)]
    for u in direct:
        m = re.search(r"index=(\d+)", u.rest)
        if u.opcode == "get-tuple-element" and m and int(m.group(1)) < n:
            out[int(m.group(1))] += users.get((u.computation, u.name), [])
    return out


def _done_users(ins: _Instr, users: Users) -> list[_Instr]:
    done = [u for u in users.get((ins.computation, ins.name), []) if u.opcode.endswith("-done")]
    return [x for d in done for x in users.get((d.computation, d.name), [])]


def _partition_scalars(instrs: list[_Instr]) -> set[tuple[str, str]]:
    """Scalars computed from ``partition-id`` (the offsets of per-device slices)."""
    derived: set[tuple[str, str]] = set()
    for ins in instrs:  # HLO text lists operands before their users
        key = (ins.computation, ins.name)
        if ins.opcode in ("partition-id", "replica-id"):
            derived.add(key)
        elif shape_bytes(ins.shape) and max(shape_bytes(ins.shape)) <= 8:
            if any((ins.computation, op) in derived for op in _operands(ins.rest)):
                derived.add(key)
    return derived


def _slices(user: _Instr, size: int, pid: set[tuple[str, str]]) -> bool:
    """Whether ``user`` keeps only a per-device slice of an array of ``size`` bytes."""
    out = shape_bytes(user.shape)
    if not out or sum(out) >= size:
        return False
    return any((user.computation, op) in pid for op in _operands(user.rest))


def dot_flops(text: str) -> float:
    """FLOPs of the matmuls of an optimized HLO module: ``2 · result elements ·
    contracted size`` for each ``dot`` (fused ones included) and each cuBLAS GEMM
    custom call. What a compiler without ``cost_analysis`` (the GPU's) is counted by."""
    instrs = list(_instructions(text))
    shapes = {(i.computation, i.name): i.shape for i in instrs}
    total = 0.0
    for ins in instrs:
        if ins.opcode == "dot":
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
        elif ins.opcode == "custom-call" and re.search(r"gemm|matmul", ins.rest):
            m = re.search(r'"lhs_contracting_dimensions":\[([\d",]*)\]', ins.rest)
        else:
            continue
        operands = _operands(ins.rest)
        inline = _ARRAY.findall(ins.rest.split("%", 1)[0])
        if operands and (ins.computation, operands[0]) in shapes:
            lhs = _ARRAY.findall(shapes[(ins.computation, operands[0])])
        else:
            lhs = inline
        result = _ARRAY.findall(ins.shape)
        if not (m and lhs and result):
            continue
        dims = [int(d) for d in lhs[0][1].split(",") if d]
        contracted = [int(c.strip('"')) for c in m.group(1).split(",") if c.strip('"')]
        out = [int(d) for d in result[0][1].split(",") if d]
        total += 2.0 * math.prod(out) * math.prod(dims[c] for c in contracted if c < len(dims))
    return total


def summary(found: list[Collective]) -> dict[str, int]:
    """Bytes per kind, every kind present (0 where none)."""
    totals = dict.fromkeys(KINDS, 0)
    for c in found:
        totals[c.kind] += c.bytes
    return totals
