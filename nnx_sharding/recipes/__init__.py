"""Recipes: an nnx MLP trained tensor-parallel, data-parallel, on a 2-D mesh, with FSDP,
deeper (`DeepMLP`) pipelined and, with mixture-of-experts blocks (`ExpertMLP`),
expert-parallel.

Every recipe is a step factory, ``recipe(mesh, ...) -> step``, where
``step(model, optimizer, x, y)`` runs one adam step in place and returns the loss.
Each gives the numbers of `reference_step` (plain flax on one device) to float32
tolerance; ``docs/recipes/`` walks through them.

- `tensor_parallel_step`: Megatron-style, `shard_map` over `megatron_sharding`, one ``psum``.
- `jit_tensor_parallel_step`: the same layout through `jit` shardings alone.
- `data_parallel_step`: batch over ``'data'``, gradients averaged with ``pmean``.
- `data_tensor_parallel_step`: both, on a ``('data', 'model')`` mesh.
- `fsdp_step`: parameters split over ``'data'`` (`fsdp_sharding`), gathered each step.
- `pipeline_step`: `DeepMLP`'s blocks pipelined over ``'stage'`` (`pipeline_sharding`).
- `expert_step`: `ExpertMLP`'s experts over ``'expert'`` (`expert_sharding`), its loss
  `expert_loss` (with the load-balancing loss), its reference `expert_reference_step`.
"""

from ._data_parallel import data_parallel_step as data_parallel_step
from ._data_parallel import data_tensor_parallel_step as data_tensor_parallel_step
from ._experts import ExpertMLP as ExpertMLP
from ._experts import expert_loss as expert_loss
from ._experts import expert_reference_step as expert_reference_step
from ._experts import expert_sharding as expert_sharding
from ._experts import expert_step as expert_step
from ._fsdp import fsdp_sharding as fsdp_sharding
from ._fsdp import fsdp_step as fsdp_step
from ._fsdp import gather_params as gather_params
from ._model import MLP as MLP
from ._model import Batch as Batch
from ._model import OnStep as OnStep
from ._model import Step as Step
from ._model import make_batches as make_batches
from ._model import make_optimizer as make_optimizer
from ._model import max_param_diff as max_param_diff
from ._model import mse as mse
from ._model import param_specs as param_specs
from ._model import reference_step as reference_step
from ._model import train as train
from ._pipeline import DeepMLP as DeepMLP
from ._pipeline import pipeline_sharding as pipeline_sharding
from ._pipeline import pipeline_step as pipeline_step
from ._specs import PathEndsWith as PathEndsWith
from ._specs import make_mesh as make_mesh
from ._specs import megatron_sharding as megatron_sharding
from ._specs import on_mesh as on_mesh
from ._tp_jit import jit_tensor_parallel_step as jit_tensor_parallel_step
from ._tp_shard_map import tensor_parallel_step as tensor_parallel_step
from ._tp_shard_map import tp_forward as tp_forward

__all__ = [
    "MLP",
    "Batch",
    "DeepMLP",
    "ExpertMLP",
    "OnStep",
    "PathEndsWith",
    "Step",
    "data_parallel_step",
    "data_tensor_parallel_step",
    "expert_loss",
    "expert_reference_step",
    "expert_sharding",
    "expert_step",
    "fsdp_sharding",
    "fsdp_step",
    "gather_params",
    "jit_tensor_parallel_step",
    "make_batches",
    "make_mesh",
    "make_optimizer",
    "max_param_diff",
    "megatron_sharding",
    "mse",
    "on_mesh",
    "param_specs",
    "pipeline_sharding",
    "pipeline_step",
    "reference_step",
    "tensor_parallel_step",
    "tp_forward",
    "train",
]
