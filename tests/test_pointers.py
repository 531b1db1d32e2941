"""`pointers`: the one-step identity comparison of two lists, and its fallback."""

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest
from flax import nnx

from nnx_sharding._fastpath import pointers as _pointers


def test_the_probe_accepts_this_python():
    assert _pointers.DIRECT
    assert _pointers._probe()


@pytest.mark.parametrize("direct", [True, False], ids=["pointers", "is"])
def test_same_objects_is_identity_not_equality(monkeypatch, direct):
    monkeypatch.setattr(_pointers, "DIRECT", direct)
    count = nnx.BatchStat(jnp.array(0))
    twin = nnx.BatchStat(jnp.array(0))  # compares equal to `count` (by its value)
    assert bool(count == twin)
    xs = [count, "name", 1.0, None]
    assert _pointers.same_objects(xs, list(xs))
    assert not _pointers.same_objects(xs, [twin, "name", 1.0, None])
    assert not _pointers.same_objects(xs, xs[:3])
    assert not _pointers.same_objects(xs, [*xs, None])
    assert _pointers.same_objects([], [])
    assert not _pointers.same_objects([], [count])


def test_pointers_that_do_not_read_back_turn_direct_off(monkeypatch):
    monkeypatch.setattr(_pointers, "_string_at", lambda address, size: bytes(size))
    assert not _pointers._probe()


def test_the_public_fallback_is_chosen_by_the_environment():
    check = "from nnx_sharding._fastpath import pointers; assert not pointers.DIRECT"
    env = {**os.environ, "NNX_SHARDING_PUBLIC_SLOTS": "1"}
    subprocess.run([sys.executable, "-c", check], env=env, check=True)
