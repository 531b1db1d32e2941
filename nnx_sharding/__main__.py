"""The main job: ``python -m nnx_sharding``.

Runs a jitted, tensor-parallel nnx MLP on 8 simulated CPU devices and prints its
output next to a single-device reference, and the sharding of every parameter.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    import jax

    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)

    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P
    from rich.console import Console
    from rich.table import Table

    import nnx_sharding

    class MLP(nnx.Module):
        def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
            self.up = nnx.Linear(din, dhidden, rngs=rngs)
            self.down = nnx.Linear(dhidden, dout, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.down(nnx.relu(self.up(x)))

    console = Console()
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    model = MLP(16, 64, 8, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (32, 16))
    reference = model(x)

    shardings = nnx_sharding.StateSharding(
        [
            (nnx.All(nnx.PathContains("up"), nnx.PathContains("kernel")), P(None, "model")),
            (nnx.All(nnx.PathContains("up"), nnx.PathContains("bias")), P("model")),
            (nnx.All(nnx.PathContains("down"), nnx.PathContains("kernel")), P("model", None)),
            (..., P()),
        ]
    )

    @nnx_sharding.jit(in_shardings=(shardings, P("data")), out_shardings=P("data"))
    def forward(model: MLP, x: jax.Array) -> jax.Array:
        return model(x)

    with jax.set_mesh(mesh):
        y = forward(model, x)

    table = Table(title=f"Parameters of MLP on mesh {dict(mesh.shape)}")
    for column in ("path", "shape", "sharding"):
        table.add_column(column)
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = param.get_raw_value()
        table.add_row(".".join(map(str, path)), str(value.shape), str(value.sharding.spec))
    console.print(table)
    error = float(jnp.max(jnp.abs(y - reference)))
    console.print(f"output {y.shape} sharded as {y.sharding.spec}")
    console.print(f"max |jit - single-device reference| = {error:.2e}")
    return 0 if error < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
