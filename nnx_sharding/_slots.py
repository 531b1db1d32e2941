"""Direct reads of a Variable's metadata slot: the one place that touches flax internals.

Why: the fast path (`_snapshot`) must prove on every call that no Variable's metadata
changed, since flax makes metadata part of the graph definition (a change retraces).
flax's public ``Variable.get_metadata()`` returns a copy, 0.44 µs a Variable: 260 µs a
call for the 602 Variables of a depth-100 MLP, more than jax's own dispatch. Holding
each Variable's metadata dict itself lets the snapshot check it like a module's
``__dict__``: the same dict object, with the same keys and values (about 0.1 µs).

The layout is probed once, at import (`_probe`): the slot holds a plain dict that
``get_metadata`` copies, and ``set_metadata`` updates in place (by name) or replaces
(by dict). If the probe fails, or ``NNX_SHARDING_PUBLIC_SLOTS=1`` is set, `DIRECT` is
False and callers use the public methods: everything works, only slower.
"""

from __future__ import annotations

import os
from operator import attrgetter
from typing import Any

from flax import nnx

_METADATA = "_var_metadata"


def _probe() -> bool:
    """Whether flax's Variable keeps its metadata as this module expects."""
    try:
        variable = nnx.Variable(0.0)
        slot = object.__getattribute__(variable, _METADATA)
        if type(slot) is not dict or slot != variable.get_metadata():
            return False
        variable.set_metadata("probe", 1)  # by name: in place
        if object.__getattribute__(variable, _METADATA) is not slot or slot.get("probe") != 1:
            return False
        variable.set_metadata({"probe": 2})  # a whole dict: a new one
        slot = object.__getattribute__(variable, _METADATA)
        return type(slot) is dict and slot == variable.get_metadata() and slot["probe"] == 2
    except Exception:  # noqa: BLE001 - any other layout: use the public methods
        return False


DIRECT: bool = os.environ.get("NNX_SHARDING_PUBLIC_SLOTS") != "1" and _probe()
"""Whether `metadata_dict` may be used; read when a snapshot is taken."""

metadata_dict: Any = attrgetter(_METADATA)
"""``variable -> its metadata dict`` (the live one: never write to it); only if `DIRECT`."""
