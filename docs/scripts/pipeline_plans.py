"""Plans where pipeline parallelism wins and where it loses (docs/planning/real_runs.md,
"Pipeline parallelism"): the built-in decoder planned with no GPU for H100 nodes of 8
GPUs, exact candidates, full remat.

    python docs/scripts/pipeline_plans.py nodes   # Llama-3-70B on 8 nodes (64 GPUs)
    python docs/scripts/pipeline_plans.py nodes --network-gbps 50
    python docs/scripts/pipeline_plans.py node    # Llama-3-8B on one node (8 GPUs)

Each prints the plans as a table (layout, mesh, knobs, peak, step, exposed comms) and,
with ``--json FILE``, writes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

RUNS = {
    # 64 H100s: FSDP over all, hybrid FSDP in nodes and data across them, and 8 stages
    # across the nodes with FSDP inside each node (at 8 and 32 pipeline microbatches)
    "nodes": dict(
        config="llama3-70b",
        devices=64,
        batch=64,
        seq=2048,
        layouts=[
            ("fsdp", {"fsdp": 64}),
            ("dp+fsdp", {"data": 8, "fsdp": 8}),
            ("pp+tp", {"stage": 8, "model": 8}),
            ("pp+fsdp+tp", {"stage": 8, "fsdp": 2, "model": 4}),
        ],
        space={"remat": ["full"], "pipeline_microbatches": [16, 32]},
    ),
    # one node of 8: FSDP over NVLink against 2 and 4 stages
    "node": dict(
        config="llama3-8b",
        devices=8,
        batch=16,
        seq=4096,
        layouts=[
            ("fsdp", {"fsdp": 8}),
            ("pp+fsdp", {"stage": 2, "fsdp": 4}),
            ("pp+fsdp", {"stage": 4, "fsdp": 2}),
        ],
        space={"remat": ["full"], "pipeline_microbatches": [8, 16]},
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", choices=list(RUNS))
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--network-gbps", type=float, default=400.0,
        help="the network across nodes, Gb/s per GPU (the h100 preset: 400)",
    )  # fmt: skip
    args = parser.parse_args()
    run = RUNS[args.run]

    from nnx_sharding.plan import DECODER_CONFIGS, PRESETS, decoder_builder, search

    config = dataclasses.replace(
        DECODER_CONFIGS[run["config"]], batch=run["batch"], seq_len=run["seq"]
    )
    start = time.perf_counter()
    plans = search(
        decoder_builder(config),
        run["space"],
        devices=run["devices"],
        accelerator=dataclasses.replace(
            PRESETS["h100"], name="h100", inter_bandwidth=args.network_gbps * 1e9 / 8
        ),
        layouts=run["layouts"],
        prune=False,
    )
    seconds = time.perf_counter() - start
    print(
        f"{run['config']} on {run['devices']} H100s, {args.network_gbps:g} Gb/s per GPU "
        f"across nodes: {len(plans)} plans in {seconds:.0f} s"
    )
    print("| layout | mesh | pipeline microbatches | peak | step | comms exposed | fits |")
    print("|---|---|---|---|---|---|---|")
    for p in plans:
        mesh = " × ".join(f"{k} {v}" for k, v in p.mesh_shape.items())
        m = p.knobs.get("pipeline_microbatches") if "stage" in p.mesh_shape else "-"
        if p.memory is None or p.time is None:
            print(f"| {p.layout} | {mesh} | {m} | | | | {p.reason} |")
            continue
        print(
            f"| {p.layout} | {mesh} | {m} | {p.memory.peak / 2**30:.1f} GiB "
            f"| {p.time.step:.2f} s | {p.time.exposed:.2f} s | {'yes' if p.fits else 'no'} |"
        )
    if args.json:
        plans.to_json(args.json)


if __name__ == "__main__":
    main()
