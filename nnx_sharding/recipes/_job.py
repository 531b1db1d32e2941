"""The main job (``python -m nnx_sharding``): a recipe trained next to its reference."""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ._data_parallel import data_parallel_step, data_tensor_parallel_step
from ._model import (
    MLP,
    Array,
    Batch,
    Step,
    make_batches,
    make_optimizer,
    max_param_diff,
    reference_step,
)
from ._model import train as train_steps
from ._specs import AxisName, make_mesh
from ._tensor_parallel import tensor_parallel_step

DIN, DOUT = 16, 8
RTOL = 1e-4
"""How close the final loss must come to the reference's for exit status 0."""


def pick_recipe(axes: Mapping[AxisName, int]) -> tuple[str, Step, NamedSharding]:
    """The recipe for the mesh (tensor-parallel, data-parallel or both), its batch sharding."""
    mesh = make_mesh(axes)
    batch = NamedSharding(mesh, P("data") if "data" in axes else P())
    if "data" in axes and "model" in axes:
        return "data x tensor parallel", data_tensor_parallel_step(mesh), batch
    if "data" in axes:
        return "data parallel", data_parallel_step(mesh), batch
    return "tensor parallel (Megatron, shard_map)", tensor_parallel_step(mesh), batch


def run(axes: Mapping[AxisName, int], steps: int, console: Console | None = None) -> int:
    """Trains the recipe for ``axes`` and the reference; prints the comparison.

    Returns the exit status: 0 when the final losses agree to `RTOL`.
    """
    console = console or Console()
    start = time.perf_counter()
    hidden, batch = 16 * axes.get("model", 1), 32 * axes.get("data", 1)
    name, step, placement = pick_recipe(axes)
    batches = make_batches(16, batch, DIN, DOUT)
    model = MLP(DIN, hidden, DOUT, rngs=nnx.Rngs(0))
    reference = nnx.clone(model)
    console.print(f"[bold]{name}[/] on mesh {dict(axes)}")
    console.print(f"MLP {DIN} -> {hidden} -> {DOUT}, batch {batch}, adam, {steps} steps")
    with Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        losses = _train(progress, "sharded", step, model, batches, steps, placement)
        expected = _train(
            progress, "single-device reference", reference_step(), reference, batches, steps
        )
    console.print(_param_table(model, axes))
    loss, ref = float(losses[-1]), float(expected[-1])
    diff, params = abs(loss - ref), max_param_diff(model, reference)
    console.print(
        f"final loss {loss:.6f}, single-device reference {ref:.6f}, |difference| {diff:.1e}\n"
        f"max |loss difference| over the {steps} steps "
        f"{float(np.max(np.abs(losses - expected))):.1e}\n"
        f"max |parameter difference| {params:.1e}\n"
        f"took {time.perf_counter() - start:.1f} s"
    )
    ok = diff <= RTOL * max(1.0, abs(ref))
    if not ok:
        console.print(f"[red]the sharded loss is off by more than {RTOL:g}[/]")
    return 0 if ok else 1


def _train(
    progress: Progress,
    label: str,
    step: Step,
    model: MLP,
    batches: list[Batch],
    steps: int,
    sharding: NamedSharding | None = None,
) -> np.ndarray:
    task = progress.add_task(label, total=steps, loss="-")
    every = max(1, steps // 50)

    def on_step(i: int, loss: Array) -> None:
        if (i + 1) % every == 0 or i + 1 == steps:
            progress.update(task, completed=i + 1, loss=f"{float(loss):.6f}")

    optimizer = make_optimizer(model)
    return train_steps(step, model, optimizer, batches, steps, sharding=sharding, on_step=on_step)


def _param_table(model: MLP, axes: Mapping[AxisName, int]) -> Table:
    table = Table(title=f"Parameters on mesh {dict(axes)}")
    for column in ("path", "shape", "sharding", "shard per device"):
        table.add_column(column)
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = param[...]
        shard = value.sharding.shard_shape(value.shape)
        spec = getattr(value.sharding, "spec", value.sharding)
        table.add_row(".".join(map(str, path)), str(value.shape), str(spec), str(shard))
    return table
