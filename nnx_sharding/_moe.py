"""`MoE`, a mixture-of-experts SwiGLU layer for NNX, and `moe`, the same as a function of
its weights: a softmax top-k router, experts stored as one stacked weight per matrix,
optional shared experts, the router's load-balancing loss returned beside the output.

Two ways to send tokens to their experts, chosen by ``capacity_factor``:

- **Dropping** (a number): each expert takes at most ``capacity`` tokens of each
  sequence (`capacity`, MaxText's size), first come first served in token order (a
  token's k choices in rank order, as MaxText fills them); the rest of its assignments
  are dropped (weight 0, the kept ones not rescaled; the token keeps its residual).
  Tokens are dispatched with one-hot einsums (GShard's, MaxText's "dropping" path).
  Under a mesh with an ``expert`` axis the dispatched tokens are constrained to the
  experts' split: the compiler turns that resharding into an all-to-all from the batch's
  devices to the experts' and one back (per layer, forward; more backward). Expert
  parallelism by sharding constraints, not a hand-written ``shard_map``: the capacity
  makes every buffer's size static, so the compiler's all-to-all is the one a
  hand-written dispatch would issue, and FSDP's and tensor parallelism's axes compose
  with it without manual collectives.
- **Dropless** (``None``): every assignment computed. The assignments are sorted by
  expert and run as grouped matmuls (``jax.lax.ragged_dot``: Pallas's megablox on TPUs),
  each device on its own tokens (``jax.shard_map`` over the batch's axes), the experts'
  weights gathered to it as FSDP gathers them (split over ``model`` inside, where the
  mesh has that axis). Dispatching dropless tokens to the devices that hold their
  experts takes ``jax.lax.ragged_all_to_all``, which XLA's CPU backend cannot run, so
  that path could not be held exact against one device here; dropless under an
  ``expert`` axis splits the experts' storage over it and gathers them to compute. With
  ``grouped='dense'`` each token goes through every expert, weighted by its routing
  (zero for the experts it did not choose): ``experts / k`` times the FLOPs, for a
  target where ``ragged_dot`` does not compile.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from . import _errors

EXPERT = "expert"
"""The mesh axis `MoE` splits its experts over."""
BATCH_AXES = ("data", "fsdp", EXPERT)
"""The mesh axes a batch of tokens is split over (where the mesh has them)."""
NAMES = {
    "router": ("embed", None),
    "gate": ("experts", "embed", "expert_mlp"),
    "up": ("experts", "embed", "expert_mlp"),
    "down": ("experts", "expert_mlp", "embed"),
    "shared_gate": ("embed", "mlp"),
    "shared_up": ("embed", "mlp"),
    "shared_down": ("mlp", "embed"),
}
"""The weights' logical axis names (sharding metadata, as ``nnx.with_partitioning``
gives it)."""
RULES = (("experts", EXPERT), ("embed", None), ("expert_mlp", None), ("mlp", None))
"""Logical names to mesh axes for `nnx_sharding.shard`: the experts over ``expert``, the
rest replicated (map ``embed`` to ``'fsdp'`` for FSDP, ``expert_mlp`` and ``mlp`` to
``'model'`` for tensor parallelism)."""


def capacity(seq: int, experts: int, k: int, capacity_factor: float) -> int:
    """Tokens of one sequence each expert takes on the dropping path, as MaxText sizes
    it: ``int(max(ceil(k · seq / experts) · capacity_factor, capacity_factor))``.

    >>> capacity(seq=4096, experts=8, k=2, capacity_factor=1.25)
    1280
    """
    return int(max(math.ceil(k * seq / experts) * capacity_factor, capacity_factor))


def route(
    x: jax.Array, router: jax.Array, k: int, *, renormalize: bool = True
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(weights, experts, loss)``: each token's top-``k`` experts (batch, seq, k), their
    routing weights (float32 softmax probabilities, renormalised over the k when
    ``renormalize``: Mixtral and Qwen3 do, Switch does not) and the load-balancing loss.

    The loss is MaxText's (Switch's, counting all k choices): per sequence,
    ``experts · Σ_e f_e · p_e``, ``f_e`` the fraction of tokens that chose expert e,
    ``p_e`` its mean probability, averaged over the sequences; ``k`` when routing is
    uniform. Scale it by your loss weight (MaxText's default is 0.01).

    >>> w, e, loss = route(jnp.ones((1, 3, 4)), jnp.zeros((4, 8)), 2)
    >>> w.shape, e.shape, float(loss)
    ((1, 3, 2), (1, 3, 2), 2.0)
    """
    logits = jnp.einsum("bsd,de->bse", x, router.astype(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    chosen = jnp.sum(jax.nn.one_hot(experts, probs.shape[-1], dtype=jnp.float32), axis=2)
    density = jnp.mean(chosen, axis=1)  # (batch, experts): sums to k over experts
    loss = probs.shape[-1] * jnp.mean(jnp.sum(density * jnp.mean(probs, axis=1), axis=-1))
    return weights, experts, loss


def moe(
    x: jax.Array,
    weights: dict[str, jax.Array],
    k: int,
    *,
    capacity_factor: float | None = None,
    renormalize: bool = True,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    grouped: str = "ragged",
) -> tuple[jax.Array, jax.Array]:
    """``(y, loss)``: the mixture-of-experts SwiGLU of ``x`` (batch, seq, d_model) and
    the router's load-balancing loss (`route`).

    ``x`` is ``(batch, seq, d_model)``: the capacity and the load-balancing loss are per
    sequence. ``weights``: ``router`` (d, E), ``gate`` and ``up`` (E, d, f), ``down`` (E, f, d),
    and optionally the shared experts' ``shared_gate``, ``shared_up`` (d, F) and
    ``shared_down`` (F, d), whose SwiGLU every token goes through. The experts compute
    in ``x``'s dtype. See the module's docstring for ``capacity_factor`` (dropping, or
    None: dropless) and ``grouped``.

    >>> w = {'router': jnp.zeros((4, 2)), 'gate': jnp.ones((2, 4, 3)),
    ...      'up': jnp.ones((2, 4, 3)), 'down': jnp.ones((2, 3, 4))}
    >>> y, loss = moe(jnp.ones((1, 5, 4)), w, 1)
    >>> y.shape, float(loss)
    ((1, 5, 4), 1.0)
    """
    _check(x, weights, k, capacity_factor, grouped)
    if capacity_factor is not None:
        run = functools.partial(_dropping, capacity_factor=capacity_factor, act=activation)
    elif grouped == "dense":
        run = functools.partial(_dense, act=activation)
    else:
        run = functools.partial(_dropless, act=activation)

    def body(x: jax.Array, weights: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        probs, chosen, loss = route(x, weights["router"], k, renormalize=renormalize)
        w = {n: a.astype(x.dtype) for n, a in weights.items()}
        y = run(x, w, probs, chosen)
        if "shared_gate" in w:
            h = activation(x @ w["shared_gate"]) * (x @ w["shared_up"])
            y = y + h @ w["shared_down"]
        return y, loss

    return _auto_axes(body, x)(x, weights)


def check_options(
    experts: int,
    k: object,
    capacity_factor: object,
    grouped: object = "ragged",
    seq: int | None = None,
    owner: tuple[str, str] = ("MoE", "k"),
) -> None:
    """Raises the message of the first option a layer of ``experts`` cannot take: ``k``
    outside ``1..experts``, an unknown ``grouped``, a capacity factor that is not
    positive or (given ``seq``) leaves each expert no token. ``owner``: who takes them,
    and its name for ``k`` (`DecoderConfig`'s is ``experts_per_token``).

    >>> check_options(8, 9, None)
    Traceback (most recent call last):
    ValueError: MoE: k: 9 experts per token, with 8 experts
    ...
    """
    transform, argument = owner
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= experts:
        raise ValueError(_errors.moe_bad_k(k, experts, transform, argument))
    if grouped not in ("ragged", "dense"):
        raise ValueError(_errors.moe_bad_grouped(grouped))
    cf = capacity_factor
    if cf is None:
        return
    bad = not isinstance(cf, (int, float)) or isinstance(cf, bool) or cf <= 0
    if bad or (seq is not None and capacity(seq, experts, k, cf) < 1):  # type: ignore[arg-type]
        raise ValueError(_errors.moe_bad_capacity(cf, seq, experts, k, transform))


def _check(
    x: jax.Array, weights: dict[str, jax.Array], k: int, cf: float | None, grouped: str
) -> None:
    experts = weights["gate"].shape[0]
    if x.ndim != 3 or x.shape[-1] != weights["gate"].shape[1]:
        raise ValueError(_errors.moe_bad_input(x.shape, weights["gate"].shape[1]))
    check_options(experts, k, cf, grouped, seq=x.shape[1])
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    if experts % sizes.get(EXPERT, 1):
        raise ValueError(_errors.moe_experts_indivisible(experts, sizes[EXPERT]))


def _auto_axes(run: Callable[..., Any], x: jax.Array) -> Callable[..., Any]:
    """``run`` with the mesh's explicit axes handed to the compiler (sharding constraints
    and ``shard_map`` need them so): ``y`` keeps ``x``'s sharding, the loss replicated."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return run
    explicit = tuple(
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    )
    if not explicit:
        return run
    spec = jax.typeof(x).sharding.spec
    return jax.sharding.auto_axes(run, axes=explicit, out_sharding=(spec, P()))


def _axes(names: tuple[str, ...], size: int) -> tuple[str, ...]:
    """Those of the mesh axes ``names`` (size > 1) that together divide ``size``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    out: list[str] = []
    for a in names:
        if sizes.get(a, 1) > 1 and size % math.prod(sizes[b] for b in [*out, a]) == 0:
            out.append(a)
    return tuple(out)


def _constrain(x: jax.Array, *entries: tuple[str, ...]) -> jax.Array:
    if jax.sharding.get_abstract_mesh().empty or not any(entries):
        return x
    spec = P(*(None if not e else e[0] if len(e) == 1 else e for e in entries))
    return jax.lax.with_sharding_constraint(x, spec)


def _dropping(x, w, probs, chosen, *, capacity_factor: float, act: Callable) -> jax.Array:
    """GShard's dispatch: per sequence, each expert's first ``capacity`` assignments."""
    b, s, _ = x.shape
    experts, k = w["gate"].shape[0], chosen.shape[-1]
    c = capacity(s, experts, k, capacity_factor)
    onehot = jax.nn.one_hot(chosen, experts, dtype=jnp.int32)  # (b, s, k, e)
    # each assignment's place in its expert's queue: token order, a token's k in rank order
    place = jnp.cumsum(onehot.reshape(b, s * k, experts), axis=1).reshape(onehot.shape)
    # a token takes an expert at most once: its place there (0: not chosen) and weight
    place = jnp.sum(place * onehot, axis=2)  # (b, s, e)
    weight = jnp.sum(onehot * probs[..., None], axis=2).astype(x.dtype)
    dispatch = jax.nn.one_hot(jnp.where(place <= c, place, 0) - 1, c, dtype=x.dtype)
    combine = dispatch * weight[..., None]  # (b, s, e, c); one_hot(-1) is all zeros
    batch = _axes(BATCH_AXES, b)
    inner = tuple(a for a in batch if a != EXPERT)
    ep = _axes((EXPERT,), experts)
    model = _axes(("model",), w["gate"].shape[-1])
    tokens = _constrain(jnp.einsum("bsec,bsd->ebcd", dispatch, x), (), batch)  # local
    tokens = _constrain(tokens, ep, inner)  # batch's devices -> experts': an all-to-all
    h = act(jnp.einsum("ebcd,edf->ebcf", tokens, w["gate"]))
    h = _constrain(h * jnp.einsum("ebcd,edf->ebcf", tokens, w["up"]), ep, inner, (), model)
    out = _constrain(jnp.einsum("ebcf,efd->ebcd", h, w["down"]), ep, inner)
    out = _constrain(out, (), batch)  # and back: the second all-to-all
    return jnp.einsum("ebcd,bsec->bsd", out, combine)


def _dense(x, w, probs, chosen, *, act: Callable) -> jax.Array:
    """Every token through every expert, weighted by its routing (0 where not chosen)."""
    experts = w["gate"].shape[0]
    gates = jnp.sum(jax.nn.one_hot(chosen, experts, dtype=probs.dtype) * probs[..., None], 2)
    h = act(jnp.einsum("bsd,edf->bsef", x, w["gate"])) * jnp.einsum("bsd,edf->bsef", x, w["up"])
    h = h * gates.astype(x.dtype)[..., None]
    return jnp.einsum("bsef,efd->bsd", h, w["down"])


def _grouped(x, w, probs, chosen, act: Callable) -> jax.Array:
    """One device's tokens: assignments sorted by expert, grouped matmuls, unsorted."""
    b, s, d = x.shape
    experts, k = w["gate"].shape[0], chosen.shape[-1]
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignment order within an expert: token order
    rows = x.reshape(b * s, d)[order // k]
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    h = act(jax.lax.ragged_dot(rows, w["gate"], sizes)) * jax.lax.ragged_dot(rows, w["up"], sizes)
    out = jax.lax.ragged_dot(h, w["down"], sizes)
    out = jnp.zeros_like(out).at[order].set(out).reshape(b, s, k, d)
    return jnp.einsum("bskd,bsk->bsd", out, probs.astype(x.dtype))


def _dropless(x, w, probs, chosen, *, act: Callable) -> jax.Array:
    """`_grouped` on each device's tokens: a ``shard_map`` over the batch's axes, the
    experts gathered to every device (their ``expert_mlp`` split over ``model``)."""
    mesh = jax.sharding.get_abstract_mesh()
    batch = _axes(BATCH_AXES, x.shape[0])
    model = _axes(("model",), w["gate"].shape[-1])
    if mesh.empty or not (batch or model):
        return _grouped(x, w, probs, chosen, act)
    data = P(batch if batch else None)
    specs = {
        n: P(None, None, *model) if n in ("gate", "up") else P(None, *model) if n == "down"
        else P()
        for n in w
    }  # fmt: skip

    def local(x, w, probs, chosen):
        y = _grouped(x, w, probs, chosen, act)
        return jax.lax.psum(y, model) if model else y

    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(data, specs, data, data), out_specs=data, check_vma=False
    )
    return mapped(x, w, probs, chosen)


class MoE(nnx.Module):
    """A mixture-of-experts SwiGLU layer: ``y, loss = layer(x)`` (`moe`).

    Args:
      d_model: the width of ``x``.
      experts: how many experts; their weights are ``gate``, ``up`` (experts, d_model,
        mlp) and ``down`` (experts, mlp, d_model), logical axes ``('experts', 'embed',
        'expert_mlp')``: ``experts`` goes over the ``expert`` mesh axis.
      k: experts per token.
      mlp: each expert's hidden width.
      shared: shared experts (every token goes through them, DeepSeek's and Qwen2's),
        as one SwiGLU ``shared × mlp`` wide; 0 for none.
      capacity_factor: None for dropless, else the dropping path's factor (MaxText's
        ``capacity_factor``; 1.25 is common).
      renormalize: the top-k weights renormalised to sum to 1 (Mixtral, Qwen3).
      grouped: ``'ragged'`` (grouped matmuls) or ``'dense'`` (every expert on every
        token, weighted), for dropless.
      param_dtype: the weights' dtype.
      rngs: for the weights' initialisation.

    >>> layer = MoE(8, experts=4, k=2, mlp=16, rngs=nnx.Rngs(0))
    >>> y, loss = layer(jnp.ones((2, 3, 8)))
    >>> y.shape, loss.shape
    ((2, 3, 8), ())
    """

    def __init__(
        self,
        d_model: int,
        *,
        experts: int,
        k: int,
        mlp: int,
        shared: int = 0,
        capacity_factor: float | None = None,
        renormalize: bool = True,
        grouped: str = "ragged",
        activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        check_options(experts, k, capacity_factor, grouped)
        self.experts, self.k = experts, k
        self.capacity_factor, self.renormalize = capacity_factor, renormalize
        self.grouped, self.activation = grouped, activation
        # the names are metadata only: `nnx_sharding.shard(layer, mesh, rules=RULES)`
        # places the weights, whatever mesh is in context now
        with nnx.use_eager_sharding(False):
            for name, shape in moe_shapes(d_model, experts, mlp, shared).items():
                init = nnx.with_partitioning(nnx.initializers.normal(0.02), NAMES[name])
                setattr(self, name, nnx.Param(init(rngs.params(), shape, param_dtype)))

    RULES = RULES
    """`nnx_sharding.shard`'s default rules for the weights' logical names (`RULES`)."""

    def capacity(self, seq: int) -> int | None:
        """Tokens of a ``seq``-long sequence each expert takes (`capacity`); None when
        dropless.

        >>> MoE(8, experts=4, k=2, mlp=16, capacity_factor=1.25, rngs=nnx.Rngs(0)).capacity(64)
        40
        """
        if self.capacity_factor is None:
            return None
        return capacity(seq, self.experts, self.k, self.capacity_factor)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        weights = {n: p[...] for n, p in vars(self).items() if isinstance(p, nnx.Param)}
        return moe(
            x, weights, self.k, capacity_factor=self.capacity_factor,
            renormalize=self.renormalize, activation=self.activation, grouped=self.grouped,
        )  # fmt: skip


def moe_shapes(d: int, experts: int, mlp: int, shared: int = 0) -> dict[str, tuple[int, ...]]:
    """The MoE layer's weights and their shapes (see `MoE`).

    >>> moe_shapes(8, 4, 16)['gate']
    (4, 8, 16)
    """
    shapes = {"router": (d, experts), "gate": (experts, d, mlp), "up": (experts, d, mlp)}
    shapes["down"] = (experts, mlp, d)
    if shared:
        shapes |= {"shared_gate": (d, shared * mlp), "shared_up": (d, shared * mlp)}
        shapes["shared_down"] = (shared * mlp, d)
    return shapes
