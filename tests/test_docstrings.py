"""Docstrings say what and why; measurements and their dates live in the docs.

A docstring of the package (a module's, a class's, a function's, or the string under an
assignment) names no measurement context: no jax version, no "measured on ...", no "took
N", no sub-millisecond timing, no GiB figure with decimals, no date. Its ``>>>`` examples
are not prose and are not checked. A quoted heading (``"Measured on a GPU"``) is a pointer
to the docs, not a claim.
"""

from __future__ import annotations

import ast
import doctest
import re
from pathlib import Path

import pytest
from test_imports import PACKAGE

MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
MEASUREMENT = re.compile(
    r"\bjax \d+\.\d+(?:\.\d+)?"  # a jax version: what a figure was measured with
    r'|(?<!")\b[Mm]easured on\b'  # a claim; the quoted heading is only a pointer
    r"|\b(?:[Tt]ook|ran in) \d[\d.]*"  # "took 2.8 s", "ran in 195 ms"
    r"|\b\d[\d.]* ?[µn]s\b|\b\d[\d.]* m?s\b"  # "2-4 µs", "25-30 ns", "209 ms", "about 2 s"
    r"|\b\d+\.\d+x\b"  # a benchmark's ratio: "1.7x its size"
    r"|\b\d+\.\d+ ?GiB\b"  # a run's memory: "79.78 GiB"
    rf"|\b(?:19|20)\d\d-\d\d-\d\d\b|\b(?:{MONTHS}) (?:19|20)\d\d\b"  # a date
)
LITERAL = re.compile(r"``.*?``")
"""Code written inline (``'12.3 ms'``): an example of a format, not a figure."""


def measurements(docstring: str) -> list[str]:
    """The measurement context named in the prose of ``docstring`` (its ``>>>`` examples
    and their output left out).

    >>> measurements('It ran in 195 ms on jax 0.11.2 (docs/x.md, "Measured on a GPU").')
    ['ran in 195', 'jax 0.11.2']
    >>> measurements("``format_seconds(0.0123)`` is ``'12.3 ms'``.")
    []
    """
    prose = "".join(p for p in doctest.DocTestParser().parse(docstring) if isinstance(p, str))
    prose = LITERAL.sub("``…``", " ".join(prose.split()))
    return [m.group(0) for m in MEASUREMENT.finditer(prose)]


def offences(root: Path) -> list[str]:
    """``path:line: match`` for every measurement in a docstring of the modules under
    ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                for match in measurements(node.value.value):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {match}")
    return found


def test_no_docstring_of_the_package_carries_a_measurement() -> None:
    assert offences(PACKAGE) == [], "move the figures to the docs and point there"


@pytest.mark.parametrize(
    "text",
    [
        "prints 30 lines of their start-up errors (jax 0.10.2, measured). So",
        "a GPU multiplies zeros faster, 894 against 788 TFLOP/s measured on an H200, so",
        "Measured on 2 CPU cores for llama3-8b on 64 H100s: ptxas and LLVM took 2.8 s",
        "over a 95 GiB chip, ``peak_memory_in_bytes`` at 84.97 GiB, and the run fit",
        "Each saves memory (7B on 8 H100s, FSDP: 137.6, 69.4, 62.3 and 24.4 GiB per GPU).",
        "decoder's step took 321 ms without remat and 302 ms saving the matmuls'",
        "Python that is ``all(map(operator.is_, xs, ys))``, 25-30 ns a value",
        "flax's answer costs 2-4 µs for a non-node",
        "Measured on small models (a 2-layer MLP, 0.5 to 9 MiB per device)",
        "on an H200, a 1B decoder's step predicted at 209 ms ran in 195 ms with cuDNN",
        "the buffers of a whole model, beside the model (1.7x its size at the peak)",
        "imports the package, and so jax, which takes about 2 s).",
        "the published run (MaxText, April 2024)",
    ],
)
def test_what_the_docstrings_said_is_caught(text: str) -> None:
    assert measurements(text)


@pytest.mark.parametrize(
    "text",
    [
        'So a plan made with no GPU prices it (docs/planning/predictions.md, "Measured on a GPU").',
        "Sizes and durations as people read them: ``1.50 KiB``, ``12.3 ms``.",
        "flax 0.12.8 runs ``nnx.jit`` on its full graph protocol only when both are on",
        "h100       989e12    67e12     80 GB   3.35e12   450e9, 5 us      50e9, 10 us",
        ">>> format_bytes(80 * 2**30)\n'80.00 GiB'\n",
    ],
)
def test_what_docstrings_may_say_is_not(text: str) -> None:
    assert measurements(text) == []
