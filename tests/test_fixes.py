"""Every suggested fix that is code works when tried, in the situation of its error.

Each case sets up a situation (`setup`), runs the user's code that fails (`broken`)
and reads the numbered fix from the error it raised. The code of the fix is taken
from the message as printed (every ```...``` snippet of that fix line, checked to be
there), the user's names put in (`names`: ``(printed, user's)`` replacements, applied
once each, in order), and must then appear literally in `fixed`, the user's code with
the fix applied, which must run; `check` then asserts what the fix was for. A case with
``fresh=True`` runs in a new interpreter without device flags, for fixes about how jax
starts.

`test_every_message_is_classified` keeps the table complete: each message builder of
every module of ``nnx_sharding._errors`` (the transforms', the tools', the
checkpoints', the planner's) is either in the table or listed in `PROSE` (fixes
without code, or code that only names an option). ``_errors.layout`` is left out: it
holds the layout and the pieces the builders share, which no call site raises itself
(`test_no_call_site_raises_a_layout_piece`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from flax import nnx

import nnx_sharding._errors
from nnx_sharding._errors import layout

ROOT = Path(__file__).resolve().parent.parent

PRELUDE = """\
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding import StateSharding

mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
model = nnx.Linear(16, 64, rngs=nnx.Rngs(0))
x = jnp.ones((8, 16))
expected = model(x)
tp = StateSharding(
    {
        nnx.PathContains("kernel"): P(None, "model"),
        nnx.PathContains("bias"): P("model"),
        ...: P(),
    }
)


def close(actual, desired):
    np.testing.assert_allclose(actual, desired, rtol=1e-5, atol=1e-6)
"""

# A model whose Variables carry logical axis names (nnx.with_partitioning).
ANNOTATED = """
init = nnx.initializers.lecun_normal()
with nnx.use_eager_sharding(False):
    annotated = nnx.Linear(
        16, 64, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=nnx.Rngs(0)
    )
"""

# The planner's cases: a step planned for 2 of the CPU devices, and a builder of a
# training step with the knobs remat and microbatches (`nnx_sharding.plan.search`).
PLANNER = """
from nnx_sharding.plan import Built, accumulate_gradients, remat_policy


def forward(m, x):
    return m(x)


def loss(m, x):
    return jnp.mean(m(x) ** 2)


def build(knobs):
    remat = knobs.get("remat", "none")
    microbatches = knobs.get("microbatches", 1)
    f = loss if remat == "none" else nnx.remat(loss, policy=remat_policy(remat))

    def step(m, x):
        return accumulate_gradients(f, m, x, microbatches)[0]

    return Built(step, (model, x))
"""

# A stack of 8 layers, a mesh whose 'stage' axis has 4 devices, and nnx.scan's answer.
MOE = """
sizes = dict(experts=8, mlp=16, rngs=nnx.Rngs(0))
x = jnp.ones((2, 12, 8))
"""

CONTEXT = """
cmesh = jax.make_mesh((8,), ("context",), axis_types=(AxisType.Auto,))
q, kv = jnp.ones((1, 64, 4, 16)), jnp.ones((1, 64, 2, 16))
attend = nnx_sharding.plan.context_attention
"""

PIPELINE = """
@nnx.split_rngs(splits=8)
@nnx.vmap
def make_stack(rngs):
    return nnx.Linear(16, 16, rngs=rngs)


def block(layer, h):
    return jnp.tanh(layer(h))


stack = make_stack(nnx.Rngs(0))
stage_mesh = jax.make_mesh((4, 2), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
reference = nnx.scan(block, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(stack, x)
"""

FRESH_PRELUDE = """\
import jax.numpy as jnp
from flax import nnx

import nnx_sharding
"""


def aot_command(command: str) -> str:
    """A fix that is a ``python -m nnx_sharding`` command line, run as printed.

    The command runs in a new process of this interpreter (the ``python`` it names),
    with this repository importable and the device flags of the test's process.
    """
    return (
        "import os, shlex, subprocess, sys\n"
        f"command = {command!r}\n"
        "argv = [sys.executable, *shlex.split(command)[1:]]\n"
        f"path = os.pathsep.join([{str(ROOT)!r}, os.environ.get('PYTHONPATH', '')])\n"
        "env = dict(os.environ, PYTHONPATH=path)\n"
        "done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)"
    )


# The command's report: its title names the config and the mesh.
AOT_CHECK = (
    "assert done.returncode == 0, done.stderr\n"
    "assert \"AOT: config '{config}', mesh {mesh}\" in done.stdout, done.stdout"
)


@dataclasses.dataclass(frozen=True)
class Case:
    builder: str  # the _errors function whose message this is
    fix: int  # the fix's number in the message
    setup: str
    broken: str
    fixed: str
    error: type[BaseException] = Exception
    names: tuple[tuple[str, str], ...] = ()
    check: str = ""
    fresh: bool = False  # run in a new interpreter without device flags
    id: str = ""
    # which of the fix line's `snippets` the case runs, where it offers alternatives
    snippets: tuple[int, ...] | None = None


def _ids(case: Case) -> str:
    return f"{case.builder}-{case.fix}" + (f"-{case.id}" if case.id else "")


CASES = [
    # --- StateSharding ----------------------------------------------------------------------
    Case(
        "no_filter_matched",
        1,
        "shardings = StateSharding([(nnx.BatchStat, P())])",
        "with jax.set_mesh(mesh):\n    nnx_sharding.shard(model, shardings)",
        "shardings = StateSharding([(nnx.BatchStat, P()), (nnx.Param, P())])\n"
        "with jax.set_mesh(mesh):\n    nnx_sharding.shard(model, shardings)",
        ValueError,
        check="assert model.kernel.get_value().sharding.spec == P()",
    ),
    Case(
        "no_filter_matched",
        2,
        "shardings = StateSharding([(nnx.BatchStat, P())])",
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(shardings, None))\n"
        "with jax.set_mesh(mesh):\n    forward(model, x)",
        "shardings = StateSharding([(nnx.BatchStat, P()), (..., None)])\n"
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(shardings, None))\n"
        "with jax.set_mesh(mesh):\n    y = forward(model, x)",
        ValueError,
        check="close(y, expected)",
    ),
    Case(
        "spec_not_pairs",
        1,
        "",
        "shardings = StateSharding(P('model'))",
        "shardings = StateSharding({nnx.Param: P('model'), ...: None})\n"
        "with jax.set_mesh(mesh):\n    nnx_sharding.shard(model, shardings)",
        TypeError,
        check="assert model.kernel.get_value().sharding.spec == P('model')",
    ),
    Case(
        "spec_entry_not_a_pair",
        2,
        "",
        "shardings = StateSharding([nnx.Param, P()])",
        "shardings = StateSharding([(nnx.Param, P()), (..., None)])\n"
        "with jax.set_mesh(mesh):\n    nnx_sharding.shard(model, shardings)",
        TypeError,
        check="assert model.kernel.get_value().sharding.spec == P()",
    ),
    Case(
        "bad_filter",
        1,
        "",
        "shardings = StateSharding({1.5: P(None, 'model'), ...: P()})",
        "shardings = StateSharding(\n"
        "    {nnx.PathContains('kernel'): P(None, 'model'), nnx.Param: P(), ...: None}\n)\n"
        "with jax.set_mesh(mesh):\n    nnx_sharding.shard(model, shardings)",
        TypeError,
        check="assert model.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "bad_filter",
        2,
        "",
        "shardings = StateSharding({1.5: P(None, 'model'), ...: P()})",
        "shardings = StateSharding(\n"
        "    {lambda path, value: path[-1] == 'kernel': P(None, 'model'), ...: P()}\n)\n"
        "with jax.set_mesh(mesh):\n    nnx_sharding.shard(model, shardings)",
        TypeError,
        check="assert model.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "spec_value_not_a_sharding",
        1,
        "",
        "shardings = StateSharding({nnx.Param: 'model'})",
        "shardings = StateSharding({nnx.Param: P('model')})\n"
        "with jax.set_mesh(mesh):\n    nnx_sharding.shard(model, shardings)",
        TypeError,
        check="assert model.bias.get_value().sharding.spec == P('model')",
    ),
    # --- jit --------------------------------------------------------------------------------
    Case(
        "sharding_mismatch",
        1,
        "nnx_sharding.shard(model, NamedSharding(mesh, P()))  # committed, replicated\n"
        "shardings = tp\n"
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(shardings, None))",
        "with jax.set_mesh(mesh):\n    forward(model, x)",
        "with jax.set_mesh(mesh):\n"
        "    nnx_sharding.shard(model, shardings)\n"
        "    y = forward(model, x)",
        ValueError,
        id="module",
        snippets=(1, 2),
        check="close(y, expected)\n"
        "assert model.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "sharding_mismatch",
        1,
        "x = jax.device_put(x, NamedSharding(mesh, P()))  # committed, replicated\n"
        "sharding = NamedSharding(mesh, P('data'))\n"
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(None, sharding))",
        "forward(model, x)",
        "x = jax.device_put(x, sharding)\ny = forward(model, x)",
        ValueError,
        id="array",
        snippets=(0,),
        check="close(y, expected)",
    ),
    Case(
        "deleted_buffers",
        2,
        "step = nnx_sharding.jit(lambda m: nnx.update(m, nnx.state(m)), donate_argnums=0)\n"
        "forward = nnx_sharding.jit(lambda m, x: m(x))\n",
        "kept = nnx.clone(model)\nstep(model)\nforward(kept, x)",
        "graphdef, state = nnx.split(model); "
        "copy = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))\n"
        "step(model)\ny = forward(copy, x)",
        RuntimeError,
        check="close(y, expected)",
    ),
    Case(
        "not_callable",
        1,
        "def forward(model, n):\n    return model(x) * n\n",
        "nnx_sharding.jit(static_argnums=1)(3)",
        "forward_jit = nnx_sharding.jit(forward, static_argnums=1)\ny = forward_jit(model, 2)",
        TypeError,
        names=(("jit(", "nnx_sharding.jit("),),
        check="close(y, 2 * expected)",
    ),
    Case(
        "not_callable",
        2,
        "def forward(model, n):\n    return model(x) * n\n",
        "nnx_sharding.jit(3, static_argnums=1)",
        "forward_jit = nnx_sharding.jit(static_argnums=1)(forward)\ny = forward_jit(model, 2)",
        TypeError,
        names=(("jit(", "nnx_sharding.jit("),),
        snippets=(0,),
        check="close(y, 2 * expected)",
    ),
    Case(
        "not_callable",
        1,
        "def forward(model, x):\n    return model(x)\n",
        "nnx_sharding.shard_map(out_specs=P('data'))(3)",
        "f = nnx_sharding.shard_map("
        "forward, mesh=mesh, in_specs=(P(), P('data')), out_specs=P('data'))\n"
        "y = f(model, x)",
        TypeError,
        names=(
            ("shard_map(", "nnx_sharding.shard_map("),
            ("out_specs=P()", "mesh=mesh, in_specs=(P(), P('data')), out_specs=P('data')"),
        ),
        id="shard_map",
        check="close(y, expected)",
    ),
    Case(
        "not_callable",
        1,
        "def forward(model, x):\n    return model(x)\n",
        "nnx_sharding.export(x, forward)",
        "exported = nnx_sharding.export(forward, model, x)",
        TypeError,
        names=(("export(", "nnx_sharding.export("), ("*args", "model, x")),
        id="export",
        check="y, _ = exported.call(model, x)\nclose(y, expected)",
    ),
    Case(
        "bad_prefix_entry",
        1,
        "",
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(None, 'data'))\n"
        "with jax.set_mesh(mesh):\n    forward(model, x)",
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(None, P('data')))\n"
        "with jax.set_mesh(mesh):\n    y = forward(model, x)",
        TypeError,
        check="assert y.sharding.spec[0] == 'data'",
    ),
    Case(
        "node_in_prefix",
        1,
        "",
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(model, None))",
        "forward = nnx_sharding.jit(\n"
        "    lambda m, x: m(x),\n"
        "    in_shardings=(\n"
        "        StateSharding({nnx.PathContains('kernel'): P(None, 'model'), ...: P()}),\n"
        "        None,\n"
        "    ),\n"
        ")\n"
        "with jax.set_mesh(mesh):\n    y = forward(model, x)",
        ValueError,
        check="close(y, expected)\n"
        "assert model.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "node_in_prefix",
        2,
        "",
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(model, None))",
        "forward = nnx_sharding.jit(\n"
        "    lambda m, x: m(x),\n"
        "    in_shardings=(\n"
        "        nnx.prefix(model, {nnx.PathContains('kernel'): P(None, 'model'), ...: P()}),\n"
        "        None,\n"
        "    ),\n"
        ")\n"
        "with jax.set_mesh(mesh):\n    y = forward(model, x)",
        ValueError,
        check="close(y, expected)\n"
        "assert model.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "node_in_prefix",
        3,
        ANNOTATED + "rules = [('embed', None), ('mlp', 'model')]\nexpected = annotated(x)",
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(annotated, None))",
        "forward = nnx_sharding.jit(\n"
        "    lambda m, x: m(x),\n"
        "    in_shardings=(StateSharding.from_metadata(annotated, rules), None),\n"
        ")\n"
        "with jax.set_mesh(mesh):\n    y = forward(annotated, x)",
        ValueError,
        names=(("model", "annotated"),),
        check="close(y, expected)\n"
        "assert annotated.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "not_a_prefix",
        1,
        "shardings = tp",
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(shardings, None, None))\n"
        "forward(model, x)",
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(shardings, P('data')))\n"
        "with jax.set_mesh(mesh):\n    y = forward(model, x)",
        ValueError,
        names=(("StateSharding(...)", "shardings"),),
        id="arguments",
        check="close(y, expected)",
    ),
    Case(
        "not_a_prefix",
        1,
        "shardings = tp",
        "forward = nnx_sharding.jit(lambda m, x: (m, m(x)), out_shardings=(shardings,))\n"
        "with jax.set_mesh(mesh):\n    forward(model, x)",
        "forward = nnx_sharding.jit(\n"
        "    lambda m, x: (m, m(x)), out_shardings=(shardings, P('data'))\n)\n"
        "with jax.set_mesh(mesh):\n    m, y = forward(model, x)",
        ValueError,
        names=(("StateSharding(...)", "shardings"),),
        id="output",
        check="close(y, expected)\nassert m is model",
    ),
    # --- shard_map --------------------------------------------------------------------------
    Case(
        "no_mesh",
        1,
        "def forward(model, x):\n    return model(x)\n",
        "f = nnx_sharding.shard_map(forward, in_specs=(P(), P('data')), out_specs=P('data'))\n"
        "f(model, x)",
        "f = nnx_sharding.shard_map(\n"
        "    forward,\n"
        "    mesh=jax.make_mesh((2, 4), ('data', 'model')),\n"
        "    in_specs=(P(), P('data')),\n"
        "    out_specs=P('data'),\n"
        ")\n"
        "y = f(model, x)",
        ValueError,
        names=(("jax.make_mesh(...)", "jax.make_mesh((2, 4), ('data', 'model'))"),),
        id="shard_map",
        check="close(y, expected)",
    ),
    Case(
        "no_mesh",
        2,
        "def forward(model, x):\n    return model(x)\n",
        "f = nnx_sharding.shard_map(forward, in_specs=(P(), P('data')), out_specs=P('data'))\n"
        "f(model, x)",
        "with jax.set_mesh(mesh):\n    y = f(model, x)",
        ValueError,
        id="shard_map",
        check="close(y, expected)",
    ),
    Case(
        "cannot_infer_specs",
        1,
        "def forward(model, x):\n    return model(x)\n",
        "f = nnx_sharding.shard_map(forward, mesh=mesh, out_specs=P('data'))\nf(model, x)",
        "f = nnx_sharding.shard_map(\n"
        "    forward,\n"
        "    mesh=mesh,\n"
        "    in_specs=(P(), P('data')),\n"
        "    out_specs=P('data'),\n"
        ")\n"
        "y = f(model, x)",
        TypeError,
        check="close(y, expected)",
    ),
    Case(
        "cannot_infer_specs",
        2,
        "def forward(model, x):\n    return model(x)\n",
        "f = nnx_sharding.shard_map(forward, mesh=mesh, out_specs=P('data'))\nf(model, x)",
        "mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)\n"
        "with jax.set_mesh(mesh):\n"
        "    nnx_sharding.shard(model, P())\n"
        "    x = jax.device_put(x, P('data'))\n"
        "    f = nnx_sharding.shard_map(forward, mesh=mesh, out_specs=P('data'))\n"
        "    y = f(model, x)",
        TypeError,
        names=((" * n", " * 2"),),
        check="close(y, expected)",
    ),
    Case(
        "spec_axes_not_manual",
        1,
        "def forward(model, x):\n    return model(x)\n",
        "f = nnx_sharding.shard_map(forward, mesh=mesh, in_specs=(P(), P('data')), "
        "out_specs=P('batch'))\nf(model, x)",
        "f = nnx_sharding.shard_map(\n"
        "    forward, mesh=mesh, in_specs=(P(), P('data')), out_specs=P('data')\n)\n"
        "y = f(model, x)",
        ValueError,
        snippets=(0,),
        check="close(y, expected)",
    ),
    Case(
        "state_sharding_above",
        1,
        "shardings = tp\ndef pair(model):\n    return model, model\n",
        "f = nnx_sharding.shard_map(pair, mesh=mesh, in_specs=(shardings,), out_specs=shardings)\n"
        "f(model)",
        "f = nnx_sharding.shard_map(\n"
        "    pair, mesh=mesh, in_specs=(shardings,), out_specs=(shardings, shardings)\n)\n"
        "a, b = f(model)",
        ValueError,
        names=(("(s, s)", "(shardings, shardings)"),),
        check="assert a is model and b is model",
    ),
    Case(
        "bound_method",
        1,
        "",
        "f = nnx_sharding.shard_map(\n"
        "    model.__call__, mesh=mesh, in_specs=(P('data'),), out_specs=P('data')\n)",
        "class Model(nnx.Module):\n"
        "    def __init__(self):\n"
        "        self.linear = model\n"
        "\n"
        "    @nnx_sharding.shard_map(mesh=mesh, in_specs=(P(), P('data')), out_specs=P('data'))\n"
        "    def __call__(self, x):\n"
        "        return self.linear(x)\n"
        "\n"
        "y = Model()(x)",
        ValueError,
        names=(("...", "mesh=mesh, in_specs=(P(), P('data')), out_specs=P('data')"),),
        check="close(y, expected)",
    ),
    Case(
        "bound_method",
        2,
        "",
        "f = nnx_sharding.shard_map(\n"
        "    model.__call__, mesh=mesh, in_specs=(P('data'),), out_specs=P('data')\n)",
        "f = nnx_sharding.shard_map(nnx.Linear.__call__, mesh=mesh, in_specs=(P(), P('data')), "
        "out_specs=P('data'))(model, x)",
        ValueError,
        names=(
            ("MyClass.method", "nnx.Linear.__call__"),
            ("...", "mesh=mesh, in_specs=(P(), P('data')), out_specs=P('data')"),
            ("instance, ...", "model, x"),
        ),
        check="close(f, expected)",
    ),
    # --- shard, metadata, tables ------------------------------------------------------------
    Case(
        "no_mesh",
        1,
        ANNOTATED,
        "nnx_sharding.shard(annotated, rules=[('embed', None), ('mlp', 'model')])",
        "nnx_sharding.shard(annotated, mesh, rules=[('embed', None), ('mlp', 'model')])",
        ValueError,
        names=(("shard(model, mesh)", "shard(annotated, mesh"),),
        id="shard",
        check="assert annotated.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "no_mesh",
        2,
        ANNOTATED,
        "nnx_sharding.shard(annotated, rules=[('embed', None), ('mlp', 'model')])",
        "with jax.set_mesh(mesh):\n"
        "    nnx_sharding.shard(annotated, rules=[('embed', None), ('mlp', 'model')])",
        ValueError,
        id="shard",
        check="assert annotated.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "spec_without_mesh",
        1,
        "shardings = tp",
        "nnx_sharding.shard(model, shardings)",
        "with jax.set_mesh(mesh):\n    nnx_sharding.shard(model, shardings)",
        ValueError,
        check="assert model.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "spec_without_mesh",
        2,
        "",
        "nnx_sharding.shard(model, StateSharding({nnx.Param: P('model')}))",
        "nnx_sharding.shard(model, StateSharding({nnx.Param: NamedSharding(mesh, P('model'))}))",
        ValueError,
        check="assert model.bias.get_value().sharding.spec == P('model')",
    ),
    Case(
        "rules_without_metadata",
        2,
        ANNOTATED + "rules = [('embed', None), ('mlp', 'model')]",
        "nnx_sharding.shard(annotated, tp, rules=rules)",
        "nnx_sharding.shard(annotated, mesh, rules=rules)",
        TypeError,
        names=(("model", "annotated"),),
        check="assert annotated.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "old_and_new_keyword",
        1,
        "with nnx.use_eager_sharding(False):\n"
        "    annotated = nnx.Linear(\n"
        "        16,\n"
        "        64,\n"
        "        kernel_init=nnx.with_partitioning(nnx.initializers.ones, (None, 'model')),\n"
        "        rngs=nnx.Rngs(0),\n"
        "    )\n",
        "nnx_sharding.shard(annotated, mesh, mesh=mesh)",
        "nnx_sharding.shard(annotated, shardings=mesh)",
        TypeError,
        names=(("model", "annotated"),),
        check="assert annotated.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "bad_placement",
        1,
        "",
        "nnx_sharding.shard(model, {nnx.PathContains('kernel'): P(None, 'model'), ...: P()})",
        "with jax.set_mesh(mesh):\n"
        "    nnx_sharding.shard(model, nnx_sharding.StateSharding("
        "{nnx.PathContains('kernel'): P(None, 'model'), ...: P()}))",
        TypeError,
        check="assert model.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "bad_placement",
        2,
        "with nnx.use_eager_sharding(False):\n"
        "    annotated = nnx.Linear(\n"
        "        16,\n"
        "        64,\n"
        "        kernel_init=nnx.with_partitioning(nnx.initializers.ones, (None, 'model')),\n"
        "        rngs=nnx.Rngs(0),\n"
        "    )\n",
        "nnx_sharding.shard(annotated, {'data': 2, 'model': 4})",
        "nnx_sharding.shard(annotated, mesh)",
        TypeError,
        names=(("model", "annotated"),),
        check="assert annotated.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "not_a_node",
        1,
        "",
        "with jax.set_mesh(mesh):\n    nnx_sharding.shard(model.kernel)",
        "with jax.set_mesh(mesh):\n    nnx_sharding.shard(model)",
        TypeError,
        names=(("shard(", "nnx_sharding.shard("),),
        id="shard",
        check="assert model.kernel.get_value().sharding.spec == P()",
    ),
    Case(
        "not_a_node",
        2,
        "",
        "StateSharding.from_metadata([model])",
        "shardings = StateSharding.from_metadata(nnx.state(model))",
        TypeError,
        id="from_metadata",
        check="assert len(shardings.filters) == 2",
    ),
    Case(
        "bad_rules",
        1,
        ANNOTATED,
        "nnx_sharding.shard(annotated, mesh, rules={'embed': None, 'mlp': 'model'})",
        "nnx_sharding.shard(annotated, mesh, rules=[('embed', None), ('mlp', 'model')])",
        TypeError,
        check="assert annotated.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "bad_rules",
        2,
        ANNOTATED,
        "nnx_sharding.shard(annotated, mesh, rules=[('embed', None), ('mlp', 'data', 'model')])",
        "nnx_sharding.shard(annotated, mesh, rules=[('embed', None), ('mlp', ('data', 'model'))])",
        TypeError,
        names=(("'batch'", "'mlp'"), ("'fsdp'", "'model'")),
        check="assert annotated.kernel.get_value().sharding.spec == P(None, ('data', 'model'))",
    ),
    Case(
        "unknown_logical_axes",
        2,
        "init = nnx.initializers.lecun_normal()\nrules = [('embed', None), ('mlp', 'model')]\n",
        "with nnx.use_eager_sharding(False):\n"
        "    annotated = nnx.Linear(\n"
        "        16, 64, kernel_init=nnx.with_partitioning(init, ('embed', 'hidden')), "
        "rngs=nnx.Rngs(0)\n    )\n"
        "nnx_sharding.shard(annotated, mesh, rules=rules)",
        "with nnx.use_eager_sharding(False):\n"
        "    annotated = nnx.Linear(\n"
        "        16, 64, kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')), "
        "rngs=nnx.Rngs(0)\n    )\n"
        "nnx_sharding.shard(annotated, mesh, rules=rules)",
        ValueError,
        check="assert annotated.kernel.get_value().sharding.spec == P(None, 'model')",
    ),
    Case(
        "unknown_mesh_axes",
        2,
        ANNOTATED,
        "nnx_sharding.shard(annotated, mesh, rules=[('embed', None), ('mlp', 'tensor')])",
        "mesh = jax.make_mesh((2, 4), ('data', 'tensor'))\n"
        "nnx_sharding.shard(annotated, mesh, rules=[('embed', None), ('mlp', 'tensor')])",
        ValueError,
        check="assert annotated.kernel.get_value().sharding.spec == P(None, 'tensor')",
    ),
    Case(
        "unknown_paths",
        2,
        "class Stack(nnx.Module):\n"
        "    def __init__(self):\n"
        "        self.layers = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(0))])\n"
        "stack = Stack()\n"
        "import io\nfrom rich.console import Console\n"
        "console = Console(file=io.StringIO(), width=120)\n",
        "nnx_sharding.visualize_sharding(stack, ['layers.0.kernel'], console=console)",
        "nnx_sharding.visualize_sharding(stack, [('layers', 0, 'kernel')], console=console)",
        ValueError,
        check="assert 'layers[0].kernel' in console.file.getvalue()",
    ),
    Case(
        "not_drawable",
        2,
        ANNOTATED + "import io\nfrom rich.console import Console\n"
        "console = Console(file=io.StringIO(), width=120)\n"
        "with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nnx.logical_axis_rules(\n"
        "    [('embed', None), ('mlp', 'model')]\n"
        "):\n"
        "    abstract = nnx.eval_shape(lambda: nnx.Linear(16, 64, kernel_init="
        "nnx.with_partitioning(init, ('embed', 'mlp')), rngs=nnx.Rngs(0)))\n",
        "nnx_sharding.visualize_sharding(abstract, ['.kernel'], console=console)",
        "with jax.set_mesh(mesh):\n"
        "    nnx_sharding.visualize_sharding(abstract, ['.kernel'], console=console)",
        ValueError,
        check="assert '.kernel' in console.file.getvalue()",
    ),
    # --- AOT reports and export -------------------------------------------------------------
    Case(
        "aot_unknown_config",
        1,
        "from nnx_sharding._cli.aot import aot_report",
        "aot_report('1B', {'data': 2, 'model': 4})",
        aot_command("python -m nnx_sharding aot --config tiny"),
        ValueError,
        check=AOT_CHECK.format(config="tiny", mesh="data=2,model=4 (8 devices)"),
    ),
    Case(
        "aot_mesh_too_big",
        1,
        "from nnx_sharding._cli.aot import aot_report",
        "aot_report('tiny', {'data': 4, 'model': 4})",
        aot_command("python -m nnx_sharding aot --config tiny --devices 16 --mesh data=4,model=4"),
        ValueError,
        names=(("NAME", "tiny"),),
        check=AOT_CHECK.format(config="tiny", mesh="data=4,model=4 (16 devices)"),
    ),
    Case(
        "aot_mesh_too_big",
        2,
        "from nnx_sharding._cli.aot import aot_report",
        "aot_report('tiny', {'data': 4, 'model': 4})",
        aot_command("python -m nnx_sharding aot --config tiny"),
        ValueError,
        names=(("NAME", "tiny"),),
        check=AOT_CHECK.format(config="tiny", mesh="data=2,model=4 (8 devices)"),
    ),
    Case(
        "aot_indivisible",
        1,
        "from nnx_sharding._cli.aot import aot_report",
        "aot_report('tiny', {'model': 8})",
        aot_command("python -m nnx_sharding aot --config tiny --mesh data=2,model=4"),
        ValueError,
        names=(("NAME", "tiny"),),
        check=AOT_CHECK.format(config="tiny", mesh="data=2,model=4 (8 devices)"),
    ),
    Case(
        "export_spec_without_mesh",
        1,
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(None, P('data')))",
        "nnx_sharding.export(forward, model, x)",
        "with jax.set_mesh(mesh):\n    exported = nnx_sharding.export(forward, model, x)",
        ValueError,
        check="y, _ = exported.call(model, x)\nclose(y, expected)",
    ),
    Case(
        "export_spec_without_mesh",
        2,
        "forward = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(None, P('data')))",
        "nnx_sharding.export(forward, model, x)",
        "forward = nnx_sharding.jit(\n"
        "    lambda m, x: m(x), in_shardings=(None, NamedSharding(mesh, P('data')))\n)\n"
        "exported = nnx_sharding.export(forward, model, x)",
        ValueError,
        check="y, _ = exported.call(model, x)\nclose(y, expected)",
    ),
    Case(
        "export_structure_mismatch",
        1,
        "exported = nnx_sharding.export(lambda m, x: m(x), model, x)",
        "exported.call(model)",
        "y, _ = exported.call(nnx.state(model), x)",
        TypeError,
        names=(("call(", "exported.call("),),
        check="close(y, expected)",
    ),
    Case(
        "export_structure_mismatch",
        2,
        "exported = nnx_sharding.export(lambda m, x: m(x), model, x)\n"
        "arrays = jax.tree.leaves((nnx.state(model), x))",
        "exported.call(arrays)",
        "args, kwargs = jax.tree.unflatten(exported.in_tree, arrays)\n"
        "y, _ = exported.call(*args, **kwargs)",
        TypeError,
        check="close(y, expected)",
    ),
    Case(
        "export_not_arrays",
        1,
        "def scaled(model, x, n):\n    return model(x) * n\n",
        "nnx_sharding.export(scaled, model, x, 'two')",
        "exported = nnx_sharding.export(\n"
        "    nnx_sharding.jit(scaled, static_argnums=2), model, x, 2\n)",
        TypeError,
        names=(("fun", "scaled"), ("...", "2")),
        check="y, _ = exported.call(model, x)\nclose(y, 2 * expected)",
    ),
    Case(
        "export_variable_argument",
        1,
        "v = nnx.Param(jnp.ones(3))\n",
        "nnx_sharding.export(lambda v, x: v[...] * x, v, 2.0)",
        "exported = nnx_sharding.export(lambda d, x: d['w'][...] * x, nnx.Dict(w=v), 2.0)",
        TypeError,
        check="y, _ = exported.call(nnx.state(nnx.Dict(w=v)), 2.0)\nclose(y, 2.0 * v[...])",
    ),
    Case(
        "export_variable_argument",
        2,
        "v = nnx.Param(jnp.ones(3))\n",
        "nnx_sharding.export(lambda v, x: v[...] * x, v, 2.0)",
        "exported = nnx_sharding.export(lambda w, x: w * x, v[...], 2.0)",
        TypeError,
        check="y, _ = exported.call(v[...], 2.0)\nclose(y, 2.0 * v[...])",
    ),
    Case(
        "export_too_few_devices",
        1,
        "import jax\n\njax.config.update('jax_num_cpu_devices', 8)\n"
        "from jax.sharding import NamedSharding, PartitionSpec as P\n"
        "mesh = jax.make_mesh((8,), ('data',))\n"
        "model = nnx.Linear(16, 64, rngs=nnx.Rngs(0))\n"
        "x = jnp.ones((8, 16))\n"
        "forward = nnx_sharding.jit(\n"
        "    lambda m, x: m(x), in_shardings=(None, NamedSharding(mesh, P('data')))\n)\n"
        "open('program.bin', 'wb').write(nnx_sharding.export(forward, model, x).serialize())\n",
        "import jax\n\n"
        "exported = nnx_sharding.deserialize(open('program.bin', 'rb').read())\n"
        "exported.call(nnx.state(nnx.Linear(16, 64, rngs=nnx.Rngs(0))), jnp.ones((8, 16)))",
        "import jax\n\njax.config.update('jax_num_cpu_devices', 8)\n"
        "exported = nnx_sharding.deserialize(open('program.bin', 'rb').read())\n"
        "y, _ = exported.call(nnx.state(nnx.Linear(16, 64, rngs=nnx.Rngs(0))), "
        "jnp.ones((8, 16)))",
        ValueError,
        fresh=True,
        check="assert y.shape == (8, 64)",
    ),
    # --- nnx.cached_partial over jit ----------------------------------------------------------
    Case(
        "cached_partial_arrays",
        1,
        "model.offset = jnp.ones(64)\nstep = nnx_sharding.jit(lambda m, x: m(x) + m.offset)",
        "nnx.cached_partial(step, model)(x)",
        "model.offset = nnx.Variable(model.offset)\ny = nnx.cached_partial(step, model)(x)",
        TypeError,
        check="close(y, expected + 1)",
    ),
    Case(
        "cached_partial_arrays",
        2,
        "model.offset = jnp.ones(64)\nstep = nnx_sharding.jit(lambda m, x: m(x) + m.offset)",
        "nnx.cached_partial(step, model)(x)",
        "y = step(model, x)",
        TypeError,
        check="close(y, expected + 1)",
    ),
    # --- jit_partial --------------------------------------------------------------------------
    Case(
        "partial_output_aliases",
        1,
        "model.count = nnx.BatchStat(jnp.array(0))\n"
        "def f(model, x):\n    model.count[...] += 1\n    return model(x), model.count\n",
        "nnx_sharding.jit_partial(f, model)(x)",
        "def f(model, x):\n    model.count[...] += 1\n    return model(x), model.count[...]\n"
        "y, count = nnx_sharding.jit_partial(f, model)(x)",
        ValueError,
        check="close(y, expected)\nassert int(count) == 1 and int(model.count[...]) == 1",
    ),
    Case(
        "partial_metadata_changed",
        2,
        "def f(model, x):\n    model.kernel.set_metadata('tag', 1)\n    return model(x)\n",
        "nnx_sharding.jit_partial(f, model, graph_updates=False)(x)",
        "y = nnx_sharding.jit(f, graph_updates=False)(model, x)",
        ValueError,
        check="close(y, expected)\nassert model.kernel.get_metadata()['tag'] == 1",
    ),
    Case(
        "partial_runtime_variable",
        1,
        "count = nnx.BatchStat(jnp.array(0))\n"
        "def f(model, count, x):\n    count[...] += 1\n    return model(x)\n",
        "nnx_sharding.jit_partial(f, model)(count, x)",
        "step = nnx_sharding.jit_partial(f, model, count)\ny = step(x)\ny = step(x)",
        ValueError,
        names=(("jit_partial(", "nnx_sharding.jit_partial("), ("other, ...", "count")),
        check="close(y, expected)\nassert int(count[...]) == 2",
    ),
    Case(
        "partial_unsupported_variable",
        1,
        "model.scale = nnx.Param(jnp.array(1.0), ref=True)\n"
        "def f(model, x):\n    model.scale[...] += 1.0\n    return model(x) * model.scale[...]\n",
        "nnx_sharding.jit_partial(f, model)",
        "y = nnx_sharding.jit(f, graph_updates=False)(model, x)",
        ValueError,
        id="ref",
        check="close(y, 2 * expected)\nassert float(model.scale[...]) == 2.0",
    ),
    Case(
        "partial_unsupported_variable",
        1,
        "model.scale = nnx.Param(jnp.array(1.0), hijax=True)\n"
        "def f(model, x):\n    model.scale[...] += 1.0\n    return model(x) * model.scale[...]\n",
        "nnx_sharding.jit_partial(f, model)",
        "y = nnx_sharding.jit(f, graph_updates=False)(model, x)",
        ValueError,
        id="hijax",
        check="close(y, 2 * expected)\nassert float(model.scale[...]) == 2.0",
    ),
    Case(
        "partial_static",
        2,
        "def scaled(model, n, x):\n"
        "    assert isinstance(n, int)  # static: a Python int, not a tracer\n"
        "    return model(x) * n\n",
        "nnx_sharding.jit_partial(scaled, model, static_argnums=0)",
        "y = nnx_sharding.jit_partial(scaled, model, static_argnums=1)(3, x)",
        ValueError,
        id="argnums",
        snippets=(0,),
        check="close(y, 3 * expected)",
    ),
    Case(
        "partial_static",
        2,
        "def scaled(model, n, x):\n"
        "    assert isinstance(n, int)  # static: a Python int, not a tracer\n"
        "    return model(x) * n\n",
        "nnx_sharding.jit_partial(scaled, model, static_argnums=0)",
        "y = nnx_sharding.jit_partial(scaled, model, static_argnames='n')(n=3, x=x)",
        ValueError,
        id="argnames",
        snippets=(1,),
        check="close(y, 3 * expected)",
    ),
    # --- the simple path (graph=False) -------------------------------------------------------
    Case(
        "bound_method_simple",
        2,
        "",
        "nnx_sharding.jit(model.__call__, graph=False)",
        "y = nnx_sharding.jit(nnx.Linear.__call__, graph=False)(model, x)",
        ValueError,
        names=(
            ("MyClass.method", "nnx.Linear.__call__"),
            ("...", "graph=False"),
            ("instance, ...", "model, x"),
        ),
        check="close(y, expected)",
    ),
    Case(
        "duplicate_variable",
        2,
        "both = nnx_sharding.jit(lambda a, b: a(x) + b(x), graph=False)",
        "both(model, model)",
        "y = both(model, nnx.clone(model))",
        ValueError,
        names=(("...", "model"),),
        check="close(y, 2 * expected)",
    ),
    Case(
        "captured_variable_returned",
        2,
        "v = nnx.Param(jnp.ones(3))",
        "nnx_sharding.jit(lambda s: v, graph=False)(2.0)",
        "y = nnx_sharding.jit(lambda s: v[...] * s, graph=False)(2.0)",
        ValueError,
        check="close(y, 2.0 * jnp.ones(3))",
    ),
    # --- checkpoints (tested with checkpoints in tests/checkpoint; the cheap fixes here) -----
    Case(
        "empty_checkpoint_path",
        1,
        "from nnx_sharding import checkpoint",
        "checkpoint.save('', model)",
        "checkpoint.save('checkpoints/run1', model)",
        ValueError,
        check="restored = checkpoint.restore('checkpoints/run1', nnx.clone(model))\n"
        "close(restored(x), expected)",
    ),
    Case(
        "manager_on_checkpoint",
        1,
        "from nnx_sharding import checkpoint\ncheckpoint.save('saved', model)",
        "checkpoint.Manager('saved')",
        "restored = checkpoint.restore('saved', nnx.clone(model))",
        ValueError,
        names=(("directory", "'saved'"), ("target", "nnx.clone(model)")),
        check="close(restored(x), expected)",
    ),
    Case(
        "foreign_checkpoint",
        1,
        "from nnx_sharding import checkpoint\n"
        "manager = checkpoint.Manager('run')\nmanager.save(1, model)\nmanager.close()",
        "checkpoint.restore('run', nnx.clone(model))",
        "restored = checkpoint.Manager('run').restore(nnx.clone(model))",
        ValueError,
        names=(("directory", "'run'"), ("target", "nnx.clone(model)")),
        snippets=(0,),
        check="close(restored(x), expected)",
    ),
    # --- the planner: accelerators, devices -------------------------------------------------
    Case(
        "accelerator_bad_kind",
        1,
        "import dataclasses",
        "dataclasses.replace(nnx_sharding.plan.PRESETS['h100'], name='mine', kind='GPU')",
        "mine = dataclasses.replace(nnx_sharding.plan.PRESETS['h100'], name='mine', kind='gpu')",
        ValueError,
        check="assert mine.kind == 'gpu'",
    ),
    Case(
        "accelerator_no_flops",
        1,
        "import dataclasses",
        "dataclasses.replace(nnx_sharding.plan.PRESETS['h100'], name='mine', flops={})",
        "mine = dataclasses.replace(\n"
        "    nnx_sharding.plan.PRESETS['h100'], name='mine', flops={'bfloat16': 989e12}\n)",
        ValueError,
        check="assert mine.peak_flops('bfloat16') == 989e12",
    ),
    Case(
        "accelerator_bad_figures",
        2,
        "import dataclasses",
        "dataclasses.replace(nnx_sharding.plan.PRESETS['h100'], name='mine', hbm_bytes=0)",
        "mine = dataclasses.replace(nnx_sharding.plan.PRESETS['h100'], name='mine', "
        "hbm_bytes=40 * 10**9)",
        ValueError,
        names=(("hbm_bytes=...", "hbm_bytes=40 * 10**9"),),
        check="assert mine.hbm_bytes == 40 * 10**9",
    ),
    Case(
        "accelerator_read_only_flops",
        1,
        "import dataclasses",
        "nnx_sharding.plan.PRESETS['h100'].flops['bfloat16'] = 1e15",
        "mine = dataclasses.replace(nnx_sharding.plan.PRESETS['h100'], flops={'bfloat16': 1e15})",
        TypeError,
        names=(
            ("accelerator", "nnx_sharding.plan.PRESETS['h100']"),
            ("{...}", "{'bfloat16': 1e15}"),
        ),
        check="assert mine.peak_flops('bfloat16') == 1e15\n"
        "assert nnx_sharding.plan.PRESETS['h100'].peak_flops('bfloat16') != 1e15",
    ),
    Case(
        "plan_unknown_accelerator",
        2,
        PLANNER + "import dataclasses",
        "nnx_sharding.plan(forward, model, x, devices=2, accelerator='mi300', layouts=['dp'])",
        "mine = dataclasses.replace(nnx_sharding.plan.PRESETS['h100'], name='mine', "
        "hbm_bytes=192 * 2**30)\n"
        "plans = nnx_sharding.plan(forward, model, x, devices=2, accelerator=mine, layouts=['dp'])",
        ValueError,
        names=(("hbm_bytes=...", "hbm_bytes=192 * 2**30"),),
        check="assert plans.best.accelerator == 'mine'",
    ),
    Case(
        "plan_bad_accelerator_type",
        1,
        PLANNER,
        "nnx_sharding.plan(forward, model, x, devices=2, accelerator=None, layouts=['dp'])",
        "plans = nnx_sharding.plan(\n"
        "    forward, model, x, devices=2, accelerator='h100', layouts=['dp']\n)",
        TypeError,
        check="assert plans.best.accelerator == 'h100'",
    ),
    Case(
        "plan_too_few_cpu_devices",
        1,
        "",
        "model = nnx.Linear(16, 64, rngs=nnx.Rngs(0))\n"
        "nnx_sharding.plan(lambda m, x: m(x), model, jnp.ones((8, 16)), devices=2)",
        "import jax\n\njax.config.update('jax_num_cpu_devices', 2)\n"
        "model = nnx.Linear(16, 64, rngs=nnx.Rngs(0))\n"
        "plans = nnx_sharding.plan(lambda m, x: m(x), model, jnp.ones((8, 16)), devices=2)",
        ValueError,
        fresh=True,
        snippets=(1,),
        check="assert plans.best.devices == 2",
    ),
    # --- the planner: its cost model ----------------------------------------------------------
    Case(
        "plan_bad_memory_limit",
        1,
        PLANNER,
        "nnx_sharding.plan(forward, model, x, devices=2, memory_limit='80 parsecs')",
        "plans = nnx_sharding.plan(forward, model, x, devices=2, memory_limit='80GiB')",
        ValueError,
        check="assert plans.limit == 80 * 2**30 and plans.best.fits",
    ),
    Case(
        "plan_nothing_measured",
        1,
        PLANNER + "plans = nnx_sharding.plan(forward, model, x, devices=2, layouts=['dp'])",
        "plans.calibrate()",
        "plans.measure()\nfitted = plans.calibrate()",
        ValueError,
        check="assert plans.best.measured > 0 and fitted.matmul_efficiency > 0",
    ),
    # --- the planner: layouts, knobs, builders ------------------------------------------------
    Case(
        "plan_bad_layout_spec",
        1,
        PLANNER,
        "nnx_sharding.plan(forward, model, x, devices=2, layouts=[('fsdp', 2)])",
        "plans = nnx_sharding.plan(forward, model, x, devices=2, layouts=['fsdp'])",
        ValueError,
        check="assert [p.layout for p in plans] == ['fsdp']",
    ),
    Case(
        "plan_unknown_layouts",
        1,
        PLANNER,
        "nnx_sharding.plan(forward, model, x, devices=2, layouts=['ddp'])",
        "plans = nnx_sharding.plan(forward, model, x, devices=2, layouts=['dp', 'fsdp'])",
        ValueError,
        check="assert sorted(p.layout for p in plans) == ['dp', 'fsdp']",
    ),
    Case(
        "plan_bad_candidate",
        1,
        PLANNER,
        "nnx_sharding.plan(forward, model, x, devices=2, layouts=[('dp', {'data': 4})])",
        "plans = nnx_sharding.plan(forward, model, x, devices=2, layouts=[('dp', {'data': 2})])",
        ValueError,
        check="assert plans.best.mesh_shape == {'data': 2}",
    ),
    Case(
        "search_bad_space",
        1,
        PLANNER,
        "nnx_sharding.plan.search(build, ['remat', 'microbatches'], devices=2, layouts=['dp'])",
        "plans = nnx_sharding.plan.search(\n"
        "    build,\n"
        "    space={'remat': ['none', 'full'], 'microbatches': [1, 2]},\n"
        "    devices=2,\n"
        "    layouts=['dp'],\n"
        ")",
        ValueError,
        check="assert len(plans) == 4",
    ),
    Case(
        "search_bad_knob_values",
        1,
        PLANNER,
        "nnx_sharding.plan.search(build, {'remat': 'full'}, devices=2, layouts=['dp'])",
        "plans = nnx_sharding.plan.search(build, space={'remat': ['full']}, devices=2, "
        "layouts=['dp'])",
        ValueError,
        check="assert plans.best.knobs == {'remat': 'full'}",
    ),
    Case(
        "search_bad_microbatches",
        1,
        PLANNER,
        "nnx_sharding.plan.search(build, {'microbatches': [3]}, devices=2, layouts=['dp'])",
        "plans = nnx_sharding.plan.search(\n"
        "    build, space={'microbatches': [2]}, devices=2, layouts=['dp']\n)",
        ValueError,
        check="assert plans.best.knobs == {'microbatches': 2}",
    ),
    Case(
        "search_bad_knob_value",
        1,
        PLANNER + "build.choices = {'remat': ['none', 'full']}",
        "nnx_sharding.plan.search(build, {'remat': ['dots']}, devices=2, layouts=['dp'])",
        "plans = nnx_sharding.plan.search(\n"
        "    build, space={'remat': ['none', 'full']}, devices=2, layouts=['dp']\n)",
        ValueError,
        check="assert sorted(p.knobs['remat'] for p in plans) == ['full', 'none']",
    ),
    Case(
        "search_bad_built",
        1,
        PLANNER,
        "nnx_sharding.plan.search(lambda knobs: loss, devices=2, layouts=['dp'])",
        "def build(knobs):\n"
        "    return nnx_sharding.plan.Built(loss, (model, x))\n"
        "plans = nnx_sharding.plan.search(build, devices=2, layouts=['dp'])",
        TypeError,
        names=(("step", "loss"),),
        check="assert plans.best.compiled",
    ),
    Case(
        "search_unread_knobs",
        1,
        PLANNER,
        "nnx_sharding.plan.search(build, {'dtype': ['bfloat16']}, devices=2, layouts=['dp'])",
        "default = 'float32'\n"
        "def build_typed(knobs):\n"
        "    dtype = knobs.get('dtype', default)\n"
        "    return nnx_sharding.plan.Built(loss, (model, x.astype(dtype)))\n"
        "plans = nnx_sharding.plan.search(\n"
        "    build_typed, {'dtype': ['bfloat16']}, devices=2, layouts=['dp']\n)",
        ValueError,
        check="assert plans.best.knobs == {'dtype': 'bfloat16'}",
    ),
    # --- the planner: Plan, Plans -------------------------------------------------------------
    Case(
        "plan_mesh_too_few_devices",
        1,
        PLANNER + "plans = nnx_sharding.plan(forward, model, x, devices=2, layouts=['dp'])",
        "plans.best.mesh(jax.devices()[:1])",
        "mesh = plans.best.mesh(jax.devices()[:2])",
        ValueError,
        names=(("plan.mesh", "plans.best.mesh"),),
        check="assert mesh.devices.size == 2",
    ),
    Case(
        "plan_no_tokens",
        1,
        PLANNER + "plans = nnx_sharding.plan(forward, model, x, devices=2, layouts=['dp'])",
        "plans.devices_for(1e9, 1.0, max_devices=8)",
        "sizing = plans.devices_for(1e9, 1.0, tokens_per_step=8, max_devices=8)",
        ValueError,
        names=(("tokens, days", "1e9, 1.0"), ("...", "8, max_devices=8")),
        check="assert sizing.devices in (2, 4, 8)",
    ),
    # --- the planner: the decoder -------------------------------------------------------------
    Case(
        "decoder_bad_choice",
        1,
        "import dataclasses",
        "dataclasses.replace(nnx_sharding.plan.DECODER_CONFIGS['tiny'], remat='dot')",
        "config = dataclasses.replace(nnx_sharding.plan.DECODER_CONFIGS['tiny'], remat='dots')",
        ValueError,
        check="built = nnx_sharding.plan.decoder_builder(config)({})\n"
        "assert built.args[2].shape == (8, 65)",
    ),
    Case(
        "decoder_bad_kv_heads",
        1,
        "import dataclasses",
        "dataclasses.replace(nnx_sharding.plan.DECODER_CONFIGS['tiny'], kv_heads=3)",
        "config = dataclasses.replace(nnx_sharding.plan.DECODER_CONFIGS['tiny'], kv_heads=2)",
        ValueError,
        check="assert config.kv == 2",
    ),
    Case(
        "decoder_vocab_tiles",
        1,
        "import dataclasses",
        "dataclasses.replace(nnx_sharding.plan.DECODER_CONFIGS['tiny'], vocab_tiles=5)",
        "config = dataclasses.replace(nnx_sharding.plan.DECODER_CONFIGS['tiny'], vocab_tiles=4)",
        ValueError,
        check="assert config.vocab_tiles == 4",
    ),
    Case(
        "decoder_unknown_knobs",
        1,
        "build = nnx_sharding.plan.decoder_builder(nnx_sharding.plan.DECODER_CONFIGS['tiny'])",
        "build({'remat': 'dots', 'pipeline': 2})",
        "built = build(\n"
        "    {'remat': 'none', 'microbatches': 1, 'pipeline_microbatches': None,"
        " 'pipeline_repeats': 1, 'context_strategy': 'all_gather'}\n"
        ")",
        ValueError,
        check="assert built.args[2].shape == (8, 65)",
    ),
    Case(
        "microbatches_indivisible",
        1,
        "def loss(m, x):\n    return jnp.mean(m(x) ** 2)\n",
        "nnx_sharding.plan.accumulate_gradients(loss, model, x, 3)",
        "value, grads = nnx_sharding.plan.accumulate_gradients(loss, model, x, microbatches=2)",
        ValueError,
        check="close(value, jnp.mean(expected**2))",
    ),
    Case(
        "pipeline_too_few_microbatches",
        1,
        PIPELINE,
        "with jax.set_mesh(stage_mesh):\n"
        "    nnx_sharding.pipeline(block, microbatches=2)(stack, x)",
        "with jax.set_mesh(stage_mesh):\n"
        "    y = nnx_sharding.pipeline(block, microbatches=4)(stack, x)",
        ValueError,
        check="close(y, reference)",
    ),
    Case(
        "pipeline_no_axis",
        1,
        PIPELINE,
        "with jax.set_mesh(stage_mesh):\n"
        "    nnx_sharding.pipeline(block, microbatches=4, axis='pipe')(stack, x)",
        "with jax.set_mesh(stage_mesh):\n"
        "    y = nnx_sharding.pipeline(block, microbatches=4, axis='stage')(stack, x)",
        ValueError,
        check="close(y, reference)",
    ),
    # --- MoE ----------------------------------------------------------------------------------
    Case(
        "context_ulysses_heads",
        1,
        CONTEXT,
        "with jax.set_mesh(cmesh):\n    out = attend(q, kv, kv, context_strategy='ulysses')",
        "with jax.set_mesh(cmesh):\n    out = attend(q, kv, kv, context_strategy='all_gather')",
        ValueError,
        check="assert out.shape == q.shape",
    ),
    Case(
        "context_bad_seq",
        1,
        CONTEXT,
        "with jax.set_mesh(cmesh):\n    out = attend(q[:, :60], kv[:, :60], kv[:, :60])",
        "seq_len=64\nwith jax.set_mesh(cmesh):\n"
        "    out = attend(q[:, :seq_len], kv[:, :seq_len], kv[:, :seq_len])",
        ValueError,
        check="assert out.shape == q.shape",
    ),
    Case(
        "moe_bad_k",
        1,
        MOE,
        "nnx_sharding.MoE(8, k=9, **sizes)",
        "k = 9\nlayer = nnx_sharding.MoE(8, k=min(k, 8), **sizes)",
        ValueError,
        check="assert layer(x)[0].shape == x.shape",
    ),
    Case(
        "moe_bad_capacity",
        1,
        MOE,
        "nnx_sharding.MoE(8, k=2, capacity_factor=0.01, **sizes)(x)",
        "y, loss = nnx_sharding.MoE(8, k=2, capacity_factor=1.25, **sizes)(x)",
        ValueError,
        check="assert y.shape == x.shape",
    ),
    Case(
        "moe_bad_input",
        1,
        MOE,
        "x = jnp.ones((5, 8))\nlayer = nnx_sharding.MoE(8, k=2, **sizes)\nlayer(x)",
        "x = jnp.ones((5, 8))\nlayer = nnx_sharding.MoE(8, k=2, **sizes)\n"
        "y, loss = layer(x[:, None, :])\ny = y[:, 0]",
        ValueError,
        check="assert y.shape == x.shape",
    ),
    Case(
        "moe_bad_grouped",
        1,
        MOE,
        "nnx_sharding.MoE(8, k=2, grouped='sparse', **sizes)",
        "y, loss = nnx_sharding.MoE(8, k=2, grouped='ragged', **sizes)(x)",
        ValueError,
        check="assert y.shape == x.shape",
    ),
]

# Message builders whose fixes have no code to run (or only name an option or a value
# the message states), and helpers that build parts of other messages.
PROSE = {
    # pipeline: fixes that name a value to choose, or how to build the stack
    "pipeline_bad_stack",
    "pipeline_changes_shape",
    "pipeline_layers_indivisible",
    "pipeline_microbatches_indivisible",
    "pipeline_mutates_stack",
    "moe_experts_indivisible",  # names the axis sizes that divide the experts
    "static_graph_node",  # drop it from static_argnums
    "wrong_trace_level",  # use nnx.jit for the outer transform
    "state_sharding_at_leaf",
    "aliased_shardings",
    "bad_static",
    "bad_shardings",
    "argnums_out_of_range",
    "unknown_argnames",
    "static_and_donated",
    "structure_mismatch",
    "structure_changed",
    "cannot_place",
    "export_bad_key",
    "export_bad_arguments",
    "partial_aliases",  # pass graph=True, or nnx.clone the shared part
    # the simple path: tested against flax in tests/parity/; their fixes switch modes
    # (graph=True, graph_updates=True) or remake an nnx.prefix
    "state_sharding_simple",
    "variable_in_prefix",
    "node_in_prefix_graph",
    "graph_prefix_in_tree_mode",
    "node_prefix_mismatch",
    "aliased_prefixes_simple",
    # checkpoints: tested with checkpoints (tests/checkpoint/); their fixes name an option
    # (force=True, allow_type_change=True, filter=...), a command or a step to take
    "not_savable",
    "checkpoint_exists",
    "overwrite_foreign",
    "checkpoint_not_found",
    "incomplete_checkpoint",
    "no_steps",
    "unknown_step",
    "bad_step",
    "bad_restore_filter",
    "checkpoint_mismatch",
    "abstract_not_restored",
    "unplaceable",
    "no_mesh_for_restore",
    "mixed_target",
    "selects_nothing",
    "manager_not_a_directory",
    "manager_foreign",
    "write_failed",
    "variable_types_differ",
    "damaged_checkpoint",
    # the planner: a TPU or a compiler to install, an option's value, or prose
    "plan_bad_topology",  # a TPU topology: needs the TPU compiler
    "plan_no_tpu_compiler",  # installs libtpu
    "plan_bad_tpu_topology",
    "plan_bad_devices",  # devices=8, num_slices=1
    "compiler_no_libtpu",  # pip install 'jax[tpu]'
    "plan_bad_device_count",  # devices=8
    "search_builder_failed",  # the builder's own fixes, or prose
    "search_bad_prune",  # prune=True
    "plan_jit_no_step",  # a Plan made by hand
    "plan_nothing_fits",  # more devices, more memory (devices=..., memory_limit)
    "plan_nothing_fits_state",
    "plan_no_candidate_built",
    "plan_needs_matplotlib",  # pip install
    "plan_target_unreachable",  # more days, max_devices=...
    "plan_cannot_replan",
    "decoder_bad_size",  # layers=2
    # parts of other messages
    "bad_state_sharding_spec",
    "prefix_mismatch",
    "rank_too_low",
    "misfit",
    "argument_structure",
    "compiled_difference",
    "graph_change",
    "unknown_axis",
    "name_spec_paths",
    "name_leaves",
    "export_wrong_kind",
    "mismatch_detail",
    "not_a_node_problem",
    "bare_variable_problem",
    "no_variables_problem",
    "array_outside_variable_problem",
    "value_problem",
    "describe_variable",
    "type_detail",
    "node_prefix_difference",
}

SNIPPET = re.compile(r"`([^`]+)`")


def fix_lines(message: str) -> dict[int, str]:
    """The numbered fixes of a message: ``{1: "...", 2: "..."}``."""
    _, _, fixes = message.partition("\nFixes:\n")
    found = [re.match(r"  (\d+)\. (.*)", line) for line in fixes.splitlines()]
    return {int(m.group(1)): m.group(2) for m in found if m}


def fix_code(case: Case, message: str) -> list[str]:
    """The code of the case's fix as printed, the user's names put in."""
    fixes = fix_lines(message)
    assert case.fix in fixes, message
    snippets = SNIPPET.findall(fixes[case.fix]) or [fixes[case.fix].partition(" ")[2]]
    if case.snippets is not None:
        snippets = [snippets[i] for i in case.snippets]
    code = []
    for snippet in snippets:
        for printed, user in case.names:
            snippet = snippet.replace(printed, user, 1)
        code.append(snippet)
    return code


def run_fresh(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS")
    }
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_suggested_fix_works(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if "nnx.prefix" in case.fixed and not hasattr(nnx, "prefix"):
        pytest.skip("nnx.prefix is new in flax 0.12.8")
    monkeypatch.chdir(tmp_path)
    if case.fresh:
        if case.builder == "export_too_few_devices":  # the program is made with 8 devices
            made = run_fresh(FRESH_PRELUDE + case.setup, tmp_path)
            assert made.returncode == 0, made.stderr
            setup = ""
        else:
            setup = case.setup
        broken = run_fresh(FRESH_PRELUDE + setup + "\n" + case.broken, tmp_path)
        assert broken.returncode != 0
        message = broken.stderr.partition(f"{case.error.__name__}: ")[2]
        assert message, broken.stderr
    else:
        namespace: dict[str, object] = {"__name__": "__main__"}
        exec(PRELUDE + case.setup, namespace)
        with pytest.raises(case.error) as raised:
            exec(textwrap.dedent(case.broken), namespace)
        message = str(raised.value)
    for code in fix_code(case, message):
        assert code in case.fixed, f"the fix as printed, {code!r}, is not what the test runs"
    if case.fresh:
        done = run_fresh(FRESH_PRELUDE + setup + "\n" + case.fixed + "\n" + case.check, tmp_path)
        assert done.returncode == 0, done.stderr
    else:
        exec(case.fixed, namespace)
        exec(case.check, namespace)


def _builders(module: object) -> set[str]:
    return {
        name
        for name, f in vars(module).items()
        if inspect.isfunction(f) and not name.startswith("_") and f.__module__ == module.__name__
    }


MODULES = [
    importlib.import_module(f"nnx_sharding._errors.{found.name}")
    for found in pkgutil.iter_modules(nnx_sharding._errors.__path__)
    if found.name != "layout"
]
"""Every module of message builders (`layout` holds what they are made of)."""


def test_every_message_is_classified() -> None:
    """A new message builder must get a case (its fixes have code) or join PROSE."""
    assert len(MODULES) >= 12, [m.__name__ for m in MODULES]
    builders = set().union(*map(_builders, MODULES))
    tested = {case.builder for case in CASES}
    assert builders - tested - PROSE == set()
    assert tested & PROSE == set()
    assert (tested | PROSE) - builders == set()


def test_no_call_site_raises_a_layout_piece() -> None:
    """`layout`'s functions build parts of the builders' messages: the package raises
    the builders, never those pieces, so that leaving `layout` out classifies all."""
    pieces = _builders(layout)
    used = set()
    for path in (ROOT / "nnx_sharding").rglob("*.py"):
        if path.parent.name != "_errors":
            used |= set(re.findall(r"_errors\.(\w+)", path.read_text()))
    assert used & pieces == set()
