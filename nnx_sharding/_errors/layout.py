"""The layout every message follows: ``transform: argument: problem``, a rule, fixes.

Also the pieces that the messages of several areas share, word for word: listings,
fixes, problems (each module imports them from here).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence

DYNAMIC_FIX = "pass it as a dynamic argument (drop it from static_argnums/static_argnames);"
"""The first fix for a static argument that cannot be one."""

PAD_FIX = "pad the dimension to a multiple of the mesh axis size, or use a smaller mesh axis."
"""The last fix for an array whose dimension its mesh axes do not divide."""


def with_article(name: str) -> str:
    """``name`` with its indefinite article: ``an int``, ``a str``."""
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def listing(items: Sequence[object], at_most: int = 8) -> str:
    """The first ``at_most`` items, comma-separated: ``a, b, c and 4 more``."""
    items = list(items)
    shown = ", ".join(map(str, items[:at_most]))
    return shown + (f" and {len(items) - at_most} more" if len(items) > at_most else "")


def quoted(names: Sequence[object], empty: str = "") -> str:
    """Each name's repr, comma-separated: ``'data', 'model'``; ``empty`` when there is none."""
    return ", ".join(repr(n) for n in names) or empty


def jax_said(message: str) -> str:
    """The first line of jax's own message, as a message quotes it."""
    return f"(jax said: {message.splitlines()[0] if message else 'nothing'})"


def argument_differences(missing: Sequence[str], extra: Sequence[str], made: str) -> str:
    """``a is missing; b is not among the arguments it was <made> for``: how a call's
    arguments differ from those a program was made (lowered, exported) for."""
    parts = [f"{w} is missing" for w in missing]
    parts += [f"{w} is not among the arguments it was {made} for" for w in extra]
    return "; ".join(parts)


def wrap_in_spec(example: str) -> str:
    """The fix for mesh axis names given where a PartitionSpec belongs."""
    return f"wrap mesh axis names in PartitionSpec, e.g. `{example}`."


def mesh_fixes(action: str, example: str) -> list[str]:
    """The two ways to bind PartitionSpecs to a mesh: ``action`` under `jax.set_mesh`, or
    NamedShardings instead (``example``)."""
    return [
        f"{action} inside `with jax.set_mesh(mesh):`;",
        f"or give NamedShardings, e.g. `{example}`.",
    ]


def static_argument_message(
    transform: str, argument: str, problem: str, rule: str, fix: str, flax: str = ""
) -> str:
    """A static argument that cannot be one: `DYNAMIC_FIX`, then ``fix``, the other way."""
    return format_message(transform, argument, [problem], rule, [DYNAMIC_FIX, fix], flax=flax)


def bound_method_message(
    transform: str, argument: str, type_name: str, rule: str, fixes: Sequence[str]
) -> str:
    """A bound method of a graph node (a ``type_name``) given as the function, which flax's
    transforms refuse too."""
    return format_message(
        transform,
        argument,
        [f"a bound method of a graph node ({type_name})"],
        rule,
        fixes,
        flax=f"nnx.{transform} does not support bound methods",
    )


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, smallest first: ``divisors(8) == [1, 2, 4, 8]``."""
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatches_message(
    transform: str,
    argument: str,
    value: object,
    batch: int | None,
    example: Callable[[int], str],
) -> str:
    """``microbatches=value`` that does not divide ``batch`` (None: that is not a positive
    integer); the fix is ``example(k)``, the code that gives ``k`` microbatches."""
    shown = repr(value) if argument == "microbatches" else f"microbatches={value!r}"
    if batch is None:
        problem, ok = f"{shown} is not a positive integer", [1]
    else:
        ok = divisors(batch)
        problem = f"{shown} does not divide the batch of {batch} (its divisors: {listing(ok, 12)})"
    smaller = [d for d in ok if isinstance(value, int) and d <= value] or [1]
    return format_message(
        transform,
        argument,
        [problem],
        "Rule: the batch (the leading dimension of the step's data arguments) is split into "
        "microbatches of equal size: their number is a positive integer that divides it.",
        [f"choose one, e.g. `{example(smaller[-1])}`."]
        if batch is None
        else [f"choose one, e.g. `{example(smaller[-1])}`;", "or make the batch a multiple of it."],
    )


def choice_message(
    transform: str, argument: str, value: object, choices: Sequence[object], rule: str
) -> str:
    """``value`` is not one of ``choices``; the fix names the one spelled most alike."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    example = next((c for c in choices if close and str(c) == close[0]), choices[0])
    return format_message(
        transform,
        argument,
        [f"{value!r} is not one of {quoted(choices)}"],
        rule,
        [f"name one of them, e.g. `{argument}={example!r}`."],
    )


def fixes_of(message: str) -> list[str]:
    """The numbered fixes of a message `format_message` laid out ([] for another)."""
    _, found, fixes = message.partition("\nFixes:\n")
    return [re.sub(r"^ +\d+\. ", "", line) for line in fixes.splitlines()] if found else []


def format_message(
    transform: str,
    argument: str,
    problems: Sequence[str],
    rule: str,
    fixes: Sequence[str],
    flax: str = "",
) -> str:
    """Assembles the standard message layout; every ``problems`` entry is listed.

    ``flax``: flax's own words for the same error, which code written against flax
    may match on; they close the rule's line.
    """
    lines = [f"{transform}: {argument}: " + (problems[0] if len(problems) == 1 else "")]
    if len(problems) > 1:
        lines[0] += f"{len(problems)} problems:"
        lines += [f"  - {p}" for p in problems]
    lines.append(f'{rule} (flax: "{flax}")' if flax else rule)
    lines.append("Fixes:")
    lines += [f"  {i}. {fix}" for i, fix in enumerate(fixes, 1)]
    return "\n".join(lines)
