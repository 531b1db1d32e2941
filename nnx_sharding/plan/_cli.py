"""``python -m nnx_sharding plan``: plans the built-in decoder (``aot``'s configs).

``python -m nnx_sharding plan --config 1b --devices 64 --accelerator h100`` builds the
decoder and an adam optimizer with ``nnx.eval_shape`` (never allocated), compiles one
training step under every candidate layout for 64 devices and prints the ranked table.
The decoder's layers are scanned (``DecoderConfig.scan``), as large models are written:
the compiler builds one layer, and the planner counts it once per layer.
Where no compile-only devices of the accelerator are installed, the command gives
itself the simulated CPU devices it needs (re-running itself in a fresh process).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from typing import Any

from .._cli import Parser, cpu_devices_or_rerun, positive

PROG = "python -m nnx_sharding plan"
RULES = [("heads", "model"), ("mlp", "model"), ("vocab", "model"), ("embed", None)]
"""The decoder's logical axes: tensor parallelism splits heads, MLP units and the
vocabulary; FSDP picks each Variable's largest dimension itself."""
MAX_DEVICES = 1024


def _size(text: str) -> int:
    from ._cost import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 80GiB, 16GB or 85899345920, got {text!r}"
        ) from None


def parser() -> argparse.ArgumentParser:
    """The command's options."""
    from ._decoder import CONFIGS
    from ._layouts import LAYOUTS

    p = Parser(prog=PROG, description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", default="1b", choices=list(CONFIGS), help="the decoder (1b)")
    p.add_argument(
        "--devices",
        type=positive,
        help=f"devices to plan for, up to {MAX_DEVICES} (default: a TPU topology's chips, else 8)",
    )
    p.add_argument(
        "--accelerator",
        default="h100",
        help="a preset (h100, h200, a100-80gb, b200, v5e, v5p, v6e, cpu) or a TPU "
        "topology such as v5e:16x16 (default: h100)",
    )
    p.add_argument(
        "--memory-limit",
        type=_size,
        help="bytes per device, e.g. 80GiB (default: the accelerator's memory)",
    )
    p.add_argument(
        "--batch",
        type=positive,
        help="sequences per step (default: the smallest multiple of both the config's and "
        "the device count, so that every layout can split it)",
    )
    p.add_argument("--seq", type=positive, help="tokens per sequence (default: the config's)")
    p.add_argument(
        "--layouts", help=f"comma-separated subset of {','.join(LAYOUTS)} (default: all)"
    )
    p.add_argument("--num-slices", type=positive, default=1, help="TPU slices (1)")
    p.add_argument("--plot", metavar="FILE", help="also save the plot (needs matplotlib)")
    return p


def main(argv: Sequence[str]) -> int:
    """Runs the command; the exit status (2 for a bad option or an impossible plan)."""
    argv = list(argv)
    p = parser()
    args = p.parse_args(argv)
    from ._accelerator import resolve_accelerator
    from ._devices import has_gpu_compiler, has_tpu_compiler
    from ._layouts import LAYOUTS

    try:
        accelerator, topology = resolve_accelerator(args.accelerator)
    except ValueError:
        from ._accelerator import PRESETS

        p.error(
            f"unknown --accelerator {args.accelerator!r}; choose a preset "
            f"({', '.join(PRESETS)}) or a TPU topology such as v5e:16x16"
        )
    layouts = args.layouts.split(",") if args.layouts else None
    if layouts and (wrong := [x for x in layouts if x not in LAYOUTS]):
        p.error(f"unknown --layouts {','.join(wrong)}; choose among {','.join(LAYOUTS)}")
    if topology is not None and args.devices is None:
        from ._planner import default_count

        devices = default_count(topology, args.num_slices)
    else:
        devices = args.devices or 8
    if devices > MAX_DEVICES:
        p.error(f"--devices {devices}: the command plans up to {MAX_DEVICES} devices")
    compile_only = (accelerator.kind == "tpu" and has_tpu_compiler()) or (
        accelerator.kind == "gpu" and has_gpu_compiler()
    )
    if not compile_only:
        status = cpu_devices_or_rerun(devices, ["plan", *argv])
        if status is not None:
            return status
    else:  # compile-only devices need no accelerator: keep jax off any it would probe
        import jax

        jax.config.update("jax_platforms", "cpu")
    return _run(args, accelerator if topology is None else args.accelerator, devices, layouts)


def _run(args: argparse.Namespace, accelerator: Any, devices: int, layouts: Any) -> int:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from rich.console import Console

    from ._decoder import CONFIGS, Decoder
    from ._planner import plan

    config = CONFIGS[args.config]
    batch = args.batch or math.lcm(config.batch, devices)
    config = dataclasses.replace(  # layers scanned: each candidate compiles one layer
        config, batch=batch, seq_len=args.seq or config.seq_len, scan=True
    )

    def build() -> tuple[Decoder, nnx.Optimizer]:
        model = Decoder(config, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

    with nnx.use_eager_sharding(False):
        model, optimizer = nnx.eval_shape(build)
    tokens = jax.ShapeDtypeStruct((config.batch, config.seq_len + 1), jnp.int32)
    console = Console(width=max(Console().width, 170))  # the table's width
    console.print(
        f"planning {config.name} ({config.param_count():,} parameters, batch {config.batch} "
        f"× {config.seq_len} tokens) for {devices} devices of {args.accelerator}"
    )
    try:
        plans = plan(
            train_step,
            model,
            optimizer,
            tokens,
            devices=devices,
            accelerator=accelerator,
            memory_limit=args.memory_limit,
            layouts=layouts,
            rules=RULES,
            num_slices=args.num_slices,
            progress=True,
            donate_argnums=(0, 1),
        )
    except ValueError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    console.print(plans)
    try:
        best = plans.best
        console.print(f"best: {best!r}")
    except ValueError as e:
        console.print(str(e))
    if args.plot:
        plans.plot(args.plot)
        console.print(f"plot saved to {args.plot}")
    return 0


def train_step(model: Any, optimizer: Any, tokens: Any) -> Any:
    """One adamw step of the decoder's next-token loss; returns the loss."""
    from flax import nnx

    from ._decoder import loss_fn

    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss
