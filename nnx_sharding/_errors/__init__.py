"""Every user-facing error message, built in one place: this package.

A message names the transform and the argument, says what was found and where
(a ``jax.tree_util.keystr`` path), states the rule, then lists numbered fixes
(`format_message`, in `layout`). The builders are split by who raises them: the
transforms (`transforms`, `prefixes` for sharding prefixes, `simple` for the simple
path, `partial` for `jit_partial`), those about the caller's objects (`objects`), the
tools around them (`tools`), checkpoints (`checkpoint`), `pipeline`, `moe`, and the
planner, one module for each of its groups (`plan_hardware`, `plan_cost`,
`plan_search`, `plan_records`, `plan_decoder`); call sites use ``_errors.<builder>``.
"""

from .checkpoint import *  # noqa: F403
from .layout import format_message as format_message
from .moe import *  # noqa: F403
from .objects import *  # noqa: F403
from .partial import *  # noqa: F403
from .pipeline import *  # noqa: F403
from .plan_cost import *  # noqa: F403
from .plan_decoder import *  # noqa: F403
from .plan_hardware import *  # noqa: F403
from .plan_records import *  # noqa: F403
from .plan_search import *  # noqa: F403
from .prefixes import *  # noqa: F403
from .simple import *  # noqa: F403
from .tools import *  # noqa: F403
from .transforms import *  # noqa: F403
