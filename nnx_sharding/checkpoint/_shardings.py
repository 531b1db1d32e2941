"""Where each restored Variable goes: ``shardings`` resolved as `jit` resolves a prefix,
else the target's own placement, else replicated on the context mesh or on one device;
every result checked to fit.

The prefix machinery is the package's (`prefixes`, `broadcast_prefix`,
`variable_shardings`); the fallback is `placement`, which `shard` uses: the value's
own sharding, else its sharding metadata on the mesh set with ``jax.set_mesh``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding
from jax.tree_util import keystr

from .. import _errors
from .._metadata import concrete, on_abstract_mesh, placement
from .._nodes import Path, is_node
from .._sharding import (
    broadcast_prefix,
    check_leaf_entries,
    incompatible_shardings,
    prefixes,
    variable_shardings,
)
from .._types import ShardingLike
from ._state import Tree, where

Shardings: TypeAlias = Any
"""What ``restore`` takes as ``shardings``: a `StateSharding`, a Sharding, a
PartitionSpec or None, or a pytree prefix of the target holding these (as `jit`'s
``in_shardings``)."""


def declared(transform: str, target: Tree, shardings: Shardings) -> dict[int, ShardingLike]:
    """``id(variable) -> sharding`` for the Variables ``shardings`` gives one (not None)."""
    if shardings is None:
        return {}
    prefix, _ = prefixes(transform, shardings, None, names=("shardings", "out_shardings"))
    keyed = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_node)[0]
    wheres = [f"target{keystr(kp)}" for kp, _ in keyed]
    leaves = [leaf for _, leaf in keyed]
    entries = broadcast_prefix(
        transform, "shardings", prefix, target, lambda kp: f"shardings{keystr(kp)}", "target"
    )
    check_leaf_entries(transform, "shardings", entries, leaves, wheres)
    table = variable_shardings(
        transform,
        "shardings",
        [(w, x, e) for w, x, e in zip(wheres, leaves, entries, strict=True) if is_node(x)],
    )
    return {key: sharding for key, (sharding, _) in table.items()}


def resolve(
    transform: str,
    target: Tree,
    shardings: Shardings,
    selected: Sequence[tuple[Path, nnx.Variable]],
    shapes: Sequence[jax.ShapeDtypeStruct],
) -> list[Sharding]:
    """The sharding each selected Variable is restored with; ``shapes``: their arrays'.

    Raises ValueError, listing every Variable concerned, for a PartitionSpec (or a
    sharding on an abstract mesh) with no mesh set to bind it to, and for a sharding
    that does not fit its array (a dimension its mesh axes do not divide).
    """
    table = declared(transform, target, shardings)
    mesh = jax.sharding.get_mesh()
    device = SingleDeviceSharding(jax.local_devices()[0])
    out: list[Sharding] = []
    unbound: list[str] = []
    failed: list[str] = []
    for path, var in selected:
        given = table.get(id(var))
        try:  # jax raises ValueError, or its DuplicateSpecError, for specs the mesh lacks
            sharding = concrete(given) if given is not None else placement(var.get_raw_value(), var)
            if sharding is None:  # nothing says where: replicated on the mesh, else one device
                sharding = device if mesh.empty else PartitionSpec()
            if isinstance(sharding, PartitionSpec) and not mesh.empty:
                sharding = NamedSharding(mesh, sharding)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{where('target', path)}: {e}")
            continue
        if isinstance(sharding, PartitionSpec) or on_abstract_mesh(sharding):
            on = getattr(sharding, "mesh", None)  # an abstract sharding on another mesh
            seen = (
                f" (the mesh set has the axes {dict(mesh.shape)})" if on and not mesh.empty else ""
            )
            unbound.append(f"{where('target', path)}: {sharding!r}{seen}")
            continue
        out.append(sharding)
    if failed:
        raise ValueError(_errors.unplaceable(transform, failed))
    if unbound:
        raise ValueError(_errors.no_mesh_for_restore(transform, unbound, not mesh.empty))
    sites = [where("target", path) for path, _ in selected]
    if misfits := incompatible_shardings(shapes, out, sites, mesh):
        raise ValueError(_errors.bad_shardings(transform, "shardings", misfits))
    return out
