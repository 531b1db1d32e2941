"""Griffe extensions for the API reference: doctests shown as code, readable signatures.

`DoctestBlocks`:

The package's docstrings hold bare doctest blocks (``>>>`` lines and their expected
output, run by ``pytest --doctest-modules``). Markdown would read ``>>>`` as nested
block quotes and ``x['a']`` as a link; this wraps each block that starts at the left
margin into a ```` ```pycon ```` fence. Blocks inside an ``Examples:`` section are
indented, and left to griffe's own parser.

`OverloadParameters`: a function written as ``def jit(fun=None, **options)`` with typed
``@overload``s shows, in its signature and its parameter table, the overloads' keywords
with their defaults (griffe looks a documented parameter's default up in the signature
it sees, and prints "required" when it is not there). An ``Args:`` entry naming several
parameters (``a, b: ...``) becomes one entry per name, so each finds its default.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SEVERAL = re.compile(r"^(?P<indent>\s+)(?P<names>\w+(?:, \w+)+): (?P<text>.*)$")


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


def split_names(text: str) -> str:
    """``a, b: text`` entries of an ``Args:`` section as ``a: text`` and ``b: text``."""
    out: list[str] = []
    section = False
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith(" "):
            section = line.strip() in {"Args:", "Arguments:", "Parameters:"}
        found = _SEVERAL.match(line) if section else None
        if found is None:
            out.append(line)
            i += 1
            continue
        indent = found["indent"]
        body = [found["text"]]
        i += 1
        while i < len(lines) and lines[i].startswith(indent + " "):  # its continuation lines
            body.append(lines[i])
            i += 1
        for name in found["names"].split(", "):
            out.append(f"{indent}{name}: {body[0]}")
            out.extend(body[1:])
    return "\n".join(out)


class OverloadParameters(griffe.Extension):
    """Shows the overloads' keywords in place of an implementation's ``**options``."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = split_names(obj.docstring.value)

    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        params = func.parameters
        var_keyword = griffe.ParameterKind.var_keyword
        if not func.overloads or not any(p.kind is var_keyword for p in params):
            return
        merged: dict[str, griffe.Parameter] = {}
        for overload in func.overloads:
            for param in overload.parameters:
                if param.name in merged:
                    continue
                own = params[param.name] if param.name in params else None
                merged[param.name] = own if own is not None else param
        func.parameters = griffe.Parameters(*merged.values())
