"""Issue 17, item 1: save on one layout, restore on another.

An FSDP-sharded MLP and its adam optimizer, saved from an (8,) mesh, restore into
tensor-parallel shardings on a (2, 4) mesh, onto one device, into the layout of
`StateSharding.from_metadata`, and in place into a concrete tree: every value equal,
every Variable laid out as asked. Also what a checkpoint holds (BatchNorm statistics,
Rngs keys and counts, a shared Variable once) and the forms of ``shardings``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from ckpt_models import (
    DIN,
    DOUT,
    HIDDEN,
    Stateful,
    abstract,
    assert_laid_out,
    assert_same_values,
    build,
    build_fresh,
    place,
    shardings,
    used_stateful,
    values,
)
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding import checkpoint, recipes
from nnx_sharding.recipes import MLP


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Any, np.ndarray]]:
    """A trained (model, optimizer) saved FSDP-sharded over an (8,) mesh, and its values."""
    directory = tmp_path_factory.mktemp("fsdp") / "checkpoint"
    mesh = recipes.make_mesh({"data": 8})
    tree = build(1)
    fsdp = recipes.fsdp_sharding(tree[0], mesh)
    with jax.set_mesh(mesh):
        place(tree, fsdp)
    kernel = tree[0].up.kernel.get_value()
    assert kernel.sharding.spec == P("data") and len(kernel.addressable_shards) == 8
    checkpoint.save(directory, tree)
    return directory, values(tree)


def test_fsdp_to_tensor_parallel_on_another_mesh(saved: tuple[Path, dict]) -> None:
    directory, expected = saved
    mesh = recipes.make_mesh({"data": 2, "model": 4})
    megatron = recipes.megatron_sharding("model")
    target = abstract()
    with jax.set_mesh(mesh):
        restored = checkpoint.restore(directory, target, shardings=megatron)
    assert_same_values(restored, expected)
    asked = {
        tuple(p): NamedSharding(mesh, megatron.sharding_for(tuple(p), v))
        for p, v in nnx.to_flat_state(nnx.state(target))
    }
    assert_laid_out(restored, asked)
    kernel = restored[0].up.kernel.get_value()
    assert kernel.sharding.spec == P(None, "model")
    assert {s.data.shape for s in kernel.addressable_shards} == {(DIN, HIDDEN // 4)}
    # the abstract target is left abstract; a new tree is returned
    assert isinstance(target[0].up.kernel.get_value(), jax.ShapeDtypeStruct)
    assert restored[0] is not target[0]


def test_onto_one_device(saved: tuple[Path, dict]) -> None:
    directory, expected = saved
    restored = checkpoint.restore(directory, abstract())
    assert_same_values(restored, expected)
    one = SingleDeviceSharding(jax.local_devices()[0])
    assert all(s == one for s in shardings(restored).values())


class Partitioned(nnx.Module):
    """The recipes' MLP with Megatron sharding metadata on its kernels."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            DIN, HIDDEN, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs
        )
        self.down = nnx.Linear(
            HIDDEN, DOUT, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs
        )


def test_into_the_layout_of_from_metadata(tmp_path: Path) -> None:
    mesh8 = recipes.make_mesh({"data": 8})
    with nnx.use_eager_sharding(False):
        model = Partitioned(nnx.Rngs(3))
    with jax.set_mesh(mesh8):
        place(model, recipes.fsdp_sharding(model, mesh8))  # saved FSDP, not as the metadata says
    expected = values(model)
    checkpoint.save(tmp_path / "ckpt", model)

    mesh = recipes.make_mesh({"data": 2, "model": 4})
    with nnx.use_eager_sharding(False):
        target = nnx.eval_shape(lambda: Partitioned(nnx.Rngs(0)))
    with jax.set_mesh(mesh):
        layout = nnx_sharding.StateSharding.from_metadata(target)
        restored = checkpoint.restore(tmp_path / "ckpt", target, shardings=layout)
        # shardings=None: the Variables' metadata on the context mesh, the same layout
        by_default = checkpoint.restore(tmp_path / "ckpt", target)
    asked = {
        ("up", "kernel"): NamedSharding(mesh, P(None, "model")),
        ("down", "kernel"): NamedSharding(mesh, P("model", None)),
        ("up", "bias"): NamedSharding(mesh, P()),
        ("down", "bias"): NamedSharding(mesh, P()),
    }
    for tree in (restored, by_default):
        assert_same_values(tree, expected)
        assert_laid_out(tree, asked)


def test_concrete_target_updated_in_place_keeps_its_layout(saved: tuple[Path, dict]) -> None:
    directory, expected = saved
    mesh = recipes.make_mesh({"data": 2, "model": 4})
    target = build_fresh(7)
    with jax.set_mesh(mesh):
        place(target, recipes.megatron_sharding("model"))
    before = shardings(target)
    variables = [v for _, v in nnx.to_flat_state(nnx.state(target))]
    assert checkpoint.restore(directory, target) is target
    assert [v for _, v in nnx.to_flat_state(nnx.state(target))] == variables
    assert_same_values(target, expected)
    assert_laid_out(target, before)


def test_shardings_as_a_prefix(saved: tuple[Path, dict]) -> None:
    """One StateSharding for the model, None for the optimizer: its Variables fall back
    to the target's own placement; an abstract target has none, so they are replicated
    on the context mesh (without one: on one device)."""
    directory, expected = saved
    mesh = recipes.make_mesh({"data": 2, "model": 4})
    megatron = recipes.megatron_sharding("model")
    with jax.set_mesh(mesh):
        model, optimizer = checkpoint.restore(directory, abstract(), shardings=(megatron, None))
    assert_same_values((model, optimizer), expected)
    assert model.up.kernel.get_value().sharding.is_equivalent_to(
        NamedSharding(mesh, P(None, "model")), 2
    )
    replicated = NamedSharding(mesh, P())
    assert all(s.is_equivalent_to(replicated, 0) for s in shardings(optimizer).values())


def test_every_kind_of_state_round_trips(tmp_path: Path) -> None:
    model = used_stateful(1)
    expected = values(model)
    assert int(model.drop.rngs.count.get_value()) > 0
    checkpoint.save(tmp_path / "ckpt", model)

    described = json.loads((tmp_path / "ckpt" / "nnx" / "metadata").read_text())
    paths = [tuple(v["path"]) for v in described["variables"]]
    types = {tuple(v["path"]): v["type"] for v in described["variables"]}
    assert len(paths) == len(set(paths)) == len(expected)  # the shared Linear once
    assert not any(p[0] == "linear" for p in paths) or not any(p[0] == "same_linear" for p in paths)
    assert types[("norm", "mean")] == "BatchStat"
    assert types[("drop", "rngs", "key")] == "RngKey"

    for target in (Stateful(5), nnx.eval_shape(lambda: Stateful(5))):
        restored = checkpoint.restore(tmp_path / "ckpt", target)
        assert_same_values(restored, expected)
        assert restored.linear is restored.same_linear
        assert str(restored.drop.rngs.key.get_value().dtype) == "key<rbg>"
    # the restored Rngs goes on where the saved one was: the same next key
    again = used_stateful(1)
    assert np.array_equal(
        jax.random.key_data(restored.drop.rngs()),
        jax.random.key_data(again.drop.rngs()),
    )


def test_a_dict_of_nodes_and_a_plain_module(tmp_path: Path) -> None:
    model, optimizer = build(2)
    expected = values({"model": model, "opt": optimizer})
    checkpoint.save(tmp_path / "dict", {"model": model, "opt": optimizer})
    target = nnx.eval_shape(lambda: dict(zip(("model", "opt"), build_fresh(0), strict=True)))
    assert_same_values(checkpoint.restore(tmp_path / "dict", target), expected)

    checkpoint.save(str(tmp_path / "plain"), model)  # a str path works as well
    fresh = MLP(DIN, HIDDEN, DOUT, rngs=nnx.Rngs(9))
    assert checkpoint.restore(str(tmp_path / "plain"), fresh) is fresh
    assert_same_values(fresh, values(model))


def test_force_replaces_a_checkpoint(tmp_path: Path) -> None:
    first, second = build(3)[0], build(4)[0]
    checkpoint.save(tmp_path / "ckpt", first)
    checkpoint.save(tmp_path / "ckpt", second, force=True)
    restored = checkpoint.restore(tmp_path / "ckpt", nnx.eval_shape(lambda: build_fresh(0)[0]))
    assert_same_values(restored, values(second))


def test_an_existing_empty_directory_is_written_without_force(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    checkpoint.save(tmp_path / "empty", build(3)[0])
    assert (tmp_path / "empty" / "state").is_dir()


def test_the_package_imports_orbax_only_on_use() -> None:
    code = (
        "import sys, nnx_sharding; assert not [m for m in sys.modules if m.startswith('orbax')]; "
        "nnx_sharding.checkpoint.save; assert 'orbax.checkpoint' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_bare_variable_and_a_target_whose_arrays_were_donated(tmp_path: Path) -> None:
    scale = nnx.Param(np.arange(8.0, dtype=np.float32))
    model = build(5)[0]
    checkpoint.save(tmp_path / "ckpt", (scale, model))
    target = (nnx.Param(np.zeros(8, np.float32)), build_fresh(6)[0])
    target[1].up.kernel.get_value().delete()  # as donation leaves it: replaced anyway
    checkpoint.restore(tmp_path / "ckpt", target)
    assert_same_values(target, values((scale, model)))
