"""``shard_map`` over modules: flax's ``nnx.shard_map`` against ours.

The mesh is (2, 4) over ('a', 'b') with Auto axes, so in_specs are always given. Specs
of modules are flax's ``nnx.StateSharding`` (ours converts it) or one PartitionSpec.
The logged state includes every Variable's sharding: after a call, flax leaves each
input Variable laid out by its in_spec.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import needs_nnx_prefix
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._harness import OURS, X8, full_graph_only, mesh8, mesh24, parity


class MLP(nnx.Module):
    def __init__(self, seed=0, din=4, hidden=8):
        rngs = nnx.Rngs(seed)
        self.l1 = nnx.Linear(din, hidden, use_bias=False, rngs=rngs)
        self.l2 = nnx.Linear(hidden, din, use_bias=False, rngs=rngs)
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


MEGATRON = nnx.StateSharding(
    {
        nnx.All(nnx.Param, nnx.PathContains("l1")): P(None, "b"),
        nnx.All(nnx.Param, nnx.PathContains("l2")): P("b", None),
        ...: P(),
    }
)


def megatron_forward(m, x):
    m.count[...] += 1
    return jax.lax.psum(m(x), "b")


def test_megatron_forward_updates_and_layout():
    def scenario(impl, log):
        model = MLP()
        f = impl.shard_map(
            megatron_forward, mesh=mesh24(), in_specs=(MEGATRON, P("a")), out_specs=P("a")
        )
        for i in range(3):
            log.value(f"out{i}", f(model, X8 * (i + 1)))
            log.state(f"model{i}", model)

    parity(scenario)


def test_inputs_are_laid_out_by_in_specs_after_a_read_only_call():
    # issue 15, B.8: flax leaves every Variable holding the array placed per in_specs
    def scenario(impl, log):
        model = MLP()
        f = impl.shard_map(
            lambda m, x: jax.lax.psum(m(x), "b"),
            mesh=mesh24(),
            in_specs=(MEGATRON, P("a")),
            out_specs=P("a"),
        )
        for i in range(3):
            log.value(f"out{i}", f(model, X8))
            log.sharding(f"layout{i}", nnx.state(model))

    parity(scenario)


def test_one_spec_for_a_whole_module():
    def scenario(impl, log):
        model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        f = impl.shard_map(
            lambda m: m.kernel[...] * 2, mesh=mesh24(), in_specs=(P("b"),), out_specs=P("b")
        )
        for i in range(3):
            log.value(f"out{i}", f(model))
        log.state("model", model)

    parity(scenario)


def test_batchnorm_statistics_averaged_over_data():
    def step(bn, x):
        mean = jax.lax.pmean(x.mean(0), "a")
        var = jax.lax.pmean((x**2).mean(0), "a") - mean**2
        bn.mean[...] = 0.5 * bn.mean[...] + 0.5 * mean
        bn.var[...] = 0.5 * bn.var[...] + 0.5 * var
        return x - mean

    def scenario(impl, log):
        bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
        # inside jit: flax's shard_map called eagerly runs op by op (slow)
        f = impl.jit(impl.shard_map(step, mesh=mesh24(), in_specs=(P(), P("a")), out_specs=P("a")))
        for i in range(3):
            log.value(f"out{i}", f(bn, X8 * (i + 1)))
        log.state("bn", bn)

    parity(scenario)


def data_parallel_step(m, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)
    grads = jax.lax.pmean(grads, "a")
    nnx.update(m, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(m, nnx.Param), grads))
    return jax.lax.pmean(loss, "a")


def test_data_parallel_train_step():
    def scenario(impl, log):
        model = MLP()
        f = impl.jit(
            impl.shard_map(data_parallel_step, mesh=mesh24(), in_specs=(P(), P("a")), out_specs=P())
        )
        for i in range(3):
            log.value(f"loss{i}", f(model, X8))
        log.state("model", model)

    parity(scenario)


def test_data_parallel_step_with_an_optimizer():
    def step(m, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)
        opt.update(m, jax.lax.pmean(grads, "a"))
        return jax.lax.pmean(loss, "a")

    def scenario(impl, log):
        model = MLP()
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        specs = dict(mesh=mesh24(), in_specs=(P(), P(), P("a")), out_specs=P())
        f = impl.jit(impl.shard_map(step, **specs))
        for i in range(3):
            log.value(f"loss{i}", f(model, opt, X8))
        log.state("after", model, opt)

    parity(scenario)


def jitted(impl, fn, **specs):
    """``impl.jit(impl.shard_map(fn))``: flax's shard_map called eagerly compiles every
    primitive on every call (about 0.4 s a call), so most cases run it inside jit."""
    return impl.jit(impl.shard_map(fn, **specs))


def direct(impl, fn, **specs):
    return impl.shard_map(fn, **specs)


# the eager forms are the items 10 and 11; the others run inside jit
OUT_SPECS = {
    "dict": (direct, lambda m, x: {"y": m(x)}, {"y": P("a")}),  # issue 15, B.10
    "P(None)": (direct, lambda m, x: m.l1.kernel[...], P(None)),  # issue 15, B.11
    "list_in_jit": (jitted, lambda m, x: [m(x), x], [P("a"), P("a")]),
    "tuple_in_jit": (jitted, lambda m, x: (m(x), x), (P("a"), P("a", None))),
    "P()_in_jit": (jitted, lambda m, x: jax.lax.psum(m(x).sum(), "a"), P()),
    "nested_dict_in_jit": (
        jitted,
        lambda m, x: {"a": {"b": m(x)}, "c": [x]},
        {"a": {"b": P("a")}, "c": P("a")},
    ),
}


@pytest.mark.parametrize("wrap, fn, out_specs", OUT_SPECS.values(), ids=OUT_SPECS.keys())
def test_out_specs_forms(wrap, fn, out_specs):
    def scenario(impl, log):
        model = MLP()
        f = wrap(impl, fn, mesh=mesh24(), in_specs=(P(), P("a")), out_specs=out_specs)
        for i in range(3):
            log.value(f"out{i}", f(model, X8))
        log.state("model", model)

    parity(scenario)


def test_in_specs_dict_for_a_dict_argument_in_jit():
    def scenario(impl, log):
        model = MLP()
        f = jitted(
            impl,
            lambda d: d["m"](d["x"]),
            mesh=mesh24(),
            in_specs=({"m": P(), "x": P("a")},),
            out_specs=P("a"),
        )
        for i in range(3):
            log.value(f"out{i}", f({"m": model, "x": X8}))
        log.state("model", model)

    parity(scenario)


def test_outputs_that_are_inputs_and_shared_references():
    def scenario(impl, log):
        model = MLP()
        model.alias = model.l1

        def same(m, other):
            m.count[...] += 1
            return m, other, m.count[...]

        f = impl.shard_map(same, mesh=mesh24(), in_specs=(P(), P()), out_specs=(P(), P(), P()))
        for i in range(3):
            m, other, inside = f(model, model.l1)
            log.fact(f"identities{i}", (m is model, other is model.l1, model.alias is model.l1))
        log.state("model", model)

    parity(scenario)


class Fresh(nnx.Module):
    def __init__(self, count):
        self.w = nnx.Param(jnp.ones((2, 3)))
        self.count = nnx.BatchStat(count + 1)


def test_new_module_in_the_output():
    def scenario(impl, log):
        model = MLP()
        f = impl.shard_map(
            lambda m: Fresh(m.count[...]),
            mesh=mesh24(),
            in_specs=(MEGATRON,),
            out_specs=P(),
        )
        for i in range(3):
            new = f(model)
            log.fact(f"new{i} is model", new is model)
            log.value(f"new{i}", new)
        log.state("model", model)

    parity(scenario)


def test_structure_change_inside_is_refused_where_flax_applies_it():
    """A documented difference (docs/migrating.md): flax applies it (every device adds
    the same replicated Param); ours refuses it, naming the attribute, and leaves the
    module as it was: inside shard_map each device holds its own shard of a module."""
    full_graph_only("the other modes bring no structure change back, as flax")

    def grow(m):
        m.extra = nnx.Param(jnp.ones(()))
        return m.count[...]

    model = MLP()
    nnx.shard_map(grow, mesh=mesh24(), in_specs=(MEGATRON,), out_specs=P())(model)
    assert hasattr(model, "extra")  # flax
    model = MLP()
    before = nnx.to_pure_dict(nnx.state(model))
    f = OURS.shard_map(grow, mesh=mesh24(), in_specs=(MEGATRON,), out_specs=P())
    for _ in range(3):
        with pytest.raises(ValueError, match=r"args\[0\]\.extra"):
            f(model)
    assert not hasattr(model, "extra")
    after = nnx.to_pure_dict(nnx.state(model))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), before, after))


def test_partial_manual_axes_in_jit():
    def scenario(impl, log):
        model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        f = jitted(
            impl,
            lambda m, x: m(x),
            mesh=mesh24(),
            in_specs=(P(), P("a")),
            out_specs=P("a"),
            axis_names={"a"},
        )
        for i in range(3):
            log.value(f"out{i}", f(model, X8 * i))
        log.state("model", model)

    parity(scenario)


def test_check_vma_false_in_jit():
    def scenario(impl, log):
        model = MLP()
        specs = dict(mesh=mesh24(), in_specs=(P(), P("a")), out_specs=P(), check_vma=False)
        f = jitted(impl, lambda m, x: m(x), **specs)
        for i in range(3):
            log.value(f"out{i}", f(model, X8))
        log.state("model", model)

    parity(scenario)


def test_varying_output_under_a_replicated_spec_is_an_error():
    def scenario(impl, log):
        f = impl.shard_map(lambda x: x, mesh=mesh24(), in_specs=(P("a"),), out_specs=P())
        for i in range(3):
            log.raises(f"call{i}", f, X8)

    parity(scenario)


def test_one_dimensional_mesh_and_rngs_inside_jit():
    def step(m, rngs, x):
        m.count[...] += 1
        return m(x) + rngs.normal((1, 4))

    def scenario(impl, log):
        model, rngs = MLP(), nnx.Rngs(3)
        specs = dict(mesh=mesh8(), in_specs=(P(), P(), P("x")), out_specs=P("x"))
        f = impl.jit(impl.shard_map(step, **specs))  # random bits op by op are slow in flax
        for i in range(3):
            log.value(f"out{i}", f(model, rngs, X8))
        log.state("after", model, rngs)

    parity(scenario)


def test_two_modules_with_different_specs_in_jit():
    def scenario(impl, log):
        a, b = MLP(0), MLP(1)
        f = jitted(
            impl,
            lambda a, b, x: jax.lax.psum(a.l1(x).sum(), ("a", "b")) + b.count[...],
            mesh=mesh24(),
            in_specs=(MEGATRON, P(), P("a")),
            out_specs=P(),
        )
        for i in range(3):
            log.value(f"out{i}", f(a, b, X8))
        log.state("after", a, b)

    parity(scenario)


def test_mutation_between_calls():
    def scenario(impl, log):
        model = MLP()
        f = impl.shard_map(
            megatron_forward, mesh=mesh24(), in_specs=(MEGATRON, P("a")), out_specs=P("a")
        )
        log.value("0", f(model, X8))
        log.value("1", f(model, X8))
        model.l2.kernel[...] = model.l2.kernel[...] * 2
        log.value("2", f(model, X8))
        model.l1 = nnx.Linear(4, 8, use_bias=False, rngs=nnx.Rngs(7))
        log.value("3", f(model, X8))
        log.value("4", f(model, X8))
        log.state("model", model)

    parity(scenario)


# composition with jit, both ways


def test_shard_map_inside_jit():
    def scenario(impl, log):
        model = MLP()
        inner = impl.shard_map(
            megatron_forward, mesh=mesh24(), in_specs=(MEGATRON, P("a")), out_specs=P("a")
        )

        @impl.jit
        def outer(m, x):
            m.count[...] += 10
            return inner(m, x) * 2

        for i in range(3):
            log.value(f"out{i}", outer(model, X8))
        log.state("model", model)

    parity(scenario)


def test_jit_inside_shard_map():
    def scenario(impl, log):
        model = MLP()
        layer = impl.jit(lambda m, x: m.l2(nnx.relu(m.l1(x))))

        def body(m, x):
            m.count[...] += 1
            return jax.lax.psum(layer(m, x), "b")

        f = impl.shard_map(body, mesh=mesh24(), in_specs=(MEGATRON, P("a")), out_specs=P("a"))
        for i in range(3):
            log.value(f"out{i}", f(model, X8))
        log.state("model", model)

    parity(scenario)


def test_data_parallel_shard_map_inside_jit_with_donation():
    def scenario(impl, log):
        model = MLP()
        inner = impl.shard_map(
            data_parallel_step, mesh=mesh24(), in_specs=(P(), P("a")), out_specs=P()
        )
        outer = impl.jit(lambda m, x: inner(m, x), donate_argnums=0)
        for i in range(3):
            log.value(f"loss{i}", outer(model, X8))
        log.state("model", model)

    parity(scenario)


def test_shard_map_inside_flax_jit_and_flax_shard_map_inside_ours():
    def scenario(impl, log):
        model = MLP()
        ours_inner = impl.shard_map(
            megatron_forward, mesh=mesh24(), in_specs=(MEGATRON, P("a")), out_specs=P("a")
        )
        flax_inner = nnx.shard_map(
            megatron_forward, mesh=mesh24(), in_specs=(MEGATRON, P("a")), out_specs=P("a")
        )
        a = nnx.jit(lambda m, x: ours_inner(m, x))
        b = impl.jit(lambda m, x: flax_inner(m, x))
        for i in range(3):
            log.value(f"a{i}", a(model, X8))
            log.value(f"b{i}", b(model, X8))
        log.state("model", model)

    parity(scenario)


# nnx.prefix as in_specs: flax's default (graph updates on) rejects it; ours accepts it


@needs_nnx_prefix
def test_prefix_in_specs_like_the_equivalent_state_sharding():
    # issue 15, B.12: ours with nnx.prefix(...) must do what flax does with the same rules
    # as an nnx.StateSharding; flax's own nnx.shard_map refuses the prefix (ValueError).
    full_graph_only("a StateSharding, which the other modes refuse")
    rules = {nnx.PathContains("l1"): P(None, "b"), nnx.PathContains("l2"): P("b", None), ...: P()}

    def scenario(impl, log):
        model = MLP()
        spec = nnx.prefix(model, rules) if impl is OURS else nnx.StateSharding(rules)
        f = impl.shard_map(
            megatron_forward, mesh=mesh24(), in_specs=(spec, P("a")), out_specs=P("a")
        )
        for i in range(3):
            log.value(f"out{i}", f(model, X8))
        log.state("model", model)

    parity(scenario)
    with pytest.raises(ValueError):
        model = MLP()
        spec = nnx.prefix(model, rules)
        nnx.shard_map(lambda m: m.count[...], mesh=mesh24(), in_specs=(spec,), out_specs=P())(model)


def test_named_sharding_entries_like_their_specs():
    # ours takes a NamedSharding where a spec goes (its spec is used); flax's nnx.shard_map
    # raises TypeError. Compared with flax given the same rules as PartitionSpecs.
    full_graph_only("a StateSharding, which the other modes refuse")

    def rules(named):
        wrap = (lambda spec: NamedSharding(mesh24(), spec)) if named else (lambda spec: spec)
        return nnx.StateSharding({nnx.PathContains("l1"): wrap(P(None, "b")), ...: wrap(P())})

    def forward(m, x):
        return jax.lax.psum(m.l1(x), "b").sum(-1, keepdims=True)

    def scenario(impl, log):
        model = MLP()
        specs = (rules(named=impl is OURS), P("a"))
        f = jitted(impl, forward, mesh=mesh24(), in_specs=specs, out_specs=P("a"))
        for i in range(3):
            log.value(f"out{i}", f(model, X8))
        log.state("model", model)

    parity(scenario)
    f = nnx.shard_map(forward, mesh=mesh24(), in_specs=(rules(True), P("a")), out_specs=P("a"))
    with pytest.raises(TypeError):
        f(MLP(), X8)
