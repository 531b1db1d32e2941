"""`slots`: the probed direct read of a Variable's metadata, and its public fallback."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import nnx_sharding
from nnx_sharding._fastpath import slots as _slots

TESTS = Path(__file__).parent


def test_the_probe_accepts_the_installed_flax():
    assert _slots.DIRECT
    variable = nnx.Param(jnp.ones(2), scale=1.0)
    assert _slots.metadata_dict(variable) == variable.get_metadata()


def test_the_probe_refuses_another_layout(monkeypatch):
    monkeypatch.setattr(_slots, "_METADATA", "_no_such_slot")
    assert not _slots._probe()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "public"])
def test_a_metadata_change_is_seen_either_way(monkeypatch, direct):
    monkeypatch.setattr(_slots, "DIRECT", direct)
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    f = nnx_sharding.jit(lambda m: m.kernel.get_metadata().get("scale", 1.0) * m.bias[...])
    f(model)
    assert f(model).tolist() == [0.0, 0.0]
    model.bias[...] = jnp.ones(2)
    model.kernel.set_metadata(scale=3.0)
    assert f(model).tolist() == [3.0, 3.0]


def test_the_fast_path_tests_pass_through_the_public_fallback():
    env = {**os.environ, "NNX_SHARDING_PUBLIC_SLOTS": "1"}
    files = ["test_cache.py", "test_snapshot.py", "test_call.py"]
    check = "from nnx_sharding._fastpath import slots; assert not slots.DIRECT"
    subprocess.run([sys.executable, "-c", check], env=env, check=True)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


WRITES: list[object] = []


class Recorded(nnx.Param):
    """Records every write made outside a trace: the write-backs of a call."""

    def set_raw_value(self, value, **kwargs):
        if not isinstance(value, jax.core.Tracer):
            WRITES.append(value)
        super().set_raw_value(value, **kwargs)


def test_writes_go_through_the_slot_only_for_plain_variables():
    assert not hasattr(_slots.setter(nnx.Param(jnp.ones(2))), "__self__")  # the slot
    for special in (Recorded(jnp.ones(2)), nnx.Param(jnp.ones(2), ref=True)):
        assert _slots.setter(special) == special.set_raw_value


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "public"])
def test_an_overridden_set_raw_value_is_called_on_the_fast_path(monkeypatch, direct):
    monkeypatch.setattr(_slots, "DIRECT", direct)
    module = nnx.Module()
    module.w = Recorded(jnp.zeros(2))
    bump = nnx_sharding.jit(lambda m: m.w.set_raw_value(m.w.get_raw_value() + 1.0))
    WRITES.clear()
    for _ in range(4):
        bump(module)
    assert module.w[...].tolist() == [4.0, 4.0]
    assert [w.tolist() for w in WRITES][-3:] == [[2.0, 2.0], [3.0, 3.0], [4.0, 4.0]]


def test_a_writer_writes_plain_variables_through_the_slots_and_others_through_set_raw_value():
    plain, special = nnx.Param(jnp.zeros(2)), Recorded(jnp.zeros(2))
    WRITES.clear()
    _slots.writer([plain])([jnp.ones(2)])
    assert plain[...].tolist() == [1.0, 1.0] and WRITES == []
    _slots.writer([plain, special])([jnp.full(2, 2.0), jnp.full(2, 3.0)])
    assert plain[...].tolist() == [2.0, 2.0] and [w.tolist() for w in WRITES] == [[3.0, 3.0]]
    with pytest.raises(ValueError, match="1 values for 2 Variables"):
        _slots.writer([plain, nnx.Param(jnp.zeros(2))])([jnp.ones(2)])
