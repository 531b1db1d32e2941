"""Code in the docs fits the page: every line of a code block is at most 88 columns.

Checked: the lines of ```python/```py/```bash/```sh/```shell blocks and the command
lines (``$ ...``) of ```console blocks, in docs/**/*.md and README.md. Output blocks
(```text, a console's output) show what a program prints and are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
WIDTH = 88
CODE = {"python", "py", "bash", "sh", "shell"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")


def code_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every checked line of the page's code blocks."""
    lines = text.splitlines()
    found = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        ticks, info = opening["ticks"], opening["info"].lower()
        end = i + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(ticks) and set(lines[end].strip()) == {ticks[0]}
        ):
            end += 1
        for number in range(i + 1, end):
            line = lines[number].removeprefix(opening["indent"])
            if info in CODE or (info == "console" and line.startswith("$ ")):
                found.append((number + 1, line))
        i = end + 1
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_code_lines_fit_in_88_columns(page):
    long = [
        f"{page.relative_to(ROOT)}:{number}: {len(line)} columns: {line.strip()[:60]}"
        for number, line in code_lines(page.read_text())
        if len(line) > WIDTH
    ]
    assert not long, "\n".join(long)


def test_the_checked_lines():
    text = "\n".join(
        [
            "```python",
            "x = 1",
            "```",
            "```text",
            "output " * 20,
            "```",
            "```console",
            "$ python -m nnx_sharding",
            "printed " * 20,
            "```",
            "- item",
            "",
            "    ```bash",
            "    echo hi",
            "    ```",
        ]
    )
    assert code_lines(text) == [(2, "x = 1"), (8, "$ python -m nnx_sharding"), (14, "echo hi")]
