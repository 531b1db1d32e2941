"""`Traced`/`Lowered`/`Compiled`: every `jax.stages` member, module arguments, AOT calls."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.experimental.layout import Format
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding import Compiled, Lowered, Traced

X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
Y = jnp.linspace(0.0, 1.0, 6).reshape(2, 3)


class Counter(nnx.Module):
    """A Linear plus a call counter updated in place."""

    def __init__(self, seed: int = 0):
        self.lin = nnx.Linear(4, 3, rngs=nnx.Rngs(seed))
        self.count = nnx.BatchStat(jnp.array(0))

    def __call__(self, x):
        self.count[...] += 1
        return self.lin(x)


def forward(model, x):
    return model(x)


def scaled(model, factor, x):
    return model(x) * factor


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def public(cls):
    return {n for n in dir(cls) if not n.startswith("_")}


STAGES = {"Traced": Traced, "Lowered": Lowered, "Compiled": Compiled}


# --- every member, against the same function through plain jax.jit on the flat arrays ---


def flat_reference(model, x):
    """`forward` as jax.jit sees it: ``(donated, kept)`` flat lists in, flat lists out.

    The first output stands where our program returns its static `OutPlan`.
    """
    graphdef, state = nnx.split(model)
    values, treedef = jax.tree.flatten(state)

    def forward(donated, kept):
        *variables, x = kept
        inner = nnx.merge(graphdef, jax.tree.unflatten(treedef, variables))
        y = inner(x)
        return None, [inner.count[...]], [y]

    return jax.jit(forward).trace([], [*values, x])


@pytest.fixture(scope="module")
def stages():
    ours = nnx_sharding.jit(forward).trace(Counter(), X)
    ref = flat_reference(Counter(), X)
    lowered, ref_lowered = ours.lower(), ref.lower()
    return {
        "Traced": (ours, ref),
        "Lowered": (lowered, ref_lowered),
        "Compiled": (lowered.compile(), ref_lowered.compile()),
    }


def same(name):
    return lambda o, r: getattr(o, name) == getattr(r, name)


def same_leaves(name):
    return lambda o, r: jax.tree.leaves(getattr(o, name)) == jax.tree.leaves(getattr(r, name))


def args_info(o, r):
    (state, x), kwargs = o.args_info
    return (
        isinstance(state, nnx.State)
        and kwargs == {}
        and set(dict(nnx.to_flat_state(state))) == {("count",), ("lin", "bias"), ("lin", "kernel")}
        and x.shape == X.shape
        and jax.tree.leaves(o.args_info) == jax.tree.leaves(r.args_info)
    )


def out_info(o, r):
    return o.out_info == r.out_info[2][0]  # one array output: given as itself


def out_tree(o, r):
    # the function's own output (one array), as out_info gives it; jax's is the flat
    # (OutPlan, updated Variables, outputs) of the program
    return o.out_tree == jax.tree.structure(o.out_info) == jax.tree.structure(r.out_info[2][0])


def compiled_call(o, r):
    model = Counter()
    values = jax.tree.leaves(nnx.state(model))
    _, [count], [y] = r([], [*values, X])  # jax's `call` is a static helper of __call__
    got = o.call(model, X)
    return np.allclose(got, y) and int(model.count[...]) == int(count) == 1


def memory(o, r):
    fields = [
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
    ]
    got, want = o.memory_analysis(), r.memory_analysis()
    return [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]


SHARED = {
    "args_info": args_info,
    "donate_argnums": same("donate_argnums"),
    "in_avals": same("in_avals"),
    "in_tree": same("in_tree"),
    "out_info": out_info,
    "out_tree": out_tree,
}
CHECKS = {
    "Traced": {
        **SHARED,
        "fun_name": lambda o, r: o.fun_name == r.fun_name == "forward",
        "jaxpr": lambda o, r: str(o.jaxpr) == str(r.jaxpr) and "dot_general" in str(o.jaxpr),
        "lojax": lambda o, r: type(o.lojax) is type(r.lojax),
        "out_avals": lambda o, r: o.out_avals == r.out_avals[2][0],  # as out_info
        "lower": lambda o, r: (
            isinstance(low := o.lower(lowering_platforms=("cpu",)), Lowered)
            and low.as_text() == r.lower(lowering_platforms=("cpu",)).as_text()
        ),
    },
    "Lowered": {
        **SHARED,
        "as_text": lambda o, r: (
            o.as_text() == r.as_text()
            and "func" in o.as_text()
            and o.as_text("hlo") == r.as_text("hlo")
        ),
        "compiler_ir": lambda o, r: (
            o.compiler_ir("stablehlo") is not None
            and str(o.compiler_ir("stablehlo")) == str(r.compiler_ir("stablehlo"))
        ),
        "cost_analysis": lambda o, r: o.cost_analysis() == r.cost_analysis(),
        "compile": lambda o, r: (
            isinstance(
                c := o.compile(compiler_options={"xla_cpu_enable_fast_math": False}), Compiled
            )
            and np.allclose(c(Counter(), X), Counter()(X))
        ),
    },
    "Compiled": {
        **SHARED,
        "as_text": lambda o, r: (  # later lines name source files
            o.as_text().startswith("HloModule jit_forward")
            and o.as_text().splitlines()[0] == r.as_text().splitlines()[0]
        ),
        "call": compiled_call,
        "cost_analysis": lambda o, r: o.cost_analysis() == r.cost_analysis(),
        "memory_analysis": memory,
        "runtime_executable": lambda o, r: (
            type(o.runtime_executable()) is type(r.runtime_executable())
        ),
        "input_formats": same("input_formats"),
        "input_shardings": same("input_shardings"),
        "output_formats": lambda o, r: o.output_formats == r.output_formats[2][0],
        "output_shardings": lambda o, r: o.output_shardings == r.output_shardings[2][0],
    },
}
MEMBERS = [  # every public member of jax's class and of ours
    (s, n)
    for s, cls in STAGES.items()
    for n in sorted(public(getattr(jax.stages, s)) | public(cls))
]


@pytest.mark.parametrize("stage", STAGES)
def test_every_jax_member_exists_and_is_checked(stage):
    jax_members = public(getattr(jax.stages, stage))
    assert jax_members <= public(STAGES[stage])
    assert set(CHECKS[stage]) == jax_members | public(STAGES[stage])


@pytest.mark.parametrize("stage, member", MEMBERS)
def test_member_matches_jax(stages, stage, member):
    ours, ref = stages[stage]
    assert type(ours) is STAGES[stage]
    assert CHECKS[stage][member](ours, ref)


# --- entry points ------------------------------------------------------------------------


def test_jit_wrapped_trace_and_lower():
    f = nnx_sharding.jit(forward)
    model = Counter()
    traced, lowered = f.trace(model, X), f.lower(model, X)
    assert isinstance(traced, Traced) and isinstance(lowered, Lowered)
    assert lowered.as_text() == traced.lower().as_text()
    assert int(model.count[...]) == 0  # tracing and lowering run nothing


# --- args_info / out_info in the caller's structure --------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_args_info_gives_graph_nodes_as_states(stage):
    model = Counter()
    obj = nnx_sharding.jit(forward, donate_argnums=0).trace(model, X)
    obj = obj if stage == "Traced" else obj.lower()
    obj = obj.compile() if stage == "Compiled" else obj
    (state, x), kwargs = obj.args_info
    assert isinstance(state, nnx.State) and kwargs == {}
    infos = dict(nnx.to_flat_state(state))
    assert {p: i.shape for p, i in infos.items()} == {
        ("count",): (),
        ("lin", "bias"): (3,),
        ("lin", "kernel"): (4, 3),
    }
    assert all(isinstance(i, jax.stages.ArgInfo) and i.donated for i in infos.values())
    assert x.shape == (2, 4) and not x.donated


@pytest.mark.parametrize("stage", STAGES)
def test_out_info_gives_graph_nodes_as_abstract_modules(stage):
    model = Counter()
    obj = nnx_sharding.jit(lambda m: (m, m.count[...] + 1)).trace(model)
    obj = obj if stage == "Traced" else obj.lower()
    obj = obj.compile() if stage == "Compiled" else obj
    out_model, count = obj.out_info
    assert type(out_model) is Counter and out_model is not model
    kernel = out_model.lin.kernel.get_value()
    assert isinstance(kernel, jax.ShapeDtypeStruct) and kernel.shape == (4, 3)
    assert count.shape == () and count.dtype == jnp.int32


def test_out_info_of_a_constructor():
    out = nnx_sharding.jit(lambda: Counter(seed=1)).trace().out_info
    assert type(out) is Counter
    assert {p: v.get_value().shape for p, v in nnx.to_flat_state(nnx.state(out))} == {
        ("count",): (),
        ("lin", "bias"): (3,),
        ("lin", "kernel"): (4, 3),
    }


# --- Compiled.__call__ -------------------------------------------------------------------


def test_compiled_propagates_updates_like_jit():
    model = Counter()
    reference = nnx.clone(model)
    compiled = nnx_sharding.jit(forward).lower(model, X).compile()
    jitted = nnx_sharding.jit(forward)
    for step in (1, 2):
        np.testing.assert_allclose(compiled(model, X), jitted(reference, X), rtol=1e-6)
        assert int(model.count[...]) == int(reference.count[...]) == step


def test_compiled_optimizer_step_like_jit():
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    ref_model, ref_optimizer = nnx.clone(model), nnx.clone(optimizer)
    compiled = nnx_sharding.jit(train_step).lower(model, optimizer, X, Y).compile()
    jitted = nnx_sharding.jit(train_step)
    for step in (1, 2, 3):
        loss = compiled(model, optimizer, X, Y)
        np.testing.assert_allclose(loss, jitted(ref_model, ref_optimizer, X, Y), rtol=1e-6)
        assert int(optimizer.step[...]) == int(ref_optimizer.step[...]) == step
    np.testing.assert_allclose(model.kernel[...], ref_model.kernel[...], rtol=1e-6)
    np.testing.assert_allclose(model.bias[...], ref_model.bias[...], rtol=1e-6)
    for got, want in zip(
        jax.tree.leaves(nnx.state(optimizer)),
        jax.tree.leaves(nnx.state(ref_optimizer)),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert not np.allclose(model.kernel[...], Counter().lin.kernel[...])  # it did train


def test_compiled_call_is_dunder_call():
    assert Compiled.call is Compiled.__call__
    model, other = Counter(), Counter()
    compiled = nnx_sharding.jit(forward).lower(model, X).compile()
    np.testing.assert_array_equal(compiled.call(model, X), compiled(other, X))
    assert int(model.count[...]) == int(other.count[...]) == 1


def _with_extra_attribute():
    model = Counter()
    model.extra = nnx.Param(jnp.zeros(2))
    return model


def _with_wider_kernel():
    model = Counter()
    model.lin.kernel.set_value(jnp.zeros((4, 5)))
    return model


MISMATCHES = {  # call -> (args, kwargs); compiled for forward(Counter(), X)
    "extra_attribute": (
        lambda: ((_with_extra_attribute(), X), {}),
        r"graph node at args\[0\] has another structure: "
        r"args\[0\]\.extra: not in the compiled program \(here: a Param\)",
    ),
    "array_shape": (
        lambda: ((Counter(), jnp.ones((3, 4))), {}),
        r"args\[1\]: got float32\[3, 4\], compiled for float32\[2, 4\]",
    ),
    "array_dtype": (
        lambda: ((Counter(), X.astype(jnp.int32)), {}),
        r"args\[1\]: got int32\[2, 4\], compiled for float32\[2, 4\]",
    ),
    "variable_shape": (
        lambda: ((_with_wider_kernel(), X), {}),
        r"args\[0\]\.lin\.kernel: got float32\[4, 5\], compiled for float32\[4, 3\]",
    ),
    "keyword_argument": (lambda: ((Counter(),), {"x": X}), r"argument structure"),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_compiled_rejects_other_structures(case):
    make, match = MISMATCHES[case]
    compiled = nnx_sharding.jit(forward).lower(Counter(), X).compile()
    args, kwargs = make()
    with pytest.raises(TypeError, match=match) as info:
        compiled(*args, **kwargs)
    assert "lowered for" in str(info.value)
    assert int(args[0].count[...]) == 0  # nothing ran


def test_compiled_rejects_another_static_argument():
    compiled = nnx_sharding.jit(scaled, static_argnums=1).lower(Counter(), 2, X).compile()
    np.testing.assert_allclose(compiled(Counter(), 2, X), Counter()(X) * 2, rtol=1e-6)
    with pytest.raises(
        TypeError, match=r"static arguments \(\(1, 3\),\) differ from \(\(1, 2\),\)"
    ):
        compiled(Counter(), 3, X)


class Holder(nnx.Module):
    def __init__(self):
        self.counter = Counter()

    @nnx_sharding.jit
    def run(self, x):
        return self.counter(x)


def test_compiled_from_a_method_takes_the_method_arguments():
    holder, reference = Holder(), Holder()
    compiled = holder.run.lower(X).compile()
    np.testing.assert_allclose(compiled(X), reference.run(X), rtol=1e-6)
    assert int(holder.counter.count[...]) == 1


# --- out_tree of the function's output; Compiled names what differs (issue items 7, 8) --


def _shard_mapped():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    return nnx_sharding.shard_map(
        lambda m, x: {"y": m(x), "model": m}, mesh=mesh, in_specs=(P(), P()), out_specs=P()
    )


@pytest.mark.parametrize("transform", ["jit", "shard_map"])
def test_out_tree_is_the_structure_of_out_info(transform):
    """out_tree describes the function's output, graph nodes included, as out_info does
    (not the program's flat outputs, which carry the package's own plan)."""
    model = Counter()
    if transform == "jit":
        f = nnx_sharding.jit(lambda m, x: {"y": m(x), "model": m})
    else:
        f = _shard_mapped()
    traced = f.trace(model, X)
    lowered = traced.lower()
    compiled = lowered.compile()
    expected = jax.tree.structure({"y": X, "model": Counter()})
    for stage in (traced, lowered, compiled):
        assert stage.out_tree == jax.tree.structure(stage.out_info) == expected
        assert stage.out_tree.num_leaves == len(jax.tree.leaves(stage.out_info)) == 4
    for member in (traced.out_avals, compiled.output_shardings, compiled.output_formats):
        assert jax.tree.structure(member) == expected
    out = compiled(model, X)
    assert jax.tree.structure(out) == compiled.out_tree


def _updated(m, x):
    m.lin.kernel[...] += 1.0
    return {"y": m(x), "model": m}


def _returned_as_is(m, x):  # every Variable read, none changed: each goes back as it came
    return m, (x @ m.lin.kernel[...] + m.lin.bias[...]) * m.count[...]


OUTPUT_MEMBERS = {
    "trace": ("out_info", "out_avals"),
    "lower": ("out_info",),
    "compile": ("out_info", "output_shardings", "output_formats"),
}


def _stage(f, stage, *args):
    traced = f.trace(*args)
    if stage == "trace":
        return traced
    lowered = traced.lower()
    return lowered if stage == "lower" else lowered.compile()


@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "sharded"])
@pytest.mark.parametrize("fun", [forward, _updated, _returned_as_is])
@pytest.mark.parametrize("stage", OUTPUT_MEMBERS)
def test_output_members_have_the_structure_of_jax_jits(stage, fun, sharded):
    """Every member jax unflattens with out_tree comes in our out_tree's structure,
    leaf for leaf as jax.jit gives it for the same function of the module pytree."""
    model = Counter()
    if sharded:
        mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
        kernel = model.lin.kernel
        kernel.set_value(jax.device_put(kernel.get_value(), NamedSharding(mesh, P(None, None))))
        x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("model")))
    else:
        x = X
    ours = _stage(nnx_sharding.jit(fun), stage, model, x)
    theirs = _stage(jax.jit(fun), stage, model, x)
    assert ours.out_tree == theirs.out_tree
    for member in OUTPUT_MEMBERS[stage]:
        got, want = getattr(ours, member), getattr(theirs, member)
        assert jax.tree.structure(got) == ours.out_tree, member
        got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
        ndims = [len(info.shape) for info in jax.tree.leaves(theirs.out_info)]
        for a, b, ndim in zip(got_leaves, want_leaves, ndims, strict=True):
            assert _equivalent(a, b, ndim), (member, a, b)


def _equivalent(a, b, ndim=None):
    """Equal, but shardings compared by placement: an input returned as it came keeps
    its own spec (``P(None, None)``) where jax's new output has the normal form ``P()``."""
    if isinstance(a, jax.sharding.Sharding) and isinstance(b, jax.sharding.Sharding):
        return a.is_equivalent_to(b, ndim)
    if isinstance(a, jax.ShapeDtypeStruct) and isinstance(b, jax.ShapeDtypeStruct):
        return (a.shape, a.dtype, a.weak_type) == (b.shape, b.dtype, b.weak_type) and (
            _equivalent(a.format, b.format, a.ndim)
        )
    if isinstance(a, Format) and isinstance(b, Format):
        return a.layout == b.layout and _equivalent(a.sharding, b.sharding, ndim)
    return a == b


def test_an_input_the_program_drops_is_described_as_jax_describes_its_input():
    """A Variable neither read nor changed never enters the program (jax drops unused
    inputs): its entry is what jax reports for the dropped input, with no sharding."""
    model = Counter()
    compiled = nnx_sharding.jit(lambda m, x: (m, x @ m.lin.kernel[...])).lower(model, X).compile()
    reference = jax.jit(lambda m, x: (m, x @ m.lin.kernel[...])).lower(model, X).compile()
    assert compiled.out_tree == reference.out_tree
    out_model, _ = compiled.output_shardings
    assert out_model.count.get_value() is None and out_model.lin.bias.get_value() is None
    assert out_model.lin.kernel.get_value() == reference.output_shardings[0].lin.kernel.get_value()
    info, _ = compiled.out_info
    assert info.count.get_value() == jax.ShapeDtypeStruct((), jnp.int32)


def _renamed_feature():
    model = Counter()
    model.lin.in_features = 5
    return model


def _without_count():
    model = Counter()
    del model.count
    return model


def _count_as_param():
    model = Counter()
    model.count = nnx.Param(jnp.array(0))
    return model


def _shared_twice():
    model = Counter()
    model.alias = model.lin
    return model


def _unshared_twice():
    model = Counter()
    model.alias = Counter().lin
    return model


ATTRIBUTE_CHANGES = {  # made -> what the message says, for forward compiled for Counter()
    "added": (
        lambda: (_with_extra_attribute(), Counter()),
        [r"args\[0\]\.extra: not in the compiled program \(here: a Param\)"],
    ),
    "removed": (
        lambda: (_without_count(), Counter()),
        [r"args\[0\]\.count: missing \(the compiled program has a BatchStat there\)"],
    ),
    "static_value": (
        lambda: (_renamed_feature(), Counter()),
        [r"args\[0\]\.lin\.in_features: 5 here, 4 in the compiled program"],
    ),
    "variable_type": (
        lambda: (_count_as_param(), Counter()),
        [r"args\[0\]\.count: a Param here, a BatchStat in the compiled program"],
    ),
    "sharing": (
        lambda: (_unshared_twice(), _shared_twice()),
        [r"args\[0\]\.lin: a separate object here, the object at args\[0\]\.alias in the"],
    ),
}


@pytest.mark.parametrize("case", ATTRIBUTE_CHANGES)
def test_compiled_names_each_attribute_that_differs(case):
    make, patterns = ATTRIBUTE_CHANGES[case]
    called, compiled_for = make()
    compiled = nnx_sharding.jit(forward).lower(compiled_for, X).compile()
    with pytest.raises(TypeError) as info:
        compiled(called, X)
    message = str(info.value)
    assert message.startswith("jit: arguments: the graph node at args[0] has another structure: ")
    assert all(re.search(p, message) for p in patterns), message
    assert (  # jax's words (through flax) for a call that does not fit the compiled pytree
        "Function compiled with input pytree does not match the input pytree it was called with"
        in message
    )


def test_compiled_names_every_difference_and_flax_words_for_types():
    model = _with_extra_attribute()
    model.lin.extra_b = nnx.Param(jnp.ones(2))
    del model.count
    compiled = nnx_sharding.jit(forward).lower(Counter(), X).compile()
    with pytest.raises(TypeError) as info:
        compiled(model, X)
    message = str(info.value).splitlines()[0]
    for path in ("args[0].count: missing", "args[0].extra: not in", "args[0].lin.extra_b: not in"):
        assert path in message
    # shapes: flax (jax) and ours say it in the same words
    flax_compiled = nnx.jit(forward).lower(Counter(), X).compile()
    words = "Argument types differ from the types for which this computation was compiled"
    with pytest.raises(TypeError, match=words):
        flax_compiled(Counter(), jnp.ones((3, 4)))
    with pytest.raises(TypeError, match=words):
        compiled(Counter(), jnp.ones((3, 4)))


# --- the simple path (graph=False, graph_updates=False): the same classes, the same rows ---

SIMPLE_MODES = {"tree": dict(graph=False), "no-updates": dict(graph_updates=False)}


def _fresh(m, x):  # a new module out: the simple path forbids returning an input Variable
    return {"y": m(x), "model": nnx.Linear(2, 3, rngs=nnx.Rngs(1))}


def _simple_transforms(mode, fun):
    """(our shard_map, the same function through plain jax of the module pytree)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    specs = dict(mesh=mesh, in_specs=(P(), P()), out_specs=P())
    ours = nnx_sharding.shard_map(fun, **specs, **SIMPLE_MODES[mode])
    return ours, jax.jit(jax.shard_map(fun, **specs), keep_unused=True)


@pytest.fixture(scope="module", params=[(t, m) for t in ("jit", "shard_map") for m in SIMPLE_MODES])
def simple_stages(request):
    transform, mode = request.param
    if transform == "jit":
        # keep_unused: jax's program would drop the count, whose update it loses
        ours_f = nnx_sharding.jit(_fresh, **SIMPLE_MODES[mode])
        ref_f = jax.jit(_fresh, keep_unused=True)
    else:
        ours_f, ref_f = _simple_transforms(mode, _fresh)
    model = Counter()
    ours, ref = ours_f.trace(model, X), ref_f.trace(model, X)
    lowered, ref_lowered = ours.lower(), ref.lower()
    return mode, {
        "Traced": (ours, ref),
        "Lowered": (lowered, ref_lowered),
        "Compiled": (lowered.compile(), ref_lowered.compile()),
    }


def _leaves_equal(name):
    return lambda o, r: jax.tree.leaves(getattr(o, name)) == jax.tree.leaves(getattr(r, name))


def _out_structured(name):
    """The member in out_tree's structure, leaf for leaf as jax.jit of the pytree gives it."""

    def check(o, r):
        got, want = getattr(o, name), getattr(r, name)
        return (
            jax.tree.structure(got) == o.out_tree == r.out_tree
            and len(jax.tree.leaves(got)) == 3  # y, the new Linear's bias and kernel
            and all(
                _equivalent(a, b)
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
            )
        )

    return check


def _simple_args_info(o, r):
    (state, x), kwargs = o.args_info
    return (
        isinstance(state, nnx.State)
        and kwargs == {}
        and set(dict(nnx.to_flat_state(state))) == {("count",), ("lin", "bias"), ("lin", "kernel")}
        and x.shape == X.shape
        and jax.tree.leaves(o.args_info) == jax.tree.leaves(r.args_info)
    )


def _simple_call(o, r):
    model, reference = Counter(), Counter()
    got = o(model, X)
    want = r(reference, X)  # jax's pytree call: the count update is lost
    return (
        type(got["model"]) is nnx.Linear
        and np.allclose(got["y"], want["y"])
        and np.allclose(got["model"].kernel[...], want["model"].kernel[...])
        and int(model.count[...]) == 1  # written back, as the transform's call does
    )


SIMPLE_SHARED = {
    "args_info": _simple_args_info,
    "donate_argnums": same("donate_argnums"),
    "in_avals": _leaves_equal("in_avals"),
    # the program's inputs: the module pytree (tree mode) or its flattened TreeNode
    "in_tree": lambda o, r: o.in_tree.num_leaves == r.in_tree.num_leaves,
    "out_info": _out_structured("out_info"),
    "out_tree": lambda o, r: o.out_tree == jax.tree.structure(o.out_info) == r.out_tree,
}
SIMPLE_CHECKS = {
    "Traced": {
        **SIMPLE_SHARED,
        "fun_name": lambda o, r: o.fun_name == "_fresh",
        # the program: the function plus the Variable updates (the count) as outputs
        "jaxpr": lambda o, r: (
            "dot_general" in str(o.jaxpr) and len(o.jaxpr.out_avals) == len(r.jaxpr.out_avals) + 1
        ),
        "lojax": lambda o, r: type(o.lojax) is type(r.lojax),
        "out_avals": _out_structured("out_avals"),
        "lower": lambda o, r: (
            isinstance(low := o.lower(lowering_platforms=("cpu",)), Lowered)
            and "func" in low.as_text()
        ),
    },
    "Lowered": {
        **SIMPLE_SHARED,
        "as_text": lambda o, r: "func" in o.as_text() and "HloModule" in o.as_text("hlo"),
        "compiler_ir": lambda o, r: "func" in str(o.compiler_ir("stablehlo")),
        "cost_analysis": lambda o, r: (  # unoptimized: the copies differ, not the init
            o.cost_analysis()["flops"] > 0
            and o.cost_analysis()["transcendentals"] == r.cost_analysis()["transcendentals"]
        ),
        "compile": lambda o, r: (
            isinstance(c := o.compile(), Compiled) and _simple_call(c, r.compile())
        ),
    },
    "Compiled": {
        **SIMPLE_SHARED,
        "as_text": lambda o, r: o.as_text().startswith("HloModule jit_"),
        "call": lambda o, r: _simple_call(o.call, r),
        "cost_analysis": lambda o, r: o.cost_analysis()["flops"] >= r.cost_analysis()["flops"] > 0,
        "memory_analysis": lambda o, r: (
            o.memory_analysis().argument_size_in_bytes == r.memory_analysis().argument_size_in_bytes
        ),
        "runtime_executable": lambda o, r: (
            type(o.runtime_executable()) is type(r.runtime_executable())
        ),
        "input_formats": _leaves_equal("input_formats"),
        "input_shardings": _leaves_equal("input_shardings"),
        "output_formats": _out_structured("output_formats"),
        "output_shardings": _out_structured("output_shardings"),
    },
}


@pytest.mark.parametrize("stage", STAGES)
def test_every_member_is_checked_on_the_simple_path(stage):
    assert set(SIMPLE_CHECKS[stage]) == set(CHECKS[stage])


@pytest.mark.parametrize("stage, member", MEMBERS)
def test_simple_path_member_matches_jax(simple_stages, stage, member):
    """graph=False and graph_updates=False give the same classes and the same contract,
    for jit and shard_map, against jax of the same function of the module pytree."""
    _, stages = simple_stages
    ours, ref = stages[stage]
    assert type(ours) is STAGES[stage]
    assert SIMPLE_CHECKS[stage][member](ours, ref)


@pytest.mark.parametrize("mode", SIMPLE_MODES)
@pytest.mark.parametrize("stage", OUTPUT_MEMBERS)
def test_simple_path_output_members_have_the_structure_of_jax_jits(stage, mode):
    ours = _stage(nnx_sharding.jit(_fresh, **SIMPLE_MODES[mode]), stage, Counter(), X)
    theirs = _stage(jax.jit(_fresh), stage, Counter(), X)
    assert ours.out_tree == theirs.out_tree
    for member in OUTPUT_MEMBERS[stage]:
        got, want = getattr(ours, member), getattr(theirs, member)
        assert jax.tree.structure(got) == ours.out_tree, member
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert _equivalent(a, b), (member, a, b)


ALL_MODES = {"graph": {}, **SIMPLE_MODES}


@pytest.mark.parametrize("mode", ALL_MODES)
def test_args_info_of_a_variable_argument_is_its_arg_info(mode):
    variable = nnx.Param(jnp.ones(3))
    traced = nnx_sharding.jit(lambda v, x: v[...] * x, **ALL_MODES[mode]).trace(variable, X[0, :3])
    (info, x), kwargs = traced.args_info
    assert isinstance(info, jax.stages.ArgInfo) and info.shape == (3,)
    assert x.shape == (3,) and kwargs == {}


@pytest.mark.parametrize("mode", ["graph", "no-updates"])
def test_args_info_of_a_shared_module_lists_its_variables_once(mode):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    f = nnx_sharding.jit(lambda a, b: a(jnp.ones(2)) + b(jnp.ones(2)), **ALL_MODES[mode])
    (first, second), _ = f.trace(model, model).args_info
    assert set(dict(nnx.to_flat_state(first))) == {("bias",), ("kernel",)}
    assert dict(nnx.to_flat_state(second)) == {}
