"""Pipeline parallelism: a deep residual MLP whose stacked blocks run as a pipeline over
``'stage'`` (`nnx_sharding.pipeline`), with the batch over ``'data'`` and, inside each
stage, the hidden units over ``'model'``."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._jit import jit
from .._pipeline import STAGE, pipeline
from .._state_sharding import StateSharding
from ._model import MLP, Array, Step, mse
from ._specs import AxisName, PathEndsWith, on_mesh


def _residual(block: nnx.Linear, h: Array) -> Array:
    """One block of `DeepMLP`: ``h + tanh(block(h))``."""
    return h + jax.numpy.tanh(block(h))


class DeepMLP(MLP):
    """`MLP` with a stack of ``layers`` residual blocks, ``h + tanh(block(h))``, between
    ``up`` and the relu: ``down(relu(blocks(up(x))))``, the blocks run by
    `nnx_sharding.pipeline` in ``microbatches``.

    ``blocks`` is one ``nnx.Linear(hidden, hidden)`` made by ``nnx.vmap``: its kernel
    is ``(layers, hidden, hidden)``, its bias ``(layers, hidden)``. Under a mesh with a
    ``'stage'`` axis (`jax.set_mesh`) the blocks run as a GPipe pipeline over it; with
    no mesh (or none with that axis) they run as a scan, one block after the other.
    Both give the same numbers (to float32 rounding): the model is its own
    single-device reference. As `nnx_sharding.pipeline` requires, the stages must
    divide ``layers``, and ``microbatches`` be at least the stages and divide the batch.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = DeepMLP(2, 8, 3, layers=4, microbatches=2, rngs=nnx.Rngs(0))
    >>> model.blocks.kernel.shape
    (4, 8, 8)
    >>> model(jnp.ones((4, 2))).shape
    (4, 3)
    """

    def __init__(
        self, din: int, hidden: int, dout: int, *, layers: int, microbatches: int, rngs: nnx.Rngs
    ):
        @nnx.split_rngs(splits=layers)
        @nnx.vmap
        def stack(rngs: nnx.Rngs) -> nnx.Linear:
            return nnx.Linear(hidden, hidden, rngs=rngs)

        super().__init__(din, hidden, dout, rngs=rngs)
        self.blocks: nnx.Linear = stack(rngs)
        self.microbatches = microbatches

    def __call__(self, x: Array) -> Array:
        run = pipeline(_residual, microbatches=self.microbatches)
        return self.down(nnx.relu(run(self.blocks, self.up(x))))


def pipeline_sharding(axis: AxisName = STAGE, model_axis: AxisName | None = None) -> StateSharding:
    """The blocks' layer dimension over ``axis``: each stage holds its own blocks.

    The stacked kernel and bias of `DeepMLP`'s blocks (and adam's moments, whose paths
    end alike) are split on their leading, layer, dimension; the rest (``up``, ``down``,
    counters) is replicated. With ``model_axis``, the hidden units are split over it
    too: ``up``'s and every block's output columns, ``down``'s input rows.

    >>> pipeline_sharding().sharding_for(('opt_state', 0, 'mu', 'blocks', 'kernel'), None)
    P('stage',)
    >>> pipeline_sharding(model_axis='model').sharding_for(('blocks', 'kernel'), None)
    P('stage', None, 'model')
    """
    if model_axis is None:
        rules = {
            PathEndsWith(("blocks", "kernel")): P(axis),
            PathEndsWith(("blocks", "bias")): P(axis),
        }
    else:
        rules = {
            PathEndsWith(("blocks", "kernel")): P(axis, None, model_axis),
            PathEndsWith(("blocks", "bias")): P(axis, model_axis),
            PathEndsWith(("up", "kernel")): P(None, model_axis),
            PathEndsWith(("up", "bias")): P(model_axis),
            PathEndsWith(("down", "kernel")): P(model_axis, None),
        }
    return StateSharding({**rules, ...: P()})


def pipeline_step(mesh: Mesh) -> Step:
    """One adam step of a `DeepMLP`, its blocks pipelined over the mesh's ``'stage'`` axis.

    The step is the plain flax step (`reference_step`'s), jitted with the layout of
    `pipeline_sharding` and called under ``jax.set_mesh(mesh)``, where the model's
    `nnx_sharding.pipeline` finds the ``'stage'`` axis. The batch is split over
    ``'data'`` and the hidden units over ``'model'`` when the mesh has those axes;
    their collectives are the compiler's. The gradient is autodiff's through the
    pipeline: the loop run backwards, each ``ppermute`` sent back.

    On CPU devices the step waits for its loss before it returns: with several of
    these steps in flight, XLA's CPU collectives can wait forever for a device still
    busy with an earlier step (the pipeline's loop holds many collective-permutes).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_sharding.recipes import make_mesh, make_optimizer
    >>> model = DeepMLP(2, 8, 3, layers=4, microbatches=2, rngs=nnx.Rngs(0))
    >>> step = pipeline_step(make_mesh({'stage': 1, 'data': 1}))
    >>> step(model, make_optimizer(model), jnp.ones((4, 2)), jnp.ones((4, 3))).shape
    ()
    """
    axes = mesh.axis_names
    shardings = on_mesh(mesh, pipeline_sharding(model_axis="model" if "model" in axes else None))
    replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P("data") if "data" in axes else P())

    @jit(in_shardings=(shardings, shardings, batch, batch), out_shardings=replicated)
    def jitted(model: MLP, optimizer: nnx.Optimizer[MLP], x: Array, y: Array) -> Array:
        loss, grads = nnx.value_and_grad(lambda m: mse(m(x), y))(model)
        optimizer.update(model, grads)
        return loss

    on_cpu = mesh.devices.flat[0].platform == "cpu"

    def step(model: MLP, optimizer: nnx.Optimizer[MLP], x: Array, y: Array) -> Array:
        with jax.set_mesh(mesh):
            loss = jitted(model, optimizer, x, y)
        return loss.block_until_ready() if on_cpu else loss

    return step
