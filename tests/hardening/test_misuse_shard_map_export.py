"""Hardening (issue 8), item 1, bad input: `shard_map`, `export` and `Exported`.

`SHARD_MAP_MISUSES` and `EXPORT_MISUSES` are tables of (trigger, exception type, regexes
the message must contain: the argument, the Variable path where there is one, what was
expected); `REQUIRED` names the cases the issue asks for, and
`test_misuse_table_covers_issue_8_for_shard_map_and_export` checks that they are there.
`test_package_errors_follow_the_message_layout`: the layout of the package's messages.
A bug these tests found is kept as a strict xfail whose reason is the diagnosis.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest
from flax import nnx
from hardening_common import (
    MESH,
    MLP,
    XX,
    Counter,
    X,
    _scaled,
    _with_string_variable,
    case,
    check_misuse,
    forward,
    jit_call,
    kernel_spec,
)
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding import StateSharding


def shard_map_call(fun, *args, mesh=MESH, **options):
    """``nnx_sharding.shard_map(fun, mesh=mesh, **options)(*args)``; in_specs and
    out_specs replicate everything unless given."""
    options = {"in_specs": P(), "out_specs": P(), **options}
    return nnx_sharding.shard_map(fun, mesh=mesh, **options)(*args)


def _grow(model, x):
    model.extra = nnx.Param(jnp.ones(()))
    return x


def _swap_kernel(model, x):
    model.linear.kernel = nnx.Param(model.linear.kernel[...])
    return x


def _drop_batch_norm(model, x):
    del model.bn
    return x


def _varying_bias(model, x):
    """Writes a value that differs between the 'data' shards into a replicated Variable."""
    model.linear.bias[...] = jnp.tile(x.sum(0), 2)
    return x


def _twice(model, x):
    return x, x


SHARD_MAP_MISUSES = [
    # -- mesh and structure -------------------------------------------------------------
    case(
        "shard_map_without_a_mesh",
        lambda: shard_map_call(forward, MLP(), X, mesh=None),
        ValueError,
        [r"shard_map: mesh: no mesh was given", r"mesh=jax\.make_mesh", r"jax\.set_mesh"],
    ),
    case(
        "shard_map_structure_change_inside",
        lambda: shard_map_call(_grow, MLP(), X),
        ValueError,
        [
            r"shard_map: arguments: the function changed the graph structure of args\[0\]",
            r"added a Param at args\[0\]\.extra",
            r"may update Variable values but not add, remove or replace",
        ],
    ),
    case(
        "shard_map_variable_swapped_inside",
        lambda: shard_map_call(_swap_kernel, MLP(), X),
        ValueError,
        [
            r"shard_map: arguments: .*structure of args\[0\]",
            r"replaced the Param at args\[0\]\.linear\.kernel",
            r"may update Variable values but not add, remove or replace",
        ],
    ),
    case(
        "shard_map_submodule_removed_inside",
        lambda: shard_map_call(_drop_batch_norm, MLP(), X),
        ValueError,
        [r"shard_map: arguments", r"removed the BatchNorm at args\[0\]\.bn\b", r"may update"],
    ),
    # -- in_specs and out_specs that are no prefix ---------------------------------------
    case(
        "shard_map_in_specs_not_a_prefix",
        lambda: shard_map_call(forward, MLP(), X, in_specs=(P(), P(), P())),
        ValueError,
        [
            r"shard_map: in_specs: is not a pytree prefix of the arguments",
            r"at args it has a tuple of 3 entries where the arguments have a tuple of 2",
            r"one entry per positional argument",
        ],
    ),
    case(
        "shard_map_in_specs_deeper_than_an_argument",
        lambda: shard_map_call(forward, MLP(), X, in_specs=(P(), (P(), P()))),
        ValueError,
        [r"shard_map: in_specs: is not a pytree prefix", r"at args\[1\]", r"shape \(8, 4\)"],
    ),
    case(
        "shard_map_out_specs_not_a_prefix",
        lambda: shard_map_call(forward, MLP(), X, out_specs=(P(), P())),
        ValueError,
        [
            r"shard_map: out_specs: is not a pytree prefix of the output",
            r"at output it has a tuple of 2 entries where the output has an array",
            r"one entry per element of the output",
        ],
    ),
    case(
        "shard_map_graph_node_in_in_specs",
        lambda: shard_map_call(forward, MLP(), X, in_specs=(MLP(), P())),
        ValueError,
        [r"shard_map: in_specs", r"graph node of type MLP at args\[0\]", r"StateSharding\("],
    ),
    case(
        "shard_map_string_in_in_specs",
        lambda: shard_map_call(forward, MLP(), X, in_specs=("model", P())),
        TypeError,
        [r"shard_map: in_specs", r"found a str at args\[0\]", r"PartitionSpec"],
    ),
    case(
        "shard_map_string_in_out_specs",
        lambda: nnx_sharding.shard_map(_twice, mesh=MESH, in_specs=P(), out_specs=(P(), "x")),
        TypeError,
        [r"shard_map: out_specs", r"found a str at output\[1\]", r"PartitionSpec"],
    ),
    case(
        "shard_map_state_sharding_at_an_array",
        lambda: shard_map_call(forward, MLP(), X, in_specs=(P(), StateSharding({...: P()}))),
        ValueError,
        [
            r"shard_map: in_specs",
            r"StateSharding stands at args\[1\], where the argument is an ArrayImpl",
            r"position of a graph node",
        ],
    ),
    case(
        "shard_map_state_sharding_above_several_nodes",
        lambda: shard_map_call(lambda m: (m, m.linear), MLP(), out_specs=StateSharding({...: P()})),
        ValueError,
        [
            r"shard_map: out_specs",
            r"StateSharding stands at output, which is not a single graph node",
            r"exactly one graph node",
        ],
    ),
    # -- specs that do not fit ----------------------------------------------------------
    case(
        "shard_map_unknown_mesh_axis",
        lambda: shard_map_call(forward, MLP(), X, in_specs=(kernel_spec(P(None, "nope")), P())),
        ValueError,
        [r"shard_map: in_specs", r"args\[0\]\.linear\.kernel", r"'nope'", r"not found in mesh"],
    ),
    case(
        "shard_map_unknown_mesh_axis_in_out_specs",
        lambda: shard_map_call(_twice, MLP(), X, out_specs=(P(), P("nope"))),
        ValueError,
        [
            r"shard_map: out_specs: output\[1\]",
            r"names 'nope', which is not an axis of the mesh",
            r"the mesh has 'data', 'model'",
        ],
    ),
    case(
        "shard_map_axis_not_manual_in_out_specs",
        lambda: shard_map_call(
            _twice, MLP(), X, axis_names={"data"}, out_specs=(P("data"), P("model"))
        ),
        ValueError,
        [
            r"shard_map: out_specs: output\[1\]",
            r"names 'model', which is not a manual axis",
            r"the manual ones are 'data'\.",
        ],
    ),
    case(
        "shard_map_unmatched_variable_in_specs",
        lambda: shard_map_call(
            forward, MLP(), X, in_specs=(StateSharding({nnx.BatchStat: P()}), P())
        ),
        ValueError,
        [
            r"shard_map: in_specs",
            r"args\[0\]\.bn\.bias \(type Param\) matches none of the filters",
            r"catch-all",
        ],
    ),
    case(
        "shard_map_unmatched_variable_out_specs",
        lambda: shard_map_call(
            lambda m: MLP(), MLP(), out_specs=StateSharding({nnx.BatchStat: P()})
        ),
        ValueError,
        [
            r"shard_map: out_specs",
            r"output\.bn\.bias \(type Param\) matches none of the filters",
            r"catch-all",
        ],
    ),
    case(
        "shard_map_indivisible_variable_dimension",
        lambda: shard_map_call(
            forward,
            nnx.Linear(3, 8, rngs=nnx.Rngs(0)),
            jnp.ones((2, 3)),
            in_specs=(kernel_spec(P("model", None)), P()),
        ),
        ValueError,
        [r"shard_map: in_specs", r"args\[0\]\.kernel", r"\(3, 8\)", r"partitioned 4 times"],
    ),
    case(
        "shard_map_indivisible_array_dimension",
        lambda: shard_map_call(forward, MLP(), jnp.ones((6, 4)), in_specs=(P(), P("model"))),
        ValueError,
        [r"shard_map: in_specs", r"args\[1\]", r"\(6, 4\)", r"partitioned 4 times"],
    ),
    case(
        "shard_map_spec_rank_above_variable_rank",
        lambda: shard_map_call(
            forward, MLP(), X, in_specs=(kernel_spec(P(None, None, "model")), P())
        ),
        ValueError,
        [r"shard_map: in_specs", r"args\[0\]\.linear\.kernel", r"rank at least 3", r"rank 2"],
    ),
    case(
        "shard_map_spec_rank_above_output_rank",
        lambda: shard_map_call(forward, MLP(), X, out_specs=P(None, None, "model")),
        ValueError,
        [r"the out_specs entry at output is P\(None, None, 'model'\)", r"length 3", r"rank 2"],
    ),
    case(
        "shard_map_in_specs_inferred_on_auto_axes",
        lambda: shard_map_call(forward, MLP(), X, in_specs=None),
        TypeError,
        [
            r"shard_map: in_specs: 2 problems:\n  - in_specs is None, but mesh axis 'data' "
            r"is not Explicit",
            r"AxisType\.Explicit",
        ],
    ),
    # -- values that vary where the spec says replicated --------------------------------
    case(
        "shard_map_varying_update_of_a_replicated_variable",
        lambda: shard_map_call(
            _varying_bias, MLP(), X, in_specs=(P(), P("data")), out_specs=P("data")
        ),
        ValueError,
        [
            r"the in_specs entry of args\[0\]\.linear\.bias",
            r"is P\(\) which implies .* possibly varying over \{data\}",
            r"check_vma",
        ],
    ),
    case(
        "shard_map_varying_output_under_a_replicated_spec",
        lambda: shard_map_call(
            _twice, MLP(), X, in_specs=(P(), P("data")), out_specs=(P("data"), P())
        ),
        ValueError,
        [r"the out_specs entry at output\[1\] is P\(\)", r"possibly varying over \{data\}"],
    ),
    case(
        "shard_map_of_a_non_callable",
        lambda: nnx_sharding.shard_map(3, out_specs=P()),
        TypeError,
        [r"shard_map: fun: expected a callable, got 3", r"shard_map\(forward, out_specs=P\(\)\)"],
    ),
]


@functools.cache
def _exported() -> nnx_sharding.Exported:
    return nnx_sharding.export(forward, MLP(), X)


def _with_wider_linear():
    model = MLP()
    model.linear.kernel.set_value(jnp.zeros((4, 5)))
    return model


def _state_without_bn_scale():
    state = nnx.state(MLP())
    del state["bn"]["scale"]
    return state


def _grow_and_run(model, x):
    model.extra = nnx.Param(jnp.zeros(2))
    return model(x)


EXPORT_MISUSES = [
    # -- export -------------------------------------------------------------------------
    case(
        "export_variable_holding_a_non_array",
        lambda: nnx_sharding.export(forward, _with_string_variable(), XX),
        TypeError,
        [r"export: arguments: args\[0\]\.label: a str is not an array", r"takes arrays"],
    ),
    case(
        "export_argument_not_an_array",
        lambda: nnx_sharding.export(_scaled, Counter(), "two", XX),
        TypeError,
        [r"export: arguments: args\[1\]: a str is not an array", r"static_argnums"],
    ),
    case(
        "export_structure_change_inside",
        lambda: nnx_sharding.export(_grow_and_run, Counter(), XX),
        ValueError,
        [
            r"export: fun: the function changed the graph structure of args\[0\]",
            r"added a Variable at args\[0\]\.extra",
            r"may update Variable values but not add",
        ],
    ),
    case(
        "export_spec_without_a_mesh",
        lambda: nnx_sharding.export(
            nnx_sharding.jit(forward, in_shardings=(kernel_spec(P(None, "model")), None)), MLP(), X
        ),
        ValueError,
        [
            r"export: in_shardings",
            r"P\(None, 'model'\) for args\[0\]\.linear\.kernel needs a mesh",
            r"jax\.set_mesh",
        ],
    ),
    case(
        "export_of_a_non_callable",
        lambda: nnx_sharding.export(3, X),
        TypeError,
        [r"export: fun: expected a callable, got 3", r"export\(forward, \*args\)"],
    ),
    # -- Exported.call ------------------------------------------------------------------
    case(
        "exported_called_with_another_module",
        lambda: _exported()(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), X),
        TypeError,
        [
            r"Exported\.call: arguments: 6 problems",
            r"args\[0\]\.linear\.kernel: missing",
            r"shape and dtype it was exported for",
        ],
    ),
    case(
        "exported_variable_of_another_shape",
        lambda: _exported()(_with_wider_linear(), X),
        TypeError,
        [r"args\[0\]\.linear\.kernel: got float32\[4, 5\], exported for float32\[4, 8\]"],
    ),
    case(
        "exported_array_where_a_module_was",
        lambda: _exported()(X, X),
        TypeError,
        [r"Exported\.call: arguments", r"args\[0\]: expected a graph node or nnx\.State"],
    ),
    case(
        "exported_module_where_an_array_was",
        lambda: _exported()(MLP(), MLP()),
        TypeError,
        [r"Exported\.call: arguments", r"args\[1\]: expected an array, got a MLP"],
    ),
    case(
        "exported_missing_argument",
        lambda: _exported()(MLP()),
        TypeError,
        [r"Exported\.call: arguments", r"args\[1\] is missing", r"the program takes"],
    ),
    case(
        "exported_keyword_for_positional",
        lambda: _exported()(MLP(), x=X),
        TypeError,
        [r"args\[1\] is missing", r"kwargs\['x'\] is not among the arguments it was exported"],
    ),
    case(
        "deserialized_called_with_another_structure",
        lambda: nnx_sharding.deserialize(_exported().serialize())(_state_without_bn_scale(), X),
        TypeError,
        [r"Exported\.call: arguments: args\[0\]\.bn\.scale: missing", r"exported for"],
    ),
]
ALL_MISUSES = SHARD_MAP_MISUSES + EXPORT_MISUSES

REQUIRED = {  # issue 8, item 1: "at least" these cases, by id
    "shard_map": [
        "shard_map_without_a_mesh",
        "shard_map_structure_change_inside",
        "shard_map_in_specs_not_a_prefix",
        "shard_map_out_specs_not_a_prefix",
        "shard_map_unknown_mesh_axis",
        "shard_map_unmatched_variable_in_specs",
        "shard_map_indivisible_variable_dimension",
        "shard_map_variable_swapped_inside",
    ],
    "export": [
        "export_variable_holding_a_non_array",
        "exported_called_with_another_module",
        "deserialized_called_with_another_structure",
    ],
}


@pytest.mark.parametrize("trigger, error, patterns", ALL_MISUSES)
def test_misuse_names_argument_path_and_expectation(trigger, error, patterns):
    check_misuse(trigger, error, patterns)


@pytest.mark.parametrize("transform", ["shard_map", "export"])
def test_misuse_table_covers_issue_8_for_shard_map_and_export(transform):
    """The cases the issue names for shard_map (and those of export) are in their table."""
    rows = {"shard_map": SHARD_MAP_MISUSES, "export": EXPORT_MISUSES}[transform]
    ids = [p.id for p in rows]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert all(p.values[2] for p in rows), "every case checks its message"
    assert len(ids) >= max(3, len(REQUIRED[transform]))
    missing = [i for i in REQUIRED[transform] if i not in ids]
    assert not missing, f"issue 8 asks for these misuse cases: {missing}"
    if transform == "shard_map":
        assert all(i.startswith("shard_map_") for i in ids)


def test_package_errors_follow_the_message_layout():
    """The package's own messages: 'transform: argument: problem', a Rule, numbered fixes."""
    with pytest.raises(ValueError) as info:
        jit_call(forward, MLP(), X, in_shardings=(MLP(), None))
    lines = str(info.value).splitlines()
    assert lines[0].startswith("jit: in_shardings: ")
    assert lines[1].startswith("Rule: ")
    assert lines[2] == "Fixes:" and lines[3].startswith("  1. ")
