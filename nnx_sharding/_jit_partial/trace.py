"""The program `jit_partial` has jax trace, and the output rebuilt from its result.

`make_inner` merges the partial arguments (split once, `split`) from the
values of the call, runs the function, and returns the Variables' values it changed
(pinned to their in_shardings) with the output split into leaves; `_split_output`
refuses an output that holds a partial argument's Variable (other than the argument
itself). `rebuild_output` turns the static `Result` and the output leaves back into the
output, outside the program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx
from jax.tree_util import keystr

from .. import _errors
from .._callpath.inside import snapshots
from .._callpath.outside import Leaf, unflatten_all, value_of
from .._nodes import format_path, is_node, is_variable
from .._sharding import accept_flax, variable_shardings
from .._types import PyTreeDef
from .split import PartialSplit, flatten_with_prefix


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Result:
    """The static half of a traced call: what to write back, how to rebuild the output."""

    written: tuple[int, ...]  # indices of the partial Variables the program returns
    out_treedef: PyTreeDef  # of the output, graph nodes as leaves
    out_graphdefs: tuple[Any, ...] | None  # per treedef leaf: its graph definition, or
    # None (for an array); None when the output holds no graph node
    out_sizes: tuple[int, ...]  # flat leaves per treedef leaf
    # per treedef leaf: the index of the partial argument node it is, or None; None
    # when no output is one
    out_sources: tuple[int | None, ...] | None


def rebuild_output(result: Result, payload: list[Leaf], nodes: Sequence[Any]) -> Any:
    """The output: ``payload``'s graph nodes merged, partial argument ``nodes`` put back."""
    if result.out_graphdefs is None:
        return jax.tree_util.tree_unflatten(result.out_treedef, payload)
    sources = result.out_sources or (None,) * len(result.out_graphdefs)
    leaves, start = [], 0
    with nnx.merge_context() as ctx:
        for graphdef, size, source in zip(
            result.out_graphdefs, result.out_sizes, sources, strict=True
        ):
            chunk, start = payload[start : start + size], start + size
            if source is not None:
                leaves.append(nodes[source])
            else:
                leaves.append(chunk[0] if graphdef is None else ctx.unflatten(graphdef, chunk))
    return jax.tree_util.tree_unflatten(result.out_treedef, leaves)


def make_inner(
    fun: Callable[..., Any],
    split: PartialSplit,
    graph: bool,
    donated: bool,
    out_shardings: Any,
    keep_structure: str | None,
    transform: str,
    argument: str,
) -> Callable[..., Any]:
    """The function jax traces: ``(partial list, *args, **kwargs) -> (Result, written,
    output leaves)``. ``keep_structure``: None to drop a structure change the function
    makes to a partial argument (flax's jit_partial), else the rule for the error
    raised on one."""
    n_items = len(split.items)
    variable_index = [i for i, x in enumerate(split.items) if is_variable(x)]
    out_prefix = accept_flax(out_shardings)

    def inner(partial: list[Leaf], *args: Any, **kwargs: Any) -> tuple[Result, list, list]:
        keyed = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_variable)[0]
        if wrong := [_runtime_where(kp) for kp, x in keyed if is_variable(x)]:
            raise ValueError(_errors.partial_runtime_variable(wrong))
        leaves = [partial[split.order[i]] for i in range(n_items)]
        with nnx.merge_context() as ctx:
            nodes = unflatten_all(ctx, split.graphdefs, leaves, split.sizes)
        partial_args = jax.tree_util.tree_unflatten(split.treedef, nodes)
        with nnx.split_context() as ctx:  # the inner Variables, in the outer order
            inner_items = [
                item for node in nodes if is_node(node) for item in ctx.flatten(node)[1].leaves
            ]
        inner_vars = [x for x in inner_items if is_variable(x)]
        before = [v.get_raw_value() for v in inner_vars]
        metadata = [v.get_metadata() for v in inner_vars]
        structures = snapshots(nodes) if keep_structure is not None else None
        out = fun(*partial_args, *args, **kwargs)
        if keep_structure is not None:
            node_wheres = [w for w, n in zip(split.wheres, nodes, strict=True) if is_node(n)]
            changed = [
                w for w, s in zip(node_wheres, structures or [], strict=True) if not s.fresh()
            ]
            if changed or structures is None:
                raise ValueError(
                    _errors.structure_changed(
                        transform, argument, changed or node_wheres, keep_structure, transform
                    )
                )
        after = [v.get_raw_value() for v in inner_vars]
        if moved := [
            str(split.sites[variable_index[i]])
            for i, v in enumerate(inner_vars)
            if v.get_metadata() != metadata[i]
        ]:
            raise ValueError(_errors.partial_metadata_changed(moved))
        written = tuple(i for i in range(len(inner_vars)) if donated or after[i] is not before[i])
        values = []
        for i in written:
            value, sharding = after[i], split.shardings[variable_index[i]]
            if sharding is not None and isinstance(value, jax.Array):
                value = jax.lax.with_sharding_constraint(value, sharding)
            values.append(value)
        result, payload = _split_output(out, nodes, inner_vars, graph, out_prefix, transform)
        return dataclasses.replace(result, written=written), values, payload

    inner.__name__ = getattr(fun, "__name__", "fun")
    inner.__qualname__ = getattr(fun, "__qualname__", inner.__name__)
    return inner


def _split_output(
    out: Any,
    nodes: list[Any],
    inputs: list[nnx.Variable[Any]],
    graph: bool,
    prefix: Any,
    transform: str,
) -> tuple[Result, list[Leaf]]:
    """The output as flat leaves (graph nodes split together) and its `Result`.

    An output that is a partial argument's graph node (``nodes``) comes back as that
    very object; any other output holding one of its Variables is an error."""
    treedef, leaves, wheres, entries = flatten_with_prefix(
        out, "output", prefix, transform, "out_shardings", "output"
    )
    sources = [
        next((k for k, n in enumerate(nodes) if n is leaf), None) if is_node(leaf) else None
        for leaf in leaves
    ]
    table = variable_shardings(
        transform,
        "out_shardings",
        [
            (w, x, e)
            for w, x, e, s in zip(wheres, leaves, entries, sources, strict=True)
            if is_node(x) and s is None
        ],
    )
    input_ids = {id(v) for v in inputs}
    seen: dict[int, str] = {}
    aliased: list[str] = []
    graphdefs, sizes, payload = [], [], []
    with nnx.split_context() as ctx:
        for leaf, where, entry, source in zip(leaves, wheres, entries, sources, strict=True):
            if not is_node(leaf) or source is not None:
                graphdefs.append(None)
                sizes.append(0 if source is not None else 1)
                if source is None:
                    if entry is not None and isinstance(leaf, jax.Array):
                        leaf = jax.lax.with_sharding_constraint(leaf, entry)
                    payload.append(leaf)
                continue
            graphdef, flat = ctx.flatten(leaf)
            graphdefs.append(graphdef)
            sizes.append(len(flat.leaves))
            for path, item in zip(flat.paths, flat.leaves, strict=True):
                site = where + format_path(tuple(path))
                if is_variable(item) and (
                    id(item) in input_ids or (not graph and id(item) in seen)
                ):
                    aliased.append(site)
                seen.setdefault(id(item), site)
                value = value_of(item)
                sharding = table.get(id(item), (None,))[0]
                if sharding is not None and isinstance(value, jax.Array):
                    value = jax.lax.with_sharding_constraint(value, sharding)
                payload.append(value)
    if aliased:
        raise ValueError(_errors.partial_output_aliases(aliased, transform))
    returned = None if all(s is None for s in sources) else tuple(sources)
    if all(g is None for g in graphdefs) and returned is None:
        return Result((), treedef, None, tuple(sizes), None), payload
    return Result((), treedef, tuple(graphdefs), tuple(sizes), returned), payload


def _runtime_where(keypath: tuple[Any, ...]) -> str:
    """A key path of a call's ``(args, kwargs)`` as ``args[0].w`` / ``kwargs['x']``."""
    head = "args" if keypath[0].idx == 0 else "kwargs"
    return head + keystr(keypath[1:])
