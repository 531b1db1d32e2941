"""`export`/`deserialize`: module states in, outputs and new states out, shardings kept."""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding import Exported

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
SHARDING = nnx_sharding.StateSharding({nnx.PathContains("kernel"): P(None, "model"), ...: P()})
X = jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)
Y = jnp.linspace(0.0, 1.0, 8 * 4).reshape(8, 4)
ROOT = Path(__file__).resolve().parent.parent


class Net(nnx.Module):
    """Two Linears (one in an nnx.List: integer keys) and a counter updated in place."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.lin = nnx.Linear(16, 32, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(32, 4, rngs=rngs)])
        self.count = nnx.BatchStat(jnp.array(0))

    def __call__(self, x):
        self.count[...] += 1
        return self.layers[0](jax.nn.relu(self.lin(x)))


def forward(model, x):
    return model(x)


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def sharded(tree):
    """Places ``tree``'s Variables by SHARDING on MESH."""
    state = nnx.state(tree)
    specs = {
        p: NamedSharding(MESH, SHARDING.sharding_for(p, v) if v.ndim == 2 else P())
        for p, v in nnx.to_flat_state(state)
    }
    flat = [(p, jax.device_put(v.get_value(), specs[p])) for p, v in nnx.to_flat_state(state)]
    nnx.update(tree, nnx.from_flat_state(flat))
    return tree


def kernel_specs(shardings):
    return {p: s.spec for p, s in nnx.to_flat_state(shardings) if p[-1] == "kernel"}


# --- the exporting process ---------------------------------------------------------------------


def test_export_runs_like_jit_and_updates_the_modules():
    model, reference = Net(), Net()
    exported = nnx_sharding.export(forward, model, X)
    assert isinstance(exported, Exported) and exported.fun_name == "forward"
    y, (state,) = exported.call(model, X)
    np.testing.assert_allclose(y, nnx_sharding.jit(forward)(reference, X), rtol=1e-6)
    assert int(model.count[...]) == int(state["count"]) == int(reference.count[...]) == 1
    assert isinstance(state, nnx.State) and state["layers"][0]["kernel"].shape == (32, 4)


def test_the_program_takes_states_and_returns_new_states():
    model = Net()
    exported = nnx_sharding.export(forward, model, X)
    (args, kwargs) = jax.tree.unflatten(exported.in_tree, exported.in_avals)
    assert isinstance(args[0], nnx.State) and kwargs == {}
    assert args[0]["lin"]["kernel"].shape == (16, 32) and args[1].shape == X.shape
    outputs, states = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    assert outputs.shape == (8, 4) and len(states) == 1
    state = nnx.state(model)
    y1, (s1,) = exported.call(state, X)  # an nnx.State of Variables
    y2, (s2,) = exported.call(s1, X)  # the State of arrays it returned
    np.testing.assert_allclose(y1, y2)
    assert (int(s1["count"]), int(s2["count"]), int(model.count[...])) == (1, 2, 0)


def test_abstract_modules_export_without_allocating():
    abstract = nnx.eval_shape(lambda: Net())
    x = jax.ShapeDtypeStruct(X.shape, X.dtype)
    exported = nnx_sharding.export(forward, abstract, x)
    model = Net()
    y, (state,) = exported.call(model, X)
    np.testing.assert_allclose(y, Net()(X), rtol=1e-5, atol=1e-6)
    assert int(model.count[...]) == 1


def test_shardings_are_kept_through_serialization():
    jitted = nnx_sharding.jit(forward, in_shardings=(SHARDING, P("data")))
    with jax.set_mesh(MESH):
        exported = nnx_sharding.export(jitted, Net(), X)
    restored = nnx_sharding.deserialize(exported.serialize())
    assert restored.nr_devices == 8
    for exp in (exported, restored):
        (state, x), _ = exp.in_shardings_jax(MESH)
        assert kernel_specs(state) == {
            ("lin", "kernel"): P(None, "model"),
            ("layers", 0, "kernel"): P(None, "model"),
        }
        assert x.spec == P("data")
        _, (new_state,) = exp.out_shardings_jax(MESH)
        assert kernel_specs(new_state) == kernel_specs(state)
    y, (state,) = restored.call(Net(), X)  # unplaced arrays are moved to the shardings
    assert state["lin"]["kernel"].sharding.spec == P(None, "model")
    assert len(state["lin"]["kernel"].sharding.device_set) == 8
    np.testing.assert_allclose(y, Net()(X), rtol=1e-5, atol=1e-6)


def test_shardings_of_the_arrays_themselves_are_kept():
    model = sharded(Net())
    exported = nnx_sharding.export(forward, model, X)
    assert exported.nr_devices == 8
    (state, x), _ = exported.in_shardings_jax()
    assert kernel_specs(state)[("lin", "kernel")] == P(None, "model")


def test_lowering_for_several_platforms_on_cpu():
    with jax.set_mesh(MESH):
        exported = nnx_sharding.export(
            nnx_sharding.jit(forward, in_shardings=(SHARDING, P("data"))),
            Net(),
            X,
            platforms=("cpu", "cuda", "tpu"),
        )
    restored = nnx_sharding.deserialize(exported.serialize())
    assert restored.platforms == ("cpu", "cuda", "tpu")
    y, _ = restored.call(nnx.state(Net()), X)
    np.testing.assert_allclose(y, Net()(X), rtol=1e-5, atol=1e-6)


def test_static_arguments_are_baked_in():
    def scaled(model, factor, x):
        return model(x) * factor

    exported = nnx_sharding.export(nnx_sharding.jit(scaled, static_argnums=1), Net(), 3.0, X)
    y, _ = exported.call(Net(), X)
    np.testing.assert_allclose(y, Net()(X) * 3.0, rtol=1e-6)


def test_graph_node_outputs_become_states_and_shared_variables_travel_once():
    model = Net()

    def both(model, lin, x):  # lin is model.lin: its Variables are model's
        lin.kernel[...] *= 2
        return model, model(x)

    exported = nnx_sharding.export(both, model, model.lin, X)
    ((in_model, in_lin, _), _) = jax.tree.unflatten(exported.in_tree, exported.in_avals)
    assert "lin" in in_model and len(in_lin) == 0  # the alias carries no second copy
    (out_model, y), (new_model, new_lin) = exported.call(model, model.lin, X)
    assert isinstance(out_model, nnx.State) and int(out_model["count"]) == 1
    reference = Net()
    reference.lin.kernel[...] *= 2
    np.testing.assert_allclose(y, reference(X), rtol=1e-6)
    np.testing.assert_allclose(model.lin.kernel[...], reference.lin.kernel[...])


def test_structure_changes_cannot_be_exported():
    def grow(model, x):
        model.extra = nnx.Param(jnp.zeros(2))
        return model(x)

    with pytest.raises(
        ValueError,
        match=r"export: fun: the function changed the graph "
        r"structure of args\[0\]",
    ):
        nnx_sharding.export(grow, Net(), X)


def test_wrong_arguments_are_named():
    exported = nnx_sharding.export(forward, Net(), X)
    with pytest.raises(
        TypeError,
        match=r"args\[1\]: got float32\[3, 16\], exported for "
        r"float32\[8, 16\]",
    ):
        exported.call(Net(), jnp.ones((3, 16)))
    state = nnx.state(Net())
    del state["lin"]["bias"]
    with pytest.raises(TypeError, match=r"args\[0\]\.lin\.bias: missing"):
        exported.call(state, X)
    with pytest.raises(
        TypeError,
        match=r"Exported.call: arguments: the arguments have the "
        r"structure",
    ):
        exported.call(Net())


# --- a fresh process: no model class, only the bytes and arrays --------------------------------


CHILD = textwrap.dedent(
    """
    import json, sys, time
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import nnx_sharding

    start = time.perf_counter()
    folder = sys.argv[1]
    exported = nnx_sharding.deserialize(open(folder + "/program.bin", "rb").read())
    arrays = np.load(folder + "/inputs.npz")
    args, kwargs = jax.tree.unflatten(
        exported.in_tree, [arrays[f"a{i}"] for i in range(len(arrays.files))]
    )
    losses = []
    for _ in range(3):  # each step feeds the new states back in
        loss, (model, optimizer) = exported.call(*args, **kwargs)
        args = (model, optimizer, *args[2:])
        losses.append(float(loss))
    kernel = model["lin"]["kernel"]
    np.savez(folder + "/outputs.npz", *jax.tree.leaves((model, optimizer)))
    print(json.dumps({
        "losses": losses,
        "platforms": list(exported.platforms),
        "kernel_spec": str(kernel.sharding.spec),
        "kernel_devices": len(kernel.sharding.device_set),
        "modules": sorted(m for m in sys.modules if m.startswith(("test", "tests"))),
        "seconds": time.perf_counter() - start,
    }))
    """
)


def test_deserialized_in_a_fresh_process_without_the_model_class(tmp_path):
    model = Net()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    jitted = nnx_sharding.jit(train_step, in_shardings=(SHARDING, SHARDING, P("data"), P("data")))
    start = time.perf_counter()
    with jax.set_mesh(MESH):
        exported = nnx_sharding.export(
            jitted, model, optimizer, X, Y, platforms=("cpu", "cuda", "tpu")
        )
    data = exported.serialize()
    export_seconds = time.perf_counter() - start
    (tmp_path / "program.bin").write_bytes(data)
    inputs = jax.tree.leaves(((nnx.state(model), nnx.state(optimizer), X, Y), {}))
    assert [x.shape for x in inputs] == [a.shape for a in exported.in_avals]
    np.savez(tmp_path / "inputs.npz", **{f"a{i}": np.asarray(x) for i, x in enumerate(inputs)})

    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    child = json.loads(result.stdout.strip().splitlines()[-1])

    reference = [float(train_step_jit(model, optimizer)) for _ in range(3)]
    np.testing.assert_allclose(child["losses"], reference, rtol=1e-5)
    got = np.load(tmp_path / "outputs.npz")
    want = jax.tree.leaves((nnx.state(model), nnx.state(optimizer)))
    assert len(got.files) == len(want)
    for i, w in enumerate(want):
        np.testing.assert_allclose(got[f"arr_{i}"], w, rtol=1e-5, atol=1e-6)
    assert child["platforms"] == ["cpu", "cuda", "tpu"]
    assert child["kernel_spec"] == str(P(None, "model")) and child["kernel_devices"] == 8
    assert child["modules"] == []  # no test module, so not the model's class
    print(
        f"export+serialize {export_seconds:.2f}s, {len(data)} bytes; "
        f"child deserialize+3 calls {child['seconds']:.2f}s"
    )


_STEP = {}


def train_step_jit(model, optimizer):
    step = _STEP.setdefault("step", nnx_sharding.jit(train_step))
    return step(model, optimizer, X, Y)


def test_partition_specs_need_a_mesh():
    jitted = nnx_sharding.jit(forward, in_shardings=(SHARDING, P("data")))
    with pytest.raises(
        ValueError, match=r"export: in_shardings: the PartitionSpec .* needs a mesh"
    ):
        nnx_sharding.export(jitted, Net(), X)


def test_a_variable_argument_is_refused_and_each_fix_works():
    v = nnx.Param(jnp.ones(3))
    with pytest.raises(TypeError) as e:
        nnx_sharding.export(lambda v, x: v[...] * x, v, 2.0)
    message = str(e.value)
    assert "args[0] is a Variable, not inside a graph node" in message
    assert "`nnx.Dict(w=v)`" in message and "`v[...]`" in message
    boxed = nnx_sharding.export(lambda d, x: d["w"][...] * x, nnx.Dict(w=v), 2.0)
    y, _ = boxed.call(nnx.state(nnx.Dict(w=v)), 2.0)
    np.testing.assert_allclose(y, 2.0 * np.ones(3))
    by_value = nnx_sharding.export(lambda w, x: w * x, v[...], 2.0)
    y, _ = by_value.call(v[...], 2.0)
    np.testing.assert_allclose(y, 2.0 * np.ones(3))
