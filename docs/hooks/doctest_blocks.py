"""Griffe extension for the API reference: shows docstring doctests as code.

The package's docstrings hold bare doctest blocks (``>>>`` lines and their expected
output, run by ``pytest --doctest-modules``). Markdown would read ``>>>`` as nested
block quotes and ``x['a']`` as a link; this wraps each block that starts at the left
margin into a ```` ```pycon ```` fence. Blocks inside an ``Examples:`` section are
indented, and left to griffe's own parser.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """Wraps every left-margin doctest block (up to the next blank line) in a fence."""
    out: list[str] = []
    in_fence = in_block = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if in_block and not line.strip():
            out.append("```")
            in_block = False
        elif not in_fence and not in_block and line.startswith(">>>"):
            out.append("```pycon")
            in_block = True
        out.append(line)
    if in_block:
        out.append("```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Applies `fence_doctests` to every docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
