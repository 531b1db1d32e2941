"""The plot and the Markdown tables of `overhead.py`'s results, for docs/performance.md.

`overhead.py` calls `write` after a run: next to ``overhead[-TAG].json`` it writes
``overhead[-TAG].png`` (time per call over the raw ``jax.jit`` floor, by depth) and
``overhead[-TAG].md`` (the tables). To put a run into the docs:

    python benchmarks/overhead_report.py benchmarks/results/overhead.json --docs

re-makes both from the JSON (nothing is measured), writes the plot to
docs/assets/overhead.png and the JSON to docs/assets/overhead.json (the source of the
page's numbers), and replaces what lies between the ``<!-- overhead:NAME -->``
and ``<!-- /overhead:NAME -->`` markers of docs/performance.md (NAME: ``summary``,
``tables``, ``spread``, ``machine``) with the new text. Only the standard library and matplotlib.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "performance.md"
FIGURE = REPO / "docs" / "assets" / "overhead.png"

STEP_TITLES = {
    "noop": "No-op step (only a counter changes)",
    "train": "Train step (forward, gradient, SGD update)",
}
SHORT = {"noop": "no-op", "train": "train"}
LABELS = {
    "nnx_sharding.jit": "`nnx_sharding.jit`",
    "nnx_sharding.jit (donate)": "`nnx_sharding.jit`, donating",
    "nnx_sharding Compiled": "`nnx_sharding` `Compiled`",
    "nnx.jit (graph)": "`flax.nnx.jit` (graph mode)",
    "nnx.jit (graph=False)": "`flax.nnx.jit` (tree mode)",
    "nnx.cached_partial": "`nnx.cached_partial`",
    "functional jax.jit": "`jax.jit` on `nnx.split`/`merge`",
    "floor (a)": "raw `jax.jit` (the floor)",
    "floor (b)": "raw `jax.jit` (the floor)",
}
"""Row labels of the tables (Markdown), by variant; a new variant shows as its name."""
OURS = "nnx_sharding"


def label(variant: str, markdown: bool = True) -> str:
    """The variant's row label; without Markdown, for the plot's legend."""
    text = LABELS.get(variant, f"`{variant}`")
    return text if markdown else text.replace("`", "")


def _rows(step: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The variants shown for a step: all that ran, the step's own floor last."""
    variants = step["variants"]
    shown = [
        (name, cells)
        for name, cells in variants.items()
        if not name.startswith("floor") and any(c.get("us") is not None for c in cells.values())
    ]
    return [*shown, (step["floor"], variants[step["floor"]])]


def _us(us: float) -> str:
    return f"{us:,.0f} µs" if us >= 100 else f"{us:.1f} µs"


def _times(ratio: float) -> str:
    return f"{ratio:.0f}×" if ratio >= 10 else f"{ratio:.1f}×" if ratio >= 2 else f"{ratio:.2f}×"


def tables(report: dict[str, Any]) -> str:
    """One Markdown table per step: time per call and its ratio to the floor, by depth."""
    depths = report["settings"]["depths"]
    out = []
    for name, step in report["steps"].items():
        out.append(f"{STEP_TITLES.get(name, name)}, time per call (× the floor):\n")
        out.append("| | " + " | ".join(f"depth {d}" for d in depths) + " |")
        out.append("|---" * (len(depths) + 1) + "|")
        for variant, cells in _rows(step):
            row = []
            for d in depths:
                c = cells.get(str(d)) or {}
                if c.get("us") is None:
                    row.append("n/a")
                elif variant == step["floor"]:
                    row.append(_us(c["us"]))
                else:
                    row.append(f"{_us(c['us'])} ({_times(c['ratio'])})")
            out.append(f"| {label(variant)} | " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def spread(report: dict[str, Any]) -> str:
    """Our rows' ratios with their interquartile range over the paired rounds."""
    depths = report["settings"]["depths"]
    out = ["| | " + " | ".join(f"depth {d}" for d in depths) + " |"]
    out.append("|---" * (len(depths) + 1) + "|")
    for name, step in report["steps"].items():
        for variant, cells in _rows(step):
            if not variant.startswith(OURS):
                continue
            row = []
            for d in depths:
                c = cells.get(str(d)) or {}
                s = c.get("spread") or []
                row.append(
                    f"{c['ratio']:.2f}× ({s[1]:.2f}–{s[3]:.2f})"
                    if len(s) == 5 and c.get("ratio") is not None
                    else "n/a"
                )
            step_name = SHORT.get(name, name)
            out.append(f"| {step_name}, {label(variant)} | " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


def _ratio_of(step: dict[str, Any], variant: str, depth: int) -> float | None:
    cell = step["variants"].get(variant, {}).get(str(depth)) or {}
    return cell.get("ratio") if cell.get("us") is not None else None


def summary(report: dict[str, Any]) -> str:
    """The deepest model's ratios, ours against flax's modes, as a sentence per step."""
    depth = max(report["settings"]["depths"])
    what = {"noop": "a call that changes only a counter", "train": "a training step"}
    out = []
    for name, step in report["steps"].items():
        ours = [
            r
            for v in step["variants"]
            if v.startswith(OURS) and (r := _ratio_of(step, v, depth)) is not None
        ]
        graph = _ratio_of(step, "nnx.jit (graph)", depth)
        tree = _ratio_of(step, "nnx.jit (graph=False)", depth)
        if not ours:
            continue
        low, high = min(ours), max(ours)
        mine = _times(low) if _times(low) == _times(high) else f"{_times(low)}–{_times(high)}"
        theirs = []
        if graph is not None:
            theirs.append(f"{_times(graph)} under `flax.nnx.jit` in graph mode")
        if tree is not None:
            theirs.append(f"{_times(tree)} in tree mode")
        text = f"- **{what.get(name, name).capitalize()}** costs {mine} the floor"
        out.append(text + (f", against {' and '.join(theirs)}." if theirs else "."))
    return f"At depth {depth}:\n\n" + "\n".join(out) + "\n"


def machine(report: dict[str, Any]) -> str:
    """The machine and the versions, one sentence."""
    m, s = report["machine"], report["settings"]
    where = f"{m.get('platform', '?').upper()}, {m.get('cpu_count', '?')} cores"
    if m.get("platform") not in (None, "cpu"):
        where = f"{m.get('device_kind', m['platform'])} ({m.get('cpu_count', '?')} CPU cores)"
    note = f" {m['note']}" if m.get("note") else ""
    return (
        f"Measured on: {where}; jax {m.get('jax', '?')}, flax {m.get('flax', '?')}; "
        f"{s.get('blocks', '?')} paired rounds per measurement.{note}\n"
    )


def plot(report: dict[str, Any], path: Path) -> None:
    """Time per call over the step's floor, by depth: one panel per step, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = report["settings"]["depths"]
    steps = report["steps"]
    fig, axes = plt.subplots(1, len(steps), figsize=(12, 5), squeeze=False)
    names = [v for step in steps.values() for v in step["variants"] if not v.startswith("floor")]
    palette = plt.colormaps["tab10"].colors  # one color per variant, the same in each panel
    colors = {v: palette[i % len(palette)] for i, v in enumerate(dict.fromkeys(names))}
    handles: dict[str, Any] = {}
    for ax, (name, step) in zip(axes[0], steps.items(), strict=True):
        for variant, cells in _rows(step):
            points = [
                (d, 1.0 if variant == step["floor"] else c["ratio"])
                for d in depths
                if (c := cells.get(str(d)) or {}).get("us") is not None
                and (variant == step["floor"] or c.get("ratio") is not None)
            ]
            if not points:
                continue
            ours = variant.startswith(OURS)
            (line,) = ax.plot(
                *zip(*points, strict=True),
                "--" if variant == step["floor"] else "-",
                marker="o",
                linewidth=2.5 if ours else 1.5,
                color="black" if variant == step["floor"] else colors[variant],
            )
            handles[label(variant, markdown=False)] = line
        ax.set(title=STEP_TITLES.get(name, name), xlabel="model depth (blocks)")
        ax.set(ylabel="time per call ÷ raw jax.jit", xscale="log", yscale="log")
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.set_xticks([], minor=True)
        ax.grid(True, which="both", alpha=0.3)
    order = [label(v, markdown=False) for v in dict.fromkeys(names)]
    order = [name for name in order if name in handles] + [n for n in handles if n not in order]
    fig.legend([handles[n] for n in order], order, loc="lower center", ncol=4, fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(report: dict[str, Any], stem: Path) -> None:
    """``STEM.png`` and ``STEM.md`` from a run's report."""
    plot(report, stem.with_suffix(".png"))
    text = "\n".join(make(report) for make in (summary, tables, spread, machine))
    stem.with_suffix(".md").write_text(text)


def splice(page: str, name: str, text: str) -> str:
    """``page`` with the text between ``<!-- overhead:NAME -->`` and its end marker replaced."""
    pattern = re.compile(
        rf"(<!-- overhead:{name} -->\n).*?(<!-- /overhead:{name} -->)", flags=re.DOTALL
    )
    if not pattern.search(page):
        raise SystemExit(f"{PAGE}: no <!-- overhead:{name} --> ... <!-- /overhead:{name} -->")
    # blank lines around the text: Markdown ends an HTML block (the marker) at one
    return pattern.sub(lambda m: f"{m[1]}\n{text.strip()}\n\n{m[2]}", page)


def update_docs(report: dict[str, Any], page: Path = PAGE, figure: Path = FIGURE) -> None:
    """docs/performance.md's tables and machine line, docs/assets/overhead.png, and the
    results they come from, docs/assets/overhead.json."""
    text = page.read_text()
    parts = (("summary", summary), ("tables", tables), ("spread", spread), ("machine", machine))
    for name, make in parts:
        text = splice(text, name, make(report))
    plot(report, figure)
    figure.with_suffix(".json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    page.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="an overhead[-TAG].json of overhead.py")
    parser.add_argument(
        "--docs", action="store_true", help="update docs/performance.md and its figure"
    )
    args = parser.parse_args()
    report = json.loads(args.results.read_text())
    if args.docs:
        update_docs(report)
        print(f"updated {PAGE.relative_to(REPO)} and {FIGURE.relative_to(REPO)}")
    else:
        write(report, args.results.with_suffix(""))
        print(f"wrote {args.results.with_suffix('.png')} and {args.results.with_suffix('.md')}")


if __name__ == "__main__":
    main()
