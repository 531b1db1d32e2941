"""`Built`: what a step builder returns for one point of a knob search."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Built:
    """A training step and its arguments, built for one set of knob values.

    A builder (``build(knobs) -> Built``) turns knob values such as
    ``{'remat': 'dots', 'microbatches': 4}`` into the step the planner compiles under
    each layout. ``model_flops`` is the step's useful work counted from the model (for
    a decoder ``6·N·tokens`` plus attention), the numerator of the model TFLOP/s
    that published runs report; ``None`` where the builder does not know it.
    ``rules``: the logical axis rules of the step's sharding metadata, which `search`
    uses where it is given none (`decoder_builder` gives `DECODER_RULES`).
    ``sequence``: the length of the sequence the step splits over a ``context`` axis
    (its activations named ``activation_length``, as the decoder's are), which context-
    parallel candidates must divide; None: the step splits no sequence, and `search`
    proposes no context-parallel layout unless ``layouts`` names one.

    >>> Built(lambda x: x, (1.0,)).jit_options
    {}
    """

    step: Callable[..., Any]
    args: tuple[Any, ...]
    jit_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model_flops: float | None = None
    rules: Sequence[tuple[str, str | None]] | None = None
    sequence: int | None = None
