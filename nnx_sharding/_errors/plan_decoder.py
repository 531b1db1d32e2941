"""Messages of the planner's decoder (``plan/_decoder/``): its config, remat policies,
attention kernels, knobs and microbatches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .layout import (
    choice_message,
    divisors,
    format_message,
    listing,
    microbatches_message,
    quoted,
)

__all__ = [
    "context_bad_seq",
    "context_ulysses_heads",
    "decoder_bad_choice",
    "decoder_bad_kv_heads",
    "decoder_vocab_tiles",
    "decoder_bad_size",
    "decoder_unknown_knobs",
    "microbatches_indivisible",
]


_CHOSEN = {
    "remat": "the block's rematerialization policy, a name in REMAT_POLICIES",
    "name": "a rematerialization policy, a name in REMAT_POLICIES",
    "attention": "the attention kernel ('auto': the target's own)",
    "implementation": "the attention kernel ('auto': the target's own)",
    "activation": "the MLP's activation",
    "param_dtype": "the parameters' dtype",
    "compute_dtype": "the dtype of the matmuls and the activations",
    "context_strategy": "the context-parallel attention strategy (CONTEXT_STRATEGIES)",
}
"""What each field `decoder_bad_choice` is about chooses."""


def decoder_bad_choice(where: str, field: str, value: object, choices: Sequence[object]) -> str:
    """``where``: the function or class given ``field=value``."""
    rule = f"Rule: {field} is {_CHOSEN.get(field, 'one of the choices')}."
    return choice_message(where, field, value, choices, rule)


def decoder_bad_size(field: str, value: object) -> str:
    """A size of `DecoderConfig` (``field``) that is not a positive int."""
    return format_message(
        "DecoderConfig",
        field,
        [f"{value!r} is not a positive integer"],
        "Rule: the decoder's sizes (vocab, d_model, heads, head_dim, mlp, layers, batch, "
        "seq_len, and kv_heads when given) are positive integers.",
        [f"give {field} as a count, e.g. `{field}=2`."],
    )


def decoder_bad_kv_heads(kv_heads: int, heads: int) -> str:
    """``kv_heads`` that does not divide ``heads``: the query heads would not split into
    equal groups."""
    fitting = divisors(heads)
    smaller = [d for d in fitting if d <= kv_heads]
    return format_message(
        "DecoderConfig",
        "kv_heads",
        [f"{kv_heads} does not divide heads={heads}"],
        "Rule: each key/value head serves an equal group of query heads (grouped-query "
        f"attention): kv_heads divides heads, here one of {listing(fitting, 12)}.",
        [
            f"choose one, e.g. `kv_heads={smaller[-1]}`;",
            "or leave kv_heads out (None): a key/value head for each query head.",
        ],
    )


def decoder_vocab_tiles(tiles: object, seq: int) -> str:
    """``vocab_tiles`` that is not a positive int dividing ``seq_len``: the tokens of each
    sequence would not split into equal tiles."""
    fitting = divisors(seq)
    under = [d for d in fitting if isinstance(tiles, int) and d <= tiles] or [1]
    return format_message(
        "DecoderConfig",
        "vocab_tiles",
        [f"{tiles!r} does not divide seq_len={seq}"],
        "Rule: the loss takes each sequence's tokens in equal tiles: vocab_tiles is a "
        f"positive int that divides seq_len, here one of {listing(fitting, 12)}.",
        [
            f"choose one, e.g. `vocab_tiles={under[-1]}`;",
            "or leave vocab_tiles out (1): the whole batch's logits at once.",
        ],
    )


def decoder_unknown_knobs(unknown: Sequence[str], knobs: Mapping[str, object]) -> str:
    """``knobs``: those the decoder's builder reads, with their defaults."""
    return format_message(
        "decoder_builder",
        "knobs",
        [f"unknown knobs {quoted(unknown)}"],
        f"Rule: the decoder's step reads the knobs {quoted(list(knobs))} (remat: a name in "
        "REMAT_POLICIES; microbatches: the gradient accumulation steps), nothing else.",
        [
            f"give only those, e.g. `{dict(knobs)!r}` (their defaults);",
            "or plan a builder of your own, which reads the knobs it takes (see "
            "nnx_sharding.plan.Built).",
        ],
    )


def microbatches_indivisible(where: str, microbatches: object, batch: int) -> str:
    """``where``: `accumulate_gradients`, given ``microbatches``, or the decoder's builder,
    given it as a knob."""
    if where == "decoder_builder":
        return microbatches_message(
            where, "knobs", microbatches, batch, lambda k: f"{{'microbatches': {k}}}"
        )
    return microbatches_message(
        where, "microbatches", microbatches, batch, lambda k: f"microbatches={k}"
    )


def context_bad_seq(strategy: str, seq: int, parts: int, chunks: int) -> str:
    """A sequence the ``context`` axis cannot split as ``strategy`` needs."""
    balanced = chunks != parts
    why = " (two per device, load-balanced)" if balanced else ""
    fitting = [d for d in divisors(seq) if d > 1 and seq % (d * (2 if balanced else 1)) == 0]
    return format_message(
        "context_attention",
        "seq_len",
        [
            f"a sequence of {seq} does not split into {chunks} equal chunks{why} over the "
            f"'context' axis of {parts} devices"
        ],  # fmt: skip
        f"Rule: context parallelism with {strategy!r} splits the sequence into "
        f"{'2 × context' if balanced else 'context'} equal chunks.",
        [
            f"make seq_len a multiple of {chunks}, e.g. `seq_len={seq + (-seq) % chunks}`.",
            f"use a 'context' axis that fits the sequence: one of {listing(fitting)}.",
        ],  # fmt: skip
    )


def context_ulysses_heads(heads: int, local_heads: int, parts: int) -> str:
    """Ulysses with heads per device that the ``context`` axis does not divide."""
    return format_message(
        "context_attention",
        "context_strategy",
        [
            f"'ulysses' splits each device's {local_heads} query heads (of {heads}) over the "
            f"'context' axis of {parts}, which does not divide them"
        ],  # fmt: skip
        "Rule: Ulysses trades the sequence split for a split of the heads, so the heads on "
        "each device must divide by the context axis.",
        [
            "use `context_strategy='all_gather'` (or 'ring'), which split the sequence only.",
            f"use a 'context' axis that divides {local_heads}: one of "
            f"{listing([d for d in divisors(local_heads) if d > 1][:8])}.",
        ],  # fmt: skip
    )
