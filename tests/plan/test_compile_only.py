"""The planner on the targets' own compilers (compile-only TPUs and GPUs, no device):
FSDP's gradients leave as reduce-scatters and each device holds an eighth of the state.
Run where ``python -m nnx_sharding compilers --install`` installed both (the test command
does; in CI, `test_ci_has_both_compilers` fails where it did not)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import nnx_sharding
from nnx_sharding.plan._hardware import tpu_log
from nnx_sharding.plan._hardware.devices import has_gpu_compiler, has_tpu_compiler
from nnx_sharding.plan._search import compile, drive

TARGETS = [
    pytest.param(
        "v5e:2x4",
        "tpu",
        marks=pytest.mark.skipif(not has_tpu_compiler(), reason="needs the TPU compiler"),
    ),
    pytest.param(
        "h100",
        "gpu",
        marks=pytest.mark.skipif(not has_gpu_compiler(), reason="needs the GPU compiler"),
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
"""


@pytest.mark.parametrize(("accelerator", "compiler"), TARGETS)
def test_the_compilers_are_used_from_python_with_no_platform_set(accelerator, compiler):
    """A fresh process with no JAX_PLATFORMS (jax then starts every backend it knows)
    plans with the target's compiler, loaded by the planner, and prints nothing on stderr
    (the compilers' start-up complaints stay out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.pop("ALLOW_MULTIPLE_LIBTPU_LOAD", None)
    code = SCRIPT.replace("ACCELERATOR", repr(accelerator))
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert (run.stdout, run.stderr) == (f"{compiler} None\n", "")


def _plan_while_another_holds_libtpu(allow: str | None) -> subprocess.CompletedProcess:
    """Plans for a v5e:2x4 in a fresh process while another holds libtpu, both with
    ``ALLOW_MULTIPLE_LIBTPU_LOAD`` as ``allow`` (None: unset); the second's run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.pop("ALLOW_MULTIPLE_LIBTPU_LOAD", None)
    if allow is not None:
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = allow
    hold = (
        "import sys\n"
        "from nnx_sharding.plan._hardware.devices import compile_devices\n"
        "print(compile_devices('v5e:2x4', 8)[1], flush=True)\n"
        "sys.stdin.readline()\n"
    )
    first = subprocess.Popen(
        [sys.executable, "-c", hold], env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert first.stdout is not None
        assert first.stdout.readline() == "tpu\n"  # it holds libtpu now
        code = SCRIPT.replace("ACCELERATOR", repr("v5e:2x4"))
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        first.communicate("\n", timeout=60)


@pytest.mark.skipif(not has_tpu_compiler(), reason="needs the TPU compiler")
def test_two_processes_plan_for_tpus_at_once():
    """libtpu lets one process at a time load it unless ALLOW_MULTIPLE_LIBTPU_LOAD is set:
    the planner sets it while loading (unless the environment says otherwise), so a
    second planner runs while the first holds libtpu."""
    run = _plan_while_another_holds_libtpu(None)
    assert (run.returncode, run.stdout, run.stderr) == (0, "tpu None\n", "")
    refused = _plan_while_another_holds_libtpu("0")  # the reference: one at a time
    assert refused.returncode != 0 and "v5e:2x4" in refused.stderr


def test_ci_has_both_compilers():
    """CI runs the README's test command, which installs both compilers: their tests
    must run there, never be skipped for want of them."""
    if not os.environ.get("CI"):
        pytest.skip("outside CI the compilers may be missing (their tests are skipped)")
    assert (has_tpu_compiler(), has_gpu_compiler()) == (True, True), (
        "run `python -m nnx_sharding compilers --install` before the tests"
    )


@pytest.mark.skipif(not has_gpu_compiler(), reason="needs the GPU compiler")
def test_the_gpu_kernel_cache_is_written_and_changes_no_figure(monkeypatch):
    """The search gives each compile a GPU kernel cache file: the compiler writes its
    kernels there, and every figure of every plan is what it is without the cache."""
    model = nnx.eval_shape(lambda: nnx.Linear(256, 256, rngs=nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32)

    def plan() -> list[tuple]:
        plans = nnx_sharding.plan(
            lambda m, x: (m(x) ** 2).mean(), model, x, devices=8, accelerator="h100",
            layouts=["dp", "fsdp"],
        )  # fmt: skip
        assert plans and all(p.compiled for p in plans)
        return [(p.label, p.memory, p.flops, p.collectives, p.time) for p in plans]

    written: list[int] = []
    real = drive.compile_candidate

    def spy(step, candidate, kernels=None):
        plan = real(step, candidate, kernels)
        written.append(os.path.getsize(kernels))
        return plan

    monkeypatch.setattr(drive, "compile_candidate", spy)
    cached = plan()
    assert len(written) == 2 and min(written) > 0  # the compiler wrote its kernels
    monkeypatch.setattr(drive, "compile_candidate", real)
    monkeypatch.setattr(compile, "compiler_options", lambda compiler, kernels: None)
    assert plan() == cached  # the reference: no cache
    assert compile.compiler_options("tpu", "kernels.bin") is None  # GPU only


def spy_on_temporaries(monkeypatch) -> list:
    """The compiler's memory statistics of each candidate compiled, as `temporaries`
    is given them."""
    seen: list = []
    real = compile.temporaries
    monkeypatch.setattr(
        compile,
        "temporaries",
        lambda compiler, stats, *rest: seen.append(stats) or real(compiler, stats, *rest),
    )
    return seen


@pytest.mark.skipif(not has_tpu_compiler(), reason="needs the TPU compiler")
def test_a_tpu_plans_peak_is_the_compilers_own_not_the_sum_of_its_parts(monkeypatch):
    """The TPU compiler's ``temp_size_in_bytes`` counts its temporaries' fragmentation
    twice: the plan's peak is the compiler's ``peak_memory_in_bytes``, which here differs
    from arguments + outputs - alias + that temp, and its temp what the peak leaves."""

    class Stack(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((4, 2048, 2048)))

    def loss(model: Stack, x: jax.Array) -> jax.Array:
        h = x
        for i in range(4):
            h = jnp.tanh(h @ model.w[i])
        return (h**2).mean()

    seen = spy_on_temporaries(monkeypatch)
    x = jax.ShapeDtypeStruct((8 * 4096, 2048), jnp.float32)
    plans = nnx_sharding.plan(
        nnx.grad(loss), nnx.eval_shape(Stack), x, devices=8, accelerator="v5e:2x4", layouts=["dp"]
    )
    (stats,) = seen
    parts = (
        stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )  # fmt: skip
    memory = plans[0].memory
    assert memory.peak == stats.peak_memory_in_bytes != parts
    assert memory.temp == memory.peak - (memory.arguments + memory.outputs - memory.alias)


@pytest.mark.skipif(not has_tpu_compiler(), reason="needs the TPU compiler")
def test_offloaded_activations_are_the_hosts_memory_and_hide_under_the_kernels(monkeypatch):
    """``offload_qkv`` moves each layer's input and projections to the host: the TPU
    compiler's peak then counts the host's buffers, so the plan's device memory is the
    program's bytes in libtpu's own report (its log), not ``temp_size_in_bytes``; the
    host's bytes are a note, and the asynchronous copies to and from the host are not
    priced as kernels (they overlap them); its matmuls recompute less than under
    ``full``."""
    import dataclasses

    from nnx_sharding.plan import DECODER_CONFIGS, decoder_builder, search

    seen = spy_on_temporaries(monkeypatch)
    config = dataclasses.replace(
        DECODER_CONFIGS["llama3-8b"], vocab=1024, layers=4, batch=16, seq_len=1024,
        d_model=1024, heads=8, kv_heads=8, mlp=4096,
    )  # fmt: skip
    plans = search(
        decoder_builder(config), {"remat": ["full", "offload_qkv"]}, devices=8,
        accelerator="v5e:2x4", layouts=[("fsdp", {"fsdp": 8})], prune=False,
    )  # fmt: skip
    full, offload = sorted(plans, key=lambda p: p.knobs["remat"] != "full")
    stats = seen[[p.knobs["remat"] for p in plans].index("offload_qkv")]
    assert stats.host_temp_size_in_bytes > 0
    log = open(tpu_log.log_file() or os.devnull).read()
    reported = re.findall(
        r"Total hbm usage >= \S+:\s+reserved\s+\S+\s+program\s+([\d.]+)([KMG])", log
    )
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    assert any(
        abs(offload.memory.temp - float(v) * units[u]) <= units[u] / 100 for v, u in reported
    )
    assert offload.memory.temp != stats.temp_size_in_bytes
    assert any("in the host's memory" in n for n in offload.notes)
    host = ("dynamic-slice-start", "dynamic-update-slice-start")
    copies = [op for op in offload.program.kernels if op.opcode in host]
    assert copies == [] and offload.time.compute < full.time.compute
