"""`sharding_table` and `visualize_sharding`: rows, byte counts, exports and device grids."""

import io

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

import nnx_sharding

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
IDS = [d.id for d in MESH.devices.flat]
lecun, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()


class MLP(nnx.Module):
    """Megatron-style: the first kernel split by columns, the second by rows."""

    def __init__(self, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        up = nnx.with_partitioning(lecun, (None, "model"))
        self.up = nnx.Linear(
            16, 64, kernel_init=up, bias_init=nnx.with_partitioning(zeros, ("model",)), rngs=rngs
        )
        self.down = nnx.Linear(
            64, 16, kernel_init=nnx.with_partitioning(lecun, ("model", None)), rngs=rngs
        )


# Worked out by hand: float32, 'model' has 4 devices of 8, so sharded arrays have 2 copies.
EXPECTED = {
    # path: (spec, axes, bytes per device, total bytes, replication)
    ".down.bias": (P(), (), 64, 64, 8),
    ".down.kernel": (P("model", None), ("model",), 64 * 16 * 4 // 4, 64 * 16 * 4, 2),
    ".up.bias": (P("model"), ("model",), 64 * 4 // 4, 64 * 4, 2),
    ".up.kernel": (P(None, "model"), ("model",), 16 * 64 * 4 // 4, 16 * 64 * 4, 2),
}
PER_DEVICE = 1024 + 64 + 1024 + 64


def concrete_mlp():
    with jax.set_mesh(MESH):
        return MLP()


def summary(table):
    return {
        r.path: (r.sharding.spec, r.mesh_axes, r.bytes_per_device, r.total_bytes, r.replication)
        for r in table.rows
    }


def test_rows_of_a_concrete_module():
    table = nnx_sharding.sharding_table(concrete_mlp())
    assert summary(table) == EXPECTED
    assert [r.path for r in table.rows] == sorted(EXPECTED)
    kernel = table.rows[-1]
    assert (kernel.type, kernel.shape, kernel.dtype) == ("Param", (16, 64), jnp.float32)
    assert kernel.sharding == NamedSharding(MESH, P(None, "model"))
    assert table.per_device == {i: PER_DEVICE for i in sorted(IDS)}
    assert table.total_bytes == sum(e[3] for e in EXPECTED.values())


def test_fully_sharded_single_device_and_key_arrays():
    holder = nnx.Dict(
        grid=nnx.Param(jax.device_put(jnp.zeros((8, 8)), NamedSharding(MESH, P("data", "model")))),
        lone=nnx.BatchStat(jax.device_put(jnp.zeros(10, jnp.int8), jax.devices()[3])),
        rngs=nnx.Rngs(0),
    )
    rows = {r.path: r for r in nnx_sharding.sharding_table(holder).rows}
    grid, lone, key = rows[".grid"], rows[".lone"], rows[".rngs.default.key"]
    assert (grid.mesh_axes, grid.bytes_per_device, grid.replication) == (("data", "model"), 32, 1)
    assert isinstance(lone.sharding, SingleDeviceSharding)
    assert (lone.type, lone.bytes_per_device, lone.total_bytes, lone.replication) == (
        "BatchStat",
        10,
        10,
        1,
    )
    assert (key.type, key.bytes_per_device) == ("RngKey", key.total_bytes)
    per_device = nnx_sharding.sharding_table(holder).per_device
    # the grid's 32 B everywhere; the rngs (uint32 count + key) and the int8 stat on one device
    rng_bytes = rows[".rngs.default.count"].total_bytes + key.total_bytes
    assert per_device[3] == 32 + 10 + (rng_bytes if jax.devices()[0].id == 3 else 0)
    assert per_device[jax.devices()[0].id] == 32 + rng_bytes


def test_shared_variables_are_one_row_and_pytrees_get_key_paths():
    model = concrete_mlp()
    model.again = model.up
    assert len(nnx_sharding.sharding_table(model).rows) == 4
    table = nnx_sharding.sharding_table({"model": concrete_mlp(), "x": jnp.ones((2, 3))})
    paths = [r.path for r in table.rows]
    assert paths == [f"['model']{p}" for p in sorted(EXPECTED)] + ["['x']"]
    assert table.rows[-1].type == "Array" and table.rows[-1].total_bytes == 24


def test_abstract_module_from_eval_shape_in_and_out_of_the_mesh():
    with jax.set_mesh(MESH):
        abstract = nnx.eval_shape(MLP)
        inside = nnx_sharding.sharding_table(abstract)
    assert isinstance(abstract.up.kernel.get_value(), jax.ShapeDtypeStruct)
    assert summary(inside) == EXPECTED
    assert inside.per_device == {i: PER_DEVICE for i in sorted(IDS)}
    assert inside.rows[0].sharding.mesh == MESH  # moved onto the concrete mesh in context

    outside = nnx_sharding.sharding_table(abstract)
    assert summary(outside) == EXPECTED
    assert isinstance(outside.rows[0].sharding.mesh, AbstractMesh)
    assert outside.per_device == {i: PER_DEVICE for i in range(8)}  # positions in the mesh


def test_metadata_without_a_sharded_value_needs_a_mesh():
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(MLP)
    assert abstract.up.kernel.get_value().sharding is None

    bare = nnx_sharding.sharding_table(abstract)
    kernel = bare.rows[-1]
    assert kernel.sharding == P(None, "model") and kernel.mesh_axes == ("model",)
    assert (kernel.bytes_per_device, kernel.replication, kernel.total_bytes) == (None, None, 4096)
    assert bare.rows[0].sharding is None  # no metadata, no sharding: unknown
    assert bare.per_device == {}
    assert "4 without a known sharding left out" in bare.to_text()

    with jax.set_mesh(MESH):
        placed = {r.path: r for r in nnx_sharding.sharding_table(abstract).rows}
    assert placed[".up.kernel"].sharding == NamedSharding(MESH, P(None, "model"))
    assert (placed[".up.kernel"].bytes_per_device, placed[".up.kernel"].replication) == (1024, 2)
    assert placed[".down.bias"].sharding is None  # neither metadata nor a sharding
    with nnx.use_eager_sharding(False):
        own = nnx.eval_shape(
            lambda: nnx.Linear(
                16,
                64,
                kernel_init=nnx.with_partitioning(lecun, (None, "model"), mesh=MESH),
                rngs=nnx.Rngs(0),
            )
        )
    row = nnx_sharding.sharding_table(own).rows[-1]
    assert row.sharding == NamedSharding(MESH, P(None, "model")) and row.bytes_per_device == 1024


def test_exports_to_text_html_and_svg():
    table = nnx_sharding.sharding_table(concrete_mlp())
    text = table.to_text()
    assert "Sharding of Variables on mesh {'data': 2, 'model': 4}" in text
    line = next(line for line in text.splitlines() if ".up.kernel" in line)
    for cell in (
        "Param",
        "(16, 64)",
        "float32",
        "P(None, 'model')",
        "model",
        "1.00 KiB",
        "4.00 KiB",
        "2",
    ):
        assert cell in line
    assert "4 Variables" in text and "per device: 2.12 KiB on devices 0-7" in text
    html = table.to_html()
    assert html.lstrip().startswith("<!DOCTYPE html>") and ".up.kernel" in html
    svg = table.to_svg(title="MLP")
    assert svg.lstrip().startswith("<svg") and "MLP" in svg and "kernel" in svg


def record():
    return Console(record=True, file=io.StringIO(), width=120)


def test_visualize_prints_the_table_and_the_chosen_grids():
    console = record()
    table = nnx_sharding.visualize_sharding(
        concrete_mlp(), [".up.kernel", ("down", "bias")], console=console
    )
    assert summary(table) == EXPECTED
    out = console.export_text()
    assert out.index("Sharding of Variables") < out.index(".up.kernel  (16, 64)")
    grid = out[out.index(".up.kernel  (16, 64)") : out.index(".down.bias  (16,)")]
    # columns split over 'model' (4), each column held by the two 'data' devices
    (labels,) = [line.split("│")[1:-1] for line in grid.splitlines() if "CPU" in line]
    assert [cell.strip() for cell in labels] == ["CPU 0,4", "CPU 1,5", "CPU 2,6", "CPU 3,7"]
    assert "CPU 0,1,2,3,4,5,6,7" in out[out.index(".down.bias  (16,)") :]


def test_visualize_without_paths_draws_no_grid_and_prints_to_stdout(capsys):
    nnx_sharding.visualize_sharding(concrete_mlp())
    out = capsys.readouterr().out
    assert "Sharding of Variables" in out and "CPU" not in out
    nnx_sharding.visualize_sharding(concrete_mlp(), ["up.kernel"])
    assert "CPU" in capsys.readouterr().out


def test_visualize_an_abstract_module_inside_the_mesh():
    with jax.set_mesh(MESH):
        abstract = nnx.eval_shape(MLP)
        console = record()
        nnx_sharding.visualize_sharding(abstract, [".down.kernel"], console=console)
    out = console.export_text()
    grid = out[out.index(".down.kernel  (64, 16)") :]
    # the same grid as the concrete array's: row blocks over 'model', copies over 'data'
    assert [line.strip("│ ") for line in grid.splitlines() if "CPU" in line] == [
        "CPU 0,4",
        "CPU 1,5",
        "CPU 2,6",
        "CPU 3,7",
    ]


def test_visualize_reports_bad_paths():
    model = concrete_mlp()
    with pytest.raises(ValueError, match=r"visualize_sharding: paths: no Variable at \.up\.weight"):
        nnx_sharding.visualize_sharding(model, [".up.weight"], console=record())
    cube = nnx.Dict(w=nnx.Param(jnp.zeros((2, 2, 2))))
    with pytest.raises(ValueError, match=r"the Variable at \.w has 3 dimensions"):
        nnx_sharding.visualize_sharding(cube, ["w"], console=record())
    with jax.set_mesh(MESH):
        abstract = nnx.eval_shape(MLP)
    with pytest.raises(ValueError, match=r"\.up\.kernel has no devices"):
        nnx_sharding.visualize_sharding(abstract, [".up.kernel"], console=record())
