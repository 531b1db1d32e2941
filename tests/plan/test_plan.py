"""`plan`: its decisions against the scaling book's rules, bad input, the table, the
plot, `Plans.measure` on the CPU devices present, and the lazy import."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_sharding
from nnx_sharding.plan import PRESETS, Plans
from nnx_sharding.plan._measure import materialise


class MLP(nnx.Module):
    """Residual ReLU MLP blocks, no sharding metadata (tensor parallelism comes from
    the planner's analysis of the step)."""

    def __init__(self, d: int, f: int, layers: int, rngs: nnx.Rngs):
        self.ups = nnx.List([nnx.Linear(d, f, use_bias=False, rngs=rngs) for _ in range(layers)])
        self.downs = nnx.List([nnx.Linear(f, d, use_bias=False, rngs=rngs) for _ in range(layers)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for up, down in zip(self.ups, self.downs, strict=True):
            x = x + down(jax.nn.relu(up(x)))
        return x


def sgd_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def abstract_mlp(d: int = 1024, f: int = 4096, layers: int = 2) -> tuple[MLP, nnx.Optimizer]:
    def build() -> tuple[MLP, nnx.Optimizer]:
        model = MLP(d, f, layers, nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(build)


# --- decisions: the scaling book's rules on the same constants --------------------------

H100 = PRESETS["h100"]
ALPHA = H100.peak_flops("float32") / H100.intra_bandwidth
"""C / W: data parallelism is compute-bound above this many tokens per device (~149)."""


@pytest.fixture(scope="module")
def by_batch() -> dict[int, Plans]:
    model, optimizer = abstract_mlp()
    out = {}
    for per_device in (2, 2048):  # far below and far above C / W
        x = jax.ShapeDtypeStruct((8 * per_device, 1024), jnp.float32)
        out[per_device] = nnx_sharding.plan(
            sgd_step, model, optimizer, x, devices=8, accelerator="h100", donate_argnums=(0, 1)
        )
    return out


def test_growing_the_batch_moves_the_best_plan_from_tensor_to_data_parallel(by_batch):
    assert 2 < ALPHA / 10 and 2048 > ALPHA * 10
    small, large = by_batch[2].best, by_batch[2048].best
    assert "model" in small.mesh_shape, small  # comms-bound data parallelism loses
    assert "model" not in large.mesh_shape, large  # compute-bound: no activations to move
    # the overlapped estimate lies between the kernels alone and the unoverlapped sum;
    # the kernels' sum of rooflines is no less than the roofline of their sums
    for plans in by_batch.values():
        for p in plans:
            if p.time is not None:
                assert max(p.time.compute, p.time.memory) <= p.time.busy
                assert p.time.busy <= p.time.step <= p.time.serial
                assert p.time.serial == pytest.approx(p.time.busy + p.time.comms)


def test_a_memory_limit_below_data_parallel_moves_to_a_sharded_layout():
    model, optimizer = abstract_mlp()
    x = jax.ShapeDtypeStruct((8 * 2048, 1024), jnp.float32)
    layouts = ["dp", "dp+tp"]  # (FSDP, whose update is an eighth, beats dp at any limit)
    # The CPU compiler's figures, whatever compilers are installed: the GPU compiler's
    # activations for this batch leave dp+tp's peak no lower than dp's.
    free = nnx_sharding.plan(
        sgd_step,
        model,
        optimizer,
        x,
        devices=8,
        accelerator="cpu",
        layouts=layouts,
        donate_argnums=(0, 1),
    )
    assert free.best.layout == "dp"
    limit = free.best.memory.peak - 1
    tight = nnx_sharding.plan(
        sgd_step,
        model,
        optimizer,
        x,
        devices=8,
        accelerator="cpu",
        layouts=layouts,
        memory_limit=limit,
        donate_argnums=(0, 1),
    )
    assert tight.best.layout != "dp"
    assert tight.best.memory.peak <= limit
    assert tight.best.memory.state < free.best.memory.state
    dp = next(p for p in tight if p.layout == "dp")
    assert not dp.fits and f"{dp.memory.peak - limit:,} more than" in dp.reason


def test_a_model_that_fits_nowhere_names_the_closest_plan_and_its_shortfall():
    model, optimizer = abstract_mlp(256, 1024, 1)
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    plans = nnx_sharding.plan(
        sgd_step,
        model,
        optimizer,
        x,
        devices=8,
        accelerator="h100",
        memory_limit="64KiB",
        layouts=["dp", "fsdp"],
    )
    closest = min(plans, key=lambda p: p.memory.peak)
    assert closest.layout == "fsdp"
    with pytest.raises(ValueError) as info:
        _ = plans.best
    message = str(info.value)
    assert f"the closest is {closest.label}" in message
    assert f"({closest.memory.peak - 65536:,} bytes) too many" in message
    assert [p.fits for p in plans] == [False, False]
    assert plans[0] is closest  # none fits: ranked by memory


# --- bad input -----------------------------------------------------------------------------


def test_shapes_that_do_not_divide_are_reasons_not_crashes():
    model, optimizer = abstract_mlp(64, 12, 1)  # 12 hidden units: not over 8 devices
    x = jax.ShapeDtypeStruct((6, 64), jnp.float32)  # a batch of 6: not over 4 or 8
    plans = nnx_sharding.plan(sgd_step, model, optimizer, x, devices=8, layouts=["dp", "tp"])
    reasons = {p.layout: p.reason for p in plans}
    assert reasons["dp"] == (
        "shapes do not divide: args[2]: leading dimension 6 (the batch) is not divisible "
        "by the data-parallel axes data=8 (8)"
    )
    assert (
        "args[0].ups[0].kernel: dimension 1 (12) is not divisible by 'model' (8)" in (reasons["tp"])
    )
    assert all(p.memory is None and not p.fits for p in plans)


def test_a_step_that_fails_under_one_candidate_is_listed_with_the_message():
    model, optimizer = abstract_mlp(64, 64, 1)
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    calls = []

    def fragile(model, optimizer, x):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the second layout breaks me")
        return sgd_step(model, optimizer, x)

    plans = nnx_sharding.plan(fragile, model, optimizer, x, devices=8, layouts=["dp", "fsdp"])
    failed = [p for p in plans if p.reason is not None]
    assert len(failed) == 1
    assert failed[0].reason == ("could not be compiled: RuntimeError: the second layout breaks me")
    assert plans.best.reason is None


def test_unknown_accelerator_names_the_presets():
    model, optimizer = abstract_mlp(64, 64, 1)
    with pytest.raises(ValueError, match="h100") as info:
        nnx_sharding.plan(sgd_step, model, optimizer, jnp.ones((8, 64)), accelerator="h1000")
    assert "v5e" in str(info.value)


@pytest.mark.parametrize("limit", ["80 parsecs", "-3GB", 0, "GiB"])
def test_a_memory_limit_that_does_not_parse_says_what_forms_it_takes(limit):
    model, optimizer = abstract_mlp(64, 64, 1)
    with pytest.raises(ValueError) as info:
        nnx_sharding.plan(sgd_step, model, optimizer, jnp.ones((8, 64)), memory_limit=limit)
    assert f"plan: memory_limit: {limit!r} is not a size" in str(info.value)
    assert "'80GiB'" in str(info.value)


def test_unknown_layouts_are_named():
    model, optimizer = abstract_mlp(64, 64, 1)
    with pytest.raises(ValueError, match=re.escape("unknown layouts ['ddp']")):
        nnx_sharding.plan(sgd_step, model, optimizer, jnp.ones((8, 64)), layouts=["ddp"])


def test_more_devices_than_present_says_how_to_get_them():
    model, optimizer = abstract_mlp(64, 64, 1)
    with pytest.raises(ValueError, match="JAX_NUM_CPU_DEVICES"):
        nnx_sharding.plan(sgd_step, model, optimizer, jnp.ones((16, 64)), devices=16)


# --- the table, the plot, measure, jit on concrete arguments ------------------------------


@pytest.fixture(scope="module")
def small() -> tuple[Plans, MLP, nnx.Optimizer, jax.Array]:
    with nnx.use_eager_sharding(False):
        model = MLP(32, 64, 1, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    x = jnp.arange(16 * 32, dtype=jnp.float32).reshape(16, 32) / 512
    plans = nnx_sharding.plan(
        sgd_step,
        model,
        optimizer,
        x,
        devices=8,
        accelerator="cpu",
        layouts=["dp", "zero1", "fsdp", "tp"],
        donate_argnums=(0, 1),
    )
    return plans, model, optimizer, x


def test_the_table_lists_every_plan_ranked(small):
    plans = small[0]
    text = str(plans)
    rows = [line for line in text.splitlines() if re.match(r"│ \d ", line)]
    assert [row.split("│")[2].strip() for row in rows] == [p.layout for p in plans]
    assert "no overlap" in text and "8 devices (cpu" in text
    steps = [p.time.step for p in plans]
    assert steps == sorted(steps)


def test_plot_writes_an_image(small, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    small[0].plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measure_runs_the_best_plans_and_leaves_the_arguments_alone(small):
    plans, model, optimizer, x = small
    before = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    plans.measure(k=2, steps=2)
    measured = [p.measured for p in plans]
    assert all(m is not None and m > 0 for m in measured[:2]) and measured[2:] == [None] * 2
    after = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert "measured" in str(plans)


def test_measure_fills_abstract_arguments_with_small_positive_floats(small):
    """Not zeros, which a GPU multiplies faster: abstract float arrays become
    ``|N(0, 0.02²)|`` (positive, so that a second moment stays one), integers zeros,
    laid out as the plan says."""
    plans, model, optimizer, _ = small
    plan = plans[0]
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    steps = jax.ShapeDtypeStruct((3,), jnp.int32)
    abstract = nnx_sharding.plan(
        lambda m, o, x, n: sgd_step(m, o, x), model, optimizer, x, steps, devices=8,
        accelerator="cpu", layouts=[plan.layout], donate_argnums=(0, 1),
    )  # fmt: skip
    chosen = abstract[0]
    args = materialise(abstract._step, chosen, chosen.mesh())
    floats, ints = np.asarray(args[2]), np.asarray(args[3])
    assert floats.min() > 0 and 0.005 < floats.mean() < 0.03
    assert not ints.any() and ints.dtype == np.int32
    assert args[2].sharding.spec == chosen.shardings(chosen.mesh())[2].spec


def test_mesh_is_shaped_as_the_plan(small):
    for p in small[0]:
        mesh = p.mesh()
        assert dict(mesh.shape) == dict(p.mesh_shape)
        assert list(mesh.devices.flat) == jax.devices()[:8]


def test_importing_the_package_does_not_import_the_planner():
    code = (
        "import sys, nnx_sharding; assert 'nnx_sharding.plan' not in sys.modules; "
        "assert callable(nnx_sharding.plan); print(nnx_sharding.Accelerator.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Accelerator"


def test_a_step_may_constrain_its_activations_by_axis_name():
    """Each candidate is traced under its mesh (``jax.set_mesh``): a bare PartitionSpec
    in the step names the candidate's axes."""
    model = nnx.eval_shape(lambda: nnx.Linear(16, 16, rngs=nnx.Rngs(0)))

    def step(model: nnx.Linear, x: jax.Array) -> jax.Array:
        y = jax.lax.with_sharding_constraint(model(x), jax.sharding.PartitionSpec("data"))
        return jnp.sum(y**2)

    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    (dp,) = nnx_sharding.plan(step, model, x, devices=8, layouts=["dp"])
    assert dp.reason is None and dp.fits
    assert dp.collectives["all-gather"] == 0  # the batch stays split, as constrained
