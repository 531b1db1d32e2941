"""``python -m nnx_sharding plan``: plans the built-in decoder, or your own builder.

``python -m nnx_sharding plan --config 1b --devices 64 --accelerator h100`` builds the
decoder and an adam optimizer with ``nnx.eval_shape`` (never allocated), compiles one
training step under every candidate layout for 64 devices and prints the ranked table.
The decoder's layers are scanned (``DecoderConfig.scan``), as large models are written:
the compiler builds one layer, and the planner counts it once per layer.
``--remat none,dots,full --microbatches 1,2,4`` (and ``--knob NAME=V1,V2``) search
those knob values with `nnx_sharding.plan.search`; ``--model pkg.module:build`` plans
your own builder (``build(knobs) -> Built``) instead of the decoder.
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

from .common import Parser, cpu_devices_or_rerun, positive

PROG = "python -m nnx_sharding plan"
DIMENSIONS = {
    "d_model": "width of the residual stream",
    "layers": "layers",
    "heads": "query heads",
    "kv_heads": "key/value heads (grouped-query attention)",
    "head_dim": "width of a head",
    "mlp": "width of the MLP",
    "vocab": "vocabulary size",
    "vocab_tiles": "tiles of tokens the loss computes its logits in (one tile's held)",
    "experts": "experts of each layer's mixture-of-experts MLP (0: a dense MLP)",
    "experts_per_token": "experts each token goes to (top-k)",
    "expert_mlp": "width of each expert's MLP",
    "shared_experts": "shared experts (every token goes through them)",
}
"""The decoder's sizes the command overrides (``--d-model``, ...), by config field."""
COUNTS = ("experts", "shared_experts")
"""The sizes that may be 0."""


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number, 0 or more, got {text!r}")
    return value


def _capacity(text: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive number such as 1.25, or none (dropless), got {text!r}"
        )
    return value


MAX_DEVICES = 1024


def _size(text: str) -> int:
    from ..plan._cost.model import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 80GiB, 16GB or 85899345920, got {text!r}"
        ) from None


def parser() -> argparse.ArgumentParser:
    """The command's options."""
    from ..plan._decoder.configs import DECODER_CONFIGS
    from ..plan._search.layouts import LAYOUTS

    p = Parser(prog=PROG, description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", default="1b", choices=list(DECODER_CONFIGS), help="the decoder (1b)")
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
        "the device count times the microbatch counts, so that every layout can split "
        "every microbatch)",
    )
    p.add_argument("--seq", type=positive, help="tokens per sequence (default: the config's)")
    p.add_argument(
        "--layouts", help=f"comma-separated subset of {','.join(LAYOUTS)} (default: all)"
    )
    p.add_argument("--num-slices", type=positive, default=1, help="TPU slices (1)")
    p.add_argument("--plot", metavar="FILE", help="also save the plot (needs matplotlib)")
    p.add_argument("--json", metavar="FILE", help="also write every plan as JSON")
    p.add_argument(
        "--tokens",
        type=float,
        help="with --days: also find the devices that train this many tokens in time "
        "(the per-device batch kept; the step planned again at each count tried)",
    )
    p.add_argument("--days", type=float, help="with --tokens: the days to train them in")
    search = p.add_argument_group("knobs searched (every combination; see plan.search)")
    search.add_argument("--remat", type=_texts, help="remat policies, e.g. none,dots,full")
    search.add_argument("--microbatches", type=_counts, help="microbatch counts, e.g. 1,2,4,8")
    search.add_argument(
        "--knob",
        action="append",
        default=[],
        type=_knob,
        metavar="NAME=V1,V2",
        help="any other knob of the builder and its values (repeatable)",
    )
    search.add_argument(
        "--no-prune",
        action="store_true",
        help="compile every point (default: leave uncompiled what cannot be fastest)",
    )
    search.add_argument(
        "--pareto",
        action="store_true",
        help="also leave uncompiled a candidate another beats on memory and time at the "
        "same knobs (fewer compiles; not exact)",
    )
    search.add_argument(
        "--all", action="store_true", help="show the points left uncompiled in the table too"
    )
    model = p.add_argument_group("the model")
    model.add_argument(
        "--model",
        metavar="MODULE:NAME",
        help="plan your own builder, build(knobs) -> nnx_sharding.plan.Built, instead "
        "of the decoder (e.g. mypkg.train:build)",
    )
    for field, text in DIMENSIONS.items():
        flag = "--" + field.replace("_", "-")
        kind = _count if field in COUNTS else positive
        model.add_argument(flag, type=kind, dest=field, help=f"the decoder's {text}")
    model.add_argument(
        "--capacity-factor",
        type=_capacity,
        default=argparse.SUPPRESS,
        help="the experts' capacity factor (tokens past it dropped), or none: dropless",
    )
    model.add_argument(
        "--gated",
        action=argparse.BooleanOptionalAction,
        help="a gated (SwiGLU) MLP, or not (--no-gated)",
    )
    model.add_argument(
        "--tied", action=argparse.BooleanOptionalAction, help="tie the embedding and the head"
    )
    model.add_argument(
        "--scan",
        action=argparse.BooleanOptionalAction,
        help="stack the layers and scan them (the pipeline layouts need it), or unroll them",
    )
    model.add_argument("--param-dtype", help="the parameters' dtype, e.g. float32")
    model.add_argument("--compute-dtype", help="the matmuls' dtype, e.g. bfloat16")
    return p


def _texts(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
    return values


def _counts(text: str) -> list[int]:
    return [positive(v) for v in _texts(text)]


def _knob(text: str) -> tuple[str, list[Any]]:
    from ..plan._search.knobs import parse_value

    name, eq, values = text.partition("=")
    if not eq or not name.strip().isidentifier():
        raise argparse.ArgumentTypeError(
            f"expected NAME=V1,V2, e.g. dtype=float32,bfloat16; got {text!r}"
        )
    return name.strip(), [parse_value(v) for v in _texts(values)]


def main(argv: Sequence[str]) -> int:
    """Runs the command; the exit status (2 for a bad option or an impossible plan)."""
    argv = list(argv)
    p = parser()
    args = p.parse_args(argv)
    if (args.tokens is None) != (args.days is None):
        p.error("--tokens and --days go together")
    from ..plan._hardware.accelerators import resolve_accelerator
    from ..plan._hardware.devices import has_gpu_compiler, has_tpu_compiler
    from ..plan._search.layouts import LAYOUTS

    try:
        accelerator, topology = resolve_accelerator(args.accelerator)
    except ValueError:
        from ..plan._hardware.accelerators import PRESETS

        p.error(
            f"unknown --accelerator {args.accelerator!r}; choose a preset "
            f"({', '.join(PRESETS)}) or a TPU topology such as v5e:16x16"
        )
    layouts = args.layouts.split(",") if args.layouts else None
    if layouts and (wrong := [x for x in layouts if x not in LAYOUTS]):
        p.error(f"unknown --layouts {','.join(wrong)}; choose among {','.join(LAYOUTS)}")
    if topology is not None and args.devices is None:
        from ..plan._search.prepare import default_device_count

        devices = default_device_count(topology, args.num_slices)
    else:
        devices = args.devices or 8
    if devices > MAX_DEVICES:
        p.error(f"--devices {devices}: the command plans up to {MAX_DEVICES} devices")
    space = _space(p, args)  # the options checked before jax starts (or the command reruns)
    config = None if args.model else _config(p, args, devices)
    builder = _user_builder(p, args.model) if args.model else None
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
    return _run(
        args,
        accelerator if topology is None else args.accelerator,
        devices,
        layouts,
        space,
        builder,
        config,
    )


def _space(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, list[Any]] | None:
    """The knob space of ``--remat``, ``--microbatches`` and ``--knob``."""
    space: dict[str, list[Any]] = {}
    given = [("remat", args.remat), ("microbatches", args.microbatches), *args.knob]
    for name, values in given:
        if values is None:
            continue
        if name in space:
            p.error(f"the knob {name!r} is given twice")
        space[name] = values
    return space or None


def _user_builder(p: argparse.ArgumentParser, spec: str) -> Any:
    """``--model MODULE:NAME``: the builder it names."""
    import importlib

    module, colon, name = spec.partition(":")
    if not colon or not module or not name:
        p.error(f"--model {spec!r}: expected MODULE:NAME, e.g. mypkg.train:build")
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        p.error(f"--model {spec!r}: cannot import {module!r} ({e})")
    build = getattr(found, name, None)
    if not callable(build):
        p.error(f"--model {spec!r}: {module!r} has no callable {name!r}")
    return build


def _config(p: argparse.ArgumentParser, args: argparse.Namespace, devices: int) -> Any:
    """The decoder's config with the command's sizes; a size the decoder does not have
    is an error naming the ones it has."""
    from ..plan._decoder.configs import DECODER_CONFIGS

    config = DECODER_CONFIGS[args.config]
    fields = {f.name for f in dataclasses.fields(config)}
    wanted = {name: getattr(args, name) for name in DIMENSIONS}
    wanted |= {"gated": args.gated, "tied": args.tied, "scan": args.scan}
    wanted |= {"param_dtype": args.param_dtype, "compute_dtype": args.compute_dtype}
    wanted = {k: v for k, v in wanted.items() if v is not None}
    if "capacity_factor" in args:  # None (dropless) is a value here
        wanted["capacity_factor"] = args.capacity_factor
    if missing := [k for k in wanted if k not in fields]:
        flags = ", ".join("--" + k.replace("_", "-") for k in missing)
        p.error(f"{flags}: the decoder has no such size; it has {', '.join(sorted(fields))}")
    slices = math.lcm(*(args.microbatches or [1]))  # each microbatch split over every device
    batch = args.batch or math.lcm(config.batch, devices * slices)
    wanted |= {"batch": batch, "seq_len": args.seq or config.seq_len}
    if "scan" in fields:  # layers scanned: each candidate compiles one layer
        wanted["scan"] = True
    try:
        return dataclasses.replace(config, **wanted)
    except ValueError as e:
        p.error(str(e))


def _run(
    args: argparse.Namespace,
    accelerator: Any,
    devices: int,
    layouts: Any,
    space: dict[str, list[Any]] | None,
    builder: Any,
    config: Any,
) -> int:
    from rich.console import Console

    from ..plan._decoder.configs import DECODER_RULES
    from ..plan._search.search import search

    console = Console(width=max(Console().width, 260))  # the table's width
    if builder is None:
        builder = _decoder_builder(config)
        console.print(
            f"planning {config.name} ({config.param_count():,} parameters, batch "
            f"{config.batch} × {config.seq_len} tokens) for {devices} devices of "
            f"{args.accelerator}"
        )
    else:
        console.print(f"planning {args.model} for {devices} devices of {args.accelerator}")
    try:
        plans = search(
            builder,
            space,
            devices=devices,
            accelerator=accelerator,
            memory_limit=args.memory_limit,
            layouts=layouts,
            rules=DECODER_RULES if config is not None else None,
            num_slices=args.num_slices,
            progress=True,
            prune="pareto" if args.pareto and not args.no_prune else not args.no_prune,
        )
    except (ValueError, TypeError) as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    console.print(plans.table(pruned=args.all))
    compiled = sum(p.compiled for p in plans)
    console.print(f"{compiled} of {len(plans)} plans compiled")
    try:
        best = plans.best
        console.print(f"best: {best!r}")
    except ValueError as e:
        console.print(str(e), markup=False)
    if args.plot:
        plans.plot(args.plot)
        console.print(f"plot saved to {args.plot}")
    if args.json:
        plans.to_json(args.json)
        console.print(f"every plan written to {args.json}")
    if args.tokens and args.days:
        per_step = config.batch * config.seq_len if config is not None else None
        try:
            sizing = plans.devices_for(args.tokens, args.days, tokens_per_step=per_step)
        except ValueError as e:
            sys.stderr.write(f"{PROG}: error: {e}\n")
            return 2
        console.print(f"{args.tokens:.3g} tokens in {args.days:g} days: {sizing}")
    return 0


def _decoder_builder(config: Any) -> Any:
    """The decoder's builder (`decoder_builder`), declaring the remat policies and context
    strategies it takes."""
    from ..plan._decoder.context_parallel import CONTEXT_STRATEGIES
    from ..plan._decoder.remat import REMAT_POLICIES
    from ..plan._decoder.training import decoder_builder

    build = decoder_builder(config)
    choices = {"remat": list(REMAT_POLICIES), "context_strategy": list(CONTEXT_STRATEGIES)}
    build.choices = choices  # type: ignore[attr-defined]
    return build
