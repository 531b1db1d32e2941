"""Every user-facing error message, built in one place: this package.

A message names the transform and the argument, says what was found and where
(a ``jax.tree_util.keystr`` path), states the rule, then lists numbered fixes
(`format_message`). The builders are split by who raises them: the transforms
(`_transforms`, and `_prefixes` for sharding prefixes), those about the caller's
objects (`_objects`), the tools around them (`_tools`) and checkpoints
(`_checkpoint`), the planner (`_plan`, `_plan_hardware`, `_decoder`); call sites use
``_errors.<builder>``.
"""

from ._checkpoint import *  # noqa: F403
from ._decoder import *  # noqa: F403
from ._layout import format_message as format_message
from ._objects import *  # noqa: F403
from ._partial import *  # noqa: F403
from ._plan import *  # noqa: F403
from ._plan_hardware import *  # noqa: F403
from ._prefixes import *  # noqa: F403
from ._search import *  # noqa: F403
from ._simple import *  # noqa: F403
from ._tools import *  # noqa: F403
from ._transforms import *  # noqa: F403
