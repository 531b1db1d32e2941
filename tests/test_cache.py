"""The fast path (`cache`): cached splits must never serve a stale graph."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_sharding


class Block(nnx.Module):
    def __init__(self, din: int, dout: int, seed: int):
        self.linear = nnx.Linear(din, dout, rngs=nnx.Rngs(seed))
        self.bn = nnx.BatchNorm(dout, rngs=nnx.Rngs(seed))

    def __call__(self, x):
        return nnx.relu(self.bn(self.linear(x)))


class Model(nnx.Module):
    def __init__(self):
        self.count = nnx.BatchStat(jnp.array(0))
        self.first = Block(2, 4, 0)
        self.layers = nnx.List([Block(4, 4, 1)])

    def __call__(self, x):
        self.count[...] += 1
        x = self.first(x)
        for layer in self.layers:
            x = layer(x)
        return x


X = jnp.linspace(0.0, 1.0, 6).reshape(3, 2)


@nnx_sharding.jit
def forward(model, x):
    return model(x)


@nnx_sharding.jit
def bump_bias(model):
    model.first.linear.bias[...] += 1.0


def _replace_attribute(model):
    model.first = Block(2, 4, 7)


def _swap_variable(model):
    model.first.linear.kernel = nnx.Param(jnp.full((2, 4), 0.5))


def _append_layer(model):
    model.layers.append(Block(4, 4, 3))


def _set_value(model):
    model.first.linear.bias[...] = jnp.full((4,), 2.0)


def _other_jit(model):
    bump_bias(model)


def _toggle_static(model):
    model.eval()  # BatchNorm's use_running_average: a static attribute, a new graphdef


def _grow_plain_list(model):
    model.extras.append(nnx.Param(jnp.ones(())))  # a list held with nnx.data: not a Pytree


class ModelWithList(Model):
    def __init__(self):
        super().__init__()
        self.extras = nnx.data([nnx.Param(jnp.zeros(()))])

    def __call__(self, x):
        return super().__call__(x) + sum(p[...] for p in self.extras)


CHANGES = [
    _replace_attribute,
    _swap_variable,
    _append_layer,
    _set_value,
    _other_jit,
    _toggle_static,
    _grow_plain_list,
]


@pytest.mark.parametrize("change", CHANGES)
def test_change_between_calls_is_seen(change):
    model = ModelWithList()
    for _ in range(3):  # warm the cache: later calls take the fast path
        forward(model, X)
    change(model)
    # reference: the same program on a copy, through a fresh jit (no cache)
    reference = nnx.clone(model)
    expected = nnx_sharding.jit(lambda m, x: m(x))(reference, X)
    np.testing.assert_array_equal(forward(model, X), expected)
    assert int(model.count[...]) == int(reference.count[...]) == 4
    np.testing.assert_array_equal(model.first.bn.mean[...], reference.first.bn.mean[...])


def test_fast_path_keeps_updating_the_callers_variables():
    model, reference = Model(), Model()
    for _ in range(5):
        out = forward(model, X)
        expected = reference(X)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert int(model.count[...]) == 5
    np.testing.assert_allclose(model.layers[0].bn.var[...], reference.layers[0].bn.var[...])


def test_no_retrace_on_the_fast_path():
    traces = []

    @nnx_sharding.jit
    def step(model, x):
        traces.append(1)
        return model(x)

    model = Model()
    for _ in range(5):
        step(model, X)
    assert len(traces) == 1
    step(model, jnp.ones((5, 2)))  # new shape: jax traces again, on the full path
    assert len(traces) == 2
    step(model, X)
    assert len(traces) == 2


def test_structure_change_inside_disables_the_fast_path_for_that_plan():
    @nnx_sharding.jit
    def grow(model):
        model.extra = nnx.Param(jnp.zeros(()))

    model = Model()
    grow(model)
    assert isinstance(model.extra, nnx.Param)
    del model.extra
    grow(model)  # the same plan again: must still write the new attribute back
    assert isinstance(model.extra, nnx.Param)


def test_cache_entry_dies_with_its_module():
    import gc

    @nnx_sharding.jit
    def f(model, x):
        return model(x)

    model = Model()
    f(model, X)
    assert len(f._entries) == 1
    del model
    gc.collect()
    assert len(f._entries) == 0


def test_a_call_waits_for_its_program_only_when_it_has_host_callbacks(monkeypatch):
    """A run-time error can only come from a host callback: such programs are waited for
    before the write-back (so it raises with the Variables untouched); others stay async."""
    waited = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(1) or real(x))

    def quiet(c):
        c["n"][...] += 1

    def chatty(c):
        c["n"][...] += 1
        jax.debug.callback(lambda n: None, c["n"][...])

    def make():
        return nnx.Dict(n=nnx.BatchStat(jnp.array(0)))

    for fun, expected in [(quiet, 0), (chatty, 3)]:
        counter, f = make(), nnx_sharding.jit(fun)
        for _ in range(3):  # the first call traces; the others take the fast path
            f(counter)
        assert len(waited) == expected, fun.__name__
        assert int(counter["n"][...]) == 3
    compiled = nnx_sharding.jit(chatty).lower(make()).compile()
    compiled(make())
    assert len(waited) == 4


def test_renamed_attribute_is_seen():
    """Renaming the last attribute leaves the module's values, in order, as they were:
    only its keys tell the change."""
    model = Model()
    for _ in range(3):
        forward(model, X)
    model.blocks = model.layers
    del model.layers
    with pytest.raises(AttributeError, match="layers"):
        forward(model, X)


@pytest.mark.parametrize("change", CHANGES)
def test_compiled_sees_or_refuses_each_change(change):
    """Compiled.__call__ shares the fast path: a change that keeps the graph definition
    (new objects of the same structure too) is seen; one that changes it is refused, as
    the program was compiled for one structure. Never served stale."""
    model = ModelWithList()
    compiled = forward.lower(model, X).compile()
    for _ in range(3):
        compiled(model, X)
    graphdef = nnx.graphdef(model)
    change(model)
    reference = nnx.clone(model)
    if nnx.graphdef(model) == graphdef:
        expected = nnx_sharding.jit(lambda m, x: m(x))(reference, X)
        np.testing.assert_array_equal(compiled(model, X), expected)
        np.testing.assert_array_equal(model.first.bn.mean[...], reference.first.bn.mean[...])
    else:
        with pytest.raises(TypeError, match=r"(?s)jit: .*args\[0\]"):
            compiled(model, X)
        assert nnx.graphdef(model) == nnx.graphdef(reference)  # nothing written back
        np.testing.assert_array_equal(model.count[...], reference.count[...])


def test_compiled_takes_the_fast_path(monkeypatch):
    from nnx_sharding import _stages

    splits = []
    real = _stages.split_call
    monkeypatch.setattr(_stages, "split_call", lambda *a: splits.append(1) or real(*a))
    model = Model()
    compiled = forward.lower(model, X).compile()
    for _ in range(4):
        compiled(model, X)
    assert len(splits) == 1  # the first call splits and caches; the others reuse it
    assert int(model.count[...]) == 4


def test_fast_path_names_a_bad_value_set_from_outside():
    """jax's complaint about a flat argument (``kept[3]``) is redone on the full path,
    which names the Variable."""
    model = Model()
    for _ in range(2):
        forward(model, X)
    model.first.linear.bias.set_raw_value("oops")
    with pytest.raises(TypeError, match=r"args\[0\]\.first\.linear\.bias"):
        forward(model, X)


def test_compiled_names_a_changed_shape_set_from_outside():
    model = Model()
    compiled = forward.lower(model, X).compile()
    compiled(model, X)
    compiled(model, X)
    model.first.linear.bias[...] = jnp.zeros((4,))  # same shape: fine
    compiled(model, X)
    model.first.linear.bias = nnx.Param(jnp.zeros((5,)))
    with pytest.raises(TypeError, match=r"args\[0\]\.first\.linear\.bias: got float32\[5\]"):
        compiled(model, X)


# Plain array attributes (flax's examples/nnx_toy_examples/07_array_leaves.py): graph
# leaves outside any Variable, replaced by each update.


class ArrayLinear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = jax.random.normal(rngs.params(), (din, dout))
        self.b = jnp.zeros((dout,))

    def __call__(self, x):
        return x @ self.w + self.b


class ArrayMLP(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.count = jnp.array(0)
        self.linear1 = ArrayLinear(2, 8, rngs=rngs)
        self.linear2 = ArrayLinear(8, 1, rngs=rngs)

    def __call__(self, x):
        self.count += 1
        return self.linear2(nnx.relu(self.linear1(x)))


def _is_param(path, value):
    return path[-1] in ("w", "b")


def _array_train_step(model, optimizer, batch):
    x, y = batch
    grads = nnx.grad(lambda m: jnp.mean((y - m(x)) ** 2), argnums=nnx.DiffState(0, _is_param))(
        model
    )
    optimizer.update(model, grads)
    return model.count


def _arrays(*nodes):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(nodes))]


def _assert_identical(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def splits(monkeypatch):
    """Counts the full path's splits (`call.split_call`) and the fast path's fallbacks
    to the full merge (`cache.split_call`)."""
    from nnx_sharding._callpath import call as _call
    from nnx_sharding._fastpath import cache as _cache

    counts = {"full": 0, "fallback": 0}
    for module, name in ((_call, "full"), (_cache, "fallback")):
        real = module.split_call

        def counted(*args, real=real, name=name):
            counts[name] += 1
            return real(*args)

        monkeypatch.setattr(module, "split_call", counted)
    return counts


BATCH = (np.linspace(0, 1, 8).reshape(4, 2), np.linspace(1, 2, 4).reshape(4, 1))


@pytest.mark.parametrize("donate", [False, True], ids=["plain", "donated"])
def test_array_attributes_take_the_fast_path_with_flax_results(splits, donate):
    import optax

    results = []
    for jit in (nnx.jit, nnx_sharding.jit):
        options = {"donate_argnums": (0, 1)} if donate and jit is nnx_sharding.jit else {}
        model = ArrayMLP()
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=_is_param)
        step = jit(_array_train_step, **options)
        counts = [int(step(model, optimizer, BATCH)) for _ in range(6)]
        assert counts == [1, 2, 3, 4, 5, 6]
        assert type(model.linear1.w) is type(jnp.zeros(()))
        results.append(_arrays(model, optimizer))
    _assert_identical(*results)
    assert splits == {"full": 1, "fallback": 0}  # the first call only


def _scale_from_outside(model):
    model.linear1.w = model.linear1.w * 2.0  # another array: the same structure


def _numpy_from_outside(model):
    model.linear1.b = np.ones(8, np.float32)  # flax's calls leave a jax array there


def _python_number(model):
    model.count = 5  # still a data attribute: a leaf, but no array


def _variable_for_array(model):
    model.linear1.b = nnx.Param(jnp.ones(8))


def _new_array_attribute(model):
    model.linear2.extra = jnp.ones(())


def _delete_array_attribute(model):
    del model.linear2.extra


ARRAY_CHANGES = [
    (_scale_from_outside, 0),
    (_numpy_from_outside, 1),
    (_python_number, 1),
    (_variable_for_array, 1),
    (_new_array_attribute, 1),
]


@pytest.mark.parametrize(
    ("change", "full"), ARRAY_CHANGES, ids=lambda c: getattr(c, "__name__", "")
)
def test_an_array_attribute_changed_between_calls_is_seen(splits, change, full):
    """The same calls through flax and through our fast path: equal arrays and types
    after each; only a change of structure (or of a leaf's kind) takes the full path."""
    models, steps = (
        [ArrayMLP(), ArrayMLP()],
        [nnx.jit(ArrayMLP.__call__), nnx_sharding.jit(ArrayMLP.__call__)],
    )
    x = jnp.asarray(BATCH[0])
    for _ in range(2):
        outs = [np.asarray(f(m, x)) for f, m in zip(steps, models, strict=True)]
    before = dict(splits)
    for model in models:
        change(model)
    for _ in range(2):
        outs = [np.asarray(f(m, x)) for f, m in zip(steps, models, strict=True)]
        _assert_identical(*outs)
        _assert_identical(_arrays(models[0]), _arrays(models[1]))
        assert [type(m.linear1.b) for m in models][0] is type(models[1].linear1.b)
        assert [type(m.count) for m in models][0] is type(models[1].count)
    assert splits["full"] - before["full"] == full
    assert splits["fallback"] == 0


class Shared(nnx.Module):
    def __init__(self):
        self.s = jnp.zeros(())
        self.t = self.s  # one array under two names: two leaves for flax
        self.items = nnx.List([jnp.zeros(()), jnp.ones(())])
        self.table = nnx.data({"a": jnp.zeros(())})  # a dict: flax's merge makes a new one

    def bump(self, which):
        if which == "t":
            self.t = self.t + 1
        elif which == "items":
            self.items[1] = self.items[1] + 1
        else:
            self.table["a"] = self.table["a"] + 1
        return self.s + self.t + self.items[1] + self.table["a"]


@pytest.mark.parametrize(("which", "fast"), [("t", True), ("items", True), ("table", False)])
def test_arrays_in_lists_dicts_and_shared_are_written_as_flax_writes_them(splits, which, fast):
    models = [Shared(), Shared()]
    tables = [m.table for m in models]
    steps = [
        nnx.jit(Shared.bump, static_argnums=1),
        nnx_sharding.jit(Shared.bump, static_argnums=1),
    ]
    for _ in range(4):
        outs = [[np.asarray(f(m, which))] for f, m in zip(steps, models, strict=True)]
        _assert_identical(*outs)
        _assert_identical(_arrays(models[0]), _arrays(models[1]))
    assert float(models[1].s) == 0.0
    if which == "table":  # a new dict, as flax's merge makes one
        assert [m.table is t for m, t in zip(models, tables, strict=True)] == [False, False]
    # table: the fast path ran the program once, then merged in full and stopped
    assert splits == ({"full": 1, "fallback": 0} if fast else {"full": 3, "fallback": 1})


WRITTEN: list[int] = []  # ids of the `Logged` modules whose count was set


class Logged(nnx.Module):
    def __init__(self):
        self.count = jnp.array(0)

    def __setattr__(self, name, value):
        if name == "count":
            WRITTEN.append(id(self))
        super().__setattr__(name, value)


def test_an_array_is_stored_as_flax_merges_it_past_the_owners_setattr(splits):
    """flax's merge clears a module and sets its attributes with object.__setattr__: an
    override of __setattr__ sees none of its writes, on either path."""
    models = [Logged(), Logged()]
    steps = [nnx.jit(_bump_count), nnx_sharding.jit(_bump_count)]
    for _ in range(3):
        for f, m in zip(steps, models, strict=True):
            f(m)
    assert [int(m.count) for m in models] == [3, 3]
    assert [WRITTEN.count(id(m)) for m in models] == [1, 1]  # __init__'s own
    assert splits == {"full": 1, "fallback": 0}


def _bump_count(model):
    model.count += 1


def test_compiled_takes_the_fast_path_with_array_attributes(splits):
    from nnx_sharding import _stages

    model, reference = ArrayMLP(), ArrayMLP()
    x = jnp.asarray(BATCH[0])
    compiled = nnx_sharding.jit(ArrayMLP.__call__).lower(model, x).compile()
    step = nnx.jit(ArrayMLP.__call__)
    real, stage_splits = _stages.split_call, []
    _stages.split_call = lambda *a: stage_splits.append(1) or real(*a)
    try:
        for _ in range(4):
            _assert_identical([np.asarray(compiled(model, x))], [np.asarray(step(reference, x))])
    finally:
        _stages.split_call = real
    assert len(stage_splits) == 1
    assert int(model.count) == 4
    _assert_identical(_arrays(model), _arrays(reference))
