"""`Exported`: a program exported by `export`, run and serialized without the model.

Its arguments are the call's with an ``nnx.State`` of arrays at each graph-node
position; `Exported.call` checks the States given against the exported avals, moves
them to the exported shardings and returns ``(outputs, new_states)``. ``nnx.State``
is registered with ``jax.export``'s serialization (by its keys), so `deserialize`
rebuilds an `Exported` from bytes in a process that has no model class.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import jax
from flax import nnx
from jax.core import ShapedArray
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import _errors
from .._callpath.outside import Leaf
from .._nodes import Path, format_path, is_node
from .._types import HloSharding, PyTreeDef

# --- nnx.State in in_tree/out_tree: jax.export serializes it by its keys -----------------------


def _keys_to_bytes(keys: tuple[Any, ...]) -> bytes:
    items = []
    for k in keys:
        if isinstance(k, bool) or not isinstance(k, (str, int)):
            raise ValueError(
                _errors.export_bad_key("Exported.serialize", repr(k), type(k).__name__)
            )
        items.append([k, isinstance(k, int)])
    return json.dumps(items).encode()


def _keys_from_bytes(data: bytes) -> tuple[Any, ...]:
    return tuple(int(k) if is_int else k for k, is_int in json.loads(data.decode()))


try:
    jax.export.register_pytree_node_serialization(
        nnx.State,
        serialized_name="flax.nnx.State",
        serialize_auxdata=_keys_to_bytes,
        deserialize_auxdata=_keys_from_bytes,
    )
except ValueError:  # registered already (by flax, or a reloaded module)
    pass


def nested_state(pairs: Iterable[tuple[Path, Any]]) -> nnx.State:
    """``[(path, value)]`` -> an ``nnx.State`` with a State (not a dict) at every level."""
    tree: dict[Any, Any] = {}
    for path, value in pairs:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value

    def build(d: dict[Any, Any]) -> nnx.State:
        return nnx.State({k: build(v) if isinstance(v, dict) else v for k, v in d.items()})

    return build(tree)


def flat_state(state: Any) -> dict[Path, Any]:
    """``path -> array`` of a State (of Variables or of values) or of a graph node."""
    if is_node(state) and not isinstance(state, nnx.State):
        state = nnx.state(state)
    return {
        tuple(path): value.get_raw_value() if isinstance(value, nnx.Variable) else value
        for path, value in nnx.to_flat_state(state)
    }


def is_state(x: Any) -> bool:
    return isinstance(x, nnx.State)


def _is_input(x: Any) -> bool:
    return is_node(x) or isinstance(x, nnx.State)


# --- the exported program -------------------------------------------------------------------


class Exported:
    """An exported program over module states; what `export` and `deserialize` return.

    It wraps a ``jax.export.Exported`` (``jax_exported``) whose arguments are the
    call's arguments with an ``nnx.State`` of arrays in place of each graph node, and
    whose result is ``(outputs, new_states)``. ``in_tree``, ``out_tree``,
    ``in_avals``, ``out_avals``, ``platforms``, ``nr_devices``, ``fun_name``,
    ``in_shardings_hlo``/``out_shardings_hlo`` and ``in_shardings_jax``/
    ``out_shardings_jax`` are jax's own.
    """

    def __init__(self, exported: jax.export.Exported):
        self.jax_exported = exported

    @property
    def in_tree(self) -> PyTreeDef:
        """See `jax.export.Exported`."""
        return self.jax_exported.in_tree

    @property
    def out_tree(self) -> PyTreeDef:
        """See `jax.export.Exported`."""
        return self.jax_exported.out_tree

    @property
    def in_avals(self) -> tuple[ShapedArray, ...]:
        """See `jax.export.Exported`."""
        return self.jax_exported.in_avals

    @property
    def out_avals(self) -> tuple[ShapedArray, ...]:
        """See `jax.export.Exported`."""
        return self.jax_exported.out_avals

    @property
    def platforms(self) -> tuple[str, ...]:
        """See `jax.export.Exported`."""
        return self.jax_exported.platforms

    @property
    def nr_devices(self) -> int:
        """See `jax.export.Exported`."""
        return self.jax_exported.nr_devices

    @property
    def fun_name(self) -> str:
        """See `jax.export.Exported`."""
        return self.jax_exported.fun_name

    @property
    def in_shardings_hlo(self) -> tuple[HloSharding | None, ...]:
        """See `jax.export.Exported`."""
        return self.jax_exported.in_shardings_hlo

    @property
    def out_shardings_hlo(self) -> tuple[HloSharding | None, ...]:
        """See `jax.export.Exported`."""
        return self.jax_exported.out_shardings_hlo

    def in_shardings_jax(self, mesh: Any = None) -> Any:
        """The input shardings on ``mesh`` (default: `mesh`), as a pytree like ``in_tree``."""
        mesh = self.mesh() if mesh is None else mesh
        return jax.tree.unflatten(self.in_tree, self.jax_exported.in_shardings_jax(mesh))

    def out_shardings_jax(self, mesh: Any = None) -> Any:
        """The output shardings on ``mesh`` (default: `mesh`), as a pytree like ``out_tree``."""
        mesh = self.mesh() if mesh is None else mesh
        return jax.tree.unflatten(self.out_tree, self.jax_exported.out_shardings_jax(mesh))

    def mesh(self) -> Mesh:
        """The mesh `call` runs on: the one set by ``jax.set_mesh``, else one like the
        exporter's (same axes and sizes) over the first ``nr_devices`` devices."""
        context = jax.sharding.get_mesh()
        if not context.empty:
            return context
        named = [
            s
            for s in (
                *getattr(self.jax_exported, "_in_named_shardings", ()),
                *getattr(self.jax_exported, "_out_named_shardings", ()),
            )
            if isinstance(s, NamedSharding)
        ]
        n = self.nr_devices
        if n > jax.device_count():
            raise ValueError(_errors.export_too_few_devices("Exported.call", n, jax.device_count()))
        if not named:
            return jax.make_mesh((n,), ("devices",), devices=jax.devices()[:n])
        abstract = named[0].mesh
        return jax.make_mesh(
            tuple(abstract.axis_sizes),
            tuple(abstract.axis_names),
            axis_types=tuple(abstract.axis_types),
            devices=jax.devices()[:n],
        )

    def mlir_module(self) -> str:
        """See `jax.export.Exported.mlir_module`."""
        return self.jax_exported.mlir_module()

    def serialize(self, vjp_order: int = 0) -> bytes:
        """The program as bytes, for `deserialize`; see `jax.export.Exported.serialize`."""
        return bytes(self.jax_exported.serialize(vjp_order=vjp_order))

    def call(self, *args: Any, **kwargs: Any) -> tuple[Any, tuple[nnx.State[Any, Any], ...]]:
        """Runs the program; returns ``(outputs, new_states)``.

        Give the dynamic arguments (static ones are baked in) with, at each graph-node
        position, the graph node itself or its ``nnx.State`` (of Variables or of
        arrays): Variables that the exported call did not take (a second path to a
        shared Variable) are ignored. A graph node given is updated in place. Arrays
        are moved to the exported shardings on `mesh` first.

        Returns:
          The outputs (graph nodes as States) and one ``nnx.State`` of arrays per
          graph-node argument, in argument order.
        """
        transform = "Exported.call"
        given, given_def = jax.tree.flatten((args, kwargs), is_leaf=_is_input)
        expected_leaves = jax.tree.unflatten(self.in_tree, list(range(self.in_tree.num_leaves)))
        expected, expected_def = jax.tree.flatten(expected_leaves, is_leaf=is_state)
        if given_def != expected_def:
            have, want = _wheres((args, kwargs), _is_input), _wheres(expected_leaves)
            raise TypeError(
                _errors.export_structure_mismatch(
                    transform,
                    str(given_def),
                    str(expected_def),
                    [w for w in want if w not in have],
                    [w for w in have if w not in want],
                )
            )
        avals = self.in_avals
        flat: list[Leaf] = []
        problems: list[str] = []
        where = _wheres(expected_leaves)
        for value, want, place in zip(given, expected, where, strict=True):
            if isinstance(want, nnx.State):
                if not _is_input(value):
                    problems.append(
                        _errors.export_wrong_kind(
                            place, "a graph node or nnx.State", type(value).__name__
                        )
                    )
                    continue
                have = flat_state(value)
                for path, index in nnx.to_flat_state(want):
                    label = place + format_path(path)
                    if tuple(path) not in have:
                        problems.append(f"{label}: missing")
                        continue
                    flat.append(have[tuple(path)])
                    problems += _aval_problem(label, flat[-1], avals[index])
            else:
                if _is_input(value):
                    problems.append(
                        _errors.export_wrong_kind(place, "an array", type(value).__name__)
                    )
                    continue
                flat.append(value)
                problems += _aval_problem(place, value, avals[want])
        if problems:
            raise TypeError(_errors.export_bad_arguments(transform, problems))
        if self.nr_devices > 1:
            mesh = self.mesh()
            shardings = self.jax_exported.in_shardings_jax(mesh)
            flat = [
                jax.device_put(x, s if s is not None else NamedSharding(mesh, PartitionSpec()))
                for x, s in zip(flat, shardings, strict=True)
            ]
        call_args, call_kwargs = jax.tree.unflatten(self.in_tree, flat)
        outputs, new_states = self.jax_exported.call(*call_args, **call_kwargs)
        nodes = [value for value, want in zip(given, expected, strict=True) if is_state(want)]
        for node, state in zip(nodes, new_states, strict=True):
            if is_node(node) and not isinstance(node, nnx.State):
                nnx.update(node, state)
        return outputs, tuple(new_states)

    __call__ = call

    def __repr__(self) -> str:
        return (
            f"Exported(fun_name={self.fun_name!r}, platforms={self.platforms!r}, "
            f"nr_devices={self.nr_devices})"
        )


def _wheres(expected: Any, is_leaf: Callable[[Any], bool] = is_state) -> list[str]:
    """``args[0]``, ``kwargs['x']``: the name of each leaf of ``(args, kwargs)``."""
    keyed, _ = jax.tree_util.tree_flatten_with_path(expected, is_leaf=is_leaf)
    out = []
    for keypath, _ in keyed:
        head, rest = keypath[0], keypath[1:]
        label = "args" if getattr(head, "idx", 0) == 0 else "kwargs"
        out.append(label + jax.tree_util.keystr(tuple(rest)))
    return out


def _aval_problem(label: str, value: Any, aval: Any) -> list[str]:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None:
        return []
    if tuple(shape) != tuple(aval.shape) or (dtype is not None and dtype != aval.dtype):
        return [f"{label}: got {dtype}{list(shape)}, exported for {aval.dtype}{list(aval.shape)}"]
    return []


def deserialize(data: bytes | bytearray) -> Exported:
    """The `Exported` that `Exported.serialize` wrote; needs no model class.

    >>> import jax.numpy as jnp
    >>> import nnx_sharding
    >>> data = nnx_sharding.export(lambda x: x * 2, jnp.ones(3)).serialize()
    >>> out, states = nnx_sharding.deserialize(data).call(jnp.ones(3))
    >>> out.tolist(), states
    ([2.0, 2.0, 2.0], ())
    """
    return Exported(jax.export.deserialize(bytearray(data)))
