"""`nnx_sharding.pipeline` against `nnx.scan` over the same layers: the output and the
gradients on 4 and 8 simulated CPU devices (GPipe and circular, a data axis beside the
stage axis, `nnx.remat` inside, under `nnx_sharding.jit` with FSDP and tensor-parallel
shardings inside each stage), the program's shape (one loop, collective-permutes), and
bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import nnx_sharding

L, D, B = 8, 16, 16


def make_stack(layers: int = L) -> nnx.Module:
    @nnx.split_rngs(splits=layers)
    @nnx.vmap
    def stack(rngs: nnx.Rngs) -> nnx.Module:
        return nnx.Linear(D, D, rngs=rngs)

    return stack(nnx.Rngs(0))


def block(layer: nnx.Linear, h: jax.Array) -> jax.Array:
    return jnp.tanh(layer(h)) + h


def scanned(layers: nnx.Module, x: jax.Array, f=block) -> jax.Array:
    """The reference: `nnx.scan` over the layers."""

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def run(layer, h):
        return f(layer, h)

    return run(layers, x)


def loss_of(run):
    return lambda layers, x: (run(layers, x) ** 2).mean()


def mesh_of(shape: dict[str, int], kind: AxisType = AxisType.Auto) -> jax.sharding.Mesh:
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=(kind,) * len(shape))


@pytest.fixture(scope="module")
def x() -> jax.Array:
    return jax.random.normal(jax.random.key(1), (B, D))


@pytest.fixture(scope="module")
def reference(x):
    layers = make_stack()
    loss, grads = nnx.value_and_grad(loss_of(scanned))(layers, x)
    return float(loss), nnx.state(grads), scanned(layers, x)


def close(actual, desired) -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(desired), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    "shape, microbatches, repeats",
    [
        ({"stage": 4, "data": 2}, 4, 1),
        ({"stage": 4, "data": 2}, 8, 2),
        ({"stage": 2, "data": 4}, 4, 2),
        ({"stage": 8}, 8, 1),
        ({"data": 2, "stage": 4}, 4, 1),
        ({"stage": 4}, 4, 2),
        ({"stage": 2, "data": 2}, 2, 1),
    ],
    ids=["gpipe 4x2", "circular 4x2", "circular 2x4", "gpipe 8", "stage inner", "4", "2x2"],
)
def test_output_and_gradients_are_the_scans(x, reference, shape, microbatches, repeats):
    run = nnx_sharding.pipeline(block, microbatches=microbatches, repeats=repeats)
    layers = make_stack()
    with jax.set_mesh(mesh_of(shape)):
        y = nnx.jit(run)(layers, x)
        loss, grads = nnx.jit(nnx.value_and_grad(loss_of(run)))(layers, x)
    close(y, reference[2])
    close(loss, reference[0])
    jax.tree.map(close, nnx.state(grads), reference[1])


def test_remat_inside_f_and_a_pytree_x(x):
    """f under `nnx.remat`, x a dict whose second array rides along."""

    @nnx.remat
    def f(layer, h):
        return {"h": block(layer, h["h"]), "n": h["n"] + 1}

    run = nnx_sharding.pipeline(f, microbatches=4)
    layers = make_stack()
    tree = {"h": x, "n": jnp.zeros((B,), jnp.int32)}
    want = scanned(layers, tree, f)
    with jax.set_mesh(mesh_of({"stage": 4, "data": 2})):
        got = nnx.jit(run)(layers, tree)
        grads = nnx.jit(nnx.grad(lambda m, t: (run(m, t)["h"] ** 2).mean()))(layers, tree)
    close(got["h"], want["h"])
    np.testing.assert_array_equal(got["n"], np.full((B,), L))
    expected = nnx.grad(lambda m, t: (scanned(m, t, f)["h"] ** 2).mean())(layers, tree)
    jax.tree.map(close, nnx.state(grads), nnx.state(expected))


def test_under_jit_with_fsdp_and_tensor_parallel_inside_each_stage(x, reference):
    """The layer dimension over 'stage', each kernel's columns over 'model', the rest
    over 'fsdp'; a donated, lowered and compiled training step; the program is one loop
    whose stages pass activations with collective-permutes."""
    run = nnx_sharding.pipeline(block, microbatches=4, repeats=2)
    layers = make_stack()
    specs = nnx_sharding.StateSharding(
        {
            nnx.PathContains("kernel"): P("stage", "fsdp", "model"),
            nnx.PathContains("bias"): P("stage", "model"),
        }
    )

    def step(layers, x):
        loss, grads = nnx.value_and_grad(loss_of(run))(layers, x)
        nnx.update(layers, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(layers), grads))
        return loss

    with jax.set_mesh(mesh_of({"stage": 2, "fsdp": 2, "model": 2})):
        jitted = nnx_sharding.jit(step, in_shardings=(specs, P()), donate_argnums=0)
        compiled = jitted.lower(layers, x).compile()
        # ahead of time, from a stack never allocated
        abstract = nnx.eval_shape(make_stack)
        aot = jitted.lower(abstract, jax.ShapeDtypeStruct(x.shape, x.dtype)).compile()
        sizes = [
            (m.argument_size_in_bytes, m.temp_size_in_bytes)
            for m in (aot.memory_analysis(), compiled.memory_analysis())
        ]
        assert sizes[0] == sizes[1] and "collective-permute" in aot.as_text()
        loss = jitted(layers, x)
    close(loss, reference[0])
    text = compiled.as_text()
    assert "collective-permute" in text and "while" in text
    sgd = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(make_stack()), reference[1])
    jax.tree.map(close, nnx.state(layers), sgd)
    kernel = layers.kernel.get_value()
    assert kernel.sharding.spec == P("stage", "fsdp", "model")


def test_explicit_axes(x, reference):
    """`jax.make_mesh`'s default Explicit axes: the batch sharded by type."""
    run = nnx_sharding.pipeline(block, microbatches=4)
    layers = make_stack()
    with jax.set_mesh(jax.make_mesh((4, 2), ("stage", "data"))):
        y = nnx.jit(run)(layers, jax.device_put(x, P("data")))
    close(y, reference[2])


@pytest.mark.parametrize("shape", [{"data": 8}, {"stage": 1, "data": 8}, None])
def test_without_the_stage_axis_it_is_the_scan(x, reference, shape):
    run = nnx_sharding.pipeline(block, microbatches=4)
    layers = make_stack()
    if shape is None:
        y = run(layers, x)
    else:
        with jax.set_mesh(mesh_of(shape)):
            y = nnx.jit(run)(layers, x)
            assert "collective-permute" not in nnx.jit(run).lower(layers, x).compile().as_text()
    close(y, reference[2])


def refused(run, layers, x, shape=None) -> str:
    with pytest.raises(ValueError) as raised:
        if shape is None:
            run(layers, x)
        else:
            with jax.set_mesh(mesh_of(shape)):
                nnx.jit(run)(layers, x)
    return str(raised.value)


def test_bad_input_is_named_with_its_sizes(x):
    layers = make_stack()
    run = nnx_sharding.pipeline(block, microbatches=4, repeats=3)
    assert "8 layers do not split into 4 stages × 3 repeats = 12" in refused(
        run, layers, x, {"stage": 4, "data": 2}
    )
    run = nnx_sharding.pipeline(block, microbatches=5)
    assert "microbatches=5 does not divide the batch of 16" in refused(run, layers, x)
    run = nnx_sharding.pipeline(block, microbatches=2)
    message = refused(run, layers, x, {"stage": 4, "data": 2})
    assert "microbatches=2 is fewer than the 4 stages" in message and "60%" in message
    run = nnx_sharding.pipeline(block, microbatches=4, axis="pipe")
    assert "the mesh has no axis 'pipe'" in refused(run, layers, x, {"stage": 4, "data": 2})


def test_an_f_that_writes_to_its_layer_or_changes_x_is_refused(x):
    class Counting(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(D, D, rngs=rngs)
            self.calls = nnx.BatchStat(jnp.zeros(()))

    @nnx.split_rngs(splits=L)
    @nnx.vmap
    def stack(rngs):
        return Counting(rngs)

    def counting(layer, h):
        layer.calls[...] += 1
        return layer.linear(h)

    layers = stack(nnx.Rngs(0))
    message = refused(nnx_sharding.pipeline(counting, microbatches=4), layers, x)
    assert "f changed the layer's Variables at" in message and "calls" in message
    widen = nnx_sharding.pipeline(lambda layer, h: jnp.concatenate([h, h], -1), microbatches=4)
    assert "returned float32[4, 32]" in refused(widen, make_stack(), x)
    not_a_stack = nnx.Linear(D, D // 2, rngs=nnx.Rngs(0))
    assert "leading dimensions differ" in refused(
        nnx_sharding.pipeline(block, microbatches=4), not_a_stack, x
    )
