"""Abstract inputs: lowering and compiling models that are never allocated; the aot report."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding._cli.aot import aot_main, aot_report
from nnx_sharding._units import format_bytes
from nnx_sharding.plan._decoder.configs import DECODER_CONFIGS

ROOT = Path(__file__).resolve().parent.parent
MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
GiB = 1024**3


class MLP(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            16, 64, kernel_init=nnx.with_partitioning(init, ("data", "model")), rngs=rngs
        )
        self.down = nnx.Linear(
            64, 16, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs
        )
        self.count = nnx.BatchStat(jnp.array(0))

    def __call__(self, x):
        self.count[...] += 1
        return self.down(jax.nn.relu(self.up(x)))


def forward(model, x):
    return model(x)


def shard_bytes(x):
    return int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize


X = jnp.linspace(-1, 1, 8 * 16, dtype=jnp.float32).reshape(8, 16)
X_SPEC = jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=NamedSharding(MESH, P("data")))


def test_abstract_values_with_shardings_lower_compile_and_run_real_models():
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    nnx_sharding.shard(abstract, MESH)  # ShapeDtypeStructs now carry NamedShardings
    kernel = abstract.up.kernel.get_value()
    assert isinstance(kernel, jax.ShapeDtypeStruct) and kernel.sharding.spec == P("data", "model")

    compiled = nnx_sharding.jit(forward).lower(abstract, X_SPEC).compile()
    (state, x), _ = compiled.args_info
    assert state["up"]["kernel"].shape == (16, 64) and x.shape == X.shape
    flat_in = jax.tree.leaves(compiled.input_shardings)
    assert P("data", "model") in [s.spec for s in flat_in]
    values = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(abstract))]
    expected = sum(map(shard_bytes, values)) + shard_bytes(X_SPEC)
    assert compiled.memory_analysis().argument_size_in_bytes == expected
    assert compiled.cost_analysis()["flops"] > 0

    with nnx.use_eager_sharding(False):
        model = MLP(nnx.Rngs(0))
    reference = nnx.clone(model)
    nnx_sharding.shard(model, MESH)
    y = compiled(model, jax.device_put(X, X_SPEC.sharding))
    np.testing.assert_allclose(y, reference(X), rtol=1e-5, atol=1e-6)
    assert int(model.count[...]) == 1


def test_abstract_values_take_shardings_from_a_state_sharding():
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    assert abstract.up.kernel.get_value().sharding is None
    shardings = nnx_sharding.StateSharding({nnx.PathContains("kernel"): P(None, "model"), ...: P()})
    step = nnx_sharding.jit(forward, in_shardings=(shardings, P("data")))
    with jax.set_mesh(MESH):
        traced = step.trace(abstract, jax.ShapeDtypeStruct(X.shape, X.dtype))
        compiled = traced.lower().compile()
        out = step.eval_shape(abstract, jax.ShapeDtypeStruct(X.shape, X.dtype))
    assert out.shape == (8, 16)
    specs = [s.spec for s in jax.tree.leaves(compiled.input_shardings)]  # the flat call's
    assert sorted(map(str, specs)) == sorted(
        map(str, [P()] * 3 + [P(None, "model")] * 2 + [P("data")])
    )
    assert type(traced.out_info) is jax.ShapeDtypeStruct
    kernel_bytes = (16 * 64 // 4 + 64 * 16 // 4) * 4
    other_bytes = (64 + 16) * 4 + 4 + 8 * 16 * 4 // 2
    assert compiled.memory_analysis().argument_size_in_bytes == kernel_bytes + other_bytes


# --- a 1B-parameter transformer, compiled in a fresh process that stays small ------------------


CHILD = textwrap.dedent(
    """
    import dataclasses, json, resource, time
    start = time.perf_counter()
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    from nnx_sharding._cli.aot import aot_report
    report = aot_report("1b", {"data": 2, "model": 4})
    out = dataclasses.asdict(report)
    # the peak of this process's own memory: Linux's VmHWM (ru_maxrss keeps the peak of
    # the process that started this one, across its exec: a large pytest worker's)
    try:
        status = open("/proc/self/status").read()
        out["max_rss_bytes"] = int(status.split("VmHWM:")[1].split()[0]) * 1024
    except (OSError, IndexError):
        out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["seconds"] = time.perf_counter() - start
    print(json.dumps(out))
    """
)


def test_a_1b_transformer_compiles_for_8_devices_without_allocating():
    result = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])

    c = DECODER_CONFIGS["1b"]
    d, layers = c.d_model, c.layers
    norms = layers * 2 * d + d
    matrices = 2 * c.vocab * d + layers * (4 * d * c.heads * c.head_dim + 2 * d * c.mlp)
    assert report["params"] == matrices + norms >= 1_000_000_000
    # FSDP over data=2 and tensor parallelism over model=4 split every matrix 8 ways
    per_device = (matrices // 8 + norms) * 4
    tokens = c.batch * (c.seq_len + 1) * 4 // 2
    assert report["param_bytes"] == (matrices + norms) * 4
    assert report["param_bytes_per_device"] == per_device
    assert report["argument_bytes"] == per_device + tokens
    assert report["alias_bytes"] >= 0.99 * per_device  # the donated parameters
    assert report["output_bytes"] >= 0.99 * per_device  # the updated parameters
    assert report["temp_bytes"] > 0
    # a training step is about 6 FLOPs per parameter and token, spread over 8 devices
    estimate = 6 * report["params"] * c.batch * c.seq_len / 8
    assert 0.8 * estimate < report["flops"] < 1.5 * estimate
    assert report["max_rss_bytes"] < 2 * GiB  # 4 GiB of float32 weights never allocated
    print(
        f"\n1b: {report['params']:,} params; per device: argument {report['argument_bytes']:,} B,"
        f" output {report['output_bytes']:,} B, temp {report['temp_bytes']:,} B;"
        f" {report['flops']:.3e} FLOPs; lower {report['lower_seconds']:.1f}s,"
        f" compile {report['compile_seconds']:.1f}s, process {report['seconds']:.1f}s;"
        f" peak RSS {report['max_rss_bytes'] / 2**20:.0f} MiB"
    )


# --- the command line --------------------------------------------------------------------------


def test_aot_main_prints_the_report_table(capsys):
    assert aot_main(["--config", "tiny", "--mesh", "model=4,data=2"]) == 0
    out = capsys.readouterr().out
    assert "config 'tiny', mesh data=2,model=4 (8 devices)" in out
    for row in ("argument bytes", "output bytes", "temp bytes", "FLOPs", "compile"):
        assert row in out
    assert f"{DECODER_CONFIGS['tiny'].param_count():,}" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--devices", "8", "--mesh", "model=4"],
            "--mesh model=4 has 4 devices, but --devices is 8",
        ),
        (
            ["--devices", "16", "--mesh", "data=2,model=4"],
            "--mesh data=2,model=4 has 8 devices, but --devices is 16",
        ),
        (["--devices", "0"], "argument --devices: expected a positive integer, got '0'"),
        (
            ["--mesh", "data=3,model=4"],
            "cannot shard config '1b': batch (8) is not divisible by mesh axis 'data' (3)",
        ),
        (["--mesh", "fsdp=8"], "expected NAME=SIZE pairs with NAME in ('data', 'model')"),
        (["--mesh", "data=2,data=4"], "axis 'data' is given twice"),
        (["--mesh", "data=two"], "expected a positive size for 'data', got 'two'"),
        (["--config", "2b"], "unknown --config '2b'; choose one of tiny, 1b, 1b-wide"),
        (
            ["--config", "tiny", "--mesh", "model=8"],
            "cannot shard config 'tiny': heads (4) is not divisible by mesh axis 'model' (8)",
        ),
        (["--steps", "3"], "unrecognized arguments: --steps 3"),
    ],
)
def test_aot_main_rejects_bad_options_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        aot_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m nnx_sharding aot: error: ")
    assert message in err


def aot(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    return subprocess.run(
        [sys.executable, "-m", "nnx_sharding", "aot", *args],
        cwd=ROOT, env={**clean, **(env or {})}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def per_device_parameters(out: str) -> str:
    found = re.search(r"parameter bytes\s+│\s+([\d.]+ \w+)", out)
    assert found, out
    return found[1]


@pytest.mark.parametrize(
    "args, env, title",
    [
        (["--devices", "4", "--mesh", "model=4"], {}, "mesh model=4 (4 devices)"),
        (["--mesh", "model=4"], {}, "mesh model=4 (4 devices)"),  # --devices: the mesh's
        # the environment's device count does not matter: the command sets its own
        (
            ["--devices", "16", "--mesh", "data=4,model=4"],
            {"JAX_NUM_CPU_DEVICES": "3"},
            "mesh data=4,model=4 (16 devices)",
        ),
        (["--devices", "2"], {}, "mesh data=2,model=1 (2 devices)"),  # the default mesh
    ],
)
def test_aot_runs_on_the_devices_its_mesh_needs(args, env, title):
    run = aot("--config", "tiny", *args, env=env)
    assert run.returncode == 0, run.stderr
    assert f"AOT: config 'tiny', {title}" in run.stdout and "Traceback" not in run.stderr
    n = int(re.search(r"\((\d+) devices\)", title)[1])
    c = DECODER_CONFIGS["tiny"]
    matrices = c.param_count() - (2 * c.layers + 1) * c.d_model
    per_device = (matrices // n + (2 * c.layers + 1) * c.d_model) * 4  # every matrix split n ways
    assert per_device_parameters(run.stdout) == format_bytes(per_device)


def test_aot_mismatched_devices_is_one_line_from_the_command_line():
    run = aot("--devices", "16", "--mesh", "data=2,model=4")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == (
        "python -m nnx_sharding aot: error: --mesh data=2,model=4 has 8 devices, "
        "but --devices is 16 (see --help)\n"
    )


def test_aot_main_on_another_device_count_reruns_itself(capsys):
    """This process has 8 devices: a 4-device mesh runs in a fresh process, same output."""
    assert aot_main(["--config", "tiny", "--mesh", "model=4"]) == 0
    out = capsys.readouterr().out
    assert "AOT: config 'tiny', mesh model=4 (4 devices)" in out


def test_aot_help_says_what_it_accepts(capsys):
    with pytest.raises(SystemExit) as info:
        aot_main(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "[--config CONFIG] [--devices N] [--mesh AXES]" in out
    assert "--devices N simulated CPU devices (default: the mesh's size; without --mesh, 8)" in out
    assert (
        "their sizes multiply to N (default: data=2 and model=N/2, or model=N for an odd N)" in out
    )


def test_aot_report_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"aot_report: config: no config is named '7b'"):
        aot_report("7b", {"data": 2})
    with pytest.raises(ValueError, match=r"aot_report: mesh: the mesh .* needs 16 devices"):
        aot_report("tiny", {"data": 2, "model": 8})
    with pytest.raises(ValueError, match=r"heads \(4\) is not divisible by mesh axis 'model'"):
        aot_report("tiny", {"model": 8})
