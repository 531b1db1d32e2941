"""Data x tensor parallel training on a mesh that spans processes (docs/multihost.md).

Every process runs this same file. On one machine:

    python -m nnx_sharding.launch -n 2 --devices-per-process 4 docs/scripts/multihost_train.py

On a cluster, start it once per host the cluster's way (srun, mpirun, a TPU pod's
``--worker=all``); `initialize_distributed` finds the coordinator there itself.
"""

import nnx_sharding

nnx_sharding.initialize_distributed()  # first: before anything touches a device

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nnx_sharding import recipes  # noqa: E402

# One global mesh over every device of every process: 'data' across processes
# (2 here), 'model' within a process (4 here).
mesh = recipes.make_mesh({"data": jax.process_count(), "model": jax.local_device_count()})
params = recipes.on_mesh(mesh, recipes.megatron_sharding())

# Created sharded: each process computes and holds only its own shards.
model = nnx_sharding.jit(lambda: recipes.MLP(16, 64, 8, rngs=nnx.Rngs(0)), out_shardings=params)()
optimizer = nnx_sharding.jit(recipes.make_optimizer, out_shardings=params)(model)
step = recipes.data_tensor_parallel_step(mesh)

if jax.process_index() == 0:  # the same global table on every process: print it once
    print(nnx_sharding.sharding_table(model).to_text())

# Each process loads only its own rows of every global batch: those of its devices.
batch = NamedSharding(mesh, P("data"))
rows = [index[0] for index in batch.addressable_devices_indices_map((32, 16)).values()]
mine = slice(min(r.start for r in rows), max(r.stop for r in rows))
for i, (x, y) in enumerate(recipes.make_batches(6, 32, 16, 8)):
    x, y = (jax.make_array_from_process_local_data(batch, np.asarray(a)[mine]) for a in (x, y))
    loss = step(model, optimizer, x, y)  # a replicated scalar: every process can read it
    print(f"process {jax.process_index()}: step {i} loss {float(loss):.6f}")
