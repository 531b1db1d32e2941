"""The candidate layouts: every layout on every factorisation of N, and the
PartitionSpec each one gives every Variable and every data argument.

A layout is a rule per Variable:

- ``dp``: everything replicated, the batch split over ``data``.
- ``zero1``: parameters replicated, optimizer state (``nnx.OptState`` Variables) split
  over ``data`` on its largest dimension ``data`` divides.
- ``fsdp``: every Variable split over ``fsdp`` on its largest dimension ``fsdp`` divides.
- ``tp``: the tensor-parallel split over ``model`` (Megatron pairs, see `tp_specs`).
- ``dp+tp``, ``fsdp+tp``: both, on a 2-D mesh; FSDP takes the largest free dimension.
- ``dp+fsdp`` (hybrid-sharded data parallelism): FSDP inside each ``data`` group, the
  groups replicas of each other; ``dp+fsdp+tp`` adds tensor parallelism innermost.
- ``pp`` and ``pp+...``: pipeline parallelism, the stacked layers' layer dimension over
  ``stage`` (where the Variables' metadata names it, through the rules: the step runs
  them with `nnx_sharding.pipeline`), the other layouts' rules inside each stage.
- ``ep`` and ``...+ep``: expert parallelism for Mixture-of-Experts models, the stacked
  experts' dimension over ``expert`` (where the Variables' metadata names it, through
  the rules), the other layouts' rules on the rest; ``expert`` splits the batch too.
- ``cp`` and ``...+cp``: context parallelism for long sequences, the sequence split
  over ``context`` (the step's activations named ``activation_length``: the decoder's
  attention by its ``context_strategy``); the Variables are sharded over ``context``
  with ``fsdp``, as MaxText shards them, and the batch is not split over it.

Data arguments (arrays) have their leading dimension split over the data-parallel
axes (``data``, ``fsdp``, ``expert``); with none of them (``tp``) they are replicated.

Mesh axes are in the order ``data``, ``stage``, ``fsdp``, ``context``, ``expert``,
``model`` (MaxText's order): the
devices are laid out node by node (`_hardware.devices.order_devices`), so the innermost
axes sit inside a node (a GPU host, a TPU slice) and ``data`` and ``stage`` span the
nodes: the data-parallel reduction crosses the slower network once per step, the
pipeline's activations once per microbatch and stage; ``expert``, next to ``model``,
keeps the all-to-alls of an MoE step (its heaviest traffic) inside a node first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

from flax import nnx
from jax.sharding import PartitionSpec as P

from ..._nodes import Path

Rules: TypeAlias = Sequence[tuple[str, "str | tuple[str, ...] | None"]]

LAYOUTS: dict[str, tuple[str, ...]] = {
    "dp": ("data",),
    "zero1": ("data",),
    "fsdp": ("fsdp",),
    "tp": ("model",),
    "dp+tp": ("data", "model"),
    "fsdp+tp": ("fsdp", "model"),
    "dp+fsdp": ("data", "fsdp"),
    "dp+fsdp+tp": ("data", "fsdp", "model"),
    "pp": ("stage",),
    "pp+fsdp": ("stage", "fsdp"),
    "pp+tp": ("stage", "model"),
    "pp+fsdp+tp": ("stage", "fsdp", "model"),
    "dp+pp+fsdp": ("data", "stage", "fsdp"),
    "ep": ("expert",),
    "fsdp+ep": ("fsdp", "expert"),
    "dp+ep": ("data", "expert"),
    "dp+fsdp+ep": ("data", "fsdp", "expert"),
    "fsdp+tp+ep": ("fsdp", "expert", "model"),
    "cp": ("context",),
    "fsdp+cp": ("fsdp", "context"),
    "dp+fsdp+cp": ("data", "fsdp", "context"),
    "fsdp+tp+cp": ("fsdp", "context", "model"),
}
"""Each layout's mesh axes, in mesh order (``model`` innermost: inside a node, then
``expert``, then ``context``)."""
STAGE = "stage"
"""The pipeline's mesh axis (`nnx_sharding.pipeline`'s default)."""
EXPERT = "expert"
"""Expert parallelism's mesh axis: a Mixture-of-Experts layer's experts split over it."""
CONTEXT = "context"
"""Context parallelism's mesh axis: the sequence split over it (the activations named
``activation_length``), the Variables sharded over it as over ``fsdp``."""
FSDP_AXES = ("fsdp", CONTEXT)
"""The axes FSDP shards each Variable over, together, where the mesh has them: MaxText
shards the weights over its ``context`` axis as over ``fsdp`` (the ``embed`` rule)."""
LayoutSpec: TypeAlias = "str | tuple[str, Mapping[str, int]]"
"""A layout on every split (``'fsdp+tp'``) or one exact candidate
(``('fsdp+tp', {'fsdp': 16, 'model': 4})``)."""
DATA_AXES = ("data", "fsdp", "expert")
"""The axes the batch is split over, in mesh order (MaxText's ``activation_batch``)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A layout on a mesh shape, e.g. ``Candidate('dp+tp', {'data': 2, 'model': 4})``."""

    layout: str
    mesh_shape: Mapping[str, int]

    @property
    def label(self) -> str:
        axes = "×".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        return f"{self.layout} ({axes})"

    @property
    def data_parallel(self) -> int:
        """The devices the batch is split over."""
        return math.prod(self.mesh_shape.get(a, 1) for a in DATA_AXES)


def candidates(n: int, layouts: Sequence[LayoutSpec] | None = None) -> list[Candidate]:
    """Every layout on every split of ``n`` devices, or the exact candidates given.

    A name stands for every split: each axis of a multi-axis layout at least 2 (all
    ``d × m = n``, and for ``dp+fsdp+tp`` all ``d × f × m = n``: 10 for 64 devices, 28
    for 512); one ``dp`` candidate for a single device. ``(name, {axis: size})`` is that
    one candidate (see `exact_candidate`).

    >>> [c.label for c in candidates(4, ['dp', 'dp+tp'])]
    ['dp (data=4)', 'dp+tp (data=2×model=2)']
    >>> [c.label for c in candidates(8, [('dp+fsdp+tp', {'model': 2, 'data': 2, 'fsdp': 2})])]
    ['dp+fsdp+tp (data=2×fsdp=2×model=2)']
    """
    chosen = list(LAYOUTS) if layouts is None else list(layouts)
    names = [x if isinstance(x, str) else x[0] for x in chosen]
    if n == 1 and all(isinstance(x, str) for x in chosen):
        return [Candidate(names[0] if names[0] in ("dp", "fsdp") else "dp", {"data": 1})]
    out = []
    for spec in chosen:
        if not isinstance(spec, str):
            out.append(exact_candidate(spec, n))
            continue
        axes = LAYOUTS[spec]
        for sizes in splits(n, len(axes)):
            out.append(Candidate(spec, dict(zip(axes, sizes, strict=True))))
    return out


def splits(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ``(s1, ..., sk)`` with product ``n``, each at least 2 when ``k > 1``, the
    innermost (last) growing first.

    >>> splits(8, 2), splits(8, 3), splits(8, 1)
    ([(4, 2), (2, 4)], [(2, 2, 2)], [(8,)])
    """
    if k == 1:
        return [(n,)]
    out = []
    for last in range(2, n // 2 + 1):
        if n % last == 0:
            out += [(*rest, last) for rest in splits(n // last, k - 1) if min(rest) >= 2]
    return out


def exact_candidate(spec: Any, n: int) -> Candidate:
    """``(name, {axis: size, ...})`` as a `Candidate` on ``n`` devices, its axes put in
    the layout's mesh order.

    Raises:
      ValueError: an unknown layout, axes other than the layout's, a size that is not a
        positive integer, or sizes whose product is not ``n``.

    >>> exact_candidate(('fsdp+tp', {'model': 4, 'fsdp': 16}), 64).label
    'fsdp+tp (fsdp=16×model=4)'
    """
    from ... import _errors

    if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], Mapping)):
        raise ValueError(_errors.plan_bad_layout_spec(spec, list(LAYOUTS)))
    name, sizes = spec
    if name not in LAYOUTS:
        raise ValueError(_errors.plan_unknown_layouts([name], list(LAYOUTS)))
    axes = LAYOUTS[name]
    if set(sizes) != set(axes):
        raise ValueError(_errors.plan_bad_candidate(name, dict(sizes), axes, n))
    bad = {a: s for a, s in sizes.items() if not isinstance(s, int) or isinstance(s, bool)}
    bad |= {a: s for a, s in sizes.items() if a not in bad and s < 1}
    if bad or math.prod(sizes.values()) != n:
        raise ValueError(_errors.plan_bad_candidate(name, dict(sizes), axes, n))
    return Candidate(name, {a: sizes[a] for a in axes})


def shard_largest(shape: Sequence[int], spec: Sequence[Any], axis: Any, size: int) -> tuple:
    """``spec`` (padded to the rank) with ``axis`` (a mesh axis, or a tuple of them) on the
    largest free dimension ``size`` divides (the first of equals); unchanged where none
    does."""
    spec = list(spec) + [None] * (len(shape) - len(spec))
    free = [d for d, n in enumerate(shape) if spec[d] is None and n % size == 0 and n >= size]
    if free and size > 1:
        best = max(free, key=lambda d: (shape[d], -d))
        spec[best] = axis
    return tuple(spec)


def _trim(spec: Sequence[Any]) -> P:
    spec = list(spec)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def metadata_tp(
    variables: Sequence[tuple[Path, nnx.Variable]], rules: Rules | None, axis: str = "model"
) -> dict[Path, P] | None:
    """Specs over one mesh ``axis`` (tensor parallelism's ``model``, the pipeline's
    ``stage``, expert parallelism's ``expert``) from the Variables' sharding metadata
    (``out_sharding``), logical names mapped by ``rules`` (names taken as mesh axes
    without rules); only ``axis`` is kept. None when no Variable's metadata names
    ``axis``."""
    mapping = None if rules is None else dict(rules)
    out: dict[Path, P] = {}
    for path, var in variables:
        declared = var.get_metadata().get("out_sharding")
        if not declared or not isinstance(declared, (tuple, P)):
            continue
        entries = []
        for name in declared:
            mapped = name if mapping is None else mapping.get(name) if name is not None else None
            names = mapped if isinstance(mapped, tuple) else (mapped,)
            entries.append(axis if axis in names else None)
        out[path] = _trim(entries)
    return out if any(axis in tuple(s) for s in out.values()) else None


def mirror(specs: Mapping[Path, P], variables: Sequence[tuple[Path, nnx.Variable]]) -> dict:
    """``specs`` completed for Variables it lacks, from the Variable whose path is the
    longest suffix of theirs with the same shape (adam's ``mu``/``nu`` mirror the
    parameters: ``('opt_state', 0, 'mu', 'up')`` takes ``('up',)``'s spec)."""
    out = dict(specs)
    shapes = {p: _shape(v) for p, v in variables}
    for path, var in variables:
        if path in out:
            continue
        for k in range(1, len(path)):
            tail = path[k:]
            if tail in specs and shapes.get(tail) == _shape(var):
                out[path] = specs[tail]
                break
    return out


def _shape(var: nnx.Variable) -> tuple[int, ...]:
    return tuple(getattr(var.get_value(), "shape", ()))


def node_specs(
    candidate: Candidate,
    variables: Sequence[tuple[Path, nnx.Variable]],
    tp: Mapping[Path, P] | None,
    where: str,
    stage: Mapping[Path, P] | None = None,
    expert: Mapping[Path, P] | None = None,
) -> tuple[dict[Path, P], list[str]]:
    """Each Variable's PartitionSpec under ``candidate``, and the problems found
    (a tensor-parallel, pipeline or expert split its dimension does not divide).
    ``tp``, ``stage`` and ``expert``: the specs over ``model``, ``stage`` and
    ``expert`` (`metadata_tp`); FSDP then takes the largest free dimension, over
    `FSDP_AXES` together where one dimension takes them, else over each it can."""
    mesh = candidate.mesh_shape
    layout = candidate.layout
    specs: dict[Path, P] = {}
    problems: list[str] = []
    for path, var in variables:
        shape = _shape(var)
        spec: tuple = (None,) * len(shape)
        for axis, given in ((STAGE, stage), (EXPERT, expert), ("model", tp)):
            if axis not in mesh or given is None or path not in given:
                continue
            entries = tuple(given[path]) + (None,) * (len(shape) - len(given[path]))
            spec = tuple(a if b is None else b for a, b in zip(spec, entries, strict=True))
            for dim, entry in enumerate(entries):
                if entry is not None and shape[dim] % mesh[axis]:
                    problems.append(
                        f"{where}{_path(path)}: dimension {dim} ({shape[dim]}) is not "
                        f"divisible by {axis!r} ({mesh[axis]})"
                    )
        fsdp = [a for a in FSDP_AXES if a in mesh]
        if fsdp:
            together = shard_largest(shape, spec, tuple(fsdp) if len(fsdp) > 1 else fsdp[0],
                                     math.prod(mesh[a] for a in fsdp))  # fmt: skip
            if together == spec:  # no dimension takes them together: each where it can
                for axis in fsdp:
                    together = shard_largest(shape, together, axis, mesh[axis])
            spec = together
        elif layout == "zero1" and isinstance(var, nnx.OptState):
            spec = shard_largest(shape, spec, "data", mesh["data"])
        specs[path] = _trim(spec)
    return specs, problems


def data_spec(candidate: Candidate, shape: Sequence[int], where: str) -> tuple[P, str | None]:
    """A data argument's spec: leading dimension over the data-parallel axes."""
    axes = tuple(a for a in DATA_AXES if a in candidate.mesh_shape)
    if not axes or not shape:
        return P(), None
    size = math.prod(candidate.mesh_shape[a] for a in axes)
    if shape[0] % size:
        named = ",".join(f"{a}={candidate.mesh_shape[a]}" for a in axes)
        return P(), (
            f"{where}: leading dimension {shape[0]} (the batch) is not divisible by the "
            f"data-parallel axes {named} ({size})"
        )
    return P(axes[0] if len(axes) == 1 else axes), None


def _path(path: Path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
