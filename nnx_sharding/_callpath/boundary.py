"""The jax boundary: calling a call plan's jax-level function, and naming what jax says.

jax sees one flat list of arrays; its errors name a position in it (``kept[3]``), a
deleted (donated) buffer or a committed argument on another sharding. `call_flat`
re-raises them naming the caller's arguments and Variable paths. `host_callbacks` says
whether a program runs Python when it runs; `check_writable` applies flax's rule on
which trace level may write a Variable before anything is written back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx
from flax.errors import TraceContextError
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh

from .. import _errors
from .._sharding import incompatible_shardings, mismatched_shardings
from .outside import CallPlan, Leaf, Site


def call_flat(
    fn: Callable[..., Any],
    plan: CallPlan,
    leaves: Sequence[Leaf],
    sites: Sequence[Site],
    mesh: Mesh | AbstractMesh | None = None,
) -> Any:
    """Calls a jax-level function (jitted, traced or compiled) on the flat leaves.

    jax's errors about one flat argument (``kept[3]``), a deleted (donated) buffer or
    a committed argument on another sharding are re-raised naming the caller's
    arguments and Variable paths instead. ``mesh`` is the one specs refer to (None:
    the context mesh).
    """
    try:
        return fn(*plan.partition(leaves))
    except (ValueError, TypeError, RuntimeError) as e:
        spec = plan.spec
        if deleted := deleted_leaves(e, leaves):
            message = _errors.deleted_buffers(
                spec.transform, [str(sites[i]) for i in deleted], str(e)
            )
            raise RuntimeError(message).with_traceback(e.__traceback__) from None
        if isinstance(e, RuntimeError):
            raise
        named = _errors.name_leaves(str(e), *plan.partition(sites))
        if wrong := incompatible_shardings(leaves, plan.shardings, sites, mesh):
            message = _errors.bad_shardings(spec.transform, spec.in_name, wrong, named)
        elif "does not match the sharding" in str(e) and (
            moved := mismatched_shardings(leaves, plan.shardings, sites, mesh)
        ):
            message = _errors.sharding_mismatch(spec.transform, spec.in_name, moved)
        elif named != str(e):
            message = named
        else:
            raise
        raise type(e)(message).with_traceback(e.__traceback__) from None


CALLBACKS = frozenset({"debug_callback", "io_callback", "pure_callback"})
"""The primitives that run Python when the program runs."""


def host_callbacks(jaxpr: Any) -> bool:
    """Whether a ``jax.extend.core.Jaxpr``, its sub-jaxprs included, has a host callback."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in CALLBACKS:
            return True
        for param in eqn.params.values():
            for value in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns") and host_callbacks(inner):
                    return True
    return False


_DELETED = re.compile(r"(Array|Buffer) has been deleted")


def deleted_leaves(error: BaseException, leaves: Sequence[Leaf]) -> list[int]:
    """The indices of the deleted arrays among ``leaves``, if ``error`` is jax's
    complaint about one (else none): called on the error path only."""
    if not isinstance(error, (ValueError, RuntimeError)) or not _DELETED.search(str(error)):
        return []
    return [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.is_deleted()
    ]


def check_writable(transform: str, items: Sequence[Any], sites: Sequence[Site]) -> None:
    """Raises flax's ``TraceContextError`` before anything is written if a Variable
    among ``items`` cannot be written at the current trace level (our call runs inside
    an outer ``jax.jit``/``jax.grad`` over a module it closes over).

    Each Variable is written its own value: flax's own check, and otherwise a no-op.
    """
    wrong = []
    for item, site in zip(items, sites, strict=True):
        if isinstance(item, nnx.Variable):
            try:
                item.set_raw_value(item.get_raw_value())
            except TraceContextError:
                wrong.append(str(site))
    if wrong:
        raise TraceContextError(_errors.wrong_trace_level(transform, wrong))
