"""The kernels of an optimized HLO module, each with the FLOPs and bytes it moves: what
the cost model prices one by one (a sum of per-op rooflines, not a roofline of sums).

An *op* is what a device launches: each instruction of a computation that runs as a
program of its own (the entry, a loop's body and condition, a called computation, a
conditional's branches) except bookkeeping (parameters, tuples, bitcasts, constants,
control flow) and collectives (priced on their link, `nnx_sharding.plan._cost.model`). A
fusion is one op: its FLOPs are the matmuls of the computations it calls, its bytes the
arrays it reads and writes at its call site, where a fused parameter that is only
sliced reads only the slices, and a fused in-place update (``dynamic-update-slice`` of a
parameter) writes only the update: what XLA's own cost analysis counts for the two
forms a scanned layer takes (a layer's weights sliced from the stack, its activations
written into the stack).
"""

from __future__ import annotations

import dataclasses
import re

from .flops import matmul
from .hlo import KINDS, Instr, control, instructions, operands, runs, shape_bytes
from .host import is_transfer

_BOOKKEEPING = frozenset(
    {
        "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
        "conditional", "after-all", "partition-id", "replica-id", "opt-barrier",
        "add-dependency", "domain", "copy-start", "copy-done", "send", "send-done", "recv",
        "recv-done", "async-update", "async-done", "fusion-done",
        "dynamic-slice-start", "dynamic-slice-done", "dynamic-update-slice-start",
        "dynamic-update-slice-done",
    }
)  # fmt: skip
"""Instructions that launch no kernel (or, ``copy-start``/``copy-done`` and the
asynchronous ``dynamic-slice`` and ``dynamic-update-slice``, an asynchronous copy
between memory spaces that overlaps the kernels: host offload's, a layer's saved
activations written to the host's stacked buffer and read back; ``fusion-done``, the
end of a ``fusion-start``, which is the kernel)."""
_COLLECTIVE = frozenset(KINDS) | {f"{k}-start" for k in KINDS} | {f"{k}-done" for k in KINDS}
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_INDEX = re.compile(r"^\s*(\d+)\)")


@dataclasses.dataclass(frozen=True)
class Op:
    """One kernel of the program: ``runs`` times per step, each with ``flops`` matmul
    FLOPs (operands of HLO dtype ``dtype``, ``''`` without a matmul) and ``bytes`` of
    memory read and written; ``computation`` is the program it runs in (the entry, a
    loop's body), the unit the cost model overlaps collectives with."""

    name: str
    opcode: str
    computation: str
    runs: int
    flops: float
    dtype: str
    bytes: float


def ops(text: str) -> list[Op]:
    """Every op of the optimized HLO module ``text`` (see the module's docstring).

    >>> text = '''
    ... ENTRY %main (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {
    ...   %a = f32[8,16]{1,0} parameter(0)
    ...   %b = f32[16,4]{1,0} parameter(1)
    ...   ROOT %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }'''
    >>> [(op.name, op.flops, op.bytes) for op in ops(text)]
    [('d', 1024.0, 896.0)]
    """
    instrs = list(instructions(text))
    times = runs(instrs)
    owner = control(instrs)
    code: dict[str, list[Instr]] = {}
    for ins in instrs:
        code.setdefault(ins.computation, []).append(ins)
    shapes = {(i.computation, i.name): i.shape for i in instrs}
    found = []
    for ins in instrs:
        if owner.get(ins.computation) != ins.computation:  # inside a fusion, a reducer
            continue
        if ins.opcode in _BOOKKEEPING or ins.opcode in _COLLECTIVE or is_transfer(ins):
            continue  # (a host transfer is priced on the host link: `host`)
        called = _called(ins, code)
        flops, dtype = matmul(ins, shapes)
        for inner in called:
            f, d = matmul(inner, shapes)
            if f > flops:
                dtype = d
            flops += f
        if not flops and any(c.opcode in _COLLECTIVE for c in called):
            continue  # a collective's wrapper: priced as comms
        # (a collective fused into a matmul's fusion: the matmul is priced here, the
        # collective as comms)
        moved = _bytes(ins, shapes, code)
        found.append(
            Op(ins.name, ins.opcode, ins.computation, times.get(ins.computation) or 1,
               flops, dtype, moved)
        )  # fmt: skip
    return found


def _called(ins: Instr, code: dict[str, list[Instr]]) -> list[Instr]:
    """The instructions of the computations ``ins`` calls as part of itself (a fusion's,
    an async op's wrapped computation), nested calls included."""
    out: list[Instr] = []
    todo = _CALLS.findall(ins.rest)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for inner in code.get(name, []):
            out.append(inner)
            todo += _CALLS.findall(inner.rest)
    return out


def _bytes(ins: Instr, shapes: dict[tuple[str, str], str], code: dict[str, list[Instr]]) -> float:
    """Bytes ``ins`` reads and writes: each operand and each result once, except that an
    operand only sliced reads the slices, and an in-place update writes the update."""
    names = operands(ins.rest)
    sizes = [sum(shape_bytes(shapes.get((ins.computation, n), ""))) for n in names]
    written = float(sum(shape_bytes(ins.shape)))
    if ins.opcode == "fusion-start":  # ((its operands), its result, a context): the result
        each = shape_bytes(ins.shape)
        operand_arrays = sum(len(shape_bytes(shapes.get((ins.computation, n), ""))) for n in names)
        written = float(sum(each[operand_arrays:-1]))
    if ins.opcode == "custom-call" and "cublas" in ins.rest:  # (result, s8 workspace)
        written = float(shape_bytes(ins.shape)[0])
    if ins.opcode in ("dynamic-slice", "slice", "gather"):
        return 2.0 * written  # reads what it writes (and its indices, negligible)
    if ins.opcode == "dynamic-update-slice" and len(sizes) > 1:
        return 2.0 * sizes[1]  # in place: reads and writes the update
    fused = _CALLS.search(ins.rest) if ins.opcode in ("fusion", "fusion-start") else None
    if fused is None:
        return float(sum(sizes)) + written
    body = code.get(fused.group(1), [])
    params = {int(m.group(1)): p for p in body if p.opcode == "parameter"
              if (m := _INDEX.match(p.rest))}  # fmt: skip
    users: dict[str, list[Instr]] = {}
    for inner in body:
        for name in operands(inner.rest):
            users.setdefault(name, []).append(inner)
    root = next((inner for inner in body if inner.root), body[-1] if body else None)
    written_by, updated = _writes(root, body)
    read = 0.0
    for i, size in enumerate(sizes):
        param = params.get(i)
        if param is None:
            read += size
            continue
        if param.name in updated:  # the buffer an in-place update writes into
            continue
        uses, aliases = _through_bitcasts(param.name, users)
        if uses and all(u.opcode in _SLICING and operands(u.rest)[:1] in aliases for u in uses):
            read += sum(sum(shape_bytes(u.shape)) for u in uses)
        else:
            read += size
    return read + (written if written_by is None else written_by)


def _through_bitcasts(name: str, users: dict[str, list[Instr]]) -> tuple[list[Instr], list]:
    """The users of ``name`` looking through bitcasts and in-place relayouts of it
    (`_relayout`: the TPU compiler relays a saved activation's stack out before slicing
    a layer from it), and ``[name]`` and the names of those, each as a one-element list
    (an operand list's head to compare with)."""
    out, aliases = [], [[name]]
    for u in users.get(name, []):
        if u.opcode == "bitcast" or (_relayout(u) and operands(u.rest)[:1] == [name]):
            more, names = _through_bitcasts(u.name, users)
            out += more
            aliases += names
        else:
            out.append(u)
    return out, aliases


_IN_PLACE = "output_to_operand_aliasing={{}: (0, {})}"


def _relayout(ins: Instr) -> bool:
    """A nested fusion whose result is its first operand's buffer (`_IN_PLACE`: the TPU
    compiler's relayout of a stacked buffer in place): looked through, like a bitcast."""
    return ins.opcode == "fusion" and _IN_PLACE in ins.rest


def _writes(root: Instr | None, body: list[Instr]) -> tuple[float | None, set[str]]:
    """The bytes a fusion writes, where one of its results is an in-place update (a
    ``dynamic-update-slice`` into one of its parameters, through bitcasts and in-place
    nested fusions, alone or in a tuple): the updates' bytes for those, the others'
    full size; and the names of the parameters updated in place. (None, empty) where
    no result is such an update."""
    if root is None:
        return None, set()
    by_name = {i.name: i for i in body}

    def through(ins: Instr | None) -> Instr | None:
        while ins is not None and (ins.opcode == "bitcast" or _relayout(ins)):
            inner = operands(ins.rest)
            ins = by_name.get(inner[0]) if inner else None
        return ins

    results = [root] if root.opcode != "tuple" else [by_name.get(n) for n in operands(root.rest)]
    written, updated = 0.0, set()
    for result in results:
        r = through(result)
        if r is not None and r.opcode == "dynamic-update-slice":
            names = operands(r.rest)
            target = through(by_name.get(names[0])) if names else None
            update = by_name.get(names[1]) if len(names) > 1 else None
            if target is not None and target.opcode == "parameter" and update is not None:
                updated.add(target.name)
                written += sum(shape_bytes(update.shape))
                continue
        written += sum(shape_bytes(result.shape)) if result is not None else 0
    return (written, updated) if updated else (None, set())
