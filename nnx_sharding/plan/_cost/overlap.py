"""Which collectives can hide under kernels, read from the program's data flow.

A collective overlaps with the kernels of its program when it need not sit between
two of them:

- *prefetchable*: no matmul kernel produces its input (within its program, and in a
  loop's body across iterations: what the body's state held when the iteration began
  is what the previous iteration left there). FSDP's gathers of a layer's weights
  (sliced from the stacked parameters, cast) are; so are the compiler's collective
  matmuls, which pass operand chunks around a ring while each iteration's matmul runs.
- *deferrable*: no matmul kernel consumes its result (again within its program and
  around its loop). Gradient reductions are: their results go to the optimizer, or
  into the stack of a layer loop's gradients.

Anything else waits on a matmul and is waited on by one. It can still run beside the
matmuls that neither feed it nor use its result (`beside`): the pieces of a collective
matmul the compiler unrolled, each piece's partial result passed on while the next
piece computes. With none, it is exposed whole: tensor parallelism's activations
gathered or reduced between two matmuls, or activations a layout chose to move rather
than its weights (`nnx_sharding.plan._cost.model`).
"""

from __future__ import annotations

import re
from collections import deque

from .hlo import KINDS, Instr, control, operands

_MATMUL_CALL = re.compile(r"gemm|matmul|triton|tpu_custom_call|cudnn|fmha|mosaic", re.I)
_CALLS = re.compile(r"\b(?:calls|body|to_apply)=%?([\w.\-]+)")
_COLLECTIVES = frozenset(KINDS) | {f"{k}-start" for k in KINDS}


def hidden(instrs: list[Instr]) -> dict[str, tuple[bool, tuple[str, ...]]]:
    """For each collective instruction (by name; one inside a fusion or an async
    wrapper by its own name, judged at its caller): whether it can overlap with its
    whole program, and else the matmul kernels it can run beside (see the module's
    docstring).

    >>> from nnx_sharding.plan._cost.hlo import instructions
    >>> text = '''
    ... ENTRY %main (w: f32[4,8], x: f32[2,8]) -> f32[2,8] {
    ...   %w = f32[4,8]{1,0} parameter(0)
    ...   %x = f32[2,8]{1,0} parameter(1)
    ...   %g = f32[8,8]{1,0} all-gather(%w), dimensions={0}
    ...   %y = f32[2,8]{1,0} dot(%x, %g), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ...   %r = f32[2,8]{1,0} all-reduce(%y), to_apply=%add
    ...   ROOT %z = f32[2,8]{1,0} dot(%r, %g), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }'''
    >>> hidden(list(instructions(text)))
    {'g': (True, ()), 'r': (False, ())}
    """
    owner = control(instrs)
    loops = {
        c for i in instrs if i.opcode == "while" for c in re.findall(r"body=%?([\w.\-]+)", i.rest)
    }
    code: dict[str, list[Instr]] = {}
    for ins in instrs:
        code.setdefault(ins.computation, []).append(ins)
    heavy = _heavy_computations(code)
    callers: dict[str, Instr] = {}  # a wrapped computation -> the op that calls it
    for ins in instrs:
        if owner.get(ins.computation) == ins.computation:
            for callee in _CALLS.findall(ins.rest):
                if owner.get(callee) != callee:
                    callers.setdefault(callee, ins)
    out: dict[str, tuple[bool, tuple[str, ...]]] = {}
    graphs: dict[str, _Graph] = {}
    for ins in instrs:
        if ins.opcode not in _COLLECTIVES:
            continue
        outer = ins
        while owner.get(outer.computation) != outer.computation and outer.computation in callers:
            outer = callers[outer.computation]
        program = outer.computation
        if program not in graphs:
            graphs[program] = _Graph(code.get(program, []), heavy, program in loops)
        graph = graphs[program]
        feeds = operands(outer.rest)
        if outer is not ins:  # fused with other work (a matmul): judge what feeds it
            feeds = [feeds[j] for j in _fed_by(ins, code) if j < len(feeds)]
        if graph.prefetchable(outer, feeds) or graph.deferrable(outer):
            out[ins.name] = (True, ())
        else:
            out[ins.name] = (False, graph.beside(outer))
    return out


def _fed_by(ins: Instr, code: dict[str, list[Instr]]) -> list[int]:
    """The parameter numbers of ``ins``'s computation that its operands derive from (a
    collective fused with other work: the fusion's operands that feed it)."""
    by_name = {i.name: i for i in code.get(ins.computation, [])}
    seen, todo, found = set(), list(operands(ins.rest)), []
    while todo:
        name = todo.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        producer = by_name[name]
        if producer.opcode == "parameter":
            index = re.match(r"\s*(\d+)\)", producer.rest)
            found += [int(index.group(1))] if index else []
        else:
            todo += operands(producer.rest)
    return sorted(set(found))


def _heavy_computations(code: dict[str, list[Instr]]) -> set[str]:
    """Computations that run a matmul, themselves or in what they call."""
    direct = {name for name, body in code.items() if any(_is_matmul(i) for i in body)}
    calls = {name: {c for i in body for c in _CALLS.findall(i.rest)} for name, body in code.items()}
    heavy = set(direct)
    changed = True
    while changed:
        changed = False
        for name, callees in calls.items():
            if name not in heavy and callees & heavy:
                heavy.add(name)
                changed = True
    return heavy


def _is_matmul(ins: Instr) -> bool:
    if ins.opcode in ("dot", "convolution"):
        return True
    return ins.opcode == "custom-call" and bool(_MATMUL_CALL.search(ins.rest[:2000]))


class _Graph:
    """One program's instructions, their users, and which of them run a matmul."""

    def __init__(self, body: list[Instr], heavy: set[str], loop: bool):
        self.by_name = {i.name: i for i in body}
        self.users: dict[str, list[Instr]] = {}
        for i in body:
            for name in operands(i.rest):
                self.users.setdefault(name, []).append(i)
        self.root = next((i for i in body if i.root), None)
        # a loop body's state: what an iteration starts from is what the last one left
        self.state = [i for i in body if i.opcode == "parameter"] if loop else []
        self.heavy = {
            i.name for i in body if _is_matmul(i) or any(c in heavy for c in _CALLS.findall(i.rest))
        }

    def _state_reads(self, index: int) -> list[Instr]:
        """What reads element ``index`` of the program's state (a loop body's
        parameter): the next iteration's use of what the root leaves there."""
        out = []
        for p in self.state:
            for u in self.users.get(p.name, []):
                if u.opcode == "get-tuple-element" and re.search(rf"\bindex={index}\b", u.rest):
                    out.append(u)
        return out

    def _reach(self, start: Instr, forward: bool) -> set[str]:
        """The names ``start`` reaches in one iteration, along its users or operands."""
        seen: set[str] = set()
        todo = [start.name]
        while todo:
            name = todo.pop()
            ins = self.by_name.get(name)
            if ins is None:
                continue
            nxt = [u.name for u in self.users.get(name, [])] if forward else operands(ins.rest)
            for n in nxt:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    def beside(self, start: Instr) -> tuple[str, ...]:
        """The matmul kernels of the program that neither feed ``start`` nor use its
        result within an iteration: what it can run beside."""
        tied = self._reach(start, True) | self._reach(start, False)
        return tuple(sorted(self.heavy - tied - {start.name}))

    def deferrable(self, start: Instr) -> bool:
        """No matmul uses ``start``'s result (a fused matmul is one)."""
        if start.name in self.heavy:
            return False
        seen = {start.name}
        todo = deque([start])
        while todo:
            ins = todo.popleft()
            for u in self.users.get(ins.name, []):
                if u.name in seen:
                    continue
                seen.add(u.name)
                if u.name in self.heavy:
                    return False
                if u is self.root and u.opcode == "tuple":
                    for j, name in enumerate(operands(u.rest)):
                        if name == ins.name:
                            todo.extend(r for r in self._state_reads(j) if r.name not in seen)
                todo.append(u)
        return True

    def prefetchable(self, start: Instr, feeds: list[str] | None = None) -> bool:
        """No matmul feeds ``start`` (through ``feeds``, its operands by default)."""
        seen = {start.name}
        todo: deque[Instr] = deque()
        for name in operands(start.rest) if feeds is None else feeds:
            producer = self.by_name.get(name)
            if producer is not None and name not in seen:
                if name in self.heavy:
                    return False
                seen.add(name)
                todo.append(producer)
        root_fields = operands(self.root.rest) if self.root is not None else []
        while todo:
            ins = todo.popleft()
            names = operands(ins.rest)
            if (
                ins.opcode == "get-tuple-element"
                and names
                and names[0] in {p.name for p in self.state}
            ):
                index = re.search(r"\bindex=(\d+)", ins.rest)
                j = int(index.group(1)) if index else -1
                if self.root is not None and self.root.opcode == "tuple" and j < len(root_fields):
                    names = [root_fields[j]]  # around the loop: what the last iteration left
            for name in names:
                if name in seen:
                    continue
                seen.add(name)
                producer = self.by_name.get(name)
                if producer is None:
                    continue
                if name in self.heavy:
                    return False
                todo.append(producer)
        return True
