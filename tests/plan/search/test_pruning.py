"""The search's order and pruning (`_schedule`), against brute force on models whose
memory and time follow the rules the pruning rests on; the knob helpers (`_knobs`).

Nothing is compiled: each "compile" reads a point's figures from a formula.
"""

from __future__ import annotations

import math
import random

import pytest

from nnx_sharding.plan._search.knobs import (
    REMAT_ORDER,
    Reads,
    extensions,
    no_faster,
    no_heavier,
    parse_value,
    points,
    rank,
)
from nnx_sharding.plan._search.pruning import MEMORY_MARGIN, Outcome, Schedule

REMAT = ["none", "dots", "full"]
MICROBATCHES = [1, 2, 4, 8]
KEPT = {"none": 1.0, "dots": 0.45, "full": 0.12}  # activations kept, of remat none's
SLOWER = {"none": 1.0, "dots": 1.08, "full": 1.33}  # recompute


def model(seed: int, candidates: int = 12) -> list[tuple[float, ...]]:
    """Per candidate: state, activations, gradients, base time, per-microbatch cost."""
    rng = random.Random(seed)
    return [
        (
            rng.uniform(5, 90),
            rng.uniform(20, 400),
            rng.uniform(0.5, 30),
            rng.uniform(1, 3),
            rng.uniform(0, 0.3),
        )
        for _ in range(candidates)
    ]


def figures(candidate: tuple[float, ...], knobs: dict) -> tuple[float, float]:
    """(peak, time): one microbatch keeps the activations or the gradients at their
    largest; more accumulate the gradients beside a slice of the activations."""
    state, act, grads, base, per = candidate
    remat, count = knobs["remat"], knobs["microbatches"]
    if count == 1:
        peak = state + max(act * KEPT[remat], grads)
    else:
        peak = state + grads + act * KEPT[remat] / count
    time = base * SLOWER[remat] * (1 + 0.02 * math.log2(count)) + per * (count - 1) * 0.05
    return peak, time


def run(
    candidates: list[tuple[float, ...]], limit: float, busy: int = 2
) -> tuple[Schedule, list[tuple[float, float]], set[int]]:
    """The schedule driven to the end, ``busy`` units compiling at a time, results in
    the order they were started; the figures of every unit; those excluded (state
    above the limit)."""
    grid = points({"remat": REMAT, "microbatches": MICROBATCHES})
    units, truth = [], []
    for c, candidate in enumerate(candidates):
        for knobs in grid:
            units.append((c, rank(knobs)))
            truth.append(figures(candidate, knobs))
    excluded = {i for i, (c, _) in enumerate(units) if candidates[c][0] > limit}
    schedule = Schedule(units, limit, excluded=excluded)
    running: list[int] = []
    while True:
        while len(running) < busy and (i := schedule.next(busy=running)) is not None:
            running.append(i)
        if not running:
            break
        i = running.pop(0)
        peak, time = truth[i]
        schedule.record(i, Outcome(peak <= limit, time, peak))
    return schedule, truth, excluded


@pytest.mark.parametrize("limit", [40.0, 80.0, 200.0, 1e9])
def test_the_fastest_fitting_point_is_found_and_what_is_pruned_is_so(limit):
    for seed in range(40):
        schedule, truth, excluded = run(model(seed), limit)
        fitting = [t for i, (peak, t) in enumerate(truth) if peak <= limit and i not in excluded]
        found = None if schedule.best is None else schedule.outcomes[schedule.best].time
        assert found == (min(fitting) if fitting else None), seed
        for i, why in schedule.pruned.items():
            peak, time = truth[i]
            if why.kind == "memory":  # inferred from a lighter point far above the limit
                assert peak > limit and truth[why.by][0] > limit * (1 + MEMORY_MARGIN)
                assert no_heavier(schedule.units[i][1], schedule.units[why.by][1])
            else:  # no faster than a compiled point no faster than the best
                assert time >= truth[why.by][1] >= found
                assert no_faster(schedule.units[why.by][1], schedule.units[i][1])
        assert schedule.open_count() == 0
        assert set(schedule.outcomes) | set(schedule.pruned) | excluded == set(range(len(truth)))


def test_pruning_compiles_a_fraction_of_the_points():
    """12 candidates x 12 points: about 4 compiles a candidate where the limit bites,
    two where every candidate fits at its fastest point (no remat, and the lightest
    policy's, which can be faster: `no_faster`)."""
    counts = {}
    for limit in (80.0, 1e9):
        counts[limit] = [len(run(model(seed), limit)[0].outcomes) for seed in range(40)]
    assert max(counts[1e9]) == 24  # the two fastest points fit: the others are slower
    assert sum(counts[80.0]) / 40 < 0.35 * 144


def test_one_to_two_microbatches_is_not_taken_to_save_memory():
    """Accumulating gradients can need more than one microbatch's activations: the
    one-microbatch point fits where every point with more misses by over the margin
    (and prunes the others with more), and is found."""
    candidate = (1.0, 562.0, 74.0, 1.0, 0.1)  # the gradients take most of the limit
    schedule, truth, _ = run([candidate], limit=75.0, busy=1)
    best = schedule.units[schedule.best][1]
    assert (REMAT_ORDER[best.remat], best.microbatches) == ("full", 1)
    many = [i for i, (_, r) in enumerate(schedule.units) if r.microbatches > 1]
    assert min(truth[i][0] for i in many) > 75.0 * (1 + MEMORY_MARGIN)
    assert {schedule.pruned[i].kind for i in many if i in schedule.pruned} == {"memory"}


@pytest.mark.parametrize(("over", "pruned"), [(1.05, 0), (1.2, 2), (2.5, 3)])
def test_a_point_that_misses_by_less_than_the_margin_proves_nothing(over, pruned):
    """The lightest point misses the limit by 5 %, 20 %, 150 %: the first proves
    nothing (more remat or microbatches needed up to 17 % more memory on small
    models), the second stands for the heavier points but the fastest (compiled, it
    checks the rule), the third for all."""
    grid = points({"remat": ["none", "full"], "microbatches": [2, 4]})
    schedule = Schedule([(0, rank(k)) for k in grid], 100.0)
    lightest = grid.index({"remat": "full", "microbatches": 4})
    schedule.record(lightest, Outcome(False, 1.0, 100.0 * over))
    assert len(schedule.pruned) == pruned
    fastest = grid.index({"remat": "none", "microbatches": 2})
    assert (fastest in schedule.pruned) == (pruned == 3)
    assert all(why.kind == "memory" and why.by == lightest for why in schedule.pruned.values())


def test_without_pruning_every_point_is_compiled_in_order():
    grid = points({"remat": ["none", "full"], "microbatches": [1, 2]})
    schedule = Schedule([(0, rank(k)) for k in grid], 1.0, prune=False)
    order = []
    while (i := schedule.next(busy=[])) is not None:
        order.append(i)
        schedule.record(i, Outcome(True, 1.0, 0.5))
    assert order == [0, 1, 2, 3] and not schedule.pruned


def test_knob_points_are_the_product_in_the_order_given():
    assert points({"remat": ["none", "full"], "microbatches": [1, 4], "x": [0]}) == [
        {"remat": r, "microbatches": m, "x": 0} for r in ("none", "full") for m in (1, 4)
    ]
    assert points(None) == [{}]


def test_points_are_ordered_by_remat_and_microbatches_within_their_group():
    a, b = rank({"remat": "dots", "microbatches": 2}), rank({"remat": "full", "microbatches": 4})
    assert no_faster(a, b) and no_heavier(a, b) and not no_faster(b, a)
    none = rank({"remat": "none", "microbatches": 2})
    assert no_heavier(none, b) and not no_faster(none, b)  # saving less can be faster
    assert no_faster(none, rank({"remat": "none", "microbatches": 4}))
    other = rank({"remat": "none", "microbatches": 4, "dtype": "bf16"})
    assert not no_faster(a, other)  # another value of another knob: apart
    unknown = rank({"remat": "offload", "microbatches": 4})
    assert not no_faster(a, unknown) and not no_faster(unknown, b)
    assert REMAT_ORDER.index("dots") < REMAT_ORDER.index("full")


def test_reads_records_the_knobs_a_builder_asks_for():
    seen: set[str] = set()
    knobs = Reads({"remat": "none", "other": 1}, seen)
    assert knobs.get("remat") == "none" and knobs.get("microbatches", 1) == 1
    assert seen == {"remat", "microbatches"}


def test_extensions_save_memory_within_the_batch():
    both = {"remat", "microbatches"}
    assert extensions({"remat": "dots", "microbatches": 2}, both, 8, 2) == [
        {"remat": "full", "microbatches": 2},
        {"remat": "full", "microbatches": 4},
    ]
    assert extensions({}, {"microbatches"}, 12, 3) == [{"microbatches": 2}, {"microbatches": 4}]
    assert extensions({"remat": "full"}, {"remat"}, 8, 1) == []


def test_command_line_values_are_typed():
    assert [parse_value(v) for v in ("8", "0.25", "False", "dots", "nan")] == [
        8,
        0.25,
        False,
        "dots",
        "nan",
    ]


def drive(units, truth, limit, prune=True):
    """Compiles one unit at a time, as the schedule says; the schedule at the end."""
    schedule = Schedule(units, limit, prune=prune)
    while (i := schedule.next(busy=[])) is not None:
        peak, time = truth[i]
        schedule.record(i, Outcome(peak <= limit, time, peak))
    return schedule


def lattice_after_a_large_model(figures):
    """A one-point lattice that does not fit (so that probes start with the lightest
    point, as for large models), then a 2 x 2 lattice with ``figures`` by knobs."""
    grid = points({"remat": ["none", "full"], "microbatches": [2, 4]})
    units = [("big", rank({"remat": "none", "microbatches": 2}))]
    units += [("small", rank(k)) for k in grid]
    truth = [(1000.0, 1.0)] + [figures[(k["remat"], k["microbatches"])] for k in grid]
    return grid, units, truth


def test_points_that_contradict_the_memory_rule_make_their_lattice_compile_it_all():
    """The lightest point needs far more than the limit, yet two heavier ones fit: the
    fastest point (always compiled) needs less than the lightest, so the rule is
    dropped for the lattice and the points it had pruned are compiled."""
    figures = {("none", 2): (105.0, 1.0), ("none", 4): (98.0, 1.2)}
    figures |= {("full", 2): (97.0, 1.3), ("full", 4): (150.0, 1.5)}
    grid, units, truth = lattice_after_a_large_model(figures)
    schedule = drive(units, truth, 100.0)
    assert ("small", "remat") in schedule.distrusted["memory"]
    best = grid[schedule.best - 1]
    assert (best["remat"], best["microbatches"]) == ("none", 4)
    assert truth[schedule.best] == (98.0, 1.2)


def test_points_that_contradict_the_time_rule_make_their_lattice_compile_it_all():
    """The lightest point fits and is faster than one with fewer microbatches (by
    33 %): the time rule is dropped for the lattice along microbatches, and its other
    points are compiled too."""
    figures = {("none", 2): (120.0, 1.0), ("none", 4): (110.0, 1.1)}
    figures |= {("full", 2): (105.0, 1.2), ("full", 4): (90.0, 0.8)}
    _, units, truth = lattice_after_a_large_model(figures)
    schedule = drive(units, truth, 100.0)
    assert ("small", "microbatches") in schedule.distrusted["time"]
    assert set(schedule.outcomes) == {0, 1, 2, 3, 4} and not schedule.pruned


def test_a_rule_is_dropped_only_along_the_knob_two_points_contradict_it_on():
    """More microbatches faster (the GPU compiler's FLOP count varies with the
    microbatch loop), more remat slower: the time rule stays along remat."""
    grid = points({"remat": ["none", "full"], "microbatches": [2, 4]})
    schedule = Schedule([("x", rank(k)) for k in grid], 100.0)
    times = {("none", 2): 1.0, ("none", 4): 0.8, ("full", 2): 1.3, ("full", 4): 1.1}
    for i, knobs in enumerate(grid):
        schedule.record(i, Outcome(False, times[(knobs["remat"], knobs["microbatches"])], 200.0))
    assert schedule.distrusted["time"] == {("x", "microbatches")}
    assert schedule.distrusted["memory"] == set()


@pytest.mark.parametrize("prune", [True, "pareto"])
def test_pareto_leaves_a_candidate_beaten_at_the_same_knobs_uncompiled(prune):
    """Two candidates whose fastest points both fit nowhere; at the lightest point, one
    needs less memory and less time than the other: with ``'pareto'`` the beaten one's
    other points are not compiled."""
    grid = points({"remat": ["none", "full"], "microbatches": [2, 4]})
    units = [(c, rank(k)) for c in ("a", "b") for k in grid]
    figures = {"a": (90.0, 1.0), "b": (95.0, 1.2)}  # at every point; fits below 100
    heavy = {("none", 2): 5.0}  # the fastest point: 5 times the figures' memory
    truth = []
    for c, knobs in ((c, k) for c in ("a", "b") for k in grid):
        peak, time = figures[c]
        truth.append((peak * heavy.get((knobs["remat"], knobs["microbatches"]), 1.0), time))
    schedule = drive(units, truth, 100.0, prune=prune)
    beaten = {i for i, why in schedule.pruned.items() if why.kind == "pareto"}
    if prune == "pareto":
        assert beaten and all(units[i][0] == "b" for i in beaten)
        assert all(units[schedule.pruned[i].by][0] == "a" for i in beaten)
    else:
        assert not beaten
    assert schedule.units[schedule.best][0] == "a"


@pytest.mark.parametrize("squeezed", [False, True])
def test_a_point_the_compiler_squeezed_neither_contradicts_nor_bounds_the_time_rule(squeezed):
    """A point over the device's memory that the compiler recomputed on its own to fit
    is slower than its knobs make it (the GPU compiler, for llama3-8b under FSDP 64 with
    `dots`: 8.01 s at one microbatch, 6.84 s at four): squeezed, it drops no rule and
    bounds no other point; the reference, the same figures not squeezed, drops the time
    rule along microbatches."""
    grid = points({"remat": ["none"], "microbatches": [2, 4, 8]})
    schedule = Schedule([("x", rank(k)) for k in grid], 100.0)
    schedule.record(0, Outcome(False, 1.0, 200.0, squeezed=squeezed))  # 2 microbatches
    schedule.record(1, Outcome(True, 0.8, 90.0))  # 4: faster, and fits
    if squeezed:
        assert schedule.distrusted["time"] == set()
        assert schedule.bound(2) == (0.8, 1)  # 8 microbatches: by 4's time, not 2's
        assert schedule.pruned[2].kind == "time"
    else:
        assert schedule.distrusted["time"] == {("x", "microbatches")}
        assert schedule.bound(2) == (0.0, None) and schedule.is_open(2)
