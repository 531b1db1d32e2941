"""The function `jit` has jax trace: the call path's steps 2 and 3 around the function.

`make_inner` merges fresh inner copies of the inputs, calls the function, splits
inputs and outputs again, and pins every array to its sharding with
``with_sharding_constraint``: an input Variable keeps its in_sharding (by path, as flax
pins them), an output gets its out_shardings entry, and a Variable given two different
shardings, or a sharding that does not fit, is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax
from flax import nnx

from .. import _errors
from .._nodes import format_path, is_node
from .._sharding import broadcast_prefix, incompatible_shardings, variable_shardings
from .._state_sharding import StateSharding
from .._types import ShardingLike
from .inside import InnerSplit, changed_inputs, merge_inputs, snapshots, split_inner
from .outside import CallPlan, Leaf, checked_on_fast_calls, chunks, value_of


def make_inner(fun: Callable[..., Any], plan: CallPlan) -> Callable[..., Any]:
    """The function jax traces: the call path's steps 2 and 3 (`inside`) around ``fun``."""

    @checked_on_fast_calls
    def inner(donated: list[Leaf], kept: list[Leaf]) -> tuple[Any, list[Leaf], list[Leaf]]:
        leaves = plan.join(donated, kept)
        args, kwargs, call_leaves = merge_inputs(plan, leaves)
        in_paths = _in_paths(plan, call_leaves)
        before = snapshots(call_leaves)
        out = fun(*args, **kwargs)
        in_table = _inner_shardings(plan, call_leaves, in_paths)
        return _constrain(plan, leaves, in_table, split_inner(plan, call_leaves, before, out))

    inner.__name__ = getattr(fun, "__name__", "fun")
    inner.__qualname__ = getattr(fun, "__qualname__", inner.__name__)
    return inner


SiteShardings: TypeAlias = dict[int, tuple[ShardingLike, str]]
"""``id(Variable) -> (sharding, path)``."""


PathShardings: TypeAlias = dict[tuple[int, tuple[Any, ...]], ShardingLike]
"""``(argument index, Variable path) -> in_sharding``."""


def _in_paths(plan: CallPlan, call_leaves: Sequence[Any]) -> PathShardings:
    """The in_sharding of every Variable of the freshly merged inputs, by path."""
    table: PathShardings = {}
    if all(s is None for s in plan.shardings):
        return table
    with nnx.split_context() as ctx:
        for k, (leaf, run) in enumerate(
            zip(call_leaves, chunks(plan.shardings, plan.sizes), strict=True)
        ):
            if is_node(leaf):
                paths = ctx.flatten(leaf)[1].paths
                table.update(((k, tuple(p)), s) for p, s in zip(paths, run, strict=True))
    return table


def _inner_shardings(
    plan: CallPlan, call_leaves: Sequence[Any], in_paths: PathShardings
) -> SiteShardings:
    """The in_sharding of every Variable of the inputs after the call, by path, as flax
    pins them: a Variable the function replaced keeps its path's sharding, and a new
    one gets its argument's in_shardings entry (the first StateSharding filter it
    matches)."""
    table: SiteShardings = {}
    if not in_paths:
        return table
    spec = plan.spec
    dyn_args = jax.tree_util.tree_unflatten(plan.treedef, call_leaves)[0]
    entries = broadcast_prefix(spec.transform, spec.in_name, spec.in_shardings, dyn_args, str)
    with nnx.split_context() as ctx:
        for k, (leaf, where) in enumerate(zip(call_leaves, plan.wheres, strict=True)):
            if not is_node(leaf):
                continue
            entry = entries[k] if k < len(entries) else None
            flat = ctx.flatten(leaf)[1]
            for path, item in zip(flat.paths, flat.leaves, strict=True):
                key = (k, tuple(path))
                if key in in_paths:
                    sharding = in_paths[key]
                elif isinstance(entry, StateSharding):
                    index = entry.find(key[1], item)
                    sharding = None if index is None else entry.shardings[index]
                else:
                    sharding = entry
                if sharding is not None:
                    table[id(item)] = (sharding, where + format_path(path))
    return table


def _constrain(
    plan: CallPlan, in_leaves: Sequence[Leaf], in_table: SiteShardings, split: InnerSplit
) -> tuple[Any, list[Leaf], list[Leaf]]:
    """Applies in/out shardings to the split outputs (``with_sharding_constraint``).

    Returns the `OutPlan`, the input leaves the caller needs back (all of them if
    the structure changed; else the changed, resharded or donated ones) and the
    output leaves.
    """
    spec = plan.spec
    nodes = zip(split.out_wheres, split.out_leaves, split.out_entries, strict=True)
    out_table = variable_shardings(
        spec.transform, spec.out_name, [(w, x, e) for w, x, e in nodes if is_node(x)]
    )
    conflicts: list[str] = []
    misfits: list[str] = []  # out_shardings that do not fit their output

    def constrain(item: Any, entry: ShardingLike, where: str = "") -> Leaf:
        value = value_of(item)
        (inner, in_site), (outer, out_site) = (
            in_table.get(id(item), (None, "")),
            out_table.get(id(item), (None, "")),
        )
        if inner is not None and outer is not None and inner != outer:
            conflicts.append(
                f"the Variable at {in_site} gets {inner!r} as an input, "
                f"and as {out_site} gets {outer!r} as an output"
            )
        if entry is not None:
            sharding, site = entry, where
        elif outer is not None:
            sharding, site = outer, out_site
        else:  # an in_sharding, which the input already has
            sharding, site = inner, ""
        if sharding is None or not isinstance(value, jax.Array):
            return value
        # with_sharding_constraint would replicate an indivisible dimension silently
        if site and (wrong := incompatible_shardings([value], [sharding], [site])):
            misfits.extend(wrong)
            return value
        return jax.lax.with_sharding_constraint(value, sharding)

    in_flat = [constrain(item, None) for item in split.in_items]
    out_flat = [
        constrain(
            item,
            None if is_node(split.out_leaves[k]) else split.out_entries[k],
            split.out_wheres[k],
        )
        for item, k in zip(split.out_items, split.out_owner, strict=True)
    ]
    if misfits:
        misfits = list(dict.fromkeys(misfits))  # an input returned is checked twice
        raise ValueError(_errors.bad_shardings(spec.transform, spec.out_name, misfits))
    if conflicts:
        raise ValueError(
            _errors.aliased_shardings(spec.transform, "in_shardings/out_shardings", conflicts)
        )
    if not split.kept_structure:
        return split.out_plan(None), in_flat, out_flat
    # changed, resharded (constrained) or donated: the caller needs the new array
    changed = changed_inputs(plan, split.in_items, in_flat, in_leaves)
    if changed is None:
        return split.out_plan(None), in_flat, out_flat
    return split.out_plan(changed), [in_flat[i] for i in changed], out_flat
