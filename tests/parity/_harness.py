"""Runs one scenario under flax's transforms and under ours, and compares what each saw.

A *scenario* is a function ``scenario(impl, log)``: it builds its objects afresh (the same
seeds each time, so both runs start from identical models), calls ``impl.jit`` /
``impl.shard_map`` at least three times (the first call takes our full path, the later
ones our cached fast path) and records what a user could observe with ``log``:

- ``log.value(label, tree)``: outputs (any pytree; graph nodes in it are summarized by
  their state);
- ``log.state(label, *nodes)``: the caller's objects afterwards: graph definition,
  every Variable's value, type, dtype, array kind (jax or numpy) and sharding;
- ``log.fact(label, x)``: anything compared with ``==`` (identities: ``out is model``);
- ``log.sharding(label, tree)``: the shardings of a pytree's arrays (specs as written);
- ``log.raises(label, fn, *args)``: calls ``fn`` and records its result or its error type.

Every case runs in each of flax's modes (`MODES`, set by the ``mode`` fixture of
``conftest.py`` with ``nnx.set_graph_mode``/``nnx.set_graph_updates`` around the test):
the full graph protocol, graph mode without graph updates, and tree mode; flax and ours
run in the same mode. Outside the full graph protocol an error escaping flax's run is an
observation too (ours must raise the same), and `better_than_flax` becomes `parity` (the
simple path follows flax exactly).

`parity` runs the scenario with `FLAX` and with `OURS` and compares the two logs entry by
entry: arrays by kind, dtype, weak type, shape, sharding and value (``allclose``, 1e-6);
errors by type (ours may raise a subclass of flax's). Every difference is listed in
the failure message. `better_than_flax` is for the few cases where flax errors and
nnx_sharding promises to do better: flax must raise the given error, and ours is
compared with `EAGER` (the same scenario without any jit).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, SingleDeviceSharding

import nnx_sharding

# ---------------------------------------------------------------------------------------
# the implementations


def _eager_jit(fun: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``jit`` that does not compile: the function runs eagerly on the caller's objects."""
    if fun is None:
        return lambda f: f
    return fun


def _no_shard_map(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("shard_map has no eager reference")


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    jit: Callable[..., Any]
    shard_map: Callable[..., Any]

    def __repr__(self) -> str:
        return self.name


FLAX = Impl("flax", nnx.jit, nnx.shard_map)
OURS = Impl("ours", nnx_sharding.jit, nnx_sharding.shard_map)
EAGER = Impl("eager", _eager_jit, _no_shard_map)


@functools.cache
def mesh8() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


@functools.cache
def mesh24() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)


X = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(4, 2)
X8 = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(8, 4)


MODES: dict[str, tuple[bool, bool]] = {
    "graph": (True, True),
    "no_updates": (True, False),
    "tree": (False, False),
}
"""flax's modes, ``(graph, graph_updates)``, by the name the test ids carry."""


@dataclasses.dataclass
class _Mode:
    name: str = "graph"

    @property
    def full(self) -> bool:
        return self.name == "graph"


MODE = _Mode()
"""The mode the current test runs in (set by ``conftest.py``)."""


# ---------------------------------------------------------------------------------------
# summaries of what a user can observe


def is_graph_node(x: Any) -> bool:
    return isinstance(x, nnx.Variable) or nnx.graph.is_graph_node(x)


@dataclasses.dataclass
class Arr:
    """An array as observed: its kind, type, layout and value."""

    kind: str  # "jax" or "numpy"
    dtype: str
    shape: tuple[int, ...]
    weak_type: bool | None
    sharding: Any
    value: np.ndarray | None  # None: deleted (donated)

    def differs(self, other: Arr) -> str | None:
        for field in ("kind", "dtype", "shape", "weak_type", "sharding"):
            a, b = getattr(self, field), getattr(other, field)
            if field == "sharding" and ACCEPTED.unplaced_stay and _stayed(a, b):
                continue
            if a != b:
                return f"{field}: {a!r} != {b!r}"
        if (self.value is None) != (other.value is None):
            return f"deleted: {self.value is None} != {other.value is None}"
        if self.value is None or other.value is None:
            return None
        a, b = self.value, other.value
        if a.dtype.kind in "biu" or a.dtype == bool:
            ok = np.array_equal(a, b)
        else:
            ok = np.allclose(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)
        return None if ok else f"value: {a.tolist()} != {b.tolist()}"


@dataclasses.dataclass
class _Differences:
    """The documented differences (docs/migrating.md) a comparison accepts; each is
    switched on by `parity` only for the cases it concerns."""

    normalize_specs: bool = False  # jit: a spec comes back without its trailing Nones
    unplaced_stay: bool = False  # jit: an unchanged Variable with no in_sharding stays put


ACCEPTED = _Differences()


def _trimmed(spec: Any) -> str:
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return str(type(spec)(*parts))


def sharding_of(x: Any) -> Any:
    """A comparable description of an array's sharding: specs as written (or without
    trailing Nones where that documented difference is accepted)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        spec = _trimmed(sharding.spec) if ACCEPTED.normalize_specs else str(sharding.spec)
        return ("named", spec, tuple(sharding.mesh.shape.items()))
    if isinstance(sharding, SingleDeviceSharding):
        return ("single", next(iter(sharding.device_set)).id)
    return (type(sharding).__name__, str(sharding))


def _stayed(flax: Any, ours: Any) -> bool:
    """flax gave it the layout jit's compiler chose for its output; ours left it on the
    device it was on (device 0: where the test models are made)."""
    return flax is not None and flax[0] == "named" and ours == ("single", 0)


def summarize_leaf(x: Any) -> Any:
    if isinstance(x, jax.Array):
        if x.is_deleted():
            return Arr("jax", str(x.dtype), x.shape, None, None, None)
        sharding = sharding_of(x)
        weak = getattr(x, "weak_type", None)
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return Arr("jax", str(x.dtype), tuple(x.shape), weak, sharding, np.asarray(x))
    if isinstance(x, (np.ndarray, np.generic)):
        return Arr("numpy", str(x.dtype), tuple(np.shape(x)), None, None, np.asarray(x))
    if isinstance(x, nnx.Variable):
        return ("node", type(x).__name__, summarize_variable("", x))
    if is_graph_node(x):
        return ("node", type(x).__name__, summarize_node(x))
    if isinstance(x, (int, float, complex, bool, str, type(None))):
        return ("py", type(x).__name__, x)
    text = repr(x)
    if re.search(r" object at 0x[0-9a-f]+>$", text):  # the default repr: by type only
        text = f"<{type(x).__name__} object>"
    return ("object", type(x).__name__, text)


def summarize_tree(tree: Any) -> list[tuple[str, Any]]:
    """``[(path, summary)]`` of a pytree's leaves, graph nodes as leaves."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_graph_node)
    out: list[tuple[str, Any]] = [("<treedef>", ("py", "treedef", str(treedef)))]
    out += [(jax.tree_util.keystr(path), summarize_leaf(x)) for path, x in leaves]
    return out


def summarize_node(node: Any) -> list[tuple[str, Any]]:
    """A graph node: its graph definition and each Variable's type and value."""
    graphdef, state = nnx.split(node)
    out: list[tuple[str, Any]] = [("<graphdef>", ("graphdef", graphdef))]
    for path, leaf in nnx.to_flat_state(state):
        where = "." + ".".join(map(str, path))
        if isinstance(leaf, nnx.Variable):
            out += summarize_variable(where, leaf)
        else:  # an array held outside a Variable
            out.append((where, summarize_leaf(leaf)))
    return out


def summarize_variable(where: str, variable: nnx.Variable) -> list[tuple[str, Any]]:
    """A Variable's type and value (the array behind a ``ref=True`` Variable)."""
    raw = variable.get_raw_value()
    if not isinstance(raw, (jax.Array, np.ndarray, np.generic)) and hasattr(raw, "shape"):
        raw = variable[...]  # an array ref
    out: list[tuple[str, Any]] = [(where + " <type>", ("py", "type", type(variable).__name__))]
    for sub, leaf in summarize_tree(raw):
        out.append((where + (sub if sub != "<treedef>" else " <treedef>"), leaf))
    return out


_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def graphdef_diff(a: Any, b: Any) -> str | None:
    """The lines in which two graph definitions differ (functions compared by name: each
    run builds its own optax closures)."""
    if a == b:
        return None
    la, lb = (_ADDRESS.sub("", repr(g)).splitlines() for g in (a, b))
    if la == lb:
        return None
    diff = [
        line
        for line in difflib.unified_diff(la, lb, lineterm="", n=0)
        if line[:1] in "+-" and line[:3] not in ("+++", "---")
    ]
    return "graphdef: " + " | ".join(d.strip() for d in diff[:12])


def _differs(a: Any, b: Any) -> str | None:
    if isinstance(a, Arr) and isinstance(b, Arr):
        return a.differs(b)
    if type(a) is not type(b):
        return f"{a!r} != {b!r}"
    if isinstance(a, tuple) and len(a) == 3 and a and a[0] == "node":
        if a[1] != b[1]:
            return f"node type {a[1]} != {b[1]}"
        return _differs_list(a[2], b[2])
    if isinstance(a, tuple) and a and a[0] == "graphdef":
        return graphdef_diff(a[1], b[1])
    return None if a == b else f"{a!r} != {b!r}"


def _differs_list(a: list[tuple[str, Any]], b: list[tuple[str, Any]]) -> str | None:
    da, db = dict(a), dict(b)
    problems = []
    for key in dict.fromkeys([k for k, _ in a] + [k for k, _ in b]):
        if key not in da:
            problems.append(f"{key}: missing in flax's")
        elif key not in db:
            problems.append(f"{key}: missing in ours")
        elif (why := _differs(da[key], db[key])) is not None:
            problems.append(f"{key}: {why}")
    return "; ".join(problems) if problems else None


# ---------------------------------------------------------------------------------------
# the log


@dataclasses.dataclass
class Entry:
    label: str
    kind: str  # value | state | fact | error
    payload: Any


class Log:
    def __init__(self, impl: Impl):
        self.impl = impl
        self.entries: list[Entry] = []
        self.escaped: BaseException | None = None
        self.trace = ""

    def value(self, label: str, tree: Any) -> Any:
        self.entries.append(Entry(label, "value", summarize_tree(tree)))
        return tree

    def state(self, label: str, *nodes: Any) -> None:
        for i, node in enumerate(nodes):
            name = label if len(nodes) == 1 else f"{label}[{i}]"
            self.entries.append(Entry(name, "state", summarize_node(node)))

    def fact(self, label: str, x: Any) -> None:
        self.entries.append(Entry(label, "fact", x))

    def sharding(self, label: str, tree: Any) -> None:
        """The shardings of a pytree's arrays (Variables unwrapped)."""
        shardings = [sharding_of(x) for x in jax.tree.leaves(tree)]
        self.entries.append(Entry(label, "fact", shardings))

    def raises(self, label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Calls ``fn``: records its output, or the type of the error it raised."""
        try:
            out = fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - any error is an observation
            self.entries.append(Entry(label, "error", error))
            return None
        self.entries.append(Entry(label, "value", summarize_tree(out)))
        return out


def run(scenario: Callable[[Impl, Log], Any], impl: Impl) -> Log:
    log = Log(impl)
    try:
        scenario(impl, log)
    except Exception as error:  # noqa: BLE001
        log.escaped = error
        try:
            log.trace = "".join(traceback.format_exception(error))
        except RecursionError:  # a RecursionError's own traceback is too deep to format
            log.trace = f"{type(error).__name__}: {error}"
    return log


def _same_error(want: BaseException, got: BaseException) -> bool:
    return isinstance(got, type(want))


def compare(want: Log, got: Log) -> list[str]:
    """The differences of ``got`` from ``want`` (the reference), one line each."""
    problems = []
    for i, (a, b) in enumerate(zip(want.entries, got.entries, strict=False)):
        where = f"#{i} {a.label!r}"
        if a.label != b.label:
            problems.append(f"{where}: the runs diverged ({got.impl} logged {b.label!r})")
            break
        if a.kind != b.kind:
            what = {"error": "raised {!r}", "value": "returned"}
            pa = what.get(a.kind, a.kind).format(a.payload)
            pb = what.get(b.kind, b.kind).format(b.payload)
            problems.append(f"{where}: {want.impl} {pa}, {got.impl} {pb}")
        elif a.kind == "error":
            if not _same_error(a.payload, b.payload):
                problems.append(
                    f"{where}: {want.impl} raised {type(a.payload).__name__}, "
                    f"{got.impl} raised {type(b.payload).__name__}: {b.payload}"
                )
        elif a.kind == "fact":
            if a.payload != b.payload:
                problems.append(f"{where}: {a.payload!r} != {b.payload!r}")
        elif (why := _differs_list(a.payload, b.payload)) is not None:
            problems.append(f"{where}: {why}")
    n, m = len(want.entries), len(got.entries)
    if n > m and not problems:
        missing = [e.label for e in want.entries[m:]]
        problems.append(f"{got.impl} stopped before {missing}")
    elif m > n and not problems:
        problems.append(f"{got.impl} logged more: {[e.label for e in got.entries[n:]]}")
    if got.escaped is not None and want.escaped is None:
        problems.append(f"{got.impl} raised:\n{got.trace}")
    elif got.escaped is not None and want.escaped is not None:
        if not _same_error(want.escaped, got.escaped):
            problems.append(f"{want.impl} raised {want.escaped!r}, {got.impl}:\n{got.trace}")
    elif want.escaped is not None:
        problems.append(f"{want.impl} raised {want.escaped!r}, {got.impl} did not")
    return problems


def _check(want: Log, got: Log) -> None:
    problems = compare(want, got)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        pytest.fail(f"{got.impl} differs from {want.impl}:\n{lines}", pytrace=False)


def parity(
    scenario: Callable[[Impl, Log], Any],
    *,
    flax_raises: type | None = None,
    normalize_specs: bool = False,
    unplaced_stay: bool = False,
) -> None:
    """Runs ``scenario`` with flax's transforms and with ours; fails on any difference.

    ``flax_raises``: the scenario is expected to end in this error under flax (and then
    under ours too). Otherwise an error escaping flax's run is a bug of the test.
    ``normalize_specs``, ``unplaced_stay``: accept these documented differences of jit
    (docs/migrating.md, "Layouts after a call").
    """
    ACCEPTED.normalize_specs, ACCEPTED.unplaced_stay = normalize_specs, unplaced_stay
    try:
        want = run(scenario, FLAX)
        if not MODE.full:  # what flax does here is the reference, errors included
            _check(want, run(scenario, OURS))
            return
        if flax_raises is None and want.escaped is not None:
            pytest.fail(f"the scenario fails under flax itself:\n{want.trace}", pytrace=False)
        if flax_raises is not None and not isinstance(want.escaped, flax_raises):
            pytest.fail(f"expected flax to raise {flax_raises.__name__}: {want.escaped!r}")
        _check(want, run(scenario, OURS))
    finally:
        ACCEPTED.normalize_specs = ACCEPTED.unplaced_stay = False


def full_graph_only(why: str) -> None:
    """Skips a case outside the full graph protocol: ``why`` it holds there only."""
    if not MODE.full:
        pytest.skip(f"graph=True, graph_updates=True only: {why}")


def better_than_flax(scenario: Callable[[Impl, Log], Any], flax_raises: type) -> None:
    """A case where flax errors and nnx_sharding deliberately works: flax must raise
    ``flax_raises``; ours must observe what the eager run (no jit at all) observes.
    Outside the full graph protocol, ours follows flax: a plain `parity`."""
    if not MODE.full:
        parity(scenario)
        return
    flax_log = run(scenario, FLAX)
    assert isinstance(flax_log.escaped, flax_raises), (
        f"flax was expected to raise {flax_raises.__name__}, got {flax_log.escaped!r}"
    )
    eager = run(scenario, EAGER)
    if eager.escaped is not None:
        pytest.fail(f"the scenario fails eagerly:\n{eager.trace}", pytrace=False)
    _check(eager, run(scenario, OURS))


# ---------------------------------------------------------------------------------------
# small models shared by the test files


class Counter(nnx.Module):
    """A Linear layer that counts its calls."""

    def __init__(self, seed: int = 0, din: int = 2, dout: int = 2):
        self.linear = nnx.Linear(din, dout, rngs=nnx.Rngs(seed))
        self.calls = nnx.BatchStat(jnp.array(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls[...] += 1
        return self.linear(x)


class Pair(nnx.Module):
    """Two counters, a BatchNorm and a call count."""

    def __init__(self, seed: int = 0):
        self.a = Counter(seed)
        self.b = Counter(seed + 1)
        self.bn = nnx.BatchNorm(2, rngs=nnx.Rngs(seed))
        self.calls = nnx.BatchStat(jnp.array(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls[...] += 1
        return self.b(nnx.relu(self.bn(self.a(x))))


class Block(nnx.Module):
    """A layer to stack: Linear, Dropout and a call count."""

    def __init__(self, rngs: nnx.Rngs, width: int = 2):
        self.linear = nnx.Linear(width, width, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.calls = nnx.BatchStat(jnp.array(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls[...] += 1
        return self.dropout(nnx.tanh(self.linear(x)))


def stack(n: int = 3, seed: int = 0) -> Block:
    """``n`` Blocks stacked on a leading axis (flax's scan-over-layers layout)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs) -> Block:
        return Block(rngs)

    return create(nnx.Rngs(seed, dropout=seed + 1))


def mse(model: Any, x: jax.Array) -> jax.Array:
    return jnp.mean(model(x) ** 2)


def sgd(model: Any, grads: Any, lr: float = 0.1) -> None:
    """One eager-style SGD step on the Params of ``model`` (works inside any transform)."""
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, params, grads))
