"""Issue 17, item 5: bad input gets a clear error naming the Variable path, and the
caller's objects are left as they were.

Each case checks the exception type, the key parts of the message (the function, the
paths, the rule, the fix) and, for restore, that the target's values and shardings
did not change.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ckpt_models import abstract, build, build_fresh, place, shardings, values
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding import checkpoint, recipes


class Saved(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.encoder = nnx.Linear(4, 8, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)


class Different(nnx.Module):
    """`Saved` with every kind of difference: a wider encoder (shape), a bfloat16 head
    (dtype), no norm (in the checkpoint only) and a new decoder (in the target only)."""

    def __init__(self, rngs: nnx.Rngs):
        self.encoder = nnx.Linear(4, 6, rngs=rngs)
        self.head = nnx.Linear(8, 2, param_dtype=jnp.bfloat16, rngs=rngs)
        self.decoder = nnx.Linear(2, 4, rngs=rngs)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    checkpoint.save(tmp_path / "ckpt", Saved(nnx.Rngs(0)))
    return tmp_path / "ckpt"


def unchanged(target: object) -> object:
    """A check that ``target`` still has the values and shardings it has now."""
    before_values, before_shardings = values(target), shardings(target)

    def check() -> None:
        after = values(target)
        assert after.keys() == before_values.keys()
        for path, value in before_values.items():
            np.testing.assert_array_equal(after[path], value)
        assert shardings(target) == before_shardings

    return check


def test_every_mismatch_in_one_message(saved: Path) -> None:
    target = Different(nnx.Rngs(1))
    check = unchanged(target)
    with pytest.raises(ValueError) as info:
        checkpoint.restore(saved, target)
    message = str(info.value)
    assert message.startswith("checkpoint.restore: target: ")
    for expected in [
        "target.encoder.kernel: shape (4, 6) in the target, (4, 8) in the checkpoint",
        "target.encoder.bias: shape (6,) in the target, (8,) in the checkpoint",
        "target.head.kernel: dtype bfloat16 in the target, float32 in the checkpoint",
        "target.head.bias: dtype bfloat16 in the target, float32 in the checkpoint",
        "target.decoder.kernel: the target has a Param of shape (2, 4) float32, the "
        "checkpoint has no Variable there",
        "target.norm.mean: the checkpoint has a BatchStat of shape (8,) float32, the "
        "target has no Variable there",
        "target.norm.scale: the checkpoint has a Param",
        "Nothing was read or changed",
        "filter=nnx.Param",
    ]:
        assert expected in message, (expected, message)
    assert "10 problems" in message  # 2 shape, 2 dtype, 2 missing, 4 extra
    check()


def test_abstract_target_mismatch(saved: Path) -> None:
    target = nnx.eval_shape(lambda: Different(nnx.Rngs(1)))
    with pytest.raises(ValueError, match=r"target\.encoder\.kernel: shape \(4, 6\)"):
        checkpoint.restore(saved, target)
    assert isinstance(target.encoder.kernel.get_value(), jax.ShapeDtypeStruct)


def test_a_sharding_that_does_not_divide(tmp_path: Path) -> None:
    model = nnx.Linear(6, 6, rngs=nnx.Rngs(0))
    checkpoint.save(tmp_path / "ckpt", model)
    mesh = recipes.make_mesh({"data": 2, "model": 4})
    target = nnx.Linear(6, 6, rngs=nnx.Rngs(1))
    with jax.set_mesh(mesh):
        place(target, P())
        check = unchanged(target)
        with pytest.raises(ValueError) as info:
            checkpoint.restore(
                tmp_path / "ckpt", target, shardings=nnx_sharding.StateSharding({...: P("model")})
            )
    message = str(info.value)
    assert message.startswith("checkpoint.restore: shardings: 2 problems:")
    assert "target.kernel: shape (6, 6)" in message and "target.bias: shape (6,)" in message
    assert "'model': 4" in message
    assert "spec=P('model',)" in message and "divisible" in message
    check()


def test_a_partition_spec_without_a_mesh(saved: Path) -> None:
    target = Saved(nnx.Rngs(1))
    check = unchanged(target)
    with pytest.raises(ValueError) as info:
        checkpoint.restore(saved, target, shardings=nnx_sharding.StateSharding({...: P()}))
    message = str(info.value)
    assert "target.encoder.kernel: P()" in message and "jax.set_mesh" in message
    check()


def test_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="checkpoint.restore: directory: nothing exists"):
        checkpoint.restore(tmp_path / "nowhere", Saved(nnx.Rngs(0)))


@pytest.mark.parametrize("contents", ["empty", "foreign"])
def test_a_directory_that_is_not_a_checkpoint(tmp_path: Path, contents: str) -> None:
    directory = tmp_path / "dir"
    directory.mkdir()
    if contents == "foreign":
        (directory / "notes.txt").write_text("hello")
    target = Saved(nnx.Rngs(0))
    check = unchanged(target)
    with pytest.raises(ValueError) as info:
        checkpoint.restore(directory, target)
    message = str(info.value)
    assert "is not a checkpoint written by nnx_sharding.checkpoint" in message
    assert ("notes.txt" in message) == (contents == "foreign")
    check()


def test_a_manager_directory_points_to_its_steps(tmp_path: Path) -> None:
    with checkpoint.Manager(tmp_path, async_save=False) as manager:
        manager.save(3, Saved(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"holds the Manager steps 3") as info:
        checkpoint.restore(tmp_path, Saved(nnx.Rngs(0)))
    assert "Manager(directory).restore(target)" in str(info.value)


def test_an_uncommitted_checkpoint(saved: Path) -> None:
    """The temporary directory orbax writes into is never restored, even when complete."""
    uncommitted = saved.parent / f"{saved.name}.orbax-checkpoint-tmp-1234"
    shutil.copytree(saved, uncommitted)
    with pytest.raises(ValueError, match="whose save never finished"):
        checkpoint.restore(uncommitted, Saved(nnx.Rngs(0)))


def test_save_does_not_overwrite(saved: Path) -> None:
    old = values(checkpoint.restore(saved, nnx.eval_shape(lambda: Saved(nnx.Rngs(5)))))
    with pytest.raises(FileExistsError) as info:
        checkpoint.save(saved, Saved(nnx.Rngs(9)))
    message = str(info.value)
    assert f"a checkpoint already exists at {saved}" in message and "force=True" in message
    again = values(checkpoint.restore(saved, nnx.eval_shape(lambda: Saved(nnx.Rngs(5)))))
    for path, value in old.items():
        np.testing.assert_array_equal(again[path], value)


def test_force_never_deletes_other_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="holds notes.txt, which is not a checkpoint"):
        checkpoint.save(tmp_path, Saved(nnx.Rngs(0)), force=True)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_saving_what_is_not_a_tree_of_concrete_arrays(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"tree\.kernel .*is abstract"):
        checkpoint.save(tmp_path / "a", nnx.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0))))
    with pytest.raises(TypeError, match=r"tree\[1\] is a ndarray, not a graph node"):
        checkpoint.save(tmp_path / "b", (nnx.Linear(2, 3, rngs=nnx.Rngs(0)), np.ones(3)))
    module = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    module.note = nnx.Variable("text")
    with pytest.raises(TypeError, match=r"the Variable at tree\.note holds a str, not an array"):
        checkpoint.save(tmp_path / "c", module)
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_a_bad_filter(saved: Path) -> None:
    with pytest.raises(TypeError, match="checkpoint.restore: filter: 3.5 is not an nnx filter"):
        checkpoint.restore(saved, Saved(nnx.Rngs(0)), filter=3.5)


def test_manager_errors(tmp_path: Path) -> None:
    model, optimizer = build(0)
    with checkpoint.Manager(tmp_path / "run") as manager:
        with pytest.raises(FileNotFoundError, match="no committed checkpoint step exists"):
            manager.restore(abstract())
        assert manager.save(1, (model, optimizer))
        with pytest.raises(FileExistsError, match=r"the checkpoint step 1 already exists"):
            manager.save(1, (model, optimizer))
        unknown = r"(?s)no committed checkpoint for step 2 .*it has 1 "
        with pytest.raises(FileNotFoundError, match=unknown):
            manager.restore(abstract(), step=2)
        with pytest.raises(TypeError, match="a step is an int >= 0"):
            manager.save(-1, (model, optimizer))
        target = build_fresh(3)
        check = unchanged(target)
        with pytest.raises(ValueError, match=r"target\[0\]\.up\.kernel: shape \(16, 32\)"):
            manager.restore(build_fresh(3, hidden=32))
        check()


class Dotted(nnx.Module):
    """An attribute named with a '.', beside a nested one of the same spelling: orbax
    joins a path's parts with '.', so unescaped they would be stored as one name."""

    def __init__(self, first: float):
        self.a = nnx.Dict({"b": nnx.Param(jnp.full(3, first))})
        setattr(self, "a.b", nnx.Param(jnp.full(3, first + 1)))


def test_paths_that_differ_by_a_dot_are_stored_apart(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "ckpt", Dotted(0.0))
    restored = checkpoint.restore(tmp_path / "ckpt", nnx.eval_shape(lambda: Dotted(5.0)))
    assert restored.a["b"][...].tolist() == [0.0] * 3
    assert getattr(restored, "a.b")[...].tolist() == [1.0] * 3


def test_an_array_outside_a_variable_is_named(tmp_path: Path) -> None:
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    model.extra = nnx.data(jnp.arange(3.0))
    with pytest.raises(TypeError, match=r"tree\.extra is an ArrayImpl held outside a Variable"):
        checkpoint.save(tmp_path / "ckpt", model)


def test_mesh_axes_the_mesh_lacks_are_named_with_their_path(saved: Path) -> None:
    target = Saved(nnx.Rngs(1))
    check = unchanged(target)
    with jax.set_mesh(recipes.make_mesh({"data": 8})):
        with pytest.raises(ValueError) as info:
            checkpoint.restore(saved, target, shardings=P("model"))
    message = str(info.value)
    assert "checkpoint.restore" in message and "target.encoder.kernel: " in message
    assert "model" in message and "exists in the mesh" in message
    check()


def test_a_filter_that_selects_nothing(saved: Path) -> None:
    target = Saved(nnx.Rngs(1))
    check = unchanged(target)
    with pytest.raises(ValueError, match=r"selects none of the target's Variables"):
        checkpoint.restore(saved, target, filter=nnx.Intermediate)
    check()


def test_a_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"x\.txt is a file, not a checkpoint directory"):
        checkpoint.restore(tmp_path / "x.txt", Saved(nnx.Rngs(1)))


def test_a_home_relative_directory_is_expanded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    checkpoint.save("~/ckpt", nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    assert (tmp_path / "ckpt").is_dir()


def test_a_shardings_prefix_that_does_not_fit_the_target(saved: Path) -> None:
    target = Saved(nnx.Rngs(1))
    check = unchanged(target)
    with pytest.raises(ValueError) as info:
        checkpoint.restore(saved, target, shardings=(P(), None))
    message = str(info.value)
    assert "is not a pytree prefix of the target" in message
    assert "one entry per element of the target" in message and "positional" not in message
    check()


@pytest.mark.parametrize(
    ("make", "kind", "fix"),
    [
        (
            lambda: nnx.Param(jnp.ones(2), ref=True),
            "is a `ref=True` Variable",
            "without `ref=True`",
        ),
        (lambda: nnx.Variable(0.5), "holds a float, not an array", "as an array"),
        (lambda: nnx.eval_shape(lambda: nnx.Param(jnp.ones(2))), "is abstract", "values first"),
    ],
    ids=["ref", "python-value", "abstract"],
)
def test_each_unsavable_value_gets_its_own_fix(tmp_path: Path, make, kind: str, fix: str) -> None:
    module = nnx.Module()
    module.v = make()
    with pytest.raises(TypeError) as info:
        checkpoint.save(tmp_path / "ckpt", module)
    message = str(info.value)
    assert f"tree.v {kind}" in message or kind in message
    fixes = message[message.index("Fixes") :] if "Fixes" in message else message
    assert fix in fixes and fixes.count("\n  ") <= 2  # only the fix for this problem


def test_a_dtype_mismatch_says_how_to_change_a_dtype(saved: Path) -> None:
    target = Different(nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"restore into a target of the saved dtype, then cast"):
        checkpoint.restore(saved, target)


def test_a_target_part_abstract_part_concrete(saved: Path) -> None:
    concrete = Saved(nnx.Rngs(1))
    check = unchanged(concrete)
    target = nnx.eval_shape(lambda: Saved(nnx.Rngs(1)))
    target.head = concrete.head
    with pytest.raises(ValueError, match=r"target\.encoder\.bias.* abstract .*but target\.head"):
        checkpoint.restore(saved, target)
    check()


def test_a_target_made_under_another_mesh(saved: Path) -> None:
    with jax.set_mesh(recipes.make_mesh({"data": 2, "model": 4})):
        target = nnx.eval_shape(lambda: Saved(nnx.Rngs(1)))
    with jax.set_mesh(recipes.make_mesh({"data": 8})):
        with pytest.raises(ValueError) as info:
            checkpoint.restore(saved, target)
    message = str(info.value)
    assert "(the mesh set has the axes {'data': 8})" in message
    assert "make the target under the mesh restore runs under" in message


class Stats(nnx.Module):
    """`Saved`'s paths, shapes and dtypes, with other Variable types: the encoder's
    kernel a BatchStat, the head's bias an Intermediate."""

    def __init__(self, rngs: nnx.Rngs):
        self.encoder = nnx.Linear(4, 8, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.encoder.kernel = nnx.BatchStat(self.encoder.kernel.get_value())
        self.head.bias = nnx.Intermediate(self.head.bias.get_value())


def test_a_variable_of_another_type_is_a_type_error(saved: Path) -> None:
    target = Stats(nnx.Rngs(1))
    check = unchanged(target)
    with pytest.raises(TypeError) as info:
        checkpoint.restore(saved, target)
    assert str(info.value).splitlines()[:3] == [
        "checkpoint.restore: target: 2 problems:",
        "  - target.encoder.kernel: a BatchStat in the target, a Param in the checkpoint",
        "  - target.head.bias: an Intermediate in the target, a Param in the checkpoint",
    ]
    assert "allow_type_change=True" in str(info.value)
    check()
    # abstract, or through a filter that selects one of them: the same check
    with pytest.raises(TypeError, match=r"target\.encoder\.kernel: a BatchStat"):
        checkpoint.restore(saved, nnx.eval_shape(lambda: Stats(nnx.Rngs(1))))
    with pytest.raises(TypeError, match=r"^checkpoint.restore: target: target\.head\.bias"):
        checkpoint.restore(saved, target, filter=nnx.PathContains("head"))
    check()
    # the fix the message gives: the values, into the target's own types
    restored = checkpoint.restore(saved, target, allow_type_change=True)
    assert type(restored.encoder.kernel) is nnx.BatchStat
    expected = values(checkpoint.restore(saved, nnx.eval_shape(lambda: Saved(nnx.Rngs(5)))))
    for path, value in values(restored).items():
        np.testing.assert_array_equal(value, expected[path])


def test_manager_restore_checks_types(tmp_path: Path) -> None:
    with checkpoint.Manager(tmp_path) as manager:
        manager.save(1, Saved(nnx.Rngs(0)))
        with pytest.raises(TypeError, match=r"Manager.restore: target: 2 problems"):
            manager.restore(Stats(nnx.Rngs(1)))
        restored = manager.restore(Stats(nnx.Rngs(1)), allow_type_change=True)
    np.testing.assert_array_equal(
        restored.head.bias.get_value(), Saved(nnx.Rngs(0)).head.bias.get_value()
    )


def test_a_variable_alone_is_refused_and_the_fixes_work(tmp_path: Path) -> None:
    variable = nnx.Param(jnp.arange(3.0))
    with pytest.raises(TypeError, match=r"tree is a Param alone: a Variable is saved by its"):
        checkpoint.save(tmp_path / "alone", variable)
    assert not (tmp_path / "alone").exists()
    for name, fixed in [("dict", nnx.Dict(w=variable)), ("plain", {"w": variable})]:
        checkpoint.save(tmp_path / name, fixed)
        restored = checkpoint.restore(tmp_path / name, nnx.eval_shape(lambda f=fixed: f))
        np.testing.assert_array_equal(restored["w"].get_value(), variable.get_value())
