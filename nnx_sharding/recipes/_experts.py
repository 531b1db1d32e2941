"""Expert parallelism: an MLP whose hidden tokens pass through residual mixture-of-experts
blocks (`nnx_sharding.MoE`), the experts split over ``'expert'`` by their logical names,
the batch over ``'data'`` and ``'expert'``, the load-balancing loss added to the loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._jit import jit
from .._moe import BATCH_AXES, EXPERT, NAMES, MoE
from .._state_sharding import StateSharding
from ._model import MLP, Array, Batch, Step, mse
from ._specs import AxisName, PathEndsWith, on_mesh

AUX_WEIGHT = 0.01
"""The load-balancing loss's weight in the loss (MaxText's default)."""


class ExpertMLP(MLP):
    """`MLP` with ``layers`` residual MoE blocks, ``h + moe(h)``, between ``up`` and the
    relu: ``down(relu(blocks(up(x))))`` for ``x`` of shape (batch, seq, din), each token
    routed to ``k`` of ``experts`` SwiGLU experts (`nnx_sharding.MoE`, dropless unless
    ``capacity_factor``).

    ``model(x)`` is the prediction; ``model.with_aux(x)`` also returns the blocks' mean
    load-balancing loss. The MoE layers find the mesh in context (`jax.set_mesh`): with
    no mesh they run on one device, so the model is its own single-device reference.

    >>> model = ExpertMLP(2, 8, 3, layers=1, experts=4, k=2, mlp=16, rngs=nnx.Rngs(0))
    >>> model.blocks[0].gate.shape
    (4, 8, 16)
    >>> [a.shape for a in model.with_aux(jnp.ones((2, 5, 2)))]
    [(2, 5, 3), ()]
    """

    def __init__(
        self,
        din: int,
        hidden: int,
        dout: int,
        *,
        layers: int,
        experts: int,
        k: int,
        mlp: int,
        capacity_factor: float | None = None,
        rngs: nnx.Rngs,
    ):
        super().__init__(din, hidden, dout, rngs=rngs)
        self.blocks = nnx.List(
            MoE(hidden, experts=experts, k=k, mlp=mlp, capacity_factor=capacity_factor, rngs=rngs)
            for _ in range(layers)
        )

    def with_aux(self, x: Array) -> tuple[Array, Array]:
        """The prediction and the blocks' mean load-balancing loss."""
        h, aux = self.up(x), jnp.zeros((), jnp.float32)
        for block in self.blocks:
            y, loss = block(h)
            h, aux = h + y, aux + loss
        return self.down(nnx.relu(h)), aux / len(self.blocks)

    def __call__(self, x: Array) -> Array:
        return self.with_aux(x)[0]


def expert_loss(model: ExpertMLP, x: Array, y: Array) -> Array:
    """The mean squared error plus `AUX_WEIGHT` times the load-balancing loss."""
    prediction, aux = model.with_aux(x)
    return mse(prediction, y) + AUX_WEIGHT * aux


def expert_rules(model_axis: AxisName | None = None) -> tuple[tuple[str, str | None], ...]:
    """The MoE weights' logical names to mesh axes: the experts over ``'expert'``, each
    expert's hidden units over ``model_axis`` (None: replicated), the rest replicated.

    >>> expert_rules()[0]
    ('experts', 'expert')
    """
    return (("experts", EXPERT), ("embed", None), ("expert_mlp", model_axis), ("mlp", model_axis))


def expert_sharding(model_axis: AxisName | None = None) -> StateSharding:
    """Every MoE weight (and adam's moments of it, whose paths end alike) laid out by its
    logical names through `expert_rules`; the rest (``up``, ``down``, counters)
    replicated.

    >>> expert_sharding().sharding_for(('opt_state', 0, 'mu', 'blocks', 0, 'gate'), None)
    P('expert', None, None)
    >>> expert_sharding('model').sharding_for(('blocks', 1, 'down'), None)
    P('expert', 'model', None)
    """
    rules = dict(expert_rules(model_axis))
    specs = {
        PathEndsWith((name,)): P(*(None if n is None else rules[n] for n in names))
        for name, names in NAMES.items()
    }
    return StateSharding({**specs, ...: P()})


def batch_spec(axes: tuple[AxisName, ...]) -> P:
    """The sequences over the mesh's batch axes, as `nnx_sharding.MoE` splits them.

    >>> batch_spec(('expert', 'data'))
    P(('data', 'expert'),)
    """
    batch = tuple(a for a in BATCH_AXES if a in axes)
    return P(batch if batch else None)


def as_sequences(batches: list[Batch], seq: int) -> list[Batch]:
    """Batches of tokens ``(batch, d)`` as sequences ``(batch // seq, seq, d)``."""
    return [tuple(a.reshape(-1, seq, a.shape[-1]) for a in b) for b in batches]  # type: ignore[misc]


def expert_reference_step() -> Step:
    """The plain flax step of `expert_loss` (``nnx.jit``, one device, no mesh)."""

    @nnx.jit
    def step(model: MLP, optimizer: nnx.Optimizer[MLP], x: Array, y: Array) -> Array:
        loss, grads = nnx.value_and_grad(expert_loss)(model, x, y)
        optimizer.update(model, grads)
        return loss

    return step


def expert_step(mesh: Mesh) -> Step:
    """One adam step of an `ExpertMLP` of `expert_loss`, its experts over ``'expert'``.

    The step is `expert_reference_step`'s, jitted with the layout of `expert_sharding`
    and called under ``jax.set_mesh(mesh)``, where the MoE layers find the mesh: the
    sequences go over ``'data'`` and ``'expert'`` (`batch_spec`), each expert's hidden
    units over ``'model'`` when the mesh has it. The collectives are the compiler's and
    the MoE layer's (`nnx_sharding.moe`).

    >>> from nnx_sharding.recipes import make_mesh, make_optimizer
    >>> model = ExpertMLP(2, 8, 3, layers=1, experts=4, k=2, mlp=16, rngs=nnx.Rngs(0))
    >>> step = expert_step(make_mesh({'expert': 1}))
    >>> step(model, make_optimizer(model), jnp.ones((2, 4, 2)), jnp.ones((2, 4, 3))).shape
    ()
    """
    axes = mesh.axis_names
    shardings = on_mesh(mesh, expert_sharding("model" if "model" in axes else None))
    batch = NamedSharding(mesh, batch_spec(axes))

    @jit(in_shardings=(shardings, shardings, batch, batch), out_shardings=NamedSharding(mesh, P()))
    def jitted(model: MLP, optimizer: nnx.Optimizer[MLP], x: Array, y: Array) -> Array:
        loss, grads = nnx.value_and_grad(expert_loss)(model, x, y)
        optimizer.update(model, grads)
        return loss

    def step(model: MLP, optimizer: nnx.Optimizer[MLP], x: Array, y: Array) -> Array:
        with jax.set_mesh(mesh):
            return jitted(model, optimizer, x, y)

    return step
