"""One candidate, lowered and compiled for N devices (never allocated), and measured:
memory from ``memory_analysis``, FLOPs from ``cost_analysis``, collectives from the
optimized HLO."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..._jit import jit
from ..._state_sharding import AtPath, StateSharding
from .._cost.flops import dot_flops
from .._cost.hlo import collectives, entered, instructions, summary
from .._cost.host import Transfer, transfers
from .._cost.kernels import ops
from .._cost.model import Memory, Program, Topology
from .._cost.overlap import hidden
from .._hardware.devices import mesh_in_order
from .._hardware.stderr import offset, since
from .._hardware.tpu_log import compiling, program_bytes
from .._plan import Plan, bind
from .._step import Step
from .knobs import BALANCED
from .layouts import CONTEXT, DATA_AXES, EXPERT, STAGE, Candidate, data_spec, node_specs


def in_shardings(step: Step, candidate: Candidate) -> tuple[tuple[Any, ...], list[str]]:
    """The PartitionSpecs of every positional argument under ``candidate`` and the
    problems found (shapes that do not divide)."""
    entries: list[Any] = []
    problems: list[str] = []
    for i, arg in enumerate(step.args):
        where = f"args[{i}]"
        if i in step.static:
            entries.append(None)
        elif i in step.variables:
            specs, wrong = node_specs(
                candidate,
                step.variables[i],
                step.tp.get(i),
                where,
                step.stage.get(i),
                step.expert.get(i),
            )
            problems += wrong
            entries.append(StateSharding([(AtPath(p), s) for p, s in specs.items()]))
        else:
            leaves, treedef = jax.tree_util.tree_flatten_with_path(arg)
            specs = []
            for keypath, leaf in leaves:
                if not hasattr(leaf, "shape"):
                    specs.append(None)
                    continue
                spec, wrong = data_spec(
                    candidate, leaf.shape, where + jax.tree_util.keystr(keypath)
                )
                specs.append(spec)
                problems += [wrong] if wrong else []
            entries.append(jax.tree_util.tree_unflatten(treedef, specs))
    return tuple(entries), problems


def state_bytes(step: Step, candidate: Candidate, specs: Sequence[Any]) -> int:
    """Per-device bytes of every graph node's Variables under their specs (a Variable
    shared by two arguments counted once)."""
    seen: set[int] = set()
    total = 0
    for i, variables in step.variables.items():
        entry = specs[i]
        for path, var in variables:
            if id(var) in seen:
                continue
            seen.add(id(var))
            v = var.get_value()
            if not hasattr(v, "shape"):
                continue
            spec = entry.sharding_for(path, var)
            shape = list(v.shape)
            for dim, names in enumerate(spec):
                for name in names if isinstance(names, tuple) else (names,):
                    if name is not None:
                        shape[dim] //= candidate.mesh_shape[name]
            total += math.prod(shape) * np.dtype(v.dtype).itemsize
    return total


NO_STAGES = (
    "no Variable names a layer dimension to split over 'stage' (a pipeline runs a stack "
    "of layers with nnx_sharding.pipeline; its Variables' metadata names the stacked "
    "dimension, which the rules map to 'stage')"
)

NO_EXPERTS = (
    "no Variable names an experts dimension to split over 'expert' (a Mixture-of-Experts "
    "layer stacks its experts' weights; their metadata names the experts dimension, which "
    "the rules map to 'expert')"
)


def bubble_note(candidate: Candidate, knobs: Mapping[str, Any]) -> str | None:
    """The pipeline's bubble under ``candidate``, as a plan's note (None without a
    ``stage`` axis): the share of the step each stage idles, ``(stages - 1) /
    (microbatches · repeats + stages - 1)``, read from the ``pipeline_microbatches``
    and ``pipeline_repeats`` knobs (by default as many microbatches as stages, one
    round). The step time priced is the compiled loop's, bubble included.

    >>> bubble_note(Candidate('pp', {'stage': 4}), {'pipeline_microbatches': 8})
    'pipeline bubble: 27% of the step (4 stages, 8 microbatches, 1 repeat; in the step time)'
    """
    stages = candidate.mesh_shape.get(STAGE, 1)
    if stages <= 1:
        return None
    microbatches = knobs.get("pipeline_microbatches") or stages
    repeats = knobs.get("pipeline_repeats") or 1
    share = (stages - 1) / (microbatches * repeats + stages - 1)
    return (
        f"pipeline bubble: {share:.0%} of the step ({stages} stages, {microbatches} "
        f"microbatches, {repeats} repeat{'s' * (repeats > 1)}; in the step time)"
    )


def context_problem(step: Step, candidate: Candidate) -> str | None:
    """Why ``candidate``'s ``context`` axis cannot split ``step``'s sequence, or None:
    the sequence must split into ``context`` chunks, twice as many for the
    load-balanced strategies (`BALANCED`, the ``context_strategy`` knob's, by default
    ``all_gather``). A step that names no sequence (`Built.sequence`) is compiled as
    given."""
    parts = candidate.mesh_shape.get(CONTEXT, 1)
    seq = step.sequence
    if parts <= 1 or seq is None:
        return None
    strategy = step.knobs.get("context_strategy", "all_gather")
    chunks = parts * (2 if strategy in BALANCED else 1)
    if seq % chunks == 0:
        return None
    how = " (two per device: load-balanced)" if chunks > parts else ""
    return (
        f"the sequence of {seq} does not split into {chunks} chunks{how} over "
        f"context={parts} with context_strategy={strategy}"
    )


def listed(step: Step, candidate: Candidate, specs: Any = (), **fields: Any) -> Plan:
    """A `Plan` of ``candidate`` without the compiler's figures (``fields`` say why)."""
    n = math.prod(candidate.mesh_shape.values())
    base = {
        "layout": candidate.layout,
        "mesh_shape": dict(candidate.mesh_shape),
        "in_shardings": specs,
        "compiler": step.compiler,
        "accelerator": step.accelerator.name,
        "options": step.options,
        "knobs": dict(step.knobs),
        "model_flops": None if step.model_flops is None else step.model_flops / n,
        "step": step.fun,
        "source": step,
        "memory": None,
        "fits": False,
        "flops": 0.0,
        "collectives": {},
        "time": None,
        "reason": None,
    }
    return Plan(**{**base, **fields})


def precheck(step: Step, candidate: Candidate, prune: bool | str) -> Plan | None:
    """``candidate``'s plan when it is listed without compiling (shapes that do not
    divide, no tensor-parallel split, no stacked layers for ``stage`` or experts for
    ``expert``, and with ``prune`` a state above the limit)."""
    specs, problems = in_shardings(step, candidate)
    if step.tp_problem is not None and "model" in candidate.mesh_shape:
        return listed(step, candidate, specs, reason=step.tp_problem)
    if STAGE in candidate.mesh_shape and not step.stage:
        return listed(step, candidate, specs, reason=NO_STAGES)
    if EXPERT in candidate.mesh_shape and not step.expert:
        return listed(step, candidate, specs, reason=NO_EXPERTS)
    problem = context_problem(step, candidate)
    if problem is not None:
        return listed(step, candidate, specs, reason=problem)
    count, batch, size = step.knobs.get("microbatches"), step.batch, candidate.data_parallel
    if count and batch and not problems and (batch // count) % size:
        named = ",".join(
            f"{a}={candidate.mesh_shape[a]}" for a in DATA_AXES if a in candidate.mesh_shape
        )
        problems.append(
            f"a microbatch of {batch // count} (batch {batch} / microbatches={count}) is not "
            f"divisible by the data-parallel axes {named} ({size})"
        )
    if problems:
        shown = "; ".join(problems[:3])
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        return listed(step, candidate, specs, reason=f"shapes do not divide: {shown}{more}")
    state = state_bytes(step, candidate, specs)
    if prune and state > step.limit:
        reason = (
            f"not compiled: its state alone needs {state:,} bytes per device, "
            f"{state - step.limit:,} more than the limit of {step.limit:,}"
        )
        return listed(step, candidate, specs, reason=reason, pruned="state", state_bytes=state)
    return None


def compile_candidate(step: Step, candidate: Candidate, kernels: str | None = None) -> Plan:
    """Lowers and compiles ``step`` laid out as ``candidate``, which `precheck` passed;
    a `Plan` with the measured figures and the predicted time, or with ``reason`` set if
    the compiler refused it. The compiler's warnings (while
    `capturing`) go into its notes. ``kernels``: a file the GPU compiler keeps
    its compiled kernels in (`compiler_options`), for one compile at a time."""
    specs, _ = in_shardings(step, candidate)
    state = state_bytes(step, candidate, specs)
    mesh = mesh_in_order(step.devices, dict(candidate.mesh_shape))
    bound = bind(specs, mesh)
    dynamic = tuple(s for i, s in enumerate(bound) if i not in step.static)
    start, logged = time.perf_counter(), offset()
    try:
        with jax.set_mesh(mesh):  # the step may constrain its activations to the mesh's axes
            lowered = jit(step.fun, in_shardings=dynamic, **step.options).lower(*step.args)
        # a TPU program that offloads: its device memory is read from libtpu's log
        offloads = step.compiler == "tpu" and "pinned_host" in lowered.as_text()
        with compiling(offloads) as tpu_logged:
            compiled = lowered.compile(compiler_options(step.compiler, kernels))
    except Exception as e:  # noqa: BLE001 - any compiler error is this candidate's reason
        message = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        reason = f"could not be compiled: {message}"
        return listed(step, candidate, specs, reason=reason, state_bytes=state)
    seconds = time.perf_counter() - start
    notes = list(step.notes)
    notes += compiler_notes(step.compiler, since(logged))
    n = math.prod(candidate.mesh_shape.values())
    text = compiled.as_text()
    if text is None:
        reason = f"{step.compiler} compiler gives no HLO text"
        return listed(step, candidate, specs, reason=reason, state_bytes=state)
    cost = compiled.cost_analysis()  # a dict, or a list of one dict
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = float((cost or {}).get("flops", 0.0))
    stats = compiled.memory_analysis()
    if stats is None:
        reason = f"{step.compiler} compiler gives no memory_analysis"
        return listed(step, candidate, specs, reason=reason, state_bytes=state)
    host = int(getattr(stats, "host_temp_size_in_bytes", 0) or 0)
    program = None
    if tpu_logged is not None and host > 0:
        program = program_bytes(tpu_logged, int(stats.argument_size_in_bytes), host)
    if step.compiler == "tpu" and host > 0 and program is None:
        notes.append(
            "libtpu's log gave no single memory report for this program: its device "
            "temporaries are temp_size_in_bytes, which counts their fragmentation twice"
        )
    memory = Memory(
        state=state,
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        alias=int(stats.alias_size_in_bytes),
        temp=temporaries(step.compiler, stats, program),
        host=host,
    )
    if flops <= 0:  # the GPU compiler gives no cost_analysis: count the matmuls
        flops = dot_flops(text)
        notes.append(
            f"the {step.compiler} compiler gives no cost_analysis: FLOPs are the optimized "
            "program's matmuls"
        )
    else:
        flops, note = _per_iteration(text, flops)
        notes += [note] if note else []
    notes += check_memory(memory, flops)
    moved = transfers(text)
    notes += host_notes(memory.host, moved, step)
    bubble = bubble_note(candidate, step.knobs)
    notes += [bubble] if bubble else []
    if memory.arguments < state:  # the compiler under-reported its inputs: trust the shardings
        memory = dataclasses.replace(memory, arguments=state)
    instrs = list(instructions(text))
    hiding = hidden(instrs)
    found = [
        dataclasses.replace(c, hidden=hiding[c.name][0], beside=hiding[c.name][1])
        if c.name in hiding
        else c
        for c in collectives(text, n)
    ]
    program = Program(
        tuple(ops(text)),
        tuple(found),
        dict(candidate.mesh_shape),
        Topology.of(list(step.devices)[:n], step.accelerator.devices_per_node),
        entered(instrs),
        tuple(moved),
    )
    over = memory.peak - step.limit
    too_big = (
        f"needs {memory.peak:,} bytes per device, {over:,} more than the limit of {step.limit:,}"
    )
    host_limit = step.accelerator.host_bytes
    if over <= 0 and host_limit and memory.host > host_limit:
        over = memory.host - host_limit
        too_big = (
            f"needs {memory.host:,} bytes per device in the host's memory (offloaded "
            f"activations), {over:,} more than the host's {host_limit:,} per device"
        )
    return listed(
        step,
        candidate,
        specs,
        memory=memory,
        time=program.time(step.accelerator),
        flops=flops,
        collectives=summary(found),
        detail=tuple(found),
        program=program,
        state_bytes=state,
        notes=tuple(notes),
        compile_seconds=seconds,
        compiled=True,
        fits=over <= 0,
        reason=None if over <= 0 else too_big,
    )


def host_notes(host: int, moved: Sequence[Transfer], step: Step) -> list[str]:
    """What a plan says of host offload: the host's bytes and how their transfers are
    priced, or that the target's compiler did not offload what the remat policy names
    (the CPU compiler keeps them on the device)."""
    policy = step.knobs.get("remat")
    if host <= 0 and not moved:
        if isinstance(policy, str) and policy.startswith("offload"):
            return [f"the {step.compiler} compiler does not offload to the host: remat="
                    f"{policy}'s activations stay in the device's memory"]  # fmt: skip
        return []
    link = step.accelerator.host_bandwidth
    priced = (
        f"their {sum(t.bytes * t.runs for t in moved) / 2**30:.2f} GiB of transfers priced "
        f"on the host link ({link / 1e9:g} GB/s), hidden under the layers' kernels where "
        "they fit"
        if link > 0
        else "their transfers not priced (the accelerator's host_bandwidth is not known)"
    )
    return [f"{host / 2**30:.2f} GiB per device in the host's memory (offloaded "
            f"activations), beside the device's peak; {priced}"]  # fmt: skip


def temporaries(compiler: str, stats: Any, program: int | None = None) -> int:
    """The step's temporary bytes per device: the compiler's ``temp_size_in_bytes``, or
    on TPUs what its own peak (``peak_memory_in_bytes``) leaves beside the arguments and
    outputs, since there ``temp_size_in_bytes`` counts the temporaries' fragmentation
    twice: for the 32B calibration run, the arguments and ``temp_size_in_bytes`` add up to
    more than the chip holds, the compiler's peak does not, and the run fit as published
    (measured, with libtpu's own log: docs/planning/predictions.md, "Predictions against
    published runs"). The GPU compiler's peak equals arguments + outputs - alias + temp
    (checked); the CPU compiler's falls below its own arguments, so neither is read.
    Where the program offloads activations to the host, the TPU compiler's peak counts
    the host's buffers: the temporaries are then ``program``, the program's device bytes
    from libtpu's own report (`tpu_log.program_bytes`), else ``temp_size_in_bytes``.
    """
    if program is not None:
        return program
    temp = int(stats.temp_size_in_bytes)
    peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    host = int(getattr(stats, "host_temp_size_in_bytes", 0) or 0)
    # with activations offloaded to the host, the TPU compiler's peak is the arguments
    # plus the host's buffers (Mixtral-8x22B on v6e-256: 3.42 + 70.0 GiB), not the chip's
    if compiler != "tpu" or peak <= 0 or host > 0:
        return temp
    rest = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    return max(peak - int(rest), 0)


def compiler_options(compiler: str, kernels: str | None) -> dict[str, Any] | None:
    """The options a compile is given: for the GPU compiler with a ``kernels`` file, its
    kernel cache, so that a kernel compiled for one candidate is not compiled again for
    the next.

    Most of a GPU compile is the kernels' machine code (ptxas and LLVM), which no plan
    reads, and only that is cached: the optimized HLO and the buffer assignment, where
    every figure of a plan comes from, are made anew each time, so a search is faster
    with the cache and its plans are the same (measured: docs/planning/search.md, "How
    long a search takes"). One file per concurrent compile: the compiler reads, extends
    and rewrites it whole.
    """
    if compiler != "gpu" or kernels is None:
        return None
    return {"xla_gpu_kernel_cache_file": kernels}


def compiler_notes(
    compiler: str, lines: Sequence[str], keep: int = 3, width: int = 160
) -> list[str]:
    """The compiler's warnings as notes: the first ``keep``, each cut to ``width``
    characters (the SPMD partitioner's quote whole instructions), and how many more.

    >>> compiler_notes('gpu', ['a' * 200, 'b', 'c', 'd'], width=10)[::3]
    ['the gpu compiler: aaaaaaaaa…', 'the gpu compiler: and 1 more warning']
    """
    cut = [line if len(line) <= width else line[: width - 1] + "…" for line in lines[:keep]]
    notes = [f"the {compiler} compiler: {line}" for line in cut]
    if len(lines) > keep:
        more = len(lines) - keep
        notes.append(f"the {compiler} compiler: and {more} more warning{'s' * (more > 1)}")
    return notes


def _per_iteration(text: str, flops: float) -> tuple[float, str | None]:
    """``cost_analysis``'s FLOPs with a loop's body counted once per iteration:
    ``cost_analysis`` counts it once. The matmuls of the further iterations are added
    (counted from ``text``). (The step time is priced from the program's kernels
    themselves, `kernels`: this is the table's FLOPs column.)"""
    once, every = dot_flops(text, per_iteration=False), dot_flops(text)
    if every <= once or flops <= 0:
        return flops, None
    note = (  # one text for every plan: the table shows it once, in its caption
        "cost_analysis counts a loop's body once: the matmul FLOPs of its other iterations "
        "are added"
    )
    return flops + every - once, note


def check_memory(memory: Memory, flops: float) -> list[str]:
    """Caveats where ``memory_analysis`` is not to be trusted as it stands."""
    notes = []
    if memory.arguments < memory.state:
        notes.append(
            f"memory_analysis gave {memory.arguments:,} argument bytes, fewer than the state's "
            f"{memory.state:,}: the state's are used"
        )
    if memory.temp == 0 and flops > 0:
        notes.append("memory_analysis gave no temporaries: the peak is a lower bound")
    return notes
