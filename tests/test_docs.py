"""Every ```python block of README.md and of every docs/*.md page runs as pasted.

The blocks of one page run in order in one fresh Python process, as a reader would
paste them into a new interpreter: the environment has no device flags
(``JAX_NUM_CPU_DEVICES``, ``XLA_FLAGS``, ``JAX_PLATFORMS`` are removed), so a page
that needs several devices must set them itself in its first block, and a page that
depends on the suite's set-up (conftest.py's 8 devices) fails. A block preceded by
the line ``<!-- skip-test -->`` is not run; use that sparingly (for code that needs
several processes, say). Output and other non-Python text belong in ```text or
```console fences, which are not run. The docstrings' examples run as doctests
(``--doctest-modules`` in pyproject.toml).

Without pytest-xdist every page's process is started at once on the first page's
test (at most one per CPU), so the pages run side by side; under xdist each test
runs its own page, in its worker.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SKIP = "<!-- skip-test -->"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
RUN = {"python", "py"}
DEVICE_FLAGS = ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS")
TIMEOUT_S = 600

# Runs in the child: the blocks, in order, in one namespace, as a pasted session would.
RUNNER = """\
import json, sys
page, blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for line, code in blocks:
    # Padded so that tracebacks give the line numbers of the .md file.
    exec(compile("\\n" * (line - 1) + code, page, "exec"), namespace)
"""


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


def clean_env() -> dict[str, str]:
    """This process's environment without device flags, the repository importable."""
    env = {k: v for k, v in os.environ.items() if k not in DEVICE_FLAGS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_page(page: Path) -> subprocess.CompletedProcess[str]:
    """Runs the page's blocks in a fresh interpreter, in a temporary directory."""
    blocks = [(line, code) for line, code, skipped in code_blocks(page.read_text()) if not skipped]
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run(
            [sys.executable, "-c", RUNNER],
            input=json.dumps([str(page), blocks]),
            capture_output=True,
            text=True,
            env=clean_env(),
            cwd=cwd,
            timeout=TIMEOUT_S,
        )


PAGES = sorted(DOCS.rglob("*.md"))


@functools.cache
def _pool() -> dict[Path, concurrent.futures.Future[subprocess.CompletedProcess[str]]]:
    """Every page started at once (outside xdist), one process per CPU at a time."""
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    return {page: executor.submit(run_page, page) for page in [README, *PAGES]}


def result(page: Path) -> subprocess.CompletedProcess[str]:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return run_page(page)
    return _pool()[page].result()


def check(page: Path) -> None:
    done = result(page)
    if done.returncode != 0:
        pytest.fail(
            f"{page.relative_to(ROOT)} does not run as pasted into a fresh interpreter "
            f"without device flags (rc {done.returncode}):\n{done.stderr[-6000:]}",
            pytrace=False,
        )


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_code_runs(page: Path) -> None:
    check(page)


def test_readme_code_runs() -> None:
    assert [code for _, code, skipped in code_blocks(README.read_text()) if not skipped]
    check(README)


# How a page that needs several devices gets them: its first block, exactly this.
DEVICE_SETUP = """\
# This page uses 8 devices: on a machine without them, simulate 8 on the CPU
# (this must run before jax is imported).
import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "8\""""
DEVICE_WORDS = re.compile(r"JAX_NUM_CPU_DEVICES|jax_num_cpu_devices|xla_force_host_platform")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_device_setup_comes_first(page: Path) -> None:
    """A page that asks for devices does it in its first block, in the common words."""
    blocks = [code for _, code, skipped in code_blocks(page.read_text()) if not skipped]
    asking = [code for code in blocks if DEVICE_WORDS.search(code)]
    if asking:
        assert blocks[0] == DEVICE_SETUP, f"{page.name}: first block:\n{blocks[0]}"
        assert asking == [blocks[0]], f"{page.name} sets devices after its first block"


def test_readme_sets_its_devices_first() -> None:
    first = code_blocks(README.read_text())[0][1]
    assert first.startswith(DEVICE_SETUP.replace("This page", "This example"))


def test_pages_run_without_device_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pages' interpreter gets none of the suite's device set-up: a page that does
    not ask for devices sees one."""
    page = tmp_path / "page.md"
    page.write_text(
        '```python\nimport jax\n\nassert len(jax.devices("cpu")) == 1, jax.devices()\n```\n'
    )
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    done = run_page(page)
    assert done.returncode == 0, done.stderr
    page.write_text('```python\nimport jax\n\nassert len(jax.devices("cpu")) == 8\n```\n')
    done = run_page(page)
    assert done.returncode != 0
    assert "AssertionError" in done.stderr
    assert f'File "{page}", line 4' in done.stderr  # the .md file's own line number


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
