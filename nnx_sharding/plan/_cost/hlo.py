"""The collectives of an optimized HLO module, read from its text.

Every collective instruction is found (async ``-start`` forms and tuple-shaped ones
included), with the bytes it moves and the devices of each of its replica groups.
What a compiler writes in another form is counted as what it runs: the CPU compiler's
reduce-scatter (an all-reduce whose every user takes a slice at an offset computed from
``partition-id``) and the TPU compiler's (an ``all-reduce-scatter`` fusion around an
all-reduce) both count as ``reduce-scatter``.

A loop's body runs once per iteration: a collective or a matmul inside a ``while``
(``jax.lax.scan``, ``nnx.scan``, ``fori_loop``) counts its loop's trip count times
(`trip_count`), nested loops the product of theirs.

The TPU compiler splits one collective into a chain of fusions that repeat its
instruction (same ``channel_id``): an ``async-collective-start`` fusion, continuations
(``async_collective_fusion``, often sunk into a later loop to overlap it, where they
would otherwise count once per iteration) and an ``async-collective-done``. The chain is
one collective, counted where it starts.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator
from typing import TypeAlias

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""The collective kinds, named as in HLO."""

_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OPCODES = {k: k for k in KINDS} | {f"{k}-start": k for k in KINDS}
_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_INTEGER = re.compile(r"[su](8|16|32|64)\[\]")
_REMAT_COPY = re.compile(r"\.remat\d*(?:\.|$)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the program: its kind, the full size in bytes of the array(s)
    it reduces or gathers (before any ring factor), its replica groups (device
    positions in the mesh's device order; for a collective-permute, the pairs), its
    instruction's name and the program it runs in."""

    kind: str
    bytes: int
    groups: tuple[tuple[int, ...], ...]
    name: str
    computation: str = ""
    """The program it runs in (`control`): the entry, or a loop's body."""
    hidden: bool | None = None
    """Whether it can overlap with its program's kernels (`overlap.hidden`); None: not
    judged (the cost model then goes by the mesh axes it spans)."""
    beside: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    """Where not ``hidden``: the matmul kernels it can run beside (`overlap.hidden`)."""

    @property
    def group_size(self) -> int:
        """Devices per group (2 for a collective-permute's pairs)."""
        return max((len(g) for g in self.groups), default=1)


@dataclasses.dataclass
class Instr:
    """One instruction of an HLO module's text: its name, result shape, opcode, the text
    after the opcode's opening parenthesis, the computation it is in, and whether it is
    that computation's ``ROOT``."""

    name: str
    shape: str
    opcode: str
    rest: str
    computation: str
    root: bool = False


def remat_copies(names: Iterable[str]) -> int:
    """How many of the instruction ``names`` are copies made by the compiler's own
    rematerialization (XLA names them ``NAME.remat``, ``NAME.remat2``, ...), which
    recomputes where the program is over the device's memory; a step's remat policy
    makes none (jax recomputes in the program it writes).

    >>> remat_copies(["fusion.3.remat", "bitcast.remat.1", "dot.2", "remat_loop"])
    2
    """
    return sum(1 for name in names if _REMAT_COPY.search(name))


def shape_bytes(shape: str) -> list[int]:
    """The bytes of each array in an HLO shape: ``f32[4,8]`` -> ``[128]``; a tuple -> each."""
    out = []
    for dtype, dims in ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(size * _DTYPE_BYTES[dtype])
    return out


def instructions(text: str) -> Iterator[Instr]:
    """The instructions of an HLO module's text, in order."""
    computation = ""
    for line in text.splitlines():
        if line.rstrip().endswith("{") and "=" not in line.split("(")[0]:
            m = _COMPUTATION.match(line)
            computation = m.group(1) if m else computation
            continue
        m = _INSTRUCTION.match(line)
        if m:
            root = line.lstrip().startswith("ROOT ")
            yield Instr(m.group(1), m.group(2), m.group(3), m.group(4), computation, root)


def runs(instrs: list[Instr]) -> dict[str, int]:
    """How many times each computation runs in one execution of the module: the entry
    once; a loop's body and condition its trip count (`trip_count`) times the
    computation that holds the loop; anything else called (fusions, reducers, branches)
    as often as its callers, summed over them. A computation it finds no call of has 0
    here; its users count it once."""
    code: dict[str, list[Instr]] = {}  # computation -> its instructions, in order
    for ins in instrs:
        code.setdefault(ins.computation, []).append(ins)
    named = {(ins.computation, ins.name): ins for ins in instrs}
    calls: dict[str, list[tuple[str, int]]] = {}  # caller -> (callee, times per call)
    for caller, body in code.items():
        calls[caller] = []
        for ins in body:
            loop = trip_count(ins, code, named) if ins.opcode == "while" else 1
            for role, callee in _CALLED.findall(ins.rest):
                calls[caller].append((callee, loop if role in ("body", "condition") else 1))
            for branches in _BRANCHES.findall(ins.rest):
                calls[caller] += [(b, 1) for b in re.findall(r"%?([\w.\-]+)", branches)]
    # HLO text defines a computation before any that calls it, so the entry comes last
    # and, read backwards, every caller's count is complete before its callees'.
    order = list(code)
    times = dict.fromkeys(order, 0)
    if order:
        times[order[-1]] = 1
    for caller in reversed(order):
        for callee, n in calls[caller]:
            if callee in times:
                times[callee] += times[caller] * n
    return times


def control(instrs: list[Instr]) -> dict[str, str]:
    """Each computation's *program*: itself for one that runs on its own (the entry, a
    loop's body or condition, a called computation, a conditional's branch), else the
    program of the instruction that calls it (a fusion's computation, a reducer, an
    asynchronous op's wrapped computation)."""
    order: list[str] = []
    calls: dict[str, list[tuple[str, bool]]] = {}  # caller -> (callee, runs on its own)
    for ins in instrs:
        if not order or order[-1] != ins.computation:
            order.append(ins.computation)
        own = ins.opcode in ("while", "call", "conditional")
        for _, callee in _CALLED.findall(ins.rest):
            calls.setdefault(ins.computation, []).append((callee, own))
        for branches in _BRANCHES.findall(ins.rest):
            calls.setdefault(ins.computation, []).extend(
                (b, True) for b in re.findall(r"%?([\w.\-]+)", branches)
            )
    owner = {order[-1]: order[-1]} if order else {}
    for caller in reversed(order):  # callers are defined after their callees
        for callee, own in calls.get(caller, []):
            owner.setdefault(callee, callee if own else owner.get(caller, caller))
    return owner


def entered(instrs: list[Instr]) -> dict[str, int]:
    """How many times each program (`control`) is entered in one execution of the
    module: a loop's body and condition as often as the loop starts (the runs of the
    computation that holds it); any other program as often as it runs."""
    times = runs(instrs)
    out = dict(times)
    for ins in instrs:
        if ins.opcode == "while":
            for role, callee in _CALLED.findall(ins.rest):
                if role in ("body", "condition"):
                    out[callee] = times.get(ins.computation) or 1
    return out


Code: TypeAlias = dict[str, list[Instr]]
Named: TypeAlias = dict[tuple[str, str], Instr]


def trip_count(loop: Instr, code: Code, named: Named) -> int:
    """A ``while``'s iterations: the count the compiler wrote into its backend config
    (the CPU and GPU compilers), else read from the loop itself (the TPU compiler): its
    condition ``i < N`` on an integer of the loop state that starts at a constant and
    that its body steps by a positive constant ``c`` (the state it returns holds
    ``i + c``: ``ceil((N - start) / c)`` iterations; the TPU compiler unrolls some
    loops by 2 and steps them by 2); 1 (the body counted once) where any of that is
    not there."""
    if found := _TRIP_COUNT.search(loop.rest):
        return int(found.group(1))
    condition = re.search(r"condition=%?([\w.\-]+)", loop.rest)
    body = re.search(r"body=%?([\w.\-]+)", loop.rest)
    if not (condition and body):
        return 1
    compares = [ins for ins in code.get(condition.group(1), []) if ins.opcode == "compare"]
    if len(compares) != 1 or "direction=LT" not in compares[0].rest:
        return 1
    where = compares[0].computation
    counter, bound = (named.get((where, name)) for name in operands(compares[0].rest)[:2])
    index = re.search(r"index=(\d+)", counter.rest) if counter else None
    if not (index and counter and counter.opcode == "get-tuple-element"):
        return 1
    if bound is None or bound.opcode != "constant" or not _INTEGER.match(counter.shape):
        return 1
    i = int(index.group(1))
    step = _step(code.get(body.group(1), []), i, named)
    if step is None:
        return 1
    state = [named.get((loop.computation, name)) for name in operands(loop.rest)[:1]]
    fields = operands(state[0].rest) if state and state[0] and state[0].opcode == "tuple" else []
    init = named.get((loop.computation, fields[i])) if i < len(fields) else None
    while init is not None and init.opcode in ("copy", "bitcast"):  # to what it copies
        init = named.get((loop.computation, operands(init.rest)[0]))
    if init is None or init.opcode != "constant":  # a start known only at run time
        return 1
    return max(-(-(_constant(bound) - _constant(init)) // step), 0)


def _step(body: list[Instr], index: int, named: Named) -> int | None:
    """The positive constant a loop body adds to element ``index`` of its state: the
    body's result holds ``counter + c`` there (through copies and bitcasts), where the
    counter is that element of the body's parameter. None for anything else."""
    root = next((ins for ins in body if ins.root), None)
    if root is None or root.opcode != "tuple":
        return None
    fields = operands(root.rest)
    if index >= len(fields):
        return None
    where = root.computation

    def through(name: str) -> Instr | None:
        ins = named.get((where, name))
        while ins is not None and ins.opcode in ("copy", "bitcast"):
            ins = named.get((where, operands(ins.rest)[0]))
        return ins

    new = through(fields[index])
    if new is None or new.opcode != "add":
        return None
    terms = [through(name) for name in operands(new.rest)]
    if len(terms) != 2 or any(t is None for t in terms):
        return None
    counters = [t for t in terms if t.opcode == "get-tuple-element"]  # type: ignore[union-attr]
    constants = [t for t in terms if t.opcode == "constant"]  # type: ignore[union-attr]
    if len(counters) != 1 or len(constants) != 1:
        return None
    if not re.search(rf"\bindex={index}\b", counters[0].rest):  # type: ignore[union-attr]
        return None
    source = named.get((where, operands(counters[0].rest)[0]))  # type: ignore[union-attr]
    if source is None or source.opcode != "parameter":
        return None
    c = _constant(constants[0])  # type: ignore[arg-type]
    return c if c >= 1 else None


def _constant(ins: Instr) -> int:
    """The value of an integer scalar ``constant(N)``."""
    m = re.match(r"\s*(-?\d+)\)", ins.rest)
    return int(m.group(1)) if m else 0


def operands(rest: str) -> list[str]:
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
    ``{{0,1},{2,3}}``, iota ``[2,2]<=[2,2]T(1,0)``, or ``mesh['axis_0'=2,...] {'axis_1'}``
    (its devices reordered where it gives ``device_ids``).
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
        ids = _mesh_devices(text, math.prod(sizes)).reshape(sizes)
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


def _mesh_devices(text: str, n: int) -> np.ndarray:
    """The devices of a ``mesh[...]`` replica-group form, in the mesh's order: its
    ``device_ids=(...)`` (an iota ``[2,4]T(1,0)`` or a list), else ``0 .. n-1``.

    >>> _mesh_devices("mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}", 8).tolist()
    [0, 4, 1, 5, 2, 6, 3, 7]
    """
    head = text[: text.index("{")] if "{" in text else text
    m = re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", head)
    if m:
        ids = np.arange(n).reshape([int(d) for d in m.group(1).split(",")])
        if m.group(2):
            ids = ids.transpose([int(d) for d in m.group(2).split(",")])
        return ids.reshape(-1)
    m = re.search(r"device_ids=\(([\d,\s]+)\)", head)
    if m:
        return np.array([int(d) for d in m.group(1).split(",") if d.strip()])
    return np.arange(n)


def collectives(text: str, devices: int) -> list[Collective]:
    """Every collective of the optimized HLO module ``text`` of a program on ``devices``.

    Tuple-shaped collectives count each array of the tuple; an async pair counts once
    (its ``-start``); an all-reduce the program only slices, per device, counts as
    a reduce-scatter (see the module's docstring); one inside a loop is listed once per
    iteration.
    """
    instrs = list(instructions(text))
    times = runs(instrs)
    owner = control(instrs)
    users: dict[tuple[str, str], list[Instr]] = {}
    by_name: dict[tuple[str, str], Instr] = {}
    for ins in instrs:
        by_name[(ins.computation, ins.name)] = ins
        for op in operands(ins.rest):
            users.setdefault((ins.computation, op), []).append(ins)
    pid = _partition_scalars(instrs)
    continued = _continuations(instrs)
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
        if kind is None or ins.computation in continued:
            continue
        groups = replica_groups(ins.rest, devices)
        sizes = _sizes(ins, kind, by_name)
        if kind == "all-reduce" and ins.computation in scatter_calls:
            kinds = ["reduce-scatter"] * len(sizes)
        elif kind == "all-reduce":
            elements = _elements(ins, users, len(sizes))
            kinds = [
                "reduce-scatter"
                if element_users and all(_slices(u, size, pid) for u in element_users)
                else "all-reduce"
                for size, element_users in zip(sizes, elements, strict=True)
            ]
        else:
            kinds = [kind] * len(sizes)
        program = owner.get(ins.computation, ins.computation)
        once = [
            Collective(k, b, groups, ins.name, program) for k, b in zip(kinds, sizes, strict=True)
        ]
        found += once * (times.get(ins.computation) or 1)
    return found


_CHAIN = ("async_collective_fusion", "async-collective-done")
"""How the TPU compiler names a chain's continuations (their computations) and its end
(the fusion that calls it)."""


def _continuations(instrs: list[Instr]) -> set[str]:
    """The computations of the TPU compiler's chain continuations (`_CHAIN`) whose
    collective a chain's ``async-collective-start`` also holds (the same channel)."""
    started: set[str] = set()
    chained: dict[str, str] = {}  # computation -> the fusion that calls it
    for ins in instrs:
        if ins.opcode == "fusion":
            for callee in re.findall(r"calls=%?([\w.\-]+)", ins.rest):
                chained[callee] = ins.name
    channel: dict[str, str] = {}  # computation -> its collective's channel
    for ins in instrs:
        found = re.search(r"channel_id=(\d+)", ins.rest)
        if ins.opcode in _OPCODES and found and ins.computation in chained:
            channel[ins.computation] = found.group(1)
            if chained[ins.computation].startswith("async-collective-start"):
                started.add(found.group(1))
    return {
        c
        for c, ch in channel.items()
        if ch in started and (c.startswith(_CHAIN[0]) or chained[c].startswith(_CHAIN[1]))
    }


def _sizes(ins: Instr, kind: str, by_name: dict[tuple[str, str], Instr]) -> list[int]:
    """Full array bytes: the result for all-reduce and all-gather (gathered), the
    operands for reduce-scatter, all-to-all and collective-permute."""
    if kind in ("all-reduce", "all-gather"):
        sizes = shape_bytes(ins.shape)
        if ins.opcode.endswith("-start") and kind == "all-gather":
            # (operands, results) tuple of an async all-gather: the results half
            sizes = sizes[len(sizes) // 2 :]
        return sizes
    found = [by_name.get((ins.computation, op)) for op in operands(ins.rest)]
    sizes = [b for op in found if op is not None for b in shape_bytes(op.shape)]
    return sizes or shape_bytes(ins.shape)


Users: TypeAlias = dict[tuple[str, str], list[Instr]]


def _elements(ins: Instr, users: Users, n: int) -> list[list[Instr]]:
    """The users of each array of an all-reduce's result (through get-tuple-element)."""
    direct = users.get((ins.computation, ins.name), [])
    if n == 1 and not all(u.opcode == "get-tuple-element" for u in direct):
        return [[u for u in direct if not u.opcode.endswith("-done")] + _done_users(ins, users)]
    out: list[list[Instr]] = [[] for _ in range(n)]
    for u in direct:
        m = re.search(r"index=(\d+)", u.rest)
        if u.opcode == "get-tuple-element" and m and int(m.group(1)) < n:
            out[int(m.group(1))] += users.get((u.computation, u.name), [])
    return out


def _done_users(ins: Instr, users: Users) -> list[Instr]:
    done = [u for u in users.get((ins.computation, ins.name), []) if u.opcode.endswith("-done")]
    return [x for d in done for x in users.get((d.computation, d.name), [])]


def _partition_scalars(instrs: list[Instr]) -> set[tuple[str, str]]:
    """Scalars computed from ``partition-id`` (the offsets of per-device slices)."""
    derived: set[tuple[str, str]] = set()
    for ins in instrs:  # HLO text lists operands before their users
        key = (ins.computation, ins.name)
        if ins.opcode in ("partition-id", "replica-id"):
            derived.add(key)
        elif shape_bytes(ins.shape) and max(shape_bytes(ins.shape)) <= 8:
            if any((ins.computation, op) in derived for op in operands(ins.rest)):
                derived.add(key)
    return derived


def _slices(user: Instr, size: int, pid: set[tuple[str, str]]) -> bool:
    """Whether ``user`` keeps only a per-device slice of an array of ``size`` bytes."""
    out = shape_bytes(user.shape)
    if not out or sum(out) >= size:
        return False
    return any((user.computation, op) in pid for op in operands(user.rest))


def summary(found: list[Collective]) -> dict[str, int]:
    """Bytes per kind, every kind present (0 where none)."""
    totals: dict[str, int] = dict.fromkeys(KINDS, 0)
    for c in found:
        totals[c.kind] += c.bytes
    return totals
