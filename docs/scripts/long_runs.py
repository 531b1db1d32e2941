"""Plans the published, measured MaxText runs that offload activations to the host or
split a long sequence over a ``context`` axis, and Ironwood runs, as they ran, with the
built-in decoder, and prints the predicted step beside the published one
(docs/planning/predictions.md, "Host offload and long context").

    python docs/scripts/long_runs.py llama3.1-8b-v6e-8         # offload, FSDP 8
    python docs/scripts/long_runs.py llama3.1-70b-v6e-32       # offload, FSDP 32
    python docs/scripts/long_runs.py llama3.1-70b-128k-tpu7x   # 128K, FSDP 64 x context 8
    python docs/scripts/long_runs.py llama3.1-70b-8k-tpu7x     # 8K, FSDP 128
    python docs/scripts/long_runs.py llama3.1-8b-v6e-8 --json out.jsonl --compiler-defaults
    python docs/scripts/long_runs.py all --check    # every run as published (nox -s long_runs)

Each run: the model's config (`DECODER_CONFIGS`: Llama 3.1 has Llama 3's dimensions),
its published per-device batch and sequence, its remat as the decoder names it (the
recipe's ``custom`` placement; ``--remat`` another), its loss's vocabulary tiling
(the recipe's ``num_vocab_tiling``; ``--vocab-tiles`` another), its weights' dtype, its
mesh as an exact candidate, its context strategy, and its recipe's ``LIBTPU_INIT_ARGS``
as ``compiler_options`` (``--compiler-defaults``: without them); compiled by the TPU
compiler for compile-only chips. The published step is the one the run's log or its
recipe's table prints. With ``--check`` the script fails (exit status 1) unless every
run it planned fits and is predicted within 25 % of its published step: the check of
docs/planning/predictions.md's table, too slow for the suite (2 to 4 minutes a run on
two cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# MaxText benchmarks/xla_flags_library.py: CF_FOR_ALL_GATHER + DATA_PARALLEL_OVERLAP +
# HOST_OFFLOAD_FLAGS, as the v6e recipes of tpu-recipes set them
V6E_FLAGS = {
    "xla_tpu_scoped_vmem_limit_kib": "98304",
    "xla_tpu_enable_async_collective_fusion": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
    "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
    "xla_tpu_overlap_compute_collective_tc": True,
    "xla_enable_async_all_gather": True,
    "xla_tpu_enable_data_parallel_all_reduce_opt": True,
    "xla_tpu_data_parallel_opt_different_sized_ops": True,
    "xla_tpu_enable_all_experimental_scheduler_features": True,
    "xla_tpu_enable_scheduler_memory_pressure_tracking": True,
    "xla_tpu_host_transfer_overlap_limit": "24",
    "xla_max_concurrent_host_send_recv": "100",
    "xla_tpu_scheduler_percent_shared_memory_limit": "100",
    "xla_latency_hiding_scheduler_rerun": "2",
}

MAXTEXT_V6E_70B_REMAT = (
    "custom:decoder_layer_input=offload,query_proj=offload,key_proj=offload,value_proj=offload"
)
"""The v6e-32 70B run's placement, as its recipe sets it (the rest rematerialized)."""
MAXTEXT_128K_REMAT = (
    "custom:decoder_layer_input=device,context=device,query_proj=device,key_proj=device,"
    "value_proj=device,mlpwo=device"
)
"""The 128K run's placement, as its recipe sets it (the rest rematerialized)."""
MAXTEXT_8K_REMAT = (
    "custom:decoder_layer_input=device,context=device,query_proj=device,key_proj=device,"
    "value_proj=device"
)
"""The Ironwood 8K run's placement, as its recipe sets it (the rest rematerialized)."""

RUNS = {
    # tpu-recipes training/trillium/Llama3.1-8B-MaxText/v6e-8 (MaxText tpu-recipes-v0.1.4):
    # custom remat, the layer input and q/k/v/out projections offloaded; 3.443 s a step
    "llama3.1-8b-v6e-8": dict(
        source="tpu-recipes trillium/Llama3.1-8B-MaxText v6e-8 (3.443 s)",
        config="llama3-8b", accelerator="v6e", devices=8, batch=3 * 8, seq=8192,
        remat="offload_qkv", param_dtype="float32", layout=("fsdp", {"fsdp": 8}),
        flags=V6E_FLAGS, published_step=3.443,
    ),
    # tpu-recipes training/trillium/Llama3.1-70B-MaxText/v6e-32: custom remat, the layer
    # input and q/k/v offloaded, the rest rematerialized (MaxText's default for a name
    # the recipe leaves out), weights in bfloat16; 17.790 s a step
    "llama3.1-70b-v6e-32": dict(
        source="tpu-recipes trillium/Llama3.1-70B-MaxText v6e-32 (17.790 s)",
        config="llama3-70b", accelerator="v6e", devices=32, batch=2 * 32, seq=8192,
        remat=MAXTEXT_V6E_70B_REMAT, param_dtype="bfloat16", layout=("fsdp", {"fsdp": 32}),
        flags=V6E_FLAGS, published_step=17.790,
    ),
    # tpu-recipes training/ironwood (README table): Llama3.1-70B at 131072 tokens on
    # tpu7x-4x8x8 (256 chips, 512 devices), FSDP 64 x context 8 (MaxText's default
    # all_gather strategy, load-balanced), 64 sequences, custom remat keeping the layer
    # input, q/k/v, the attention's output and the MLP's output on the device, the loss
    # in 4 tiles (num_vocab_tiling=4); 34.02 s
    "llama3.1-70b-128k-tpu7x": dict(
        source="tpu-recipes ironwood llama3.1-70b 128k-bf16-tpu7x-4x8x8 (34.02 s)",
        config="llama3-70b", accelerator="tpu7x", devices=512, batch=64, seq=131072,
        remat=MAXTEXT_128K_REMAT, param_dtype="float32", vocab_tiles=4,
        layout=("fsdp+cp", {"fsdp": 64, "context": 8}), context_strategy="all_gather",
        flags={"xla_tpu_scoped_vmem_limit_kib": "65536"}, published_step=34.02,
    ),
    # tpu-recipes training/ironwood (README table): Llama3.1-70B at 8192 tokens on
    # tpu7x-4x4x4 (64 chips, 128 devices), FSDP 128, 2 sequences per device, custom remat
    # keeping the layer input, q/k/v and the attention's output; 12.20 s
    "llama3.1-70b-8k-tpu7x": dict(
        source="tpu-recipes ironwood llama3.1-70b 8k-bf16-tpu7x-4x4x4 (12.20 s)",
        config="llama3-70b", accelerator="tpu7x", devices=128, batch=2 * 128, seq=8192,
        remat=MAXTEXT_8K_REMAT, param_dtype="float32", layout=("fsdp", {"fsdp": 128}),
        flags={"xla_tpu_scoped_vmem_limit_kib": "61440"}, published_step=12.20,
    ),
}  # fmt: skip


def plan_run(name: str, flags: bool = True, strategies: list[str] | None = None,
             vocab_tiles: int | None = None, remat: str | None = None):  # fmt: skip
    """The run's plans (one exact candidate; one per context strategy), compiled for
    the run's compile-only TPU chips, with the recipe's compiler flags or (``flags=False``)
    the compiler's defaults."""
    from nnx_sharding.plan import DECODER_CONFIGS, decoder_builder, search

    run = RUNS[name]
    config = dataclasses.replace(
        DECODER_CONFIGS[run["config"]], batch=run["batch"], seq_len=run["seq"],
        param_dtype=run["param_dtype"], vocab_tiles=vocab_tiles or run.get("vocab_tiles", 1),
    )  # fmt: skip
    build = decoder_builder(config)

    def with_flags(knobs):
        built = build(knobs)
        options = built.jit_options
        if flags:
            options = dict(options, compiler_options=run["flags"])
        return dataclasses.replace(built, jit_options=options)

    space = {"remat": [remat or run["remat"]]}
    if "context_strategy" in run:
        space["context_strategy"] = strategies or [run["context_strategy"]]
    return search(
        with_flags, space, devices=run["devices"], accelerator=run["accelerator"],
        layouts=[run["layout"]], prune=False,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", choices=[*RUNS, "all"])
    parser.add_argument("--json", default=None, help="append the results as JSON lines")
    parser.add_argument(
        "--compiler-defaults", action="store_true",
        help="compile without the recipe's flags (faster to compile)",
    )  # fmt: skip
    parser.add_argument(
        "--strategies", default=None,
        help="context strategies to compare, comma-separated (default: the run's)",
    )  # fmt: skip
    parser.add_argument("--vocab-tiles", type=int, default=None, help="(default: the run's)")
    parser.add_argument("--remat", default=None, help="(default: the run's)")
    parser.add_argument(
        "--check", action="store_true",
        help="exit 1 unless every plan fits and is within 25 %% of the published step",
    )  # fmt: skip
    args = parser.parse_args()
    failed = []
    for name in RUNS if args.run == "all" else [args.run]:
        failed += report(name, args)
    if args.check and failed:
        print("outside the check:\n" + "\n".join(failed))
        raise SystemExit(1)


def report(name: str, args: argparse.Namespace) -> list[str]:
    """Plans run ``name`` as ``args`` say, prints each plan (a JSON line per plan, also
    appended to ``--json``) and returns what fails the check."""
    run = RUNS[name]
    start = time.perf_counter()
    strategies = args.strategies.split(",") if args.strategies else None
    plans = plan_run(name, flags=not args.compiler_defaults, strategies=strategies,
                     vocab_tiles=args.vocab_tiles, remat=args.remat)  # fmt: skip
    seconds = time.perf_counter() - start
    print(repr(plans))
    failed = []
    for plan in plans:
        t = plan.time
        row = {
            "run": name,
            "source": run["source"],
            "knobs": dict(plan.knobs),
            "vocab_tiles": args.vocab_tiles or run.get("vocab_tiles", 1),
            "flags": not args.compiler_defaults,
            "compiler": plan.compiler,
            "published_step": run["published_step"],
            "step": None if t is None else t.step,
            "step_low": None if t is None else t.step_low,
            "step_high": None if t is None else t.step_high,
            "host_seconds": None if t is None else t.host,
            "exposed": None if t is None else t.exposed,
            "ratio": None if t is None else t.step / run["published_step"],
            "peak": None if plan.memory is None else plan.memory.peak,
            "host_bytes": None if plan.memory is None else plan.memory.host,
            "fits": plan.fits,
            "reason": plan.reason,
            "collectives": dict(plan.collectives),
            "compile_seconds": seconds,
        }
        print(json.dumps(row, indent=1))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
        if not plan.fits or abs(row["ratio"] - 1) > 0.25:
            failed.append(f"{name} {dict(plan.knobs)}: fits {plan.fits}, ratio {row['ratio']}")
    return failed


if __name__ == "__main__":
    main()
