"""``jit`` with ``in_shardings``/``out_shardings``: where the caller's Variables and the
outputs end up, compared with flax (specs as written, meshes, single devices)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import needs_flax_prefix_check, needs_nnx_prefix
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._harness import MODE, OURS, X8, full_graph_only, mesh24, parity, run


class MLP(nnx.Module):
    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 4, rngs=rngs)
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.count[...] += 1
        return self.l2(nnx.relu(self.l1(x)))


SPECS = nnx.StateSharding(
    {
        nnx.All(nnx.PathContains("l1"), nnx.PathContains("kernel")): P(None, "b"),
        nnx.All(nnx.PathContains("l1"), nnx.PathContains("bias")): P("b"),
        nnx.All(nnx.PathContains("l2"), nnx.PathContains("kernel")): P("b", None),
        ...: P(),
    }
)


def named(spec):
    return NamedSharding(mesh24(), spec)


NAMED = nnx.StateSharding(
    {
        nnx.All(nnx.PathContains("l1"), nnx.PathContains("kernel")): named(P(None, "b")),
        nnx.All(nnx.PathContains("l2"), nnx.PathContains("kernel")): named(P("b", None)),
        ...: named(P()),
    }
)


def forward(m, x):
    return m(x)


# 1. in_shardings forms, with and without a mesh context

IN_SHARDINGS = {
    "state_sharding_specs": ((SPECS, P("a")), True),
    "state_sharding_named": ((NAMED, named(P("a"))), False),
    "one_spec_for_the_module": ((P(), P("a")), True),
    "one_named_for_the_module": ((named(P()), None), False),
    "none": (None, False),
    "none_for_the_module": ((None, P("a", None)), True),
}


@pytest.mark.parametrize("in_shardings, in_mesh", IN_SHARDINGS.values(), ids=IN_SHARDINGS.keys())
def test_in_shardings_place_the_callers_variables(in_shardings, in_mesh):
    def scenario(impl, log):
        model = MLP()
        f = impl.jit(forward, in_shardings=in_shardings)
        for i in range(3):
            if in_mesh:
                with jax.set_mesh(mesh24()):
                    log.value(f"out{i}", f(model, X8))
            else:
                log.value(f"out{i}", f(model, X8))
            log.state(f"model{i}", model)

    parity(scenario, normalize_specs=True, unplaced_stay=True)  # documented: docs/migrating.md


def test_out_shardings_of_an_array_and_of_a_new_module():
    def make(m, x):
        return m(x), nnx.Linear(4, 8, rngs=nnx.Rngs(1))

    def scenario(impl, log):
        model = MLP()
        f = impl.jit(make, in_shardings=(SPECS, None), out_shardings=(P("a"), SPECS))
        with jax.set_mesh(mesh24()):
            for i in range(3):
                log.value(f"out{i}", f(model, X8))
        log.state("model", model)

    parity(scenario, normalize_specs=True)  # documented: docs/migrating.md


def test_out_shardings_dict():
    def scenario(impl, log):
        model = MLP()
        f = impl.jit(
            lambda m, x: {"y": m(x), "k": m.l1.kernel[...]},
            out_shardings={"y": named(P("a")), "k": named(P("b", None))},
        )
        for i in range(3):
            log.value(f"out{i}", f(model, X8))
        log.state("model", model)

    parity(scenario, normalize_specs=True, unplaced_stay=True)  # documented: docs/migrating.md


def test_in_shardings_dict_for_a_dict_argument():
    # issue 15, B.10: dicts of shardings wherever a prefix is taken
    def scenario(impl, log):
        model = MLP()
        f = impl.jit(lambda d: d["m"](d["x"]), in_shardings=({"m": NAMED, "x": named(P("a"))},))
        for i in range(3):
            log.value(f"out{i}", f({"m": model, "x": X8}))
        log.state("model", model)

    parity(scenario, normalize_specs=True)  # documented: docs/migrating.md


def test_in_shardings_list_for_a_list_argument():
    def scenario(impl, log):
        a, b = MLP(0), MLP(1)
        f = impl.jit(lambda ms, x: ms[0](x) + ms[1](x), in_shardings=([NAMED, named(P())], None))
        for i in range(3):
            log.value(f"out{i}", f([a, b], X8))
        log.state("after", a, b)

    parity(scenario, normalize_specs=True)  # documented: docs/migrating.md


# 2. updated Variables come back laid out by their in_sharding


def constrain_by_attribute(m):
    # assigning an array to a Variable attribute sets the Variable's value (flax 0.12)
    m.kernel = jax.lax.with_sharding_constraint(m.kernel, named(P("b", "a")))
    return m.kernel[...].sum()


def constrain_by_index(m):
    m.kernel[...] = jax.lax.with_sharding_constraint(m.kernel[...], named(P("b", "a")))
    return m.kernel[...].sum()


@pytest.mark.parametrize("step", [constrain_by_attribute, constrain_by_index])
def test_constrained_update_is_pinned_to_the_in_sharding(step):
    # issue 15, B.9
    shardings = nnx.StateSharding({nnx.PathContains("kernel"): named(P("a", "b")), ...: None})

    def scenario(impl, log):
        m = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        f = impl.jit(step, in_shardings=(shardings,))
        with jax.set_mesh(mesh24()):
            for i in range(3):
                log.value(f"out{i}", f(m))
                log.sharding(f"kernel{i}", m.kernel[...])
        log.state("m", m)

    parity(scenario, unplaced_stay=True)  # documented: docs/migrating.md


def test_replaced_variable_value_keeps_the_in_sharding():
    def step(m, x):
        m.l1.kernel[...] = m.l1.kernel[...] * 2 + x.sum()
        m.l2.bias[...] = jnp.zeros(4)
        return m(x)

    def scenario(impl, log):
        model = MLP()
        f = impl.jit(step, in_shardings=(NAMED, named(P("a"))))
        for i in range(3):
            log.value(f"out{i}", f(model, X8))
            log.state(f"model{i}", model)

    parity(scenario, normalize_specs=True)  # documented: docs/migrating.md


def test_value_committed_to_one_device_from_outside_is_an_error():
    # jax.jit refuses a committed argument whose sharding differs from its in_sharding
    def scenario(impl, log):
        model = MLP()
        f = impl.jit(forward, in_shardings=(NAMED, None))
        log.value("0", f(model, X8))
        log.value("1", f(model, X8))
        model.l1.kernel.set_value(jax.device_put(jnp.ones((4, 8)), jax.devices()[0]))
        log.raises("2", f, model, X8)
        log.raises("3", f, model, X8)
        log.state("model", model)
        model.l1.kernel.set_value(jax.device_put(jnp.ones((4, 8)), named(P(None, "b"))))
        log.value("4", f(model, X8))
        log.state("model again", model)

    parity(scenario, normalize_specs=True)  # documented: docs/migrating.md


def test_new_attribute_added_inside_with_in_shardings():
    def grow(m, x):
        m.extra = nnx.Param(m(x).mean(0))
        return m.extra[...]

    def scenario(impl, log):
        model = MLP()
        f = impl.jit(grow, in_shardings=(NAMED, None))
        for i in range(3):
            log.value(f"out{i}", f(model, X8))
            log.state(f"model{i}", model)

    parity(scenario, normalize_specs=True)  # documented: docs/migrating.md


# 3. prefixes built by nnx.prefix, and graph nodes as prefixes


@needs_nnx_prefix
def test_prefix_in_shardings_like_the_equivalent_state_sharding():
    # issue 15, B.12: flax's nnx.jit (graph updates on, its default) refuses nnx.prefix
    # with a ValueError; ours accepts it. Compared with flax given the same rules as a
    # StateSharding.
    full_graph_only("a StateSharding, which the other modes refuse")
    rules = {nnx.PathContains("kernel"): named(P(None, "b")), ...: named(P())}

    def scenario(impl, log):
        model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        prefix = nnx.prefix(model, rules) if impl is OURS else nnx.StateSharding(rules)
        f = impl.jit(forward, in_shardings=(prefix, None))
        for i in range(3):
            log.value(f"out{i}", f(model, X8))
        log.state("model", model)

    parity(scenario)
    model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError):
        nnx.jit(forward, in_shardings=(nnx.prefix(model, rules), None))(model, X8)


@needs_nnx_prefix
def test_prefix_of_specs_under_a_mesh_context():
    rules = {nnx.PathContains("kernel"): P(None, "b"), ...: P()}
    full_graph_only("a StateSharding, which the other modes refuse")

    def scenario(impl, log):
        model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        prefix = nnx.prefix(model, rules) if impl is OURS else nnx.StateSharding(rules)
        f = impl.jit(forward, in_shardings=(prefix, None))
        with jax.set_mesh(mesh24()):
            for i in range(3):
                log.value(f"out{i}", f(model, X8))
        log.state("model", model)

    parity(scenario)


@needs_flax_prefix_check
def test_graph_node_as_a_prefix_is_an_error_when_wrapped():
    # issue 15, B.12: a ValueError with flax's words
    def scenario(impl, log):
        log.raises("wrap", impl.jit, forward, in_shardings=(nnx.Dict(a=P()), None))

    parity(scenario)
    if MODE.name == "tree":  # tree mode takes a tree prefix
        return
    ours = run(scenario, OURS)
    error = ours.entries[0].payload
    assert "Graph nodes are not allowed as prefixes" in str(error), str(error)


# 4. errors


def test_one_variable_sharded_two_ways_is_an_error():
    # issue 15, B.13: flax's key phrase "Inconsistent aliasing" in ours
    first = nnx.StateSharding({nnx.PathContains("kernel"): named(P(None, "b")), ...: None})
    second = nnx.StateSharding({nnx.PathContains("kernel"): named(P("a", None)), ...: None})

    def scenario(impl, log):
        a = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        b = nnx.Linear(4, 8, rngs=nnx.Rngs(1))
        b.kernel = a.kernel
        f = impl.jit(lambda a, b, x: a(x) + b(x), in_shardings=(first, second, None))
        for i in range(3):
            log.raises(f"call{i}", f, a, b, X8)
        log.state("after", a, b)

    parity(scenario)
    if not MODE.full:  # both refuse the StateShardings themselves
        return
    ours = run(scenario, OURS)
    error = ours.entries[0].payload
    assert "Inconsistent aliasing" in str(error), str(error)


def test_spec_that_does_not_fit_a_variable_is_an_error():
    def scenario(impl, log):
        model = nnx.Linear(4, 6, rngs=nnx.Rngs(0))
        f = impl.jit(forward, in_shardings=(P(None, "b"), None))  # bias is 1-D
        with jax.set_mesh(mesh24()):
            for i in range(3):
                log.raises(f"call{i}", f, model, X8)
        log.state("model", model)

    parity(scenario)


def test_unmatched_variable_is_an_error():
    only_kernels = nnx.StateSharding({nnx.PathContains("kernel"): named(P())})

    def scenario(impl, log):
        model = nnx.Linear(4, 6, rngs=nnx.Rngs(0))
        f = impl.jit(forward, in_shardings=(only_kernels, None))
        for i in range(3):
            log.raises(f"call{i}", f, model, X8)
        log.state("model", model)

    parity(scenario)


# 5. options together with shardings


def test_static_argument_and_in_shardings():
    def fn(m, times, x):
        return jnp.tile(m(x), times)

    def scenario(impl, log):
        model = MLP()
        f = impl.jit(fn, static_argnums=1, in_shardings=(NAMED, named(P("a"))))
        for i, times in enumerate([1, 1, 2, 1]):
            log.value(f"out{i}", f(model, times, X8))
        log.state("model", model)

    parity(scenario, normalize_specs=True)  # documented: docs/migrating.md


def test_donation_with_in_shardings():
    def step(m, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(m)
        nnx.update(m, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(m, nnx.Param), grads))
        return m.count[...]

    def scenario(impl, log):
        model = MLP()
        f = impl.jit(step, in_shardings=(NAMED, named(P("a"))), donate_argnums=0)
        for i in range(3):
            old = model.l1.kernel[...]
            log.value(f"count{i}", f(model, X8))
            log.fact(f"deleted{i}", old.is_deleted())
        log.state("model", model)

    parity(scenario, normalize_specs=True)  # documented: docs/migrating.md


def test_optimizer_state_follows_its_rules():
    rules = nnx.StateSharding({nnx.PathContains("kernel"): named(P(None, "b")), ...: named(P())})

    def step(m, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)
        opt.update(m, grads)
        return loss

    def scenario(impl, log):
        model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        f = impl.jit(step, in_shardings=(rules, rules, named(P("a"))))
        for i in range(3):
            log.value(f"loss{i}", f(model, opt, X8))
        log.state("after", model, opt)

    parity(scenario)


def test_rngs_and_dropout_with_in_shardings():
    class Net(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0, dropout=1)
            self.linear = nnx.Linear(4, 8, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    rules = nnx.StateSharding(
        {nnx.PathContains("kernel"): named(P(None, "b")), "dropout": named(P()), ...: None}
    )

    def scenario(impl, log):
        model = Net()
        f = impl.jit(forward, in_shardings=(rules, None))
        for i in range(3):
            log.value(f"out{i}", f(model, X8))
        log.state("model", model)

    parity(scenario, unplaced_stay=True)  # documented: docs/migrating.md


def test_partitioned_init_and_state_sharding_from_get_partition_spec():
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "b"))

    def scenario(impl, log):
        with jax.set_mesh(mesh24()):
            model = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))
            specs = nnx.StateSharding(nnx.get_partition_spec(nnx.state(model)))
            f = impl.jit(forward, in_shardings=(specs, P("a")))
            for i in range(3):
                log.value(f"out{i}", f(model, X8))
        log.state("model", model)

    parity(scenario)


def update_and_forward(m, x):
    m.kernel[...] = m.kernel[...] * 2
    return m(x)


def test_explicit_axes_without_in_shardings():
    def scenario(impl, log):
        mesh = jax.make_mesh((2, 4), ("a", "b"))  # Explicit axes
        with jax.set_mesh(mesh):
            model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
            model.kernel.set_value(jax.device_put(model.kernel[...], P(None, "b")))
            x = jax.device_put(X8, P("a"))
            f = impl.jit(update_and_forward)
            for i in range(3):
                log.value(f"out{i}", f(model, x))
        log.state("model", model)

    parity(scenario)
