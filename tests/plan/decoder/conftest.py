"""Fixtures of the decoder's tests."""

from __future__ import annotations

import math

import jax
import pytest


@pytest.fixture
def saved_elements(capsys):
    """``saved_elements(f, *args)``: the element counts of what ``jax.vjp(f)`` saves for
    the backward pass beyond its arguments and constants, as
    ``jax.ad_checkpoint.print_saved_residuals`` lists them."""

    def counts(f, *args) -> list[int]:
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(f, *args)
        found = []
        for line in capsys.readouterr().out.splitlines():
            if "from the argument" in line or "from a constant" in line:
                continue
            dims = line.split("[", 1)[1].split("]", 1)[0]  # f32[2,64@context,4,16] ...
            found.append(math.prod(int(d.split("@")[0]) for d in dims.split(",") if d))
        return found

    return counts
