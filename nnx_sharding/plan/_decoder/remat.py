"""The rematerialization policies of the decoder's repeated block, by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ... import _errors

_dots = jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
OFFLOADED = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj")
"""The activations ``offload_qkv`` moves to the host."""
NAMED = (*OFFLOADED, "context", "mlpwi_0", "mlpwi_1", "mlpwo")
"""The activations the decoder names as MaxText names them (``checkpoint_name``): the
layer's input, the attention's projections and output (``context``), the MLP's two input
matmuls (gate and up) and its output matmul; what a ``custom:`` policy places."""
CUSTOM = "custom:"
"""The prefix of a policy that places each named activation itself, as MaxText's
``remat_policy: custom`` does: ``'custom:decoder_layer_input=offload,context=device'``
(each of `NAMED` ``=device``, ``=offload`` or ``=remat``, the default)."""


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
    """The ``jax.checkpoint`` policy named ``name`` in `REMAT_POLICIES`, or given as
    ``'custom:NAME=WHERE,...'`` (`CUSTOM`); None for ``'none'`` (the block is not
    rematerialized at all).

    >>> remat_policy('full') is jax.checkpoint_policies.nothing_saveable
    True
    >>> callable(remat_policy('custom:decoder_layer_input=offload,context=device'))
    True
    """
    if isinstance(name, str) and name.startswith(CUSTOM):
        placed = custom_places(name)
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[n for n, w in placed.items() if w == "device"],
            names_which_can_be_offloaded=[n for n, w in placed.items() if w == "offload"],
            offload_src="device",
            offload_dst="pinned_host",
        )
    if name not in REMAT_POLICIES:
        raise ValueError(
            _errors.decoder_bad_choice("remat_policy", "name", name, list(REMAT_POLICIES))
        )
    return REMAT_POLICIES[name]


def custom_places(name: str) -> dict[str, str]:
    """Where a ``custom:`` policy puts each named activation (`NAMED` -> ``device``,
    ``offload`` or ``remat``).

    Raises:
      ValueError: a name the decoder does not give an activation, or a place other
        than those three.

    >>> custom_places('custom:context=device')['context']
    'device'
    """
    placed: dict[str, str] = dict.fromkeys(NAMED, "remat")
    for item in filter(None, name[len(CUSTOM) :].split(",")):
        key, _, where = item.partition("=")
        key, where = key.strip(), where.strip()
        if key not in NAMED:
            raise ValueError(_errors.decoder_bad_choice("remat_policy", "custom", key, NAMED))
        if where not in ("device", "offload", "remat"):
            raise ValueError(
                _errors.decoder_bad_choice(
                    "remat_policy", key, where, ("device", "offload", "remat")
                )
            )
        placed[key] = where
    return placed
