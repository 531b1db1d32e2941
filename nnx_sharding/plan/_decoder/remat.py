"""The rematerialization policies of the decoder's repeated block, by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ... import _errors

_dots = jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims

REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "dots": _dots,
    "dots_with_context": jax.checkpoint_policies.save_from_both_policies(
        _dots, jax.checkpoint_policies.save_only_these_names("context")
    ),
    "full": jax.checkpoint_policies.nothing_saveable,
}
"""What each block keeps for the backward pass: ``none``, everything (no remat);
``dots``, the outputs of its weight matmuls (``checkpoint_dots_with_no_batch_dims``:
MaxText's ``minimal``); ``dots_with_context``, those and the attention's output, named
``'context'`` (MaxText's ``minimal_flash``); ``full``, only the block's input."""


def remat_policy(name: str) -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy named ``name`` in `REMAT_POLICIES`; None for
    ``'none'`` (the block is not rematerialized at all).

    >>> remat_policy('full') is jax.checkpoint_policies.nothing_saveable
    True
    """
    if name not in REMAT_POLICIES:
        raise ValueError(
            _errors.decoder_bad_choice("remat_policy", "name", name, list(REMAT_POLICIES))
        )
    return REMAT_POLICIES[name]
