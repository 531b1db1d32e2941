"""Shardings read from Variable metadata: logical axis names mapped through rules."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, TypeAlias

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from . import _errors
from ._nodes import Path, alias_paths, format_path, is_node
from ._types import ShardingLike

MeshAxes: TypeAlias = str | tuple[str, ...] | None
"""What a logical axis name maps to: a mesh axis, several, or None (replicated)."""
Rules: TypeAlias = Sequence[tuple[str, MeshAxes]]
"""``(logical name, mesh axes)`` pairs, the form of flax's ``nnx.logical_axis_rules``."""
AnyMesh: TypeAlias = Mesh | AbstractMesh


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


def metadata_pairs(transform: str, tree: Any, rules: Rules | None) -> list[tuple[Path, Any]]:
    """``(path, spec)`` for each Variable and each alias path of a shared one, from its
    metadata (`StateSharding.from_metadata`); specs are bound to the Variables' own meshes."""
    specs = metadata_specs(transform, tree, rules, context_mesh(), bind=False)
    pairs: list[tuple[Path, Any]] = [(path, spec) for path, _, spec in specs]
    if is_node(tree) and not isinstance(tree, nnx.State):
        pairs += list(alias_paths(tree, dict(pairs)))
    return pairs
