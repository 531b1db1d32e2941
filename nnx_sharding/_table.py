"""`sharding_table` and `visualize_sharding`: where each Variable lives and what it costs."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, Sharding
from jax.sharding import SingleDeviceSharding as SingleDevice
from jax.tree_util import keystr
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import _errors
from ._logical import axis_names
from ._metadata import on_abstract_mesh, placement
from ._nodes import Path, format_path, is_node
from ._types import ShardingLike
from ._units import format_bytes

DeviceKey: TypeAlias = int
"""A device id; for an abstract mesh without devices in context, a position in the mesh."""
PathLike: TypeAlias = str | Path
"""A row's path, ``'.layers[0].kernel'`` (the leading dot optional) or a key tuple."""
COLUMNS = ("path", "type", "shape", "dtype", "sharding", "axes", "per device", "total", "repl")
RIGHT = ("shape", "per device", "total", "repl")


@dataclasses.dataclass(frozen=True)
class ShardingRow:
    """One Variable (or array): its placement and its bytes.

    ``bytes_per_device`` is the size of one device's shard, ``total_bytes`` the size of
    the whole array (once), ``replication`` the number of devices holding each shard.
    The three are None where no sharding is known.
    """

    path: str
    type: str
    shape: tuple[int, ...]
    dtype: Any
    sharding: ShardingLike
    mesh_axes: tuple[str, ...]
    bytes_per_device: int | None
    total_bytes: int
    replication: int | None
    devices: tuple[DeviceKey, ...] = dataclasses.field(repr=False)
    value: Any = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class ShardingTable:
    """Rows of `sharding_table`, the bytes each device holds; exports through rich.

    >>> import jax.numpy as jnp
    >>> import nnx_sharding
    >>> table = nnx_sharding.sharding_table({'w': jnp.zeros((2, 4))})
    >>> table.rows[0].bytes_per_device, table.per_device
    (32, {0: 32})
    """

    rows: tuple[ShardingRow, ...]
    per_device: Mapping[DeviceKey, int]

    @property
    def total_bytes(self) -> int:
        """Sum of the arrays' sizes, each counted once."""
        return sum(row.total_bytes for row in self.rows)

    def __rich__(self) -> Table:
        named = [r.sharding for r in self.rows if isinstance(r.sharding, NamedSharding)]
        meshes = {str(dict(s.mesh.shape)) for s in named}
        title = "Sharding of Variables" + (f" on mesh {meshes.pop()}" if len(meshes) == 1 else "")
        kinds = "arrays" if any(r.type == "Array" for r in self.rows) else "Variables"
        footer = {"path": f"{len(self.rows)} {kinds}", "total": format_bytes(self.total_bytes)}
        footer["per device"] = format_bytes(max(self.per_device.values(), default=0))
        table = Table(title=title, caption=self._caption(), show_footer=True)
        for name in COLUMNS:
            fold = "fold" if name in ("path", "sharding") else "ellipsis"
            justify = "right" if name in RIGHT else "left"
            table.add_column(name, footer=footer.get(name, ""), justify=justify, overflow=fold,
                             no_wrap=name in RIGHT)  # fmt: skip
        for r in self.rows:
            known = r.bytes_per_device is not None
            figures = (
                format_bytes(r.bytes_per_device or 0),
                format_bytes(r.total_bytes),
                str(r.replication),
            )
            table.add_row(
                r.path or "<root>", r.type, str(r.shape), str(r.dtype), _show(r.sharding),
                ",".join(r.mesh_axes) or "-", *(figures if known else ("?", figures[1], "?")),
                style=None if known else "dim",
            )  # fmt: skip
        return table

    def _caption(self) -> str:
        groups: dict[int, list[DeviceKey]] = {}
        for device, size in sorted(self.per_device.items()):
            groups.setdefault(size, []).append(device)
        parts = [f"{format_bytes(size)} on {_ranges(ids)}" for size, ids in groups.items()]
        unknown = sum(r.bytes_per_device is None for r in self.rows)
        if unknown:
            parts.append(f"{unknown} without a known sharding left out")
        return "per device: " + ("; ".join(parts) or "nothing")

    def _export(self, width: int) -> Console:
        console = Console(record=True, file=io.StringIO(), width=width, color_system="truecolor")
        console.print(self)
        return console

    def to_text(self, width: int = 120) -> str:
        """The table as plain text."""
        return self._export(width).export_text()

    def to_html(self, width: int = 120) -> str:
        """The table as a standalone HTML page (rich's ``export_html``)."""
        return self._export(width).export_html()

    def to_svg(self, width: int = 120, title: str = "nnx_sharding") -> str:
        """The table as an SVG image (rich's ``export_svg``), e.g. for docs."""
        return self._export(width).export_svg(title=title)


def _show(s: ShardingLike) -> str:
    if isinstance(s, NamedSharding):
        return repr(s.spec)
    if isinstance(s, PartitionSpec):
        return f"{s!r} (no mesh)"
    if isinstance(s, SingleDevice):
        return f"device {next(iter(s.device_set)).id}"
    return "unknown" if s is None else repr(s)


def _ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``devices 0-2, 5``."""
    runs = [[i for _, i in g] for _, g in itertools.groupby(enumerate(ids), lambda p: p[1] - p[0])]
    spans = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
    return ("device " if len(ids) == 1 else "devices ") + spans


def _items(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, Variable or array)`` for every Variable below graph nodes and States."""
    if isinstance(tree, nnx.Variable):
        yield prefix, tree
    elif isinstance(tree, nnx.State) or is_node(tree):
        state = tree if isinstance(tree, nnx.State) else nnx.state(tree)
        for path, item in nnx.to_flat_state(state):
            yield prefix + format_path(path), item
    else:
        is_leaf = lambda x: is_node(x) or isinstance(x, nnx.State)  # noqa: E731
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
            if is_leaf(leaf):
                yield from _items(leaf, prefix + keystr(keypath))
            else:
                yield prefix + keystr(keypath), leaf


def _row(path: str, item: Any) -> ShardingRow | None:
    var = item if isinstance(item, nnx.Variable) else None
    value = var.get_value() if var is not None else item
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return None
    shape = tuple(shape)
    sharding = placement(value, var)
    total = math.prod(shape) * dtype.itemsize
    spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
    axes = tuple(axis_names(spec)) if isinstance(spec, PartitionSpec) else ()
    per_device, replication, devices = None, None, ()
    if isinstance(sharding, Sharding):
        per_device = math.prod(sharding.shard_shape(shape)) * dtype.itemsize
        if on_abstract_mesh(sharding):  # no devices: count the shards from the spec
            devices = tuple(range(sharding.mesh.size))  # type: ignore[attr-defined]
            shards = math.prod(sharding.mesh.shape[a] for a in axes)  # type: ignore[attr-defined]
        else:
            index_map = sharding.devices_indices_map(shape)
            devices = tuple(sorted(d.id for d in index_map))
            shards = len({tuple(map(_slice_key, index)) for index in index_map.values()})
        replication = len(devices) // shards
    kind = type(item).__name__ if var is not None else "Array"
    return ShardingRow(path, kind, shape, dtype, sharding, axes, per_device, total, replication,
                       devices, value)  # fmt: skip


def _slice_key(index: Any) -> Any:
    return (index.start, index.stop, index.step) if isinstance(index, slice) else index


def sharding_table(tree: Any) -> ShardingTable:
    """One row per Variable of ``tree``: its placement and its bytes; totals per device.

    ``tree`` is a graph node, an ``nnx.State`` or a pytree of them and arrays. Concrete
    and abstract (``nnx.eval_shape``) Variables are both read: a value's own sharding
    first, else its sharding metadata (``out_sharding`` through flax's rules in
    context) on its ``mesh`` metadata or the mesh in context, else a bare
    PartitionSpec. A Variable reached twice (shared) is one row.

    Args:
      tree: what to tabulate.

    Returns:
      A `ShardingTable`; print it with rich, or export it with ``to_text``,
      ``to_html``, ``to_svg``.

    >>> from flax import nnx
    >>> import nnx_sharding
    >>> table = nnx_sharding.sharding_table(nnx.Linear(2, 4, rngs=nnx.Rngs(0)))
    >>> [(r.path, r.type, r.shape, r.bytes_per_device) for r in table.rows]
    [('.bias', 'Param', (4,), 16), ('.kernel', 'Param', (2, 4), 32)]
    """
    rows, seen = [], set()
    for path, item in _items(tree):
        if id(item) in seen:
            continue
        seen.add(id(item))
        row = _row(path, item)
        if row is not None:
            rows.append(row)
    per_device: dict[DeviceKey, int] = {}
    for row in rows:
        for device in row.devices:
            per_device[device] = per_device.get(device, 0) + (row.bytes_per_device or 0)
    return ShardingTable(tuple(rows), dict(sorted(per_device.items())))


def _select(table: ShardingTable, paths: Sequence[PathLike]) -> list[ShardingRow]:
    by_path = {row.path: row for row in table.rows}
    chosen, missing, problems = [], [], []
    for p in paths:
        key = format_path(p) if isinstance(p, tuple) else p if p[:1] in ".[" else "." + p
        row = by_path.get(key)
        if row is None:
            missing.append(key)
            continue
        if len(row.shape) not in (1, 2):
            problems.append(f"the Variable at {key} has {len(row.shape)} dimensions")
        elif not isinstance(row.sharding, Sharding) or on_abstract_mesh(row.sharding):
            problems.append(f"the Variable at {key} has no devices ({_show(row.sharding)})")
        chosen.append(row)
    if missing:
        raise ValueError(_errors.unknown_paths("visualize_sharding", missing, list(by_path)))
    if problems:
        raise ValueError(_errors.not_drawable("visualize_sharding", problems))
    return chosen


def visualize_sharding(
    tree: Any, paths: Sequence[PathLike] | None = None, *, console: Console | None = None
) -> ShardingTable:
    """Prints `sharding_table` as a rich table, then the device grids of ``paths``.

    The grids are those of ``jax.debug.visualize_array_sharding`` (for abstract
    Variables, ``jax.debug.visualize_sharding``); jax draws 1-D and 2-D arrays.

    Args:
      tree: as for `sharding_table`.
      paths: rows whose grids to draw (``'.up.kernel'`` or ``('up', 'kernel')``); None
        draws none.
      console: a rich Console to print to (e.g. ``Console(record=True)`` to export
        the whole page); the grids are captured into it. Default: a new Console.

    Returns:
      The `ShardingTable`.

    >>> from flax import nnx
    >>> import nnx_sharding
    >>> _ = nnx_sharding.visualize_sharding(nnx.Linear(2, 4, rngs=nnx.Rngs(0)), ['.kernel'])
    Sharding of Variables ...
    """
    table = sharding_table(tree)
    rows = _select(table, paths or ())
    out = console if console is not None else Console()
    if console is None and not out.is_terminal:
        out = Console(width=max(out.width, 120))  # a file or a pipe: no need to squeeze
    out.print(table)
    for row in rows:
        out.print(Text(f"{row.path}  {row.shape} {row.dtype}  {_show(row.sharding)}", "bold"))
        if console is None:
            _draw(row, out.width)
            continue
        with contextlib.redirect_stdout(io.StringIO()) as captured:
            _draw(row, out.width)
        out.print(Text.from_ansi(captured.getvalue().rstrip("\n")))
    return table


def _draw(row: ShardingRow, width: int) -> None:
    """jax's device grid: of the array itself where there is one."""
    if isinstance(row.value, jax.Array):
        jax.debug.visualize_array_sharding(row.value, max_width=width)
    else:
        assert isinstance(row.sharding, Sharding)  # checked by _select
        jax.debug.visualize_sharding(row.shape, row.sharding, max_width=width)
