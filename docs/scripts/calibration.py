"""Plans published, measured MaxText runs exactly as they ran, and prints the cost
model's predicted step time beside the published one (docs/planning/predictions.md,
"Predictions against published runs").

    python docs/scripts/calibration.py llama2-7b      # 8 H100s, FSDP 8 (GPU compiler)
    python docs/scripts/calibration.py maxtext-32b    # v5p-128, FSDP 16 x tensor 4
    python docs/scripts/calibration.py maxtext-16b    # v5e-256, FSDP 256 (held out)
    python docs/scripts/calibration.py llama2-7b --hlo /tmp/calib  # also save the HLO

Each run is rebuilt as published (model sizes, batch, remat policy, mesh, float32
weights and Adam state, bfloat16 compute) with a small decoder written here, its layers
scanned, its causal attention a flash-attention kernel (jax's Pallas kernels: Triton on
GPUs, Mosaic on TPUs; the published runs used cuDNN's and Pallas's), and compiled by
the target's own compiler for compile-only devices. The published step time is MaxText's model FLOP
count (``6·N·tokens + 6·heads·layers·head_dim·seq²·batch`` per device, of its date)
over the published TFLOP/s per device.

Each run is compiled with the compiler flags its script set: the GPU run's
``XLA_FLAGS`` (those this XLA still has) in the environment, the 32B run's
``LIBTPU_INIT_ARGS`` as ``compiler_options`` (the compile-only TPU compiler does not read
the environment variable, but takes the same flags as options); the held-out 16B run is
compiled with the compiler's defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


@dataclasses.dataclass(frozen=True)
class Run:
    """One published run: the model, the batch, the layout, and what was measured."""

    name: str
    source: str
    accelerator: str  # a preset or a TPU topology
    devices: int
    layout: str
    mesh: dict
    vocab: int
    d_model: int
    heads: int
    head_dim: int
    mlp: int
    layers: int
    seq: int
    per_device_batch: int  # sequences per device, as MaxText's per_device_batch_size
    glu: bool  # SwiGLU (three matrices) or a two-matrix ReLU MLP
    parallel: bool  # attention and MLP off one norm, summed (MaxText's 2023 default)
    tied: bool  # the output head is the embedding's transpose
    remat: str
    published_tflops: float  # per device, as published
    flags: str = ""  # the run's published XLA_FLAGS (GPU) or LIBTPU_INIT_ARGS (TPU)

    @property
    def params(self) -> int:
        attn = 4 * self.d_model * self.heads * self.head_dim
        mlp = (3 if self.glu else 2) * self.d_model * self.mlp
        norms = (1 if self.parallel else 2) * self.d_model
        head = 0 if self.tied else self.vocab * self.d_model
        return self.vocab * self.d_model + head + self.layers * (attn + mlp + norms) + self.d_model

    @property
    def batch(self) -> int:
        return self.per_device_batch * self.devices

    @property
    def model_flops(self) -> float:
        """MaxText's count per device per step (late 2023 to May 2024)."""
        tokens = self.per_device_batch * self.seq
        dense = 6 * self.params * tokens
        attention = (
            6 * self.heads * self.layers * self.head_dim * self.seq**2 * self.per_device_batch
        )
        return dense + attention

    @property
    def published_step(self) -> float:
        return self.model_flops / (self.published_tflops * 1e12)

    @property
    def gpu(self) -> bool:
        return self.accelerator in ("h100", "h200")

    @property
    def jit_options(self) -> dict[str, dict[str, bool | str]]:
        """A TPU run's flags as ``compiler_options`` (``jax.jit``'s, which `plan` passes
        on); nothing for a GPU run, whose flags are read from ``XLA_FLAGS``."""
        if self.gpu or not self.flags:
            return {}
        pairs = (flag.removeprefix("--").split("=", 1) for flag in self.flags.split())
        return {"compiler_options": {k: {"true": True, "false": False}.get(v, v) for k, v in pairs}}


# The XLA flags of 1vm.sh that this XLA still has (it dropped --xla_gpu_graph_level and
# --xla_gpu_enable_triton_softmax_fusion): cuBLAS GEMMs, no compiler rematerialization,
# the latency-hiding scheduler, collectives combined up to 128 MiB and pipelined.
A3_FLAGS = " ".join(
    """--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false
    --xla_gpu_enable_highest_priority_async_stream=true
    --xla_gpu_all_reduce_combine_threshold_bytes=134217728
    --xla_gpu_all_gather_combine_threshold_bytes=134217728
    --xla_gpu_reduce_scatter_combine_threshold_bytes=67108864
    --xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true
    --xla_gpu_enable_pipelined_all_reduce=true --xla_gpu_enable_while_loop_double_buffering=true
    --xla_gpu_enable_all_gather_combine_by_dim=false
    --xla_gpu_enable_reduce_scatter_combine_by_dim=false
    --xla_disable_hlo_passes=rematerialization""".split()
)

# The LIBTPU_INIT_ARGS of v5p/32b.sh: collectives made asynchronous and fused with
# the matmuls they feed, the data-parallel all-reduce optimised.
V5P_FLAGS = " ".join(
    """--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true
    --xla_tpu_megacore_fusion_allow_ags=false --xla_enable_async_collective_permute=true
    --xla_tpu_enable_ag_backward_pipelining=true
    --xla_tpu_enable_data_parallel_all_reduce_opt=true
    --xla_tpu_data_parallel_opt_different_sized_ops=true
    --xla_tpu_enable_async_collective_fusion=true
    --xla_tpu_enable_async_collective_fusion_multiple_steps=true
    --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true""".split()
)

RUNS = {
    r.name: r
    for r in (
        # MaxText configs/a3/llama_2_7b/1vm.sh and README.md (April 2024): 492 TFLOP/s.
        Run("llama2-7b", "MaxText configs/a3/llama_2_7b (1x A3, 492 TFLOP/s/GPU)", "h100", 8,
            "fsdp", {"fsdp": 8}, 32000, 4096, 32, 128, 11008, 32, 4096, 4, glu=True,
            parallel=False, tied=False, remat="dots_with_context", published_tflops=492.0,
            flags=A3_FLAGS),
        # MaxText configs/v5p/32b.sh and README.md (December 2023): 328 TFLOP/s.
        Run("maxtext-32b", "MaxText configs/v5p/32b.sh (1x v5p-128, 328 TFLOP/s/chip)",
            "v5p:4x4x4", 64, "fsdp+tp", {"fsdp": 16, "model": 4}, 32768, 10240, 32, 256,
            32768, 32, 2048, 8, glu=False, parallel=True, tied=True, remat="dots",
            published_tflops=328.0, flags=V5P_FLAGS),
        # MaxText configs/v5e/16b.sh and README.md: 120 TFLOP/s (global_parameter_scale 16).
        Run("maxtext-16b", "MaxText configs/v5e/16b.sh (1x v5e-256, 120 TFLOP/s/chip)",
            "v5e:16x16", 256, "fsdp", {"fsdp": 256}, 32768, 5120, 32, 256, 32768, 32, 2048,
            6, glu=False, parallel=True, tied=True, remat="full", published_tflops=120.0),
    )
}  # fmt: skip


def build(run: Run):
    """The model, its adamw optimizer (abstract), the tokens, the step, and the rules."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import PartitionSpec as P

    bf16 = jnp.bfloat16
    policies = {
        "none": None,
        "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
        "dots_with_context": jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
            jax.checkpoint_policies.save_only_these_names("context"),
        ),
        "full": jax.checkpoint_policies.nothing_saveable,
    }

    def param(rngs, shape, names, ones=False):
        init = nnx.initializers.ones if ones else nnx.initializers.normal(0.02)
        return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, jnp.float32))

    def constrain(x, last=None):
        axes = jax.sharding.get_abstract_mesh().axis_names
        data = tuple(a for a in ("data", "fsdp") if a in axes)
        spec = [data or None] + [None] * (x.ndim - 1)
        if last and last in axes:
            spec[-1] = last
        return jax.lax.with_sharding_constraint(x, P(*spec))

    def norm(x, scale):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (y * scale).astype(bf16)

    def attention(q, k, v):
        """Causal flash attention, as the published runs used (cuDNN's on GPUs, Pallas
        on TPUs): the Pallas kernel of the target (Triton on GPUs, Mosaic on TPUs), on
        each device's share of the batch (and heads, under tensor parallelism)."""
        from jax.experimental.pallas.ops.gpu import attention as gpu_attention
        from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention

        axes = jax.sharding.get_abstract_mesh().axis_names
        data = tuple(a for a in ("data", "fsdp") if a in axes) or None
        heads = "model" if "model" in axes else None
        spec = P(data, None, heads, None)  # (batch, seq, heads, head_dim)

        def local(q, k, v):
            if run.accelerator.startswith("v"):  # TPU: (batch, heads, seq, head_dim)
                q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
                o = tpu_attention.flash_attention(q, k, v, causal=True, sm_scale=scale)
                return o.transpose(0, 2, 1, 3)
            return gpu_attention.mha(q, k, v, segment_ids=None, causal=True, sm_scale=scale)

        scale = 1.0 / math.sqrt(q.shape[-1])
        mapped = jax.shard_map(local, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
        return mapped(q, k, v)

    def layer(x, w):
        w = {k: v.astype(bf16) for k, v in w.items()}
        h = norm(x, w["attn_norm"])
        q, k, v = (jnp.einsum("bsd,dhk->bshk", h, w[n]) for n in ("wq", "wk", "wv"))
        context = checkpoint_name(attention(q, k, v), "context")
        attn = jnp.einsum("bshk,hkd->bsd", context, w["wo"])
        if run.parallel:
            m = h
            x = x + attn
        else:
            x = constrain(x + attn, "model")
            m = norm(x, w["mlp_norm"])
        if run.glu:
            hidden = jax.nn.silu(m @ w["wi_0"]) * (m @ w["wi_1"])
        else:
            hidden = jax.nn.relu(m @ w["wi_0"])
        return constrain(x + hidden @ w["wo_mlp"], "model")

    class Decoder(nnx.Module):
        def __init__(self, rngs):
            d, h, k, f, n = run.d_model, run.heads, run.head_dim, run.mlp, run.layers
            self.embed = param(rngs, (run.vocab, d), ("vocab", "embed"))
            shapes = {
                "attn_norm": ((n, d), (None, None)),
                "wq": ((n, d, h, k), (None, "embed", "heads", None)),
                "wk": ((n, d, h, k), (None, "embed", "heads", None)),
                "wv": ((n, d, h, k), (None, "embed", "heads", None)),
                "wo": ((n, h, k, d), (None, "heads", None, "embed")),
                "wi_0": ((n, d, f), (None, "embed", "mlp")),
                "wo_mlp": ((n, f, d), (None, "mlp", "embed")),
            }
            if run.glu:
                shapes["wi_1"] = shapes["wi_0"]
            if not run.parallel:
                shapes["mlp_norm"] = shapes["attn_norm"]
            self.layers = nnx.Dict(
                {
                    name: param(rngs, s, a, ones=name.endswith("norm"))
                    for name, (s, a) in shapes.items()
                }
            )
            self.final_norm = param(rngs, (d,), (None,), ones=True)
            if not run.tied:
                self.head = param(rngs, (d, run.vocab), ("embed", "vocab"))

        def __call__(self, tokens):
            x = constrain(self.embed[...].astype(bf16)[tokens], "model")
            policy = policies[run.remat]
            body = lambda x, w: (layer(x, w), None)  # noqa: E731
            if run.remat != "none":
                body = jax.checkpoint(body, policy=policy, prevent_cse=False)
            weights = {name: p[...] for name, p in self.layers.items()}
            x, _ = jax.lax.scan(body, x, weights)
            x = norm(x, self.final_norm[...])
            head = self.embed[...].T if run.tied else self.head[...]
            return jnp.einsum("bsd,dv->bsv", x, head.astype(bf16))

    def loss_fn(model, tokens):
        logits = model(tokens[:, :-1]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    def train_step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return loss

    def make():
        model = Decoder(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

    with nnx.use_eager_sharding(False):
        model, optimizer = nnx.eval_shape(make)
    tokens = jax.ShapeDtypeStruct((run.batch, run.seq + 1), jnp.int32)
    rules = [("heads", "model"), ("mlp", "model"), ("vocab", "model"), ("embed", None)]
    return model, optimizer, tokens, train_step, rules


def plan_run(run: Run, hlo: Path | None = None):
    """The run's one plan: its layout on its exact mesh, compiled for the target; the
    optimized HLO is kept (``--hlo``) by watching what the planner reads."""
    import nnx_sharding
    from nnx_sharding.plan._search import compile as candidate

    model, optimizer, tokens, step, rules = build(run)
    assert sum(math.prod(v.get_value().shape) for _, v in nnx_params(model)) == run.params
    saved: list[str] = []
    original_collectives = candidate.collectives

    def spy(text, n):
        saved.append(text)
        return original_collectives(text, n)

    candidate.collectives = spy
    try:
        plans = nnx_sharding.plan(
            step, model, optimizer, tokens, devices=run.devices, accelerator=run.accelerator,
            layouts=[(run.layout, dict(run.mesh))], rules=rules, donate_argnums=(0, 1),
            **run.jit_options,
        )  # fmt: skip
    finally:
        candidate.collectives = original_collectives
    if hlo is not None and saved:
        hlo.mkdir(parents=True, exist_ok=True)
        (hlo / f"{run.name}.hlo.txt").write_text(saved[-1])
    return plans[0]


def search_run(run: Run):
    """Every layout on every split of the run's devices, its model, batch and remat as
    published: the best plan that fits, and where the published layout ranks."""
    import nnx_sharding

    model, optimizer, tokens, step, rules = build(run)
    plans = nnx_sharding.plan(
        step, model, optimizer, tokens, devices=run.devices, accelerator=run.accelerator,
        rules=rules, donate_argnums=(0, 1), **run.jit_options,
    )  # fmt: skip
    print(plans, flush=True)
    published = next(p for p in plans if dict(p.mesh_shape) == dict(run.mesh))
    return {
        "run": run.name,
        "best": plans.best.label,
        "best_step": plans.best.time.step,
        "published": published.label,
        "published_fits": published.fits,
        "published_step": published.time.step if published.time else None,
        "published_rank": list(plans).index(published) + 1,
    }


def nnx_params(model):
    from flax import nnx

    return nnx.to_flat_state(nnx.state(model, nnx.Param))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("runs", nargs="*", default=["llama2-7b", "maxtext-32b"], choices=list(RUNS))
    p.add_argument("--hlo", type=Path, help="also save each optimized HLO module here")
    p.add_argument("--json", type=Path, help="append each result as a JSON line here")
    p.add_argument(
        "--search", action="store_true", help="plan every layout and split, as published else"
    )
    args = p.parse_args(argv)
    if len(args.runs) > 1:  # each run's flags are read when jax starts: a process each
        import subprocess

        rest = [a for a in argv if a not in args.runs]
        for name in args.runs:
            subprocess.run([sys.executable, __file__, name, *rest], check=True)
        return 0
    for name in args.runs:
        run = RUNS[name]
        if run.flags and run.gpu:  # read when jax starts the GPU compiler
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + run.flags).strip()
        if args.search:
            row = search_run(run)
            print(json.dumps(row, indent=1), flush=True)
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            continue
        start = time.perf_counter()
        plan = plan_run(run, args.hlo)
        seconds = time.perf_counter() - start
        t = plan.time
        row = {
            "run": run.name,
            "source": run.source,
            "params": run.params,
            "layout": plan.label,
            "compiler": plan.compiler,
            "reason": plan.reason,
            "peak_GiB": plan.memory.peak / 2**30 if plan.memory else None,
            "flops": plan.flops,
            "model_flops": run.model_flops,
            "published_step": run.published_step,
            "time": dataclasses.asdict(t) if t is not None else None,
            "step": t.step if t else None,
            "ratio": t.step / run.published_step if t else None,
            "plan_seconds": seconds,
            "notes": list(plan.notes),
        }
        if t is not None:
            for extra in ("step_low", "step_high"):
                row[extra] = getattr(t, extra, None)
        print(json.dumps(row, indent=1), flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
