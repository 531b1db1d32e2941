"""The twins of `test_fuzz`: the model, its mutations and the transforms it is called by.

`Twins` is a hypothesis state machine holding two models built alike from one seed
(twin ``a`` and twin ``b``); each mutation (`mutation`) is applied to both, and its
invariant keeps their graph definitions equal. Subclasses (in `test_fuzz`) add the
calls that compare the twins after every step. The transforms (`FAST`, `FLAX`,
`FULL`) live at module level, so their caches outlive an example, and every drawn
value comes from a small set: each new structure costs a trace and a compilation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import nnx_sharding
from nnx_sharding._fastpath import cache as _cache

F = 3  # features: every model here is tiny; the shapes come from a small fixed set
# Every array is committed to one device: jax compiles anew for a mix of committed and
# uncommitted arguments (a ref=True Variable's value is always committed, so are the
# results of calls that take one).
DEVICE = jax.devices()[0]
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}


def values(seed: int, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A new array (its own buffer: donation may delete it) drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jax.device_put(rng.integers(-3, 4, shape).astype(dtype), DEVICE)
    return jax.device_put(rng.normal(size=shape).astype(dtype), DEVICE)


def copy(x: Any) -> jax.Array:
    """A new buffer with the value of an array or a ``ref=True`` Variable's Ref."""
    return jax.device_put(jnp.array(x[...] if isinstance(x, jax.Ref) else x, copy=True), DEVICE)


def commit(node: Any) -> None:
    """Commits the values of the Variables below ``node`` (Refs are committed already)."""
    for _, x in nnx.iter_graph(node):
        if isinstance(x, nnx.Variable) and not isinstance(x.get_raw_value(), jax.Ref):
            x.set_raw_value(jax.device_put(x.get_raw_value(), DEVICE))


XS = tuple(
    jax.device_put(np.linspace(*ends, 2 * F, dtype=np.float32).reshape(2, F), DEVICE)
    for ends in ((-1.0, 1.0), (2.0, -0.5))
)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["offset"], meta_fields=["gain"])
@dataclasses.dataclass
class Shift:
    """A pytree (not a graph node) that the model holds with ``nnx.data``."""

    offset: jax.Array
    gain: float


def linear(width: int, seed: int | nnx.Rngs) -> nnx.Linear:
    """Every Linear's kernel has the metadata ``scale`` that `Model` reads from ``l1``, so
    that `set_metadata` toggles between two graph structures, not three."""
    rngs = seed if isinstance(seed, nnx.Rngs) else nnx.Rngs(seed)
    layer = nnx.Linear(F, width, rngs=rngs, kernel_metadata={"scale": 1.0})
    commit(layer)
    return layer


class Model(nnx.Module):
    """Every kind of attribute a mutation can reach; ``__call__`` reads each of them."""

    def __init__(self, seed: int):
        rngs = nnx.Rngs(seed, dropout=seed + 1)
        self.l1 = linear(F, rngs)
        self.l2 = linear(F, rngs)
        self.side = linear(2, rngs)  # replaced by Linears of another width
        self.bn = nnx.BatchNorm(F, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)  # holds an RngStream: its count moves
        self.layers = nnx.List([])
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))
        self.shift = nnx.data(Shift(jax.device_put(np.zeros(F, np.float32), DEVICE), 1.0))
        # Arrays outside any Variable (flax's graph leaves): one the call replaces, one it
        # only reads, and one in an nnx.List that the call replaces.
        self.plain = jax.device_put(np.float32(0.0), DEVICE)
        self.frozen = jax.device_put(np.ones(F, np.float32), DEVICE)
        self.arrays = nnx.List([jax.device_put(np.float32(1.0), DEVICE)])
        commit(self)

    def __call__(self, x: jax.Array) -> jax.Array:
        self.count[...] += 1
        self.plain = self.plain + 0.5
        self.arrays[0] = self.arrays[0] * 0.5 + 1.0
        cell = getattr(self, "cell", None)  # a ref=True Variable: never cached
        if cell is not None:
            cell[...] += 1.0
        table = getattr(self, "table", None)  # a dict: flax's merge makes a new one
        if table is not None:
            table["k"] = table["k"] + 1.0
        h = nnx.relu(self.bn(self.l1(x)))  # BatchNorm updates its statistics in train mode
        h = self.drop(h) * self.l1.kernel.get_metadata().get("scale", 1.0)  # after bn: seen
        h = self.l2(h)
        for layer in self.layers:
            h = layer(h)
        h = h + self.side(x).sum(-1, keepdims=True)
        h = h * self.shift.gain + self.shift.offset + self.plain + self.frozen + self.arrays[0]
        h = h + getattr(self, "twin", 0.0)  # `share_plain`: the same array as `plain`
        if cell is not None:
            h = h + cell[...]
        if table is not None:
            h = h + table["k"]
        extra = getattr(self, "extra", None)
        if extra is not None:
            h = h + extra[...]
        return h


def forward(model: Model, x: jax.Array) -> tuple[jax.Array, Model]:
    return model(x), model  # an output that is an input must come back as that object


def bump(model: Model) -> None:
    model.l2.bias[...] += 1.0


FUNCTIONS = {"forward": forward, "bump": bump}
FAST = {name: nnx_sharding.jit(f) for name, f in FUNCTIONS.items()}
FLAX = {name: nnx.jit(f) for name, f in FUNCTIONS.items()}
FULL = {name: nnx_sharding.jit(f) for name, f in FUNCTIONS.items()}  # call in `full_path()`


@contextlib.contextmanager
def full_path() -> Iterator[None]:
    """Calls made inside cache nothing (`cache.remember` keeps at most MAX_ENTRIES), so
    a transform used only in here always takes the full path (`outside` + `merge_call`)."""
    saved = _cache.MAX_ENTRIES
    _cache.MAX_ENTRIES = 0
    try:
        yield
    finally:
        _cache.MAX_ENTRIES = saved


def on_full_path(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def call(*args: Any, **kwargs: Any) -> Any:
        with full_path():
            return f(*args, **kwargs)

    return call


def host(x: Any) -> np.ndarray:
    if isinstance(x, jax.Ref):
        x = x[...]
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.array(x)


def state_of(model: Model) -> dict[str, np.ndarray]:
    """The caller's state by path, on the host: Rngs keys and counts included."""
    flat, _ = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))
    return {jax.tree_util.keystr(path): host(x) for path, x in flat}


def assert_same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for path in a:
        assert a[path].dtype == b[path].dtype, path
        assert a[path].shape == b[path].shape, path
        np.testing.assert_allclose(a[path], b[path], **TOLERANCE, err_msg=path)


def assert_same_output(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(host(x), host(y), **TOLERANCE)


VARIABLES = [  # (attribute, Variable) pairs that `assign` may reach
    ("l1", "kernel"),
    ("l2", "bias"),
    ("side", "bias"),
    ("bn", "mean"),
    ("bn", "scale"),
    ("layers0", "kernel"),
    (None, "count"),
    (None, "extra"),
]


# nnx.update cannot write into a pytree held with nnx.data (flax: "Cannot set key 'offset'
# on immutable node"), so the updates take Variables only.
STATE_FILTERS = [nnx.Variable, nnx.Param, nnx.BatchStat]


def variable_at(model: Model, where: tuple[str | None, str]) -> nnx.Variable | None:
    owner, name = where
    if owner == "layers0" and len(model.layers) == 0:
        return None
    node = (
        model if owner is None else model.layers[0] if owner == "layers0" else getattr(model, owner)
    )
    return getattr(node, name, None)


def mutation(*, each: bool = True, **strategies: st.SearchStrategy[Any]) -> Callable[..., Any]:
    """A rule that applies one mutation, ``mutate(self, model, **drawn)``, to each twin
    (``each=False``: ``mutate(self, **drawn)`` once), then calls if ``then_call`` is drawn:
    about half the calls follow a mutation at once, half come after more of them."""

    def decorate(mutate: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(mutate)
        def apply(self: Twins, then_call: bool, **drawn: Any) -> None:
            if each:
                for model in (self.a, self.b):
                    mutate(self, model, **drawn)
            else:
                mutate(self, **drawn)
            if then_call:
                self.check_call()

        return rule(then_call=st.booleans(), **strategies)(apply)

    return decorate


class Twins(RuleBasedStateMachine):
    """The twins and the mutations; subclasses add the calls (`check_call`).

    The drawn values come from small sets (two widths, two scales, at most one extra
    layer, ...): every new graph structure costs a trace and a compilation per transform.
    """

    a: Model
    b: Model

    @initialize(seed=st.integers(0, 1))
    def build(self, seed: int) -> None:
        self.a, self.b = Model(seed), Model(seed)

    @invariant()
    def same_structure(self) -> None:
        if hasattr(self, "a"):
            assert nnx.graphdef(self.a) == nnx.graphdef(self.b)

    def check_call(self) -> None:
        """Calls both twins once (a fixed, plain call) and compares."""
        raise NotImplementedError

    # Mutations. Each builds its own objects and arrays for each twin.

    @mutation(name=st.sampled_from(["l1", "l2"]), seed=st.integers(0, 2))
    def replace_linear(self, model: Model, name: str, seed: int) -> None:
        setattr(model, name, linear(F, seed))

    @mutation(width=st.sampled_from([2, 3]), seed=st.integers(0, 2))
    def replace_side(self, model: Model, width: int, seed: int) -> None:
        model.side = linear(width, seed)  # width 3: another structure

    @mutation()
    def swap(self, model: Model) -> None:
        model.l1, model.l2 = model.l2, model.l1

    @mutation()
    def share(self, model: Model) -> None:
        model.l2 = model.l1  # one Linear under two names

    @mutation(name=st.sampled_from(["l1", "l2"]), seed=st.integers(0, 2))
    def replace_variable(self, model: Model, name: str, seed: int) -> None:
        getattr(model, name).kernel = nnx.Param(values(seed, (F, F), jnp.float32), scale=1.0)

    @mutation(
        where=st.sampled_from(VARIABLES),
        how=st.sampled_from(["index", "set_value"]),
        seed=st.integers(0, 3),
    )
    def assign(self, model: Model, where: tuple[str | None, str], how: str, seed: int) -> None:
        variable = variable_at(model, where)
        if variable is None:
            return
        value = values(seed, variable.shape, variable.dtype)
        if how == "index":
            variable[...] = value
        else:
            variable.set_value(value)

    @mutation(dtype=st.sampled_from([jnp.int32, jnp.float32]), seed=st.integers(0, 3))
    def retype_count(self, model: Model, dtype: Any, seed: int) -> None:
        model.count.set_value(values(seed, (), dtype))  # another dtype: another trace

    # Missed by the fast path at 34b7c38 (fixed since): Variable metadata.
    @mutation(scale=st.sampled_from([1.0, 2.0]))
    def set_metadata(self, model: Model, scale: float) -> None:
        model.l1.kernel.set_metadata(scale=scale)

    @mutation(seed=st.integers(0, 2))
    def add_extra(self, model: Model, seed: int) -> None:
        model.extra = nnx.Param(values(seed, (F,), jnp.float32))

    @precondition(lambda self: hasattr(self.a, "extra"))
    @mutation()
    def delete_extra(self, model: Model) -> None:
        del model.extra

    @precondition(lambda self: len(self.a.layers) == 0)
    @mutation(seed=st.integers(0, 2))
    def append_layer(self, model: Model, seed: int) -> None:
        model.layers.append(linear(F, seed))

    @precondition(lambda self: len(self.a.layers) > 0)
    @mutation()
    def pop_layer(self, model: Model) -> None:
        model.layers.pop()

    # Missed by the fast path at 34b7c38 (fixed since): a field of a pytree held with
    # nnx.data, set in place (and `StagedFuzz.set_shift_gain`).
    @mutation(seed=st.integers(0, 2))
    def set_shift_offset(self, model: Model, seed: int) -> None:
        model.shift.offset = values(seed, (F,), jnp.float32)

    @mutation(seed=st.integers(0, 2))
    def replace_shift(self, model: Model, seed: int) -> None:
        model.shift = nnx.data(Shift(values(seed, (F,), jnp.float32), model.shift.gain))

    # Mishandled by the fast path at 34b7c38 (fixed since), as are the updates that
    # `Model.__call__` makes to them: a plain array attribute, a ref=True Variable.
    # Plain arrays: each attribute set from outside to another array (the fast path reads
    # it), a numpy array (flax's calls leave a jax array), a Python number, a Variable.
    @mutation(
        name=st.sampled_from(["plain", "frozen", "arrays0"]),
        kind=st.sampled_from(["array", "numpy", "number", "variable"]),
        seed=st.integers(0, 2),
    )
    def set_plain(self, model: Model, name: str, kind: str, seed: int) -> None:
        shape = (F,) if name == "frozen" else ()
        value: Any = values(seed, shape, jnp.float32)
        if kind == "numpy":
            value = np.asarray(value)
        elif kind == "number":
            value = float(seed) if shape == () else value + 1.0
        elif kind == "variable":
            value = nnx.Variable(value)
        if name == "arrays0":
            model.arrays[0] = value
        else:
            setattr(model, name, value)

    @precondition(lambda self: not hasattr(self.a, "table"))
    @mutation(seed=st.integers(0, 2))
    def add_table(self, model: Model, seed: int) -> None:
        model.table = nnx.data({"k": values(seed, (), jnp.float32)})

    @precondition(lambda self: hasattr(self.a, "table"))
    @mutation()
    def delete_table(self, model: Model) -> None:
        del model.table

    @precondition(lambda self: not hasattr(self.a, "cell"))
    @mutation()
    def add_cell(self, model: Model) -> None:
        model.cell = nnx.Variable(jnp.zeros(()), ref=True)

    @precondition(lambda self: hasattr(self.a, "cell"))
    @mutation()
    def delete_cell(self, model: Model) -> None:
        del model.cell

    @precondition(lambda self: hasattr(self.a, "cell"))
    @mutation(seed=st.integers(0, 2))
    def set_cell(self, model: Model, seed: int) -> None:
        model.cell[...] = values(seed, (), jnp.float32)

    @mutation(mode=st.sampled_from(["train", "eval"]))
    def train_or_eval(self, model: Model, mode: str) -> None:
        getattr(model, mode)()  # BatchNorm's and Dropout's flags: static attributes

    @mutation(seed=st.integers(0, 2))
    def reseed(self, model: Model, seed: int) -> None:
        nnx.reseed(model, dropout=seed)
        commit(model)  # the new keys are uncommitted

    @mutation(each=False, filter=st.sampled_from(STATE_FILTERS))
    def update_from_twin(self, filter: Any) -> None:
        """``nnx.update`` with the other twin's state (its values, in new buffers)."""
        copies = [jax.tree.map(copy, nnx.state(m, filter)) for m in (self.b, self.a)]
        for model, state in zip((self.a, self.b), copies, strict=True):
            nnx.update(model, state)

    @mutation(filter=st.sampled_from(STATE_FILTERS), delta=st.sampled_from([0.5, -1.0]))
    def update_perturbed(self, model: Model, filter: Any, delta: float) -> None:
        state = nnx.state(model, filter)
        perturbed = jax.tree.map(
            lambda x: copy(x) + delta if jnp.issubdtype(x.dtype, jnp.floating) else copy(x), state
        )
        nnx.update(model, perturbed)

    # Helpers for the calls.

    def states(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        return state_of(self.a), state_of(self.b)
