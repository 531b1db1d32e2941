"""Steps 2 and 3 of the call path (see the package docstring), inside the program at trace time.

``merge_inputs`` turns the call's leaves into fresh inner copies of the arguments;
after the function ran, ``split_inner`` splits the inputs (possibly updated) and the
outputs again into an `InnerSplit`, ``changed_inputs`` picks the input arrays the
caller needs back, and ``snapshots``/``changed_structure`` find the arguments whose
structure the function changed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.tree_util import keystr

from .._fastpath.snapshot import Structure, Uncacheable
from .._nodes import is_node
from .._sharding import broadcast_prefix, check_leaf_entries
from .._types import PyTreeDef
from .outside import TAG, CallPlan, GraphDef, Leaf, OutPlan, unflatten_all


def merge_inputs(plan: CallPlan, leaves: Sequence[Leaf]) -> tuple[tuple, dict, list[Any]]:
    """Step 2 (inside the trace). Returns the call's args, kwargs and its inner leaves."""
    with nnx.merge_context(TAG, inner=True) as ctx:
        call_leaves = unflatten_all(ctx, plan.graphdefs, leaves, plan.sizes)
    dyn_args, kwargs = jax.tree_util.tree_unflatten(plan.treedef, call_leaves)
    args = list(dyn_args)
    for key, value in plan.statics:
        if isinstance(key, int):
            args.insert(key, value)
        else:
            kwargs[key] = value
    return tuple(args), kwargs, call_leaves


class InnerSplit(NamedTuple):
    """Step 3's split of the updated inputs and the output, before any sharding."""

    in_graphdefs: tuple[GraphDef, ...]
    in_sizes: tuple[int, ...]
    in_items: list[Any]  # per input flat leaf: the Variable or array now there
    out_treedef: PyTreeDef
    out_graphdefs: tuple[GraphDef, ...]
    out_sizes: tuple[int, ...]
    out_items: list[Any]  # per output flat leaf
    out_owner: list[int]  # per output flat leaf: the index of its output treedef leaf
    out_paths: list[tuple[Any, ...] | None]  # per output flat leaf: its path in the node
    out_leaves: list[Any]  # the output's treedef leaves (graph nodes are leaves)
    out_wheres: list[str]  # per treedef leaf: ``output[0]``
    out_entries: list[Any]  # per treedef leaf: its out_shardings/out_specs entry
    kept_structure: bool  # the input graphs kept their structure
    out_sources: tuple[int | None, ...] | None

    def out_plan(self, in_changed: tuple[int, ...] | None) -> OutPlan:
        return OutPlan(
            self.in_graphdefs,
            self.in_sizes,
            self.out_treedef,
            self.out_graphdefs,
            self.out_sizes,
            in_changed,
            self.out_sources,
        )


def snapshots(call_leaves: Sequence[Any]) -> list[Structure] | None:
    """Per input graph node, a `Structure`; None when one cannot be taken."""
    try:
        return [Structure(leaf) for leaf in call_leaves if is_node(leaf)]
    except Uncacheable:
        return None


def split_inner(
    plan: CallPlan, call_leaves: Sequence[Any], before: list[Structure] | None, out: Any
) -> InnerSplit:
    """Step 3 (inside the trace): the updated inputs and the output, split together.

    ``before`` holds the snapshots of the inputs taken before the call (`snapshots`).
    """
    spec = plan.spec
    keyed, out_treedef = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_node)
    out_leaves = [leaf for _, leaf in keyed]
    wheres = [f"output{keystr(kp)}" for kp, _ in keyed]
    entries: list[Any] = [None] * len(out_leaves)
    if spec.out_shardings is not None:
        entries = broadcast_prefix(
            spec.transform, spec.out_name, spec.out_shardings, out, lambda kp: f"output{keystr(kp)}"
        )
        check_leaf_entries(spec.transform, spec.out_name, entries, out_leaves, wheres)

    def flatten_all(leaves: Sequence[Any]) -> tuple[tuple, tuple, list, list[int], list]:
        graphdefs, sizes, items, owner, paths = [], [], [], [], []
        for k, leaf in enumerate(leaves):
            if is_node(leaf):
                graphdef, flat = ctx.flatten(leaf)
                items += flat.leaves
                paths += [tuple(p) for p in flat.paths]
            else:
                graphdef, flat = None, None
                items.append(leaf)
                paths.append(None)
            graphdefs.append(graphdef)
            sizes.append(1 if flat is None else len(flat.leaves))
            owner += [k] * sizes[-1]
        return tuple(graphdefs), tuple(sizes), items, owner, paths

    with nnx.split_context(TAG) as ctx:
        in_graphdefs, in_sizes, in_items, _, _ = flatten_all(call_leaves)
        out_graphdefs, out_sizes, out_items, out_owner, out_paths = flatten_all(out_leaves)
    inputs = [leaf for leaf in call_leaves if is_node(leaf)]
    sources = [
        None if not is_node(leaf) else next((k for k, x in enumerate(inputs) if x is leaf), -1)
        for leaf in out_leaves
    ]
    return InnerSplit(
        in_graphdefs,
        in_sizes,
        in_items,
        out_treedef,
        out_graphdefs,
        out_sizes,
        out_items,
        out_owner,
        out_paths,
        out_leaves,
        wheres,
        entries,
        before is not None and all(s.fresh() for s in before),
        None if -1 in sources else tuple(sources),
    )


def changed_inputs(
    plan: CallPlan,
    items: Sequence[Any],
    values: Sequence[Leaf],
    leaves: Sequence[Leaf],
    also: Collection[int] = (),
) -> tuple[int, ...]:
    """The flat inputs the caller needs back from a call that kept the graphs' structure
    (``OutPlan.in_changed``), at trace time: ``items`` are the inputs' objects after the
    call (Variables, or the arrays the graphs hold outside Variables), ``values`` the
    values the call returns for them, ``leaves`` those it received.

    An input comes back when its value changed, was donated (new buffers) or is in
    ``also`` (resharded, say), and when it is a container (a dict `Module.sow` fills),
    which the function may change in place.
    """
    del items  # a Variable and a plain array attribute come back alike
    return tuple(
        i
        for i in plan.state_indices
        if values[i] is not leaves[i]
        or plan.donate[i]
        or i in also
        or not isinstance(leaves[i], jax.Array)
    )


def changed_structure(plan: CallPlan, before: list[Structure] | None) -> list[str]:
    """The arguments whose graph structure the call changed (all, if unknown)."""
    wheres = [w for w, g in zip(plan.wheres, plan.graphdefs, strict=True) if g is not None]
    if before is None:
        return wheres
    return [w for w, s in zip(wheres, before, strict=True) if not s.fresh()]
