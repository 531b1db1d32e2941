"""``python -m nnx_sharding plan``: the table for the built-in decoder; a bad option is a
one-line error, a plan the planner refuses its whole message."""

from __future__ import annotations

import jax
import pytest

from nnx_sharding._cli.plan import main


def test_plans_the_decoder_and_prints_the_ranked_table(capsys, tmp_path):
    plot = tmp_path / "plan.png"
    argv = ["--config", "tiny", "--devices", "8", "--accelerator", "cpu"]
    status = main([*argv, "--layouts", "dp,fsdp,tp", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert status == 0
    assert "planning tiny (" in out and "for 8 devices of cpu" in out
    for label in ("data=8", "fsdp=8", "model=8"):
        assert label in out
    assert "best: Plan(" in out
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--memory-limit", "80parsecs"], "expected a size such as 80GiB"),
        (["--accelerator", "h1000"], "h100"),
        (["--layouts", "dp,ddp"], "unknown --layouts ddp; choose among dp,zero1,fsdp,tp"),
        (["--devices", "2048"], "the command plans up to 1024 devices"),
        (["--config", "huge"], "invalid choice: 'huge'"),
        (["--tokens", "1e12"], "--tokens and --days go together"),
    ],
)
def test_a_bad_option_is_one_line_and_status_2(option, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(option)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m nnx_sharding plan: error:") and message in err
    assert err.count("\n") == 1


def test_plan_is_a_command_of_the_main_job():
    """``python -m nnx_sharding plan --help``: the command's own options."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    run = subprocess.run(
        [sys.executable, "-m", "nnx_sharding", "plan", "--help"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    # the published models' names make the --config choices long: argparse wraps the usage
    assert run.stdout.startswith("usage: python -m nnx_sharding plan [-h]")
    options = ("--config {tiny,1b,1b-wide,llama2-7b,", "--devices", "--accelerator")
    for option in (*options, "--memory-limit", "--layouts", "--plot"):
        assert option in run.stdout


def test_a_device_count_the_process_lacks_reruns_the_command(capfd):
    """This process has 8 CPU devices: planning for 2 runs the command again with 2
    (the main job's one device-count mechanism)."""
    assert len(jax.devices()) == 8  # jax started: the command reruns itself
    argv = ["--config", "tiny", "--devices", "2", "--accelerator", "cpu", "--layouts", "dp"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "for 2 devices of cpu" in out and "data=2" in out and "best: Plan(" in out


def test_the_default_batch_splits_over_every_device(capfd):
    """The tiny config's batch of 8 is raised to 16 for 16 devices: every data-parallel
    layout compiles (none is left with a batch that does not divide), layers scanned."""
    assert len(jax.devices()) == 8  # jax started: the command reruns itself with 16,
    # leaving this process's 8 devices to the other tests
    argv = ["--config", "tiny", "--devices", "16", "--accelerator", "cpu", "--layouts", "dp,fsdp"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "batch 16 × 64 tokens) for 16 devices" in out
    assert "shapes do not divide" not in out and "best: Plan(" in out


def test_tokens_and_days_size_the_run_in_devices(capfd):
    """``--tokens 1e8 --days 1``: a target 2 devices meet (the tiny decoder's step is
    microseconds): the command names that count, its plan and the days it predicts."""
    assert len(jax.devices()) == 8  # jax started: the command reruns itself with 2,
    # leaving this process's 8 devices to the other tests
    argv = ["--config", "tiny", "--devices", "2", "--accelerator", "cpu", "--layouts", "dp"]
    assert main([*argv, "--batch", "8", "--tokens", "1e8", "--days", "1"]) == 0
    out = capfd.readouterr().out
    assert "1e+08 tokens in 1 days: 2 devices: dp (data=2)" in out


# --- the search: knobs, your own builder, JSON -------------------------------------------


def test_searches_the_decoders_microbatches_and_writes_every_plan_as_json(capsys, tmp_path):
    import dataclasses
    import json

    from nnx_sharding.plan._decoder.configs import DECODER_CONFIGS

    path = tmp_path / "plans.json"
    argv = ["--config", "tiny", "--devices", "8", "--accelerator", "cpu", "--layouts", "dp"]
    status = main([*argv, "--microbatches", "1,2", "--d-model", "64", "--json", str(path)])
    out = capsys.readouterr().out
    assert status == 0, out
    config = dataclasses.replace(DECODER_CONFIGS["tiny"], d_model=64)
    # the default batch: every microbatch of it splits over the 8 devices
    assert f"planning tiny ({config.param_count():,} parameters, batch 16 × 64" in out
    assert "microbatches" in out and "TFLOP/s/device" in out
    assert f"every plan written to {path}" in out
    plans = json.loads(path.read_text())["plans"]
    assert sorted(p["knobs"]["microbatches"] for p in plans) == [1, 2]
    # MaxText's count: 6 per parameter per token, and causal attention (DecoderConfig)
    n, tokens = config.param_count(), 16 * 64
    attention = 6 * config.heads * config.layers * config.head_dim * 64**2 * 16
    for p in plans:
        assert p["model_flops"] == (6 * n * tokens + attention) / 8  # per device of 8
        if p["compiled"]:
            assert p["model_tflops_per_device"] == p["model_flops"] / p["time"]["step"] / 1e12


def test_searches_the_pipeline_knobs_of_a_scanned_decoder(capsys, tmp_path):
    """``--scan`` stacks the tiny decoder's layers, ``--layouts pp+fsdp`` pipelines them
    and ``--knob pipeline_microbatches=4,8`` searches the schedule: each plan's notes
    give its bubble."""
    import json

    path = tmp_path / "plans.json"
    argv = ["--config", "tiny", "--scan", "--layers", "4", "--batch", "16", "--devices", "8"]
    argv += ["--accelerator", "cpu", "--layouts", "pp+fsdp", "--json", str(path)]
    status = main([*argv, "--knob", "pipeline_microbatches=4,8"])
    out = capsys.readouterr().out
    assert status == 0, out
    plans = json.loads(path.read_text())["plans"]
    pipelined = [p for p in plans if p["mesh_shape"] == {"stage": 4, "fsdp": 2}]
    assert sorted(p["knobs"]["pipeline_microbatches"] for p in pipelined) == [4, 8]
    bubbles = sorted(n for p in pipelined for n in p["notes"] if "pipeline bubble" in n)
    assert [b.split(" of the step")[0] for b in bubbles] == [
        "pipeline bubble: 27%",  # 3 / (8 + 3)
        "pipeline bubble: 43%",  # 3 / (4 + 3)
    ]


def test_plans_your_own_builder_over_its_knobs(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_builder.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "from flax import nnx\n"
        "from nnx_sharding.plan import Built\n"
        "def build(knobs):\n"
        "    model = nnx.eval_shape(lambda: nnx.Linear(16, 16, rngs=nnx.Rngs(0)))\n"
        "    x = jax.ShapeDtypeStruct((8 * knobs['scale'], 16), jnp.float32)\n"
        "    return Built(lambda m, x: jnp.sum(m(x) ** 2), (model, x))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "plans.json"
    argv = ["--model", "my_builder:build", "--knob", "scale=1,2", "--devices", "8"]
    status = main([*argv, "--accelerator", "cpu", "--layouts", "dp", "--json", str(path)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "planning my_builder:build for 8 devices of cpu" in out
    import json

    plans = json.loads(path.read_text())["plans"]
    assert sorted(p["knobs"]["scale"] for p in plans) == [1, 2]
    assert all(p["fits"] and p["compiled"] for p in plans)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--model", "nothing_here:build"], "--model 'nothing_here:build': cannot import"),
        (["--model", "build"], "--model 'build': expected MODULE:NAME"),
        (["--model", "json:nothing"], "--model 'json:nothing': 'json' has no callable 'nothing'"),
        (["--knob", "=3"], "expected NAME=V1,V2"),
        (["--microbatches", "1,0"], "expected a positive integer, got '0'"),
        (["--remat", "none", "--knob", "remat=full"], "the knob 'remat' is given twice"),
    ],
)
def test_a_bad_search_option_is_one_line_and_status_2(option, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--devices", "8", "--accelerator", "cpu", *option])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m nnx_sharding plan: error:") and message in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--microbatches", "3", "--batch", "8"],
         "microbatches=3 does not divide the batch of 8 (its divisors: 1, 2, 4, 8)"),
        (["--remat", "fulll"], "remat='fulll' is not a value the builder takes"),
    ],
)  # fmt: skip
def test_a_knob_value_the_decoder_refuses_is_its_message_and_status_2(option, message, capsys):
    """The planner's message, whole: the problem on the error line, the rule and the
    numbered fixes below it."""
    argv = ["--config", "tiny", "--devices", "8", "--accelerator", "cpu", "--layouts", "dp"]
    assert main([*argv, *option]) == 2
    first, rule, *rest = capsys.readouterr().err.splitlines()
    assert first.startswith("python -m nnx_sharding plan: error: plan.search: ")
    assert message in first and rule.startswith("Rule: ")
    assert rest[0] == "Fixes:" and rest[1].startswith("  1. ")


def test_a_size_the_decoder_lacks_names_the_ones_it_has(capsys):
    import dataclasses

    from nnx_sharding.plan._decoder.configs import DECODER_CONFIGS

    if "kv_heads" in {f.name for f in dataclasses.fields(DECODER_CONFIGS["tiny"])}:
        pytest.skip("this decoder has kv_heads")
    with pytest.raises(SystemExit):
        main(["--config", "tiny", "--devices", "8", "--accelerator", "cpu", "--kv-heads", "2"])
    err = capsys.readouterr().err
    assert "--kv-heads: the decoder has no such size; it has batch, d_model" in err


def test_when_nothing_fits_the_command_says_which_knobs_would(capsys):
    """The decoder at batch 64 needs ~25.7 MiB per device with fsdp and no remat (the
    CPU compiler): under a 12 MB limit, the command compiles knob values it was not
    asked for, the lightest remat policy first, and names the one that fits (full
    remat, ~10.2 MiB)."""
    argv = ["--config", "tiny", "--devices", "8", "--accelerator", "cpu", "--layouts", "fsdp"]
    assert main([*argv, "--batch", "64", "--memory-limit", "12000000"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "Plans.best: memory_limit: no layout fits in 11.44 MiB per device; the closest is "
        "fsdp (fsdp=8)"
    ) in out
    assert (
        "1. search remat='full': compiled beyond the space searched, fsdp (fsdp=8; remat=full) fits"
    ) in out


def test_the_mixture_of_experts_sizes_can_be_given(capsys, tmp_path):
    """``--experts`` and friends make the tiny decoder's MLP a mixture of experts; its
    model FLOPs count the active parameters (MaxText's count)."""
    import dataclasses
    import json

    from nnx_sharding.plan._decoder.configs import DECODER_CONFIGS

    path = tmp_path / "plans.json"
    argv = ["--config", "tiny", "--devices", "8", "--accelerator", "cpu", "--layouts", "fsdp"]
    argv += ["--experts", "4", "--experts-per-token", "2", "--expert-mlp", "64"]
    status = main(
        [*argv, "--shared-experts", "1", "--capacity-factor", "1.25", "--json", str(path)]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    c = dataclasses.replace(
        DECODER_CONFIGS["tiny"], experts=4, expert_mlp=64, shared_experts=1,
        capacity_factor=1.25, batch=8,
    )  # fmt: skip
    assert f"planning tiny ({c.param_count():,} parameters" in out
    (plan,) = json.loads(path.read_text())["plans"]
    assert plan["model_flops"] == c.model_flops() / 8 and plan["compiled"]


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--capacity-factor", "lots"], "expected a positive number such as 1.25, or none"),
        (["--experts", "-1"], "expected a whole number, 0 or more"),
        (["--experts", "4", "--experts-per-token", "9"], "experts_per_token: 9 experts per"),
    ],
)
def test_a_bad_expert_option_is_an_error_and_status_2(option, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--config", "tiny", "--devices", "8", "--accelerator", "cpu", *option])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
