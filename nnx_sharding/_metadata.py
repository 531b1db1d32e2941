"""Placing Variables by their sharding metadata (`shard`) and reading placements."""

from __future__ import annotations

import warnings
from typing import Any, TypeAlias, TypeVar

import jax
from flax import nnx
from flax.typing import MISSING, Missing
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from . import _errors
from ._logical import Rules, context_mesh, metadata_specs, state_of
from ._nodes import Path, format_path
from ._sharding import variable_shardings
from ._state_sharding import StateSharding
from ._types import ShardingLike

T = TypeVar("T")


def on_abstract_mesh(s: ShardingLike) -> bool:
    """Whether ``s`` is a NamedSharding on an AbstractMesh (no devices)."""
    return isinstance(s, NamedSharding) and isinstance(s.mesh, AbstractMesh)


def concrete(sharding: ShardingLike) -> ShardingLike:
    """A NamedSharding on an abstract mesh moved to the equal concrete mesh in context."""
    mesh = jax.sharding.get_mesh()
    if on_abstract_mesh(sharding) and mesh.abstract_mesh == sharding.mesh:  # type: ignore[union-attr]
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


def shard(
    tree: T,
    shardings: Placement = None,
    rules: Rules | None = None,
    *,
    mesh: Mesh | None | Missing = MISSING,
) -> T:
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
      mesh: deprecated: the name ``shardings`` had before (a Mesh, or None for the
        mesh set with ``jax.set_mesh``); accepted with a ``DeprecationWarning`` until
        the next release.

    Returns:
      ``tree`` itself, its Variables now holding the placed arrays (all or, on an
      error, none of them).

    Raises:
      ValueError: a Variable no filter matches, a logical name no rule maps, a mesh
        axis the mesh lacks, a PartitionSpec without a mesh, or a sharding that does
        not fit its array; the message names the Variable's path.
      TypeError: ``rules`` with ``shardings`` that are not a Mesh or None, or both
        ``shardings`` and its old name ``mesh``.

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
    if not isinstance(mesh, Missing):
        if shardings is not None:
            raise TypeError(
                _errors.old_and_new_keyword(
                    "shard", "mesh", "shardings", "nnx_sharding.shard(model, shardings=mesh)"
                )
            )
        warnings.warn(
            "shard: `mesh` is deprecated; use `shardings`, which takes the same values "
            "(`nnx_sharding.shard(model, shardings=mesh)`). `mesh` will be removed in the "
            "next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        shardings = mesh
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
