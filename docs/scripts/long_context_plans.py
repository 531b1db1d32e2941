"""The plans of docs/planning/long_context.md: Llama 3 8B at 131,072 tokens on 16
compile-only v5p chips (FSDP, FSDP × tensor, FSDP × context with each strategy),
and a step where offloading beats recomputing beside one where it does not.

    python docs/scripts/long_context_plans.py context   # the 128K plans
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


def offload_plans():
    """Llama 3 8B at 8,192 tokens, FSDP over 8 v6e chips, ``full`` against
    ``offload_qkv``; each priced on v6e (a 32 GB/s host link per chip) and again,
    without recompiling (`Program.time`), on a host link 20 times slower."""
    from nnx_sharding.plan import DECODER_CONFIGS, PRESETS, decoder_builder, search

    config = dataclasses.replace(DECODER_CONFIGS["llama3-8b"], batch=16, layers=8)
    plans = search(decoder_builder(config), {"remat": ["full", "offload_qkv"]}, devices=8,
                   accelerator="v6e", layouts=[("fsdp", {"fsdp": 8})], prune=False)  # fmt: skip
    v6e = PRESETS["v6e"]
    slow = dataclasses.replace(v6e, host_bandwidth=v6e.host_bandwidth / 20)
    out = []
    for link, accelerator in (("32 GB/s", v6e), ("1.6 GB/s", slow)):
        for p in plans:
            t = None if p.program is None else p.program.time(accelerator)
            out.append((p, f"{p.label}, host link {link}", t))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["context", "offload"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.which == "context":
        plans = context_plans()
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
