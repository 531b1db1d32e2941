"""A stateful fuzz of the fast path (`cache`, `snapshot`): no mutation may go unseen.

Two twin models, built alike from one seed, get the same random mutations between
calls. Twin ``a`` is called through `nnx_sharding.jit`'s fast path (module-level
transforms, so their caches outlive an example), twin ``b`` through a reference; after
every call the outputs and both callers' states must agree, and the twins' graph
definitions must stay equal after every step. The twins, their model and mutations
are `fuzz_twins`'s; this module adds the calls.

`FastPathFuzz` compares with ``flax.nnx.jit`` (graph mode, flax's default), which splits
the whole graph on every call; `FullPathFuzz` checks that premise (our full path against
flax). `StagedFuzz` covers donation (``donate_argnums``) and `Compiled` objects against
our own full path (`full_path`), since flax has no Compiled that checks its arguments.

Every new graph structure, dtype or argument placement costs a trace and a compilation
per transform (0.1-0.3 s here), so the transforms live at module level and every drawn
value comes from a small set. ``NNX_SHARDING_FUZZ_EXAMPLES`` sets `FastPathFuzz`'s
number of examples (default 500; the others run a third and a tenth of it); ``nox -s
fuzz`` runs 20000.

The suite's own run (the variable unset) draws the same examples every time
(hypothesis's ``derandomize``): its outcome depends on the code, not on the draw, so it
is a gate. A run with the variable set (``nox -s fuzz``) draws afresh, to explore; what
it finds is pinned as explicit steps (``test_found_*``, `run_steps`), which every run
takes.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from fuzz_twins import (
    FAST,
    FLAX,
    FULL,
    XS,
    Model,
    Twins,
    assert_same_output,
    assert_same_state,
    forward,
    mutation,
    on_full_path,
    state_of,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    initialize,
    precondition,
    rule,
)

import nnx_sharding

EXAMPLES = int(os.environ.get("NNX_SHARDING_FUZZ_EXAMPLES", "500"))
EXPLORE = "NNX_SHARDING_FUZZ_EXAMPLES" in os.environ  # else the same draws on every run
CLEAR_EVERY = 200
"""Examples between two ``jax.clear_caches()`` in a long run: every example compiles
new programs, and jax keeps them all; 20000 examples in one process outgrew 24 GB and
the kernel's 65530 memory maps (a segfault in the compiler after about 10 minutes).
The suite's own run (500 examples) clears nothing."""
_examples = itertools.count(1)


def clear_now_and_then() -> None:
    """``jax.clear_caches()`` once every `CLEAR_EVERY` examples of a long run: the
    transforms' own caches (the fast path's included) stay as they are."""
    if EXPLORE and next(_examples) % CLEAR_EVERY == 0:
        jax.clear_caches()


class FastPathFuzz(Twins):
    """The fast path against ``flax.nnx.jit``.

    flax is the reference for every mutation here: it supports them all, and its jit
    splits the whole graph on every call (a run with our full path in place of the fast
    path agrees with it).
    """

    fast = FAST
    reference = FLAX

    def teardown(self) -> None:
        clear_now_and_then()

    def check_call(self, x: int = 0) -> None:
        out_a, model_a = self.fast["forward"](self.a, XS[x])
        out_b, model_b = self.reference["forward"](self.b, XS[x])
        assert model_a is self.a and model_b is self.b
        assert_same_output(out_a, out_b)
        assert_same_state(*self.states())

    @rule(x=st.sampled_from([0, 1]))
    def call(self, x: int) -> None:
        self.check_call(x)

    # Not in `StagedFuzz`: jax refuses to donate one buffer twice, under flax too.
    @mutation()
    def share_plain(self, model: Model) -> None:
        # One array under two names: two graph leaves. nnx.data: `plain` may hold a
        # Python number (`set_plain`), which would make `twin` a static attribute, and
        # flax refuses an array for a static one (a later `share_plain`).
        model.twin = nnx.data(model.plain)

    @precondition(lambda self: hasattr(self.a, "twin"))
    @mutation()
    def unshare_plain(self, model: Model) -> None:
        del model.twin

    @mutation(each=False)
    def call_bump(self) -> None:
        """Another jitted function updates the twins between calls."""
        assert self.fast["bump"](self.a) is None
        assert self.reference["bump"](self.b) is None
        assert_same_state(*self.states())


def signature(model: Model) -> tuple[Any, dict[str, tuple[tuple[int, ...], np.dtype]]]:
    """What a Compiled checks: the graph structure, and each leaf's shape and dtype (as jax
    sees it: a Python number set by `set_plain` is a 32-bit scalar)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))
    leaves = {
        jax.tree_util.keystr(path): x if isinstance(x, jax.Ref | jax.Array) else jnp.asarray(x)
        for path, x in flat
    }
    return nnx.graphdef(model), {path: (x.shape, x.dtype) for path, x in leaves.items()}


PROTOTYPE = Model(0)  # the structure that the Compiled objects are lowered for
LOWERED_FOR = signature(PROTOTYPE)


@functools.cache
def staged(kind: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(fast, reference) callables for one of `StagedFuzz`'s modes; the reference is our
    own full path: flax has no counterpart of a Compiled that checks its arguments."""
    donate = {"donate_argnums": 0} if "donate" in kind else {}
    fast, full = nnx_sharding.jit(forward, **donate), nnx_sharding.jit(forward, **donate)
    if kind.startswith("compiled"):
        fast = fast.lower(PROTOTYPE, XS[0]).compile()
        full = full.lower(PROTOTYPE, XS[0]).compile()
    return fast, on_full_path(full)


class StagedFuzz(Twins):
    """Donated arguments and `Compiled` objects, against our own full path.

    A Compiled refuses (TypeError) a model whose structure or shapes differ from those
    it was lowered for: then both twins must refuse, and keep their state.
    """

    kind: str

    def teardown(self) -> None:
        clear_now_and_then()

    @initialize(kind=st.sampled_from(["jit_donate", "compiled", "compiled_donate"]))
    def pick(self, kind: str) -> None:
        self.kind = kind

    # A static field of a pytree held with nnx.data, set in place: another structure.
    # Only here, where a Compiled compiles nothing new (in `FastPathFuzz` it would double
    # the structures, each compiled twice).
    @mutation(gain=st.sampled_from([1.0, 2.0]))
    def set_shift_gain(self, model: Model, gain: float) -> None:
        model.shift.gain = gain

    def check_call(self, x: int = 0) -> None:
        fast, reference = staged(self.kind)
        before = self.states()
        outcomes: list[Any] = []
        for call, model in ((fast, self.a), (reference, self.b)):
            # A Compiled refuses other structures, shapes or dtypes with a TypeError.
            refuses = self.kind.startswith("compiled") and signature(model) != LOWERED_FOR
            try:
                out, same = call(model, XS[x])
            except TypeError as e:
                assert refuses, e
                outcomes.append(e)
            else:
                assert not refuses, "a Compiled took a model it was not lowered for"
                assert same is model
                outcomes.append(out)
        if isinstance(outcomes[0], TypeError):
            after = self.states()  # a refused call writes nothing back
            assert_same_state(after[0], before[0])
            assert_same_state(after[1], before[1])
        else:
            assert_same_output(*outcomes)
        assert_same_state(*self.states())

    @rule(x=st.sampled_from([0, 1]))
    def call(self, x: int) -> None:
        self.check_call(x)


class FullPathFuzz(FastPathFuzz):
    """The premise of `FastPathFuzz`: our full path agrees with flax on every mutation."""

    fast = {name: on_full_path(f) for name, f in FULL.items()}


FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=not EXPLORE,
    stateful_step_count=8,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestFastPath = FastPathFuzz.TestCase
TestFastPath.settings = FUZZ
TestFullPath = FullPathFuzz.TestCase
TestFullPath.settings = settings(FUZZ, max_examples=max(EXAMPLES // 10, 20))  # a check
# jax cannot donate the ref=True Variable's buffer (it is updated in place), and says so.
TestStaged = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")(
    StagedFuzz.TestCase
)
TestStaged.settings = settings(FUZZ, max_examples=max(EXAMPLES // 3, 50))


def test_the_fuzzed_model_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The premise of `FastPathFuzz`: its model, as built, reaches the fast path (plain
    array attributes included), so the mutations test it."""
    from nnx_sharding._callpath import call as _call

    splits: list[int] = []
    real = _call.split_call
    monkeypatch.setattr(_call, "split_call", lambda *a: splits.append(1) or real(*a))
    forward_ = nnx_sharding.jit(forward)
    model, reference = Model(0), Model(0)
    for x in (0, 1, 0, 1):
        out, _ = forward_(model, XS[x])
        assert_same_output(out, FLAX["forward"](reference, XS[x])[0])
    assert len(splits) == 1  # the first call; then the fast path
    assert_same_state(state_of(model), state_of(reference))


def test_twins_start_alike() -> None:
    """The premise of the fuzz: two models built from one seed are equal."""
    assert_same_state(state_of(Model(0)), state_of(Model(0)))
    with pytest.raises(AssertionError):
        assert_same_state(state_of(Model(0)), state_of(Model(1)))


def run_steps(machine: type[FastPathFuzz], steps: list[tuple[str, dict[str, Any]]]) -> Twins:
    """Runs a state machine's steps as hypothesis would (``then_call`` False unless given),
    checking the invariant after each; returns the machine."""
    fuzz = machine()
    fuzz.build(seed=0)
    for name, drawn in steps:
        if name != "call":
            drawn = {"then_call": False, **drawn}
        getattr(fuzz, name)(**drawn)
        fuzz.same_structure()
    fuzz.teardown()
    return fuzz


@pytest.mark.parametrize("machine", [FastPathFuzz, FullPathFuzz])
def test_found_python_number_shared_under_two_names(machine: type[FastPathFuzz]) -> None:
    """Found by `nox -s fuzz` (20000 examples; after 6220 passing ones): `share_plain`
    while ``plain`` held a Python number made ``twin`` a static attribute (flax's rule
    for a number), and a later `share_plain`, after a call had made ``plain`` an array,
    was refused by flax itself ("Cannot assign data value ... to static attribute"), on
    either twin: a defect of the fuzz's mutation, which now assigns with ``nnx.data``."""
    steps: list[tuple[str, dict[str, Any]]] = [
        ("set_plain", {"name": "plain", "kind": "number", "seed": 0}),
        ("share_plain", {"then_call": True}),
        ("share_plain", {}),
        ("call", {"x": 0}),
        ("call_bump", {}),
        ("unshare_plain", {}),
        ("call", {"x": 1}),
    ]
    fuzz = run_steps(machine, steps)
    assert isinstance(fuzz.a.plain, jax.Array)


@pytest.mark.parametrize("machine", [FastPathFuzz, FullPathFuzz])
def test_found_python_number_kept_by_an_unchanging_call(machine: type[FastPathFuzz]) -> None:
    """Found by `TestFastPath` (in some runs only: it depends on hypothesis's draw), run
    here on every run. `set_plain` leaves a Python float in ``plain``, and the next call
    (``bump``) does not change it: ``flax.nnx.jit`` passes every graph leaf through
    ``jax.jit`` and writes it back, so ``plain`` becomes a weakly typed float32 jax
    array; nnx_sharding (full and fast path) kept the float (float64 on the host)."""
    steps: list[tuple[str, dict[str, Any]]] = [
        ("share", {}),
        ("replace_variable", {"name": "l1", "seed": 0}),
        ("share", {}),
        ("set_plain", {"name": "plain", "kind": "number", "seed": 0}),
        ("add_cell", {}),
        ("call_bump", {}),
        ("call_bump", {}),  # cached by now: the fast path
        ("set_plain", {"name": "plain", "kind": "number", "seed": 1}),  # on a cached call
        ("call_bump", {}),
        ("call", {"x": 1}),
    ]
    plain = run_steps(machine, steps).a.plain
    assert isinstance(plain, jax.Array) and plain.dtype == jnp.float32 and plain.weak_type
