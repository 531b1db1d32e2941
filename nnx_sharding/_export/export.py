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
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from .. import _errors
from .._callpath.jit_body import make_inner
from .._callpath.outside import (
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
from .._jit import JitWrapped
from .._nodes import format_path, is_array, is_node
from .._stages import arrange
from .program import Exported, flat_state, is_state, nested_state


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
        nested_state((site.path, v) for site, v in zip(here, chunk, strict=True))
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
        values = flat_state(node)
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
            states.append(nested_state((p, values[p]) for p in paths))
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


def _is_jax_argument(x: Any) -> bool:
    """What jax takes as an argument: an array, a ShapeDtypeStruct or a scalar."""
    return is_array(x) or isinstance(x, (bool, int, float, complex, np.generic))


def _as_state(node: Any) -> nnx.State:
    return nested_state(flat_state(node).items())


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
        if alone := [
            str(here[0])
            for graphdef, here in zip(plan.graphdefs, chunks(sites, plan.sizes), strict=True)
            if graphdef is not None and any(site.path == () for site in here)
        ]:
            raise TypeError(_errors.export_variable_argument("export", alone))
        if wrong := [
            (str(site), type(x).__name__)
            for x, site in zip(leaves, sites, strict=True)
            if not _is_jax_argument(x)
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
            call_leaves = jax.tree.leaves((dyn_args, dyn_kwargs), is_leaf=is_state)
            flat: list[Leaf] = []
            for leaf, graphdef, here in zip(
                call_leaves, plan.graphdefs, chunks(sites, plan.sizes), strict=True
            ):
                if graphdef is None:
                    flat.append(leaf)
                else:
                    values = flat_state(leaf)
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
        dyn_args, dyn_kwargs = arrange(plan, sites, avals, nested_state)
        exported = jax.export.export(jitted, platforms=platforms)(*dyn_args, **dyn_kwargs)
    return Exported(exported)
