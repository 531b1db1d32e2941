"""``python -m nnx_sharding plan``: the table for the built-in decoder, one-line errors."""

from __future__ import annotations

import pytest

from nnx_sharding.plan._cli import main


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
    ],
)
def test_a_bad_option_is_one_line_and_status_2(option, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(option)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m nnx_sharding plan: error:") and message in err
    assert err.count("\n") == 1
