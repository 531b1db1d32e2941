"""Calibrating an accelerator to measured steps, and sizing a run in devices."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import nnx_sharding
from nnx_sharding.plan import PRESETS, Accelerator
from nnx_sharding.plan._cost.calibrate import calibrate
from nnx_sharding.plan._cost.hlo import Collective
from nnx_sharding.plan._cost.kernels import Op
from nnx_sharding.plan._cost.model import Program

H100 = PRESETS["h100"]
TRUTH = dict(matmul_efficiency=0.41, hbm_efficiency=0.63, link_efficiency=0.37)


def program(flops: float, nbytes: float, gathered: float) -> Program:
    """One kernel of each kind and a tensor-parallel all-reduce (exposed whole)."""
    kernels = (
        Op("gemm", "fusion", "main", 1, flops, "bf16", 0.0),
        Op("norm", "fusion", "main", 1, 0.0, "", nbytes),
    )
    comms = (Collective("all-reduce", int(gathered), (tuple(range(8)),), "ar", "main"),)
    return Program(kernels, comms, {"model": 8})


def test_calibration_recovers_the_fractions_that_produced_the_measurements():
    """Steps measured on a device whose fractions are known (made up): fitted from the
    data sheet's figures, the three fractions come back."""
    device = dataclasses.replace(H100, **TRUTH)
    programs = [
        program(4e14, 1e11, 1e9),  # mostly compute
        program(1e13, 8e11, 2e9),  # mostly memory
        program(1e13, 5e10, 4e10),  # mostly the link
        program(2e14, 3e11, 1e10),
    ]
    measured = [(p, p.step(device)) for p in programs]
    fitted = calibrate(H100, measured)
    for name, value in TRUTH.items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.02), name
    assert fitted.name == "h100-calibrated"
    assert (fitted.peak_flops(), fitted.hbm_bandwidth) == (H100.peak_flops(), H100.hbm_bandwidth)
    # one measurement: one common scale of the three
    one = calibrate(H100, measured[:1])
    ratios = [getattr(one, n) / getattr(H100, n) for n in TRUTH]
    assert max(ratios) == pytest.approx(min(ratios))
    assert programs[0].step(one) == pytest.approx(measured[0][1], rel=0.01)


def test_calibrate_needs_a_measurement():
    with pytest.raises(ValueError, match=r"plans\.measure\(\)"):
        calibrate(H100, [])


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(256, 1024, rngs=rngs)
        self.down = nnx.Linear(1024, 256, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def train_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def build():
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


@pytest.fixture(scope="module")
def measured_plans():
    model, optimizer = nnx.eval_shape(build)
    x = jax.ShapeDtypeStruct((512, 256), jnp.float32)
    plans = nnx_sharding.plan(
        train_step, model, optimizer, x, devices=8, accelerator="cpu",
        layouts=["dp", "fsdp", "tp"], donate_argnums=(0, 1),
    )  # fmt: skip
    return plans.measure(k=3, steps=5)


def test_calibration_on_the_cpu_devices_moves_predictions_towards_measurements(
    measured_plans, tmp_path
):
    """The nominal CPU device (1 TFLOP/s, 100 GB/s) is not these two shared cores: the
    fitted fractions bring every measured plan's prediction closer to its measurement,
    and the fitted accelerator saves, loads and prices the plans again."""
    measured = [p for p in measured_plans if p.measured is not None]
    assert len(measured) == 3
    fitted = measured_plans.calibrate()
    for p in measured:
        before = abs(math.log(p.time.step / p.measured))
        after = abs(math.log(p.program.time(fitted).step / p.measured))
        assert after < before, (p.label, p.time.step, p.program.time(fitted).step, p.measured)
    fitted.save(tmp_path / "cpu.json")
    again = Accelerator.load(tmp_path / "cpu.json")
    assert again == fitted
    repriced = measured_plans.reprice(again)
    assert {p.label: p.measured for p in repriced} == {p.label: p.measured for p in measured_plans}
    for p in repriced:
        if p.program is not None:
            assert p.time == p.program.time(again)
    assert "cpu-calibrated" in repriced.title


def test_devices_for_replans_at_each_count_it_tries():
    """Planned on 2 devices, a target the 2-device step misses: more devices are
    planned (per-device batch kept), and the answer's days are its own plan's step
    times the steps the tokens take."""
    model, optimizer = nnx.eval_shape(build)
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    small = nnx_sharding.plan(
        train_step, model, optimizer, x, devices=2, accelerator="cpu",
        layouts=["dp", "fsdp"], donate_argnums=(0, 1),
    )  # fmt: skip
    step2 = small.best.time.step
    tokens_per_step = 64
    tokens = 1e9
    days2 = tokens / tokens_per_step * step2 / 86400
    sizing = small.devices_for(tokens, days2 / 2.5, tokens_per_step=tokens_per_step)
    assert sizing.devices in (4, 8)
    assert [n for n, _ in sizing.tried][0] == 2
    assert sizing.tokens_per_step == tokens_per_step * sizing.devices // 2
    again = nnx_sharding.plan(
        train_step, model, optimizer, jax.ShapeDtypeStruct((32 * sizing.devices, 256),
        jnp.float32), devices=sizing.devices, accelerator="cpu", layouts=["dp", "fsdp"],
        donate_argnums=(0, 1),
    )  # fmt: skip
    expected = tokens / sizing.tokens_per_step * again.best.time.step / 86400
    assert sizing.days == pytest.approx(expected)
    assert sizing.days <= days2 / 2.5
    assert sizing.days_low <= sizing.days <= sizing.days_high
    with pytest.raises(ValueError, match="no device count tried"):
        small.devices_for(tokens, days2 / 1e6, tokens_per_step=64, max_devices=8)


def test_devices_for_needs_plans_a_planner_made():
    """Plans put together by hand have no step to plan again: a clear error that says
    where such Plans come from (repriced Plans keep their planner)."""
    from nnx_sharding.plan import Plans

    model, optimizer = nnx.eval_shape(build)
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    planned = nnx_sharding.plan(
        train_step, model, optimizer, x, devices=2, accelerator="cpu", layouts=["dp"],
        donate_argnums=(0, 1),
    )  # fmt: skip
    by_hand = Plans(list(planned), planned._step, "by hand")
    with pytest.raises(ValueError, match="not made by plan or search"):
        by_hand.devices_for(1e9, 1.0, tokens_per_step=64)
    repriced = planned.reprice(planned._step.accelerator)
    assert repriced._planner is planned._planner is not None
