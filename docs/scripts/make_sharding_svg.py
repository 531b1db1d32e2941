"""Regenerates the pictures of docs/inspecting.md: the sharding table and device grids
of the tensor-parallel model, on a ('data', 'model') = (2, 4) mesh of 8 simulated CPUs.

    python docs/scripts/make_sharding_svg.py
    python docs/scripts/make_sharding_svg.py --model some.module:make_model

``--model`` swaps in another model: a ``module:function`` whose function takes the
mesh and returns the model placed on it. Without it, `make_model` below is used: a
Megatron-style MLP whose sharding metadata (``nnx.with_partitioning``) is applied by
``nnx_sharding.shard``.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
MESH_SHAPE = {"data": 2, "model": 4}
GRIDS = (".up.kernel", ".down.kernel")  # the Variables whose device grids are drawn


def make_model(mesh):  # noqa: ANN001, ANN201 (jax is imported after the device count is set)
    """Megatron-style 2-layer MLP: columns of the first kernel, rows of the second."""
    from flax import nnx

    import nnx_sharding

    class MLP(nnx.Module):
        def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
            lecun, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
            self.up = nnx.Linear(
                din,
                dhidden,
                kernel_init=nnx.with_partitioning(lecun, (None, "model")),
                bias_init=nnx.with_partitioning(zeros, ("model",)),
                rngs=rngs,
            )
            self.down = nnx.Linear(
                dhidden, dout, kernel_init=nnx.with_partitioning(lecun, ("model", None)), rngs=rngs
            )

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    with nnx.use_eager_sharding(False):  # placed by nnx_sharding.shard
        model = MLP(16, 64, 16, rngs=nnx.Rngs(0))
    return nnx_sharding.shard(model, mesh)


def load(spec: str | None) -> Callable[..., object]:
    if spec is None:
        return make_model
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name or "make_model")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="module:function building the model")
    parser.add_argument("--out", type=Path, default=ASSETS, help="folder for the SVG files")
    args = parser.parse_args(argv)

    import jax

    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    from jax.sharding import AxisType
    from rich.console import Console

    import nnx_sharding

    mesh = jax.make_mesh(tuple(MESH_SHAPE.values()), tuple(MESH_SHAPE), (AxisType.Auto,) * 2)
    model = load(args.model)(mesh)

    args.out.mkdir(parents=True, exist_ok=True)
    title = f"Tensor-parallel MLP on mesh {MESH_SHAPE}"
    table = nnx_sharding.sharding_table(model)
    (args.out / "sharding_table.svg").write_text(table.to_svg(width=110, title=title))
    console = Console(record=True, file=io.StringIO(), width=110)
    nnx_sharding.visualize_sharding(model, GRIDS, console=console)
    (args.out / "sharding_grids.svg").write_text(console.export_svg(title=title))
    print(table.to_text(width=110))
    print(f"wrote {args.out / 'sharding_table.svg'} and {args.out / 'sharding_grids.svg'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
