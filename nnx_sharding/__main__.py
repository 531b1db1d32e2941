"""The command line: ``python -m nnx_sharding [--devices N] [--steps N] [--mesh AXES]
[--checkpoint DIR]``, and its commands (`SUBCOMMANDS`): ``python -m nnx_sharding aot ...``,
``python -m nnx_sharding plan ...``, ``python -m nnx_sharding compilers ...``.

Trains the tensor-parallel MLP recipe (`nnx_sharding.recipes`) on simulated CPU
devices next to a single-device reference, then prints every parameter's sharding
and both final losses. A mesh with a ``data`` axis trains the data-parallel recipe
(with ``model`` too: both, on a 2-D mesh); one with a ``stage`` axis, the pipeline
recipe (a deeper MLP's blocks over ``stage``, beside ``data`` and ``model``); one with
an ``expert`` axis, the mixture-of-experts recipe (the experts over ``expert``, the
batch over ``data`` and ``expert``). With
``--checkpoint DIR`` the sharded run saves to DIR as it trains and, when DIR holds a
checkpoint, resumes from it.

Every command gets its simulated devices through `nnx_sharding._cli.common.cpu_devices_or_rerun`.
A new command is one entry of `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import sys
import textwrap
from collections.abc import Callable, Sequence

from ._cli.common import (
    Parser,
    add_devices_option,
    cpu_devices_or_rerun,
    mesh_axes,
    mesh_text,
    positive,
)
from ._cli.launch import DESCRIPTION as LAUNCH_DESCRIPTION
from ._cli.launch import USAGE as LAUNCH_USAGE

PROG = "python -m nnx_sharding"
JOB_AXES = ("stage", "expert", "data", "model")
"""The training job's mesh axes, outermost first: the pipeline's stages or the experts,
then the batch."""
DESCRIPTION = "Trains a sharded nnx MLP on simulated CPU devices next to a one-device reference."

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "aot": (
        "nnx_sharding._cli.aot:aot_main",
        "compile a sharded transformer's training step ahead of time, never allocated; "
        "print its per-device memory and cost",
    ),
    "plan": (
        "nnx_sharding._cli.plan:main",
        "plan the built-in decoder's layout on N devices (or your own builder's, "
        "--model), searching its knobs: ranked by predicted step time",
    ),
    "compilers": (
        "nnx_sharding._cli.compilers:main",
        "say where the planner's TPU and GPU compilers are; with --install, install them "
        "where only the planner loads them",
    ),
}
"""``python -m nnx_sharding NAME ...``: NAME -> (``module:function`` taking the rest of
the command line and returning the exit status, a one-line description for ``--help``)."""


def _epilog() -> str:
    """The recipes, the commands (from `SUBCOMMANDS`) and the launcher, for ``--help``."""

    width = max(8, *(len(name) + 2 for name in SUBCOMMANDS))  # the names, then two spaces

    def entry(head: str, text: str) -> str:
        indent = " " * (2 + width)
        lines = textwrap.wrap(
            text, 80, initial_indent=f"  {head:<{width}}", subsequent_indent=indent
        )
        return "\n".join(lines)

    commands = "\n".join(entry(name, text) for name, (_, text) in SUBCOMMANDS.items())
    # an option and its value stay on one line: wrap at the spaces between [...] groups
    groups = [g.replace(" ", "\0") for g in re.findall(r"\[[^\]]*\]|\S+", LAUNCH_USAGE)]
    launcher = [
        line.replace("\0", " ")
        for line in textwrap.wrap(
            " ".join(groups), 80, initial_indent="  ", subsequent_indent=" " * 6
        )
    ]
    return (
        "The mesh picks the recipe: 'model' alone, tensor parallel (Megatron, shard_map);\n"
        "'data' alone, data parallel; both, data x tensor parallel; with 'stage', pipeline\n"
        "parallel (GPipe) over it, 'data' and 'model' inside each stage; with 'expert', a\n"
        "mixture-of-experts MLP, its experts over 'expert', the batch over 'data' and\n"
        "'expert'.\n\n"
        f"commands ({PROG} COMMAND --help for their options):\n{commands}\n\n"
        "launcher (multi-process runs on one machine):\n"
        + "\n".join(launcher)
        + "\n"
        + "\n".join(textwrap.wrap(LAUNCH_DESCRIPTION, 80, initial_indent=" " * 4))
    )


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The training job's options, checked; a bad value exits with one line and status 2."""
    parser = Parser(
        prog=PROG,
        usage=f"{PROG} [--devices N] [--steps N] [--mesh AXES] [--checkpoint DIR]\n"
        f"       {PROG} {{{','.join(SUBCOMMANDS)}}} [--help] ...",
        description=DESCRIPTION,
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_devices_option(parser)
    parser.add_argument(
        "--steps", type=positive, metavar="N", default=300, help="training steps (default: 300)"
    )
    parser.add_argument(
        "--mesh",
        type=job_mesh_axes,
        metavar="AXES",
        help=(
            "mesh axes among stage, expert, data, model, e.g. data=2,model=4, "
            "stage=4,data=2 or expert=4,data=2 "
            "(default: model=N, N the devices)"
        ),
    )
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        default=argparse.SUPPRESS,  # absent from the options when not given
        help=(
            "save the sharded model and optimizer to DIR every 100 steps and at the end "
            "(the latest 3 are kept); when DIR holds a checkpoint, resume from its latest step"
        ),
    )
    args = parser.parse_args(argv)
    if args.mesh is not None and ("stage" in args.mesh or "expert" in args.mesh):
        from .recipes._job import mesh_problem  # imports jax; starts no backend

        problem = mesh_problem(args.mesh)
        if problem is not None:
            parser.error(f"--mesh {mesh_text(args.mesh)}: {problem}")
    if args.mesh is None:
        args.devices = args.devices or 8
        args.mesh = {"model": args.devices}
    elif args.devices is None:
        args.devices = math.prod(args.mesh.values())
    elif math.prod(args.mesh.values()) != args.devices:
        parser.error(
            f"--mesh {mesh_text(args.mesh)} has {math.prod(args.mesh.values())} devices, "
            f"but --devices is {args.devices}"
        )
    return args


def job_mesh_axes(text: str) -> dict[str, int]:
    """``--mesh``'s value for the training job: `mesh_axes` over `JOB_AXES`.

    >>> job_mesh_axes('data=2,stage=4')
    {'stage': 4, 'data': 2}
    """
    return mesh_axes(text, JOB_AXES)


def subcommand(name: str) -> Callable[[Sequence[str]], int]:
    """The function that runs ``python -m nnx_sharding NAME``, imported on demand."""
    module, _, function = SUBCOMMANDS[name][0].partition(":")
    main: Callable[[Sequence[str]], int] = getattr(importlib.import_module(module), function)
    return main


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line (a subcommand, else the training job); the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        return subcommand(argv[0])(argv[1:])
    args = parse(argv)
    status = cpu_devices_or_rerun(args.devices, argv)
    if status is not None:
        return status
    from nnx_sharding.recipes._job import run

    return run(args.mesh, args.steps, checkpoint=getattr(args, "checkpoint", None))


if __name__ == "__main__":
    sys.exit(main())
