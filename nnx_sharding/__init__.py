"""nnx_sharding: lifted ``jax.jit`` and shardings for Flax NNX graph nodes.

``nnx_sharding.checkpoint`` (save and restore on orbax) and ``nnx_sharding.plan`` (the
sharding planner, with ``Accelerator``) are imported on first use, so that importing
the package imports neither.
"""

import importlib
from typing import TYPE_CHECKING, Any

from ._cli.launch import initialize_distributed as initialize_distributed
from ._export.export import export as export
from ._export.program import Exported as Exported
from ._export.program import deserialize as deserialize
from ._inspect import inspect_sharding as inspect_sharding
from ._jit import JitWrapped as JitWrapped
from ._jit import jit as jit
from ._jit_partial.jit_partial import JitPartialWrapped as JitPartialWrapped
from ._jit_partial.jit_partial import jit_partial as jit_partial
from ._metadata import shard as shard
from ._moe import MoE as MoE
from ._moe import moe as moe
from ._pipeline import pipeline as pipeline
from ._shard_map import ShardMapFn as ShardMapFn
from ._shard_map import shard_map as shard_map
from ._stages import Compiled as Compiled
from ._stages import Lowered as Lowered
from ._stages import Traced as Traced
from ._state_sharding import StateSharding
from ._table import ShardingTable as ShardingTable
from ._table import sharding_table as sharding_table
from ._table import visualize_sharding as visualize_sharding

__all__ = [
    "Accelerator",
    "Compiled",
    "Exported",
    "JitPartialWrapped",
    "JitWrapped",
    "Lowered",
    "MoE",
    "ShardMapFn",
    "ShardingTable",
    "StateSharding",
    "Traced",
    "deserialize",
    "export",
    "initialize_distributed",
    "inspect_sharding",
    "jit",
    "jit_partial",
    "moe",
    "pipeline",
    "plan",
    "shard",
    "shard_map",
    "sharding_table",
    "visualize_sharding",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from . import checkpoint as checkpoint
    from . import plan as plan
    from .plan import Accelerator as Accelerator


def __getattr__(name: str) -> Any:
    """``nnx_sharding.checkpoint`` (it imports orbax) and ``nnx_sharding.plan`` (a
    callable subpackage) with ``Accelerator``, imported on first access."""
    if name in ("checkpoint", "plan"):
        return importlib.import_module(f".{name}", __name__)
    if name == "Accelerator":
        return importlib.import_module(".plan", __name__).Accelerator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
