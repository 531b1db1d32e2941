"""benchmarks/overhead_report.py: docs/performance.md shows the numbers of its results file.

The page's tables, summary and machine line are generated from docs/assets/overhead.json;
a page edited by hand, or a results file replaced without re-running the report, fails.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location(
    "overhead_report", ROOT / "benchmarks" / "overhead_report.py"
)
assert SPEC is not None and SPEC.loader is not None
report_module = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(report_module)

PAGE = ROOT / "docs" / "performance.md"
RESULTS = json.loads((ROOT / "docs" / "assets" / "overhead.json").read_text())
PARTS = {
    "summary": report_module.summary,
    "tables": report_module.tables,
    "spread": report_module.spread,
    "machine": report_module.machine,
}


def between(page: str, name: str) -> str:
    found = re.search(
        rf"<!-- overhead:{name} -->\n(.*?)<!-- /overhead:{name} -->", page, flags=re.DOTALL
    )
    assert found, name
    return found[1].strip()


@pytest.mark.parametrize("name", PARTS)
def test_the_page_shows_its_results_file(name):
    assert between(PAGE.read_text(), name) == PARTS[name](RESULTS).strip()


def test_regenerating_the_page_changes_nothing():
    page = PAGE.read_text()
    again = page
    for name, make in PARTS.items():
        again = report_module.splice(again, name, make(RESULTS))
    assert again == page


def test_tables_have_every_variant_that_ran_and_the_floor():
    text = report_module.tables(RESULTS)
    for step in RESULTS["steps"].values():
        floor = step["variants"][step["floor"]]
        for depth in RESULTS["settings"]["depths"]:
            assert f"| {report_module.label(step['floor'])} |" in text
            assert f"| {report_module._us(floor[str(depth)]['us'])}" in text
        for variant, cells in step["variants"].items():
            ran = any(c.get("us") is not None for c in cells.values())
            if ran and not variant.startswith("floor"):
                assert f"| {report_module.label(variant)} |" in text, variant
    # flax's modes and the floor, by depth: the rows a reader compares
    for row in ("`flax.nnx.jit` (graph mode)", "`flax.nnx.jit` (tree mode)"):
        assert text.count(f"| {row} |") == len(RESULTS["steps"])


def test_a_cell_is_time_and_ratio():
    step = RESULTS["steps"]["train"]
    cell = step["variants"]["nnx_sharding.jit"]["100"]
    line = next(
        line
        for line in report_module.tables({**RESULTS, "steps": {"train": step}}).splitlines()
        if line.startswith("| `nnx_sharding.jit` |")
    )
    assert line.split(" | ")[-1].rstrip(" |") == f"{cell['us']:,.0f} µs ({cell['ratio']:.2f}×)"
