"""Accelerator presets and names (nnx_sharding/plan/_hardware/accelerators.py)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from nnx_sharding.plan._hardware.accelerators import PRESETS, Accelerator, resolve_accelerator


def test_presets_cover_the_required_models_with_their_data_sheet_figures():
    assert {"h100", "h200", "a100-80gb", "b200", "v5e", "v5p", "v6e", "cpu"} <= set(PRESETS)
    # dense bf16 peaks (not the with-sparsity figures resellers quote: 1,979 T for H100)
    expected = {
        "h100": 989e12,
        "h200": 989e12,
        "a100-80gb": 312e12,
        "b200": 2.25e15,
        "v5e": 197e12,
        "v5p": 459e12,
        "v6e": 918e12,
    }
    assert {k: PRESETS[k].peak_flops("bfloat16") for k in expected} == expected
    assert PRESETS["h100"].hbm_bytes == 80 * 10**9
    assert PRESETS["h200"].hbm_bandwidth == 4.8e12
    assert PRESETS["h100"].intra_bandwidth == 450e9  # NVLink 4: 900 GB/s both ways
    assert PRESETS["v5e"].hbm_bytes == 16 * 10**9
    assert [PRESETS[k].kind for k in ("h100", "v5p", "cpu")] == ["gpu", "tpu", "cpu"]
    for a in PRESETS.values():
        assert a.inter_bandwidth <= a.intra_bandwidth
        assert a.devices_per_node >= 1


def test_peak_flops_takes_dtypes_and_falls_back_conservatively():
    h100 = PRESETS["h100"]
    assert h100.peak_flops(jnp.bfloat16) == h100.peak_flops("bfloat16") == 989e12
    assert h100.peak_flops(jnp.float32) == 67e12
    assert h100.peak_flops("float64") == 67e12  # float32's figure
    assert h100.peak_flops("int8") == 2 * 989e12
    # a dtype the table lacks: the lowest figure listed
    assert PRESETS["cpu"].peak_flops("int4") == min(PRESETS["cpu"].flops.values())


def test_accelerator_is_frozen_hashable_and_checks_its_figures():
    a = PRESETS["h100"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.hbm_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        a.flops["bfloat16"] = 1.0  # type: ignore[index]
    assert hash(a) == hash(dataclasses.replace(a))
    mine = dataclasses.replace(a, name="mine", hbm_bytes=40 * 10**9)
    assert (mine.hbm_bytes, a.hbm_bytes) == (40 * 10**9, 80 * 10**9)
    with pytest.raises(ValueError, match="hbm_bandwidth, intra_bandwidth"):
        dataclasses.replace(a, hbm_bandwidth=0.0, intra_bandwidth=-1.0)
    with pytest.raises(ValueError, match="kind: 'npu' is not one of 'gpu', 'tpu', 'cpu'"):
        dataclasses.replace(a, kind="npu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one dtype"):
        dataclasses.replace(a, flops={})


def test_resolve_names_aliases_and_topologies():
    assert resolve_accelerator("H100") == (PRESETS["h100"], None)
    assert resolve_accelerator("a100") == (PRESETS["a100-80gb"], None)
    assert resolve_accelerator("trillium") == (PRESETS["v6e"], None)
    assert resolve_accelerator("v5e:16x16") == (PRESETS["v5e"], "v5e:16x16")
    assert resolve_accelerator("v5p:4x4x4") == (PRESETS["v5p"], "v5p:4x4x4")
    mine = dataclasses.replace(PRESETS["h100"], name="mine")
    assert resolve_accelerator(mine) == (mine, None)
    assert isinstance(resolve_accelerator("cpu")[0], Accelerator)


def test_unknown_names_and_bad_topologies_say_what_is_accepted():
    with pytest.raises(ValueError) as e:
        resolve_accelerator("h1000")
    message = str(e.value)
    assert message.startswith("plan: accelerator: 'h1000' is not a preset")
    for name in ("h100", "h200", "a100-80gb", "b200", "v5e", "v5p", "v6e", "cpu"):
        assert name in message
    with pytest.raises(ValueError, match="gives a topology to a GPU preset"):
        resolve_accelerator("h100:2x4")
    with pytest.raises(ValueError, match="not a TPU topology"):
        resolve_accelerator("v5e:2xfour")
    with pytest.raises(TypeError, match="got int"):
        resolve_accelerator(5)  # type: ignore[arg-type]


def test_accelerators_copy_and_pickle():
    import copy
    import pickle

    a = PRESETS["v5p"]
    assert pickle.loads(pickle.dumps(a)) == a == copy.deepcopy(a)
    assert dict(a.flops) == {"bfloat16": 459e12, "float32": 459e12, "int8": 918e12}
    with pytest.raises(TypeError, match="read-only"):
        copy.deepcopy(a).flops.update(bfloat16=1.0)
