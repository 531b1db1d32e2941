"""The rematerialization policies of the decoder's repeated block, by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ... import _errors

_dots = jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
OFFLOADED = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj")
"""The activations the decoder names as MaxText names them (``checkpoint_name``), which
``offload_qkv`` moves to the host."""


def _offload(*names: str) -> Callable[..., Any]:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(names),
        offload_src="device",
        offload_dst="pinned_host",
    )


REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "dots": _dots,
    "dots_with_context": jax.checkpoint_policies.save_from_both_policies(
        _dots, jax.checkpoint_policies.save_only_these_names("context")
    ),
    "context": jax.checkpoint_policies.save_only_these_names("context"),
    "offload_qkv": _offload(*OFFLOADED),
    "offload_input": _offload("decoder_layer_input"),
    "full": jax.checkpoint_policies.nothing_saveable,
}
"""What each block keeps for the backward pass: ``none``, everything (no remat);
``dots``, the outputs of its weight matmuls (``checkpoint_dots_with_no_batch_dims``:
MaxText's ``minimal``); ``dots_with_context``, those and the attention's output, named
``'context'`` (MaxText's ``minimal_flash``); ``context``, only the attention's output,
the rest recomputed (what long-context runs keep: the attention is the one part whose
recomputation grows with the sequence squared); ``offload_qkv``, the block's input and
its query, key, value and output projections moved to the host's memory and brought
back for the backward pass, the rest recomputed (MaxText's ``custom`` policy with those
five names set to ``offload``, as its Mixtral and Llama 3.1 runs on v6e use it);
``offload_input``, only the block's input moved to the host, the rest recomputed (its
Llama 3.1 405B run's); ``full``, only the block's input, kept on the device."""


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
