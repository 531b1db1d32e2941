"""Times `nnx_sharding.plan.search` on a llama-shaped decoder (docs/planning/search.md,
"How long a search takes"): how many points it compiles, and how long it takes.

    python docs/scripts/search_timing.py llama3-8b --devices 64 --accelerator h100 \\
        --batch 512 --seq 8192 --remat none,dots,full --microbatches 1,2,4,8

The decoder here is a stand-in written for this measurement (grouped-query attention,
a SwiGLU MLP, RMSNorm, layers scanned, each layer under ``jax.checkpoint`` with the
remat policy, gradients accumulated over microbatches in a scan; float32 parameters
and adam state, bfloat16 matmuls), not the package's built-in decoder. ``--json``
writes the plans; ``--no-prune`` compiles every point (the reference), ``--pareto``
searches with ``prune='pareto'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

SIZES = {  # d_model, layers, heads, kv_heads, head_dim, mlp, vocab (the published sizes)
    "llama3-8b": (4096, 32, 32, 8, 128, 14336, 128256),
    "llama3-70b": (8192, 80, 64, 8, 128, 28672, 128256),
    "small": (512, 4, 8, 4, 64, 1536, 32000),
}


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    batch: int
    seq: int

    def params(self) -> int:
        d, h, k, g = self.d_model, self.heads, self.kv_heads, self.head_dim
        block = d * h * g * 2 + d * k * g * 2 + 3 * d * self.mlp + 2 * d
        return 2 * self.vocab * d + self.layers * block + d


def builder(c: Config):  # noqa: ANN201 - jax is imported after the device flags
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    policies = {
        "none": None,
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "full": jax.checkpoint_policies.nothing_saveable,
    }
    rules = {"embed": None, "heads": "model", "mlp": "model", "vocab": "model"}

    def param(rngs, shape, names):
        init = nnx.initializers.normal(0.02)
        return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape))

    class Decoder(nnx.Module):
        def __init__(self, rngs):
            n, d = c.layers, c.d_model
            self.embed = param(rngs, (c.vocab, d), ("vocab", "embed"))
            self.wq = param(rngs, (n, d, c.heads, c.head_dim), (None, "embed", "heads", None))
            self.wkv = param(
                rngs, (n, 2, d, c.kv_heads, c.head_dim), (None, None, "embed", "heads", None)
            )
            self.wo = param(rngs, (n, c.heads, c.head_dim, d), (None, "heads", None, "embed"))
            self.gate_up = param(rngs, (n, 2, d, c.mlp), (None, None, "embed", "mlp"))
            self.down = param(rngs, (n, c.mlp, d), (None, "mlp", "embed"))
            self.head = param(rngs, (d, c.vocab), ("embed", "vocab"))

        def __call__(self, tokens, remat):
            bf = jnp.bfloat16
            x = self.embed[...].astype(bf)[tokens]

            def batch_parallel(x):  # the carry's batch on the data-parallel axes
                names = jax.sharding.get_abstract_mesh().axis_names
                axes = tuple(a for a in ("data", "fsdp") if a in names)
                return jax.lax.with_sharding_constraint(x, P(axes)) if axes else x

            def layer(x, w):
                x = batch_parallel(x)
                h = x * jax.lax.rsqrt(
                    jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6
                ).astype(bf)
                q = jnp.einsum("bsd,dhk->bshk", h, w["wq"].astype(bf))
                kv = jnp.einsum("bsd,cdgk->cbsgk", h, w["wkv"].astype(bf))
                a = jax.nn.dot_product_attention(q, kv[0], kv[1], is_causal=True)
                x = x + jnp.einsum("bshk,hkd->bsd", a, w["wo"].astype(bf))
                h = x * jax.lax.rsqrt(
                    jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6
                ).astype(bf)
                gu = jnp.einsum("bsd,cdf->cbsf", h, w["gate_up"].astype(bf))
                return x + jnp.einsum(
                    "bsf,fd->bsd", jax.nn.silu(gu[0]) * gu[1], w["down"].astype(bf)
                ), None

            if remat != "none":
                layer = jax.checkpoint(layer, policy=policies[remat])
            names = ("wq", "wkv", "wo", "gate_up", "down")
            x, _ = jax.lax.scan(layer, x, {n: getattr(self, n)[...] for n in names})
            return x @ self.head[...].astype(bf)

    def loss_fn(model, tokens, remat):
        logits = model(tokens[:, :-1], remat).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def make_step(remat, count):
        def step(model, optimizer, tokens):
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)

            def body(total, part):
                value, grads = jax.value_and_grad(
                    lambda p: loss_fn(nnx.merge(graphdef, p, rest), part, remat)
                )(params)
                return jax.tree.map(jnp.add, total, grads), value

            slices = tokens.reshape(count, -1, tokens.shape[-1])
            grads, losses = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), slices)
            optimizer.update(model, jax.tree.map(lambda g: g / count, grads))
            return losses.mean()

        return step

    def build(knobs):
        from nnx_sharding.plan import Built

        remat, count = knobs.get("remat", "none"), knobs.get("microbatches", 1)

        def make():
            model = Decoder(nnx.Rngs(0))
            return model, nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

        with nnx.use_eager_sharding(False):
            model, optimizer = nnx.eval_shape(make)
        tokens = jax.ShapeDtypeStruct((c.batch, c.seq + 1), jnp.int32)
        dense = c.params() - c.vocab * c.d_model
        per_token = 6 * dense + 12 * c.layers * c.heads * c.head_dim * c.seq
        flops = float(per_token * c.batch * c.seq)
        return Built(
            make_step(remat, count), (model, optimizer, tokens), {"donate_argnums": (0, 1)}, flops
        )

    build.choices = {"remat": list(policies)}
    return build, list(rules.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("size", choices=SIZES)
    p.add_argument("--devices", type=int, default=64)
    p.add_argument("--accelerator", default="h100")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--remat", default="none,dots,full")
    p.add_argument("--microbatches", default="1,2,4,8")
    p.add_argument("--layouts", help="comma-separated layouts (default: all)")
    p.add_argument("--no-prune", action="store_true")
    p.add_argument("--pareto", action="store_true", help="prune='pareto'")
    p.add_argument("--json", help="write the plans here")
    args = p.parse_args()

    import jax

    jax.config.update("jax_platforms", "cpu")
    import nnx_sharding

    config = Config(*SIZES[args.size], batch=args.batch, seq=args.seq)
    build, rules = builder(config)
    space = {
        "remat": args.remat.split(","),
        "microbatches": [int(m) for m in args.microbatches.split(",")],
    }
    start, cpu = time.perf_counter(), time.process_time()
    plans = nnx_sharding.plan.search(
        build,
        space,
        devices=args.devices,
        accelerator=args.accelerator,
        layouts=args.layouts.split(",") if args.layouts else None,
        rules=rules,
        progress=True,
        prune="pareto" if args.pareto else not args.no_prune,
    )
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    compiled = [q for q in plans if q.compiled]
    from rich.console import Console

    Console(width=220).print(plans.table(pruned=False))
    try:
        print("best:", repr(plans.best))
    except ValueError as e:
        print(e)
    by: dict[str, int] = {}
    for q in plans:
        kind = q.pruned or ("compiled" if q.compiled else "not built")
        by[kind] = by.get(kind, 0) + 1
    print(
        json.dumps(
            {
                "size": args.size,
                "parameters": config.params(),
                "devices": args.devices,
                "accelerator": args.accelerator,
                "points": len(plans),
                "by": by,
                "compiled": len(compiled),
                "compile_seconds": round(sum(q.compile_seconds for q in compiled), 1),
                "wall_seconds": round(wall, 1),
                "process_cpu_seconds": round(cpu, 1),
            }
        )
    )
    if args.json:
        plans.to_json(args.json)


if __name__ == "__main__":
    main()
