"""The main job (``python -m nnx_sharding``): a recipe trained next to its reference.

With a checkpoint directory (``--checkpoint DIR``) the sharded run saves the model and
its optimizer (whose ``step`` is the training position) every `SAVE_EVERY` steps and
at the end, through `nnx_sharding.checkpoint.Manager`; when DIR already holds a
checkpoint, the run restores the latest one straight into the recipe's sharded layout
and trains on from its step. Batch ``i`` is ``batches[i % len(batches)]`` for the
global step ``i``, so a resumed run sees the data the uninterrupted run would have
seen, and its losses continue that run's exactly. The single-device reference always
trains from scratch: it is cheap and keeps the comparison the same.

A mesh with a ``stage`` axis trains `DeepMLP` instead of the MLP: `LAYERS` residual
blocks pipelined over ``stage`` (GPipe, `pipeline_step`), its reference the same model
with no mesh, where the pipeline is a plain scan over the blocks. A mesh with an
``expert`` axis trains `ExpertMLP`: `MOE_LAYERS` residual mixture-of-experts blocks of
`EXPERTS` experts (top-`TOP_K`, dropless), the experts over ``expert`` (`expert_step`),
on sequences of `SEQ` tokens; its loss and its reference's add the load-balancing loss.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .._state_sharding import StateSharding
from ._data_parallel import data_parallel_step, data_tensor_parallel_step
from ._experts import (
    AUX_WEIGHT,
    ExpertMLP,
    as_sequences,
    batch_spec,
    expert_reference_step,
    expert_sharding,
    expert_step,
)
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
from ._pipeline import DeepMLP, pipeline_sharding, pipeline_step
from ._specs import AxisName, make_mesh, megatron_sharding, on_mesh
from ._tp_shard_map import tensor_parallel_step

if TYPE_CHECKING:
    from ..checkpoint import Manager

DIN, DOUT = 16, 8
RTOL = 1e-4
"""How close the final loss must come to the reference's for exit status 0."""
SAVE_EVERY = 100
"""With ``--checkpoint``: the sharded run saves every this many steps, and at the end."""
MAX_TO_KEEP = 3
"""With ``--checkpoint``: how many of the latest checkpoints the directory keeps."""
LAYERS = 8
"""With a ``stage`` axis: `DeepMLP`'s residual blocks, split evenly over the stages."""
MOE_LAYERS, EXPERTS, TOP_K, EXPERT_MLP, SEQ = 2, 8, 2, 32, 8
"""With an ``expert`` axis: `ExpertMLP`'s MoE blocks, experts (split evenly over the
``expert`` axis), experts per token, each expert's hidden width, tokens per sequence."""


def mesh_problem(axes: Mapping[AxisName, int]) -> str | None:
    """Why the job cannot train on the mesh ``axes``, in a line; None when it can.

    >>> print(mesh_problem({'stage': 3}))
    the pipeline's 8 residual blocks do not split into 3 stages (stage=1, 2, 4 or 8)
    >>> print(mesh_problem({'expert': 3}))
    the 8 experts do not split over 3 devices (expert=1, 2, 4 or 8)
    """
    if "stage" in axes and "expert" in axes:
        return "the job pipelines (stage) or splits experts (expert), not both"
    stages, experts = axes.get("stage", 1), axes.get("expert", 1)
    if LAYERS % stages:
        return (
            f"the pipeline's {LAYERS} residual blocks do not split into {stages} stages "
            f"(stage={_divisors(LAYERS)})"
        )
    if EXPERTS % experts:
        return (
            f"the {EXPERTS} experts do not split over {experts} devices "
            f"(expert={_divisors(EXPERTS)})"
        )
    return None


def _divisors(n: int) -> str:
    fits = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, fits[:-1])) + f" or {fits[-1]}"


def microbatches(axes: Mapping[AxisName, int]) -> int:
    """With a ``stage`` axis: the pipeline's microbatches, twice the stages.

    >>> microbatches({'stage': 4, 'data': 2})
    8
    """
    return 2 * axes.get("stage", 1)


def pick_recipe(axes: Mapping[AxisName, int]) -> tuple[str, Step, NamedSharding]:
    """The recipe for the mesh (pipeline-, expert-, tensor-, data-parallel or data x
    tensor), its batch sharding."""
    mesh = make_mesh(axes)
    batch = NamedSharding(mesh, P("data") if "data" in axes else P())
    if "expert" in axes:
        inside = " x tensor" * ("model" in axes)
        name = f"expert{inside} parallel (MoE, {EXPERTS} experts, top-{TOP_K}, dropless)"
        return name, expert_step(mesh), NamedSharding(mesh, batch_spec(mesh.axis_names))
    if "stage" in axes:
        stages, inside = axes["stage"], " x tensor" * ("model" in axes)
        plural = "s" * (stages != 1)
        name = (
            f"pipeline{inside} parallel (GPipe, {stages} stage{plural} × "
            f"{microbatches(axes)} microbatches)"
        )
        return name, pipeline_step(mesh), batch
    if "data" in axes and "model" in axes:
        return "data x tensor parallel", data_tensor_parallel_step(mesh), batch
    if "data" in axes:
        return "data parallel", data_parallel_step(mesh), batch
    return "tensor parallel (Megatron, shard_map)", tensor_parallel_step(mesh), batch


def state_layout(axes: Mapping[AxisName, int]) -> StateSharding:
    """Where the recipe for ``axes`` keeps the model and the optimizer's state.

    Megatron's split over ``model`` when the mesh has that axis (replicated over
    ``data``), else everything replicated: the ``in_shardings`` of the recipe's step.
    With ``stage``, `pipeline_sharding`: the blocks' layer dimension over ``stage``.
    With ``expert``, `expert_sharding`: the MoE weights by their logical names.

    >>> state_layout({'data': 2}).shardings[0].spec
    P()
    >>> state_layout({'stage': 1}).shardings[0].spec
    P('stage',)
    """
    mesh = make_mesh(axes)
    model_axis = "model" if "model" in axes else None
    if "stage" in axes:
        return on_mesh(mesh, pipeline_sharding(model_axis=model_axis))
    if "expert" in axes:
        return on_mesh(mesh, expert_sharding(model_axis))
    if "model" in axes:
        return on_mesh(mesh, megatron_sharding())
    return StateSharding({...: NamedSharding(mesh, P())})


def run(
    axes: Mapping[AxisName, int],
    steps: int,
    console: Console | None = None,
    checkpoint: str | Path | None = None,
) -> int:
    """Trains the recipe for ``axes`` and the reference; prints the comparison.

    Args:
      axes: The mesh, e.g. ``{'data': 2, 'model': 4}``; it picks the recipe.
      steps: How many steps both runs train in all.
      console: Where to print (a new `rich` console if None).
      checkpoint: A directory to save the sharded run to (see the module's docstring)
        and, when it holds a checkpoint, to resume it from.

    Returns:
      The exit status: 0 when the final losses agree to `RTOL` (or the checkpoint has
      nothing left to train), 1 otherwise, 2 when ``checkpoint`` cannot hold checkpoints
      (a file, an empty path, a directory of other files; nothing is written).
    """
    console = console or Console()
    start = time.perf_counter()
    manager = None
    if checkpoint is not None:
        from ..checkpoint import Manager

        try:  # the path is checked before anything is trained or written
            manager = Manager(checkpoint, max_to_keep=MAX_TO_KEEP)
        except (ValueError, OSError) as e:
            problem = str(e).splitlines()[0].split(": ", 2)[-1]
            print(f"python -m nnx_sharding: error: --checkpoint: {problem}", file=sys.stderr)
            return 2
    batch = 32 * axes.get("data", 1)
    name, step, placement = pick_recipe(axes)
    batches = make_batches(16, batch, DIN, DOUT)
    if "expert" in axes:  # sequences of SEQ tokens, at least 4 per device
        batch = 4 * axes.get("data", 1) * axes["expert"]
        batches = as_sequences(make_batches(16, batch * SEQ, DIN, DOUT), SEQ)
    model = new_model(axes)
    reference = nnx.clone(model)
    optimizer = make_optimizer(model)
    # one line each, however long (the pipeline's title is longer than 80 columns)
    console.print(f"[bold]{name}[/] on mesh {dict(axes)}", soft_wrap=True)
    console.print(f"{_describe(axes)}, batch {batch}, adam, {steps} steps", soft_wrap=True)
    first = 0
    if manager is not None:
        directory = Path(str(manager.directory))
        try:
            resumed = _resume(manager, directory, axes, steps, console)
        except _Stop as stop:
            manager.close()
            return stop.status
        if resumed is not None:
            first, model, optimizer = resumed
        console.print(f"saving to {directory} every {SAVE_EVERY} steps and at step {steps}")
    try:
        with Progress(
            TextColumn("{task.description:<22}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            losses = _train(
                progress, "sharded", step, model, optimizer, batches, steps, placement,
                first=first, manager=manager,
            )  # fmt: skip
            expected = _train(
                progress,
                "single-device reference",
                expert_reference_step() if "expert" in axes else reference_step(),
                reference,
                make_optimizer(reference),
                batches,
                steps,
            )
    finally:
        if manager is not None:
            manager.close()  # waits for the last save
    console.print(_param_table(model, axes))
    loss, ref = float(losses[-1]), float(expected[-1])
    diff, params = abs(loss - ref), max_param_diff(model, reference)
    trained = f"the {steps} steps" if first == 0 else f"steps {first + 1}-{steps}"
    console.print(
        f"final loss {loss:.6f}, single-device reference {ref:.6f}, |difference| {diff:.1e}\n"
        f"max |loss difference| over {trained} "
        f"{float(np.max(np.abs(losses - expected[first:]))):.1e}\n"
        f"max |parameter difference| {params:.1e}\n"
        f"took {time.perf_counter() - start:.1f} s"
    )
    ok = diff <= RTOL * max(1.0, abs(ref))
    if not ok:
        console.print(f"[red]the sharded loss is off by more than {RTOL:g}[/]")
    return 0 if ok else 1


class _Stop(Exception):
    """Ends the job early, with the exit status ``status`` (why is printed already)."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


def _resume(
    manager: Manager,
    directory: Path,
    axes: Mapping[AxisName, int],
    steps: int,
    console: Console,
) -> tuple[int, MLP, nnx.Optimizer[MLP]] | None:
    """The latest checkpoint's step, model and optimizer, restored in the recipe's
    layout; None when ``manager`` has none. Raises `_Stop` when there is nothing left
    to train, or when the checkpoint is of another model."""
    latest = manager.latest_step()
    if latest is None:
        return None
    if latest >= steps:
        console.print(
            f"the checkpoint in {directory} is at step {latest}, --steps is {steps}: "
            "nothing to train"
        )
        raise _Stop(0)
    abstract = nnx.eval_shape(lambda: _model_and_optimizer(axes))
    try:
        model, optimizer = manager.restore(abstract, shardings=state_layout(axes))
    except ValueError as e:  # the checkpoint's shapes differ: saved with another --mesh
        console.print(
            f"[red]cannot resume from step {latest} of the checkpoint in {directory}: "
            f"it does not fit {_describe(axes)} (saved with another --mesh?)[/]"
        )
        console.print(str(e), markup=False, highlight=False)
        raise _Stop(1) from None
    console.print(
        f"resumed from step {latest} (the optimizer's step: {int(optimizer.step[...])}) "
        f"of the checkpoint in {directory}"
    )
    return latest, model, optimizer


def new_model(axes: Mapping[AxisName, int]) -> MLP:
    """The model the job trains on ``axes``: the MLP, 16 hidden units per ``model``
    device; with ``stage``, `DeepMLP` (`LAYERS` blocks, `microbatches`); with
    ``expert``, `ExpertMLP` (`MOE_LAYERS` blocks of `EXPERTS` experts).

    >>> type(new_model({'stage': 4, 'data': 2})).__name__
    'DeepMLP'
    >>> new_model({'expert': 4, 'data': 2}).blocks[0].gate.shape
    (8, 16, 32)
    """
    if "expert" in axes:  # the experts' hidden units over `model`, the rest replicated
        return ExpertMLP(
            DIN, 16, DOUT, layers=MOE_LAYERS, experts=EXPERTS, k=TOP_K,
            mlp=EXPERT_MLP * axes.get("model", 1), rngs=nnx.Rngs(0),
        )  # fmt: skip
    hidden = 16 * axes.get("model", 1)
    if "stage" in axes:
        return DeepMLP(
            DIN, hidden, DOUT, layers=LAYERS, microbatches=microbatches(axes), rngs=nnx.Rngs(0)
        )
    return MLP(DIN, hidden, DOUT, rngs=nnx.Rngs(0))


def _describe(axes: Mapping[AxisName, int]) -> str:
    hidden = 16 * axes.get("model", 1)
    if "expert" in axes:
        mlp = EXPERT_MLP * axes.get("model", 1)
        return (
            f"MLP {DIN} -> 16 -> {MOE_LAYERS} residual MoE blocks ({EXPERTS} experts of "
            f"16 -> {mlp} -> 16, top-{TOP_K}) -> {DOUT}, loss + {AUX_WEIGHT:g} x load "
            f"balancing, sequences of {SEQ} tokens"
        )
    if "stage" in axes:
        return f"MLP {DIN} -> {hidden} -> {LAYERS} residual blocks of {hidden} -> {DOUT}"
    return f"MLP {DIN} -> {hidden} -> {DOUT}"


def _model_and_optimizer(axes: Mapping[AxisName, int]) -> tuple[MLP, nnx.Optimizer[MLP]]:
    model = new_model(axes)
    return model, make_optimizer(model)


def _train(
    progress: Progress,
    label: str,
    step: Step,
    model: MLP,
    optimizer: nnx.Optimizer[MLP],
    batches: Sequence[Batch],
    steps: int,
    sharding: NamedSharding | None = None,
    *,
    first: int = 0,
    manager: Manager | None = None,
) -> np.ndarray:
    """Steps ``first`` to ``steps`` (batch ``i % len(batches)`` at step ``i``); their
    losses. With a ``manager``, saves ``(model, optimizer)`` after every `SAVE_EVERY`
    steps and after the last."""
    task = progress.add_task(label, total=steps, completed=first, loss="-")
    every = max(1, steps // 50)

    def on_step(i: int, loss: Array) -> None:
        done = first + i + 1
        if done % every == 0 or done == steps:
            progress.update(task, completed=done, loss=f"{float(loss):.6f}")
        if manager is not None and (done % SAVE_EVERY == 0 or done == steps):
            manager.save(done, (model, optimizer))

    k = first % len(batches)  # rotated so that the run's first batch is step `first`'s
    rotated = [*batches[k:], *batches[:k]]
    return train_steps(
        step, model, optimizer, rotated, steps - first, sharding=sharding, on_step=on_step
    )


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
