"""`search`: every candidate layout of a step built from knob values, over a space of
knob values, ranked together; most points proven not to be the fastest that fits
without being compiled.

Before compiling, a candidate is listed and not compiled when its shapes do not divide
or its state alone (exact, from the shardings) exceeds the memory limit. The others are
compiled in the order `Schedule` gives, which leaves uncompiled what a compiled point
shows cannot be the fastest plan that fits (see `pruning` for the two rules).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

from ... import _errors
from ..._units import format_bytes, format_seconds
from .._built import Built
from .._hardware.stderr import capturing
from .._plan import Plan
from .._ranking import Plans
from .._step import Step
from .compile import compile_candidate, in_shardings, listed, precheck, state_bytes
from .drive import drive
from .knobs import (
    CONTEXT_KNOBS,
    PIPELINE_KNOBS,
    Reads,
    check_microbatches,
    extensions,
    label,
    points,
    rank,
)
from .layouts import CONTEXT, EXPERT, STAGE, Candidate, LayoutSpec, Rules, candidates
from .prepare import Target, check_layouts, has_optimizer_state, prepare, resolve_target
from .pruning import Schedule

Builder: TypeAlias = Callable[[Mapping[str, Any]], Any]
"""``build(knobs)``, returning a `Built` (or a ``(step, args)`` pair)."""
ADVICE_COMPILES = 6
"""At most this many extra points are compiled to say what would fit when nothing does."""


def search(
    build: Builder,
    space: Mapping[str, Sequence[Any]] | None = None,
    *,
    devices: int | Sequence[Any] | None = None,
    accelerator: Any = "cpu",
    memory_limit: int | str | None = None,
    layouts: Sequence[LayoutSpec] | None = None,
    rules: Rules | None = None,
    num_slices: int = 1,
    progress: bool = False,
    prune: bool | str = True,
) -> Plans:
    """Plans the step ``build`` makes at every point of ``space`` under every candidate
    layout, ranked together; compiles only what may be the fastest plan that fits.

    ``build(knobs)`` returns a `Built` (or a ``(step, args)`` tuple) for one point,
    ``knobs`` a mapping such as ``{'remat': 'dots', 'microbatches': 4}``; it is called
    once per point, before anything compiles (so a value it refuses fails at once). A
    builder may declare the values it takes as ``build.choices = {'remat': [...]}``.

    Uncompiled, listed with the reason (and ``Plan.pruned``): a candidate whose state
    alone exceeds the memory limit (exact); a point needing at least the memory of a
    compiled point that does not fit (more ``remat`` or ``microbatches`` needs no more
    memory: ``'memory'``); a point no faster than a compiled point that is no faster
    than the fastest plan that fits (more ``remat``, from one policy to a heavier, or
    more ``microbatches`` is no faster: ``'time'``). From 1 to 2 microbatches is not
    taken to save memory (the gradients accumulated can outweigh the activations
    halved). Both rules are checked against
    the points compiled, and dropped for a candidate whose points contradict them.
    ``prune=False`` compiles every point; ``prune='pareto'`` also leaves uncompiled the
    other points of a candidate that another beats on both memory and time at the same
    knob values (not exact: it assumes that knobs change every candidate alike). When
    nothing fits, `Plans.best` names what would: before it says so, the planner compiles
    the closest candidates with more ``remat`` and ``microbatches`` than the space holds
    (for the knobs the builder reads).

    Args:
      build: the builder (see `Built`).
      space: knob name -> the values to try (default: the builder's defaults alone).
      devices, accelerator, memory_limit, layouts, rules, num_slices, progress: as
        `plan` takes them.
      prune: leave uncompiled the points shown not to be the fastest that fits (True),
        with the candidates beaten at the same knobs too (``'pareto'``), or none (False).

    Returns:
      The `Plans` of every (candidate, knob point), ranked together.

    Raises:
      ValueError: a space that is not names to values, a knob the builder never reads,
        a value it refuses, or a ``microbatches`` that does not divide the batch.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> def build(knobs):
    ...     model = nnx.eval_shape(lambda: nnx.Linear(16, 16, rngs=nnx.Rngs(0)))
    ...     x = jax.ShapeDtypeStruct((8 * knobs['scale'], 16), jnp.float32)
    ...     return Built(lambda m, x: jnp.sum(m(x) ** 2), (model, x))
    >>> plans = search(build, {'scale': [1, 2]}, devices=2, layouts=['dp'])
    >>> sorted(p.knobs['scale'] for p in plans)
    [1, 2]
    """
    return explore(
        build,
        space,
        devices=devices,
        accelerator=accelerator,
        memory_limit=memory_limit,
        layouts=layouts,
        rules=rules,
        num_slices=num_slices,
        progress=progress,
        prune=prune,
    )


def explore(
    build: Builder,
    space: Mapping[str, Sequence[Any]] | None,
    *,
    devices: int | Sequence[Any] | None,
    accelerator: Any,
    memory_limit: int | str | None,
    layouts: Sequence[LayoutSpec] | None,
    rules: Rules | None,
    num_slices: int,
    progress: bool,
    prune: bool | str,
) -> Plans:
    """`search`'s work (`plan` is one point of it, ``prune=False``)."""
    if prune not in (True, False, "pareto"):
        raise ValueError(_errors.search_bad_prune(prune))
    knob_points = points(space)
    target = resolve_target(devices, accelerator, memory_limit, num_slices)
    given = check_layouts(layouts, len(target.devices))
    chosen = candidates(len(target.devices)) if given is None else given
    # the tensor-parallel analysis traces the step: only when a candidate needs it
    tp_cache: dict[Any, Any] | None = {} if any("model" in c.mesh_shape for c in chosen) else None
    reads: set[str] = set()
    steps = [make_step(build, p, target, rules, tp_cache, reads) for p in knob_points]
    unread = [name for name in space or () if name not in reads]
    if unread:
        raise ValueError(_errors.search_unread_knobs(unread, sorted(reads)))
    if given is None and not has_optimizer_state(steps[0]):  # zero1 would be dp
        chosen = [c for c in chosen if c.layout != "zero1"]
    if given is None and not steps[0].stage:  # no stacked layers: no pipeline
        chosen = [c for c in chosen if STAGE not in c.mesh_shape]
    if given is None and not steps[0].expert:  # no experts' weights: no expert parallelism
        chosen = [c for c in chosen if EXPERT not in c.mesh_shape]
    if given is None and steps[0].sequence is None:  # no sequence to split: no context
        chosen = [c for c in chosen if CONTEXT not in c.mesh_shape]
    units = [(c, p) for c in range(len(chosen)) for p in range(len(steps))]
    early = {}
    for i, (c, p) in enumerate(units):
        found = precheck(steps[p], chosen[c], prune)
        if found is not None:
            early[i] = found
    same = same_programs(units, chosen, knob_points)
    ranks = [rank(knob_points[p]) for _, p in units]
    schedule = Schedule(
        [((c, ranks[i].group), ranks[i]) for i, (c, _) in enumerate(units)],
        target.limit,
        prune=prune,
        excluded=set(early) | set(same),
    )
    compiled = drive(schedule, [(steps[p], chosen[c]) for c, p in units], progress)
    by_unit: dict[int, Plan] = {**early, **compiled}
    for i, (c, p) in enumerate(units):
        if i not in by_unit and i not in same:
            by_unit[i] = _pruned(schedule, i, steps[p], chosen[c], compiled)
    for i, first in same.items():  # the figures of the unit whose program it shares
        step = steps[units[i][1]]
        by_unit[i] = dataclasses.replace(
            by_unit[first], knobs=dict(step.knobs), source=step, step=step.fun
        )
    plans = [by_unit[i] for i in range(len(units))]
    advice: list[Plan] = []
    if prune and not any(p.fits for p in plans) and reads & {"remat", "microbatches"}:
        advice = advise(build, plans, target, rules, tp_cache, reads)
    return Plans(plans, steps[0], target.title, advice=advice, space=space, planner=plan)


def same_programs(
    units: Sequence[tuple[int, int]],
    chosen: Sequence[Candidate],
    knob_points: Sequence[Mapping[str, Any]],
) -> dict[int, int]:
    """Units whose program is another's: a candidate at knob points that differ only in
    knobs that act under an axis it lacks (`PIPELINE_KNOBS` without ``stage``,
    `CONTEXT_KNOBS` without ``context``); each -> the first unit of its kind."""
    first: dict[Any, int] = {}
    same: dict[int, int] = {}
    for i, (c, p) in enumerate(units):
        idle = (PIPELINE_KNOBS if STAGE not in chosen[c].mesh_shape else ()) + (
            CONTEXT_KNOBS if CONTEXT not in chosen[c].mesh_shape else ()
        )
        if not idle:
            continue
        rest = sorted((k, repr(v)) for k, v in knob_points[p].items() if k not in idle)
        key = (c, tuple(rest))
        if key in first:
            same[i] = first[key]
        else:
            first[key] = i
    return same


def make_step(
    build: Builder,
    knobs: Mapping[str, Any],
    target: Target,
    rules: Rules | None,
    tp_cache: dict[Any, Any] | None,
    reads: set[str],
) -> Step:
    """The `Step` that ``build`` makes for ``knobs``, the knob names it read added to
    ``reads`` (``tp_cache`` None: no tensor-parallel analysis, see `prepare`)."""
    choices = getattr(build, "choices", None)
    if isinstance(choices, Mapping):
        for name, value in knobs.items():
            allowed = choices.get(name)
            if allowed is not None and value not in allowed:
                raise ValueError(_errors.search_bad_knob_value(name, value, list(allowed)))
    seen: set[str] = set()
    try:
        built = build(Reads(knobs, seen))
    except Exception as e:
        raise ValueError(_errors.search_builder_failed(label(knobs), e)) from e
    reads |= seen
    if isinstance(built, tuple) and len(built) == 2 and callable(built[0]):
        built = Built(built[0], tuple(built[1]))
    if not isinstance(built, Built):
        raise TypeError(_errors.search_bad_built(label(knobs), built))
    given = rules if rules is not None else built.rules  # the builder's, unless given
    step = prepare(built.step, built.args, built.jit_options, target, given, tp_cache)
    check_microbatches(knobs, step.batch)
    return dataclasses.replace(
        step, knobs=dict(knobs), model_flops=built.model_flops, sequence=built.sequence
    )


def _pruned(
    schedule: Schedule, i: int, step: Step, candidate: Candidate, compiled: Mapping[int, Plan]
) -> Plan:
    why = schedule.pruned[i]
    by = compiled[why.by]
    specs, _ = in_shardings(step, candidate)
    state = state_bytes(step, candidate, specs)
    if why.kind == "memory":
        peak = format_bytes(by.memory.peak) if by.memory else "?"
        reason = f"not compiled: needs at least the memory of {by.label}, which needs {peak}"
    elif why.kind == "pareto":
        reason = (
            f"not compiled: {by.label} beats this candidate on memory and time at the "
            "same knobs (prune='pareto')"
        )
    else:
        best = compiled[why.best]  # type: ignore[index]
        took = format_seconds(by.time.step) if by.time else "?"
        reason = f"not compiled: no faster than {by.label} ({took})"
        if why.best != why.by:
            fast = format_seconds(best.time.step) if best.time else "?"
            reason += f", slower than {best.label} ({fast}), which fits"
        else:
            reason += ", which fits"
    return listed(
        step, candidate, specs, reason=reason, pruned=why.kind, state_bytes=state, pruned_by=by
    )


def advise(
    build: Builder,
    plans: Sequence[Plan],
    target: Target,
    rules: Rules | None,
    tp_cache: dict[Any, Any] | None,
    reads: set[str],
) -> list[Plan]:
    """When no plan fits: the closest candidates compiled with more remat and more
    microbatches than the space holds, each until one fits (at most `ADVICE_COMPILES`)."""
    built = sorted((p for p in plans if p.memory is not None), key=lambda p: p.memory.peak)  # type: ignore[union-attr]
    seen, closest = set(), []
    for p in built:
        key = (p.layout, tuple(p.mesh_shape.items()))
        if key not in seen:
            seen.add(key)
            closest.append(p)
    out: list[Plan] = []
    with capturing():
        for p in closest[:2]:
            candidate = Candidate(p.layout, dict(p.mesh_shape))
            sizes = (p.source.batch, candidate.data_parallel)
            tries = extensions(p.knobs, reads, *sizes)
            while tries:
                knobs = tries.pop(0)
                if len(out) >= ADVICE_COMPILES:
                    return out
                try:
                    extra = make_step(build, knobs, target, rules, tp_cache, set())
                except (ValueError, TypeError):  # refused: the remat policy, or no further
                    changed = knobs.get("remat") != p.knobs.get("remat", "none")
                    tries = extensions(p.knobs, reads - {"remat"}, *sizes) if changed else []
                    continue
                plan = precheck(extra, candidate, True) or compile_candidate(extra, candidate)
                out.append(plan)
                if plan.fits:
                    return out
    return out


def plan(
    fun: Callable[..., Any],
    *args: Any,
    devices: int | Sequence[Any] | None = None,
    accelerator: Any = "cpu",
    memory_limit: int | str | None = None,
    layouts: Sequence[LayoutSpec] | None = None,
    rules: Rules | None = None,
    num_slices: int = 1,
    progress: bool = False,
    **jit_options: Any,
) -> Plans:
    """Compiles ``fun(*args)`` under every candidate layout for N devices and ranks them.

    Nothing is allocated: each candidate is lowered and compiled with
    `nnx_sharding.jit` for N devices (compile-only TPUs or GPUs where their plugins are
    installed, else simulated CPU devices), and costed on ``accelerator``. Every
    candidate is compiled; `search` plans a step built from knob values, and compiles
    only the candidates that may be the fastest to fit.

    Args:
      fun: the step, as `nnx_sharding.jit` takes it.
      *args: its positional arguments, abstract (``nnx.eval_shape``,
        ``jax.ShapeDtypeStruct``) or concrete. Graph nodes are state; arrays are
        per-example data, their leading dimension split over the data-parallel axes.
      devices: how many devices to plan for, or a sequence of devices (default: a TPU
        topology's chip count, else the devices jax has).
      accelerator: a preset name (``'h100'``, ``'v5e'``, ...), a TPU topology
        (``'v5e:16x16'``) or an ``Accelerator``.
      memory_limit: bytes per device, an int or a string like ``'80GiB'`` (default:
        the accelerator's memory).
      layouts: the layouts to try (default: all of `LAYOUTS`), each a name (on every
        split of the devices) or one exact candidate, ``('fsdp+tp', {'fsdp': 16,
        'model': 4})``.
      rules: logical axis rules for Variables' sharding metadata (``('mlp', 'model')``);
        tensor parallelism follows the metadata's ``model`` entries when there are
        any, else the planner's analysis of the step.
      num_slices: TPU slices (multi-slice).
      progress: show a progress bar over the candidates.
      **jit_options: as `nnx_sharding.jit` takes them (``donate_argnums``, ...).

    Returns:
      The ranked `Plans`.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> model = nnx.eval_shape(lambda: nnx.Linear(16, 16, rngs=nnx.Rngs(0)))
    >>> def step(model, x):
    ...     return jnp.sum(model(x) ** 2)
    >>> x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    >>> plans = plan(step, model, x, devices=2, layouts=['dp', 'fsdp'])
    >>> sorted(p.layout for p in plans)
    ['dp', 'fsdp']
    """
    from .._built import Built

    return explore(
        lambda knobs: Built(fun, args, jit_options),
        None,
        devices=devices,
        accelerator=accelerator,
        memory_limit=memory_limit,
        layouts=layouts,
        rules=rules,
        num_slices=num_slices,
        progress=progress,
        prune=False,
    )
