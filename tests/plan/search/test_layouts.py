"""Hybrid layouts (``dp+fsdp``, ``dp+fsdp+tp``) on every split, exact candidates
``(name, {axis: size})``, the device order (innermost axes inside a node), and the
compilers' log lines kept off the terminal."""

from __future__ import annotations

import dataclasses
import math
import os
import threading

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding.plan import LAYOUTS, PRESETS
from nnx_sharding.plan._hardware.devices import has_gpu_compiler, has_tpu_compiler, order_devices
from nnx_sharding.plan._hardware.stderr import capturing, offset, since
from nnx_sharding.plan._search.layouts import candidates, splits


def sgd_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def abstract_mlp():
    def build():
        model = nnx.Sequential(
            nnx.Linear(64, 256, use_bias=False, rngs=nnx.Rngs(0)),
            nnx.relu,
            nnx.Linear(256, 64, use_bias=False, rngs=nnx.Rngs(1)),
        )
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(build)


def test_hybrid_layouts_are_tried_on_every_split_with_each_axis_at_least_2():
    for n in (8, 64, 512):
        both = [c.mesh_shape for c in candidates(n, ["dp+fsdp"])]
        three = [c.mesh_shape for c in candidates(n, ["dp+fsdp+tp"])]
        assert all(list(s) == ["data", "fsdp"] for s in both)
        assert all(list(s) == ["data", "fsdp", "model"] for s in three)
        for shapes in (both, three):
            assert all(math.prod(s.values()) == n and min(s.values()) >= 2 for s in shapes)
            assert len({tuple(s.values()) for s in shapes}) == len(shapes)
        k = round(math.log2(n))  # n = 2**k: compositions of k into 2 and 3 parts
        assert (len(both), len(three)) == (k - 1, (k - 1) * (k - 2) // 2)
    assert splits(12, 3) == [(3, 2, 2), (2, 3, 2), (2, 2, 3)]


def test_an_exact_candidate_is_the_only_one_planned():
    model, optimizer = abstract_mlp()
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    layouts = [("dp+fsdp+tp", {"model": 2, "fsdp": 2, "data": 2}), ("fsdp", {"fsdp": 8})]
    plans = nnx_sharding.plan(sgd_step, model, optimizer, x, devices=8, layouts=layouts)
    shapes = sorted((p.layout, tuple(p.mesh_shape.items())) for p in plans)
    assert shapes == [
        ("dp+fsdp+tp", (("data", 2), ("fsdp", 2), ("model", 2))),
        ("fsdp", (("fsdp", 8),)),
    ]
    assert all(p.compiled and p.fits for p in plans)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (("fsdp+tp", {"fsdp": 2, "model": 2}), "are not positive integers whose product is 8"),
        (("fsdp+tp", {"data": 4, "model": 2}), "'fsdp+tp' has the axes ['fsdp', 'model']"),
        (("fsdp+tp", {"fsdp": 4.0, "model": 2}), "are not positive integers"),
        (("ddp", {"data": 8}), "unknown layouts ['ddp']"),
        (("fsdp", 8), "is neither a layout name nor a candidate (name, {axis: size, ...})"),
    ],
)
def test_a_bad_exact_candidate_is_named_on_the_first_line(layout, message):
    model, optimizer = abstract_mlp()
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    with pytest.raises(ValueError) as info:
        nnx_sharding.plan(sgd_step, model, optimizer, x, devices=8, layouts=[layout])
    first = str(info.value).splitlines()[0]
    assert first.startswith("plan: layouts: ") and message in first


def test_hybrid_data_parallelism_replicates_fsdp_groups_inside_nodes():
    """dp+fsdp+tp on 8 devices, 4 to a node: each ``data`` index is one node's devices,
    FSDP's gathers and tensor parallelism's reductions stay inside it, and the
    gradient reduction over ``data`` crosses nodes."""
    four = dataclasses.replace(PRESETS["cpu"], name="cpu-4", devices_per_node=4)
    model, optimizer = abstract_mlp()
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    layouts = ["dp+fsdp", ("dp+fsdp+tp", {"data": 2, "fsdp": 2, "model": 2})]
    plans = nnx_sharding.plan(
        sgd_step, model, optimizer, x, devices=8, accelerator=four, layouts=layouts
    )
    by_shape = {tuple(p.mesh_shape.values()): p for p in plans}
    hybrid = by_shape[(2, 2, 2)]
    mesh = hybrid.mesh()
    for d in range(2):  # node d holds data index d
        assert {device.id // 4 for device in mesh.devices[d].flat} == {d}
    path = ("layers", 0, "kernel")
    variable = dict(nnx.to_flat_state(nnx.state(model)))[path]
    assert hybrid.in_shardings[0].sharding_for(path, variable) == P("fsdp", "model")
    assert hybrid.in_shardings[2] == P(("data", "fsdp"))  # the batch over both
    for c in hybrid.detail:
        group = max(c.groups, key=len)
        nodes = {i // 4 for i in group}
        if c.kind == "all-gather":  # FSDP's weights: inside a node
            assert len(nodes) == 1, c
    assert any(
        len({i // 4 for i in max(c.groups, key=len)}) == 2
        for c in hybrid.detail
        if c.kind in ("all-reduce", "reduce-scatter")
    )  # the gradients, over data: across the nodes
    assert set(by_shape) == {(4, 2), (2, 4), (2, 2, 2)}
    assert all(p.fits for p in plans) and "dp+fsdp+tp" in LAYOUTS


@pytest.mark.skipif(not has_tpu_compiler(), reason="needs the TPU compiler (libtpu)")
def test_multi_slice_data_parallelism_is_over_the_slices():
    """Two v5e slices of 2x2: ``data=2`` puts one slice on each data index."""
    from nnx_sharding.plan._hardware.devices import compile_devices

    devices, compiler, _ = compile_devices("v5e", 8, "v5e:2x2", 2)
    assert compiler == "tpu"
    shuffled = devices[::-1]  # whatever order they come in
    ordered = order_devices(shuffled)
    grid = [ordered[:4], ordered[4:]]  # data=2 x fsdp=4, row-major
    assert [{d.slice_index for d in row} for row in grid] == [{0}, {1}]


def test_devices_are_ordered_node_by_node():
    @dataclasses.dataclass
    class Device:
        id: int
        process_index: int
        slice_index: int = 0

    pool = [Device(5, 1), Device(0, 0, 1), Device(4, 1), Device(1, 0)]
    assert [d.id for d in order_devices(pool)] == [1, 4, 5, 0]


def test_a_threads_compiler_lines_are_its_own_and_kept_off_the_terminal(capfd):
    """Lines in absl's format go to the thread that wrote them (the compile's); other
    lines reach stderr when planning ends."""
    got = {}

    def compile_like(name: str) -> None:
        start = offset()
        tid = threading.get_native_id()
        os.write(2, f"W1127 11:00:02.499349 {tid:>7} remat.cc:3231] {name} is too big\n".encode())
        os.write(2, f"I1127 11:00:02.499349 {tid:>7} info.cc:1] chatter\n".encode())
        got[name] = since(start)

    with capturing():
        threads = [threading.Thread(target=compile_like, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        os.write(2, b"a step's own print\n")
    assert got == {"a": ["a is too big"], "b": ["b is too big"]}
    assert capfd.readouterr().err == "a step's own print\n"


@pytest.mark.skipif(not has_gpu_compiler(), reason="needs the GPU compiler (CUDA plugin)")
def test_the_gpu_compilers_remat_warning_goes_to_the_plan(capfd):
    """A step needing ~125 GB on one H100: the GPU compiler's "Can't reduce memory
    use" line is in the plan's notes, not on the terminal."""

    def step(x):
        ys = [jnp.sin(x * i) for i in range(20)]
        return sum(y @ ys[0] for y in ys)

    x = jax.ShapeDtypeStruct((40000, 40000), jnp.float32)
    (only,) = nnx_sharding.plan(step, x, devices=1, accelerator="h100")
    assert only.compiler == "gpu" and not only.fits
    assert any("Can't reduce memory use below" in note for note in only.notes)
    assert "Can't reduce memory use" not in capfd.readouterr().err
