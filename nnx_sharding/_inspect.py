"""`inspect_sharding`: ``jax.debug.inspect_array_sharding`` for trees holding graph nodes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeAlias

import jax
from flax import nnx
from jax.sharding import Sharding

from ._nodes import is_node

ShardingTree: TypeAlias = Any
"""The inspected tree with each array replaced by its `Sharding` (graph nodes as
``nnx.State``); leaves that are not arrays become None."""
Callback: TypeAlias = Callable[[ShardingTree], None]


def _as_pytree(x: Any) -> Any:
    """A graph node's ``nnx.State`` (keyed by Variable path); a Variable stays one."""
    return x if not is_node(x) or isinstance(x, nnx.Variable) else nnx.state(x)


class _Collector:
    """Gathers the shardings jax reports one array at a time; calls back once per round.

    jax reports each array when its sharding becomes known: at once (eager), at
    lowering, or at compile time. ``callback`` is called when all are in; a later
    round (a recompilation of the same lowering) calls it again.
    """

    def __init__(
        self,
        unflatten: Callable[[list[Sharding | None]], ShardingTree],
        slots: list[Sharding | None],
        arrays: frozenset[int],
        callback: Callback,
    ):
        self.unflatten, self.slots, self.arrays, self.callback = unflatten, slots, arrays, callback
        self.missing = set(arrays)

    def report(self, index: int) -> Callable[[Sharding], None]:
        def receive(sharding: Sharding) -> None:
            self.slots[index] = sharding
            self.missing.discard(index)
            if not self.missing:
                self.missing = set(self.arrays)
                self.callback(self.unflatten(list(self.slots)))

        return receive


def inspect_sharding(tree: Any, *, callback: Callback) -> None:
    """Calls ``callback`` with the sharding of every array in ``tree``; works inside `jit`.

    The lifted form of ``jax.debug.inspect_array_sharding``: ``tree`` may hold graph
    nodes (Modules, Optimizers, Rngs, ...) next to arrays. ``callback`` receives the
    same structure once, with each array replaced by its ``jax.sharding.Sharding``;
    a graph node is given as its ``nnx.State`` keyed by Variable path (the structure of
    ``nnx.get_named_sharding(nnx.state(node), mesh)``). Leaves that are not arrays
    become None.

    The timing is jax's: at once when called eagerly; inside a jitted function at
    lowering when the computation runs on one device; at compile time when the
    compiler picks the sharding (a partitioned ``jit``: ``.lower(...).compile()``
    triggers it); not again for calls that hit the compilation cache.

    Args:
      tree: a pytree of arrays and graph nodes.
      callback: called with the tree of shardings; its return value is ignored.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import nnx_sharding
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> nnx_sharding.inspect_sharding(
    ...     {'model': model, 'x': jnp.ones(2)},
    ...     callback=lambda s: print(s['model']['kernel'].get_value(), s['x']))
    SingleDeviceSharding(device=CpuDevice(id=0)...) SingleDeviceSharding(...)
    """
    leaves, treedef = jax.tree_util.tree_flatten(jax.tree.map(_as_pytree, tree, is_leaf=is_node))
    arrays = frozenset(i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array))
    unflatten = functools.partial(jax.tree_util.tree_unflatten, treedef)
    collector = _Collector(unflatten, [None] * len(leaves), arrays, callback)
    if not arrays:
        callback(unflatten(collector.slots))
        return
    for index in sorted(arrays):
        jax.debug.inspect_array_sharding(leaves[index], callback=collector.report(index))
