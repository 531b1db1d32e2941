"""docs/api.md: every public name is in the reference, grouped for users, without internals.

The public modules are the package and its public subpackages; a subpackage that is added
(``nnx_sharding.plan``) joins `PUBLIC` and must then be documented too. The built page
(``mkdocs build --strict``) is checked for what a reader sees: an anchor per public
name, no private classes or internal parameters, and every default shown.
"""

from __future__ import annotations

import html
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
PUBLIC = ("nnx_sharding", "nnx_sharding.checkpoint", "nnx_sharding.recipes", "nnx_sharding.plan")
"""The public modules; one that does not exist (yet) is skipped."""
PLANNING = importlib.util.find_spec("nnx_sharding.plan") is not None
GROUPS = ("Transforms", "Shardings", "Stages", "Inspection")
GROUPS += ("Planning",) * PLANNING + ("Checkpoints", "AOT and export", "Launching", "Recipes")
"""The sections of the reference, in order: ``Planning`` once ``nnx_sharding.plan`` exists."""
INTERNALS = ("CallPlan", "Site]", "_Stage", "Bases:", "**options", "jax_stage", "CachedCall")


def public_names() -> list[tuple[str, str]]:
    names = []
    for module in PUBLIC:
        if importlib.util.find_spec(module) is None:
            continue
        names += [(module, name) for name in importlib.import_module(module).__all__]
    return names


def directives(text: str) -> list[str]:
    """The objects the page renders, ``::: module.name``, in page order."""
    return re.findall(r"^::: ([\w.]+)\s*$", text, flags=re.MULTILINE)


@pytest.mark.parametrize("module, name", public_names(), ids="{0[0]}.{0[1]}".format)
def test_every_public_name_is_in_the_reference(module, name):
    shown = directives(API.read_text())
    assert f"{module}.{name}" in shown or module in shown, (module, name)


def test_the_reference_starts_with_what_users_call_grouped_for_them():
    text = API.read_text()
    assert directives(text)[:2] == ["nnx_sharding.jit", "nnx_sharding.JitWrapped"]
    headings = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    assert [h for h in headings if h in GROUPS] == list(GROUPS) == headings, headings
    for internal in INTERNALS:
        assert internal not in text


@pytest.fixture(scope="module")
def built_page(tmp_path_factory) -> str:
    """docs/api.md as mkdocs builds it (strict: a warning fails the build)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    return (site / "api" / "index.html").read_text()


def section(page: str, anchor: str) -> str:
    """The HTML of the object with this anchor, up to the next object's heading."""
    start = page.index(f'id="{anchor}"')
    end = page.find('class="doc doc-heading"', page.index(">", start))
    return page[start : end if end > 0 else None]


def test_the_built_reference_has_every_name_and_no_internals(built_page):
    anchors = set(re.findall(r'id="([\w.]+)"', built_page))
    missing = [f"{m}.{n}" for m, n in public_names() if f"{m}.{n}" not in anchors]
    assert not missing, missing
    text = html.unescape(re.sub(r"<[^>]+>", "", built_page))
    for internal in INTERNALS:
        assert internal not in text, internal


def parameter_rows(html_text: str) -> dict[str, str]:
    """Parameter name -> its Default cell, from the object's parameter table."""
    rows = {}
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", html_text, flags=re.DOTALL):
        cells = [
            " ".join(html.unescape(re.sub(r"<[^>]+>", " ", cell)).split())
            for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.DOTALL)
        ]
        if len(cells) == 4:  # name, type, description, default
            rows[cells[0]] = cells[3]
    return rows


def test_the_built_reference_shows_every_default(built_page):
    """``jit(fun=None, **options)`` shows its keywords with their defaults, not "required"."""
    jit = section(built_page, "nnx_sharding.jit")
    signature = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", jit)).split())
    rows = parameter_rows(jit)
    expected = {"fun": "None", "in_shardings": "None", "out_shardings": "None"}
    expected |= {"donate_argnums": "None", "keep_unused": "False", "inline": "False"}
    for keyword, default in expected.items():
        assert rows.get(keyword) == default, (keyword, rows)
        assert re.search(rf"{keyword} : [^=]+ = {default} ,", signature), keyword
    assert "required" not in rows.values(), rows
    # a parameter without a default still says so
    assert parameter_rows(section(built_page, "nnx_sharding.export"))["fun"] == "required"
