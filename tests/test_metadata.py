"""Shardings from Variable metadata: `StateSharding.from_metadata` and `nnx_sharding.shard`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding import StateSharding

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
RULES = [("batch", "data"), ("embed", None), ("mlp", "model")]
lecun, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()


def named(*spec, mesh=MESH):
    return NamedSharding(mesh, P(*spec))


def annotated(init, names, **metadata):
    return nnx.with_partitioning(init, names, **metadata)


class Block(nnx.Module):
    """Logical names on three Params; one Param and a BatchStat without metadata."""

    def __init__(self, up=("embed", "mlp"), down=("mlp", "embed"), din=4, **metadata):
        rngs = nnx.Rngs(0)
        with nnx.use_eager_sharding(False):
            self.up = nnx.Linear(
                din,
                8,
                kernel_init=annotated(lecun, up, **metadata),
                bias_init=annotated(zeros, ("mlp",)),
                rngs=rngs,
            )
            self.down = nnx.Linear(8, 4, kernel_init=annotated(lecun, down), rngs=rngs)
        self.steps = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


EXPECTED = {
    ("up", "kernel"): P(None, "model"),
    ("up", "bias"): P("model"),
    ("down", "kernel"): P("model", None),
    ("down", "bias"): P(),
    ("steps",): P(),
}


def entries(state_sharding):
    """path -> value of a StateSharding made of exact-path filters."""
    return {
        f.path: s for f, s in zip(state_sharding.filters, state_sharding.shardings, strict=True)
    }


def placed(node):
    """path -> (mesh, spec without trailing Nones) of each Variable's array."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(node)):
        sharding = var.get_value().sharding
        out[path] = sharding.mesh, normal(sharding.spec)
    return out


def normal(spec):
    """jax drops trailing Nones of specs it produces; so do the expectations."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def expected_placement(mesh=MESH):
    return {path: (mesh, normal(spec)) for path, spec in EXPECTED.items()}


def values(node):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(node))}


# --- StateSharding.from_metadata -------------------------------------------------------------


def test_from_metadata_maps_logical_names_through_rules():
    shardings = StateSharding.from_metadata(Block(), rules=RULES)
    assert entries(shardings) == EXPECTED
    assert shardings.sharding_for(("up", "kernel"), None) == P(None, "model")


def test_from_metadata_drives_jit_in_shardings_exactly():
    model, x = Block(), jnp.ones((8, 4))
    shardings = StateSharding.from_metadata(model, rules=RULES)

    @nnx_sharding.jit(in_shardings=(shardings, P("data")))
    def forward(model, x):
        return model(x)

    expected_out = nnx.clone(model)(x)
    with jax.set_mesh(MESH):
        out = forward(model, x)
    assert placed(model) == expected_placement()
    np.testing.assert_allclose(out, expected_out, rtol=1e-6)


def test_rules_none_reads_names_as_mesh_axes():
    model = Block(up=(None, "model"), down=("model", None))
    with pytest.raises(ValueError, match="no rule maps"):  # bias says 'mlp'; rules know nothing
        StateSharding.from_metadata(model, rules=[])
    shardings = entries(StateSharding.from_metadata(model))
    assert shardings[("up", "kernel")] == P(None, "model")
    assert shardings[("down", "kernel")] == P("model", None)
    assert shardings[("up", "bias")] == P("mlp")  # passed through unchanged, like flax


def test_rules_none_uses_flax_rules_in_context():
    with nnx.logical_axis_rules(RULES):
        shardings = StateSharding.from_metadata(Block())
    assert entries(shardings) == EXPECTED


def test_a_logical_name_may_map_to_several_mesh_axes():
    rules = [("embed", ("data", "model")), ("mlp", None)]
    shardings = entries(StateSharding.from_metadata(Block(din=8), rules=rules))
    assert shardings[("up", "kernel")] == P(("data", "model"), None)
    assert shardings[("down", "kernel")] == P(None, ("data", "model"))


def test_unknown_logical_names_name_every_variable_path():
    model = Block(up=("embed", "hidden"), down=("hidden", "emb"))
    with pytest.raises(
        ValueError, match=r"^StateSharding.from_metadata: rules: 3 problems"
    ) as info:
        StateSharding.from_metadata(model, rules=RULES)
    message = str(info.value)
    assert message.startswith("StateSharding.from_metadata: rules: 3 problems:")
    assert "the Variable at .up.kernel (Param) names the logical axis 'hidden'" in message
    assert "the Variable at .down.kernel (Param) names the logical axis 'hidden'" in message
    assert "the Variable at .down.kernel (Param) names the logical axis 'emb'" in message
    assert "rules map: 'batch', 'embed', 'mlp'." in message
    assert "  1. add a pair `(name, mesh axis or None)`" in message


def test_local_sharding_rules_metadata_count_as_known():
    model = Block(up=("embed", "hidden"), sharding_rules=(("hidden", "model"),))
    shardings = entries(StateSharding.from_metadata(model, rules=RULES))
    assert shardings[("up", "kernel")] == P(None, "model")


def test_sharding_names_alias_of_older_flax():
    with pytest.warns(DeprecationWarning, match="sharding_names"), nnx.use_eager_sharding(False):
        param = nnx.Param(jnp.ones((4, 8)), sharding_names=("embed", "mlp"))
    holder = nnx.Dict(w=param)
    assert entries(StateSharding.from_metadata(holder, rules=RULES)) == {("w",): P(None, "model")}


def test_mesh_metadata_gives_a_named_sharding():
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    shardings = entries(StateSharding.from_metadata(Block(mesh=mesh), rules=RULES))
    assert shardings[("up", "kernel")] == named(None, "model", mesh=mesh)
    assert shardings[("down", "kernel")] == P("model", None)


def test_axes_missing_from_the_mesh_in_context_are_reported():
    rules = [("embed", None), ("mlp", "tensor")]
    assert entries(StateSharding.from_metadata(Block(), rules=rules))[("up", "bias")] == P("tensor")
    with jax.set_mesh(MESH), pytest.raises(ValueError, match=r"\.up\.bias \(Param\) is sharded"):
        StateSharding.from_metadata(Block(), rules=rules)


@pytest.mark.parametrize(
    "rules, detail",
    [("embed", "got a str"), ([("embed",)], r"entry 0 is \('embed',\)"), ([(1, "x")], "entry 0")],
)
def test_malformed_rules_are_a_type_error(rules, detail):
    with pytest.raises(TypeError, match=rf"StateSharding.from_metadata: rules: {detail}"):
        StateSharding.from_metadata(Block(), rules=rules)


def test_shared_submodules_get_an_entry_at_every_path():
    class Tied(nnx.Module):
        def __init__(self):
            self.block = Block()
            self.again = self.block

    model = Tied()
    shardings = StateSharding.from_metadata(model, rules=RULES)
    assert entries(shardings)[("again", "up", "kernel")] == P(None, "model")

    @nnx_sharding.jit(in_shardings=(shardings,))
    def total(model):
        return model.again.up.kernel[...].sum()

    with jax.set_mesh(MESH):
        total(model)
    assert model.block.up.kernel.get_value().sharding == named(None, "model")


def test_state_sharding_from_a_state_accepts_shared_submodules():
    class Tied(nnx.Module):
        def __init__(self):
            self.block = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
            self.again = self.block

    model = Tied()
    shardings = StateSharding(nnx.get_named_sharding(nnx.state(model), MESH))

    @nnx_sharding.jit(in_shardings=(shardings,))
    def total(model):
        return model.again.kernel[...].sum()

    with jax.set_mesh(MESH):
        total(model)


def test_not_a_graph_node():
    with pytest.raises(TypeError, match=r"StateSharding.from_metadata: tree: found a list"):
        StateSharding.from_metadata([1, 2])


# --- shard ---------------------------------------------------------------------------------


def test_shard_places_in_place_and_keeps_values():
    model = Block()
    before = values(model)
    kernel_variable = model.up.kernel
    assert nnx_sharding.shard(model, MESH, rules=RULES) is model
    assert model.up.kernel is kernel_variable
    assert placed(model) == expected_placement()
    after = values(model)
    assert after.keys() == before.keys()
    for path in before:
        np.testing.assert_array_equal(after[path], before[path])


def test_shard_uses_the_mesh_in_context_and_explicit_axes():
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes
    model = Block()
    with jax.set_mesh(mesh):
        nnx_sharding.shard(model, rules=RULES)
    assert placed(model) == expected_placement(mesh)


def test_shard_without_a_mesh():
    with pytest.raises(ValueError, match=r"shard: mesh: no mesh was given and none is set"):
        nnx_sharding.shard(Block(), rules=RULES)


def test_shard_a_state():
    model = Block()
    state = nnx.state(model)
    assert nnx_sharding.shard(state, MESH, rules=RULES) is state
    assert state["up"]["kernel"].get_value().sharding == named(None, "model")


def test_shard_an_abstract_model_gives_sharded_shape_dtype_structs():
    abstract = nnx.eval_shape(Block)
    nnx_sharding.shard(abstract, MESH, rules=RULES)
    kernel = abstract.up.kernel.get_value()
    assert isinstance(kernel, jax.ShapeDtypeStruct)
    assert kernel.shape == (4, 8) and kernel.sharding == named(None, "model")


def test_shard_reports_specs_that_do_not_fit():
    model = Block(din=3, up=("mlp", None))  # 3 rows over a 4-way axis
    before = values(model)
    with pytest.raises(ValueError, match=r"shard: tree: the Variable at \.up\.kernel cannot be"):
        nnx_sharding.shard(model, MESH, rules=RULES)
    with pytest.raises(ValueError, match=r"mesh \{'data': 2, 'model': 4\} lacks"):
        nnx_sharding.shard(Block(), MESH, rules=[("embed", None), ("mlp", "tensor")])
    np.testing.assert_array_equal(values(model)[("down", "kernel")], before[("down", "kernel")])
    # all or nothing: the Variables that did fit were not moved either
    assert isinstance(model.down.kernel.get_value().sharding, jax.sharding.SingleDeviceSharding)


# --- shard with given shardings: jax.device_put for a module -----------------------------------

TP = StateSharding(
    {
        nnx.PathContains("kernel"): P(None, "model"),
        nnx.PathContains("bias"): P("model"),
        ...: P(),
    }
)


def test_shard_by_a_state_sharding_places_as_jit_does():
    """The placement `jit`'s in_shardings gives the module, without a call, in place."""
    model, reference = Block(), Block()
    before = values(model)
    kernel_variable = model.up.kernel
    with jax.set_mesh(MESH):
        assert nnx_sharding.shard(model, TP) is model
        nnx_sharding.jit(lambda m: None, in_shardings=(TP,))(reference)
    assert model.up.kernel is kernel_variable
    assert placed(model) == placed(reference)
    assert placed(model)[("up", "kernel")] == (MESH, P(None, "model"))
    assert placed(model)[("down", "bias")] == (MESH, P("model"))
    for path, value in values(model).items():
        np.testing.assert_array_equal(value, before[path])


def test_shard_moves_committed_arrays_for_jit():
    """The committed-array error's fix: `shard` first, then the call works."""
    model = Block()
    nnx_sharding.shard(model, named())  # committed, replicated
    forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(TP, None))
    x = jnp.ones((2, 4))
    with jax.set_mesh(MESH):
        with pytest.raises(ValueError, match="is committed to"):
            forward(model, x)
        nnx_sharding.shard(model, TP)
        y = forward(model, x)
    np.testing.assert_allclose(y, Block()(x), rtol=1e-6)


def test_shard_by_one_sharding_or_spec_and_none_entries():
    model = Block()
    nnx_sharding.shard(model, named())
    assert set(placed(model).values()) == {(MESH, P())}
    with jax.set_mesh(MESH):
        nnx_sharding.shard(model.up, P("model"))
    assert placed(model.up) == {("kernel",): (MESH, P("model")), ("bias",): (MESH, P("model"))}
    # None leaves a Variable as it is
    kernel = model.up.kernel.get_value()
    nnx_sharding.shard(model, StateSharding({nnx.PathContains("up"): None, ...: named()}))
    assert model.up.kernel.get_value() is kernel
    assert placed(model)[("down", "kernel")] == (MESH, P())


def test_shard_a_state_and_an_abstract_model_by_a_state_sharding():
    model = Block()
    state = nnx.state(model)
    abstract = nnx.eval_shape(Block)
    with jax.set_mesh(MESH):
        assert nnx_sharding.shard(state, TP) is state
        nnx_sharding.shard(abstract, TP)
    assert state["up"]["kernel"].get_value().sharding == named(None, "model")
    struct = abstract.up.kernel.get_value()
    assert isinstance(struct, jax.ShapeDtypeStruct) and struct.sharding == named(None, "model")


def test_shard_shared_variables_get_one_sharding():
    model = Block()
    model.tied = model.up  # a shared reference: two paths to the same Variables
    with jax.set_mesh(MESH):
        nnx_sharding.shard(model, TP)
        assert model.up.kernel.get_value().sharding == named(None, "model")
        assert model.tied.kernel is model.up.kernel
        both = StateSharding({nnx.PathContains("tied"): P(), ...: P("model")})
        with pytest.raises(ValueError, match=r"(?s)shard: shardings: .*through the alias"):
            nnx_sharding.shard(model, both)


def test_shard_given_shardings_errors_list_everything_and_change_nothing():
    model = Block()
    before = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}
    with pytest.raises(ValueError) as e:
        nnx_sharding.shard(model, StateSharding({nnx.BatchStat: P()}))
    assert str(e.value).startswith("shard: shardings: 4 problems:")
    assert "the Variable at .up.kernel (type Param) matches none of the filters" in str(e.value)
    with pytest.raises(ValueError) as e:
        nnx_sharding.shard(model, TP)  # PartitionSpecs, no mesh in context
    assert str(e.value).startswith("shard: shardings: 5 problems:")
    assert "P(None, 'model') for the Variable at .up.kernel needs a mesh" in str(e.value)
    with pytest.raises(ValueError) as e:
        nnx_sharding.shard(model, named(None, None, "model"))
    message = str(e.value)
    assert message.startswith("shard: tree: 5 problems:")
    assert "the Variable at .up.kernel cannot be placed: shape (4, 8)" in message
    assert "change the filter or spec for these Variables in shardings" in message
    with pytest.raises(TypeError, match=r"shard: rules: rules were given with shardings"):
        nnx_sharding.shard(model, TP, rules=RULES)
    with pytest.raises(TypeError, match=r"shard: shardings: found a dict"):
        nnx_sharding.shard(model, {nnx.Param: P()})
    for path, var in nnx.to_flat_state(nnx.state(model)):
        assert var.get_value() is before[path]


# --- shard's old keyword: `mesh` (renamed `shardings`) ---------------------------------------


def test_shard_old_mesh_keyword_places_as_shardings_with_a_deprecation_warning():
    reference, old = Block(), Block()
    nnx_sharding.shard(reference, shardings=MESH, rules=RULES)
    with pytest.warns(DeprecationWarning) as caught:
        assert nnx_sharding.shard(old, mesh=MESH, rules=RULES) is old
    assert placed(old) == placed(reference) == expected_placement()
    for path, value in values(reference).items():
        np.testing.assert_array_equal(values(old)[path], value)
    (warning,) = caught
    assert str(warning.message) == (
        "shard: `mesh` is deprecated; use `shardings`, which takes the same values "
        "(`nnx_sharding.shard(model, shardings=mesh)`). `mesh` will be removed in the next "
        "release."
    )
    # attributed to the caller's line (stacklevel), not to nnx_sharding: pyproject's
    # `error::DeprecationWarning:nnx_sharding` is for the package's own deprecated calls
    assert warning.filename == __file__


def test_shard_old_mesh_keyword_none_is_the_mesh_in_context():
    reference, old = Block(), Block()
    with jax.set_mesh(MESH):
        nnx_sharding.shard(reference, rules=RULES)
        with pytest.warns(DeprecationWarning, match="use `shardings`"):
            nnx_sharding.shard(old, mesh=None, rules=RULES)
    assert placed(old) == placed(reference) == expected_placement()


@pytest.mark.parametrize(
    "shardings, mesh", [(MESH, MESH), (P(), MESH), (P(), None)], ids=["mesh", "spec", "none"]
)
def test_shard_old_and_new_keyword_together_are_a_type_error(shardings, mesh):
    """``mesh=None`` counts as given; so does ``shardings`` unless None, its default."""
    model = Block()
    before = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}
    with pytest.raises(TypeError) as e:
        nnx_sharding.shard(model, shardings, mesh=mesh)
    assert str(e.value) == (
        "shard: mesh: given together with `shardings`, its new name\n"
        "Rule: `mesh` is the name `shardings` had before; it is accepted alone, with a "
        "DeprecationWarning, until the next release.\n"
        "Fixes:\n"
        "  1. pass the value once, as `shardings`: `nnx_sharding.shard(model, shardings=mesh)`."
    )
    for path, var in nnx.to_flat_state(nnx.state(model)):
        assert var.get_value() is before[path]
