"""``python -m nnx_sharding compilers [--install]``: where the planner's compilers are,
and their install with pip into a folder jax does not search (`compilers_dir`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence

from ..plan._hardware.compilers import (
    COMPILERS,
    DIR_ENV,
    compilers_dir,
    cuda_library,
    requirement,
    tpu_library,
)
from .common import Parser

PROG = "python -m nnx_sharding compilers"


def _install(compiler: str) -> int:
    """pip installs one compiler into its subfolder of `compilers_dir`; the exit status.

    pip writes a scratch folder that becomes the compiler's only when pip succeeded, so
    that an interrupted install is never taken for a compiler.
    """
    target = compilers_dir() / compiler
    scratch = target.with_name(f"{compiler}.partial")
    shutil.rmtree(scratch, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    command += ["--only-binary=:all:", "--target", str(scratch), requirement(compiler)]
    print(f"{PROG}: {' '.join(command[2:])}", flush=True)
    status = subprocess.run(command).returncode
    if status:
        shutil.rmtree(scratch, ignore_errors=True)
        return status
    shutil.rmtree(target, ignore_errors=True)
    scratch.rename(target)
    return 0


def _where(compiler: str) -> str | None:
    return tpu_library() if compiler == "tpu" else cuda_library()


def main(argv: Sequence[str]) -> int:
    """``python -m nnx_sharding compilers [--install] [tpu] [gpu]``: says where each
    compiler is; with ``--install``, first pip installs those not found."""
    parser = Parser(
        prog=PROG,
        description="The planner's TPU and GPU compilers: where they are, or install them "
        f"(with pip, into {compilers_dir()}, a folder jax does not search, so that other jax "
        f"programs do not load them; set {DIR_ENV} for another).",
    )
    parser.add_argument("compilers", nargs="*", metavar="{tpu,gpu}", help="(default: both)")
    parser.add_argument("--install", action="store_true", help="install those not found")
    args = parser.parse_args(argv)
    if wrong := [c for c in args.compilers if c not in COMPILERS]:
        parser.error(f"unknown compiler {wrong[0]!r}; choose among {', '.join(COMPILERS)}")
    compilers = args.compilers or list(COMPILERS)
    status = 0
    for compiler in compilers:
        if args.install and _where(compiler) is None:
            status = status or _install(compiler)
        print(f"{compiler}: {_where(compiler) or 'not installed'}")
    return status
