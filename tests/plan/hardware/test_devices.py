"""Devices to compile for (nnx_sharding/plan/_hardware/devices.py): compile-only TPUs and GPUs when
their compilers are installed (``python -m nnx_sharding compilers --install``), else CPU
devices.

The TPU and GPU tests compile a small FSDP training step with the real compilers, on
this machine, with no accelerator: the gradients must leave as reduce-scatters and each
device's arguments must be an eighth of the state (and batch).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_sharding.plan._hardware.accelerators import PRESETS
from nnx_sharding.plan._hardware.devices import (
    compile_devices,
    default_tpu_topology,
    has_gpu_compiler,
    has_tpu_compiler,
)

needs_tpu = pytest.mark.skipif(not has_tpu_compiler(), reason="needs the TPU compiler")
needs_gpu = pytest.mark.skipif(not has_gpu_compiler(), reason="needs the GPU compiler")

D, F = 256, 1024  # shards of every array are whole rows on 8 devices


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, F, rngs=rngs)
        self.down = nnx.Linear(F, D, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def _fsdp_step(devices):
    """A never-allocated Adam step, every array sharded on its first dimension over 8
    devices; returns the compiled step and the bytes one device should hold."""

    def build():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(build)
    graph_m, state_m = nnx.split(model)
    graph_o, state_o = nnx.split(optimizer)
    mesh = Mesh(np.array(devices), ("fsdp",))

    def sharding(x):
        spec = PartitionSpec("fsdp") if x.ndim and x.shape[0] % 8 == 0 else PartitionSpec()
        return NamedSharding(mesh, spec)

    batch = jax.ShapeDtypeStruct((64, D), jnp.float32)

    def step(state_m, state_o, x):
        model, optimizer = nnx.merge(graph_m, state_m), nnx.merge(graph_o, state_o)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return nnx.state(model), nnx.state(optimizer), loss

    shardings = (jax.tree.map(sharding, state_m), jax.tree.map(sharding, state_o))
    compiled = (
        jax.jit(
            step,
            in_shardings=(*shardings, sharding(batch)),
            out_shardings=(*shardings, NamedSharding(mesh, PartitionSpec())),
            donate_argnums=(0, 1),
        )
        .lower(state_m, state_o, batch)
        .compile()
    )
    per_device = 0
    for leaf in jax.tree.leaves((state_m, state_o, batch)):
        shape = sharding(leaf).shard_shape(leaf.shape)
        per_device += math.prod(shape) * leaf.dtype.itemsize
    total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves((state_m, state_o)))
    return compiled, per_device, total


def test_cpu_devices_are_the_process_devices():
    devices, compiler, note = compile_devices(PRESETS["cpu"], 8)
    assert (devices, compiler, note) == (jax.devices("cpu")[:8], "cpu", None)
    assert compile_devices("cpu", 3)[0] == jax.devices("cpu")[:3]


def test_too_few_cpu_devices_says_how_to_get_them():
    with pytest.raises(ValueError) as e:
        compile_devices("cpu", 64)
    message = str(e.value)
    assert message.startswith(
        "plan: devices: planning for 64 devices needs 64 CPU devices; this process has 8"
    )
    assert "JAX_NUM_CPU_DEVICES=64" in message
    assert "python -m nnx_sharding plan --devices 64" in message


def test_default_tpu_topologies_are_the_squarest_first():
    assert default_tpu_topology("v5e", 256)[0] == "v5e:16x16"
    assert default_tpu_topology("v6e", 32)[:2] == ["v6e:4x8", "v6e:2x16"]
    assert default_tpu_topology("v5p", 64)[0] == "v5p:4x4x4"
    assert default_tpu_topology("v5e", 1) == ["v5e:1x1"]


def test_gpu_without_a_target_description_falls_back_to_cpu_saying_so():
    import dataclasses

    mine = dataclasses.replace(PRESETS["h100"], name="my-gpu")
    devices, compiler, note = compile_devices(mine, 8)
    assert (devices, compiler) == (jax.devices("cpu")[:8], "cpu")
    assert note.startswith("compiled for simulated CPU devices: no GPU target description")


@pytest.mark.skipif(has_tpu_compiler(), reason="the TPU compiler is installed")
def test_tpu_without_its_compiler_says_how_to_install_it():
    with pytest.raises(
        ValueError, match=re.escape("python -m nnx_sharding compilers --install tpu")
    ):
        compile_devices("v5e:2x4", 8)


@pytest.mark.skipif(has_gpu_compiler(), reason="the GPU compiler is installed")
def test_gpu_without_its_compiler_falls_back_to_cpu_saying_how_to_install_it():
    devices, compiler, note = compile_devices("h100", 8)
    assert (devices, compiler) == (jax.devices("cpu")[:8], "cpu")
    assert "(python -m nnx_sharding compilers --install gpu)" in note


@needs_tpu
def test_tpu_topologies_give_compile_only_chips(capfd):
    capfd.readouterr()
    devices, compiler, note = compile_devices("v5e:2x4", 8)
    assert (len(devices), compiler, note) == (8, "tpu", None)
    assert {d.platform for d in devices} == {"tpu"}
    assert devices[0].device_kind == "TPU v5 lite"
    assert compile_devices("v5e:2x4", 8)[0] == devices  # the same devices every time
    assert len(compile_devices("v5p", 16)[0]) == 16  # the squarest slice: 2x2x4
    two, _, _ = compile_devices("v5e:2x4", 16, num_slices=2)
    assert sorted({d.slice_index for d in two}) == [0, 1]
    one, _, note = compile_devices("v5e", 1)  # a slice smaller than a host: its own host
    assert (len(one), note) == (1, None)
    assert len(compile_devices("v6e:1x2", 2)[0]) == len(compile_devices("v5p", 2)[0]) == 2
    four, _, note = compile_devices("v5e:2x4", 4)
    assert note == "planned for the first 4 of v5e:2x4's 8 chips"
    with pytest.raises(ValueError, match="rejects it: INVALID_ARGUMENT"):
        compile_devices("v5e:3x3", 9)
    assert capfd.readouterr().err == ""  # libtpu's start-up complaints stay out


@needs_gpu
def test_gpu_presets_give_compile_only_gpus_by_host(capfd):
    capfd.readouterr()
    for name, kind in [
        ("h100", "NVIDIA H100 80GB HBM3"),
        ("h200", "NVIDIA H200 141GB HBM3e"),
        ("a100-80gb", "NVIDIA A100-SXM4-80GB"),
        ("b200", "NVIDIA B200"),
    ]:
        devices, compiler, note = compile_devices(name, 8)
        assert (len(devices), compiler, note, devices[0].device_kind) == (8, "gpu", None, kind)
    devices, _, _ = compile_devices("h100", 64)
    assert [d.process_index for d in devices] == [i // 8 for i in range(64)]  # 8 hosts × 8
    devices, _, _ = compile_devices("h100", 12)
    assert [d.process_index for d in devices] == [0] * 8 + [1] * 4
    assert capfd.readouterr().err == ""  # the CUDA plugin's start-up complaints stay out


@needs_tpu
def test_fsdp_step_on_v5e_2x4_reduce_scatters_gradients_and_holds_an_eighth(capfd):
    capfd.readouterr()
    devices, _, _ = compile_devices("v5e:2x4", 8)
    compiled, per_device, total = _fsdp_step(devices)
    arguments = compiled.memory_analysis().argument_size_in_bytes
    # an eighth of everything but two replicated scalars (the step counts), and the TPU
    # pads small arrays to its (8, 128) tiles: within 0.5 %
    assert per_device < total / 8 + 64 * D * 4 / 8 + 16
    assert per_device <= arguments <= per_device * 1.005
    hlo = compiled.as_text()
    # the TPU compiler writes a reduce-scatter as an all-reduce-scatter fusion; its
    # results are the kernels' gradient shards
    scatters = [line for line in hlo.splitlines() if "calls=%all-reduce-scatter" in line]
    assert scatters
    shards = " ".join(line.partition(" fusion(")[0] for line in scatters)
    assert f"f32[{D // 8},{F}]" in shards and f"f32[{F // 8},{D}]" in shards
    assert capfd.readouterr().err == ""


@needs_gpu
def test_fsdp_step_on_8_h100s_reduce_scatters_gradients_and_holds_an_eighth(capfd):
    capfd.readouterr()
    devices, compiler, _ = compile_devices("h100", 8)
    assert compiler == "gpu"
    compiled, per_device, total = _fsdp_step(devices)
    assert compiled.memory_analysis().argument_size_in_bytes == per_device  # exact
    assert per_device < total / 8 + 64 * D * 4 / 8 + 16
    assert compiled.cost_analysis() is None  # the GPU compiler gives no FLOPs
    lines = compiled.as_text().splitlines()
    scatters = " ".join(x for x in lines if re.search(r"= .* reduce-scatter(-start)?\(", x))
    for shape in (f"f32[{D},{F}]", f"f32[{F},{D}]"):  # both kernels' gradients ...
        assert shape in scatters
    reduces = [line for line in lines if re.search(r"= .* all-reduce(-start)?\(", line)]
    for line in reduces:  # ... and no all-reduce of a kernel
        assert f"f32[{D},{F}]" not in line and f"f32[{F},{D}]" not in line
    assert capfd.readouterr().err == ""
