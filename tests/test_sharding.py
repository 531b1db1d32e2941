"""`StateSharding` and the sharding prefixes of `nnx_sharding.jit` (acceptance items 7, 11)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_flax_prefix_check, needs_nnx_prefix
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding import StateSharding
from nnx_sharding._sharding import accept_flax, from_flax

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
X = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)


def named(*spec):
    return NamedSharding(MESH, P(*spec))


A, B = named(), named("model")  # two distinct shardings


class MLP(nnx.Module):
    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.l2 = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


class Noisy(nnx.Module):
    """Holds Rng Variables (tagged 'dropout') next to Params."""

    def __init__(self):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.rngs = nnx.Rngs(dropout=1)


class Shared(nnx.Module):
    """The same Linear under two attribute names."""

    def __init__(self):
        self.first = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.second = self.first


class Annotated(nnx.Module):
    """Params carrying partitioning metadata, for `nnx.get_partition_spec`."""

    def __init__(self):
        kernel_init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        bias_init = nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",))
        self.lin = nnx.Linear(4, 8, kernel_init=kernel_init, bias_init=bias_init, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.lin(x)


def flat_variables(node):
    return {p: v for p, v in nnx.to_flat_state(nnx.state(node))}


def specs_of(node):
    """path -> PartitionSpec of the array each Variable holds now (else its sharding)."""
    shardings = {p: v.get_value().sharding for p, v in flat_variables(node).items()}
    return {p: getattr(s, "spec", s) for p, s in shardings.items()}


def sgd_step(model, x):
    """Updates every Variable: Params by SGD, BatchStats by BatchNorm in train mode."""

    def loss_fn(m):
        return jnp.mean(m(x) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    return loss


def assert_same_numbers(model, reference):
    got, want = flat_variables(model), flat_variables(reference)
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_allclose(got[path][...], want[path][...], rtol=1e-5, atol=1e-6)


MLP_SHARDING = StateSharding(
    [(nnx.PathContains("kernel"), P(None, "model")), ([nnx.Param, nnx.BatchStat], P("model"))]
)
MLP_SPECS = {  # what MLP_SHARDING gives each of MLP's Variables
    **{("bn", name): P("model") for name in ("bias", "mean", "scale", "var")},
    **{(layer, "bias"): P("model") for layer in ("l1", "l2")},
    **{(layer, "kernel"): P(None, "model") for layer in ("l1", "l2")},
}


# --- StateSharding ---------------------------------------------------------------------

KERNEL, BIAS = ("lin", "kernel"), ("lin", "bias")
RNG_KEY = ("rngs", "dropout", "key")
EXPECTED = {KERNEL: P(None, "model"), BIAS: named("model"), RNG_KEY: None}


def _spec_from_state():
    state = nnx.state(Noisy())
    flat = nnx.to_flat_state(state)
    return nnx.from_flat_state([(p, v.replace(EXPECTED.get(p))) for p, v in flat])


PAIRS = [(nnx.PathContains("kernel"), EXPECTED[KERNEL]), (nnx.Param, EXPECTED[BIAS])]
SPEC_FORMS = {
    "dict": lambda: {**dict(PAIRS), ...: None},
    "pairs": lambda: [*PAIRS, (..., None)],
    "generator": lambda: (pair for pair in [*PAIRS, ("dropout", None)]),
    "state": _spec_from_state,
}


@pytest.mark.parametrize("form", SPEC_FORMS)
def test_spec_forms_give_each_variable_its_value(form):
    sharding = StateSharding(SPEC_FORMS[form]())
    variables = flat_variables(Noisy())
    got = {p: sharding.sharding_for(p, v) for p, v in variables.items()}
    assert got[KERNEL] == P(None, "model")
    assert got[BIAS] == named("model") and isinstance(got[BIAS], NamedSharding)
    assert got[RNG_KEY] is None and got[("rngs", "dropout", "count")] is None


def test_state_spec_matches_exact_paths_only():
    sharding = StateSharding(_spec_from_state())
    with pytest.raises(ValueError, match=r"\.other\.kernel"):
        sharding.sharding_for(("other", "kernel"), nnx.Param(jnp.zeros(2)))


def test_state_spec_from_get_partition_spec():
    with nnx.use_eager_sharding(False):
        model = Annotated()
    sharding = StateSharding(nnx.get_partition_spec(nnx.state(model)))
    got = {p: sharding.sharding_for(p, v) for p, v in flat_variables(model).items()}
    assert got == {KERNEL: P(None, "model"), BIAS: P("model")}
    with jax.set_mesh(MESH):
        nnx_sharding.jit(sgd_step, in_shardings=(sharding, None))(model, X)
    assert specs_of(model) == got


FILTERS = [  # (filter, path, Variable, matches)
    (nnx.Param, KERNEL, nnx.Param(1.0), True),
    (nnx.Param, ("bn", "mean"), nnx.BatchStat(1.0), False),
    (nnx.BatchStat, ("bn", "mean"), nnx.BatchStat(1.0), True),
    ("dropout", RNG_KEY, nnx.RngKey(jax.random.key(0), tag="dropout"), True),
    ("dropout", KERNEL, nnx.Param(1.0), False),
    (nnx.PathContains("kernel"), KERNEL, nnx.Param(1.0), True),
    (nnx.PathContains("kernel"), BIAS, nnx.Param(1.0), False),
    (lambda path, v: path[-1] == "bias", BIAS, nnx.Param(1.0), True),
    (lambda path, v: path[-1] == "bias", KERNEL, nnx.Param(1.0), False),
    (..., RNG_KEY, nnx.RngKey(jax.random.key(0), tag="dropout"), True),
    ([nnx.BatchStat, "dropout"], ("bn", "var"), nnx.BatchStat(1.0), True),
    ([nnx.BatchStat, "dropout"], KERNEL, nnx.Param(1.0), False),
]


@pytest.mark.parametrize("filter_, path, variable, matches", FILTERS)
def test_filter_kinds(filter_, path, variable, matches):
    # a matching first filter gives A; otherwise the catch-all gives B
    sharding = StateSharding([(filter_, A), (..., B)])
    assert sharding.sharding_for(path, variable) == (A if matches else B)


def test_first_matching_filter_wins():
    kernel = nnx.Param(jnp.zeros((4, 8)))
    by_path_first = StateSharding([(nnx.PathContains("kernel"), A), (nnx.Param, B)])
    by_type_first = StateSharding([(nnx.Param, B), (nnx.PathContains("kernel"), A)])
    assert by_path_first.sharding_for(KERNEL, kernel) == A
    assert by_type_first.sharding_for(KERNEL, kernel) == B


def test_unmatched_variable_names_path_type_and_filters():
    sharding = StateSharding([(nnx.BatchStat, None), (nnx.PathContains("kernel"), P())])
    with pytest.raises(ValueError) as info:
        sharding.sharding_for(("layers", 0, "bias"), nnx.Param(jnp.zeros(3)))
    message = str(info.value)
    assert ".layers[0].bias" in message
    assert "(type Param)" in message
    assert repr(nnx.BatchStat) in message and "PathContains('kernel'" in message


def test_unmatched_variable_in_a_call_raises():
    f = nnx_sharding.jit(lambda m: None, in_shardings=StateSharding({nnx.BatchStat: None}))
    with pytest.raises(ValueError, match=r"^jit: in_shardings: ") as info:
        f(MLP())
    # every unmatched Variable, by its full path from the argument
    assert "Variable at args[0].bn.bias (type Param) matches none" in str(info.value)
    assert "Variable at args[0].l1.kernel (type Param) matches none" in str(info.value)


def test_equality_and_hash():
    def make():
        return StateSharding([([nnx.Param, nnx.BatchStat], P("model")), (..., named())])

    a, b = make(), make()
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a != StateSharding([([nnx.Param, nnx.BatchStat], P()), (..., named())])
    assert a != StateSharding([(..., named()), ([nnx.Param, nnx.BatchStat], P("model"))])
    assert a != {nnx.Param: P("model")}
    from_state = StateSharding(_spec_from_state())
    assert from_state == StateSharding(_spec_from_state())
    assert hash(from_state) == hash(StateSharding(_spec_from_state()))


def test_repr():
    sharding = StateSharding({nnx.Param: P(None, "model"), ...: None})
    assert repr(sharding) == "StateSharding({Param: P(None, 'model'), Ellipsis: None})"


@pytest.mark.parametrize("value", ["model", 3, ("data", None)])
def test_non_sharding_value_is_a_type_error(value):
    with pytest.raises(TypeError, match=r"the value for filter .*Param.* is a"):
        StateSharding({nnx.Param: value})


# --- in_shardings / out_shardings: acceptance item 7 -----------------------------------

IN_FORMS = {  # in_shardings -> per-path spec of MLP's Variables after the call
    "state_sharding_and_batch": ((MLP_SHARDING, P("data")), MLP_SPECS),
    "one_spec_for_all": (P(), dict.fromkeys(MLP_SPECS, P())),
    "one_named_sharding": (named(), dict.fromkeys(MLP_SPECS, P())),
    "state_from_nnx_state": (
        (StateSharding(jax.tree.map(lambda x: P("model"), nnx.state(MLP()))), None),
        dict.fromkeys(MLP_SPECS, P("model")),
    ),
}


@pytest.mark.parametrize("form", IN_FORMS)
def test_in_shardings_place_updated_variables(form):
    in_shardings, expected = IN_FORMS[form]
    model, reference = MLP(), MLP()
    with jax.set_mesh(MESH):
        loss = nnx_sharding.jit(sgd_step, in_shardings=in_shardings)(model, X)
    shardings = {p: v.get_value().sharding for p, v in flat_variables(model).items()}
    assert shardings == {p: NamedSharding(MESH, spec) for p, spec in expected.items()}
    np.testing.assert_allclose(loss, sgd_step(reference, X), rtol=1e-5)
    assert_same_numbers(model, reference)


def test_in_shardings_batch_spec_reaches_the_program():
    model = MLP()  # built outside the mesh: flax would shard it eagerly there
    f = nnx_sharding.jit(sgd_step, in_shardings=(MLP_SHARDING, P("data")))
    with jax.set_mesh(MESH):
        compiled = f.lower(model, X).compile()
    (_, kept), _ = compiled.input_shardings
    assert kept[-1].spec == P("data")  # the batch is the last flat leaf


@pytest.mark.parametrize("where", ["in_shardings", "out_shardings"])
def test_read_only_variables_are_resharded(where):
    model, reference = MLP(), MLP()
    if where == "in_shardings":
        f = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(MLP_SHARDING, None))
    else:
        f = nnx_sharding.jit(lambda m, x: (m, m(x)), out_shardings=(MLP_SHARDING, None))
    with jax.set_mesh(MESH):
        out = f(model, X)
    y = out if where == "in_shardings" else out[1]
    np.testing.assert_allclose(y, reference(X), rtol=1e-5, atol=1e-6)
    assert specs_of(model) == MLP_SPECS


def test_out_shardings_on_a_constructor():
    with jax.set_mesh(MESH):
        model = nnx_sharding.jit(lambda: MLP(seed=3), out_shardings=MLP_SHARDING)()
    assert specs_of(model) == MLP_SPECS
    assert model.l1.kernel.get_value().sharding == named(None, "model")
    assert_same_numbers(model, MLP(seed=3))


def test_out_shardings_on_arrays():
    out_shardings = (named("data"), named(None, "model"))
    a, b = nnx_sharding.jit(lambda x: (x * 2, jnp.sin(x)), out_shardings=out_shardings)(X)
    assert a.sharding == out_shardings[0] and b.sharding == out_shardings[1]
    np.testing.assert_allclose(a, X * 2)
    np.testing.assert_allclose(b, jnp.sin(X), rtol=1e-6)


SS = MLP_SHARDING
BAD_PREFIXES = [  # (option, value given the model, error, match); f(model, X) = model(X)
    ("in_shardings", lambda m: (m, None), ValueError, r"graph node of type MLP at args\[0\]"),
    ("out_shardings", lambda m: m, ValueError, r"out_shardings: found a graph node"),
    ("in_shardings", lambda m: (SS, None, None), ValueError, r"not a pytree prefix"),
    ("in_shardings", lambda m: (SS, (None, None)), ValueError, r"not a pytree prefix"),
    ("in_shardings", lambda m: (SS, SS), ValueError, r"StateSharding stands at args\[1\]"),
    ("out_shardings", lambda m: SS, ValueError, r"StateSharding stands at output, where"),
    ("in_shardings", lambda m: ("data", None), TypeError, r"found a str at args\[0\]"),
]


@pytest.mark.parametrize("option, value, error, match", BAD_PREFIXES)
def test_bad_prefix_is_rejected(option, value, error, match):
    model = MLP()
    with jax.set_mesh(MESH), pytest.raises(error, match=match):  # at creation or call
        nnx_sharding.jit(lambda m, x: m(x), **{option: value(model)})(model, X)


# --- aliasing: acceptance item 11 ------------------------------------------------------


def test_same_module_twice_with_two_shardings_names_both_paths():
    lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    f = nnx_sharding.jit(
        lambda a, b: a(X) + b(X),
        in_shardings=(StateSharding({nnx.Param: A}), StateSharding({nnx.Param: B})),
    )
    with pytest.raises(ValueError, match="shared reference") as info:
        f(lin, lin)
    assert "args[0].kernel" in str(info.value) and "args[1].kernel" in str(info.value)


def test_shared_submodule_with_two_path_shardings_names_both_paths():
    by_path = StateSharding([(nnx.PathContains("first"), A), (..., B)])
    with pytest.raises(ValueError, match="shared reference") as info:
        nnx_sharding.jit(lambda m: None, in_shardings=by_path)(Shared())
    assert "args[0].first.kernel" in str(info.value)
    assert "args[0].second.kernel" in str(info.value)


def test_input_and_output_shardings_conflict_names_both_paths():
    lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    f = nnx_sharding.jit(
        lambda m: m,
        in_shardings=StateSharding({nnx.Param: A}),
        out_shardings=StateSharding({nnx.Param: B}),
    )
    with pytest.raises(ValueError, match="shared reference") as info:
        f(lin)
    assert "args[0].kernel" in str(info.value) and "output.kernel" in str(info.value)


def double_kernels(*linears):
    for lin in linears:
        lin.kernel[...] = lin.kernel[...] * 2


def double_shared(model):
    double_kernels(model.first, model.second)


AGREEING = {  # make the arguments, function, in_shardings; the kernel ends up x4 each time
    "same_module_twice": (
        lambda: (nnx.Linear(4, 8, rngs=nnx.Rngs(0)),) * 2,
        double_kernels,
        (StateSharding({nnx.Param: A}),) * 2,
    ),
    "one_path_none": (
        lambda: (nnx.Linear(4, 8, rngs=nnx.Rngs(0)),) * 2,
        double_kernels,
        (StateSharding({nnx.Param: A}), None),
    ),
    "shared_submodule": (
        lambda: (Shared(),),
        double_shared,
        StateSharding([(nnx.PathContains("first"), A), (..., A)]),
    ),
}


@pytest.mark.parametrize("case", AGREEING)
def test_agreeing_aliases_are_fine(case):
    make, fun, in_shardings = AGREEING[case]
    args = make()
    kernel = nnx.Linear(4, 8, rngs=nnx.Rngs(0)).kernel[...]
    nnx_sharding.jit(fun, in_shardings=in_shardings)(*args)
    variable = args[0].first.kernel if case == "shared_submodule" else args[0].kernel
    np.testing.assert_allclose(variable[...], kernel * 4)
    assert variable.get_value().sharding == A


# --- static arguments -----------------------------------------------------------------


def test_static_argnums_with_in_shardings_for_dynamic_args_only():
    def step(model, scale, x):
        return sgd_step(model, x * scale)

    f = nnx_sharding.jit(step, static_argnums=1, in_shardings=(MLP_SHARDING, P("data")))
    model, reference = MLP(), MLP()
    with jax.set_mesh(MESH):
        loss = f(model, 2.0, X)
    assert specs_of(model) == MLP_SPECS
    np.testing.assert_allclose(loss, step(reference, 2.0, X), rtol=1e-5)
    assert_same_numbers(model, reference)

    one_entry_per_argument = nnx_sharding.jit(
        step, static_argnums=1, in_shardings=(MLP_SHARDING, None, P("data"))
    )
    with jax.set_mesh(MESH), pytest.raises(ValueError, match="pytree prefix"):
        one_entry_per_argument(MLP(), 2.0, X)


# --- flax's own nnx.StateSharding, accepted and converted ---------------------------------

MLP_PAIRS = [
    (nnx.PathContains("kernel"), P(None, "model")),
    ([nnx.Param, nnx.BatchStat], P("model")),
]
FLAX_MLP_SHARDING = nnx.StateSharding(MLP_PAIRS)


def test_flax_state_sharding_converts_to_ours():
    ours = from_flax(FLAX_MLP_SHARDING)
    assert type(ours) is StateSharding and ours == MLP_SHARDING
    prefix = (FLAX_MLP_SHARDING, [None, {"x": FLAX_MLP_SHARDING}], P("data"))
    assert accept_flax(prefix) == (
        MLP_SHARDING,
        [None, {"x": MLP_SHARDING}],
        P("data"),
    )
    unchanged = (MLP_SHARDING, None)
    assert accept_flax(unchanged) is unchanged


@pytest.mark.parametrize("where", ["in_shardings", "out_shardings"])
def test_jit_with_flax_state_sharding_shards_as_ours(where):
    def run(sharding):
        model = MLP()
        if where == "in_shardings":
            f = nnx_sharding.jit(sgd_step, in_shardings=(sharding, P("data")))
        else:
            f = nnx_sharding.jit(lambda m, x: (m, sgd_step(m, x)), out_shardings=(sharding, None))
        unplaced = MLP()  # built outside the mesh: flax would shard it eagerly there
        with jax.set_mesh(MESH):
            f(model, X)
            compiled = f.lower(unplaced, X).compile()
        variables = {p: v.get_value().sharding for p, v in flat_variables(model).items()}
        # output_shardings holds modules (equal only to themselves): compare its leaves
        return variables, compiled.input_shardings, jax.tree.leaves(compiled.output_shardings)

    ours, theirs = run(MLP_SHARDING), run(FLAX_MLP_SHARDING)
    assert theirs == ours
    assert {p: s.spec for p, s in theirs[0].items()} == MLP_SPECS


def test_jit_with_flax_state_sharding_from_a_state():
    spec = jax.tree.map(lambda x: P("model"), nnx.state(MLP()))
    model = MLP()
    with jax.set_mesh(MESH):
        nnx_sharding.jit(sgd_step, in_shardings=(nnx.StateSharding(spec), None))(model, X)
    assert specs_of(model) == dict.fromkeys(MLP_SPECS, P("model"))


def test_shard_map_with_flax_state_sharding():
    model, reference = nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    specs = nnx.StateSharding({nnx.PathContains("kernel"): P(None, "model"), ...: P("model")})
    seen = []

    @nnx_sharding.shard_map(mesh=MESH, in_specs=(specs, P("data")), out_specs=P("data", "model"))
    def forward(m, x):
        seen.append((m.kernel.shape, m.bias.shape, x.shape))
        return m(x)

    np.testing.assert_allclose(forward(model, X), reference(X), rtol=1e-6, atol=1e-6)
    assert seen == [((4, 2), (2,), (4, 4))]

    @nnx_sharding.shard_map(mesh=MESH, in_specs=(specs,), out_specs=specs)
    def copy(m):
        return nnx.clone(m)

    out = copy(model)
    assert out is not model
    assert specs_of(out) == {("kernel",): P(None, "model"), ("bias",): P("model")}
    assert_same_numbers(out, reference)


def test_flax_state_sharding_unmatched_variable_names_the_path():
    f = nnx_sharding.jit(lambda m: None, in_shardings=nnx.StateSharding({nnx.BatchStat: None}))
    with pytest.raises(ValueError, match=r"^jit: in_shardings: ") as info:
        f(MLP())
    assert "Variable at args[0].bn.bias (type Param) matches none" in str(info.value)
    g = nnx_sharding.shard_map(
        nnx.clone, mesh=MESH, in_specs=(P(),), out_specs=nnx.StateSharding({nnx.Param: P()})
    )
    with pytest.raises(ValueError, match=r"out_specs") as info:
        g(MLP())
    assert "output.bn.mean (type BatchStat) matches none" in str(info.value)


def test_flax_state_sharding_values_are_checked_as_ours():
    # flax's class takes any value; ours wants a Sharding, a PartitionSpec or None
    with pytest.raises(TypeError, match=r"the value for filter .*Param.* is a"):
        nnx_sharding.jit(lambda m: m, in_shardings=nnx.StateSharding({nnx.Param: "model"}))


def test_is_node_agrees_with_flax_and_caches_only_what_cannot_vary():
    """`is_node` answers from the type for plain values and concrete arrays; tracers and
    refs still get flax's own answer."""
    from flax.nnx import graph as nnx_graph

    from nnx_sharding._nodes import NOT_NODES, is_node

    values = [1, (1,), {}, [], None, "s", np.ones(2), jnp.ones(2), nnx.Param(jnp.ones(2))]
    values += [nnx.Linear(1, 1, rngs=nnx.Rngs(0)), nnx.List([]), jax.new_ref(jnp.ones(2))]
    for _ in range(2):  # the second round answers from the cache
        assert [is_node(v) for v in values] == [nnx_graph.is_graph_node(v) for v in values]
    assert type(jnp.ones(2)) in NOT_NODES and type(jax.new_ref(jnp.ones(2))) not in NOT_NODES

    @jax.jit
    def inside(x):
        ref = jax.new_ref(x)
        assert is_node(ref) and not is_node(x)  # tracers: never cached by type
        assert type(x) not in NOT_NODES
        return x

    inside(jnp.ones(2))


# --- prefix forms: dicts and lists, nnx.prefix, nnx.State; flax's words (issue items 2-6) -


def test_dict_and_list_prefixes_as_in_flax():
    data = {"x": X, "y": [X, X[0]]}
    outs, traces = {}, []

    def f(d):
        traces.append(1)
        return {"sum": d["x"] + d["y"][0], "parts": [d["y"][1] * 2]}

    for name, jit in [("flax", nnx.jit), ("ours", nnx_sharding.jit)]:
        g = jit(
            f,
            in_shardings=({"x": named("data"), "y": [named(), named("model")]},),
            out_shardings={"sum": named(None, "model"), "parts": [named()]},
        )
        outs[name] = (g(data), g(data))
    ours, theirs = outs["ours"][0], outs["flax"][0]
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
        assert a.sharding == b.sharding
    assert len(traces) == 2  # once each: the dict prefixes are part of a hashable plan
    # a list of per-argument shardings, as jax.jit takes it
    h = nnx_sharding.jit(lambda a, b: a + b, in_shardings=[named("data"), named()])
    np.testing.assert_allclose(h(X, X), 2 * X)
    assert h(X, X).sharding.is_equivalent_to(named("data"), 2)


NNX_PREFIX = {nnx.PathContains("kernel"): named(None, "model"), ...: named("model")}
LINEAR_SPECS = {("kernel",): P(None, "model"), ("bias",): P("model")}


@needs_nnx_prefix
def test_nnx_prefix_as_in_and_out_shardings_as_in_flax():
    """``nnx.prefix(model, {filter: sharding})`` stands for that module as the
    StateSharding of the same mapping does."""
    placed = {}
    for name, prefix in [
        ("flax", nnx.StateSharding(NNX_PREFIX)),  # flax pins in_shardings this way only
        ("ours", None),
    ]:
        model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        prefix = nnx.prefix(model, NNX_PREFIX) if prefix is None else prefix
        jit = nnx.jit if name == "flax" else nnx_sharding.jit
        jit(lambda m: None, in_shardings=(prefix,))(model)
        placed[name] = specs_of(model)
    assert placed["ours"] == placed["flax"] == LINEAR_SPECS
    made = {}
    for name, jit, options in [
        ("flax", nnx.jit, {"graph_updates": False}),  # flax takes it as out_shardings so
        ("ours", nnx_sharding.jit, {}),
    ]:
        prefix = nnx.prefix(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), NNX_PREFIX)
        made[name] = jit(
            lambda: nnx.Linear(4, 8, rngs=nnx.Rngs(0)), out_shardings=prefix, **options
        )()
    assert specs_of(made["ours"]) == specs_of(made["flax"]) == LINEAR_SPECS
    assert_same_numbers(made["ours"], made["flax"])


def test_state_of_shardings_above_a_module():
    """An nnx.State of shardings at a module's position reads as a StateSharding of
    exact paths (flax refuses it); above a State argument it is a plain pytree prefix."""
    shardings = nnx.State({"kernel": named(None, "model"), "bias": named("model")})
    model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    made = nnx_sharding.jit(nnx.clone, in_shardings=(shardings,), out_shardings=shardings)(model)
    assert specs_of(model) == specs_of(made) == LINEAR_SPECS
    state = nnx_sharding.jit(lambda s: s, in_shardings=(shardings,))(nnx.state(model))
    assert state["kernel"][...].sharding.spec == P(None, "model")


@pytest.mark.parametrize(
    "option, prefix, words",
    [
        ("in_shardings", nnx.Dict(a=P()), "Graph nodes are not allowed as prefixes"),
        ("out_shardings", (None, nnx.Dict(a=P())), "Graph nodes are not allowed as prefixes"),
        ("in_shardings", (nnx.Param(P()),), "Variables prefixes are not supported"),
    ],
)
@needs_flax_prefix_check
def test_graph_node_as_prefix_is_rejected_when_wrapped_as_in_flax(option, prefix, words):
    with pytest.raises(ValueError, match=words):
        nnx.jit(lambda m: m, **{option: prefix})
    with pytest.raises(ValueError) as info:
        nnx_sharding.jit(lambda m: m, **{option: prefix})
    where = {"in_shardings": "args", "out_shardings": "output[1]"}[option]
    where += "[0]" if isinstance(prefix, tuple) and option == "in_shardings" else ""
    kind = type(jax.tree.leaves(prefix, is_leaf=nnx.graph.is_graph_node)[-1]).__name__
    assert str(info.value).startswith(
        f"jit: {option}: found a graph node of type {kind} at {where}\n"
    )
    assert f'flax: "{words}"' in str(info.value)


def test_graph_node_in_prefix_names_the_argument_past_static_ones():
    with pytest.raises(ValueError, match=r"graph node of type MLP at args\[2\]"):
        nnx_sharding.jit(lambda a, s, m: m, static_argnums=1, in_shardings=(None, MLP()))


def _aliased(jit):
    lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    jit(lambda a, b: None, in_shardings=(named("data"), named()))(lin, lin)


def _committed_elsewhere(jit):
    x = jax.device_put(X, named("data"))
    jit(lambda x: x, in_shardings=(named("model"),))(x)


FLAX_PHRASES = {  # misuse -> (the call, given jit; flax's words for it)
    "aliased_variable": (_aliased, "Inconsistent aliasing detected"),
    "unhashable_static": (
        lambda jit: jit(lambda x, s: x, static_argnums=1)(X, [1]),
        "Non-hashable static arguments are not supported",
    ),
    "static_argnums_out_of_range": (
        lambda jit: jit(lambda x: x, static_argnums=3)(X),
        "only accepts 1 positional arguments",
    ),
    "unknown_static_argname": (
        lambda jit: jit(lambda x: x, static_argnames="zz")(X),
        "invalid argnames {'zz'} in static_argnames",
    ),
    "static_and_donated": (
        lambda jit: jit(lambda x: x, static_argnums=0, donate_argnums=0)(1),
        "static_argnames and donate_argnames cannot intersect",
    ),
    "not_a_prefix": (
        lambda jit: jit(lambda m, x: None, in_shardings=(P(), P(), P()))(MLP(), X),
        "pytree structure error",
    ),
    "string_entry": (
        lambda jit: jit(lambda x: x, in_shardings=("data",))(X),
        "in_shardings leaf specifications are expected to be PartitionSpec instances or None",
    ),
    "no_filter_matched": (
        lambda jit: jit(
            lambda m: None,
            in_shardings=(
                (nnx.StateSharding if jit is nnx.jit else StateSharding)({nnx.BatchStat: None}),
            ),
        )(nnx.Linear(4, 8, rngs=nnx.Rngs(0))),
        "No axis found for path",
    ),
    "committed_elsewhere": (
        _committed_elsewhere,
        "Sharding passed to jit does not match the sharding on the respective arg",
    ),
}


@pytest.mark.parametrize("case", FLAX_PHRASES)
def test_messages_carry_flax_words(case):
    """Code written against flax may match its messages: ours keep their own layout and
    carry flax's words for the same misuse."""
    trigger, phrase = FLAX_PHRASES[case]
    messages = []
    for jit in (nnx.jit, nnx_sharding.jit):
        with pytest.raises((ValueError, TypeError)) as info:
            trigger(jit)
        messages.append(str(info.value))
    assert phrase in messages[0], messages[0]
    assert messages[1].startswith("jit: ") and phrase in messages[1], messages[1]


def test_one_answer_to_what_is_a_tree_prefix() -> None:
    """``nnx.prefix(..., graph=True)``'s TreeState is recognised by flax's own type, on
    every path (the full path and the simple path asked two functions that could
    disagree: one matched the class name, and took a look-alike for it)."""
    from flax import nnx

    from nnx_sharding._callpath import simple
    from nnx_sharding._sharding import is_tree_state

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    assert is_tree_state(nnx.prefix(model, {...: None}, graph=True))
    assert not is_tree_state(nnx.prefix(model, {...: None}, graph=False))  # the module
    look_alike = type("TreeState", (), {"__module__": "flax.nnx.other"})()
    assert not is_tree_state(look_alike)
    assert simple.is_tree_state is is_tree_state  # the simple path asks the same function
