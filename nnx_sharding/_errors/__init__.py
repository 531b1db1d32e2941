"""Every user-facing error message, built in one place: this package.

A message names the transform and the argument, says what was found and where
(a ``jax.tree_util.keystr`` path), states the rule, then lists numbered fixes
(`format_message`). The builders are split by who raises them: the transforms
(`_transforms`, and `_prefixes` for sharding prefixes), those about the caller's
objects (`_objects`), the tools around them (`_tools`) and checkpoints
(`_checkpoint`), the planner (`_plan`, `_plan_hardware`, `_decoder`); call sites use
``_errors.<builder>``.
"""

from .checkpoint import *  # noqa: F403
from .layout import format_message as format_message
from .objects import *  # noqa: F403
from .partial import *  # noqa: F403
from .pipeline import *  # noqa: F403
from .plan import *  # noqa: F403
from .plan_decoder import *  # noqa: F403
from .plan_hardware import *  # noqa: F403
from .plan_search import *  # noqa: F403
from .prefixes import *  # noqa: F403
from .simple import *  # noqa: F403
from .tools import *  # noqa: F403
from .transforms import *  # noqa: F403
