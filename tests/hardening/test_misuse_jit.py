"""Hardening (issue 8), item 1, bad input: `jit`, `StateSharding` and the stage objects.

`MISUSES` is a table of (trigger, exception type, regexes the message must contain: the
argument, the Variable path where there is one, what was expected); `REQUIRED` names the
cases the issue asks for, and `test_misuse_table_covers_issue_8` checks that they are
there. A bug these tests found is kept as a strict xfail whose reason is the diagnosis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from hardening_common import (
    MESH,
    MLP,
    XX,
    Counter,
    Shared,
    X,
    _scaled,
    _with_string_variable,
    case,
    check_misuse,
    forward,
    jit_call,
    kernel_spec,
    named,
)
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding import StateSharding


def bump(model):
    model.kernel[...] += 1.0


def read_after_donation(read: Callable[[nnx.Module], Any], warm: Callable[[nnx.Module], Any]):
    """Donates a module's buffers, then hands ``read`` a second reference to them.

    The second reference is ``nnx.clone(model)`` taken before the call: it shares the
    model's buffers, which the donating call deletes. ``warm`` runs on it first.
    """
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    alias = nnx.clone(model)
    warm(alias)
    nnx_sharding.jit(bump, donate_argnums=0)(model)
    return read(alias)


def _apply(f):
    return lambda m: f(m, jnp.ones((1, 2)))


def _compiled_for(model):
    return nnx_sharding.jit(forward).lower(model, jnp.ones((1, 2))).compile()


def _donated_to_compiled():
    holder = {}
    return read_after_donation(
        lambda m: holder["compiled"](m, jnp.ones((1, 2))),
        lambda m: holder.setdefault("compiled", _compiled_for(m)),
    )


def _donated_to_warm_jit():
    f = nnx_sharding.jit(forward)
    return read_after_donation(_apply(f), lambda m: [_apply(f)(m) for _ in range(2)])


def _with_extra_attribute():
    model = Counter()
    model.extra = nnx.Param(jnp.zeros(2))
    return model


def _with_wider_kernel():
    model = Counter()
    model.lin.kernel.set_value(jnp.zeros((4, 5)))
    return model


def _compiled(fun=forward, *args, **options):
    return nnx_sharding.jit(fun, **options).lower(*(args or (Counter(), XX))).compile()


def _committed_elsewhere(model):
    """``model`` with its kernel committed to one device."""
    model.linear.kernel.set_value(jax.device_put(model.linear.kernel.get_value(), jax.devices()[3]))
    return model


def _lower_committed_elsewhere():
    model = _committed_elsewhere(MLP())
    with jax.set_mesh(MESH):
        f = nnx_sharding.jit(forward, in_shardings=(kernel_spec(P(None, "model")), None))
        return f.lower(model, X)


def _one_module_two_shardings():
    lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    by_argument = (StateSharding({nnx.Param: named()}), StateSharding({nnx.Param: named("model")}))
    return jit_call(lambda a, b: None, lin, lin, in_shardings=by_argument)


MISUSES = [
    # -- jit: a StateSharding no filter matches -----------------------------------------
    case(
        "unmatched_variable_in_shardings",
        lambda: jit_call(
            forward, MLP(), X, in_shardings=(StateSharding({nnx.BatchStat: None}), None)
        ),
        ValueError,
        [r"in_shardings", r"args\[0\]\.bn\.bias", r"type Param", r"matches none of the filters"],
    ),
    case(
        "unmatched_variable_out_shardings",
        lambda: jit_call(lambda: MLP(), out_shardings=StateSharding({nnx.BatchStat: None})),
        ValueError,
        [r"out_shardings", r"output\.bn\.bias", r"type Param", r"matches none of the filters"],
    ),
    case(
        "unmatched_variable_sharding_for",
        lambda: StateSharding({nnx.BatchStat: None}).sharding_for(
            ("layers", 0, "bias"), nnx.Param(jnp.zeros(3))
        ),
        ValueError,
        [r"StateSharding: spec", r"\.layers\[0\]\.bias", r"type Param", r"catch-all"],
    ),
    # -- jit: a spec that does not fit its array ----------------------------------------
    case(
        "spec_rank_above_variable_rank",
        lambda: jit_call(
            forward, MLP(), X, in_shardings=(kernel_spec(P(None, None, "model")), None)
        ),
        ValueError,
        [r"args\[0\]\.linear\.kernel", r"rank at least 3", r"rank 2"],
    ),
    case(
        "spec_rank_above_array_rank",
        lambda: jit_call(forward, MLP(), X, in_shardings=(None, P("data", None, None))),
        ValueError,
        [r"args\[1\]", r"rank at least 3", r"rank 2"],
    ),
    case(
        "spec_rank_above_output_rank",
        lambda: jit_call(forward, MLP(), X, out_shardings=P(None, None, "model")),
        ValueError,
        [r"out_shardings", r"output", r"rank at least 3"],
    ),
    case(
        "indivisible_variable_dimension",
        lambda: jit_call(
            forward,
            nnx.Linear(3, 8, rngs=nnx.Rngs(0)),
            jnp.ones((2, 3)),
            in_shardings=(kernel_spec(P("model", None)), None),
        ),
        ValueError,
        [r"in_shardings", r"args\[0\]\.kernel", r"\(3, 8\)", r"partitioned 4 times"],
    ),
    case(
        "indivisible_array_dimension",
        lambda: jit_call(forward, MLP(), jnp.ones((6, 4)), in_shardings=(None, P("model"))),
        ValueError,
        [r"in_shardings", r"args\[1\]", r"\(6, 4\)", r"partitioned 4 times"],
    ),
    case(
        "indivisible_output_variable_dimension",
        lambda: jit_call(
            lambda m: m,
            nnx.Linear(3, 8, rngs=nnx.Rngs(0)),
            out_shardings=kernel_spec(P("model", None)),
        ),
        ValueError,
        [r"out_shardings", r"output\.kernel", r"\(3, 8\)", r"divid|partitioned"],
    ),
    case(
        "unknown_mesh_axis",
        lambda: jit_call(forward, MLP(), X, in_shardings=(kernel_spec(P(None, "nope")), None)),
        ValueError,
        [r"in_shardings", r"args\[0\]\.linear\.kernel", r"nope", r"not found in mesh"],
    ),
    case(
        "spec_without_a_mesh",
        lambda: jit_call(forward, MLP(), X, in_mesh=False, in_shardings=(kernel_spec(P()), None)),
        RuntimeError,
        [r"in_shardings", r"mesh in context|set_mesh"],
    ),
    case(
        "committed_variable_with_another_sharding",
        lambda: jit_call(
            forward,
            _committed_elsewhere(MLP()),
            X,
            in_shardings=(kernel_spec(P(None, "model")), None),
        ),
        ValueError,
        [r"args\[0\]\.linear\.kernel", r"P\(None, 'model'\)", r"does not match"],
    ),
    # -- jit: a sharding prefix that is not one -----------------------------------------
    case(
        "graph_node_in_in_shardings",
        lambda: jit_call(forward, MLP(), X, in_shardings=(MLP(), None)),
        ValueError,
        [r"in_shardings", r"graph node of type MLP at args\[0\]", r"StateSharding\("],
    ),
    case(
        "variable_in_in_shardings",
        lambda: jit_call(forward, MLP(), X, in_shardings=(nnx.Param(jnp.zeros(3)), None)),
        ValueError,
        [r"in_shardings", r"graph node of type Param at args\[0\]", r"StateSharding\("],
    ),
    case(
        "graph_node_in_out_shardings",
        lambda: jit_call(forward, MLP(), X, out_shardings=MLP()),
        ValueError,
        [r"out_shardings", r"graph node of type MLP at output", r"StateSharding\("],
    ),
    case(
        "graph_node_in_prefix_eval_shape",
        lambda: nnx_sharding.jit(forward, in_shardings=(MLP(), None)).eval_shape(MLP(), X),
        ValueError,
        [r"in_shardings", r"graph node of type MLP at args\[0\]"],
    ),
    case(
        "in_shardings_longer_than_arguments",
        lambda: jit_call(forward, MLP(), X, in_shardings=(None, None, None)),
        ValueError,
        [r"in_shardings", r"not a pytree prefix of the arguments", r"one entry per positional"],
    ),
    case(
        "in_shardings_deeper_than_an_argument",
        lambda: jit_call(forward, MLP(), X, in_shardings=(None, (None, None))),
        ValueError,
        [r"in_shardings", r"not a pytree prefix", r"args\[1\]"],
    ),
    case(
        "out_shardings_not_a_prefix",
        lambda: jit_call(forward, MLP(), X, out_shardings=(None, None)),
        ValueError,
        [r"out_shardings", r"not a pytree prefix"],
    ),
    case(
        "state_sharding_at_an_array",
        lambda: jit_call(forward, MLP(), X, in_shardings=(None, StateSharding({...: None}))),
        ValueError,
        [r"in_shardings", r"StateSharding stands at args\[1\]", r"position of a graph node"],
    ),
    case(
        "state_sharding_at_an_output_array",
        lambda: jit_call(forward, MLP(), X, out_shardings=StateSharding({...: None})),
        ValueError,
        [r"out_shardings", r"StateSharding stands at output", r"position of a graph node"],
    ),
    case(
        "string_in_in_shardings",
        lambda: jit_call(forward, MLP(), X, in_shardings=("model", None)),
        TypeError,
        [r"in_shardings", r"found a str at args\[0\]", r"PartitionSpec"],
    ),
    # -- jit: one Variable, two shardings -----------------------------------------------
    case(
        "variable_aliased_across_arguments",
        _one_module_two_shardings,
        ValueError,
        [r"in_shardings", r"args\[0\]\.kernel", r"args\[1\]\.kernel", r"one sharding"],
    ),
    case(
        "variable_aliased_inside_one_argument",
        lambda: jit_call(
            lambda m: None,
            Shared(),
            in_shardings=StateSharding(
                [(nnx.PathContains("first"), named()), (..., named("model"))]
            ),
        ),
        ValueError,
        [r"in_shardings", r"args\[0\]\.first\.kernel", r"args\[0\]\.second\.kernel"],
    ),
    case(
        "variable_aliased_between_input_and_output",
        lambda: jit_call(
            lambda m: m,
            nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
            in_shardings=StateSharding({nnx.Param: named()}),
            out_shardings=StateSharding({nnx.Param: named("model")}),
        ),
        ValueError,
        [r"in_shardings/out_shardings", r"args\[0\]\.kernel", r"output\.kernel", r"one sharding"],
    ),
    # -- jit: static and donated arguments ----------------------------------------------
    case(
        "unhashable_static_argument",
        lambda: jit_call(_scaled, MLP(), [2], X, static_argnums=1),
        ValueError,
        [r"args\[1\]", r"static argument of type list", r"hashable"],
    ),
    case(
        "unhashable_static_keyword_argument",
        lambda: nnx_sharding.jit(_scaled, static_argnames="n")(MLP(), n={"a": 1}, x=X),
        ValueError,
        [r"kwargs\['n'\]", r"static argument of type dict", r"hashable"],
    ),
    case(
        "unhashable_static_argument_trace",
        lambda: nnx_sharding.jit(_scaled, static_argnums=1).trace(MLP(), [2], X),
        ValueError,
        [r"args\[1\]", r"static argument of type list", r"hashable"],
    ),
    case(
        "static_argnums_out_of_range",
        lambda: nnx_sharding.jit(forward, static_argnums=5)(MLP(), X),
        ValueError,
        [r"static_argnums", r"5", r"2 positional"],
    ),
    case(
        "donate_argnums_out_of_range",
        lambda: nnx_sharding.jit(forward, donate_argnums=5)(MLP(), X),
        ValueError,
        [r"donate_argnums", r"5", r"2 positional"],
    ),
    case(
        "unknown_static_argname",
        lambda: nnx_sharding.jit(forward, static_argnames="nope")(MLP(), X),
        ValueError,
        [r"static_argnames", r"nope"],
    ),
    case(
        "unknown_donate_argname",
        lambda: nnx_sharding.jit(forward, donate_argnames="nope")(MLP(), X),
        ValueError,
        [r"donate_argnames", r"nope"],
    ),
    case(
        "argument_both_static_and_donated",
        lambda: nnx_sharding.jit(forward, static_argnums=0, donate_argnums=0)(Counter(), XX),
        ValueError,
        [r"static_arg", r"donate_arg", r"model|\b0\b"],
    ),
    case(
        "donated_buffer_read_through_a_second_reference",
        lambda: read_after_donation(_apply(nnx_sharding.jit(forward)), lambda m: None),
        RuntimeError,
        [r"args\[0\]\.(bias|kernel)", r"donat|deleted"],
    ),
    case(
        "donated_buffer_read_through_a_second_reference_warm",
        _donated_to_warm_jit,
        RuntimeError,
        [r"args\[0\]\.(bias|kernel)", r"donat|deleted"],
    ),
    # -- jit: values that are not arrays ------------------------------------------------
    case(
        "non_array_argument",
        lambda: nnx_sharding.jit(lambda m, s: m(XX))(Counter(), "text"),
        TypeError,
        [r"args\[1\]", r"str", r"static_argnums"],
    ),
    case(
        "non_array_variable_value",
        lambda: nnx_sharding.jit(forward)(_with_string_variable(), XX),
        TypeError,
        [r"args\[0\]\.label", r"str", r"abstract array"],
    ),
    case(
        "jit_of_a_non_callable",
        lambda: nnx_sharding.jit(3),  # jax.jit(3) raises here, at decoration
        TypeError,
        [r"callable", r"\b3\b"],
    ),
    # -- StateSharding ------------------------------------------------------------------
    case(
        "state_sharding_value_not_a_sharding",
        lambda: StateSharding({nnx.Param: "model"}),
        TypeError,
        [r"StateSharding: spec", r"filter .*Param.* is a str", r"PartitionSpec"],
    ),
    case(
        "state_sharding_from_a_state_of_strings",
        lambda: StateSharding(jax.tree.map(lambda _: "model", nnx.state(MLP()))),
        TypeError,
        [r"StateSharding: spec", r"\.bn\.bias", r"is a str", r"PartitionSpec"],
    ),
    case(
        "state_sharding_spec_not_a_mapping",
        lambda: StateSharding(42),
        TypeError,
        [r"StateSharding", r"spec", r"int", r"[Mm]apping|pairs"],
    ),
    case(
        "state_sharding_pair_without_a_sharding",
        lambda: StateSharding([(nnx.Param,)]),
        TypeError,
        [r"StateSharding", r"spec", r"Param", r"pair"],
    ),
    case(
        "state_sharding_invalid_filter",
        lambda: StateSharding({3.5: P()}),
        TypeError,
        [r"StateSharding", r"filter", r"3\.5"],
    ),
    # -- stage objects: Compiled called with other arguments ----------------------------
    case(
        "compiled_module_with_another_structure",
        lambda: _compiled()(_with_extra_attribute(), XX),
        TypeError,
        [r"graph node at args\[0\] has another structure", r"lowered for"],
    ),
    case(
        "compiled_array_of_another_shape",
        lambda: _compiled()(Counter(), jnp.ones((3, 4))),
        TypeError,
        [r"args\[1\]: got float32\[3, 4\], compiled for float32\[2, 4\]", r"lowered for"],
    ),
    case(
        "compiled_array_of_another_dtype",
        lambda: _compiled()(Counter(), XX.astype(jnp.int32)),
        TypeError,
        [r"args\[1\]: got int32\[2, 4\], compiled for float32\[2, 4\]"],
    ),
    case(
        "compiled_variable_of_another_shape",
        lambda: _compiled()(_with_wider_kernel(), XX),
        TypeError,
        [r"args\[0\]\.lin\.kernel: got float32\[4, 5\], compiled for float32\[4, 3\]"],
    ),
    case(
        "compiled_keyword_for_positional",
        lambda: _compiled()(Counter(), x=XX),
        TypeError,
        [r"argument structure", r"lowered for", r"kwargs\['x'\]"],
    ),
    case(
        "compiled_missing_argument",
        lambda: _compiled()(Counter()),
        TypeError,
        [r"argument structure", r"lowered for", r"args\[1\]"],
    ),
    case(
        "compiled_module_where_an_array_was",
        lambda: _compiled()(Counter(), Counter()),
        TypeError,
        [r"args\[1\]", r"another structure"],
    ),
    case(
        "compiled_another_static_argument",
        lambda: _compiled(_scaled, Counter(), 2, XX, static_argnums=1)(Counter(), 3, XX),
        TypeError,
        [r"static arguments \(\(1, 3\),\) differ from \(\(1, 2\),\)"],
    ),
    case(
        "compiled_unhashable_static_argument",
        lambda: _compiled(_scaled, Counter(), 2, XX, static_argnums=1)(Counter(), [3], XX),
        ValueError,
        [r"args\[1\]", r"static argument of type list", r"hashable"],
    ),
    case(
        "compiled_donated_buffer_read_through_a_second_reference",
        _donated_to_compiled,
        RuntimeError,
        [r"args\[0\]\.(bias|kernel)", r"donat|deleted"],
    ),
    case(
        "lowered_committed_variable_with_another_sharding",
        _lower_committed_elsewhere,
        ValueError,
        [r"args\[0\]\.linear\.kernel", r"P\(None, 'model'\)", r"does not match"],
    ),
    case(
        "lowered_compile_with_unknown_option",
        lambda: nnx_sharding.jit(forward).lower(Counter(), XX).compile({"bogus_option": 1}),
        jax.errors.JaxRuntimeError,  # jax's, passed through
        [r"bogus_option", r"[Cc]ompile option"],
    ),
]

REQUIRED = {  # issue 8, item 1: "at least" these cases, by id
    "jit": [
        "unmatched_variable_in_shardings",
        "spec_rank_above_variable_rank",
        "indivisible_variable_dimension",
        "unknown_mesh_axis",
        "graph_node_in_in_shardings",
        "variable_aliased_across_arguments",
        "unhashable_static_argument",
        "donated_buffer_read_through_a_second_reference",
        "compiled_module_with_another_structure",
        "in_shardings_deeper_than_an_argument",
    ],
}


@pytest.mark.parametrize("trigger, error, patterns", MISUSES)
def test_misuse_names_argument_path_and_expectation(trigger, error, patterns):
    check_misuse(trigger, error, patterns)


MISUSE_IDS = [p.id for p in MISUSES]


def test_misuse_table_covers_issue_8():
    assert len(MISUSE_IDS) == len(set(MISUSE_IDS)), "duplicate case ids"
    assert len(MISUSE_IDS) >= 25
    assert all(p.values[2] for p in MISUSES), "every case checks its message"
    missing = [i for i in REQUIRED["jit"] if i not in MISUSE_IDS]
    assert not missing, f"issue 8 asks for these misuse cases: {missing}"
