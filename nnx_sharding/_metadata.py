"""Shardings from Variable metadata: `StateSharding.from_metadata` and `shard`."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, TypeAlias, TypeVar

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from . import _errors
from ._sharding import (
    AtPath,
    Path,
    ShardingLike,
    StateSharding,
    _alias_paths,
    format_path,
    is_node,
    variable_shardings,
)

MeshAxes: TypeAlias = str | tuple[str, ...] | None
"""What a logical axis name maps to: a mesh axis, several, or None (replicated)."""
Rules: TypeAlias = Sequence[tuple[str, MeshAxes]]
"""``(logical name, mesh axes)`` pairs, the form of flax's ``nnx.logical_axis_rules``."""
AnyMesh: TypeAlias = Mesh | AbstractMesh
T = TypeVar("T")


def state_of(transform: str, tree: Any) -> nnx.State:
    """The ``nnx.State`` of a graph node, or the State itself."""
    if isinstance(tree, nnx.State):
        return tree
    if is_node(tree) and not isinstance(tree, nnx.Variable):
        return nnx.state(tree)
    raise TypeError(_errors.not_a_node(transform, "tree", type(tree).__name__))


def check_rules(transform: str, rules: Rules | None) -> tuple[tuple[str, MeshAxes], ...] | None:
    """Validates the ``(logical name, mesh axes)`` pairs; None stays None."""
    if rules is None:
        return None
    if isinstance(rules, (str, dict)):
        raise TypeError(_errors.bad_rules(transform, f"got a {type(rules).__name__}"))
    checked = []
    for i, pair in enumerate(rules):
        ok = isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
        target = pair[1] if ok else None
        ok = ok and (
            target is None
            or isinstance(target, str)
            or (isinstance(target, tuple) and all(isinstance(a, str) for a in target))
        )
        if not ok:
            raise TypeError(_errors.bad_rules(transform, f"entry {i} is {pair!r}"))
        checked.append((pair[0], target))
    return tuple(checked)


def axis_names(entries: Any) -> list[str]:
    """The axis names of a spec or metadata tuple, in order (None and UNCONSTRAINED dropped)."""
    names: list[str] = []
    for entry in entries or ():
        for name in entry if isinstance(entry, (tuple, list)) else (entry,):
            if isinstance(name, str):
                names.append(name)
    return names


def context_mesh() -> AnyMesh | None:
    """The mesh set by ``jax.set_mesh`` (concrete where possible), or None."""
    mesh = jax.sharding.get_mesh()
    if not mesh.empty:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract.empty else abstract


def abstract(s: ShardingLike) -> bool:
    """Whether ``s`` is a NamedSharding on an AbstractMesh (no devices)."""
    return isinstance(s, NamedSharding) and isinstance(s.mesh, AbstractMesh)


def concrete(sharding: ShardingLike) -> ShardingLike:
    """A NamedSharding on an abstract mesh moved to the equal concrete mesh in context."""
    mesh = jax.sharding.get_mesh()
    if abstract(sharding) and mesh.abstract_mesh == sharding.mesh:  # type: ignore[union-attr]
        return NamedSharding(mesh, sharding.spec)  # type: ignore[union-attr]
    return sharding


def placement(value: Any, var: nnx.Variable | None) -> ShardingLike:
    """A value's own sharding, else its metadata's on a mesh; abstract meshes made concrete."""
    sharding = getattr(value, "sharding", None)
    if sharding is None and var is not None and var.get_metadata().get("out_sharding"):
        declared = var.get_metadata()["out_sharding"]
        if isinstance(declared, Sharding):
            return declared
        spec = nnx.get_partition_spec(var).get_value()
        mesh = var.get_metadata().get("mesh") or context_mesh()
        sharding = spec if mesh is None else NamedSharding(mesh, spec)
    return concrete(sharding)


def metadata_specs(
    transform: str,
    tree: Any,
    rules: Rules | None,
    mesh: AnyMesh | None = None,
    *,
    bind: bool = True,
) -> list[tuple[Path, nnx.Variable, ShardingLike]]:
    """``(path, Variable, sharding)`` for each Variable, from its sharding metadata.

    Names in ``out_sharding`` go through ``rules`` (flax's ``nnx.logical_axis_rules``
    and ``nnx.get_partition_spec`` do the mapping). A Variable without metadata gets
    ``P()``, a value without a shape None. The spec becomes a `NamedSharding` on the
    Variable's own ``mesh`` metadata, else (when ``bind``) on ``mesh``; the mesh axes
    are checked against that mesh. All problems are reported at once.
    """
    state = state_of(transform, tree)
    checked = check_rules(transform, rules)
    out: list[tuple[Path, nnx.Variable, ShardingLike]] = []
    unknown: list[str] = []
    missing_axes: list[str] = []
    lacking_axes: dict[str, None] = {}
    known: dict[str, None] = dict.fromkeys(name for name, _ in checked or ())
    mesh_axes: Sequence[str] = ()
    rules_context = (
        nnx.logical_axis_rules(checked) if checked is not None else contextlib.nullcontext()
    )
    with rules_context:
        for path, var in nnx.to_flat_state(state):
            where = f"{format_path(path) or '<root>'} ({type(var).__name__})"
            metadata = var.get_metadata()
            declared = metadata.get("out_sharding")
            if isinstance(declared, Sharding):
                out.append((tuple(path), var, declared))
                continue
            if declared and checked is not None:
                local = dict(checked) | dict(metadata.get("sharding_rules") or ())
                unknown += [
                    f"the Variable at {where} names the logical axis {name!r}, which no rule maps"
                    for name in axis_names(declared)
                    if name not in local
                ]
            spec = nnx.get_partition_spec(var).get_value()
            own_mesh = metadata.get("mesh")
            var_mesh = own_mesh or mesh
            if isinstance(spec, PartitionSpec) and var_mesh is not None:
                lacking = [a for a in axis_names(spec) if a not in var_mesh.axis_names]
                mesh_axes = var_mesh.axis_names if lacking else mesh_axes
                lacking_axes.update(dict.fromkeys(lacking))
                missing_axes += [
                    f"the Variable at {where} is sharded over {name!r}, which the mesh "
                    f"{dict(var_mesh.shape)} lacks"
                    for name in lacking
                ]
                if declared and not lacking and (own_mesh is not None or bind):
                    spec = NamedSharding(var_mesh, spec)
            out.append((tuple(path), var, spec))
    if unknown:
        raise ValueError(_errors.unknown_logical_axes(transform, unknown, list(known)))
    if missing_axes:
        raise ValueError(
            _errors.unknown_mesh_axes(
                transform, "tree", missing_axes, mesh_axes, list(lacking_axes)
            )
        )
    return out


def from_metadata(tree: Any, rules: Rules | None = None) -> StateSharding:
    """`StateSharding.from_metadata`: one exact-path entry per Variable and alias path."""
    transform = "StateSharding.from_metadata"
    specs = metadata_specs(transform, tree, rules, context_mesh(), bind=False)
    pairs = [(path, spec) for path, _, spec in specs]
    if is_node(tree) and not isinstance(tree, nnx.State):
        pairs += list(_alias_paths(tree, dict(pairs)))
    return StateSharding([(AtPath(path), spec) for path, spec in pairs])


Placement: TypeAlias = Mesh | StateSharding | Sharding | PartitionSpec | None
"""What `shard` places a tree by: a mesh for the metadata, or the shardings themselves."""


def _given_shardings(tree: Any, shardings: Placement) -> list[tuple[Path, nnx.Variable, Any]]:
    """``(path, Variable, sharding or spec)`` for each Variable ``shardings`` places, as
    `jit`'s ``in_shardings`` entry for a graph node resolves it (filters, shared
    Variables, None: left as it is)."""
    state = state_of("shard", tree)
    flat = [(tuple(path), var) for path, var in nnx.to_flat_state(state)]
    if not isinstance(shardings, StateSharding):
        return [(path, var, shardings) for path, var in flat]
    if isinstance(tree, nnx.State):  # no graph, no shared Variables: filters only
        found = [(path, var, shardings.find(path, var)) for path, var in flat]
        missing = [(format_path(p) or "<root>", type(v).__name__) for p, v, i in found if i is None]
        if missing:
            (where, type_name), *more = missing
            raise ValueError(
                _errors.no_filter_matched(
                    where, type_name, shardings.filters, "shard", "shardings", more
                )
            )
        return [(p, v, shardings.shardings[i]) for p, v, i in found if i is not None]
    chosen = variable_shardings("shard", "shardings", [("", tree, shardings)])
    return [(path, var, chosen[id(var)][0]) for path, var in flat if id(var) in chosen]


def shard(tree: T, shardings: Placement = None, rules: Rules | None = None) -> T:
    """Places the Variables of ``tree``, in place: ``jax.device_put`` for a module.

    ``shardings`` says where, as ``jit``'s ``in_shardings`` entry for a module does:

    - a `StateSharding` (or a ``jax.sharding.Sharding``, or a ``PartitionSpec`` for
      every Variable): each Variable goes where its filter says; ``None`` entries leave
      a Variable as it is; PartitionSpecs refer to the mesh set with ``jax.set_mesh``;
    - a ``Mesh``, or None for the mesh set with ``jax.set_mesh``: each Variable goes
      where its sharding metadata (``nnx.with_partitioning``) says, its logical names
      mapped to mesh axes by ``rules``; Variables without metadata are replicated.

    Arrays already on devices (committed ones included) are moved; abstract values
    (``nnx.eval_shape``) get a ``ShapeDtypeStruct`` carrying the sharding instead;
    values that are not arrays (a Python scalar) are left as they are.

    Args:
      tree: a graph node (e.g. a Module or an Optimizer) or an ``nnx.State``.
      shardings: a StateSharding, a Sharding, a PartitionSpec, a Mesh or None (see
        above).
      rules: for metadata only: ``(logical name, mesh axis or None)`` pairs as in
        flax's ``nnx.logical_axis_rules``; None uses flax's rules in context, if any,
        and otherwise reads the metadata names as mesh axes.

    Returns:
      ``tree`` itself, its Variables now holding the placed arrays (all or, on an
      error, none of them).

    Raises:
      ValueError: a Variable no filter matches, a logical name no rule maps, a mesh
        axis the mesh lacks, a PartitionSpec without a mesh, or a sharding that does
        not fit its array; the message names the Variable's path.
      TypeError: ``rules`` with ``shardings`` that are not a Mesh or None.

    >>> import jax
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> import nnx_sharding
    >>> mesh = jax.make_mesh((8,), ('model',), axis_types=(jax.sharding.AxisType.Auto,))
    >>> model = nnx.Linear(2, 8, rngs=nnx.Rngs(0))
    >>> kernels = nnx.PathContains('kernel')
    >>> shardings = nnx_sharding.StateSharding({kernels: P(None, 'model'), ...: P()})
    >>> with jax.set_mesh(mesh):
    ...     model = nnx_sharding.shard(model, shardings)
    >>> model.kernel.get_value().sharding.spec
    P(None, 'model')

    From metadata, through logical axis rules:

    >>> init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
    >>> with nnx.use_eager_sharding(False):
    ...     model = nnx.Linear(2, 8, kernel_init=init, rngs=nnx.Rngs(0))
    >>> model = nnx_sharding.shard(model, mesh, rules=[('embed', None), ('mlp', 'model')])
    >>> model.kernel.get_value().sharding.spec
    P(None, 'model')
    """
    if shardings is None or isinstance(shardings, Mesh):
        target = shardings if shardings is not None else context_mesh()
        if target is None:
            raise ValueError(
                _errors.no_mesh(
                    "shard", "PartitionSpecs from metadata need a mesh", "shard(model, mesh)"
                )
            )
        specs = metadata_specs("shard", tree, rules, target)
        source = "metadata"
    elif isinstance(shardings, (StateSharding, Sharding, PartitionSpec)):
        if rules is not None:
            raise TypeError(_errors.rules_without_metadata("shard", type(shardings).__name__))
        target = context_mesh()
        specs = _given_shardings(tree, shardings)
        source = "shardings"
    else:
        raise TypeError(_errors.bad_placement("shard", type(shardings).__name__))
    placed: list[tuple[nnx.Variable, Any]] = []  # all or nothing: set once every put worked
    no_mesh: list[tuple[str, PartitionSpec]] = []
    misfits: list[tuple[str, str]] = []
    jax_message = ""
    for path, var, spec in specs:
        if spec is None:
            continue
        where = format_path(path) or "<root>"
        if isinstance(spec, Sharding):
            sharding = spec
        elif target is None:
            no_mesh.append((where, spec))
            continue
        else:
            sharding = NamedSharding(target, spec)
        value = var.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):
            placed.append((var, jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)))
            continue
        if not hasattr(value, "shape"):
            continue  # not an array (a Python scalar, a string): nothing to place
        try:
            placed.append((var, jax.device_put(value, sharding)))
        except ValueError as e:
            misfits.append(
                (where, f"shape {tuple(value.shape)} with {getattr(sharding, 'spec', sharding)!r}")
            )
            jax_message = jax_message or str(e)
    if no_mesh:
        raise ValueError(_errors.spec_without_mesh("shard", no_mesh))
    if misfits:
        raise ValueError(_errors.cannot_place("shard", misfits, jax_message, source))
    for var, value in placed:
        var.set_value(value)
    return tree
