"""nnx_sharding: lifted ``jax.jit`` and shardings for Flax NNX graph nodes."""

from ._jit import JitWrapped as JitWrapped
from ._jit import jit as jit
from ._sharding import StateSharding as StateSharding
from ._stages import Compiled as Compiled
from ._stages import Lowered as Lowered
from ._stages import Traced as Traced

__all__ = ["Compiled", "JitWrapped", "Lowered", "StateSharding", "Traced", "jit"]
__version__ = "0.1.0"
