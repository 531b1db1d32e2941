"""`jit_partial`: ``jax.jit`` with graph-node arguments flattened once, when it is made.

flax's contract (``nnx.jit_partial``): the partial arguments are split into their
Variables once; each call passes the Variables' current values into the program and
writes the values the program changed back into those same Variables. Their structure
is taken as fixed: a Variable or submodule attached after `jit_partial` is not seen,
and a structure change made inside the function is not written back. In exchange a
call costs little more than a ``jax.jit`` call over the flat arrays: one C-level read
of the values, jax's dispatch, one C-level write of the changed values (`slots`).

The split and merge are `outside`'s (``nnx.split_context``/``merge_context``), so graph
mode keeps shared Variables shared; tree mode (``graph=False``) refuses them, as flax.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import jax

from .. import _errors
from .._callpath.argnums import JIT_DEFAULTS
from .._callpath.boundary import check_writable, host_callbacks
from .._callpath.outside import Leaf
from .._callpath.simple import resolve_mode
from .._fastpath import slots as _slots
from .._fastpath.cache import trace_state
from .._nodes import is_variable
from .._sharding import accept_flax, incompatible_shardings, mismatched_shardings
from .._types import Device
from .split import TRANSFORM, check_tree_aliases, split_partial
from .trace import Result, make_inner, rebuild_output

R = TypeVar("R")

_GRAPH_UPDATES = (
    "with graph=True and graph_updates=True, a structure change the function makes to a "
    "partial argument would have to reach your objects, but jit_partial flattened them "
    "once and does not walk them again"
)


def _inner_signature(
    fun: Callable[..., Any], n_partial: int, n_values: int
) -> inspect.Signature | None:
    """``fun``'s signature with its first ``n_partial`` positional parameters replaced by
    the ``n_values`` values the program takes in their place: jax resolves argnames
    against it."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    k = 0
    while k < len(params) and k < n_partial and params[k].kind in positional:
        k += 1
    if k < n_partial and not any(p.kind is p.VAR_POSITIONAL for p in params):
        return None  # too many partial arguments: the call will say so
    values = [
        inspect.Parameter(f"_partial_{i}", inspect.Parameter.POSITIONAL_ONLY)
        for i in range(n_values)
    ]
    return inspect.Signature([*values, *params[k:]])


def _flat_argnums(argnums: int | Sequence[int] | None, n_values: int) -> tuple[int, ...] | None:
    """flax's argnums (``0``: the partial arguments, ``1``: a call's first argument) as
    the program counts them: the ``n_values`` partial values first, one argument each.
    None stays None (jax then infers them from the argnames)."""
    if argnums is None:
        return None
    flat: list[int] = []
    for i in _as_tuple(argnums):
        flat.extend(range(n_values) if i == 0 else [i if i < 0 else i - 1 + n_values])
    return tuple(flat)


class JitPartialWrapped(Generic[R]):
    """What `jit_partial` returns: call it with the remaining arguments."""

    def __init__(
        self,
        fun: Callable[..., R],
        partial_args: tuple[Any, ...],
        options: Mapping[str, Any],
        *,
        graph: bool | None = None,
        graph_updates: bool | None = None,
        keep_structure: str | None = None,
        transform: str = TRANSFORM,
        argument: str = "partial_args",
    ):
        """``options``: ``jax.jit``'s keywords (`JIT_DEFAULTS` fills the missing ones)."""
        o = {**JIT_DEFAULTS, **options}
        in_shardings, out_shardings = o["in_shardings"], o["out_shardings"]
        static_argnums, donate_argnums = o["static_argnums"], o["donate_argnums"]
        self._transform = transform
        self.n_partial: int = len(partial_args)
        if not callable(fun):
            raise TypeError(_errors.not_callable(TRANSFORM, fun, "model", decorator=False))
        functools.update_wrapper(self, fun)
        self.fun = fun
        # None takes flax's context (nnx.set_graph_mode, nnx.set_graph_updates)
        self.graph: bool
        self.graph_updates: bool
        self.graph, self.graph_updates = resolve_mode(graph, graph_updates)
        n = len(partial_args)
        if isinstance(in_shardings, (tuple, list)):
            partial_prefix, runtime = accept_flax(tuple(in_shardings[:n])), tuple(in_shardings[n:])
        else:
            partial_prefix, runtime = None, in_shardings
        if not self.graph:
            check_tree_aliases(partial_args)
        split = split_partial(partial_args, partial_prefix, argument)
        if bad := [
            str(s)
            for x, s in zip(split.items, split.sites, strict=True)
            if is_variable(x) and (x.ref or x.hijax)
        ]:
            raise ValueError(_errors.partial_unsupported_variable(bad))
        self._split = split
        self._variables = split.variables
        self._constants = split.constants
        self._read = _slots.value_reader()
        self._trace: Any = None  # the trace level where writing was last checked allowed
        # per trace (by id of its Result, which it keeps alive): `_learn`'s answer
        self._traces: dict[int, tuple[Result, Callable[[Sequence[Leaf]], None], bool]] = {}
        if 0 in _as_tuple(static_argnums):
            raise ValueError(_errors.partial_static(n))
        n_values = len(self._variables) + len(self._constants)
        jit_options: dict[str, Any] = {
            **{k: o[k] for k in JIT_DEFAULTS if k not in ("in_shardings", "out_shardings")},
            "static_argnums": _flat_argnums(static_argnums, n_values),
            "donate_argnums": _flat_argnums(donate_argnums, n_values),
        }
        donated = 0 in _as_tuple(donate_argnums)
        if keep_structure is None and self.graph and self.graph_updates:
            keep_structure = _GRAPH_UPDATES
        shardings = split.partial_shardings()
        if isinstance(in_shardings, (tuple, list)):
            if any(s is not None for s in shardings) or any(s is not None for s in runtime):
                jit_options["in_shardings"] = (*shardings, *runtime)
        elif in_shardings is not None:
            jit_options["in_shardings"] = in_shardings
        inner = make_inner(
            fun, split, self.graph, donated, out_shardings, keep_structure, transform, argument
        )

        @functools.wraps(inner)
        def flat(*values_and_args: Any, **kwargs: Any) -> Any:  # one argument a value: the
            # fastest way into jax's dispatch (no list to flatten)
            return inner(list(values_and_args[:n_values]), *values_and_args[n_values:], **kwargs)

        signature = _inner_signature(fun, n, n_values)
        if signature is not None:
            flat.__signature__ = signature  # type: ignore[attr-defined]
        self._jitted = jax.jit(flat, **jit_options)

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        try:
            result, written, payload = self._jitted(
                *map(self._read, self._variables), *self._constants, *args, **kwargs
            )
        except ValueError as e:
            self._explain(e)
            raise
        known = self._traces.get(id(result))  # one Result a trace: known after its first call
        if known is None:
            known = self._traces[id(result)] = self._learn(result, args, kwargs)
        _, write, waits = known
        if waits:  # errors of Python callbacks are raised before anything is written
            jax.block_until_ready((written, payload))
        if written and (level := trace_state()) != self._trace:  # a new trace level:
            self._check_writable()  # may its Variables be written? (flax's rule)
            self._trace = level
        write(written)
        if result.out_graphdefs is None:  # no graph node in the output
            return jax.tree_util.tree_unflatten(result.out_treedef, payload)
        return rebuild_output(result, payload, self._split.leaves)

    def _values(self) -> list[Leaf]:
        """The partial values of a call: the Variables' current values, then the constants."""
        return [*map(self._read, self._variables), *self._constants]

    def _explain(self, error: ValueError) -> None:
        """Re-raises jax's complaint about a partial argument's array (a sharding that
        does not fit it, or one it is committed to otherwise) naming its path."""
        partial, split = self._values(), self._split
        by_index = sorted(range(len(split.items)), key=split.order.__getitem__)
        sites = [split.sites[i] for i in by_index]
        shardings = split.partial_shardings()
        if wrong := incompatible_shardings(partial, shardings, sites):
            message = _errors.bad_shardings(self._transform, "in_shardings", wrong, str(error))
        elif "does not match the sharding" in str(error) and (
            moved := mismatched_shardings(partial, shardings, sites)
        ):
            message = _errors.sharding_mismatch(self._transform, "in_shardings", moved)
        else:
            return
        raise ValueError(message).with_traceback(error.__traceback__) from None

    def _check_writable(self) -> None:
        """Raises flax's TraceContextError, before anything is written, if a Variable of
        the partial arguments cannot be written at the current trace level (a call
        inside an outer jax transform, for Variables created outside it)."""
        split = self._split
        sites = [s for x, s in zip(split.items, split.sites, strict=True) if is_variable(x)]
        check_writable(self._transform, self._variables, sites)

    def _learn(
        self, result: Result, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Result, Callable[[Sequence[Leaf]], None], bool]:
        """What a trace's calls need: the writer of its written Variables, and whether
        its program calls back into Python (then a call waits for it)."""
        jaxpr = self._jitted.trace(*self._values(), *args, **kwargs).jaxpr
        write = _slots.writer([self._variables[i] for i in result.written])
        return result, write, host_callbacks(jaxpr.jaxpr)

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The abstract output of a call; writes nothing back."""
        result, _, payload = self._jitted.eval_shape(*self._values(), *args, **kwargs)
        return rebuild_output(result, payload, self._split.leaves)


def _as_tuple(x: Any) -> tuple[Any, ...]:
    if x is None:
        return ()
    return (x,) if isinstance(x, (int, str)) else tuple(x)


def jit_partial(
    fun: Callable[..., R],
    *partial_args: Any,
    in_shardings: Any = None,
    out_shardings: Any = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    keep_unused: bool = False,
    device: Device | None = None,
    backend: str | None = None,
    inline: bool = False,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> JitPartialWrapped[R]:
    """``jax.jit`` of ``fun`` with its first arguments bound and flattened once, as
    ``flax.nnx.jit_partial``.

    The partial arguments (modules, optimizers, Variables, arrays) are split into their
    Variables now. Each call passes the Variables' current values to the program and
    writes the values it changed back into them: updates made between calls are used,
    updates made inside reach the caller's objects. Their structure is taken as fixed:
    a Variable or submodule attached to them later is not seen, and one attached inside
    the function is dropped. Static attributes are structure too: ``model.eval()`` or
    ``model.train()`` after binding is not seen (bind one function per mode). That is
    what makes a call cheap: a read of the values, jax's dispatch and a write of the
    changed ones (no walk of the graphs). Use `jit` where the structure changes.

    Unlike flax, every ``graph``/``graph_updates`` combination is accepted: tree mode
    (``graph=False``) refuses a Variable shared by two paths, as flax does; graph mode
    keeps it shared (``graph_updates`` changes nothing here: structure is never written
    back).

    Args:
      fun: the function; its first ``len(partial_args)`` positional parameters receive
        ``partial_args``.
      *partial_args: the arguments to bind.
      in_shardings: a tuple/list: its first ``len(partial_args)`` entries are prefixes of
        the partial arguments (a sharding, PartitionSpec, None or `StateSharding` at a
        graph node), the rest those of the call's arguments; anything else applies to
        every argument, as in ``jax.jit``.
      out_shardings: as in `jit`.
      static_argnums, donate_argnums: positions as flax counts them: ``0`` is all the
        partial arguments together (``donate_argnums=0`` donates their Variables), ``1``
        the first argument of a call.
      static_argnames, donate_argnames: names of ``fun``'s parameters after the partial
        ones.
      keep_unused, device, backend, inline: as in ``jax.jit``.
      graph: graph mode (shared Variables allowed); None: ``nnx.set_graph_mode``'s value.
      graph_updates: accepted for flax's signature; None: ``nnx.set_graph_updates``'s.

    Returns:
      A `JitPartialWrapped`: call it with the remaining arguments.

    >>> import jax.numpy as jnp
    >>> import optax
    >>> from flax import nnx
    >>> import nnx_sharding
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> def train_step(model, optimizer, x, y):
    ...     loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)
    ...     loss, grads = nnx.value_and_grad(loss_fn)(model)
    ...     optimizer.update(model, grads)
    ...     return loss
    >>> step = nnx_sharding.jit_partial(train_step, model, optimizer, graph=False)
    >>> x, y = jnp.ones((4, 2)), jnp.zeros((4, 3))
    >>> bool(step(x, y) > step(x, y))  # model and optimizer are updated in place
    True
    """
    options = dict(
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        keep_unused=keep_unused,
        device=device,
        backend=backend,
        inline=inline,
    )
    return JitPartialWrapped(
        fun,
        partial_args,
        options,
        graph=graph,
        graph_updates=graph_updates,
    )
