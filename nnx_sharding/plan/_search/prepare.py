"""What `plan` and `search` prepare before compiling: the target (devices, compiler,
memory limit), the candidates, and the `Step` every candidate of a step shares."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from ... import _errors
from ..._callpath.argnums import resolve_argnums
from ..._nodes import Path, is_node
from ..._units import format_bytes
from .._cost.model import parse_bytes
from .._hardware.accelerators import Accelerator
from .._step import Step
from .layouts import (
    EXPERT,
    LAYOUTS,
    STAGE,
    Candidate,
    LayoutSpec,
    Rules,
    candidates,
    metadata_tp,
    mirror,
)
from .tensor_parallel import tensor_parallel_specs


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the plans are for: the devices compiled for, whose compiler, the
    accelerator costed and the memory limit."""

    accelerator: Accelerator
    topology: str | None
    devices: Sequence[Any]
    compiler: str
    limit: int
    notes: tuple[str, ...]
    num_slices: int = 1

    @property
    def title(self) -> str:
        """The table's title."""
        where = (
            f"{self.accelerator.name}, {self.topology}" if self.topology else self.accelerator.name
        )
        return (
            f"{len(self.devices)} devices ({where}; figures from the {self.compiler} compiler), "
            f"memory limit {format_bytes(self.limit)} per device"
        )


def resolve_target(
    devices: int | Sequence[Any] | None,
    accelerator: Any,
    memory_limit: int | str | None,
    num_slices: int,
) -> Target:
    """The `Target` of `plan`'s and `search`'s arguments of the same names."""
    from .._hardware.accelerators import resolve_accelerator
    from .._hardware.devices import compile_devices

    accel, topology = resolve_accelerator(accelerator)
    limit = accel.hbm_bytes if memory_limit is None else parse_bytes(memory_limit)
    if isinstance(devices, int) or devices is None:
        n = devices if devices is not None else default_device_count(topology, num_slices)
        if n < 1:
            raise ValueError(_errors.plan_bad_device_count(n))
        pool, compiler, note = compile_devices(accel, n, topology, num_slices)
    else:
        pool = list(devices)
        compiler, note = pool[0].platform, None
    return Target(accel, topology, pool, compiler, limit, (note,) if note else (), num_slices)


def check_layouts(layouts: Sequence[LayoutSpec] | None, n: int) -> list[Candidate] | None:
    """``layouts`` validated: the candidates they name (None: every layout's)."""
    if layouts is None:
        return None
    if isinstance(layouts, str):
        layouts = [layouts]
    names = [x for x in layouts if isinstance(x, str)]
    unknown = [name for name in names if name not in LAYOUTS]
    if unknown:
        raise ValueError(_errors.plan_unknown_layouts(unknown, LAYOUTS))
    return candidates(n, layouts)


def prepare(
    fun: Callable[..., Any],
    args: Sequence[Any],
    jit_options: Mapping[str, Any],
    target: Target,
    rules: Rules | None,
    tp_cache: dict[Any, Any] | None,
) -> Step:
    """The `Step` every candidate of ``fun(*args)`` shares. ``tp_cache`` keeps the
    tensor-parallel analysis of each set of Variables (paths, shapes and dtypes), so
    that steps built for other knob values over the same state are not analysed again
    (remat and microbatching change the step, not which weights pair); None: no
    candidate splits over ``model``, nothing to analyse."""
    static, _ = resolve_argnums(
        fun, jit_options.get("static_argnums"), jit_options.get("static_argnames")
    )
    shapes = abstract_args(args, static)
    variables = {
        i: [(tuple(p), v) for p, v in nnx.to_flat_state(nnx.state(a))]
        for i, a in enumerate(shapes)
        if i not in static and is_node(a)
    }
    key = tuple(
        (i, p, tuple(getattr(v.get_value(), "shape", ())), str(getattr(v.get_value(), "dtype", "")))
        for i, pairs in variables.items()
        for p, v in pairs
    )
    tp: dict[int, dict[Path, P] | None] = {}
    tp_problem = None
    if tp_cache is not None:
        if key not in tp_cache or tp_cache[key][1] is not None:  # a failure: try this step
            tp_cache[key] = _tensor_parallel(fun, shapes, static, variables, rules)
        tp, tp_problem = tp_cache[key]
    every = [pair for pairs in variables.values() for pair in pairs]
    stage, expert = (_axis_specs(every, variables, rules, axis) for axis in (STAGE, EXPERT))
    return Step(
        fun=fun,
        args=shapes,
        static=static,
        options=dict(jit_options),
        variables=variables,
        tp=tp,
        devices=target.devices,
        compiler=target.compiler,
        accelerator=target.accelerator,
        dtype=_dtype(variables),
        limit=target.limit,
        notes=target.notes,
        originals=tuple(args),
        rules=rules,
        num_slices=target.num_slices,
        tp_problem=tp_problem,
        stage=stage,
        expert=expert,
    )


def _axis_specs(
    every: Sequence[tuple[Path, nnx.Variable[Any]]],
    variables: dict[int, list[tuple[Path, nnx.Variable[Any]]]],
    rules: Rules | None,
    axis: str,
) -> dict[int, dict[Path, P] | None]:
    """The specs over ``axis`` (``stage``, ``expert``) per graph-node argument, from the
    Variables' metadata through ``rules``, the optimizer state mirroring its parameters;
    empty when no Variable's metadata names ``axis``."""
    found = metadata_tp(every, rules, axis)
    if found is None:
        return {}
    return {i: mirror(found, pairs) for i, pairs in variables.items()}


def abstract_args(args: Sequence[Any], static: frozenset[int]) -> tuple[Any, ...]:
    """``args`` with every array (in graph nodes too) a ``ShapeDtypeStruct`` without a
    sharding: what the candidates lower. Sharing between arguments is kept; the
    caller's objects are not touched."""
    nodes = [i for i, a in enumerate(args) if i not in static and is_node(a)]
    with nnx.use_eager_sharding(False):
        copies = nnx.eval_shape(lambda *a: a, *[args[i] for i in nodes]) if nodes else ()
    for node in copies:
        for _, value in nnx.iter_graph(node):
            if isinstance(value, nnx.Variable):
                v = value.get_value()
                if hasattr(v, "shape") and hasattr(v, "dtype"):
                    value.set_value(jax.ShapeDtypeStruct(v.shape, v.dtype))
    out = list(args)
    for i, node in zip(nodes, copies, strict=True):
        out[i] = node
    for i, a in enumerate(args):
        if i in static or is_node(a):
            continue
        out[i] = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") else x, a
        )
    return tuple(out)


def default_device_count(topology: str | None, num_slices: int) -> int:
    """The devices planned for when not given: a TPU topology's chips, else jax's."""
    if topology:
        dims = re.findall(r"\d+", topology.split(":", 1)[1])
        return math.prod(int(d) for d in dims) * num_slices
    return jax.device_count()


def has_optimizer_state(step: Step) -> bool:
    """Whether any Variable of ``step`` is non-scalar optimizer state (else ``zero1``
    is ``dp``)."""
    return _has_optimizer_state(step.variables)


def _has_optimizer_state(variables: dict[int, list[tuple[Path, nnx.Variable[Any]]]]) -> bool:
    return any(
        isinstance(v, nnx.OptState) and len(getattr(v.get_value(), "shape", ())) > 0
        for pairs in variables.values()
        for _, v in pairs
    )


def _dtype(variables: dict[int, list[tuple[Path, nnx.Variable[Any]]]]) -> str:
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
    variables: dict[int, list[tuple[Path, nnx.Variable[Any]]]],
    rules: Rules | None,
) -> tuple[dict[int, dict[Path, P] | None], str | None]:
    """Tensor-parallel specs per graph-node argument: from the Variables' metadata when
    it names ``model``, else from the step's jaxpr (column- then row-parallel pairs)."""
    every = [pair for pairs in variables.values() for pair in pairs]
    found = metadata_tp(every, rules)
    if found is None:
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
