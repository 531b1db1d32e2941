"""Every ```python block of every docs/*.md page runs, so the docs cannot rot.

The blocks of one page run in order in one fresh namespace, as a reader would paste
them, on the 8 simulated CPU devices of conftest.py. A block preceded by the line
``<!-- skip-test -->`` is not run; use that sparingly (for code that needs several
processes, say). Output and other non-Python text belong in ```text or ```console
fences, which are not run. The docstrings' examples run as doctests
(``--doctest-modules`` in pyproject.toml).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
SKIP = "<!-- skip-test -->"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
RUN = {"python", "py"}


def code_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(first line number, code, skipped)`` of each ```python block, in page order."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        ticks, indent = opening["ticks"], opening["indent"]
        end = i + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(ticks) and set(lines[end].strip()) == {ticks[0]}
        ):
            end += 1
        if opening["info"].lower() in RUN:
            before = [line.strip() for line in lines[:i] if line.strip()]
            skipped = bool(before) and before[-1] == SKIP
            body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
            blocks.append((i + 2, textwrap.dedent("\n".join(body)), skipped))
        i = end + 1
    return blocks


PAGES = sorted(DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_code_runs(page: Path) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for line, code, skipped in code_blocks(page.read_text()):
        if skipped:
            continue
        # Padded so that tracebacks give the line numbers of the .md file.
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)


def test_code_blocks_are_found() -> None:
    text = "\n".join(
        [
            "```python",
            "a = 1",
            "```",
            "```text",
            "not run",
            "```",
            SKIP,
            "",
            "```python",
            "b = 2",
            "```",
            "- item",
            "",
            "    ```py",
            "    if True:",
            "        c = 3",
            "    ```",
        ]
    )
    assert code_blocks(text) == [
        (2, "a = 1", False),
        (10, "b = 2", True),
        (15, "if True:\n    c = 3", False),
    ]
