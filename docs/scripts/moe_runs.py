"""Plans the published, measured MaxText mixture-of-experts runs as they ran, with the
built-in decoder, and prints the predicted step beside the published one
(docs/planning/predictions.md, "Mixtures of experts").

    python docs/scripts/moe_runs.py mixtral-8x7b     # v6e-256, FSDP 256
    python docs/scripts/moe_runs.py mixtral-8x22b    # v6e-256, FSDP 64 x expert 4
    python docs/scripts/moe_runs.py mixtral-8x7b --json out.jsonl
    python docs/scripts/moe_runs.py mixtral-8x22b --compiler-defaults  # faster compile

Each run: the model's config (`DECODER_CONFIGS`), its published per-device batch and
sequence, MaxText's dropping path (``capacity_factor=1.25``), its remat (``custom``
with the layer input and the query, key, value and output projections offloaded to the
host: the decoder's ``offload_qkv``), its weights' dtype, its mesh as an exact
candidate, and its recipe's ``LIBTPU_INIT_ARGS`` as ``compiler_options``; compiled by
the TPU compiler for compile-only v6e chips. The published step is the one the run's
log prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# tpu-recipes' run_recipe.sh for both runs (MOE_VMEM_LIMIT_FLAG + CF_FOR_ALL_GATHER +
# DATA_PARALLEL_OVERLAP in MaxText's benchmarks/maxtext_trillium_model_configs.py)
FLAGS = {
    "xla_tpu_scoped_vmem_limit_kib": "81920",
    "xla_tpu_enable_async_collective_fusion": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
    "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
    "xla_tpu_overlap_compute_collective_tc": True,
    "xla_enable_async_all_gather": True,
    "xla_tpu_enable_data_parallel_all_reduce_opt": True,
    "xla_tpu_data_parallel_opt_different_sized_ops": True,
}

RUNS = {
    # tpu-recipes training/trillium/Mixtral-8x7B-MaxText (MaxText tpu-recipes-v0.1.2):
    # "completed step: 11, seconds: 13.484, TFLOP/s/device: 302.311"
    "mixtral-8x7b": dict(
        source="tpu-recipes trillium/Mixtral-8x7B-MaxText (v6e-256, 13.484 s)",
        per_device_batch=12, seq=4096, param_dtype="float32",
        layout=("fsdp", {"fsdp": 256}), published_step=13.484,
    ),
    # tpu-recipes training/trillium/Mixtral-8x22B-MaxText (weight_dtype=bfloat16,
    # ici_fsdp 64 x ici_expert 4): "completed step: 9, seconds: 24.706"
    "mixtral-8x22b": dict(
        source="tpu-recipes trillium/Mixtral-8x22B-MaxText (v6e-256, 24.706 s)",
        per_device_batch=8, seq=4096, param_dtype="bfloat16",
        layout=("fsdp+ep", {"fsdp": 64, "expert": 4}), published_step=24.706,
    ),
}  # fmt: skip
DEVICES = 256


def plan_run(name: str, flags: bool = True):
    """The run's plan (one exact candidate), compiled for 256 compile-only v6e chips,
    with the recipe's compiler flags or (``flags=False``) the compiler's defaults."""
    from nnx_sharding.plan import DECODER_CONFIGS, decoder_builder, search

    run = RUNS[name]
    config = dataclasses.replace(
        DECODER_CONFIGS[name], batch=run["per_device_batch"] * DEVICES, seq_len=run["seq"],
        capacity_factor=1.25, param_dtype=run["param_dtype"],
    )  # fmt: skip
    build = decoder_builder(config)

    def with_flags(knobs):
        built = build(knobs)
        options = dict(built.jit_options, compiler_options=FLAGS) if flags else built.jit_options
        return dataclasses.replace(built, jit_options=options)

    (plan,) = search(
        with_flags, {"remat": ["offload_qkv"]}, devices=DEVICES, accelerator="v6e",
        layouts=[run["layout"]], prune=False,
    )  # fmt: skip
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", choices=list(RUNS))
    parser.add_argument("--json", default=None, help="append the result as a JSON line")
    parser.add_argument(
        "--compiler-defaults", action="store_true",
        help="compile without the recipe's flags (several times faster to compile)",
    )  # fmt: skip
    args = parser.parse_args()
    run = RUNS[args.run]
    start = time.perf_counter()
    plan = plan_run(args.run, flags=not args.compiler_defaults)
    seconds = time.perf_counter() - start
    t = plan.time
    row = {
        "run": args.run,
        "source": run["source"],
        "flags": not args.compiler_defaults,
        "compiler": plan.compiler,
        "published_step": run["published_step"],
        "step": None if t is None else t.step,
        "step_low": None if t is None else t.step_low,
        "step_high": None if t is None else t.step_high,
        "ratio": None if t is None else t.step / run["published_step"],
        "peak": None if plan.memory is None else plan.memory.peak,
        "fits": plan.fits,
        "reason": plan.reason,
        "all_to_all": plan.collectives.get("all-to-all", 0),
        "compile_seconds": seconds,
    }
    print(repr(plan))
    print(json.dumps(row, indent=1))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
