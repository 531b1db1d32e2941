"""`Step`: what every candidate of one step shares, the step, its abstract arguments and
the target, as `plan` and `search` prepare it once for all candidates."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from .._nodes import Path


@dataclasses.dataclass
class Step:
    """What every candidate shares: the step, its abstract arguments and the target."""

    fun: Callable[..., Any]
    args: tuple[Any, ...]  # abstract: Variables and arrays hold ShapeDtypeStructs
    static: frozenset[int]
    options: dict[str, Any]
    variables: dict[int, list[tuple[Path, nnx.Variable[Any]]]]  # per graph-node argument
    tp: dict[int, dict[Path, P] | None]  # tensor-parallel specs per graph-node argument
    devices: Sequence[Any]
    compiler: str
    accelerator: Any
    dtype: str
    limit: int
    notes: tuple[str, ...] = ()
    originals: tuple[Any, ...] = ()  # the arguments as given (for `Plans.measure`)
    rules: Any = None  # as given to `plan` (for `Plans.devices_for`'s re-planning)
    num_slices: int = 1
    knobs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model_flops: float | None = None  # the builder's count, all devices, per step
    tp_problem: str | None = None  # why no tensor-parallel candidate can be built
    stage: dict[int, dict[Path, P] | None] = dataclasses.field(default_factory=dict)
    """The layer dimension's spec over ``stage`` per graph-node argument, from the
    Variables' metadata (empty: no pipeline candidate can be built)."""
    expert: dict[int, dict[Path, P] | None] = dataclasses.field(default_factory=dict)
    """The experts dimension's spec over ``expert`` per graph-node argument, from the
    Variables' metadata (empty: no expert-parallel candidate can be built)."""
    sequence: int | None = None
    """The sequence the step splits over ``context`` (`Built.sequence`); None: none."""

    @property
    def batch(self) -> int | None:
        """The leading dimension of the first data argument (None without one)."""
        for i, arg in enumerate(self.args):
            if i in self.static or i in self.variables:
                continue
            for leaf in jax.tree.leaves(arg):
                if len(getattr(leaf, "shape", ())) > 0:
                    return int(leaf.shape[0])
        return None
