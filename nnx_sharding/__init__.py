"""nnx_sharding: lifted ``jax.jit`` and shardings for Flax NNX graph nodes."""

from ._jit import JitWrapped as JitWrapped
from ._jit import jit as jit
from ._shard_map import ShardMapFn as ShardMapFn
from ._shard_map import shard_map as shard_map
from ._sharding import StateSharding as StateSharding
from ._stages import Compiled as Compiled
from ._stages import Lowered as Lowered
from ._stages import Traced as Traced

__all__ = [
    "Compiled",
    "JitWrapped",
    "Lowered",
    "ShardMapFn",
    "StateSharding",
    "Traced",
    "jit",
    "shard_map",
]
__version__ = "0.1.0"
