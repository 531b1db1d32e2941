"""Logical names for activations, bound to the axes of the mesh set with ``jax.set_mesh``.

The decoder says how each activation is laid out by name (``activation_batch``,
``activation_embed``, ...), as MaxText's ``logical_axis_rules`` do; each candidate of
the planner binds the names to its own axes, since it traces the step under
``jax.set_mesh(mesh)``. The batch goes over the data-parallel axes (``data``, ``fsdp``,
``expert``, as MaxText's) and, under tensor parallelism, the residual stream between
blocks over ``model`` (MaxText's ``activation_embed``, Megatron's sequence parallelism):
without that, a
tensor-parallel layout holds full-width activations on every device, and its memory is
wrong by the TP degree. Without a mesh the names do nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

ACTIVATION_RULES: Mapping[str, tuple[str, ...]] = {
    "activation_batch": ("data", "fsdp", "expert"),
    "activation_length": ("context",),
    "activation_embed": ("model",),
    "activation_heads": ("model",),
    "activation_kv_heads": ("model",),
    "activation_mlp": ("model",),
    "activation_vocab": ("model",),
}
"""Each logical activation name and the mesh axes it goes over, where the mesh has them
(``activation_length``: the ``context`` axis, context parallelism's sequence split)."""


def activation_spec(
    shape: Sequence[int],
    names: Sequence[str | None],
    rules: Mapping[str, tuple[str, ...]] = ACTIVATION_RULES,
) -> P | None:
    """The PartitionSpec ``names`` give an array of ``shape`` on the current abstract
    mesh, or None where it names no axis the mesh has (no mesh: always None).

    A dimension takes the mesh axes of its name that the mesh has with more than one
    device, as many of them, in order, as together divide its size.

    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('fsdp', 'model'))
    >>> with jax.sharding.use_abstract_mesh(mesh):
    ...     activation_spec((8, 16, 64), ('activation_batch', None, 'activation_embed'))
    P('fsdp', None, 'model')
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    entries: list[str | tuple[str, ...] | None] = []
    for size, name in zip(shape, names, strict=True):
        axes: list[str] = []
        for axis in rules.get(name, ()) if name is not None else ():
            if sizes.get(axis, 1) > 1 and size % math.prod(sizes[a] for a in [*axes, axis]) == 0:
                axes.append(axis)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries) if entries else None


def constrain_activation(
    x: jax.Array,
    names: Sequence[str | None],
    rules: Mapping[str, tuple[str, ...]] = ACTIVATION_RULES,
) -> jax.Array:
    """``x`` constrained to the layout ``names`` give it on the current mesh
    (`activation_spec`); ``x`` unchanged where they name no axis the mesh has.

    >>> constrain_activation(jax.numpy.ones((2, 3)), ('activation_batch', None)).shape
    (2, 3)
    """
    spec = activation_spec(x.shape, names, rules)
    return x if spec is None else place(x, spec)


def place(x: jax.Array, spec: P) -> jax.Array:
    """``x`` laid out as ``spec`` on the current mesh: ``jax.sharding.reshard`` where its
    axes are all Explicit (a sharding constraint there only asserts), else a sharding
    constraint; without a mesh, ``x`` as it is.

    >>> place(jax.numpy.ones(3), P()).shape
    (3,)
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    if all(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)
