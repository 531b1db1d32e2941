"""Messages of `nnx_sharding.checkpoint`: save, restore and the Manager."""

from __future__ import annotations

from collections.abc import Sequence

from .layout import format_message, listing, mesh_fixes, with_article

_SAVABLE_FIXES = {
    "node": "pass the modules themselves, e.g. `save(path, (model, optimizer))`;",
    "variable": "put the Variable in a graph node or a container, e.g. "
    "`save(path, nnx.Dict(w=variable))` or `save(path, {'w': variable})`;",
    "empty": "give a tree whose modules hold Variables (parameters, statistics, ...);",
    "outside": "hold an array a module keeps in a Variable, e.g. `self.x = nnx.Variable(x)`, "
    "or leave that module out of the tree;",
    "other": "hold a plain Python value in a Variable as an array, e.g. "
    "`nnx.Variable(jnp.asarray(3))`, or keep it out of Variables;",
    "abstract": "to save an abstract model (`nnx.eval_shape`), give it values first, e.g. with "
    "`checkpoint.restore` or by building it for real;",
    "tracer": "save and restore outside jit: call them before or after the jitted step;",
    "deleted": "save the objects a donating call updated (`nnx_sharding.jit` writes the new "
    "arrays back into your Variables), not arrays kept from before the call;",
    "ref": "make the Variable without `ref=True`: checkpoints read and write plain arrays, and "
    "jax updates a Ref's array in place;",
}
"""A fix for each kind of problem `not_savable` lists (`value_problem`'s kinds and more)."""


def not_savable(transform: str, argument: str, problems: Sequence[tuple[str, str]]) -> str:
    """The tree holds something other than graph nodes of arrays. ``problems``: ``(kind,
    text)`` pairs; a kind is a key of `_SAVABLE_FIXES` and picks the fixes shown."""
    kinds = dict.fromkeys(kind for kind, _ in problems)
    return format_message(
        transform,
        argument,
        [text for _, text in problems],
        "Rule: the tree is a pytree (a module, a tuple, a dict, ...) of graph nodes "
        "(Modules, Optimizers, Rngs, nnx.Dict/nnx.List) whose Variables hold concrete "
        "arrays; the checkpoint holds their whole `nnx.state`, by path.",
        [_SAVABLE_FIXES[kind] for kind in kinds],
    )


def checkpoint_exists(transform: str, directory: str, step: int | None = None) -> str:
    what = f"step {step} already exists in {directory}" if step is not None else directory
    found = (
        f"the checkpoint {what}" if step is not None else f"a checkpoint already exists at {what}"
    )
    return format_message(
        transform,
        "directory" if step is None else "step",
        [found],
        "Rule: a save never replaces an existing checkpoint unless asked to, so that a "
        "mistyped path cannot destroy a good checkpoint.",
        [
            "pass `force=True` to replace it;",
            "or save elsewhere: a new directory"
            + (", or a new step number." if step is not None else "."),
        ],
    )


def overwrite_foreign(transform: str, directory: str, found: Sequence[str] | None) -> str:
    """``found``: what the directory holds; None when ``directory`` is a file."""
    problem = (
        f"{directory} is a file, not a directory"
        if found is None
        else f"{directory} exists and holds {listing(found)}, which is not a "
        "checkpoint written by nnx_sharding.checkpoint"
    )
    return format_message(
        transform,
        "directory",
        [problem],
        "Rule: save writes into a new or empty directory; `force=True` replaces a "
        "checkpoint, never a directory of other files (it would delete them).",
        [
            "save into a new directory, e.g. `directory / 'checkpoint'`;",
            "or empty or remove that directory yourself if its files are not needed.",
        ],
    )


def checkpoint_not_found(transform: str, directory: str) -> str:
    return format_message(
        transform,
        "directory",
        [f"nothing exists at {directory}"],
        "Rule: directory is the one a `checkpoint.save` wrote (for a Manager, the step's "
        "directory inside the Manager's, or use `Manager.restore`).",
        [
            "check the path (relative paths are taken from the current directory);",
            "for checkpoints written by a Manager, use "
            "`checkpoint.Manager(directory).restore(target)`.",
        ],
    )


def incomplete_checkpoint(transform: str, directory: str) -> str:
    return format_message(
        transform,
        "directory",
        [f"{directory} is a checkpoint whose save never finished"],
        "Rule: orbax writes a checkpoint into a temporary directory and commits it (renames "
        "it) only once every array is written; a save interrupted before that leaves an "
        "uncommitted directory, which is never restored.",
        [
            "restore the previous checkpoint, e.g. `Manager(directory).restore(target)` "
            "(it offers only committed steps);",
            "delete the uncommitted directory, which nothing can read.",
        ],
    )


def foreign_checkpoint(
    transform: str, directory: str, found: Sequence[str] | None, steps: Sequence[int] = ()
) -> str:
    """``found``: what the directory holds; None when it is a file."""
    if steps:
        problem = f"{directory} holds the Manager steps {listing(steps)}, not one checkpoint"
    elif found is None:
        problem = f"{directory} is a file, not a checkpoint directory"
    else:
        held = listing(found) if found else "nothing"
        problem = (
            f"{directory} is not a checkpoint written by nnx_sharding.checkpoint (it holds {held})"
        )
    fixes = (
        [
            "restore through the Manager: `checkpoint.Manager(directory).restore(target)` "
            "(the latest step) or `.restore(target, step=n)`;",
            f"or give the step's directory, e.g. `restore(directory / '{steps[-1]}', target)`.",
        ]
        if steps
        else [
            "give the directory that `checkpoint.save` wrote;",
            "a checkpoint written by orbax directly can be read with orbax's "
            "`StandardCheckpointer().restore(directory, nnx.state(target))`.",
        ]
    )
    return format_message(
        transform,
        "directory",
        [problem],
        "Rule: a checkpoint of this package is an orbax checkpoint with two items, 'state' "
        "(the arrays, by Variable path) and 'nnx' (what was saved, as JSON).",
        fixes,
    )


def no_steps(transform: str, directory: str) -> str:
    return format_message(
        transform,
        "step",
        [f"no committed checkpoint step exists in {directory}"],
        "Rule: with step=None, restore reads the latest step the Manager has committed; "
        "steps whose save was interrupted are never offered.",
        [
            "check the directory, or save a step first (`manager.save(step, tree)`);",
            "to start from scratch when there is none, test `manager.latest_step() is None`.",
        ],
    )


def unknown_step(transform: str, directory: str, step: int, steps: Sequence[int]) -> str:
    return format_message(
        transform,
        "step",
        [f"no committed checkpoint for step {step} exists in {directory}"],
        "Rule: restore reads a step the Manager has committed; it has "
        + (listing(steps) if steps else "none")
        + " (max_to_keep deletes the oldest).",
        [
            "pass one of those steps, or step=None for the latest;",
            "check the directory the Manager was made with.",
        ],
    )


def bad_step(transform: str, step: object) -> str:
    return format_message(
        transform,
        "step",
        [f"got {step!r} ({with_article(type(step).__name__)})"],
        "Rule: a step is an int >= 0 (the Manager names its directories after it).",
        ["pass the training step, e.g. `int(optimizer.step[...])`."],
    )


def bad_restore_filter(transform: str, filter_: object, error: BaseException) -> str:
    return format_message(
        transform,
        "filter",
        [f"{filter_!r} is not an nnx filter ({type(error).__name__}: {error})"],
        "Rule: filter selects the Variables to restore; it is anything nnx accepts: a "
        "Variable type, a tag string, a predicate `(path, variable) -> bool`, `...`, a "
        "tuple of these.",
        [
            "use a Variable type, e.g. `filter=nnx.Param`, or `nnx.PathContains('encoder')`;",
            "or None (the default) to restore everything.",
        ],
    )


def mismatch_detail(kind: str, path: str, here: str = "", there: str = "") -> str:
    """One problem for `checkpoint_mismatch`. ``kind``: missing, extra, shape or dtype;
    ``here``/``there``: what the target and the checkpoint have."""
    return {
        "missing": f"{path}: the target has {here}, the checkpoint has no Variable there",
        "extra": f"{path}: the checkpoint has {there}, the target has no Variable there",
        "shape": f"{path}: shape {here} in the target, {there} in the checkpoint",
        "dtype": f"{path}: dtype {here} in the target, {there} in the checkpoint",
    }[kind]


def checkpoint_mismatch(
    transform: str, directory: str, problems: Sequence[str], dtypes: bool = False
) -> str:
    """``dtypes``: some problem is a dtype that differs (a fix says how to change one)."""
    cast = (
        [
            "to change a dtype, restore into a target of the saved dtype, then cast, e.g. "
            "`nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), "
            "nnx.state(model)))`."
        ]
        if dtypes
        else []
    )
    return format_message(
        transform,
        "target",
        list(problems),
        f"Rule: the target has the structure of what was saved in {directory}: the same "
        "Variables at the same paths, with the same shapes and dtypes (with filter=..., the "
        "Variables it selects). Nothing was read or changed.",
        [
            "build the target as the saved tree was built (same modules, sizes and "
            "optimizer), e.g. with `nnx.eval_shape(lambda: ...)`;",
            "or restore part of it: `filter=nnx.Param` reads only the parameters, and "
            "Variables of the checkpoint it does not select are not read;",
            *cast,
        ],
    )


def abstract_not_restored(transform: str, paths: Sequence[str]) -> str:
    return format_message(
        transform,
        "filter",
        [f"{p} is abstract (a jax.ShapeDtypeStruct) and the filter leaves it out" for p in paths],
        "Rule: restore returns a concrete tree; a Variable the filter does not select keeps "
        "the target's value, so in an abstract target (`nnx.eval_shape`) every Variable "
        "must be restored.",
        [
            "widen the filter to cover them, or leave filter out to restore everything;",
            "or restore into a concrete target (e.g. a freshly initialized model), whose "
            "other Variables keep their values.",
        ],
    )


def unplaceable(transform: str, problems: Sequence[str]) -> str:
    """Shardings (given, or from sharding metadata) that jax cannot build on the mesh."""
    return format_message(
        transform,
        "shardings",
        list(problems),
        "Rule: every mesh axis a PartitionSpec names (given in shardings, or from a "
        "Variable's sharding metadata) exists in the mesh it is bound to, at most once a spec.",
        [
            "name the mesh's axes, or call restore under the mesh the specs were written for "
            "(`with jax.set_mesh(mesh):`);",
            "for logical axis names in metadata (`nnx.with_partitioning`), map them with "
            "`nnx.logical_axis_rules` or `StateSharding.from_metadata(target, rules=...)`;",
            "or give the shardings yourself: `shardings=StateSharding({...})`.",
        ],
    )


def no_mesh_for_restore(transform: str, problems: Sequence[str], mesh_set: bool = False) -> str:
    """``mesh_set``: a mesh is set, but the abstract shardings are on another one."""
    fixes = mesh_fixes(
        "call restore",
        "StateSharding({nnx.Param: NamedSharding(mesh, P('model')), "
        "...: NamedSharding(mesh, P())})",
    )
    if mesh_set:
        fixes[0] = (
            "make the target under the mesh restore runs under, e.g. `with jax.set_mesh(mesh): "
            "target = nnx.eval_shape(...)`, or give shardings for it;"
        )
    return format_message(
        transform,
        "shardings",
        list(problems),
        "Rule: restore places every array on devices; a PartitionSpec (from shardings or "
        "from sharding metadata) or a sharding on an abstract mesh is bound to the mesh set "
        "with `jax.set_mesh`, which must be that abstract mesh's.",
        fixes,
    )


def mixed_target(
    transform: str, abstract_paths: Sequence[str], concrete_paths: Sequence[str]
) -> str:
    return format_message(
        transform,
        "target",
        [
            f"{listing(abstract_paths, 3)} abstract (jax.ShapeDtypeStruct), but "
            f"{listing(concrete_paths, 3)} concrete"
        ],
        "Rule: a target is abstract (restore returns a new tree) or concrete (restore "
        "updates it in place), not both: in a mixed one, the concrete part would not be "
        "the objects restored.",
        [
            "make all of it abstract, e.g. `nnx.eval_shape(lambda: (Model(...), optimizer))`;",
            "or all of it concrete, e.g. build the optimizer for real.",
        ],
    )


def not_a_node_problem(where: str, type_name: str) -> str:
    """A problem for `not_savable`: a pytree leaf of the tree that is not a graph node."""
    return f"{where} is {with_article(type_name)}, not a graph node"


def bare_variable_problem(where: str, type_name: str) -> str:
    """A problem for `not_savable`: a Variable given as the whole tree."""
    alone = f"{where} is {with_article(type_name)} alone"
    return f"{alone}: a Variable is saved by its path in a graph node"


def no_variables_problem(argument: str) -> str:
    """A problem for `not_savable`: the tree has graph nodes but no Variable in them."""
    return f"{argument} has no Variables: there is nothing to save or restore"


def array_outside_variable_problem(where: str, type_name: str) -> str:
    """A problem for `not_savable`: an array held by a graph node outside any Variable."""
    return (
        f"{where} is {with_article(type_name)} held outside a Variable (`nnx.data`); checkpoints "
        "hold Variables: wrap it, e.g. `nnx.Variable(value)`, or leave it out of the tree"
    )


def selects_nothing(transform: str, filter_: object) -> str:
    return format_message(
        transform,
        "filter",
        [f"the filter {filter_!r} selects none of the target's Variables"],
        "Rule: a filter says which of the target's Variables to restore; one that selects "
        "none would restore nothing, which is never what was meant.",
        [
            "check the filter against the target, e.g. `nnx.state(target, filter)`;",
            "or restore everything: `filter=None`.",
        ],
    )


def value_problem(kind: str, var_type: str, where: str, value_type: str = "") -> str:
    """A problem for `not_savable`: the Variable at ``where`` holds no savable array.
    ``kind``: abstract, tracer, deleted, ref or other (``value_type``: what it holds)."""
    return (
        f"the {var_type} at {where} "
        + {
            "abstract": "is abstract (a jax.ShapeDtypeStruct): it has no values",
            "tracer": "is a tracer: checkpoints are written and read outside jit",
            "deleted": "has been deleted (donated to a jitted call?)",
            "ref": "is a `ref=True` Variable (its value is a jax Ref)",
            "other": f"holds {with_article(value_type)}, not an array",
        }[kind]
    )


def describe_variable(type_name: str, shape: Sequence[int], dtype: str) -> str:
    """``a Param of shape (2, 3) float32``, for `mismatch_detail`."""
    return f"{with_article(type_name)} of shape {tuple(shape)} {dtype}"


def empty_checkpoint_path(transform: str, text: str) -> str:
    return format_message(
        transform,
        "directory",
        [f"the path is empty ({text!r})"],
        "Rule: a checkpoint directory is named; an empty path would mean the current "
        "directory, and save would write into it.",
        ["name a directory, e.g. `checkpoint.save('checkpoints/run1', model)`."],
    )


def manager_not_a_directory(transform: str, directory: str) -> str:
    return format_message(
        transform,
        "directory",
        [f"{directory} is a file, not a directory"],
        "Rule: a Manager keeps its steps in a directory of their own, which it creates if missing.",
        ["give a new directory, or one a Manager wrote, e.g. `Manager('checkpoints/run1')`."],
    )


def manager_on_checkpoint(transform: str, directory: str) -> str:
    return format_message(
        transform,
        "directory",
        [f"{directory} is a checkpoint written by checkpoint.save, not a Manager's directory"],
        "Rule: a Manager keeps numbered steps in a directory of their own; a single "
        "checkpoint is read with `checkpoint.restore`.",
        [
            "read it with `checkpoint.restore(directory, target)`;",
            "give the Manager a new directory, e.g. `Manager('checkpoints/run1')`.",
        ],
    )


def manager_foreign(transform: str, directory: str, found: Sequence[str]) -> str:
    return format_message(
        transform,
        "directory",
        [
            f"{directory} holds {listing(found)}, which a Manager did not write "
            "(a Manager's directory holds numbered steps only)"
        ],
        "Rule: a Manager writes its steps into a new or empty directory, or one it wrote "
        "before; it never mixes them with other files.",
        [
            "give the Manager a directory of its own, e.g. `directory / 'checkpoints'`;",
            "or move those files elsewhere if they belong there by mistake.",
        ],
    )


def write_failed(transform: str, directory: str, cause: str) -> str:
    return format_message(
        transform,
        "directory",
        [f"could not write the checkpoint {directory}: {cause}"],
        "Rule: a checkpoint is committed only once every file is written; what this save "
        "wrote was removed, and the checkpoints saved before are as they were.",
        [
            "check that the directory is writable and its disk has room (`df -h`), then "
            "save again;",
            "or save to another directory.",
        ],
    )


def variable_types_differ(transform: str, directory: str, problems: Sequence[str]) -> str:
    return format_message(
        transform,
        "target",
        list(problems),
        f"Rule: each Variable is restored into a Variable of the type saved in {directory} "
        "(a Param into a Param): a value restored into another type would be trained, "
        "or not, against its meaning. Nothing was read or changed.",
        [
            "build the target as the saved tree was built (same modules and Variable types);",
            "or, to restore values into Variables of another type on purpose, pass "
            "`allow_type_change=True`.",
        ],
    )


def type_detail(path: str, here: str, there: str) -> str:
    """One problem for `variable_types_differ`."""
    return f"{path}: {with_article(here)} in the target, {with_article(there)} in the checkpoint"


def damaged_checkpoint(transform: str, directory: str, paths: Sequence[str], cause: str) -> str:
    """``paths``: the Variables whose stored data failed to read (may be empty)."""
    problems = [f"the data of {p} is damaged or missing ({cause})" for p in paths] or [
        f"the data of {directory} is damaged or missing ({cause})"
    ]
    return format_message(
        transform,
        "directory",
        problems,
        f"Rule: every chunk of every array is stored with its checksum (CRC-32C), checked "
        f"when it is read; the data in {directory} no longer matches what was saved, or a "
        "file is cut short. Nothing was changed: the target is as it was.",
        [
            "restore an earlier checkpoint, e.g. `manager.restore(target, step=...)` with "
            "an older step;",
            "or copy the checkpoint again from where it came from (a backup, the bucket).",
        ],
    )
