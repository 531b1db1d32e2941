"""Compiles a published model's training step for compile-only GPUs or TPUs, per remat
policy, and prints what one device holds (``memory_analysis``): the check that the
decoder's memory is what the published runs fit in.

    python docs/scripts/decoder_memory.py                      # llama2-7b, 8 H100s, FSDP
    python docs/scripts/decoder_memory.py --config llama3-8b --per-device 2 --seq 8192
    python docs/scripts/decoder_memory.py --remat dots,full --microbatches 1,4

Each run compiles the AdamW step (`nnx_sharding.plan.decoder_builder`) with
`nnx_sharding.plan` under one layout (``fsdp`` by default) and prints, per remat policy
and microbatch count: the arguments (parameters and optimizer state, an eighth each),
the temporaries, their sum (the peak), the step's FLOPs per device and the model's
(``6·N·tokens`` plus attention, as MaxText counts them).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

GiB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", default="llama2-7b")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--accelerator", default="h100")
    p.add_argument("--layout", default="fsdp")
    p.add_argument("--per-device", type=int, default=4, help="sequences per device (4)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the config's)")
    p.add_argument("--remat", default="dots,full", help="remat policies, comma-separated")
    p.add_argument("--microbatches", default="1", help="microbatch counts, comma-separated")
    args = p.parse_args()

    import jax

    jax.config.update("jax_platforms", "cpu")  # compile-only devices: no accelerator used
    import nnx_sharding
    from nnx_sharding.plan import DECODER_CONFIGS, DECODER_RULES, decoder_builder

    config = DECODER_CONFIGS[args.config]
    config = dataclasses.replace(
        config, batch=args.per_device * args.devices, seq_len=args.seq or config.seq_len
    )
    print(
        f"{config.name}: {config.param_count():,} parameters, batch {config.batch} × "
        f"{config.seq_len} tokens on {args.devices} × {args.accelerator} ({args.layout})"
    )
    build = decoder_builder(config)
    for remat in args.remat.split(","):
        for k in (int(x) for x in args.microbatches.split(",")):
            built = build({"remat": remat, "microbatches": k})
            start = time.perf_counter()
            (plan,) = nnx_sharding.plan(
                built.step, *built.args, devices=args.devices, accelerator=args.accelerator,
                layouts=[args.layout], rules=DECODER_RULES, **built.jit_options,
            )  # fmt: skip
            seconds = time.perf_counter() - start
            if plan.memory is None:
                print(f"  remat {remat:18} microbatches {k}: {plan.reason}")
                continue
            m = plan.memory
            print(
                f"  remat {remat:18} microbatches {k}: arguments {m.arguments / GiB:6.2f} GiB, "
                f"temporaries {m.temp / GiB:6.2f} GiB, peak {m.peak / GiB:6.2f} GiB "
                f"({'fits' if plan.fits else 'does not fit'}); {plan.flops:.3e} FLOPs per "
                f"device (model: {built.model_flops / args.devices:.3e}); "
                f"compiled in {seconds:.0f} s"
            )


if __name__ == "__main__":
    main()
