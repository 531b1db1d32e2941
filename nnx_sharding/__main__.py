"""The main job: ``python -m nnx_sharding [--devices N] [--steps N] [--mesh data=2,model=4]
[--checkpoint DIR]``.

Trains the tensor-parallel MLP recipe (`nnx_sharding.recipes`) on simulated CPU
devices next to a single-device reference, then prints every parameter's sharding
and both final losses. A mesh with a ``data`` axis trains the data-parallel recipe
(with ``model`` too: both, on a 2-D mesh). With ``--checkpoint DIR`` the sharded run
saves to DIR as it trains and, when DIR holds a checkpoint, resumes from it.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

AXES = ("data", "model")
DESCRIPTION = "Trains a sharded nnx MLP on simulated CPU devices next to a one-device reference."
EPILOG = (
    "The mesh picks the recipe: 'model' alone, tensor parallel (Megatron, shard_map); "
    "'data' alone, data parallel; both, data x tensor parallel."
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line on stderr (not argparse's usage block), exit status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _mesh(text: str) -> dict[str, int]:
    axes: dict[str, int] = {}
    for item in text.split(","):
        name, eq, size = item.partition("=")
        name = name.strip()
        if not eq or name not in AXES:
            raise argparse.ArgumentTypeError(
                f"expected NAME=SIZE pairs with NAME in {AXES}, e.g. data=2,model=4; got {item!r}"
            )
        if name in axes:
            raise argparse.ArgumentTypeError(f"axis {name!r} is given twice")
        axes[name] = _positive(size.strip())
    # tensor-parallel axis innermost, whatever the order given
    return {name: axes[name] for name in AXES if name in axes}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked; a bad value exits with one line on stderr and status 2."""
    parser = _Parser(prog="python -m nnx_sharding", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument(
        "--devices", type=_positive, help="simulated CPU devices (default: the mesh's size, or 8)"
    )
    parser.add_argument("--steps", type=_positive, default=300, help="training steps (300)")
    parser.add_argument(
        "--mesh", type=_mesh, help="mesh axes, e.g. data=2,model=4 (default: model=DEVICES)"
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
    if args.mesh is None:
        args.devices = args.devices or 8
        args.mesh = {"model": args.devices}
    elif args.devices is None:
        args.devices = math.prod(args.mesh.values())
    elif math.prod(args.mesh.values()) != args.devices:
        parser.error(
            f"--mesh {','.join(f'{k}={v}' for k, v in args.mesh.items())} has "
            f"{math.prod(args.mesh.values())} devices, but --devices is {args.devices}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the command line (``aot ...``: ahead-of-time compile; else train); the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["aot"]:  # python -m nnx_sharding aot --config NAME --mesh data=2,model=4
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
        from nnx_sharding._aot import aot_main

        return aot_main(argv[1:])
    args = parse(argv)
    import jax  # configured before any backend starts

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    from nnx_sharding.recipes._job import run

    return run(args.mesh, args.steps, checkpoint=getattr(args, "checkpoint", None))


if __name__ == "__main__":
    sys.exit(main())
