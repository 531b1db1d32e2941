"""The planner on the targets' own compilers (compile-only TPUs and GPUs, no device):
FSDP's gradients leave as reduce-scatters and each device holds an eighth of the state.
Run where the ``tpu`` and ``gpu`` extras are installed (the test extras install both)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import nnx_sharding
from nnx_sharding.plan._devices import has_gpu_compiler, has_tpu_compiler

TARGETS = [
    pytest.param(
        "v5e:2x4",
        "tpu",
        marks=pytest.mark.skipif(not has_tpu_compiler(), reason="needs nnx_sharding[tpu]"),
    ),
    pytest.param(
        "h100",
        "gpu",
        marks=pytest.mark.skipif(not has_gpu_compiler(), reason="needs nnx_sharding[gpu]"),
    ),
]


def step(model: nnx.Linear, optimizer: nnx.Optimizer, x: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize(("accelerator", "compiler"), TARGETS)
def test_fsdp_reduce_scatters_gradients_and_holds_an_eighth(accelerator, compiler):
    def build() -> tuple[nnx.Linear, nnx.Optimizer]:
        model = nnx.Linear(512, 512, use_bias=False, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(build)
    x = jax.ShapeDtypeStruct((8 * 1024, 512), jnp.float32)  # a batch large enough to
    plans = nnx_sharding.plan(  # make gathering the weight cheaper than moving activations
        step, model, optimizer, x, devices=8, accelerator=accelerator,
        layouts=["dp", "fsdp"], donate_argnums=(0, 1),
    )  # fmt: skip
    dp, fsdp = (next(p for p in plans if p.layout == name) for name in ("dp", "fsdp"))
    assert {dp.compiler, fsdp.compiler} == {compiler}
    kernel = 512 * 512 * 4
    assert dp.memory.state == 2 * kernel + 4  # the kernel, its momentum, the step count
    assert fsdp.memory.state == 2 * kernel // 8 + 4
    assert fsdp.collectives["reduce-scatter"] == kernel  # the gradient, scattered
    # the kernel, gathered for the pass (the TPU compiler's gather moves half the bytes)
    assert fsdp.collectives["all-gather"] == (kernel // 2 if compiler == "tpu" else kernel)
    assert dp.collectives["all-reduce"] == kernel + 4  # the gradient and the loss


SCRIPT = """
import os
import jax, jax.numpy as jnp
from flax import nnx
import nnx_sharding
model = nnx.eval_shape(lambda: nnx.Linear(64, 64, rngs=nnx.Rngs(0)))
x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
plans = nnx_sharding.plan(
    lambda m, x: (m(x) ** 2).mean(), model, x, devices=8, accelerator=ACCELERATOR,
    layouts=["dp"],
)
print(plans[0].compiler, plans[0].reason)
assert os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"  # set before libtpu loaded
"""


@pytest.mark.parametrize(("accelerator", "compiler"), TARGETS)
def test_the_compilers_are_used_from_python_with_no_platform_set(accelerator, compiler):
    """A fresh process with no JAX_PLATFORMS (the CUDA plugin then refuses to register on
    a machine without CUDA, and jax would know no GPU topology) still plans with the
    target's compiler: the planner registers the plugin for compiling."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.pop("ALLOW_MULTIPLE_LIBTPU_LOAD", None)
    code = SCRIPT.replace("ACCELERATOR", repr(accelerator))
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == f"{compiler} None\n"
