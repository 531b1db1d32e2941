"""`plan`: every candidate layout of a step on N devices, compiled and ranked."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from .. import _errors
from .._callpath.argnums import resolve_argnums
from .._nodes import Path, is_node
from .._units import format_bytes
from ._compile import Step, abstract_args, compile_candidate
from ._cost import parse_bytes
from ._layouts import LAYOUTS, Candidate, Rules, candidates, metadata_tp, mirror
from ._plans import Plans

TP_LAYOUTS = tuple(name for name, axes in LAYOUTS.items() if "model" in axes)


def plan(
    fun: Callable[..., Any],
    *args: Any,
    devices: int | Sequence[Any] | None = None,
    accelerator: Any = "cpu",
    memory_limit: int | str | None = None,
    layouts: Sequence[str] | None = None,
    rules: Rules | None = None,
    num_slices: int = 1,
    progress: bool = False,
    **jit_options: Any,
) -> Plans:
    """Compiles ``fun(*args)`` under every candidate layout for N devices and ranks them.

    Nothing is allocated: each candidate is lowered and compiled with
    `nnx_sharding.jit` for N devices (compile-only TPUs or GPUs where their plugins are
    installed, else simulated CPU devices), and costed on ``accelerator``.

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
      layouts: the layouts to try (default: all of `LAYOUTS`).
      rules: logical axis rules for Variables' sharding metadata (``('mlp', 'model')``);
        tensor parallelism follows the metadata's ``model`` entries when there are
        any, else the planner's analysis of the step.
      num_slices: TPU slices (multi-slice).
      progress: show a progress bar over the candidates.
      **jit_options: as `nnx_sharding.jit` takes them (``donate_argnums``, ...).

    Returns:
      The ranked `Plans`.

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> model = nnx.eval_shape(lambda: nnx.Linear(16, 16, rngs=nnx.Rngs(0)))
    >>> def step(model, x):
    ...     return jnp.sum(model(x) ** 2)
    >>> x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    >>> plans = plan(step, model, x, devices=2, layouts=['dp', 'fsdp'])
    >>> sorted(p.layout for p in plans)
    ['dp', 'fsdp']
    """
    from ._accelerator import resolve_accelerator
    from ._devices import compile_devices

    accel, topology = resolve_accelerator(accelerator)
    unknown = [name for name in layouts or () if name not in LAYOUTS]
    if unknown:
        raise ValueError(_errors.plan_unknown_layouts(unknown, LAYOUTS))
    limit = accel.hbm_bytes if memory_limit is None else parse_bytes(memory_limit)
    if isinstance(devices, int) or devices is None:
        n = devices if devices is not None else default_device_count(topology, num_slices)
        if n < 1:
            raise ValueError(_errors.plan_bad_device_count(n))
        pool, compiler, note = compile_devices(accel, n, topology, num_slices)
    else:
        pool = list(devices)
        n, compiler, note = len(pool), pool[0].platform, None
    static, _ = resolve_argnums(
        fun, jit_options.get("static_argnums"), jit_options.get("static_argnames")
    )
    shapes = abstract_args(args, static)
    variables = {
        i: [(tuple(p), v) for p, v in nnx.to_flat_state(nnx.state(a))]
        for i, a in enumerate(shapes)
        if i not in static and is_node(a)
    }
    chosen = candidates(n, layouts)
    if layouts is None and not _has_optimizer_state(variables):  # zero1 would be dp
        chosen = [c for c in chosen if c.layout != "zero1"]
    tp: dict[int, dict[Path, P] | None] = {}
    tp_problem = None
    if any("model" in c.mesh_shape for c in chosen):
        tp, tp_problem = _tensor_parallel(fun, shapes, static, variables, rules)
    step = Step(
        fun=fun,
        args=shapes,
        static=static,
        options=dict(jit_options),
        variables=variables,
        tp=tp,
        devices=pool,
        compiler=compiler,
        accelerator=accel,
        dtype=_dtype(variables),
        limit=limit,
        notes=(note,) if note else (),
        originals=tuple(args),
        rules=rules,
        num_slices=num_slices,
    )

    def build(candidate: Candidate) -> Any:
        if tp_problem is not None and "model" in candidate.mesh_shape:
            return _unbuilt(step, candidate, tp_problem)
        return compile_candidate(step, candidate)

    # Two candidates at a time: one traces and lowers (Python) while the other compiles.
    with ThreadPoolExecutor(max_workers=2) as pool:
        pending = [pool.submit(build, candidate) for candidate in chosen]
        try:
            shown = zip(_progress(chosen, progress), pending, strict=True)
            plans = [future.result() for _, future in shown]
        except BaseException:  # an interrupt or an error: start no other candidate
            for future in pending:
                future.cancel()
            raise
    where = f"{accel.name}, {topology}" if topology else accel.name
    title = (
        f"{n} devices ({where}; figures from the {compiler} compiler), "
        f"memory limit {format_bytes(limit)} per device"
    )
    return Plans(plans, step, title)


def default_device_count(topology: str | None, num_slices: int) -> int:
    if topology:
        dims = re.findall(r"\d+", topology.split(":", 1)[1])
        return math.prod(int(d) for d in dims) * num_slices
    return jax.device_count()


def _has_optimizer_state(variables: dict[int, list[tuple[Path, nnx.Variable]]]) -> bool:
    return any(
        isinstance(v, nnx.OptState) and len(getattr(v.get_value(), "shape", ())) > 0
        for pairs in variables.values()
        for _, v in pairs
    )


def _dtype(variables: dict[int, list[tuple[Path, nnx.Variable]]]) -> str:
    """The dtype holding the most bytes of floating-point state (the step's matmuls')."""
    totals: dict[str, int] = {}
    for pairs in variables.values():
        for _, var in pairs:
            v = var.get_value()
            if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, np.floating):
                name = np.dtype(v.dtype).name
                totals[name] = totals.get(name, 0) + math.prod(v.shape) * v.dtype.itemsize
    return max(totals, key=totals.__getitem__) if totals else "float32"


def _tensor_parallel(
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    static: frozenset[int],
    variables: dict[int, list[tuple[Path, nnx.Variable]]],
    rules: Rules | None,
) -> tuple[dict[int, dict[Path, P] | None], str | None]:
    """Tensor-parallel specs per graph-node argument: from the Variables' metadata when
    it names ``model``, else from the step's jaxpr (column- then row-parallel pairs)."""
    every = [pair for pairs in variables.values() for pair in pairs]
    found = metadata_tp(every, rules)
    if found is None:
        try:
            from ._jaxpr_analysis import tensor_parallel_specs
        except ImportError:  # pragma: no cover - the analysis ships with the planner
            return {}, "the tensor-parallel analysis is not available"
        dynamic = [i for i in range(len(args)) if i not in static]

        def bound(*dyn: Any) -> Any:
            full = list(args)
            for i, value in zip(dynamic, dyn, strict=True):
                full[i] = value
            return fun(*full)

        try:
            per_arg = tensor_parallel_specs(bound, tuple(args[i] for i in dynamic), {}, "model")
        except Exception as e:  # noqa: BLE001 - a step it cannot analyse: no tp candidates
            return {}, f"the tensor-parallel analysis failed: {type(e).__name__}: {e}"
        found = {}
        for specs in per_arg:
            found.update({tuple(p): s for p, s in (specs or {}).items()})
    if not any("model" in tuple(s) for s in found.values()):
        return {}, "no weight to split over 'model' (no matmul pairs, no sharding metadata)"
    return {i: mirror(found, pairs) for i, pairs in variables.items()}, None


def _unbuilt(step: Step, candidate: Candidate, reason: str) -> Any:
    from ._plan import Plan

    return Plan(
        layout=candidate.layout,
        mesh_shape=dict(candidate.mesh_shape),
        in_shardings=(),
        memory=None,
        fits=False,
        flops=0.0,
        collectives={},
        time=None,
        reason=reason,
        compiler=step.compiler,
        accelerator=step.accelerator.name,
    )


def _progress(items: list[Candidate], show: bool) -> Any:
    if not show:
        yield from items
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("compiling candidates", total=len(items))
        for item in items:
            bar.update(task, description=f"compiling {item.label}")
            yield item
            bar.advance(task)
