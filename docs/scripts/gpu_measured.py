"""The planner's answer for one GPU held against the GPU: a 1B-parameter decoder's
training step planned with no device (the compile-only GPU compiler), then run on the
GPU at the same knob values (docs/planning/predictions.md, "Measured on a GPU").

    python docs/scripts/gpu_measured.py predict --accelerator h200 > predicted.json
    python docs/scripts/gpu_measured.py measure --accelerator h200 > measured.json
    python docs/scripts/gpu_measured.py table predicted.json measured.json

``predict`` needs no GPU: it runs `nnx_sharding.plan.search` on one compile-only GPU
(``prune=False``: every point compiled) and prints each plan's memory and predicted time.
``measure`` needs the GPU: each point runs in a process of its own (so that the
allocator's peak is that point's), with the decoder's parameters initialised as
training initialises them (random, not zeros: a matmul unit multiplies zeros faster),
random tokens, two steps to compile and warm up, then ``STEPS`` timed steps; it prints
the median step time, the spread, the compiler's memory figures and the allocator's
peak. It also plans the same points with the GPU's own compiler (``search`` on the real
device) to separate the compiler's differences from the cost model's.

The model (``CONFIG``) is Llama-shaped and sized to train on one 80 GB GPU without
remat: 0.95e9 parameters (d_model 2048, 16 layers, 16 heads of 128, SwiGLU 5632, vocab
32000), 8 sequences of 2048 tokens, float32 parameters and AdamW state, bfloat16 compute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

STEPS = 10
MODELS = {
    "gpu-1b": dict(
        name="gpu-1b", vocab=32000, d_model=2048, heads=16, head_dim=128, mlp=5632,
        layers=16, batch=8, seq_len=2048,
    ),
    # held out: planned, then measured, after gpu-1b
    "gpu-3b": dict(
        name="gpu-3b", vocab=128256, d_model=3072, heads=24, head_dim=128, kv_heads=8,
        mlp=8192, layers=28, batch=4, seq_len=4096, tied=True, rope_theta=500000.0,
    ),
    # held out: Llama-3-8B's layers, 8 of its 32, at its sequence of 8192
    "llama3-8b-8l": dict(
        name="llama3-8b-8l", vocab=128256, d_model=4096, heads=32, head_dim=128,
        kv_heads=8, mlp=14336, layers=8, batch=2, seq_len=8192, rope_theta=500000.0,
    ),
}  # fmt: skip
CONFIG = dict(MODELS[os.environ.get("GPU_MEASURED_MODEL", "gpu-1b")])
POINTS = [
    # (attention, remat, microbatches)
    ("blockwise", "none", 1),
    ("blockwise", "dots_with_context", 1),
    ("blockwise", "dots", 1),
    ("blockwise", "full", 1),
    ("blockwise", "dots", 2),
    ("cudnn", "dots", 1),
]
if CONFIG["name"] == "gpu-3b":
    POINTS = [("blockwise", r, k) for r, k in [("none", 1), ("dots", 1), ("full", 1), ("dots", 2)]]
    POINTS += [("cudnn", "dots", 1), ("cudnn", "none", 1), ("cudnn", "full", 1)]
if CONFIG["name"] == "llama3-8b-8l":
    POINTS = [("cudnn", r, 1) for r in ("none", "dots", "full")]
if os.environ.get("GPU_MEASURED_TINY"):  # a smoke test of this script on the CPU
    CONFIG.update(d_model=64, heads=2, head_dim=32, mlp=128, layers=2, seq_len=128, vocab=256)
    CONFIG.update(kv_heads=1 if CONFIG.get("kv_heads") else None)


def config(attention: str):
    from nnx_sharding.plan import DecoderConfig

    return DecoderConfig(**CONFIG, attention=attention)


def builder():
    """Knobs ``attention``, ``remat``, ``microbatches`` -> the decoder's AdamW step."""
    from nnx_sharding.plan import decoder_builder

    def build(knobs):
        inner = decoder_builder(config(knobs["attention"]))
        return inner({"remat": knobs["remat"], "microbatches": knobs["microbatches"]})

    return build


def plan_points(points, devices, accelerator, deadline=float("inf")):
    """One plan per point, every one compiled (``prune=False``), until ``deadline``."""
    from nnx_sharding.plan import search

    out = []
    for attention, remat, k in points:
        if time.perf_counter() > deadline:
            break
        start = time.perf_counter()
        plans = search(
            builder(),
            {"attention": [attention], "remat": [remat], "microbatches": [k]},
            devices=devices, accelerator=accelerator, layouts=["dp"], prune=False,
        )  # fmt: skip
        row = json.loads(plans.to_json())["plans"][0]
        row["compile_s"] = time.perf_counter() - start
        row["point"] = [attention, remat, k]
        out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return out


def measure_one(attention: str, remat: str, k: int, hlo: str = "") -> dict:
    """Runs one point on the first device: the step's median time over ``STEPS`` steps."""
    import jax
    import optax
    from flax import nnx

    import nnx_sharding
    from nnx_sharding.plan import Decoder, make_train_step

    c = dataclasses.replace(config(attention), remat=remat)
    with nnx.use_eager_sharding(False):  # one device: the names' metadata, no mesh
        model = Decoder(c, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (c.batch, c.seq_len + 1), 0, c.vocab)
    step = nnx_sharding.jit(make_train_step(k), donate_argnums=(0, 1))
    start = time.perf_counter()
    compiled = step.lower(model, optimizer, tokens).compile()
    compile_s = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    if hlo:
        with open(hlo, "w") as f:
            f.write(compiled.as_text())
    losses = [float(step(model, optimizer, tokens)) for _ in range(2)]
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        loss = step(model, optimizer, tokens)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "point": [attention, remat, k],
        "device": jax.devices()[0].device_kind,
        "step_s": statistics.median(times),
        "step_min_s": min(times),
        "step_max_s": max(times),
        "compile_s": compile_s,
        "loss": losses + [float(loss)],
        "temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
        "argument_bytes": getattr(analysis, "argument_size_in_bytes", None),
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "bytes_limit": stats.get("bytes_limit"),
        "model_flops": c.model_flops(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["predict", "measure", "one", "table"])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--accelerator", default="h200")
    parser.add_argument("--point", default="", help="one: attention,remat,k")
    parser.add_argument("--only", default="", help="measure: these points (a;b) alone")
    parser.add_argument("--hlo", default="", help="one: also write the compiled HLO here")
    parser.add_argument("--no-plans", action="store_true", help="measure: skip planning on the GPU")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds for measure")
    args = parser.parse_args()
    if args.what == "predict":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        # compile-only GPUs have no cuDNN to trace for: ``auto`` plans Pallas's kernel
        points = [("auto" if a == "cudnn" else a, r, k) for a, r, k in POINTS]
        print(json.dumps(plan_points(points, 1, args.accelerator), indent=1))
    elif args.what == "one":
        attention, remat, k = args.point.split(",")
        print("RESULT " + json.dumps(measure_one(attention, remat, int(k), args.hlo)), flush=True)
    elif args.what == "measure":
        start = time.perf_counter()
        results = []
        only = {tuple(p.split(",")) for p in args.only.split(";") if p}
        for attention, remat, k in POINTS:
            if only and (attention, remat, str(k)) not in only:
                continue
            if time.perf_counter() - start > args.budget:
                break
            point = f"{attention},{remat},{k}"
            proc = subprocess.run(
                [sys.executable, __file__, "one", "--point", point],
                capture_output=True, text=True, timeout=max(30, args.budget),
            )  # fmt: skip
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if found:
                results.append(json.loads(found[0][7:]))
            else:
                results.append({"point": [attention, remat, k], "error": proc.stderr[-3000:]})
            print(json.dumps(results[-1])[:3000], file=sys.stderr, flush=True)
        device_plans = []
        if time.perf_counter() - start < args.budget and not args.no_plans:
            import jax

            kind = jax.devices()[0].device_kind
            accelerator = "h100" if "H100" in kind else args.accelerator
            try:
                deadline = start + args.budget
                device_plans = plan_points(POINTS, jax.devices()[:1], accelerator, deadline)
            except Exception as e:  # noqa: BLE001 - report, keep the measurements
                device_plans = [{"error": repr(e)[:3000]}]
        print(json.dumps({"measured": results, "device_plans": device_plans}, indent=1))
    else:
        predicted = {tuple(r["point"]): r for r in json.load(open(args.files[0]))}
        measured = json.load(open(args.files[1]))["measured"]
        print("| attention | remat | k | fits | peak (compile-only) | peak (GPU) | "
              "predicted step | measured step | ratio |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for m in measured:
            a, r, k = m["point"]
            p = predicted.get(("auto" if a == "cudnn" else a, r, k))
            if p is None or "step_s" not in m:
                continue
            step = p["time"]["step"]
            print(
                f"| {m['point'][0]} | {m['point'][1]} | {m['point'][2]} | {p['fits']} | "
                f"{p['memory']['peak'] / 2**30:.1f} GiB | "
                f"{(m['peak_bytes_in_use'] or 0) / 2**30:.1f} GiB | {step * 1e3:.0f} ms | "
                f"{m['step_s'] * 1e3:.0f} ms ({m['step_min_s'] * 1e3:.0f}-"
                f"{m['step_max_s'] * 1e3:.0f}) | {step / m['step_s']:.2f} |"
            )


if __name__ == "__main__":
    main()
