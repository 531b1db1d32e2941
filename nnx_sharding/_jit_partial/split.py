"""The partial arguments of `jit_partial`, split once when it is made (`PartialSplit`).

Graph nodes are split together, so a Variable shared between them stays one; each
flat leaf (a Variable, or a constant array) keeps its site and its in_sharding, and a
call's partial list is its Variables' values, then the constants. In tree mode
(``graph=False``) `check_tree_aliases` refuses a Variable reached by two paths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.tree_util import keystr

from .. import _errors
from .._callpath.outside import Leaf, Site
from .._nodes import is_node, is_variable
from .._sharding import broadcast_prefix, variable_shardings
from .._types import PyTreeDef, ShardingLike

TRANSFORM = "jit_partial"


@dataclasses.dataclass
class PartialSplit:
    """The partial arguments, split once: graph definitions, Variables and constants."""

    treedef: PyTreeDef  # of the partial arguments, graph nodes as leaves
    leaves: list[Any]  # its leaves: graph nodes and constants
    wheres: list[str]  # per leaf: ``partial_args[0]``
    graphdefs: tuple[Any, ...]
    sizes: tuple[int, ...]
    items: list[Any]  # per flat leaf: the Variable, or the constant (an array)
    sites: list[Site]
    shardings: list[ShardingLike]  # per flat leaf
    variables: list[nnx.Variable[Any]] = dataclasses.field(init=False)
    constants: list[Leaf] = dataclasses.field(init=False)
    order: list[int] = dataclasses.field(init=False)  # flat leaf -> index in a call's list

    def __post_init__(self) -> None:
        self.variables = [x for x in self.items if is_variable(x)]
        self.constants = [x for x in self.items if not is_variable(x)]
        n_var, k_var, k_const = len(self.variables), 0, 0
        self.order = []
        for x in self.items:
            if is_variable(x):
                self.order.append(k_var)
                k_var += 1
            else:
                self.order.append(n_var + k_const)
                k_const += 1

    def partial_shardings(self) -> list[ShardingLike]:
        """The shardings of a call's partial list (Variables, then constants)."""
        by_index = [
            self.shardings[i] for i in sorted(range(len(self.items)), key=self.order.__getitem__)
        ]
        return by_index


def flatten_with_prefix(
    tree: Any, name: str, prefix: Any, transform: str, argument: str, root: str
) -> tuple[PyTreeDef, list[Any], list[str], list[Any]]:
    """``tree`` flattened with graph nodes as leaves: its treedef, its leaves, where each
    is (``name[0].layer``) and each one's entry of the sharding ``prefix`` (``argument``,
    whose own paths start with ``root``), None everywhere without a prefix."""
    keyed, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)
    wheres = [f"{name}{keystr(kp)}" for kp, _ in keyed]
    leaves = [leaf for _, leaf in keyed]
    entries: list[Any] = [None] * len(leaves)
    if prefix is not None:
        entries = broadcast_prefix(
            transform, argument, prefix, tree, lambda kp: f"{root}{keystr(kp)}"
        )
    return treedef, leaves, wheres, entries


def split_partial(partial_args: tuple[Any, ...], prefix: Any, name: str) -> PartialSplit:
    """Splits the partial arguments (graph nodes together: shared Variables stay one);
    ``name``: what they are called in messages."""
    treedef, leaves, wheres, entries = flatten_with_prefix(
        partial_args, name, prefix, TRANSFORM, "in_shardings", "in_shardings"
    )
    table = variable_shardings(
        TRANSFORM,
        "in_shardings",
        [(w, x, e) for w, x, e in zip(wheres, leaves, entries, strict=True) if is_node(x)],
    )
    graphdefs, sizes, items, sites, shardings = [], [], [], [], []
    with nnx.split_context() as ctx:
        for leaf, where, entry in zip(leaves, wheres, entries, strict=True):
            if is_node(leaf):
                graphdef, flat = ctx.flatten(leaf)
                graphdefs.append(graphdef)
                sizes.append(len(flat.leaves))
                for path, item in zip(flat.paths, flat.leaves, strict=True):
                    items.append(item)
                    sites.append(Site(where, tuple(path)))
                    shardings.append(table.get(id(item), (None,))[0])
            else:
                graphdefs.append(None)
                sizes.append(1)
                items.append(leaf)
                sites.append(Site(where, None))
                shardings.append(entry)
    return PartialSplit(
        treedef, leaves, wheres, tuple(graphdefs), tuple(sizes), items, sites, shardings
    )


def check_tree_aliases(partial_args: tuple[Any, ...]) -> None:
    """Tree mode: no Variable may be reached through two paths (flax's rule)."""
    paths: dict[int, list[str]] = {}
    kinds: dict[int, str] = {}
    keyed = jax.tree_util.tree_flatten_with_path(partial_args, is_leaf=is_variable)[0]
    for kp, leaf in keyed:
        if is_variable(leaf):
            paths.setdefault(id(leaf), []).append(f"partial_args{keystr(kp)}")
            kinds[id(leaf)] = type(leaf).__name__
    groups = [(kinds[k], p) for k, p in paths.items() if len(p) > 1]
    if groups:
        raise ValueError(_errors.partial_aliases(groups))
