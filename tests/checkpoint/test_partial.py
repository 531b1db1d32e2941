"""Issue 17: ``restore(..., filter=...)`` restores only the Variables the filter selects.

The others keep the target's values (a concrete target) or are an error naming them
(an abstract one); the checkpoint's Variables the filter does not select are not read
and need not exist in the target.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from ckpt_models import DIN, DOUT, HIDDEN, abstract, build, build_fresh, values
from flax import nnx

from nnx_sharding import checkpoint, recipes
from nnx_sharding.recipes import MLP


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    directory = tmp_path_factory.mktemp("partial") / "ckpt"
    tree = build(1)
    checkpoint.save(directory, tree)
    return directory, values(tree)


def test_weights_into_a_model_with_a_fresh_optimizer(trained: tuple[Path, dict]) -> None:
    directory, saved = trained
    target = build_fresh(5)
    fresh = values(target)
    assert checkpoint.restore(directory, target, filter=nnx.Param) is target
    got = values(target)
    for path, value in saved.items():
        is_param = path[0] == 0
        np.testing.assert_array_equal(got[path], value if is_param else fresh[path])
    assert int(target[1].step.get_value()) == 0  # the optimizer is the fresh one


def test_other_optimizer_in_the_checkpoint_is_not_needed(trained: tuple[Path, dict]) -> None:
    """The target's sgd optimizer has none of adam's state: with a filter, the
    checkpoint's Variables it does not select are neither read nor compared."""
    directory, saved = trained
    model = MLP(DIN, HIDDEN, DOUT, rngs=nnx.Rngs(5))
    sgd = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    checkpoint.restore(directory, (model, sgd), filter=nnx.Param)
    for path, value in values(model).items():
        np.testing.assert_array_equal(value, saved[(0, *path)])
    with pytest.raises(ValueError, match=r"target\[1\]\.opt_state\[0\]\.mu\.up\.kernel: the "):
        checkpoint.restore(directory, (model, sgd))  # without a filter: all must match


def test_a_path_filter(trained: tuple[Path, dict]) -> None:
    directory, saved = trained
    target = build_fresh(5)
    fresh = values(target)
    checkpoint.restore(directory, target, filter=nnx.All(nnx.Param, nnx.PathContains("up")))
    got = values(target)
    np.testing.assert_array_equal(got[(0, "up", "kernel")], saved[(0, "up", "kernel")])
    np.testing.assert_array_equal(got[(0, "down", "kernel")], fresh[(0, "down", "kernel")])


def test_abstract_target_must_be_restored_whole(trained: tuple[Path, dict]) -> None:
    directory, _ = trained
    target = abstract()
    with pytest.raises(ValueError) as info:
        checkpoint.restore(directory, target, filter=nnx.Param)
    message = str(info.value)
    assert message.startswith("checkpoint.restore: filter: ")
    assert "target[1].step is abstract" in message
    assert "target[1].opt_state[0].mu.up.kernel is abstract" in message
    assert "target[0].up.kernel" not in message
    assert isinstance(target[0].up.kernel.get_value(), jax.ShapeDtypeStruct)


def test_selected_variables_missing_from_the_checkpoint(trained: tuple[Path, dict]) -> None:
    directory, _ = trained
    model = MLP(DIN, HIDDEN, DOUT, rngs=nnx.Rngs(5))
    model.extra = nnx.Param(jax.numpy.ones(3))
    target = (model, recipes.make_optimizer(model))
    before = np.asarray(model.up.kernel.get_value())
    with pytest.raises(ValueError, match=r"target\[0\]\.extra: the target has a Param"):
        checkpoint.restore(directory, target, filter=nnx.Param)
    np.testing.assert_array_equal(model.up.kernel.get_value(), before)
