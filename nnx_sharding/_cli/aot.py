"""Ahead-of-time memory and cost reports of a decoder-only transformer, never allocated.

``python -m nnx_sharding aot --config 1b --mesh data=2,model=4`` (any device count:
``--devices 16 --mesh data=4,model=4``) builds the model with
``nnx.eval_shape`` (its Variables hold ``jax.ShapeDtypeStruct``s), gives each Variable a
``NamedSharding`` from its logical axis names (FSDP over ``data``, tensor parallelism over
``model``), lowers and compiles one SGD training step with `nnx_sharding.jit`, and prints
the compiler's per-device ``memory_analysis`` and ``cost_analysis`` as a rich table. No
parameter is ever allocated: a 1B-parameter model is compiled in a few hundred MiB.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.table import Table

from .. import _errors
from .._jit import jit
from .._metadata import shard
from .._units import format_bytes
from ..plan._decoder.configs import DECODER_CONFIGS, LOGICAL_AXES, DecoderConfig
from ..plan._decoder.model import Decoder, train_step
from ..recipes._specs import make_mesh
from .common import (
    MESH_AXES,
    Parser,
    add_devices_option,
    cpu_devices_or_rerun,
    mesh_axes,
    mesh_text,
)

AXES = MESH_AXES
"""The mesh axes the configs shard over: FSDP over ``data``, tensor parallelism over ``model``."""
PROG = "python -m nnx_sharding aot"


def rules_for(mesh: Mesh) -> list[tuple[str, str | None]]:
    """`LOGICAL_AXES` for ``mesh``: logical axes whose mesh axis it lacks are replicated."""
    return [
        (name, axis if axis in mesh.axis_names else None) for name, axis in LOGICAL_AXES.items()
    ]


def _indivisible(c: DecoderConfig, sizes: Mapping[str, int]) -> list[str]:
    """What a mesh of these axis sizes cannot split, one line each."""
    dims = {"batch": c.batch, "embed": c.d_model, "heads": c.heads, "mlp": c.mlp, "vocab": c.vocab}
    return [
        f"{name} ({dims[name]}) is not divisible by mesh axis {axis!r} ({sizes[axis]})"
        for name, axis in LOGICAL_AXES.items()
        if axis in sizes and dims[name] % sizes[axis]
    ]


def abstract_model(config: DecoderConfig, mesh: Mesh) -> Decoder:
    """The model with ``ShapeDtypeStruct`` values carrying their ``NamedSharding``s.

    >>> mesh = make_mesh({'model': 1})
    >>> model = abstract_model(DECODER_CONFIGS['tiny'], mesh)
    >>> model.layers[0].up.get_value().sharding.spec
    P(None, 'model')
    """
    wrong = _indivisible(config, dict(mesh.shape))
    if wrong:
        raise ValueError(_errors.aot_indivisible("aot_report", config.name, wrong))
    with nnx.use_eager_sharding(False):  # logical names: nothing to place at creation
        model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    return shard(model, mesh, rules_for(mesh))


def abstract_tokens(config: DecoderConfig, mesh: Mesh) -> jax.ShapeDtypeStruct:
    """The token batch, ``(batch, seq_len + 1)`` int32, sharded over ``data``."""
    spec = P("data") if "data" in mesh.axis_names else P()
    shape = (config.batch, config.seq_len + 1)
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, spec))


@dataclasses.dataclass(frozen=True)
class AotReport:
    """Per-device memory (bytes) and cost of one compiled training step.

    ``argument_bytes`` to ``temp_bytes`` come from ``Compiled.memory_analysis()``,
    ``flops`` and ``bytes_accessed`` from ``Compiled.cost_analysis()``: both describe
    the program one device runs. ``param_bytes`` is the whole model's size, and
    ``param_bytes_per_device`` the part one device holds (from the shardings).
    """

    config: str
    mesh: dict[str, int]
    params: int
    param_bytes: int
    param_bytes_per_device: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    bytes_accessed: float
    lower_seconds: float
    compile_seconds: float

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    def table(self) -> Table:
        """The report as a rich table."""
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        table = Table(title=f"AOT: config {self.config!r}, mesh {mesh} ({self.devices} devices)")
        table.add_column("quantity")
        table.add_column("per device", justify="right")
        table.add_column("all devices", justify="right")
        table.add_column("source")
        n = self.devices
        rows = [
            ("parameters", "", f"{self.params:,}", "the model's Variables"),
            (
                "parameter bytes",
                format_bytes(self.param_bytes_per_device),
                format_bytes(self.param_bytes),
                "their shardings (all: one copy)",
            ),
            ("argument bytes", format_bytes(self.argument_bytes), "", "memory_analysis"),
            ("output bytes", format_bytes(self.output_bytes), "", "memory_analysis"),
            ("alias bytes", format_bytes(self.alias_bytes), "", "memory_analysis (donated)"),
            ("temp bytes", format_bytes(self.temp_bytes), "", "memory_analysis"),
            ("FLOPs", _flops(self.flops), _flops(self.flops * n), "cost_analysis"),
            ("bytes accessed", format_bytes(int(self.bytes_accessed)), "", "cost_analysis"),
            ("lower", "", f"{self.lower_seconds:.2f} s", "wall time"),
            ("compile", "", f"{self.compile_seconds:.2f} s", "wall time"),
        ]
        for row in rows:
            table.add_row(*row)
        return table

    def __rich__(self) -> Table:
        return self.table()


def _flops(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def _shard_bytes(sds: jax.ShapeDtypeStruct) -> int:
    shape = sds.sharding.shard_shape(sds.shape) if sds.sharding is not None else sds.shape
    return math.prod(shape) * jnp.dtype(sds.dtype).itemsize


def aot_report(config: str | DecoderConfig, mesh: Mesh | Mapping[str, int]) -> AotReport:
    """Lowers and compiles one training step of an abstract model; reports memory and cost.

    Args:
      config: a `DecoderConfig` or the name of one in `DECODER_CONFIGS`.
      mesh: a mesh with axes among ``data`` and ``model``, or their sizes, e.g.
        ``{'data': 2, 'model': 4}``.

    Returns:
      An `AotReport`; print it with rich.

    Raises:
      ValueError: an unknown config, a mesh larger than the devices, or a size the mesh
        cannot split.

    >>> small = DecoderConfig('small', 64, 32, 2, 16, 64, 1, batch=2, seq_len=8)
    >>> report = aot_report(small, {'model': 1})
    >>> report.params == small.param_count(), report.argument_bytes > report.param_bytes
    (True, True)
    """
    if isinstance(config, str):
        if config not in DECODER_CONFIGS:
            raise ValueError(
                _errors.aot_unknown_config("aot_report", config, list(DECODER_CONFIGS))
            )
        config = DECODER_CONFIGS[config]
    if not isinstance(mesh, Mesh):
        n, have = math.prod(mesh.values()), len(jax.devices())
        if n > have:
            raise ValueError(_errors.aot_mesh_too_big("aot_report", dict(mesh), n, have))
        mesh = make_mesh(mesh)
    model = abstract_model(config, mesh)
    tokens = abstract_tokens(config, mesh)
    values = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model))]
    start = time.perf_counter()
    lowered = jit(train_step, donate_argnums=0).lower(model, tokens)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    memory = compiled.memory_analysis()
    assert memory is not None, "this backend gives no memory_analysis"
    cost = compiled.cost_analysis() or {}
    return AotReport(
        config=config.name,
        mesh=dict(mesh.shape),
        params=sum(v.size for v in values),
        param_bytes=sum(v.size * jnp.dtype(v.dtype).itemsize for v in values),
        param_bytes_per_device=sum(map(_shard_bytes, values)),
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        lower_seconds=lowered_at - start,
        compile_seconds=compiled_at - lowered_at,
    )


# --- the command line ---------------------------------------------------------------------


def _default_mesh(devices: int) -> dict[str, int]:
    """``data=2,model=N/2`` for an even device count, else ``model=N``."""
    return {"data": 2, "model": devices // 2} if devices % 2 == 0 else {"model": devices}


def aot_main(argv: Sequence[str]) -> int:
    """``python -m nnx_sharding aot [--config NAME] [--devices N] [--mesh AXES]``.

    Prints the `aot_report` of one training step of the config on a mesh of simulated
    CPU devices, any count: ``--devices`` defaults to the mesh's size (8 when neither
    is given), and the mesh to ``data=2`` and ``model`` the rest. The process gets the
    devices through `nnx_sharding._cli.common.cpu_devices_or_rerun`. A bad option, a mesh
    whose size is not ``--devices`` or one that cannot split the config exits with
    one line on stderr and status 2, before anything is compiled.

    Returns:
      The exit status, 0.
    """
    parser = Parser(prog=PROG, description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--config", default="1b", help=f"one of {', '.join(DECODER_CONFIGS)} (default: 1b)"
    )
    add_devices_option(parser)
    parser.add_argument(
        "--mesh",
        type=mesh_axes,
        metavar="AXES",
        help="mesh axes, e.g. data=2,model=4; their sizes multiply to N "
        "(default: data=2 and model=N/2, or model=N for an odd N)",
    )
    args = parser.parse_args(list(argv))
    if args.config not in DECODER_CONFIGS:
        parser.error(
            f"unknown --config {args.config!r}; choose one of {', '.join(DECODER_CONFIGS)}"
        )
    if args.mesh is None:
        args.devices = args.devices or 8
        args.mesh = _default_mesh(args.devices)
    size = math.prod(args.mesh.values())
    shown = mesh_text(args.mesh)
    if args.devices is None:
        args.devices = size
    elif size != args.devices:
        parser.error(f"--mesh {shown} has {size} devices, but --devices is {args.devices}")
    wrong = _indivisible(DECODER_CONFIGS[args.config], args.mesh)
    if wrong:
        parser.error(f"--mesh {shown} cannot shard config {args.config!r}: {wrong[0]}")
    status = cpu_devices_or_rerun(args.devices, ["aot", *argv])
    if status is not None:
        return status
    Console().print(aot_report(args.config, args.mesh))
    return 0
