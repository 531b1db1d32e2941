"""Names for the jax types that type checkers cannot see.

jaxlib implements these classes in C++ and ships no type stubs for them, so to
pyright and mypy ``jax.Device``, ``jax.tree_util.PyTreeDef`` and jaxlib's
``HloSharding`` are unknown (and not even valid in an annotation). They are
annotated with these aliases instead: ``Any`` to a type checker, but the name
says what the value is. `ShardingLike` names what the package accepts for one array.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from jax.sharding import PartitionSpec, Sharding

Device: TypeAlias = Any
"""A ``jax.Device``."""
PyTreeDef: TypeAlias = Any
"""A ``jax.tree_util.PyTreeDef``."""
HloSharding: TypeAlias = Any
"""jaxlib's ``HloSharding`` (the sharding of an XLA HLO value)."""
ShardingLike: TypeAlias = Sharding | PartitionSpec | None
"""What may stand for one array: a sharding, a spec (needs a mesh in context), or None."""
