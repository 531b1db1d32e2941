"""Damage is detected and disk faults are named (`checkpoint._integrity`).

- Every chunk is stored with tensorstore's ``crc32c`` codec: bytes overwritten inside
  a data file, or a data file cut short, make `restore` fail with a ValueError naming
  the Variable, the target untouched; orbax alone, reading the same files, fails too
  (the check is the storage engine's), and without the codec the same damage restores
  wrong values silently.
- A save into a directory that is not writable, or onto a disk that fills up half way,
  is one OSError naming the checkpoint, with no orbax traceback on stderr; the
  checkpoints saved before stay restorable.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from flax import nnx

from nnx_sharding import checkpoint
from nnx_sharding.checkpoint import _integrity


class Pair(nnx.Module):
    """Two Linears: the damage is in one of them, and the error names that one."""

    def __init__(self, rngs: nnx.Rngs):
        self.small = nnx.Linear(4, 4, rngs=rngs)
        self.large = nnx.Linear(256, 256, rngs=rngs)


def data_files(directory: Path) -> list[Path]:
    """The chunk files of a checkpoint (or of an orbax PyTree item), largest first."""
    found = [p for p in directory.rglob("*") if p.is_file() and "/d/" in str(p)]
    return sorted(found, key=lambda p: p.stat().st_size, reverse=True)


def stored_zarr(item: Path, name: str) -> dict:
    """The ``zarr.json`` of the array ``name`` inside the OCDBT database of an orbax
    PyTree item (a checkpoint's ``state``)."""
    kvstore = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
    return json.loads(kvstore.read(f"{name}/zarr.json").result().value)


def snapshot(tree: nnx.Module) -> dict[tuple, np.ndarray]:
    return {p: np.array(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(tree))}


def assert_untouched(tree: nnx.Module, before: dict[tuple, np.ndarray]) -> None:
    after = snapshot(tree)
    assert after.keys() == before.keys()
    for path, value in before.items():
        np.testing.assert_array_equal(after[path], value, err_msg=str(path))


def overwrite(file: Path) -> None:
    """5,000 random bytes over the middle of ``file``."""
    with file.open("r+b") as f:
        f.seek(1000)
        f.write(np.random.default_rng(0).bytes(5000))


def truncate(file: Path) -> None:
    with file.open("r+b") as f:
        f.truncate(file.stat().st_size // 2)


def test_every_chunk_is_stored_with_its_crc32c(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "ck", Pair(nnx.Rngs(0)))
    for name in ("large.kernel", "large.bias", "small.kernel"):
        assert _integrity.chunk_codecs(stored_zarr(tmp_path / "ck" / "state", name))[-1] == "crc32c"


@pytest.mark.parametrize("damage", [overwrite, truncate])
def test_damaged_data_is_an_error_naming_the_variable(tmp_path: Path, damage: Callable) -> None:
    saved = Pair(nnx.Rngs(0))
    checkpoint.save(tmp_path / "ck", saved)
    damage(data_files(tmp_path / "ck")[0])  # the largest: large.kernel's chunk
    target = Pair(nnx.Rngs(1))
    before = snapshot(target)
    with pytest.raises(ValueError) as info:
        checkpoint.restore(tmp_path / "ck", target)
    message = str(info.value)
    assert message.startswith(
        "checkpoint.restore: directory: the data of target.large.kernel is damaged or missing"
    ), message
    assert "checksum (CRC-32C)" in message and "Nothing was changed" in message
    assert_untouched(target, before)
    # the engine's own check: orbax reading the same files fails as well
    with pytest.raises(Exception, match="large.kernel"):
        ocp.StandardCheckpointer().restore(tmp_path / "ck" / "state")
    # what is not damaged still restores
    part = checkpoint.restore(tmp_path / "ck", Pair(nnx.Rngs(2)), filter=nnx.PathContains("small"))
    np.testing.assert_array_equal(part.small.kernel.get_value(), saved.small.kernel.get_value())


def test_a_manager_step_with_damage(tmp_path: Path) -> None:
    with checkpoint.Manager(tmp_path) as manager:
        manager.save(1, Pair(nnx.Rngs(0)))
        manager.save(2, Pair(nnx.Rngs(1)))
    overwrite(data_files(tmp_path / "2")[0])
    with checkpoint.Manager(tmp_path) as manager:
        target = nnx.eval_shape(lambda: Pair(nnx.Rngs(3)))
        with pytest.raises(ValueError, match=r"Manager.restore: directory: the data of "):
            manager.restore(target)
        restored = manager.restore(target, step=1)
    np.testing.assert_array_equal(
        restored.large.kernel.get_value(), Pair(nnx.Rngs(0)).large.kernel.get_value()
    )


def test_without_the_checksum_the_same_damage_restores_wrong_values(tmp_path: Path) -> None:
    """The reason for the codec: orbax's own zarr v3 chunks (no crc32c) damaged the same
    way read back silently, with other values."""
    saved = Pair(nnx.Rngs(0))
    plain = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True))
    build = _integrity.tensorstore_utils._build_zarr3_metadata
    _integrity.tensorstore_utils._build_zarr3_metadata = build.__wrapped__
    try:
        plain.save(tmp_path / "plain", args=ocp.args.PyTreeSave(nnx.state(saved).to_pure_dict()))
    finally:
        _integrity.tensorstore_utils._build_zarr3_metadata = build
    assert "crc32c" not in _integrity.chunk_codecs(stored_zarr(tmp_path / "plain", "large.kernel"))
    overwrite(data_files(tmp_path / "plain")[0])
    restored = plain.restore(tmp_path / "plain")
    assert not np.array_equal(restored["large"]["kernel"], saved.large.kernel.get_value())


# --- disk faults -------------------------------------------------------------------


class Big(nnx.Module):
    def __init__(self, n: int, seed: int):
        self.w = nnx.Param(jnp.arange(n * n, dtype=jnp.float32).reshape(n, n) + seed)


@contextlib.contextmanager
def own_filesystem(directory: Path, size: str) -> Iterator[Callable[[], None]]:
    """``directory`` on a tmpfs of ``size`` (root only); yields a function that makes it
    read-only. Without root, a plain directory made read-only by its mode."""
    directory.mkdir()
    if os.geteuid() != 0:
        yield lambda: directory.chmod(0o555)
        directory.chmod(0o755)
        return
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"root, but cannot mount a tmpfs: {mount.stderr.strip()}")

    def read_only() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(directory)], check=True)

    try:
        yield read_only
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def test_a_directory_that_is_not_writable(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with own_filesystem(disk, "64m") as read_only:
        checkpoint.save(disk / "single", Big(16, 1))
        manager = checkpoint.Manager(disk / "run")
        manager.save(1, Big(16, 1))
        manager.wait_until_finished()
        read_only()
        with pytest.raises(OSError) as info:
            checkpoint.save(disk / "other", Big(16, 2))
        assert info.value.errno in (errno.EROFS, errno.EACCES)
        assert f"could not write the checkpoint {disk / 'other'}: " in str(info.value)
        with pytest.raises(OSError, match=f"could not write the checkpoint {disk / 'single'}: "):
            checkpoint.save(disk / "single", Big(16, 2), force=True)
        with pytest.raises(OSError, match=f"step 2 of {disk / 'run'}: "):
            manager.save(2, Big(16, 2))
            manager.wait_until_finished()
        assert manager.all_steps() == [1]
        template = nnx.eval_shape(lambda: Big(16, 0))
        expected = Big(16, 1).w.get_value()
        np.testing.assert_array_equal(manager.restore(template).w.get_value(), expected)
        restored = checkpoint.restore(disk / "single", template)
        np.testing.assert_array_equal(restored.w.get_value(), expected)
        manager.close()


# A full disk, in a process of its own: after the first checkpoints, the files this
# process writes may not grow past LIMIT bytes (RLIMIT_FSIZE: a write past it fails with
# EFBIG, as one past the end of a disk fails with ENOSPC), or, as root, the directory is
# a tmpfs of 2 MiB. The 4 MiB saves that follow fail half way.
FULL = textwrap.dedent(
    """
    import os, resource, signal, sys
    import jax
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    from flax import nnx
    from nnx_sharding import checkpoint

    class Big(nnx.Module):
        def __init__(self, n, seed):
            self.w = nnx.Param(jnp.arange(n * n, dtype=jnp.float32).reshape(n, n) + seed)

    disk, how = sys.argv[1], sys.argv[2]
    checkpoint.save(f"{disk}/single", Big(16, 1))
    manager = checkpoint.Manager(f"{disk}/run")
    manager.save(1, Big(16, 1))
    manager.wait_until_finished()
    if how == "limit":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    for attempt in ("single", "step"):
        try:
            if attempt == "single":
                checkpoint.save(f"{disk}/single", Big(1024, 2), force=True)
            else:
                manager.save(2, Big(1024, 2))
                manager.wait_until_finished()
            print("saved", attempt)
        except OSError as e:
            print("ERROR", e.errno, str(e).splitlines()[0])
    template = nnx.eval_shape(lambda: Big(16, 0))
    print("steps", manager.all_steps())
    step = manager.restore(template).w.get_value()
    single = checkpoint.restore(f"{disk}/single", template).w.get_value()
    expected = Big(16, 1).w.get_value()
    print("restored", bool((step == expected).all()), bool((single == expected).all()))
    manager.close()
    print("listing", sorted(os.listdir(disk)), sorted(os.listdir(f"{disk}/run")))
    """
)


@pytest.mark.parametrize("how", ["limit", "tmpfs"])
def test_a_disk_that_fills_up_half_way(tmp_path: Path, how: str) -> None:
    disk = tmp_path / "disk"
    fill: contextlib.AbstractContextManager = contextlib.nullcontext()
    if how == "tmpfs":
        if os.geteuid() != 0:
            pytest.skip("mounting a 2 MiB tmpfs needs root (the 'limit' case runs anywhere)")
        fill = own_filesystem(disk, "2m")
    else:
        disk.mkdir()
    with fill:
        run = subprocess.run(
            [sys.executable, "-c", FULL, str(disk), how],
            capture_output=True,
            text=True,
            timeout=300,
        )
    context = f"rc {run.returncode}\n{run.stdout}\n{run.stderr[-4000:]}"
    assert run.returncode == 0, context
    code = errno.EFBIG if how == "limit" else errno.ENOSPC
    reason = os.strerror(code)
    assert run.stdout.splitlines()[:2] == [
        f"ERROR {code} [Errno {code}] checkpoint.save: directory: could not write the "
        f"checkpoint {disk / 'single'}: {reason}",
        f"ERROR {code} [Errno {code}] Manager.wait_until_finished: directory: could not write the "
        f"checkpoint step 2 of {disk / 'run'}: {reason}",
    ], context
    assert "steps [1]" in run.stdout and "restored True True" in run.stdout, context
    assert "listing ['run', 'single'] ['1']" in run.stdout, context  # nothing left behind
    assert "Traceback" not in run.stderr and "ERROR:absl" not in run.stderr, context
