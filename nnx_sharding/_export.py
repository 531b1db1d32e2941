"""`export`: ``jax.export`` for functions of NNX graph nodes, serializable without the model.

The exported program is a pure function of the modules' *state*: at each argument
position where the call had a graph node it takes an ``nnx.State`` of that node's
Variable values (plain arrays, nested ``nnx.State``s by attribute), and it returns
``(outputs, new_states)``: the function's outputs (an output graph node becomes its
State) and one updated State per graph-node argument, in argument order.

Graph definitions (the Python classes and static attributes) cannot be serialized,
and need not be: the serialized program and its ``in_tree``/``out_tree`` are all a
fresh process needs to run it, given the States as arrays.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias

import jax
import numpy as np
from flax import nnx
from jax.core import ShapedArray
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _errors
from ._graph import (
    TAG,
    CallPlan,
    CallSpec,
    Leaf,
    Site,
    chunks,
    full_inputs,
    split_call,
    unflatten_all,
)
from ._inner import make_inner
from ._jit import JitWrapped
from ._sharding import format_path, is_node
from ._stages import arrange
from ._types import HloSharding, PyTreeDef

Path: TypeAlias = tuple[Any, ...]


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


def _nested_state(pairs: Iterable[tuple[Path, Any]]) -> nnx.State:
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


def _flat(state: Any) -> dict[Path, Any]:
    """``path -> array`` of a State (of Variables or of values) or of a graph node."""
    if is_node(state) and not isinstance(state, nnx.State):
        state = nnx.state(state)
    return {
        tuple(path): value.get_raw_value() if isinstance(value, nnx.Variable) else value
        for path, value in nnx.to_flat_state(state)
    }


def _is_state(x: Any) -> bool:
    return isinstance(x, nnx.State)


def _is_input(x: Any) -> bool:
    return is_node(x) or isinstance(x, nnx.State)


# --- export ------------------------------------------------------------------------------------


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
        expected, expected_def = jax.tree.flatten(expected_leaves, is_leaf=_is_state)
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
                have = _flat(value)
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
        nodes = [value for value, want in zip(given, expected, strict=True) if _is_state(want)]
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


def _wheres(expected: Any, is_leaf: Callable[[Any], bool] = _is_state) -> list[str]:
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


def _resolve(sharding: Any, site: Site) -> NamedSharding | None:
    """A leaf's sharding for export: NamedShardings kept, specs bound to the context mesh."""
    if isinstance(sharding, PartitionSpec):
        mesh = jax.sharding.get_mesh()
        mesh = jax.sharding.get_abstract_mesh() if mesh.empty else mesh
        if mesh.empty:
            raise ValueError(_errors.export_spec_without_mesh("export", repr(sharding), str(site)))
        return NamedSharding(mesh, sharding)
    return sharding if isinstance(sharding, NamedSharding) else None


def _node_states(plan: CallPlan, sites: Sequence[Site], values: Sequence[Any]) -> tuple:
    return tuple(
        _nested_state((site.path, v) for site, v in zip(here, chunk, strict=True))
        for graphdef, chunk, here in zip(
            plan.graphdefs, chunks(values, plan.sizes), chunks(sites, plan.sizes), strict=True
        )
        if graphdef is not None
    )


def _states_by_path(
    plan: CallPlan, sites: Sequence[Site], nodes: Sequence[Any], sizes: Sequence[int]
) -> tuple:
    """The new States of the graph-node arguments, read by path from the updated nodes.

    Raises if a node gained or lost a Variable: a new structure cannot travel.
    """
    states, changed, changes = [], [], {}
    for node, graphdef, size, new_size, here, where in zip(
        nodes,
        plan.graphdefs,
        plan.sizes,
        sizes,
        chunks(sites, plan.sizes),
        plan.wheres,
        strict=True,
    ):
        if graphdef is None:
            continue
        values = _flat(node)
        paths = [tuple(site.path) for site in here]
        known = set(paths)
        if new_size != size or any(p not in values for p in paths):
            changed.append(where)
            changes[where] = [
                _errors.graph_change("removed", where + format_path(p), "Variable")
                for p in paths
                if p not in values
            ] + [
                _errors.graph_change("added", where + format_path(p), "Variable")
                for p in values
                if p not in known
            ]
        else:
            states.append(_nested_state((p, values[p]) for p in paths))
    if changed:
        raise ValueError(
            _errors.structure_changed(
                "export",
                "fun",
                changed,
                "an exported program takes and returns module states; the graph structure "
                "cannot travel with it",
                "exported function, before exporting",
                changes,
            )
        )
    return tuple(states)


def _is_array(x: Any) -> bool:
    """What jax takes as an argument: an array, a ShapeDtypeStruct or a scalar."""
    return (hasattr(x, "shape") and hasattr(x, "dtype")) or isinstance(
        x, (bool, int, float, complex, np.generic)
    )


def _as_state(node: Any) -> nnx.State:
    return _nested_state(_flat(node).items())


def export(
    fun: Callable[..., Any],
    *args: Any,
    platforms: Sequence[str] | None = None,
    **kwargs: Any,
) -> Exported:
    """``jax.export`` of ``fun(*args, **kwargs)``, whose arguments may hold graph nodes.

    ``fun`` is a function of modules (and arrays) or a `JitWrapped`, whose
    ``in_shardings`` and static arguments are then used. Arguments may be concrete or
    abstract (Variables holding ``jax.ShapeDtypeStruct``s, e.g. from ``nnx.eval_shape``);
    each array keeps its sharding (a ``NamedSharding``; PartitionSpecs are bound to
    the mesh in context), and each updated Variable leaves with the sharding it came
    in with. The program takes the modules' States and returns ``(outputs,
    new_states)``; see `Exported`.

    Args:
      fun: the function, or a `JitWrapped`.
      *args: its positional arguments (or ShapeDtypeStructs / abstract modules).
      platforms: the platforms to lower for, e.g. ``('cpu', 'cuda', 'tpu')``;
        default: the default backend's.
      **kwargs: its keyword arguments.

    Returns:
      An `Exported`.

    Raises:
      ValueError: the function changed the graph structure of an argument (adding or
        removing Variables or submodules cannot be exported).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import nnx_sharding
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> exported = nnx_sharding.export(lambda m, x: m(x), model, jnp.ones((1, 2)))
    >>> restored = nnx_sharding.deserialize(exported.serialize())
    >>> y, (state,) = restored.call(nnx.state(model), jnp.ones((1, 2)))
    >>> y.shape, state['kernel'].shape
    ((1, 3), (2, 3))
    """
    if not callable(fun):
        raise TypeError(
            _errors.not_callable("export", fun, "*args", "jax.export.export", decorator=False)
        )
    bound: tuple[Any, ...] = ()
    if isinstance(fun, JitWrapped):
        spec = dataclasses.replace(
            fun._spec, transform="export", donate_argnums=frozenset(), donate_argnames=frozenset()
        )
        bound, fun = fun._bound, fun.fun
    else:
        spec = CallSpec("export")
    with nnx.update_context(TAG):
        plan, leaves, sites, _ = split_call(spec, (*bound, *args), kwargs)
        if wrong := [
            (str(site), type(x).__name__)
            for x, site in zip(leaves, sites, strict=True)
            if not _is_array(x)
        ]:
            raise TypeError(_errors.export_not_arrays("export", wrong))
        shardings = [
            _resolve(s if s is not None else getattr(x, "sharding", None), site)
            for x, s, site in zip(leaves, plan.shardings, sites, strict=True)
        ]
        avals = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) if hasattr(x, "shape") else x
            for x, s in zip(leaves, shardings, strict=True)
        ]
        inner = make_inner(fun, plan)

        def exported_fun(*dyn_args: Any, **dyn_kwargs: Any) -> tuple[Any, tuple]:
            call_leaves = jax.tree.leaves((dyn_args, dyn_kwargs), is_leaf=_is_state)
            flat: list[Leaf] = []
            for leaf, graphdef, here in zip(
                call_leaves, plan.graphdefs, chunks(sites, plan.sizes), strict=True
            ):
                if graphdef is None:
                    flat.append(leaf)
                else:
                    values = _flat(leaf)
                    flat += [values[tuple(site.path)] for site in here]
            donated, kept = plan.partition(flat)
            out_plan, in_flat, out_flat = inner(donated, kept)
            full = full_inputs(out_plan, flat, in_flat)
            with nnx.merge_context() as ctx:
                in_nodes = unflatten_all(ctx, out_plan.in_graphdefs, full, out_plan.in_sizes)
                out_leaves = unflatten_all(
                    ctx, out_plan.out_graphdefs, out_flat, out_plan.out_sizes
                )
            outputs = jax.tree_util.tree_unflatten(out_plan.out_treedef, out_leaves)
            outputs = jax.tree.map(
                lambda x: _as_state(x) if is_node(x) else x, outputs, is_leaf=is_node
            )
            if out_plan.in_changed is not None:  # the same structure: read by position
                return outputs, _node_states(plan, sites, full)
            return outputs, _states_by_path(plan, sites, in_nodes, out_plan.in_sizes)

        exported_fun.__name__ = getattr(fun, "__name__", "fun")
        exported_fun.__qualname__ = getattr(fun, "__qualname__", exported_fun.__name__)
        out_shardings = (None, _node_states(plan, sites, shardings))
        jitted = jax.jit(exported_fun, out_shardings=out_shardings)
        dyn_args, dyn_kwargs = arrange(plan, sites, avals, _nested_state)
        exported = jax.export.export(jitted, platforms=platforms)(*dyn_args, **dyn_kwargs)
    return Exported(exported)


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
