"""`pipeline`: a stack of NNX layers run as a pipeline over a mesh axis, each stage on its
own devices, microbatches passed from stage to stage with ``jax.lax.ppermute``.

The schedule is one loop of ``microbatches · repeats + stages - 1`` steps under
``jax.shard_map`` (manual over the stage axis alone, so that the other axes of the mesh,
FSDP's and tensor parallelism's, stay the compiler's inside each stage). At step ``t``
stage ``s`` runs its layers of repeat ``(t - s) // microbatches`` on microbatch
``(t - s) % microbatches``, then every stage sends its result to the next, the last to
the first. With ``repeats=1`` that is GPipe; with ``repeats > 1`` it is the circular
schedule (MaxText's): each stage holds ``repeats`` groups of layers, one per round, and
the first stage keeps what comes back from the last until that microbatch's next round.
The backward pass is autodiff's: the loop reversed, each ``ppermute`` sent back.

Without the axis on the mesh (or with it of size 1) the stack runs as ``jax.lax.scan``
over its layers: the same result, with no stages.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh
from jax.sharding import PartitionSpec as P

from . import _errors

X = TypeVar("X")
STAGE = "stage"
"""The mesh axis `pipeline` runs its stages over unless told another."""


@dataclasses.dataclass(frozen=True)
class _Default:
    """`pipeline`'s ``axis`` when not given: ``'stage'`` where the mesh has it."""

    name: str = STAGE


def pipeline(
    f: Callable[[Any, X], X],
    *,
    microbatches: int,
    repeats: int = 1,
    axis: str = _Default(),  # type: ignore[assignment]
    mesh: Mesh | AbstractMesh | None = None,
) -> Callable[[nnx.Module, X], X]:
    """``run(layers, x)``: ``f(layer, x) -> x`` applied layer after layer over the stack
    ``layers``, as a pipeline over the mesh axis ``axis``.

    ``layers`` is a graph node whose Variables carry a leading layer dimension (as
    ``nnx.vmap`` builds them and ``nnx.scan`` runs them); ``x`` an array, or a pytree
    of arrays, whose leading dimension is the batch. The stack is split into
    ``stages`` (the axis's size) × ``repeats`` groups of consecutive layers; stage ``s``
    runs groups ``s, s + stages, ...`` (the layers are placed so, whatever their
    sharding). The batch is split into ``microbatches``, each microbatch taking every
    ``stages``-th example so that a batch sharded over data axes stays sharded.
    The result, and its gradients, equal ``jax.lax.scan`` (``nnx.scan``) over the
    layers. On a mesh without the axis (the default ``'stage'`` absent, or of size 1)
    the stack runs as that scan.

    Args:
      f: ``f(layer, x) -> x`` for one layer (a module of the stack's type without the
        layer dimension); it may be ``nnx.remat``-ed, and must not write to the layer.
      microbatches: how many microbatches the batch is split into, at least the stages:
        the bubble, the share of a step each stage idles, is ``(stages - 1) /
        (microbatches · repeats + stages - 1)``.
      repeats: how many rounds each microbatch makes through the stages (1: GPipe;
        more: the circular schedule, whose bubble is ``repeats`` times smaller).
      axis: the mesh axis of the stages (default ``'stage'``, where the mesh has one).
      mesh: the mesh (default: the one `jax.set_mesh` set).

    Returns:
      ``run(layers, x) -> x``.

    Raises:
      ValueError: (when ``run`` is called) layers not divisible by ``stages × repeats``,
        a batch not divisible by ``microbatches``, ``microbatches < stages``, an
        ``axis`` given that the mesh lacks, an ``f`` that writes to its layer or
        changes ``x``'s shapes.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> @nnx.split_rngs(splits=8)
    ... @nnx.vmap
    ... def stack(rngs):
    ...     return nnx.Linear(4, 4, rngs=rngs)
    >>> layers = stack(nnx.Rngs(0))
    >>> run = pipeline(lambda layer, x: jnp.tanh(layer(x)), microbatches=4)
    >>> run(layers, jnp.ones((8, 4))).shape  # no 'stage' axis here: the scan
    (8, 4)
    """
    explicit = not isinstance(axis, _Default)
    name = axis if explicit else STAGE

    def run(layers: nnx.Module, x: X) -> X:
        graphdef, state = nnx.split(layers)
        leaves = jax.tree.leaves(state)
        count = _layer_count(leaves)
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), state)
        _check_f(f, graphdef, one, _microbatch_like(x, microbatches))
        found = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
        axes = tuple(found.shape)
        if name not in axes and explicit and axes:
            raise ValueError(_errors.pipeline_no_axis(name, axes))
        stages = stage_count(name, found)
        if stages == 1:  # no such axis, or of size 1
            return _scan(f, graphdef, state, x)
        if count % (stages * repeats):
            raise ValueError(_errors.pipeline_layers_indivisible(count, stages, repeats, name))
        if microbatches < stages:
            raise ValueError(_errors.pipeline_too_few_microbatches(microbatches, stages, repeats))
        explicit_axes = tuple(
            a for a, t in zip(axes, found.axis_types, strict=True) if t == AxisType.Explicit
        )
        body = functools.partial(
            _pipelined, f, graphdef, mesh=found, axis=name, stages=stages,
            microbatches=microbatches, repeats=repeats,
        )  # fmt: skip
        if not explicit_axes:
            return body(state, x)
        # reshapes of arrays sharded by type need their output shardings spelled out:
        # with the axes the compiler's, x keeps the sharding it came with
        shardings = jax.tree.map(lambda a: jax.typeof(a).sharding.spec, x)
        auto = jax.sharding.auto_axes(body, axes=explicit_axes, out_sharding=shardings)
        return cast(Callable[..., X], auto)(state, x)

    return run


def stage_count(axis: str = STAGE, mesh: Mesh | AbstractMesh | None = None) -> int:
    """The size of ``axis`` on ``mesh`` (default: the mesh `jax.set_mesh` set); 1
    without it: how many stages `pipeline` would run."""
    found = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    return int(found.shape.get(axis, 1))


def _layer_count(leaves: list[Any]) -> int:
    """The stack's one leading dimension (the number of layers)."""
    if not leaves:
        raise ValueError(_errors.pipeline_bad_stack("it holds no arrays"))
    dims = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
    if None in dims or len(dims) != 1:
        shown = sorted(str(d) for d in dims)
        raise ValueError(
            _errors.pipeline_bad_stack(f"its arrays' leading dimensions differ: {shown}")
        )
    return int(dims.pop())  # type: ignore[arg-type]


def _microbatch_like(x: Any, microbatches: int) -> Any:
    """One microbatch of ``x`` as shapes (checks that ``microbatches`` divides it)."""

    def one(a: Any) -> jax.ShapeDtypeStruct:
        batch = jnp.shape(a)[0] if jnp.ndim(a) else 0
        if batch % microbatches or batch == 0:
            raise ValueError(_errors.pipeline_microbatches_indivisible(batch, microbatches))
        return jax.ShapeDtypeStruct((batch // microbatches, *jnp.shape(a)[1:]), jnp.result_type(a))

    return jax.tree.map(one, x)


def _apply(f: Callable[[Any, X], X], graphdef: Any, layer_state: Any, x: X) -> X:
    """``f`` on one layer (`_check_f` has made sure it does not write to it)."""
    return f(nnx.merge(graphdef, layer_state), x)


def _check_f(f: Callable[[Any, X], X], graphdef: Any, one: Any, x: Any) -> None:
    """``f`` traced once on one layer and one microbatch: it keeps x's shapes and leaves
    the layer's Variables as it found them. A Variable a transform of flax's wrote back
    unchanged (``nnx.remat`` does) is left as found: the program passes it through."""

    def probe(s: Any, x: Any) -> Any:
        layer = nnx.merge(graphdef, s)
        y = f(layer, x)
        return y, jax.tree.leaves(nnx.state(layer))

    closed, (out, after) = jax.make_jaxpr(probe, return_shape=True)(one, x)
    if jax.tree.structure(out) != jax.tree.structure(x) or any(
        (a.shape, a.dtype) != (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(x), strict=True)
    ):
        raise ValueError(_errors.pipeline_changes_shape(_shapes(x), _shapes(out)))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(one)[0]]
    if len(after) != len(paths):
        raise ValueError(_errors.pipeline_mutates_stack(["(Variables added or removed)"]))
    sources = _forwarded(closed.jaxpr)[len(jax.tree.leaves(out)) :]
    written = [p for i, (p, source) in enumerate(zip(paths, sources, strict=True)) if source != i]
    if written:
        raise ValueError(_errors.pipeline_mutates_stack(written))


def _forwarded(jaxpr: Any) -> list[int | None]:
    """For each output of ``jaxpr``, the input it passes through unchanged (through the
    jaxprs of calls, ``jax.checkpoint`` and the like), else None."""
    source: dict[Any, int] = {v: i for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        for inner in eqn.params.values():
            inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
            if not (hasattr(inner, "eqns") and hasattr(inner, "invars")):
                continue
            if (len(inner.invars), len(inner.outvars)) != (len(eqn.invars), len(eqn.outvars)):
                continue
            for out, through in zip(eqn.outvars, _forwarded(inner), strict=True):
                given = eqn.invars[through] if through is not None else None
                if given is not None and not hasattr(given, "val") and given in source:
                    source[out] = source[given]
    return [
        None if hasattr(v, "val") else source.get(v)  # a literal is no input
        for v in jaxpr.outvars
    ]


def _shapes(tree: Any) -> str:
    shown = jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree)
    return str(shown)


def _scan(f: Callable[[Any, X], X], graphdef: Any, state: Any, x: X) -> X:
    """The stack without stages: one layer after the other."""
    y, _ = jax.lax.scan(lambda x, s: (_apply(f, graphdef, s, x), None), x, state)
    return y


def _pipelined(
    f: Callable[[Any, X], X],
    graphdef: Any,
    state: Any,
    x: X,
    *,
    mesh: Mesh | AbstractMesh,
    axis: str,
    stages: int,
    microbatches: int,
    repeats: int,
) -> X:
    """The stack as a pipeline over ``axis`` (see the module's docstring)."""
    per = jax.tree.leaves(state)[0].shape[0] // (stages * repeats)

    def place(a: jax.Array) -> jax.Array:
        """Layers in stage order: stage s holds groups s, s + stages, ... contiguously."""
        if repeats == 1:
            return a
        grouped = a.reshape(repeats, stages, per, *a.shape[1:])
        return grouped.swapaxes(0, 1).reshape(a.shape)

    def split(a: jax.Array) -> jax.Array:
        """(batch, ...) -> (microbatches, batch / microbatches, ...), example i in
        microbatch i % microbatches."""
        return a.reshape(a.shape[0] // microbatches, microbatches, *a.shape[1:]).swapaxes(0, 1)

    def join(a: jax.Array) -> jax.Array:
        return a.swapaxes(0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])

    placed = jax.tree.map(place, state)
    xs = jax.tree.map(split, x)
    ring = [(i, (i + 1) % stages) for i in range(stages)]
    steps = microbatches * repeats + stages - 1

    def stage(local: Any, given_xs: Any) -> Any:
        s = jax.lax.axis_index(axis)
        xs = jax.tree.map(lambda a: a[0], given_xs)  # stage 0's microbatches, else zeros
        groups = jax.tree.map(lambda a: a.reshape(repeats, per, *a.shape[1:]), local)
        zero = jax.tree.map(lambda a: jnp.zeros_like(a[0]), xs)

        def take(tree: Any, i: Any) -> Any:
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)

        def put(tree: Any, i: Any, value: Any, when: Any) -> Any:
            """``tree[i] = value`` where ``when``: one microbatch's slice written (in
            place), never the whole buffer selected."""

            def one(a: jax.Array, v: jax.Array) -> jax.Array:
                kept = jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
                return jax.lax.dynamic_update_index_in_dim(a, jnp.where(when, v, kept), i, 0)

            return jax.tree.map(one, tree, value)

        def pick(when: Any, a: Any, b: Any) -> Any:
            return jax.tree.map(lambda u, v: jnp.where(when, u, v), a, b)

        def tick(carry: Any, t: Any) -> Any:
            # what is read at a traced index rides in the carry: a constant's cotangent
            # would be a whole buffer added at every tick, a carry's is one slice
            held, waiting, out, xs, groups = carry
            came = jax.tree.map(lambda a: jax.lax.ppermute(a, axis, ring), held)
            first = take(xs, t % microbatches)
            if repeats > 1:  # the first stage keeps a microbatch from the last for its round
                back = t - stages
                waiting = put(waiting, back % microbatches, came, (s == 0) & (back >= 0))
                first = pick(t < microbatches, first, take(waiting, t % microbatches))
            mine = t - s  # this stage's work item: microbatch mine % M, round mine // M
            active = (mine >= 0) & (mine < microbatches * repeats)
            given = pick(active, pick(s == 0, first, came), zero)
            if repeats > 1:
                layers = take(groups, jnp.clip(mine // microbatches, 0, repeats - 1))
            else:
                layers = jax.tree.map(lambda a: a[0], groups)
            done = _scan(f, graphdef, layers, given)
            last = (s == stages - 1) & active & (mine >= (repeats - 1) * microbatches)
            out = put(out, mine % microbatches, done, last)
            return (done, waiting, out, xs, groups), None

        waiting = jax.tree.map(jnp.zeros_like, xs) if repeats > 1 else ()
        start = (zero, waiting, jax.tree.map(jnp.zeros_like, xs), xs, groups)
        (_, _, out, _, _), _ = jax.lax.scan(tick, start, jnp.arange(steps))
        return jax.tree.map(lambda a: a[None], out)  # one row per stage

    context = jax.sharding.get_abstract_mesh()  # under auto_axes: the same axes, all Auto
    same = tuple(context.shape) == tuple(mesh.shape)
    mapped = jax.shard_map(
        stage,
        mesh=context if same else mesh,
        in_specs=(jax.tree.map(lambda _: P(axis), placed), jax.tree.map(lambda _: P(axis), xs)),
        out_specs=jax.tree.map(lambda _: P(axis), xs),
        axis_names={axis},
        check_vma=False,
    )
    # the inputs go to the first stage alone, the outputs come from the last alone: no
    # collective sums over the stages (whose backward would be one, of x's dtype)
    given = jax.tree.map(lambda a: jnp.zeros((stages, *a.shape), a.dtype).at[0].set(a), xs)
    # under jit (inlined when traced already): shard_map over some axes runs only so
    return jax.tree.map(lambda a: join(a[-1]), jax.jit(mapped)(placed, given))
