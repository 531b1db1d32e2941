"""Which (candidate, knob point) to compile next, and which need no compiling.

Units are grouped in lattices: one candidate (layout and split) at one value of every
knob but ``remat`` and ``microbatches``, whose points `_knobs.rank` orders. Two rules
leave a unit uncompiled, each from a compiled unit of its own lattice:

- **time**: a unit that recomputes and accumulates at least as much as a compiled unit
  (`no_faster`) is no faster than it; when that compiled unit already takes at least
  the time of the fastest plan that fits (of any lattice), the unit cannot be the
  fastest that fits. A compiled unit the compiler squeezed (recomputed on its own to
  bring it under the device's memory) bounds nothing: its time is not its knobs'. The
  GPU compiler squeezes most points of a large model, and a search that leaves them
  out of the rule compiles no more points and finds the same best plan (measured:
  docs/planning/search.md, "How long a search takes").
- **memory**: a unit that needs at least the memory of a compiled unit (`no_heavier`,
  reversed) that misses the memory limit by more than `MEMORY_MARGIN` does not fit
  either.

Neither is a theorem: they are what remat and microbatching are for, and they hold
where activations dominate. Each is checked against every two compiled units of a
lattice: where two contradict it (a unit that recomputes more is faster by more than
`TIME_TOLERANCE`, or one that should need less memory needs more than
`MEMORY_TOLERANCE` more), the lattice loses that rule along the knobs the two differ
in (remat, microbatches, or both), and what it had pruned by it along them is compiled
after all. A lattice's fastest point is compiled (no rule prunes it) unless
a lighter one needs over twice the limit, so that the lightest points are checked
against it. Both rules fail on small models, where more remat can need more memory
(measured: docs/planning/search.md, "What is compiled").

With ``prune="pareto"``, a third rule, the issue's: a lattice whose compiled point is
beaten on both memory and time by another lattice's at the same knob values is not
compiled at other values. It assumes that knobs change every candidate's memory and
time alike, which they need not (remat saves FSDP's activations an eighth of what it
saves dp+tp's on 8 devices): opt in where the exact rules compile too much.

The order: every lattice's first probe, then its second, then its third (its fastest
point, its lightest, and its lightest without microbatching: one tells whether the
candidate can fit at all, the other how fast it can be), then the remaining points of
the lattice with the lowest bound on its time first (best-first), each remat row from
the lightest, its most microbatches first, the others bisected. Probes start with the
fastest point, and start with the lightest once some fastest point has not fitted
(large models).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Hashable, Sequence

from .knobs import Rank, no_faster, no_heavier

MEMORY_MARGIN = 0.10
"""A compiled point that does not fit stands for the heavier points only when its
peak exceeds the limit by more than this fraction."""
FASTEST_MARGIN = 1.0
"""And for the lattice's fastest point only when it exceeds the limit by more than this
(twice the limit: far beyond any contradiction measured, where the fastest point would
only check the rule)."""
TIME_TOLERANCE = 0.01
"""A unit that recomputes more and is faster by less than this fraction (the bytes
accessed of a different fusion) does not contradict the time rule."""
MEMORY_TOLERANCE = 0.01
"""Nor does one that should need less memory and needs up to this fraction more."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A compiled unit: whether it fits (None: it could not be compiled), its predicted
    step time and peak bytes, and whether the compiler ``squeezed`` it (recomputed on
    its own to bring it under the device's memory: `_hlo.remat_copies`), so that its time
    is not its knobs' alone and bounds nothing by the time rule."""

    fits: bool | None
    time: float | None = None
    peak: int | None = None
    squeezed: bool = False


@dataclasses.dataclass(frozen=True)
class Pruned:
    """Why a unit was not compiled: ``kind`` ``'time'``, ``'memory'`` or ``'pareto'``,
    ``by`` the compiled unit that shows it, and for ``'time'`` the fastest fitting unit
    ``best``."""

    kind: str
    by: int
    best: int | None = None


class Schedule:
    """The compile order of ``units`` (``(lattice, rank)`` each), pruned as results come
    in (`record`) against the memory ``limit``; ``excluded`` units are never compiled
    (their reason is known)."""

    def __init__(
        self,
        units: Sequence[tuple[Hashable, Rank]],
        limit: float,
        *,
        prune: bool | str = True,
        excluded: Collection[int] = (),
    ):
        self.units = list(units)
        self.limit = limit
        self.prune = prune
        self.outcomes: dict[int, Outcome] = {}
        self.pruned: dict[int, Pruned] = {}
        self.best: int | None = None
        self.compiled_order: list[int] = []
        self._excluded = set(excluded)
        self._lattices: dict[Hashable, list[int]] = {}
        for i, (lattice, _) in enumerate(self.units):
            self._lattices.setdefault(lattice, []).append(i)
        self._fast_first = True
        self._probes: dict[Hashable, list[int]] = {}
        self.distrusted: dict[str, set[tuple[Hashable, str]]] = {"time": set(), "memory": set()}

    def is_open(self, i: int) -> bool:
        """Not compiled, not pruned, not excluded."""
        return i not in self.outcomes and i not in self.pruned and i not in self._excluded

    def open_count(self) -> int:
        return sum(self.is_open(i) for i in range(len(self.units)))

    def next(self, busy: Collection[int] = ()) -> int | None:
        """The unit to compile next, none of ``busy``'s lattice; None when every open
        unit waits on a busy one (or none is open)."""
        if not self.prune:
            return next(
                (i for i in range(len(self.units)) if self.is_open(i) and i not in busy), None
            )
        busy_lattices = {self.units[i][0] for i in busy}
        chosen, key = None, None
        for order, (lattice, members) in enumerate(self._lattices.items()):
            if lattice in busy_lattices:
                continue
            probes = self._lattice_probes(lattice, members)
            unit, rung = None, len(probes)
            for k, i in enumerate(probes):
                if self.is_open(i):
                    unit, rung = i, k
                    break
            if unit is None:
                unit = next((i for i in self._staircase(members) if self.is_open(i)), None)
            if unit is None:
                continue
            candidate = (rung, self.bound(unit)[0], order)
            if key is None or candidate < key:
                chosen, key = unit, candidate
        return chosen

    def record(self, i: int, outcome: Outcome) -> None:
        """A compiled unit's outcome; prunes what it shows need not be compiled."""
        self.outcomes[i] = outcome
        self.pruned.pop(i, None)  # pruned while it compiled: its figures stand
        self.compiled_order.append(i)
        lattice, rank = self.units[i]
        self._check(i)
        if outcome.fits and outcome.time is not None:
            if self.best is None or outcome.time < self.outcomes[self.best].time:  # type: ignore[operator]
                self.best = i
        if self._is_fastest(i) and outcome.fits is False:
            self._fast_first = False
        if not self.prune:
            return
        if self.prune == "pareto":
            self._dominate(i)
        peak = outcome.peak or 0
        far, farther = (peak > self.limit * (1 + m) for m in (MEMORY_MARGIN, FASTEST_MARGIN))
        if outcome.fits is False and far:
            for j in self._lattices[lattice]:  # the fastest checks the rule, unless farther
                other = self.units[j][1]
                if self.is_open(j) and no_heavier(other, rank):
                    if self._trusted("memory", lattice, other, rank):
                        if farther or not self._is_fastest(j):
                            self.pruned[j] = Pruned("memory", i)
        if self.best is None:
            return
        limit = self.outcomes[self.best].time
        for j in range(len(self.units)):
            if self.is_open(j):
                low, by = self.bound(j)
                if by is not None and low >= limit:  # type: ignore[operator]
                    self.pruned[j] = Pruned("time", by, self.best)

    def _dominate(self, i: int) -> None:
        """Prunes the open units of a lattice beaten on memory and time by another's at
        the same knob values (unit ``i`` either side)."""
        new = self.outcomes[i]
        if new.time is None or new.peak is None:
            return
        mine = (new.peak, new.time)
        for j, old in self.outcomes.items():
            if j == i or old.time is None or old.peak is None:
                continue
            if self.units[j][1] != self.units[i][1] or self.units[j][0] == self.units[i][0]:
                continue
            theirs = (old.peak, old.time)
            for (a, x), (b, y) in (((j, theirs), (i, mine)), ((i, mine), (j, theirs))):
                if x[0] <= y[0] and x[1] <= y[1] and x != y:
                    for k in self._lattices[self.units[b][0]]:
                        if self.is_open(k):
                            self.pruned[k] = Pruned("pareto", a)

    def _check(self, i: int) -> None:
        """Checks the rules against unit ``i`` and each compiled unit of its lattice; a
        rule two contradict is dropped for the lattice along the knobs they differ in
        (remat, microbatches), and what it pruned along them is undone."""
        lattice, rank = self.units[i]
        new = self.outcomes[i]
        if new.time is None or new.peak is None:
            return
        for j in self._lattices[lattice]:
            old = self.outcomes.get(j)
            if j == i or old is None or old.time is None or old.peak is None:
                continue
            for (a, x), (b, y) in (((j, old), (i, new)), ((i, new), (j, old))):
                ra, rb = self.units[a][1], self.units[b][1]
                faster = y.time < x.time * (1 - TIME_TOLERANCE)  # type: ignore[operator]
                if no_faster(ra, rb) and faster and not x.squeezed:
                    self._distrust("time", lattice, ra, rb)
                if no_heavier(ra, rb) and y.peak > x.peak * (1 + MEMORY_TOLERANCE):  # type: ignore[operator]
                    self._distrust("memory", lattice, ra, rb)

    def _distrust(self, rule: str, lattice: Hashable, a: Rank, b: Rank) -> None:
        self.distrusted[rule] |= {(lattice, d) for d in _along(a, b)}
        for j in self._lattices[lattice]:
            why = self.pruned.get(j)
            if why is not None and why.kind == rule:
                if not self._trusted(rule, lattice, self.units[why.by][1], self.units[j][1]):
                    del self.pruned[j]

    def _trusted(self, rule: str, lattice: Hashable, a: Rank, b: Rank) -> bool:
        """Whether ``rule`` still holds in ``lattice`` along the knobs ``a`` and ``b``
        differ in."""
        return not any((lattice, d) in self.distrusted[rule] for d in _along(a, b))

    def bound(self, i: int) -> tuple[float, int | None]:
        """A lower bound on unit ``i``'s time: the slowest compiled unit of its lattice,
        not squeezed, that it recomputes and accumulates at least as much as (and which
        one), along knobs the time rule still holds for."""
        lattice, rank = self.units[i]
        low, by = 0.0, None
        for j in self._lattices[lattice]:
            out, other = self.outcomes.get(j), self.units[j][1]
            if j == i or out is None or out.time is None or out.squeezed:
                continue
            trusted = self._trusted("time", lattice, other, rank)
            if no_faster(other, rank) and trusted and out.time >= low:
                low, by = out.time, j
        return low, by

    def _is_fastest(self, i: int) -> bool:
        members = self._lattices[self.units[i][0]]
        return i == min(
            members, key=lambda j: (self.units[j][1].remat, self.units[j][1].microbatches)
        )

    def _lattice_probes(self, lattice: Hashable, members: list[int]) -> list[int]:
        """The lattice's probes: its fastest point (and, where that has no remat, its
        lightest policy's fastest), its lightest with microbatches, its lightest
        without; fastest first until some fastest point did not fit. Fixed on first
        use."""
        if lattice in self._probes:
            return self._probes[lattice]
        ranks = {i: self.units[i][1] for i in members}
        fastest = min(members, key=lambda i: (ranks[i].remat, ranks[i].microbatches))
        fast = [fastest]
        policies = [i for i in members if ranks[i].remat > ranks[fastest].remat]
        if policies and ranks[fastest].remat == 0:  # no remat is not always the fastest
            fast.append(min(policies, key=lambda i: (ranks[i].remat, ranks[i].microbatches)))
        many = [i for i in members if ranks[i].microbatches >= 2]
        one = [i for i in members if ranks[i].microbatches < 2]
        lightest = [
            max(group, key=lambda i: (ranks[i].remat, ranks[i].microbatches))
            for group in (many, one)
            if group
        ]
        order = [*fast, *lightest] if self._fast_first else [*lightest, *fast]
        probes = list(dict.fromkeys(order))
        if any(i in self.outcomes or i in self.pruned for i in members):
            self._probes[lattice] = probes  # a lattice's order is fixed once it has begun
        return probes

    def _staircase(self, members: list[int]) -> list[int]:
        """Each remat row from the lightest (the fewest microbatches it fits with bound
        those of the rows that keep more), its most microbatches first (if that does
        not fit, no point of the row or of the heavier rows does), then the others
        bisected (the middle first, then the middles of either half)."""
        rows: dict[int, list[int]] = {}
        for i in sorted(members, key=lambda i: self.units[i][1].microbatches):
            rows.setdefault(self.units[i][1].remat, []).append(i)
        out: list[int] = []
        for remat in sorted(rows, reverse=True):
            out += [rows[remat][-1], *_bisected(rows[remat][:-1])]
        return out


def _along(a: Rank, b: Rank) -> set[str]:
    """The knobs two points differ in, of ``remat`` and ``microbatches``."""
    out = {"remat"} if a.remat != b.remat else set()
    return out | ({"microbatches"} if a.microbatches != b.microbatches else set())


def _bisected(items: list[int]) -> list[int]:
    """>>> _bisected([1, 2, 3, 4, 5, 6, 7])
    [4, 2, 6, 1, 3, 5, 7]"""
    out, spans = [], [(0, len(items))]
    while spans:
        low, high = spans.pop(0)
        if low < high:
            mid = (low + high) // 2
            out.append(items[mid])
            spans += [(low, mid), (mid + 1, high)]
    return out
