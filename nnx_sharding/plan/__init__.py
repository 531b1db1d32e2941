"""The sharding planner: which layout fits, and which is fastest, for N devices.

`plan` lowers and compiles a step under every candidate layout (data parallel,
ZeRO-1, FSDP, tensor parallel, the 2-D ones and the hybrid ``dp+fsdp`` and
``dp+fsdp+tp``, on every factorisation of N), never allocating, and ranks the `Plans` by
a written-down cost model on an `Accelerator`. `search` does so for a step built from
knob values (`Built`), over a space of them, compiling only what may be fastest.

The built-in decoder (`Decoder`, its `DecoderConfig` and the published models'
`DECODER_CONFIGS`) and `decoder_builder` give the training step people run, with its
knobs: the remat policy (`REMAT_POLICIES`) and gradient accumulation
(`accumulate_gradients`).

The subpackage is itself callable: ``nnx_sharding.plan(step, *args, ...)`` is `plan`.
"""

import sys
import types
from typing import Any

from ._built import Built as Built
from ._cost.model import Memory as Memory
from ._cost.model import Time as Time
from ._decoder.activation_sharding import ACTIVATION_RULES as ACTIVATION_RULES
from ._decoder.activation_sharding import constrain_activation as constrain_activation
from ._decoder.attention import blockwise_attention as blockwise_attention
from ._decoder.attention import causal_attention as causal_attention
from ._decoder.configs import DECODER_CONFIGS as DECODER_CONFIGS
from ._decoder.configs import DECODER_RULES as DECODER_RULES
from ._decoder.configs import DecoderConfig as DecoderConfig
from ._decoder.context_parallel import CONTEXT_STRATEGIES as CONTEXT_STRATEGIES
from ._decoder.context_parallel import context_attention as context_attention
from ._decoder.context_parallel import sequence_order as sequence_order
from ._decoder.model import Decoder as Decoder
from ._decoder.remat import REMAT_POLICIES as REMAT_POLICIES
from ._decoder.remat import remat_policy as remat_policy
from ._decoder.training import accumulate_gradients as accumulate_gradients
from ._decoder.training import decoder_builder as decoder_builder
from ._decoder.training import make_train_step as make_train_step
from ._hardware.accelerators import PRESETS as PRESETS
from ._hardware.accelerators import Accelerator as Accelerator
from ._plan import Plan as Plan
from ._ranking import Plans as Plans
from ._search.knobs import REMAT_ORDER as REMAT_ORDER
from ._search.layouts import LAYOUTS as LAYOUTS
from ._search.search import plan as plan
from ._search.search import search as search

__all__ = ["LAYOUTS", "PRESETS", "Accelerator", "Memory", "Plan", "Plans", "Time", "plan"]
__all__ += ["ACTIVATION_RULES", "DECODER_CONFIGS", "DECODER_RULES", "REMAT_POLICIES"]
__all__ += ["Decoder", "DecoderConfig", "accumulate_gradients", "blockwise_attention"]
__all__ += ["causal_attention", "constrain_activation", "decoder_builder", "make_train_step"]
__all__ += ["remat_policy", "search", "Built", "REMAT_ORDER"]
__all__ += ["CONTEXT_STRATEGIES", "context_attention", "sequence_order"]


class _CallableModule(types.ModuleType):
    """This module, callable as `plan` (``nnx_sharding.plan(...)``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Plans:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
