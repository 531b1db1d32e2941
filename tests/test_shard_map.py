"""`shard_map` over graph nodes, checked against eager single-device references."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_flax_prefix_check, needs_nnx_prefix
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding as ns

AUTO = (AxisType.Auto, AxisType.Auto)


@pytest.fixture
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)


class MLP(nnx.Module):
    def __init__(self, rngs, din=4, hidden=16):
        self.l1 = nnx.Linear(din, hidden, use_bias=False, rngs=rngs)
        self.l2 = nnx.Linear(hidden, din, use_bias=False, rngs=rngs)
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        return self.l2(self.l1(x))


MEGATRON = ns.StateSharding(
    {
        nnx.All(nnx.Param, nnx.PathContains("l1")): P(None, "model"),
        nnx.All(nnx.Param, nnx.PathContains("l2")): P("model", None),
        ...: P(),
    }
)
X = jnp.arange(32, dtype=jnp.float32).reshape(8, 4) / 10


def test_megatron_forward_matches_reference_and_sees_local_shards(mesh):
    model = MLP(nnx.Rngs(0))
    seen = []

    @ns.shard_map(mesh=mesh, in_specs=(MEGATRON, P("data")), out_specs=P("data"))
    def forward(m, x):
        seen.append((m.l1.kernel.shape, m.l2.kernel.shape, m.count.shape, x.shape))
        return jax.lax.psum(m(x), "model")

    out = forward(model, X)
    np.testing.assert_allclose(out, model(X), rtol=1e-6, atol=1e-6)
    assert seen == [((4, 4), (4, 4), (), (4, 4))]
    assert out.sharding.spec == P("data")


def test_one_spec_applies_to_every_variable_of_a_node(mesh):
    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    seen = []

    @ns.shard_map(mesh=mesh, in_specs=(P("model"),), out_specs=P("model"))
    def shapes(m):
        seen.append((m.kernel.shape, m.bias.shape))
        return m.kernel[...]

    np.testing.assert_array_equal(shapes(model), model.kernel[...])
    assert seen == [((2, 8), (2,))]


def test_mesh_from_context(mesh):
    model = MLP(nnx.Rngs(0))
    forward = ns.shard_map(
        lambda m, x: jax.lax.psum(m(x), "model"),
        in_specs=(MEGATRON, P("data")),
        out_specs=P("data"),
    )
    with jax.set_mesh(mesh):
        out = forward(model, X)
    np.testing.assert_allclose(out, model(X), rtol=1e-6, atol=1e-6)


def test_counter_and_batchnorm_statistics_reach_the_caller(mesh):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.bn = nnx.BatchNorm(4, momentum=0.5, rngs=rngs)
            self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))

    net, ref = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 4))

    @ns.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    def step(n, x):
        n.count[...] += 1
        # per-shard statistics, averaged over the data axis: the global batch statistics
        mean = jax.lax.pmean(x.mean(0), "data")
        var = jax.lax.pmean((x**2).mean(0), "data") - mean**2
        n.bn.mean[...] = 0.5 * n.bn.mean[...] + 0.5 * mean
        n.bn.var[...] = 0.5 * n.bn.var[...] + 0.5 * var
        return x - mean

    out = step(net, x)
    ref.bn(x)  # eager reference on the whole batch (train mode updates the statistics)
    np.testing.assert_allclose(out, x - x.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.bn.mean[...], ref.bn.mean[...], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.bn.var[...], ref.bn.var[...], rtol=1e-5, atol=1e-5)
    assert int(net.count[...]) == 1
    step(net, x)
    assert int(net.count[...]) == 2


def test_updates_are_laid_out_by_the_variables_spec(mesh):
    model = MLP(nnx.Rngs(0))
    kernel = np.asarray(model.l1.kernel[...])

    @ns.shard_map(mesh=mesh, in_specs=(MEGATRON,), out_specs=P())
    def scale(m):
        m.l1.kernel[...] *= 2.0
        return m.count[...]

    scale(model)
    np.testing.assert_allclose(model.l1.kernel[...], 2 * kernel)
    assert model.l1.kernel[...].sharding.spec == P(None, "model")


def test_shared_references_and_outputs_that_are_inputs(mesh):
    model = MLP(nnx.Rngs(0))
    model.alias = model.l1  # the same submodule under two names

    @ns.shard_map(mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()))
    def same(m, other):
        assert m.alias is m.l1 and other is m.l1
        m.count[...] += 1
        return m, other

    m, other = same(model, model.l1)
    assert m is model and other is model.l1 and model.alias is model.l1
    assert int(model.count[...]) == 1


def test_new_module_in_output_with_state_sharding(mesh):
    model = MLP(nnx.Rngs(0))

    @ns.shard_map(mesh=mesh, in_specs=(MEGATRON,), out_specs=MEGATRON)
    def copy(m):
        return MLP(nnx.Rngs(0))

    new = copy(model)
    assert new is not model
    # each of the 4 'model' shards made a whole (4, 16) kernel: concatenated on 'model'
    assert new.l1.kernel.shape == (4, 64) and new.l2.kernel.shape == (64, 4)
    assert new.l1.kernel[...].sharding.spec == P(None, "model")


def test_fast_path_does_not_retrace(mesh):
    model = MLP(nnx.Rngs(0))
    traces = []

    @ns.shard_map(mesh=mesh, in_specs=(MEGATRON, P("data")), out_specs=P("data"))
    def forward(m, x):
        traces.append(1)
        m.count[...] += 1
        return jax.lax.psum(m(x), "model")

    forward(model, X)  # the first call moves the counter onto the mesh: jax traces again
    forward(model, X)
    warm = len(traces)
    for _ in range(5):
        forward(model, X)
    assert warm <= 2 and len(traces) == warm and int(model.count[...]) == 7


def test_jit_of_shard_map_and_its_stages(mesh):
    model = MLP(nnx.Rngs(0))
    inner = ns.shard_map(
        lambda m, x: jax.lax.psum(m(x), "model"),
        mesh=mesh,
        in_specs=(MEGATRON, P("data")),
        out_specs=P("data"),
    )

    @ns.jit
    def outer(m, x):
        m.count[...] += 1
        return inner(m, x) * 2

    np.testing.assert_allclose(outer(model, X), 2 * model(X), rtol=1e-5, atol=1e-6)
    compiled = outer.lower(model, X).compile()
    np.testing.assert_allclose(compiled(model, X), 2 * model(X), rtol=1e-5, atol=1e-6)
    assert int(model.count[...]) == 2
    assert "all-reduce" in compiled.as_text()


def test_shard_map_body_calls_a_jitted_function(mesh):
    model = MLP(nnx.Rngs(0))
    layer = ns.jit(lambda m, x: m.l2(m.l1(x)))

    @ns.shard_map(mesh=mesh, in_specs=(MEGATRON, P("data")), out_specs=P("data"))
    def forward(m, x):
        return jax.lax.psum(layer(m, x), "model")

    np.testing.assert_allclose(forward(model, X), model(X), rtol=1e-5, atol=1e-6)


def test_partial_manual_axes(mesh):
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    seen = []

    @ns.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"), axis_names={"data"})
    def forward(m, x):
        seen.append(x.shape)
        return m(x)

    np.testing.assert_allclose(forward(model, X), model(X), rtol=1e-6, atol=1e-6)
    assert seen == [(4, 4)]  # only 'data' is manual: 8 rows over 2 shards


def test_check_vma_false_passes_through(mesh):
    f = ns.shard_map(lambda x: x, mesh=mesh, in_specs=(P("data"),), out_specs=P())
    with pytest.raises(ValueError, match="out_specs"):
        f(X)  # a varying value under a replicated out_spec: refused by jax's check
    g = ns.shard_map(lambda x: x, mesh=mesh, in_specs=(P("data"),), out_specs=P(), check_vma=False)
    assert g(X).shape == (4, 4)


def test_old_spellings_are_mapped_with_a_warning(mesh):
    seen = []

    def body(x):
        seen.append(x.shape)
        return x

    with pytest.warns(DeprecationWarning, match=re.escape("`check_rep` is deprecated")):
        f = ns.shard_map(body, mesh=mesh, in_specs=(P("data"),), out_specs=P(), check_rep=False)
    assert f(X).shape == (4, 4)
    with pytest.warns(DeprecationWarning, match=re.escape("`auto` is deprecated")):
        g = ns.shard_map(
            body, mesh=mesh, in_specs=(P("data"),), out_specs=P("data"), auto={"model"}
        )
    np.testing.assert_array_equal(g(X), X)
    assert seen == [(4, 4), (4, 4)]


def test_explicit_axes_jit_shows_variable_shardings():
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit by default
    with jax.set_mesh(mesh):
        model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        model.kernel.set_value(jax.device_put(model.kernel[...], P(None, "model")))
        x = jax.device_put(X, P("data"))
        types = []

        @ns.jit
        def forward(m, x):
            types.append((str(jax.typeof(m.kernel[...])), str(jax.typeof(x))))
            return m(x)

        out = forward(model, x)
    assert types == [("float32[4,8@model]", "float32[8@data,4]")]
    np.testing.assert_allclose(out, X @ model.kernel[...] + model.bias[...], rtol=1e-5)


def test_explicit_axes_infer_in_specs():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        model.kernel.set_value(jax.device_put(model.kernel[...], P(None, "model")))
        x = jax.device_put(X, P("data"))
        seen = []

        @ns.shard_map(out_specs=P("data"))
        def forward(m, x):
            seen.append((m.kernel.shape, m.bias.shape, x.shape))
            return jax.lax.psum(x @ m.kernel[...], "model").sum(-1, keepdims=True)

        out = forward(model, x)
    assert seen == [((4, 2), (8,), (4, 4))]
    np.testing.assert_allclose(out, (X @ model.kernel[...]).sum(-1, keepdims=True), rtol=1e-5)


def test_explicit_axes_reshard_to_given_in_specs():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))  # not sharded yet
    f = ns.shard_map(lambda m, x: m(x), mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    np.testing.assert_allclose(f(model, X), model(X), rtol=1e-6)


# --- inputs placed, specs as written, prefix forms, messages (issue items 1-6) -----------

LINEAR_SPECS = {("kernel",): P(None, "model"), ("bias",): P("model")}


def linear_specs(state_sharding):
    return state_sharding({nnx.PathContains("kernel"): P(None, "model"), ...: P("model")})


def specs_of(node):
    return {p: v.get_value().sharding for p, v in nnx.to_flat_state(nnx.state(node))}


def test_inputs_come_back_laid_out_by_in_specs_as_in_flax(mesh):
    """Every input Variable, changed or not, holds its array laid out by its in_spec
    afterwards (as flax's shard_map leaves it), so later calls do not move it again."""
    placed = {}
    for name, shard_map, state_sharding in [
        ("flax", nnx.shard_map, nnx.StateSharding),
        ("ours", ns.shard_map, ns.StateSharding),
    ]:
        model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        kernel = np.asarray(model.kernel[...])
        shard_map(
            lambda m: None, mesh=mesh, in_specs=(linear_specs(state_sharding),), out_specs=P()
        )(model)
        np.testing.assert_array_equal(model.kernel[...], kernel)  # values untouched
        placed[name] = specs_of(model)
    assert placed["ours"] == placed["flax"]
    assert placed["ours"] == {p: NamedSharding(mesh, s) for p, s in LINEAR_SPECS.items()}


def test_inputs_keep_their_in_specs_as_written_as_in_flax(mesh):
    specs = {}
    for name, shard_map, state_sharding in [
        ("flax", nnx.shard_map, nnx.StateSharding),
        ("ours", ns.shard_map, ns.StateSharding),
    ]:
        model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        in_specs = state_sharding({nnx.PathContains("kernel"): P("data", None), ...: P(None)})
        shard_map(lambda m: None, mesh=mesh, in_specs=(in_specs,), out_specs=P())(model)
        specs[name] = {p: str(s.spec) for p, s in specs_of(model).items()}
    assert specs["ours"] == specs["flax"] == {("kernel",): "P('data', None)", ("bias",): "P(None,)"}


def test_placed_inputs_cost_nothing_on_later_calls(mesh):
    model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    traces = []

    @ns.shard_map(mesh=mesh, in_specs=(linear_specs(ns.StateSharding),), out_specs=P())
    def read(m):
        traces.append(1)
        return jax.lax.psum(m.bias[...].sum(), "model")

    read(model)  # moves the Variables onto the mesh: the next call traces for them there
    placed = model.kernel[...], model.bias[...]
    for _ in range(3):
        read(model)
    # laid out already: not returned by the program, nor written back, nor traced again
    assert (model.kernel[...], model.bias[...]) == placed
    assert model.kernel[...] is placed[0] and model.bias[...] is placed[1]
    assert len(traces) == 2
    # a value set later on one device is placed by the next call, like any other
    model.bias[...] = jnp.arange(8.0)
    np.testing.assert_allclose(read(model), jnp.arange(8.0).sum())
    assert specs_of(model)[("bias",)] == NamedSharding(mesh, P("model"))
    assert model.kernel[...] is placed[0]


def test_dict_and_list_specs_as_in_flax(mesh):
    outs = {}
    for name, shard_map in [("flax", nnx.shard_map), ("ours", ns.shard_map)]:
        model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        f = shard_map(
            lambda m, x: {"a": m(x), "b": [x, x.sum(0)]},
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs={"a": P("data"), "b": [P("data"), P("model")]},
            check_vma=False,
        )
        outs[name] = f(model, X)
        g = shard_map(
            lambda d: [d["x"] * 2], mesh=mesh, in_specs=({"x": P("data")},), out_specs=[P("data")]
        )
        outs[name + " in"] = g({"x": X})
    for name in ("", " in"):
        ours, theirs = outs["ours" + name], outs["flax" + name]
        assert jax.tree.structure(ours) == jax.tree.structure(theirs)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)
            assert a.sharding == b.sharding
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(outs["ours"]["a"], model(X), rtol=1e-6)


@pytest.mark.parametrize("spec", [P(None), P(None, "model"), P("data", None)])
def test_output_specs_are_kept_as_written_as_in_flax(mesh, spec):
    x = jnp.ones((4, 8))
    got = {}
    for name, shard_map in [("flax", nnx.shard_map), ("ours", ns.shard_map)]:
        f = shard_map(lambda x: {"y": x}, mesh=mesh, in_specs=(P(),), out_specs={"y": spec})
        got[name] = f(x)["y"]
    assert str(got["ours"].sharding.spec) == str(got["flax"].sharding.spec) == str(spec)
    with jax.set_mesh(mesh):  # mesh from the context: the same
        f = ns.shard_map(lambda x: x, in_specs=(P(),), out_specs=spec)
        assert str(f(x).sharding.spec) == str(spec)


@needs_nnx_prefix
def test_nnx_prefix_as_in_and_out_specs_as_in_flax(mesh):
    """``nnx.prefix(model, {filter: spec})`` stands for the module it was made of, as a
    StateSharding does (flax takes it with graph_updates=False)."""
    reference = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    results = {}
    for name, shard_map, options in [
        ("flax", nnx.shard_map, {"graph_updates": False}),
        ("ours", ns.shard_map, {}),
    ]:
        model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        specs = nnx.prefix(model, {nnx.PathContains("kernel"): P(None, "model"), ...: P("model")})
        seen = []

        def forward(m, x, seen=seen):
            seen.append((m.kernel.shape, m.bias.shape))
            return m(x)

        f = shard_map(
            forward, mesh=mesh, in_specs=(specs, P("data")), out_specs=P("data", "model"), **options
        )
        g = shard_map(
            lambda: nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
            mesh=mesh,
            in_specs=(),
            out_specs=specs,
            **options,
        )
        results[name] = (f(model, X), seen, g())
    (y, seen, new), (y_flax, seen_flax, new_flax) = results["ours"], results["flax"]
    np.testing.assert_allclose(y, reference(X), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, y_flax, rtol=1e-6)
    assert seen == seen_flax == [((4, 2), (2,))]
    assert specs_of(new) == specs_of(new_flax)
    assert {p: s.spec for p, s in specs_of(new).items()} == LINEAR_SPECS
    assert new.kernel.shape == new_flax.kernel.shape == (4, 32)  # 4 shards of (4, 8)


def test_state_of_specs_above_a_module(mesh):
    """An nnx.State of specs where the argument or output is a module reads as a
    StateSharding of exact paths; the output keeps the State's layout."""
    model, reference = nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    specs = nnx.State({"kernel": P(None, "model"), "bias": P("model")})
    f = ns.shard_map(nnx.clone, mesh=mesh, in_specs=(specs,), out_specs=specs)
    out = f(model)
    assert out is not model
    assert {p: s.spec for p, s in specs_of(out).items()} == LINEAR_SPECS
    assert specs_of(model) == specs_of(out)
    np.testing.assert_allclose(out.kernel[...], reference.kernel[...])
    # above a State argument (not a module) it is a pytree prefix as any other
    g = ns.shard_map(lambda s: s, mesh=mesh, in_specs=(specs,), out_specs=specs)
    state = g(nnx.state(reference))
    assert state["kernel"][...].sharding.spec == P(None, "model")
    wrong = ns.shard_map(
        nnx.clone, mesh=mesh, in_specs=(P(),), out_specs=nnx.State({**specs, "extra": P()})
    )
    with pytest.raises(ValueError, match=r"nnx.State at output has \.extra, which the graph node"):
        wrong(model)


@needs_flax_prefix_check
@pytest.mark.parametrize("argument", ["in_specs", "out_specs"])
def test_graph_node_as_specs_is_rejected_when_wrapped_as_in_flax(mesh, argument):
    options = {"in_specs": (P(),), "out_specs": P(), argument: nnx.Dict(a=P())}
    with pytest.raises(ValueError, match="Graph nodes are not allowed as prefixes"):
        nnx.shard_map(lambda m: m, mesh=mesh, **options)
    with pytest.raises(ValueError) as info:
        ns.shard_map(lambda m: m, mesh=mesh, **options)
    where = "args" if argument == "in_specs" else "output"
    assert str(info.value).startswith(
        f"shard_map: {argument}: found a graph node of type Dict at {where}\n"
    )
    assert 'flax: "Graph nodes are not allowed as prefixes"' in str(info.value)


FLAX_PHRASES = {  # misuse -> (the call, flax's words for it)
    "unknown_axis": (
        lambda sm, mesh: sm(lambda x: x, mesh=mesh, in_specs=(P(),), out_specs=P("nope"))(X),
        "out_specs argument must refer to an axis marked as manual",
    ),
    "string_spec": (
        lambda sm, mesh: sm(lambda x: x, mesh=mesh, in_specs=("data",), out_specs=P())(X),
        "in_specs argument must be a pytree of `jax.sharding.PartitionSpec` instances",
    ),
    "not_a_prefix": (
        lambda sm, mesh: sm(lambda x: x, mesh=mesh, in_specs=(P(), P()), out_specs=P())(X),
        "pytree structure error",
    ),
}


@pytest.mark.parametrize("case", FLAX_PHRASES)
def test_messages_carry_flax_words(mesh, case):
    trigger, phrase = FLAX_PHRASES[case]
    messages = []
    for shard_map in (nnx.shard_map, ns.shard_map):
        with pytest.raises((ValueError, TypeError)) as info:
            trigger(shard_map, mesh)
        messages.append(str(info.value))
    assert phrase in messages[0] and phrase in messages[1]
    assert messages[1].startswith("shard_map: ")  # ours, with the flax words added


def test_a_bound_method_of_a_module_is_refused_as_in_flax():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    for shard_map in (nnx.shard_map, ns.shard_map):
        with pytest.raises(ValueError, match="shard_map does not support bound methods"):
            shard_map(model.__call__, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"))
    with pytest.raises(ValueError, match=r"shard_map: f: a bound method of a graph node \(Linear"):
        ns.shard_map(model.__call__, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"))


def test_a_plain_array_attribute_updated_inside_is_written_back_as_in_flax():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    class Counter(nnx.Module):
        def __init__(self):
            self.count = jnp.array(0)  # outside any Variable
            self.w = nnx.Param(jnp.ones(2))

    def bump(c):
        c.count += 1
        return c.w[...]

    counts = []
    for shard_map in (nnx.shard_map, ns.shard_map):
        counter, f = Counter(), shard_map(bump, mesh=mesh, in_specs=(P(),), out_specs=P())
        for _ in range(3):
            f(counter)
        counts.append(int(counter.count))
    assert counts == [3, 3]


# --- the signature a user reads (inspect.signature, help) is flax's, plus jax's extras

SHARD_MAP_EXTRAS = {"check_rep", "auto"}  # jax.experimental.shard_map's deprecated spellings


def test_signature_has_every_parameter_of_flax_shard_map():
    import inspect
    import pydoc

    ours = inspect.signature(ns.shard_map).parameters
    theirs = inspect.signature(nnx.shard_map).parameters
    assert list(theirs)[0] == list(ours)[0] == "f"
    missing = [name for name in theirs if name not in ours]
    assert missing == [], f"flax's nnx.shard_map takes {missing}, nnx_sharding's does not"
    assert set(ours) - set(theirs) == SHARD_MAP_EXTRAS
    for name in list(theirs)[1:]:
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    for name in ("axis_names", "check_vma", "graph", "graph_updates"):
        assert ours[name].default == theirs[name].default, name
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values())
    text = pydoc.render_doc(ns.shard_map, renderer=pydoc.plaintext)
    assert all(f"{name}:" in text for name in theirs), text
