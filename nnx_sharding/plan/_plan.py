"""`Plan`: one candidate layout, compiled, with its memory, cost and predicted time."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeAlias, TypeVar

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _errors
from .._jit import JitWrapped, jit
from .._state_sharding import StateSharding
from .._units import format_bytes, format_seconds
from ._cost.hlo import Collective
from ._cost.model import Memory, Time
from ._hardware.devices import mesh_in_order

Params = ParamSpec("Params")
R = TypeVar("R")

InShardings: TypeAlias = tuple[Any, ...]
"""One entry per positional argument: a `StateSharding` of PartitionSpecs for a graph
node, a PartitionSpec (or a pytree of them) for arrays, None for anything else."""


@dataclasses.dataclass(frozen=True, repr=False)
class Plan:
    """One layout of a step on ``N`` devices, compiled (never run), measured and costed.

    Attributes:
      layout: a name of `LAYOUTS` (``'dp'``, ``'fsdp'``, ``'dp+fsdp+tp'``, ...).
      mesh_shape: mesh axis name -> size, in mesh order (``model`` innermost).
      in_shardings: one entry per positional argument (see `InShardings`); PartitionSpecs,
        bound to a mesh by `jit`.
      memory: per-device bytes (`Memory`); None if it could not be compiled.
      fits: whether ``memory.peak`` is within the memory limit (False where it was
        not compiled: see `compiled` and `reason`).
      flops: FLOPs per device per step.
      collectives: kind -> bytes per device per step (the full arrays reduced or
        gathered, before any ring factor), kinds named as in HLO.
      time: the predicted `Time`; None if it could not be compiled.
      reason: why it does not fit or could not be built; None otherwise.
      compiler: whose figures these are: ``'tpu'``, ``'gpu'`` or ``'cpu'`` (simulated).
      accelerator: the accelerator's name.
      notes: caveats about the figures (e.g. a compiler's report that was corrected).
      compile_seconds: the wall time of lowering and compiling.
      measured: seconds per step measured by `Plans.measure` (None until then).
      program: what the cost model read from the compiled program (`_cost.model.Program`:
        kernels, collectives, topology), to price it on another `Accelerator`.
      knobs: the knob values its step was built with (`search`; empty for `plan`).
      model_flops: the model's FLOPs per device per step, as the builder counted them
        (``Built.model_flops`` over the devices); None where it gave none.
      compiled: whether its figures are the compiler's; False for a plan left
        uncompiled (`pruned`) or that could not be built.
      pruned: why `search` did not compile it: ``'state'`` (its state alone exceeds the
        limit), ``'memory'`` (it needs at least what a compiled plan that does not fit
        needs), ``'time'`` (no faster than a compiled plan, slower than one that fits),
        ``'pareto'`` (another candidate beats its own on memory and time at the same
        knobs); None otherwise.
      state_bytes: per-device bytes of its state from the shardings (no compiler
        needed); None where its shapes do not divide.
      pruned_by: the compiled plan that shows it need not be compiled (``pruned``
        ``'time'``, ``'memory'`` or ``'pareto'``).
    """

    layout: str
    mesh_shape: Mapping[str, int]
    in_shardings: InShardings
    memory: Memory | None
    fits: bool
    flops: float
    collectives: Mapping[str, int]
    time: Time | None
    reason: str | None
    compiler: str
    accelerator: str
    notes: tuple[str, ...] = ()
    compile_seconds: float = 0.0
    measured: float | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    detail: tuple[Collective, ...] = dataclasses.field(default=(), repr=False)
    program: Any = dataclasses.field(default=None, repr=False, compare=False)
    knobs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model_flops: float | None = None
    compiled: bool = False
    pruned: str | None = None
    state_bytes: int | None = None
    step: Callable[..., Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    source: Any = dataclasses.field(default=None, repr=False, compare=False)
    pruned_by: Plan | None = dataclasses.field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        if self.memory is None or self.time is None:
            return f"Plan({self.label}: {self.reason})"
        fits = "fits" if self.fits else "does not fit"
        return (
            f"Plan({self.label}: step {format_seconds(self.time.step)}, peak "
            f"{format_bytes(self.memory.peak)} per device, {fits})"
        )

    @property
    def devices(self) -> int:
        """The number of devices, the product of the mesh's sizes."""
        return math.prod(self.mesh_shape.values())

    @property
    def label(self) -> str:
        """``'dp+tp (data=2×model=4)'``; with knobs, ``'dp+tp (data=2×model=4;
        remat=dots, microbatches=2)'``."""
        axes = "×".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        knobs = "; " + ", ".join(f"{k}={v}" for k, v in self.knobs.items()) if self.knobs else ""
        return f"{self.layout} ({axes}{knobs})"

    @property
    def model_tflops_per_device(self) -> float | None:
        """``model_flops / time.step / 1e12``: the model's useful TFLOP/s per device at
        the predicted step time (what published runs report); None without either."""
        if self.model_flops is None or self.time is None or self.time.step <= 0:
            return None
        return self.model_flops / self.time.step / 1e12

    def mesh(self, devices: Any = None) -> Mesh:
        """A mesh of ``AxisType.Auto`` axes over the first ``N`` devices present (or over
        ``devices``), node by node (`order_devices`), shaped by `mesh_shape`.

        Raises:
          ValueError: fewer devices than the plan needs, saying how to get them.
        """
        pool = jax.devices() if devices is None else list(devices)
        if len(pool) < self.devices:
            raise ValueError(
                _errors.plan_mesh_too_few_devices(
                    self.label, self.devices, len(pool), given=devices is not None
                )
            )
        return mesh_in_order(pool, self.mesh_shape)

    def shardings(self, mesh: Mesh | None = None) -> InShardings:
        """`in_shardings` with every PartitionSpec made a ``NamedSharding`` on ``mesh``
        (default: `mesh()`)."""
        return bind(self.in_shardings, self.mesh() if mesh is None else mesh)

    def jit(
        self,
        fun: Callable[Params, R] | None = None,
        *,
        mesh: Mesh | None = None,
        **jit_options: Any,
    ) -> JitWrapped[Params, R]:
        """``nnx_sharding.jit(fun, in_shardings=...)`` laid out as this plan says.

        ``fun`` defaults to the plan's own step (the one `plan` was given, or the one
        `search`'s builder built for this plan's knobs). ``jit_options``
        (``donate_argnums``, ...) default to those given to `plan` (or the `Built`'s).
        Graph nodes' updated state keeps its input sharding; the outputs are left to jax.
        """
        fun = self.step if fun is None else fun
        if fun is None:
            raise TypeError(_errors.plan_jit_no_step(self.label))
        options = {**self.options, **jit_options}
        static = options.get("static_argnums", ())
        static = {static} if isinstance(static, int) else set(static or ())
        shardings = self.shardings(mesh)
        dynamic = tuple(s for i, s in enumerate(shardings) if i not in static)
        return jit(fun, in_shardings=dynamic, **options)


def bind(in_shardings: InShardings, mesh: Mesh) -> InShardings:
    """PartitionSpecs (also inside StateShardings) made NamedShardings on ``mesh``."""

    def one(entry: Any) -> Any:
        if isinstance(entry, StateSharding):
            return StateSharding(
                [
                    (f, NamedSharding(mesh, s) if isinstance(s, P) else s)
                    for f, s in zip(entry.filters, entry.shardings, strict=True)
                ]
            )
        return jax.tree.map(
            lambda s: NamedSharding(mesh, s), entry, is_leaf=lambda x: isinstance(x, P)
        )

    return tuple(one(e) for e in in_shardings)


def shortfall(plan: Plan, limit: int) -> int:
    """Bytes by which ``plan``'s peak exceeds ``limit`` (0 if it fits)."""
    return 0 if plan.memory is None else max(0, plan.memory.peak - limit)
