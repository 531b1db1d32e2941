"""`nnx_sharding.recipes` on 8 CPU devices, each against the single-device reference.

Every recipe trains the same MLP from the same initial parameters on the same batches
for `STEPS` adam steps; the losses of every step and the final parameters must match
plain flax on one device to float32 tolerance.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_sharding as ns
from nnx_sharding import recipes as r

STEPS = 6
DIN, HIDDEN, DOUT, BATCH = 8, 32, 4, 16
TOL = dict(rtol=1e-5, atol=1e-6)
MEGATRON = {
    "down.bias": P(),
    "down.kernel": P("model", None),
    "up.bias": P("model"),
    "up.kernel": P(None, "model"),
}


def new_model() -> r.MLP:
    return r.MLP(DIN, HIDDEN, DOUT, rngs=nnx.Rngs(0))


BATCHES = r.make_batches(3, BATCH, DIN, DOUT)


def trim(spec):
    """``P('model', None)`` -> ``P('model')``: specs as jax reports them."""
    entries = tuple(spec)
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return P(*entries)


def specs_of(node, prefix=()):
    """``'up.kernel' -> spec`` of every Variable under ``node`` whose path starts with prefix."""
    return {
        ".".join(map(str, path[len(prefix) :])): trim(v[...].sharding.spec)
        for path, v in nnx.to_flat_state(nnx.state(node))
        if tuple(path[: len(prefix)]) == prefix
    }


@pytest.fixture(scope="module")
def reference():
    model = new_model()
    losses = r.train(r.reference_step(), model, r.make_optimizer(model), BATCHES, STEPS)
    return model, losses


def run(make_step, axes, placement=None):
    mesh = r.make_mesh(axes)
    model = new_model()
    optimizer = r.make_optimizer(model)
    step = make_step(mesh, model)
    sharding = None if placement is None else jax.NamedSharding(mesh, placement)
    losses = r.train(step, model, optimizer, BATCHES, STEPS, sharding=sharding)
    return model, optimizer, losses, step


def check_matches(reference, model, losses):
    ref_model, ref_losses = reference
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert losses[-1] < 0.9 * losses[0]  # it did learn something
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(model, nnx.Param)),
        nnx.to_flat_state(nnx.state(ref_model, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_allclose(a[...], b[...], err_msg=str(path), **TOL)


def check_layout(model, optimizer, expected):
    expected = {k: trim(v) for k, v in expected.items()}
    assert specs_of(model) == expected
    for moment in ("mu", "nu"):  # adam's moments are laid out like the parameters
        assert specs_of(optimizer, ("opt_state", 0, moment)) == expected
    assert specs_of(optimizer, ("step",)) == {"": P()}


def hlo(step, model, optimizer):
    x, y = BATCHES[0]
    return step.lower(model, optimizer, x, y).compile().as_text()


@pytest.fixture(scope="module")
def both_tensor_parallel():
    return [
        run(lambda mesh, _, make=make: make(mesh), {"model": 8}, P())
        for make in (r.tensor_parallel_step, r.jit_tensor_parallel_step)
    ]


def test_tensor_parallel_shard_map(reference, both_tensor_parallel):
    model, optimizer, losses, _ = both_tensor_parallel[0]
    check_matches(reference, model, losses)
    check_layout(model, optimizer, MEGATRON)
    assert r.param_specs(model)["up.kernel"] == P(None, "model")
    assert model.up.kernel[...].sharding.shard_shape((DIN, HIDDEN)) == (DIN, HIDDEN // 8)


def test_jit_tensor_parallel_matches_reference_and_shard_map(reference, both_tensor_parallel):
    (sm_model, _, sm_losses, sm_step), (model, optimizer, losses, step) = both_tensor_parallel
    check_matches(reference, model, losses)
    check_layout(model, optimizer, MEGATRON)
    np.testing.assert_allclose(losses, sm_losses, **TOL)
    assert r.max_param_diff(model, sm_model) < 1e-6


def test_collectives_by_hand_and_by_the_compiler(both_tensor_parallel):
    (sm_model, sm_opt, _, sm_step), (model, optimizer, _, step) = both_tensor_parallel
    # the psum of tp_forward, and its transpose: all-reduces in both programs
    assert "all-reduce" in hlo(sm_step, sm_model, sm_opt)
    assert "all-reduce" in hlo(step, model, optimizer)


def test_data_parallel(reference):
    # batches not placed up front: the step's in_shardings split them at each call
    model, optimizer, losses, step = run(lambda mesh, _: r.data_parallel_step(mesh), {"data": 8})
    check_matches(reference, model, losses)
    check_layout(model, optimizer, dict.fromkeys(MEGATRON, P()))


def test_data_parallel_needs_the_pcast():
    """Without pcast, check_vma hands back gradients already summed over 'data'."""
    mesh = r.make_mesh({"data": 8})
    model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
    x = jnp.ones((16, 2))

    @ns.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    def naive(model, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x)))(model)
        return jax.lax.pmean(grads, "data")

    np.testing.assert_allclose(naive(model, x)["kernel"][...], 8 * jnp.ones((2, 1)))


def test_data_and_tensor_parallel_on_a_2d_mesh(reference):
    model, optimizer, losses, step = run(
        lambda mesh, _: r.data_tensor_parallel_step(mesh), {"data": 2, "model": 4}, P("data")
    )
    check_matches(reference, model, losses)
    check_layout(model, optimizer, MEGATRON)


def test_fsdp_sharding_picks_the_first_divisible_free_dimension():
    model, mesh = new_model(), r.make_mesh({"data": 8})
    specs = r.fsdp_sharding(model, mesh)
    at = {k: specs.sharding_for(tuple(k.split(".")), None) for k in MEGATRON}
    # down.bias has 4 entries, which 8 devices do not divide: it stays replicated
    assert at == {
        "down.bias": P(),
        "down.kernel": P("data"),
        "up.bias": P("data"),
        "up.kernel": P("data"),
    }
    mesh2 = r.make_mesh({"data": 2, "model": 4})
    with_tp = r.fsdp_sharding(model, mesh2, base=r.megatron_sharding())
    at = {k: with_tp.sharding_for(tuple(k.split(".")), None) for k in MEGATRON}
    assert at == {
        "down.bias": P("data"),
        "down.kernel": P("model", "data"),
        "up.bias": P("model"),  # its only dimension is taken by 'model'
        "up.kernel": P("data", "model"),
    }


def test_fsdp(reference):
    def make(mesh, model):
        return r.fsdp_step(mesh, r.fsdp_sharding(model, mesh))

    model, optimizer, losses, step = run(make, {"data": 8}, P("data"))
    check_matches(reference, model, losses)
    expected = {
        "down.bias": P(),
        "down.kernel": P("data"),
        "up.bias": P("data"),
        "up.kernel": P("data"),
    }
    check_layout(model, optimizer, expected)
    text = hlo(step, model, optimizer)
    assert "all-gather" in text and "reduce-scatter" in text


def test_fsdp_with_tensor_parallelism_on_a_2d_mesh(reference):
    def make(mesh, model):
        specs = r.fsdp_sharding(model, mesh, base=r.megatron_sharding())
        return r.fsdp_step(mesh, specs, model_axis="model")

    model, optimizer, losses, step = run(make, {"data": 2, "model": 4}, P("data"))
    check_matches(reference, model, losses)
    expected = {
        "down.bias": P("data"),
        "down.kernel": P("model", "data"),
        "up.bias": P("model"),
        "up.kernel": P("data", "model"),
    }
    check_layout(model, optimizer, expected)
    assert model.up.kernel[...].sharding.shard_shape((DIN, HIDDEN)) == (DIN // 2, HIDDEN // 4)


def test_megatron_filters_match_parameters_and_optimizer_state():
    specs = r.megatron_sharding()
    assert specs.sharding_for(("up", "kernel"), None) == P(None, "model")
    assert specs.sharding_for(("opt_state", 0, "nu", "down", "kernel"), None) == P("model", None)
    assert specs.sharding_for(("opt_state", 0, "count"), None) == P()
    assert specs.sharding_for(("step",), None) == P()


def test_sgd_update_inside_the_shard_map_body():
    """An optimizer without nested state may be updated inside the body (the Variables
    reach the caller in the Megatron layout); compare `test_adam_update_inside_...`."""
    mesh = r.make_mesh({"model": 8})
    specs = r.megatron_sharding()
    model, ref = new_model(), new_model()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)

    @ns.shard_map(mesh=mesh, in_specs=(specs, specs, P(), P()), out_specs=P())
    def step(model, optimizer, x, y):
        loss_fn = lambda m: r.mse(r.tp_forward(m, x), y)  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def ref_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: r.mse(m(x), y))(model)
        optimizer.update(model, grads)
        return loss

    for x, y in BATCHES * 2:
        np.testing.assert_allclose(
            step(model, optimizer, x, y), ref_step(ref, ref_opt, x, y), **TOL
        )
    assert r.max_param_diff(model, ref) < 1e-6
    assert specs_of(model) == {k: trim(v) for k, v in MEGATRON.items()}


def test_adam_update_inside_the_shard_map_body():
    mesh = r.make_mesh({"model": 8})
    model = new_model()
    optimizer = r.make_optimizer(model)  # adam: opt_state[0].mu is a nested nnx.State

    @ns.shard_map(mesh=mesh, in_specs=(P(), P()), out_specs=P())
    def update(model, optimizer):
        optimizer.update(model, nnx.state(model, nnx.Param))
        return optimizer.step[...]

    update(model, optimizer)
    assert int(optimizer.step[...]) == 1


def test_adam_step_in_jit_stays_on_the_fast_path(monkeypatch):
    import nnx_sharding._callpath.call as call

    calls = []
    real = call.split_call
    monkeypatch.setattr(call, "split_call", lambda *a, **k: calls.append(1) or real(*a, **k))
    mesh = r.make_mesh({"model": 8})
    model = new_model()
    optimizer = r.make_optimizer(model)
    step = r.jit_tensor_parallel_step(mesh)
    x, y = BATCHES[0]
    for _ in range(3):  # warm up: the first call moves the Variables onto the mesh
        step(model, optimizer, x, y)
    calls.clear()
    for _ in range(3):
        step(model, optimizer, x, y)
    assert calls == []


def test_pipeline_step_matches_the_same_model_without_the_mesh(monkeypatch):
    """`DeepMLP`'s 8 blocks pipelined over 4 stages (8 microbatches), the batch over
    'data': every step's loss and the final parameters are those of the same model
    trained by `reference_step` with no mesh, where the pipeline is a scan."""
    import nnx_sharding._pipeline as pipeline_module

    def deep() -> r.DeepMLP:
        return r.DeepMLP(DIN, HIDDEN, DOUT, layers=8, microbatches=8, rngs=nnx.Rngs(0))

    pipelined = []
    real = pipeline_module._pipelined
    monkeypatch.setattr(
        pipeline_module, "_pipelined", lambda *a, **k: pipelined.append(1) or real(*a, **k)
    )
    ref_model = deep()
    ref_losses = r.train(r.reference_step(), ref_model, r.make_optimizer(ref_model), BATCHES, 4)
    assert pipelined == []  # no mesh: the scan
    model = deep()
    optimizer = r.make_optimizer(model)
    step = r.pipeline_step(r.make_mesh({"stage": 4, "data": 2}))
    losses = r.train(step, model, optimizer, BATCHES, 4)
    assert pipelined  # traced as a pipeline
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert r.max_param_diff(model, ref_model) < 1e-5
    stacked = {"blocks.bias": P("stage"), "blocks.kernel": P("stage")}
    expected = {**dict.fromkeys(MEGATRON, P()), **stacked}
    check_layout(model, optimizer, expected)
    assert model.blocks.kernel[...].sharding.shard_shape((8, HIDDEN, HIDDEN)) == (2, HIDDEN, HIDDEN)


def test_pipeline_sharding_with_tensor_parallelism_inside_each_stage():
    specs = r.pipeline_sharding(model_axis="model")
    assert specs.sharding_for(("opt_state", 0, "nu", "blocks", "kernel"), None) == P(
        "stage", None, "model"
    )
    assert specs.sharding_for(("up", "kernel"), None) == P(None, "model")
    assert specs.sharding_for(("down", "kernel"), None) == P("model", None)
    assert specs.sharding_for(("opt_state", 0, "count"), None) == P()


def test_expert_step_matches_the_same_model_without_the_mesh():
    """`ExpertMLP`'s experts over 'expert' 4, the sequences over 'data' 2 and 'expert':
    every step's loss (with the load-balancing term) and the final parameters are those
    of the same model trained by `expert_reference_step` with no mesh."""
    from nnx_sharding.recipes._experts import as_sequences

    def moe() -> r.ExpertMLP:
        return r.ExpertMLP(
            DIN, HIDDEN, DOUT, layers=2, experts=8, k=2, mlp=16, rngs=nnx.Rngs(0)
        )  # fmt: skip

    batches = as_sequences(r.make_batches(3, 16 * 4, DIN, DOUT), 4)  # 16 sequences of 4
    ref_model = moe()
    ref_losses = r.train(
        r.expert_reference_step(), ref_model, r.make_optimizer(ref_model), batches, 4
    )
    model = moe()
    optimizer = r.make_optimizer(model)
    losses = r.train(
        r.expert_step(r.make_mesh({"expert": 4, "data": 2})), model, optimizer, batches, 4
    )
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert r.max_param_diff(model, ref_model) < 1e-4  # adam: steps of lr from tiny grads
    experts = {f"blocks.{i}.{n}": P("expert") for i in (0, 1) for n in ("gate", "up", "down")}
    expected = {
        **dict.fromkeys(MEGATRON, P()),
        **experts,
        "blocks.0.router": P(),
        "blocks.1.router": P(),
    }
    check_layout(model, optimizer, expected)
    assert model.blocks[0].gate[...].sharding.shard_shape((8, HIDDEN, 16)) == (2, HIDDEN, 16)


def test_expert_sharding_by_the_logical_names():
    specs = r.expert_sharding("model")
    assert specs.sharding_for(("opt_state", 0, "nu", "blocks", 0, "gate"), None) == P(
        "expert", None, "model"
    )
    assert specs.sharding_for(("blocks", 0, "router"), None) == P(None, None)
    assert specs.sharding_for(("up", "kernel"), None) == P()
    assert specs.sharding_for(("opt_state", 0, "count"), None) == P()
