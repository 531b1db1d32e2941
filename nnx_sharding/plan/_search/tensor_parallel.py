"""Megatron-style tensor-parallel shardings found from a step's jaxpr, for models without
sharding metadata.

The step is traced with abstract inputs; every dimension of every value in its jaxpr
becomes a node of a union-find, and the operations join the dimensions that must be
sharded alike (an elementwise op joins its operands' dimensions with its result's, a
``dot_general`` joins the two contracted dimensions, a reshape joins a merged dimension
with the major part it splits into, ...). Each resulting class of dimensions is a
candidate for the ``model`` axis. A class is sharded when:

1. a weight's free dimension is in it (the weight is *column-parallel*: its matmul's
   output is sharded along the class) and another weight's contracted dimension is in it
   (*row-parallel*: its matmul sums partial products, one all-reduce of activations);
2. nothing else needs the whole dimension: no reduction over it (other than to a
   scalar, such as a loss or a gradient norm), no contraction of it between two
   activations (attention's head dimension), no gather, slice, sort, concatenation,
   scan over it, or an operation this analysis does not know;
3. no weight has two of its dimensions in it.

Classes are taken in the order of their first column-parallel matmul, each only when its
weights are still free, so a block's weights pair once (column, then row) and a weight
never has two dimensions on the axis. Biases and optimizer state follow their weights
through the elementwise operations; embeddings, norms and weights without a partner stay
replicated.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from ..._nodes import Path, is_array, is_node

__all__ = ["tensor_parallel_specs"]

DimKey = tuple[Any, int]  # (a jaxpr variable at a call site, a dimension)

# Operations whose result is their operand with a new layout: a weight stays a weight.
_LAYOUT_OPS = {
    "convert_element_type",
    "copy",
    "copy_p",
    "transpose",
    "reshape",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "sharding_constraint",
    "reduce_precision",
    "optimization_barrier",
    "stop_gradient",
}
_REDUCTIONS = {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "argmax",
    "argmin",
}
_AXIS_OPS = {  # ops that need the whole of one dimension (param "axis" or "dimension")
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
    "sort",
    "concatenate",
    "split",
}


class _Analysis:
    def __init__(self) -> None:
        self.parent: dict[DimKey, DimKey] = {}
        self.conflict: set[DimKey] = set()  # representatives are resolved at the end
        self.col: dict[DimKey, int] = {}  # dim -> first position it was column-parallel
        self.row: set[DimKey] = set()
        self.weights: set[Any] = set()  # vars that are (views of) weights
        self.position = itertools.count()
        self.scopes = itertools.count(1)

    # --- union-find over (var, dim)
    def find(self, key: DimKey) -> DimKey:
        parent = self.parent.setdefault(key, key)
        if parent == key:
            return key
        root = self.find(parent)
        self.parent[key] = root
        return root

    def union(self, a: Any, i: int, b: Any, j: int) -> None:
        if not _is_var(a) or not _is_var(b):
            return
        ra, rb = self.find((a, i)), self.find((b, j))
        if ra != rb:
            self.parent[ra] = rb

    def bad(self, var: Any, dims: Sequence[int] | None = None) -> None:
        if not _is_var(var):
            return
        for d in range(_ndim(var)) if dims is None else dims:
            if _shape(var)[d] > 1:
                self.conflict.add((var, d))

    def same_dims(self, a: Any, b: Any) -> None:
        """Joins dimension i of ``a`` with dimension i of ``b`` where both have it."""
        if _is_var(a) and _is_var(b) and _ndim(a) == _ndim(b):
            for d, (x, y) in enumerate(zip(_shape(a), _shape(b), strict=True)):
                if x == y:
                    self.union(a, d, b, d)

    # --- the walk
    def walk(self, jaxpr: jcore.Jaxpr, scope: int) -> None:
        for eqn in jaxpr.eqns:
            ins = [_ref(scope, x) for x in eqn.invars]
            outs = [_ref(scope, x) for x in eqn.outvars]
            self.equation(eqn, ins, outs)

    def call(self, jaxpr: jcore.Jaxpr, ins: Sequence[Any], outs: Sequence[Any]) -> None:
        """Walks a sub-jaxpr for one call site: its values are this call's own (a jaxpr
        called twice, such as a cached ``jit``, must not join its two callers)."""
        scope = next(self.scopes)
        self.bind(ins, [_ref(scope, x) for x in jaxpr.invars])
        self.walk(jaxpr, scope)
        self.bind(outs, [_ref(scope, x) for x in jaxpr.outvars])

    def bind(self, outer: Sequence[Any], inner: Sequence[Any]) -> None:
        for o, i in zip(outer, inner, strict=True):
            self.same_dims(o, i)
            if _is_var(o) and _is_var(i) and o in self.weights:
                self.weights.add(i)

    def equation(self, eqn: Any, ins: list[Any], outs: list[Any]) -> None:
        name, params = eqn.primitive.name, eqn.params
        if not outs:
            return
        if name == "dot_general":
            self.dot(params, ins, outs)
        elif name in _REDUCTIONS:
            axes = params.get("axes", ())
            (out,) = outs[:1]
            if _ndim(out) > 0:  # a reduction to a scalar (a loss, a norm) is cheap
                self.bad(ins[0], axes)
            kept = [d for d in range(_ndim(ins[0])) if d not in axes]
            for o, d in enumerate(kept):
                for x in outs:
                    self.union(ins[0], d, x, o)
        elif name == "broadcast_in_dim":
            (x,), (out,) = ins[:1], outs
            for i, d in enumerate(params["broadcast_dimensions"]):
                if _is_var(x) and _shape(x)[i] == _shape(out)[d]:
                    self.union(x, i, out, d)
            self.weight_view(ins[:1], outs)
        elif name == "transpose":
            for o, i in enumerate(params["permutation"]):
                self.union(ins[0], i, outs[0], o)
            self.weight_view(ins, outs)
        elif name == "reshape":
            self.reshape(ins[0], outs[0])
            self.weight_view(ins[:1], outs)
        elif name == "squeeze":
            kept = [d for d in range(_ndim(ins[0])) if d not in params["dimensions"]]
            for o, d in enumerate(kept):
                self.union(ins[0], d, outs[0], o)
            self.weight_view(ins, outs)
        elif name in _AXIS_OPS:
            axis = params.get("axis", params.get("dimension", 0))
            for x in ins:
                self.bad(x, [axis])
            for x in ins:
                for out in outs:
                    for d in range(min(_ndim(x), _ndim(out))):
                        if d != axis and _shape(x)[d] == _shape(out)[d]:
                            self.union(x, d, out, d)
        elif name in ("slice", "dynamic_slice", "pad", "rev", "dynamic_update_slice"):
            x, out = ins[0], outs[0]
            for d in range(_ndim(x)):
                if name == "rev" and d in params["dimensions"]:
                    self.bad(x, [d])
                elif _shape(x)[d] == _shape(out)[d] and not _padded(name, params, d):
                    self.union(x, d, out, d)
                else:
                    self.bad(x, [d])
            if name == "dynamic_update_slice":
                self.same_dims(ins[1], out)
                new, size = _shape(ins[1]), _shape(out)
                self.bad(ins[1], [d for d in range(len(size)) if new[d] != size[d]])
        elif name == "scan":
            self.scan(params, ins, outs)
        elif name == "while":
            self.loop(params, ins, outs)
        elif name == "cond":
            for branch in params["branches"]:
                self.call(branch.jaxpr, ins[1:], outs)
        elif (inner := _inner_jaxpr(eqn)) is not None:  # jit, remat, custom_jvp/vjp calls
            self.call(inner, ins, outs)
        elif all(_ndim(x) in (0, _ndim(outs[0])) for x in ins if _is_var(x)) and all(
            _shape(o) == _shape(outs[0]) for o in outs
        ):
            # elementwise: same-rank operands line up with the result (size-1 broadcasts aside)
            for x in ins:
                for out in outs:
                    self.same_dims(x, out)
            # A weight scaled, cast or combined with other weights is still a weight
            # (``w * scale``, a masked or merged kernel); one mixed with activations is not.
            if name in _LAYOUT_OPS or all(
                x in self.weights or _ndim(x) == 0 for x in ins if _is_var(x)
            ):
                self.weight_view(ins, outs)
        else:  # gather, scatter, fft, random, ...: this analysis does not follow it
            for x in ins:
                self.bad(x)
            if name.startswith("scatter"):  # the result is the operand, updated
                self.same_dims(ins[0], outs[0])

    def weight_view(self, ins: Sequence[Any], outs: Sequence[Any]) -> None:
        if any(_is_var(x) and x in self.weights for x in ins):
            self.weights.update(o for o in outs if _is_var(o))

    def dot(self, params: dict[str, Any], ins: list[Any], outs: list[Any]) -> None:
        lhs, rhs = ins
        (out,) = outs
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        here = next(self.position)
        lw, rw = lhs in self.weights, rhs in self.weights
        for i, j in zip(lc, rc, strict=True):
            self.union(lhs, i, rhs, j)
            if lw == rw:  # two activations (or two weights): the sum needs the whole dim
                self.bad(lhs, [i])
            else:
                self.row.add((lhs, i) if lw else (rhs, j))
        o = 0
        for i, j in zip(lb, rb, strict=True):
            self.union(lhs, i, rhs, j)
            self.union(lhs, i, out, o)
            o += 1
        for operand, contracted, batch, weight in ((lhs, lc, lb, lw), (rhs, rc, rb, rw)):
            for d in range(_ndim(operand)):
                if d in contracted or d in batch:
                    continue
                self.union(operand, d, out, o)
                if weight and not (lw and rw):
                    self.col.setdefault((operand, d), here)
                o += 1

    def reshape(self, x: Any, out: Any) -> None:
        """Joins each merged dimension with the major dimension it splits into (or back);
        the minor parts of a split or merge cannot carry the axis alone."""
        a, b = _shape(x), _shape(out)
        i = j = 0
        while i < len(a) or j < len(b):
            gi, gj = [i], [j]
            pa = a[i] if i < len(a) else 1
            pb = b[j] if j < len(b) else 1
            while pa != pb and i < len(a) and j < len(b):
                if pa < pb:
                    i += 1
                    gi.append(i)
                    pa *= a[i] if i < len(a) else 1
                else:
                    j += 1
                    gj.append(j)
                    pb *= b[j] if j < len(b) else 1
            gi = [d for d in gi if d < len(a) and a[d] > 1]
            gj = [d for d in gj if d < len(b) and b[d] > 1]
            if gi and gj:
                self.union(x, gi[0], out, gj[0])
                self.bad(x, gi[1:])
                for d in gj[1:]:
                    self.conflict.add((out, d))
            i += 1
            j += 1

    def scan(self, params: dict[str, Any], ins: list[Any], outs: list[Any]) -> None:
        jaxpr = params["jaxpr"].jaxpr
        nc, ncarry = params["num_consts"], params["num_carry"]
        scope = next(self.scopes)
        body_ins = [_ref(scope, x) for x in jaxpr.invars]
        body_outs = [_ref(scope, x) for x in jaxpr.outvars]
        self.bind(ins[: nc + ncarry], body_ins[: nc + ncarry])
        for x, inner in zip(ins[nc + ncarry :], body_ins[nc + ncarry :], strict=True):
            self.bad(x, [0])  # the scanned-over dimension stays whole
            for d in range(_ndim(inner)):
                self.union(x, d + 1, inner, d)
            if _is_var(x) and x in self.weights:
                self.weights.add(inner)
        self.walk(jaxpr, scope)
        self.bind(outs[:ncarry], body_outs[:ncarry])
        for c_in, c_out in zip(body_ins[nc : nc + ncarry], body_outs[:ncarry], strict=True):
            self.same_dims(c_in, c_out)
        for y, inner in zip(outs[ncarry:], body_outs[ncarry:], strict=True):
            self.bad(y, [0])
            for d in range(_ndim(inner)):
                self.union(y, d + 1, inner, d)

    def loop(self, params: dict[str, Any], ins: list[Any], outs: list[Any]) -> None:
        cond, body = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        carry = ins[cn + bn :]
        self.call(cond, ins[:cn] + carry, [None])
        self.call(body, ins[cn : cn + bn] + carry, outs)
        for c_in, c_out in zip(carry, outs, strict=True):
            self.same_dims(c_in, c_out)


def _padded(name: str, params: dict[str, Any], d: int) -> bool:
    if name != "pad":
        return False
    low, high, interior = params["padding_config"][d]
    return bool(low or high or interior)


def _inner_jaxpr(eqn: Any) -> jcore.Jaxpr | None:
    """The one sub-jaxpr that takes the equation's operands and gives its results."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if isinstance(inner, jcore.ClosedJaxpr):
            inner = inner.jaxpr
        if isinstance(inner, jcore.Jaxpr) and len(inner.invars) == len(eqn.invars):
            if len(inner.outvars) == len(eqn.outvars):
                return inner
    return None


class _Ref(NamedTuple):
    """A jaxpr variable at one call site (``scope``)."""

    scope: int
    var: Any

    @property
    def aval(self) -> Any:
        return self.var.aval


def _ref(scope: int, x: Any) -> Any:
    if isinstance(x, jcore.Var) and hasattr(x.aval, "shape"):
        return _Ref(scope, x)
    return None  # a literal, a token, ...


def _is_var(x: Any) -> bool:
    return isinstance(x, _Ref)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.aval.shape) if _is_var(x) else ()


def _ndim(x: Any) -> int:
    return len(x.aval.shape) if _is_var(x) else 0


def tensor_parallel_specs(
    fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], axis: str = "model"
) -> tuple[dict[Path, PartitionSpec] | None, ...]:
    """Megatron-style `PartitionSpec`s over ``axis`` for the Variables of ``fun``'s
    graph-node arguments, from ``fun``'s jaxpr (see the module's docstring for the rule).

    ``args``/``kwargs`` as ``fun`` takes them, abstract (``nnx.eval_shape``,
    ``jax.ShapeDtypeStruct``) or concrete; nothing is allocated or run. Returns one entry
    per positional argument: for a graph node, its Variables' nnx paths mapped to their
    specs (``PartitionSpec()`` for a replicated one); None for anything else.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> class MLP(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.up = nnx.Linear(8, 32, rngs=rngs)
    ...         self.down = nnx.Linear(32, 8, rngs=rngs)
    ...     def __call__(self, x):
    ...         return self.down(jax.nn.relu(self.up(x)))
    >>> model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    >>> x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    >>> specs, _ = tensor_parallel_specs(lambda m, x: m(x), (model, x), {})
    >>> for path, spec in sorted(specs.items()):
    ...     print(path, spec)
    ('down', 'bias') P()
    ('down', 'kernel') P('model', None)
    ('up', 'bias') P('model',)
    ('up', 'kernel') P(None, 'model')
    """
    # Every graph node (positional or keyword) becomes a graphdef and its flat Variables;
    # every array becomes an abstract operand; the rest is passed as it is.
    kw_names = sorted(kwargs)
    given = list(args) + [kwargs[k] for k in kw_names]
    slots: list[Any] = []  # per argument: ("node", graphdef, paths, variables, first operand)
    operands: list[jax.ShapeDtypeStruct] = []
    weight_index: list[tuple[int, Path]] = []  # operand -> (argument, path)
    for index, arg in enumerate(given):
        if is_node(arg):
            graphdef, state = nnx.split(arg)
            flat = list(nnx.to_flat_state(state))
            start = len(operands)
            traced = []
            for path, var in flat:
                value = var.get_value()
                if is_array(value):
                    operands.append(jax.ShapeDtypeStruct(value.shape, value.dtype))
                    weight_index.append((index, tuple(path)))
                    traced.append(True)
                else:
                    traced.append(False)
            slots.append(("node", graphdef, flat, traced, start))
        elif is_array(arg):
            slots.append(("array", len(operands)))
            operands.append(jax.ShapeDtypeStruct(arg.shape, arg.dtype))
            weight_index.append((-1, ()))
        else:
            slots.append(("static", arg))
    n_weights = sum(1 for i, _ in weight_index if i >= 0)

    def pure(*values: Any) -> Any:
        rebuilt = []
        for slot in slots:
            if slot[0] == "node":
                _, graphdef, flat, traced, start = slot
                it = iter(values[start:])
                pairs = [
                    (path, var.replace(next(it)) if t else var)
                    for (path, var), t in zip(flat, traced, strict=True)
                ]
                rebuilt.append(nnx.merge(graphdef, nnx.from_flat_state(pairs)))
            elif slot[0] == "array":
                rebuilt.append(values[slot[1]])
            else:
                rebuilt.append(slot[1])
        call_args = rebuilt[: len(args)]
        call_kwargs = dict(zip(kw_names, rebuilt[len(args) :], strict=True))
        out = fun(*call_args, **call_kwargs)
        # The results and the nodes' state after the call (an update in place counts).
        leaves = [a for x in jax.tree.leaves(out, is_leaf=is_node) for a in _arrays(x)]
        for x in rebuilt:
            if is_node(x):
                leaves += [v for v in jax.tree.leaves(nnx.state(x)) if is_array(v)]
        return leaves

    closed = jax.make_jaxpr(pure)(*operands)
    jaxpr = closed.jaxpr
    analysis = _Analysis()
    invars = [_ref(0, x) for x in jaxpr.invars]
    for var, (arg, _) in zip(invars, weight_index, strict=True):
        if arg >= 0:
            analysis.weights.add(var)
    analysis.walk(jaxpr, 0)
    del n_weights

    # Classes: their weight dimensions, marks and conflicts.
    find = analysis.find
    members: dict[DimKey, list[tuple[int, int]]] = {}  # class -> [(operand, dim)]
    for k, var in enumerate(invars):
        if weight_index[k][0] < 0:
            continue
        for d in range(_ndim(var)):
            if _shape(var)[d] > 1:
                members.setdefault(find((var, d)), []).append((k, d))
    conflicted = {find(key) for key in analysis.conflict}
    rows = {find(key) for key in analysis.row}
    first_col: dict[DimKey, int] = {}
    for key, pos in analysis.col.items():
        root = find(key)
        first_col[root] = min(pos, first_col.get(root, pos))
    taken: set[int] = set()
    chosen: dict[tuple[int, int], bool] = {}
    for root in sorted(first_col, key=first_col.__getitem__):
        if root not in rows or root in conflicted or root not in members:
            continue
        weights = [k for k, _ in members[root]]
        if len(set(weights)) != len(weights) or taken & set(weights):
            continue
        taken.update(weights)
        chosen.update({m: True for m in members[root]})

    result: list[dict[Path, PartitionSpec] | None] = [None] * len(args)
    for k, var in enumerate(invars):
        arg, path = weight_index[k]
        if arg < 0 or arg >= len(args):
            continue
        spec = [axis if (k, d) in chosen else None for d in range(_ndim(var))]
        specs = result[arg]
        if specs is None:
            specs = {}
        specs[path] = PartitionSpec(*spec) if any(spec) else PartitionSpec()
        result[arg] = specs
    for arg, slot in enumerate(slots[: len(args)]):
        if slot[0] == "node" and result[arg] is None:
            result[arg] = {}
    return tuple(result)


def _arrays(x: Any) -> list[Any]:
    if is_node(x):
        return [v for v in jax.tree.leaves(nnx.state(x)) if is_array(v)]
    return [x] if is_array(x) else []
