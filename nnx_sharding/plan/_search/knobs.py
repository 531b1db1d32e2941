"""Knob points of a search: the product of a search space, and the two knobs whose
effect the planner knows (``remat`` and ``microbatches``), by which it orders them.

A builder's knobs are its own; the planner knows two of them by name:

- ``remat``: how much of the forward pass the backward pass recomputes, from
  `REMAT_ORDER`'s ``'none'`` (keeps every activation: most memory, fastest) to
  ``'full'`` (keeps a layer's inputs only: least memory, slowest). A value outside
  `REMAT_ORDER` is searched, but not ordered against the others.
- ``microbatches``: the batch accumulated in that many slices (gradient accumulation).

Every other knob is searched as given, each value apart.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from ... import _errors

REMAT_ORDER = ("none", "dots_with_context", "dots", "context", "full", "offload_input")
"""The remat policies the planner orders, by the names of `REMAT_POLICIES`, each keeping
fewer activations on the device than the one before: everything; the weight matmuls'
outputs and the attention's (``dots_with_context``); the weight matmuls' outputs
(``checkpoint_dots_with_no_batch_dims``); the attention's output (``context``); each
layer's input (``nothing_saveable``); nothing, the layer's input moved to the host
(``offload_input``). Each saves device memory and recomputes (or, last, moves) more
than the one before (measured for Llama 2 7B on 8 H100s: docs/planning/decoder.md, its
memory table). ``offload_qkv`` is left out: it keeps as little on the device as
``offload_input`` but recomputes less than ``full``, so whether it is faster than
``full`` depends on the host link; it is always compiled."""
KNOWN = ("remat", "microbatches")
PIPELINE_KNOBS = ("pipeline_microbatches", "pipeline_repeats")
"""The pipeline's knobs (`nnx_sharding.pipeline`'s ``microbatches`` and ``repeats``):
they act only under a ``stage`` axis."""
CONTEXT_KNOBS = ("context_strategy",)
"""Context parallelism's knob (the decoder's attention strategy): it acts only under a
``context`` axis."""
BALANCED = ("all_gather", "ring")
"""The context strategies that lay the sequence out load-balanced, two chunks a device:
the sequence must split into twice the ``context`` axis."""


class Rank(NamedTuple):
    """Where a knob point sits among the others: points of one ``group`` (the same
    values of every other knob) are ordered by ``remat`` (its index in `REMAT_ORDER`)
    and ``microbatches``."""

    group: tuple[Any, ...]
    remat: int
    microbatches: int


def rank(knobs: Mapping[str, Any]) -> Rank:
    """The `Rank` of a knob point; a remat value outside `REMAT_ORDER` is a group of
    its own.

    >>> rank({'remat': 'full', 'microbatches': 4, 'dtype': 'bf16'})
    Rank(group=(('dtype', 'bf16'),), remat=4, microbatches=4)
    """
    remat = knobs.get("remat", "none")
    ordered = isinstance(remat, str) and remat in REMAT_ORDER
    group = tuple(sorted((k, _key(v)) for k, v in knobs.items() if k not in KNOWN))
    if not ordered:
        group += (("remat", _key(remat)),)
    return Rank(group, REMAT_ORDER.index(remat) if ordered else 0, knobs.get("microbatches", 1))


def no_faster(a: Rank, b: Rank) -> bool:
    """Whether point ``b`` recomputes and accumulates at least as much as ``a``: the
    planner takes it to be no faster (more remat recomputes, more microbatches repeat
    the weights' reads and gathers; neither removes work).

    From no remat to a policy is the exception: saving fewer activations also writes
    and reads fewer, which can outweigh the recomputation, and did for a 1B and a 3B
    decoder's steps on a GPU. So ``none`` bounds only its own remat value; among
    policies, more remat was slower every time (measured: docs/planning/search.md,
    "What is compiled").

    >>> no_faster(Rank((), 1, 1), Rank((), 3, 2)), no_faster(Rank((), 0, 1), Rank((), 1, 1))
    (True, False)
    """
    remat = a.remat == b.remat or 0 < a.remat <= b.remat
    return a.group == b.group and remat and a.microbatches <= b.microbatches


def no_heavier(a: Rank, b: Rank) -> bool:
    """Whether point ``b`` needs no more memory than ``a``: more remat, and more
    microbatches when ``a`` already accumulates (from 1 to 2 microbatches adds the
    accumulated gradients, which can outweigh the halved activations).

    >>> no_heavier(Rank((), 0, 2), Rank((), 3, 4)), no_heavier(Rank((), 0, 1), Rank((), 0, 2))
    (True, False)
    """
    same = a.microbatches == b.microbatches or 2 <= a.microbatches <= b.microbatches
    return a.group == b.group and a.remat <= b.remat and same


def points(space: Mapping[str, Sequence[Any]] | None) -> list[dict[str, Any]]:
    """The knob points of a search space, its values' product in the order given.

    Raises:
      ValueError: a space that is not a mapping of names to non-empty sequences, or a
        ``microbatches`` value that is not a positive integer.

    >>> points({'remat': ['none', 'full'], 'microbatches': [1, 2]})[1]
    {'remat': 'none', 'microbatches': 2}
    >>> points(None)
    [{}]
    """
    if space is None:
        return [{}]
    if not isinstance(space, Mapping):
        raise ValueError(_errors.search_bad_space(space))
    for name, values in space.items():
        if not isinstance(name, str):
            raise ValueError(_errors.search_bad_space(space))
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ValueError(_errors.search_bad_knob_values(name, values))
    for value in space.get("microbatches", ()):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(_errors.search_bad_microbatches(value, None))
    names = list(space)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*space.values())]


def check_microbatches(knobs: Mapping[str, Any], batch: int | None) -> None:
    """Raises a ValueError when ``knobs['microbatches']`` does not divide the
    batch (the leading dimension of the step's data arguments), naming the divisors."""
    count = knobs.get("microbatches")
    if count is None or batch is None:
        return
    if batch % count:
        raise ValueError(_errors.search_bad_microbatches(count, batch))


class Reads(Mapping[str, Any]):
    """The knob values handed to a builder, recording the names it asks for (also those
    it asks for and lacks: ``knobs.get('remat', 'none')`` records ``remat``)."""

    def __init__(self, values: Mapping[str, Any], seen: set[str]):
        self._values = dict(values)
        self._seen = seen

    def __getitem__(self, name: str) -> Any:
        self._seen.add(name)
        return self._values[name]

    def __contains__(self, name: object) -> bool:
        if isinstance(name, str):
            self._seen.add(name)
        return name in self._values

    def __iter__(self) -> Iterator[str]:  # a builder that iterates reads every knob
        self._seen.update(self._values)
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return repr(self._values)


def label(knobs: Mapping[str, Any]) -> str:
    """>>> label({'remat': 'dots', 'microbatches': 4})
    'remat=dots, microbatches=4'"""
    return ", ".join(f"{k}={v}" for k, v in knobs.items())


def extensions(
    knobs: Mapping[str, Any], reads: set[str], batch: int | None, data_parallel: int
) -> list[dict[str, Any]]:
    """Knob points beyond ``knobs`` that save memory, lightest remat first then more
    microbatches (doubling, while they divide the batch and each slice splits over
    ``data_parallel`` devices): what the planner tries before saying nothing fits. Only
    the knobs the builder reads (``reads``) are changed.

    >>> extensions({'remat': 'none', 'microbatches': 2}, {'remat', 'microbatches'}, 16, 2)
    [{'remat': 'full', 'microbatches': 2}, {'remat': 'full', 'microbatches': 4}, \
{'remat': 'full', 'microbatches': 8}]
    """
    base = dict(knobs)
    out = []
    remat = base.get("remat", "none")
    lightest = "full"  # the host is not asked for unless the search names offloading
    if "remat" in reads and remat in REMAT_ORDER[: REMAT_ORDER.index(lightest)]:
        base["remat"] = lightest
        out.append(dict(base))
    if "microbatches" in reads and batch is not None:
        count = base.get("microbatches", 1) * 2
        while batch % count == 0 and (batch // count) % max(data_parallel, 1) == 0:
            out.append({**base, "microbatches": count})
            count *= 2
    return out


def parse_value(text: str) -> Any:
    """A knob value from the command line: an int, a float, ``true``/``false``, or the
    text.

    >>> [parse_value(x) for x in ('4', '0.5', 'true', 'dots')]
    [4, 0.5, True, 'dots']
    """
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        return value if kind is int or math.isfinite(value) else text
    return text.strip()


def _key(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value
