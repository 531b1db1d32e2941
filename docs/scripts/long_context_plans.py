"""The plans of docs/planning/long_context.md: Llama 3 8B at 131,072 tokens on 16
compile-only v5p chips (FSDP, FSDP × tensor, FSDP × context with each strategy),
and steps where offloading beats recomputing (H100s) beside ones where it does not.

    python docs/scripts/long_context_plans.py context   # the 128K plans
    python docs/scripts/long_context_plans.py single    # one 128K sequence a step
    python docs/scripts/long_context_plans.py offload   # offload against recompute

Prints each plan's table and a JSON line per plan (``--json FILE`` appends them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def context_plans():
    """Llama 3 8B, 4 sequences of 131,072 tokens, remat ``full``, 16 v5p chips: FSDP
    alone cannot split 4 sequences over 16 chips; FSDP 4 × tensor parallelism 4 holds
    whole sequences; FSDP 4 × context 4 splits each over 4 chips."""
    from nnx_sharding.plan import DECODER_CONFIGS, decoder_builder, search

    config = dataclasses.replace(DECODER_CONFIGS["llama3-8b"], seq_len=131072, batch=4)
    space = {"remat": ["full"], "context_strategy": ["all_gather", "ring", "ulysses"]}
    layouts = [("fsdp", {"fsdp": 16}), ("fsdp+tp", {"fsdp": 4, "model": 4}),
               ("fsdp+cp", {"fsdp": 4, "context": 4})]  # fmt: skip
    return search(decoder_builder(config), space, devices=16, accelerator="v5p",
                  layouts=layouts, prune=False)  # fmt: skip


def single_plans():
    """Llama 3 8B, one sequence of 131,072 tokens a step, remat ``full``, 16 v5p chips:
    FSDP cannot split one sequence, tensor parallelism stops at the 8 key and value
    heads; context parallelism over the 16 chips (or 2 × tensor 8) is what fits."""
    from nnx_sharding.plan import DECODER_CONFIGS, decoder_builder, search

    config = dataclasses.replace(DECODER_CONFIGS["llama3-8b"], seq_len=131072, batch=1)
    space = {"remat": ["full"], "context_strategy": ["all_gather", "ring", "ulysses"]}
    layouts = [("fsdp", {"fsdp": 16}), ("tp", {"model": 16}),
               ("fsdp+tp", {"fsdp": 2, "model": 8}), ("cp", {"context": 16}),
               ("fsdp+tp+cp", {"fsdp": 1, "context": 2, "model": 8})]  # fmt: skip
    return search(decoder_builder(config), space, devices=16, accelerator="v5p",
                  layouts=layouts, prune=False)  # fmt: skip


def offload_plans():
    """Llama 3 8B at 8,192 tokens, 8 layers, FSDP over 8 devices, ``full`` against
    ``offload_qkv``: on H100s (the GPU compiler; PCIe Gen5, 64 GB/s per GPU) and on v6e
    chips (the TPU compiler; 32 GB/s per chip); each priced again, without recompiling
    (`Program.time`), on a host link 8 times slower than its own."""
    from nnx_sharding.plan import DECODER_CONFIGS, PRESETS, decoder_builder, search

    config = dataclasses.replace(DECODER_CONFIGS["llama3-8b"], batch=16, layers=8)
    out = []
    for name in ("h100", "v6e"):
        plans = search(decoder_builder(config), {"remat": ["full", "offload_qkv"]},
                       devices=8, accelerator=name, layouts=[("fsdp", {"fsdp": 8})],
                       prune=False)  # fmt: skip
        own = PRESETS[name]
        slow = dataclasses.replace(own, host_bandwidth=own.host_bandwidth / 8)
        for accelerator in (own, slow):
            link = f"{accelerator.host_bandwidth / 1e9:g} GB/s"
            for p in plans:
                t = None if p.program is None else p.program.time(accelerator)
                out.append((p, f"{name} {p.label}, host link {link}", t))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["context", "single", "offload"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.which in ("context", "single"):
        plans = context_plans() if args.which == "context" else single_plans()
        print(repr(plans))
        rows = [(p, p.label, p.time) for p in plans]
    else:
        rows = offload_plans()
    for p, label, t in rows:
        m = p.memory
        row = {
            "label": label, "accelerator": p.accelerator, "knobs": dict(p.knobs),
            "fits": p.fits, "reason": p.reason,
            "peak_gib": None if m is None else m.peak / 2**30,
            "host_gib": None if m is None else m.host / 2**30,
            "step": None if t is None else t.step, "busy": None if t is None else t.busy,
            "exposed": None if t is None else t.exposed,
            "comms": None if t is None else t.comms, "host": None if t is None else t.host,
            "collectives": dict(p.collectives),
        }  # fmt: skip
        print(json.dumps(row))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
