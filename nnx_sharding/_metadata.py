"""Placing Variables by their sharding metadata (`shard`) and reading placements."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, Sharding

from . import _errors
from ._logical import Rules, context_mesh, metadata_specs
from ._nodes import format_path
from ._types import ShardingLike

T = TypeVar("T")


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


def shard(tree: T, mesh: Mesh | None = None, rules: Rules | None = None) -> T:
    """Places the Variables of ``tree`` on ``mesh`` by their sharding metadata, in place.

    Each Variable's ``out_sharding`` metadata (``nnx.with_partitioning``) is mapped
    through ``rules`` to mesh axes and the value is ``jax.device_put`` there; Variables
    without metadata are replicated. Abstract values (``nnx.eval_shape``) get a
    ``ShapeDtypeStruct`` carrying the sharding instead.

    Args:
      tree: a graph node (e.g. a Module) or an ``nnx.State``.
      mesh: the mesh; defaults to the one set by ``jax.set_mesh``.
      rules: ``(logical name, mesh axis or None)`` pairs as in flax's
        ``nnx.logical_axis_rules``; None uses flax's rules in context, if any, and
        otherwise reads the metadata names as mesh axes.

    Returns:
      ``tree`` itself, its Variables now holding the placed arrays (all or, on an
      error, none of them).

    Raises:
      ValueError: a logical name no rule maps, a mesh axis the mesh lacks, or a spec
        that does not fit its array; the message names the Variable's path.

    >>> import jax
    >>> from flax import nnx
    >>> import nnx_sharding
    >>> init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
    >>> with nnx.use_eager_sharding(False):
    ...     model = nnx.Linear(2, 4, kernel_init=init, rngs=nnx.Rngs(0))
    >>> mesh = jax.make_mesh((1,), ('model',), axis_types=(jax.sharding.AxisType.Auto,))
    >>> model = nnx_sharding.shard(model, mesh, rules=[('embed', None), ('mlp', 'model')])
    >>> model.kernel.get_value().sharding.spec
    P(None, 'model')
    """
    target = mesh if mesh is not None else context_mesh()
    if target is None:
        raise ValueError(
            _errors.no_mesh(
                "shard", "PartitionSpecs from metadata need a mesh", "shard(model, mesh)"
            )
        )
    placed: list[tuple[nnx.Variable, Any]] = []  # all or nothing: set once every put worked
    for path, var, spec in metadata_specs("shard", tree, rules, target):
        if spec is None:
            continue
        sharding = spec if isinstance(spec, Sharding) else NamedSharding(target, spec)
        value = var.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):
            placed.append((var, jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)))
            continue
        try:
            placed.append((var, jax.device_put(value, sharding)))
        except ValueError as e:
            detail = f"shape {tuple(value.shape)} with {getattr(sharding, 'spec', sharding)!r}"
            raise ValueError(
                _errors.cannot_place("shard", format_path(path) or "<root>", detail, str(e))
            ) from None
    for var, value in placed:
        var.set_value(value)
    return tree
