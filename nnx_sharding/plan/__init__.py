"""The sharding planner: which layout fits, and which is fastest, for N devices.

`plan` lowers and compiles a step under every candidate layout (data parallel,
ZeRO-1, FSDP, tensor parallel, the 2-D ones and the hybrid ``dp+fsdp`` and
``dp+fsdp+tp``, on every factorisation of N), never allocating, and ranks the `Plans` by
a written-down cost model on an `Accelerator`. `search` does so for a step built from
knob values (`Built`), over a space of them, compiling only what may be fastest.

The subpackage is itself callable: ``nnx_sharding.plan(step, *args, ...)`` is `plan`.
"""

import sys
import types
from typing import Any

from ._accelerator import PRESETS as PRESETS
from ._accelerator import Accelerator as Accelerator
from ._built import Built as Built
from ._cost import Memory as Memory
from ._cost import Time as Time
from ._knobs import REMAT_ORDER as REMAT_ORDER
from ._layouts import LAYOUTS as LAYOUTS
from ._plan import Plan as Plan
from ._planner import plan as plan
from ._plans import Plans as Plans
from ._search import search as search

__all__ = [
    "LAYOUTS",
    "PRESETS",
    "REMAT_ORDER",
    "Accelerator",
    "Built",
    "Memory",
    "Plan",
    "Plans",
    "Time",
    "plan",
    "search",
]


class _CallableModule(types.ModuleType):
    """This module, callable as `plan` (``nnx_sharding.plan(...)``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Plans:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
