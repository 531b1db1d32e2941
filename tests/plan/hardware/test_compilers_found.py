"""Where the planner finds its compilers and how it installs them
(nnx_sharding/plan/_hardware/compilers.py), on stand-in files: no compiler is loaded here."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from nnx_sharding._cli import compilers
from nnx_sharding.plan._hardware import compilers as plugins


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """An empty compilers folder (``NNX_SHARDING_COMPILERS``), no ``TPU_LIBRARY_PATH``."""
    monkeypatch.setenv("NNX_SHARDING_COMPILERS", str(tmp_path))
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    return tmp_path / f"jax-{importlib.metadata.version('jax')}"


def _touch(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return str(path)


def test_the_folder_is_per_jax_version_under_the_cache_or_the_variable(monkeypatch, tmp_path):
    version = importlib.metadata.version("jax")
    monkeypatch.delenv("NNX_SHARDING_COMPILERS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert plugins.compilers_dir() == tmp_path / "cache/nnx_sharding/compilers" / f"jax-{version}"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = tmp_path / "home/.cache/nnx_sharding/compilers"
    assert plugins.compilers_dir() == home / f"jax-{version}"
    monkeypatch.setenv("NNX_SHARDING_COMPILERS", str(tmp_path / "mine"))
    assert plugins.compilers_dir() == tmp_path / "mine" / f"jax-{version}"


def test_the_installed_compilers_are_found_in_the_folder_first(folder, monkeypatch):
    tpu = _touch(folder / "tpu/libtpu/libtpu.so")
    gpu = _touch(folder / "gpu/jax_plugins/xla_cuda12/xla_cuda_plugin.so")
    assert (plugins.tpu_library(), plugins.cuda_library()) == (tpu, gpu)
    mine = _touch(folder.parent / "elsewhere/libtpu.so")
    monkeypatch.setenv("TPU_LIBRARY_PATH", mine)  # the user's own libtpu comes first
    assert plugins.tpu_library() == mine
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(folder / "missing.so"))  # jax skips it too
    assert plugins.tpu_library() == tpu


def test_without_the_folder_only_packages_jax_finds_are_used(folder):
    """With nothing installed in the folder, the compilers are those of packages installed
    the usual way (jax[tpu], jax[cuda12]), found without importing them, else None."""

    def package_file(name: str, file: str) -> str | None:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            return None
        if spec is None:
            return None
        path = Path(list(spec.submodule_search_locations)[0]) / file
        return str(path) if path.is_file() else None

    assert plugins.tpu_library() == package_file("libtpu", "libtpu.so")
    assert plugins.cuda_library() == package_file("jax_plugins.xla_cuda12", "xla_cuda_plugin.so")


@pytest.mark.parametrize(("allow", "args"), [(None, None), ("0", "--xla_foo=1")])
def test_the_tpu_library_is_named_only_while_it_loads(monkeypatch, allow, args):
    """While libtpu loads, the planner's library is named, parallel loads allowed and
    its log written as it goes (the user's flags kept); all as they were afterwards."""
    monkeypatch.setenv("TPU_LIBRARY_PATH", "/the/users.so")
    for name, value in [("ALLOW_MULTIPLE_LIBTPU_LOAD", allow), ("LIBTPU_INIT_ARGS", args)]:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with plugins.tpu_library_env("/the/planners.so"):
        assert os.environ["TPU_LIBRARY_PATH"] == "/the/planners.so"
        assert os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] == (allow or "1")  # the user's kept
        assert os.environ["LIBTPU_INIT_ARGS"].split() == [*([args] if args else []),
                                                         "--logbuflevel=-1"]  # fmt: skip
    assert os.environ["TPU_LIBRARY_PATH"] == "/the/users.so"
    assert os.environ.get("ALLOW_MULTIPLE_LIBTPU_LOAD") == allow
    assert os.environ.get("LIBTPU_INIT_ARGS") == args


def test_the_requirements_are_those_of_the_installed_jax():
    assert plugins.requirement("gpu") == "jax-cuda12-pjrt==" + importlib.metadata.version("jaxlib")
    tpu = Requirement(plugins.requirement("tpu"))
    pins = [Requirement(r) for r in importlib.metadata.requires("jax") or []]
    jax_tpu = [r for r in pins if r.name == "libtpu" and r.marker.evaluate({"extra": "tpu"})]
    assert (tpu.name, tpu.specifier) == ("libtpu", jax_tpu[0].specifier)


def _fake_pip(status: int, calls: list[list[str]]):
    """A ``subprocess.run`` that records the command and, like pip, writes the package
    into ``--target`` (when it succeeds)."""

    def run(command, *args, **kwargs):
        calls.append(list(command))
        target = Path(command[command.index("--target") + 1])
        _touch(target / "libtpu/libtpu.so")
        return subprocess.CompletedProcess(command, status)

    return run


def test_install_puts_a_compiler_in_its_folder_only_when_pip_succeeds(folder, monkeypatch):
    monkeypatch.setattr(plugins, "package_folder", lambda name: None)  # no jax[tpu] here
    calls: list[list[str]] = []
    monkeypatch.setattr(compilers.subprocess, "run", _fake_pip(1, calls))
    assert compilers.main(["--install", "tpu"]) == 1
    assert not folder.joinpath("tpu").exists() and not folder.joinpath("tpu.partial").exists()
    monkeypatch.setattr(compilers.subprocess, "run", _fake_pip(0, calls))
    assert compilers.main(["--install", "tpu"]) == 0
    assert plugins.tpu_library() == str(folder / "tpu/libtpu/libtpu.so")
    assert not folder.joinpath("tpu.partial").exists()
    assert calls[-1] == [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
        "--only-binary=:all:", "--target", str(folder / "tpu.partial"),
        plugins.requirement("tpu"),
    ]  # fmt: skip
    calls.clear()
    assert compilers.main(["--install", "tpu"]) == 0  # found: nothing to install
    assert calls == []


def test_the_command_says_where_each_compiler_is(folder, capsys):
    gpu = _touch(folder / "gpu/jax_plugins/xla_cuda12/xla_cuda_plugin.so")
    assert compilers.main(["gpu"]) == 0
    assert capsys.readouterr().out == f"gpu: {gpu}\n"
    with pytest.raises(SystemExit) as exit_:
        compilers.main(["cuda"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "python -m nnx_sharding compilers: error: unknown compiler 'cuda'; choose among "
        "tpu, gpu (see --help)\n"
    )


def test_the_command_line_runs_it(folder):
    tpu = _touch(folder / "tpu/libtpu/libtpu.so")
    env = {k: v for k, v in os.environ.items() if k != "TPU_LIBRARY_PATH"}
    run = subprocess.run(
        [sys.executable, "-m", "nnx_sharding", "compilers", "tpu"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (run.returncode, run.stdout, run.stderr) == (0, f"tpu: {tpu}\n", "")
