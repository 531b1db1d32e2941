"""`jit`: ``jax.jit`` over NNX graph nodes, with NNX semantics."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ParamSpec, TypeAlias, TypeVar, overload

import jax

from . import _errors
from ._callpath.argnums import COMPILER_KEYWORDS, JIT_DEFAULTS, read_argnums, shift_argnums
from ._callpath.call import CachedCall, PartialRun
from ._callpath.jit_body import make_inner
from ._callpath.outside import CallPlan, CallSpec, check_statics, partition_args
from ._callpath.simple import SimpleCall, check_prefix, node_prefixes, resolve_mode, unique_leaves
from ._jit_partial.cached_partial import CachedPartials, partial_of_jit
from ._nodes import bound_node
from ._sharding import accept_flax, prefixes
from ._stages import Lowered, Traced
from ._types import Device

P = ParamSpec("P")
R = TypeVar("R")
Shardings: TypeAlias = Any
"""A pytree prefix of shardings, PartitionSpecs, `StateSharding`s and Nones."""


class JitWrapped(CachedCall[P, R]):
    """A jitted function over NNX graph nodes; what `jit` returns.

    Call it like the wrapped function. ``trace``, ``lower`` and ``eval_shape``
    take the same arguments and return the stage objects or abstract outputs.
    """

    def __init__(self, fun: Callable[P, R], **options: Any):
        """``options``: ``jax.jit``'s keywords, as `jit` takes them (`JIT_DEFAULTS`)."""
        if unknown := sorted(set(options) - set(JIT_DEFAULTS)):
            raise TypeError(f"JitWrapped() got an unexpected keyword argument {unknown[0]!r}")
        o = {**JIT_DEFAULTS, **options}
        in_shardings, out_shardings = o["in_shardings"], o["out_shardings"]
        static_argnums, donate_argnums = o["static_argnums"], o["donate_argnums"]
        if not callable(fun):
            raise TypeError(_errors.not_callable("jit", fun))
        owner = bound_node(fun)
        if owner is not None:  # a bound method of a graph node: the node is args[0]
            fun = fun.__func__  # type: ignore[attr-defined]
            static_argnums, donate_argnums = (
                shift_argnums(static_argnums),
                shift_argnums(donate_argnums),
            )
        static, donate = read_argnums(
            "jit", fun, {**o, "static_argnums": static_argnums, "donate_argnums": donate_argnums}
        )
        in_shardings, out_shardings = prefixes("jit", in_shardings, out_shardings, static[0])
        spec = CallSpec(
            "jit",
            *static,
            *donate,
            in_shardings=accept_flax(in_shardings),
            out_shardings=accept_flax(out_shardings),
        )
        super().__init__(fun, spec)
        if owner is not None:
            self._bound = (owner,)
        self._partials = CachedPartials()  # for nnx.cached_partial's calls
        self._jit_options = {k: o[k] for k in COMPILER_KEYWORDS}

    def _cached_partial(
        self, cache: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> PartialRun[R] | None:
        if self._bound:
            return None
        return self._partials.find(
            lambda clones: partial_of_jit(self.fun, clones, self._spec, self._jit_options),
            cache,
            args,
            kwargs,
        )

    def _build(self, plan: CallPlan) -> Callable[..., Any]:
        options: dict[str, Any] = {k: v for k, v in self._jit_options.items() if v}
        if any(s is not None for s in plan.shardings):
            options["in_shardings"] = plan.partition(plan.shardings)
        if any(plan.donate):
            options["donate_argnums"] = 0
        return jax.jit(make_inner(self.fun, plan), **options)


class SimpleJitWrapped(JitWrapped[P, R]):
    """`JitWrapped` on flax's simple path: ``graph=False`` (tree mode) or
    ``graph_updates=False`` (`simple`). Only Variable values come back to the caller."""

    def __init__(
        self,
        fun: Callable[P, R],
        options: Mapping[str, Any],
        *,
        graph: bool,
        graph_updates: bool,
    ):
        """``options``: ``jax.jit``'s keywords (`JIT_DEFAULTS` fills the missing ones)."""
        o = {**JIT_DEFAULTS, **options}
        in_shardings, out_shardings = o["in_shardings"], o["out_shardings"]
        if not callable(fun):
            raise TypeError(_errors.not_callable("jit", fun))
        functools.update_wrapper(self, fun)
        self.graph, self.graph_updates = graph, graph_updates
        if (owner := bound_node(fun)) is not None:
            raise ValueError(_errors.bound_method_simple("jit", type(owner).__name__))
        self._bound: tuple[Any, ...] = ()
        self.fun = fun
        static, donate = read_argnums("jit", fun, o)
        check_prefix("jit", "in_shardings", in_shardings, graph)
        check_prefix("jit", "out_shardings", out_shardings, graph)
        try:  # how `export` reads this function's arguments (as in the graph mode)
            in_prefix, out_prefix = prefixes("jit", in_shardings, out_shardings, static[0])
        except (TypeError, ValueError):  # a tree prefix of a graph node: not exported
            in_prefix = out_prefix = None
        self._spec = CallSpec(
            "jit", *static, *donate, in_shardings=in_prefix, out_shardings=out_prefix
        )
        groups = unique_leaves(in_shardings)
        if None not in groups:
            groups.append(None)  # the keyword arguments'
        arg_prefix = in_shardings
        if isinstance(in_shardings, (tuple, list)) and static[0]:
            expanded = list(in_shardings)  # jax's in_shardings skip the static arguments
            for i in sorted(static[0]):
                expanded.insert(i, None)
            arg_prefix = tuple(expanded)

        def keep(name: str, path: tuple[Any, ...]) -> bool:  # donated: comes back
            key = getattr(path[0], "idx", getattr(path[0], "key", None)) if path else None
            return key in (donate[0] if name == "args" else donate[1])

        self._call = SimpleCall(
            "jit", fun, graph, {"args": arg_prefix, "kwargs": None}, groups, keep, out_shardings
        )
        call = self._call

        @functools.wraps(fun)
        def inner(*args: Any, **kwargs: Any) -> Any:
            return call.inner(*args, **kwargs)

        self._jitted = jax.jit(
            inner,
            # graph mode: each nnx.prefix(..., graph=True) as the TreeNode of its node
            in_shardings=node_prefixes(in_shardings),
            out_shardings=(node_prefixes(out_shardings), groups),
            **{k: o[k] for k in JIT_DEFAULTS if k not in ("in_shardings", "out_shardings")},
        )

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._spec.static_argnums or self._spec.static_argnames:
            self._check_statics(args, kwargs)
        return self._call.run(self._jitted, (*self._bound, *args), kwargs)

    def _check_statics(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A static graph node or unhashable value, named as the graph mode names it."""
        _, _, _, statics = partition_args(self._spec, args, kwargs)
        check_statics("jit", statics)

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs, _ = self._call.prepare((*self._bound, *args), kwargs, not self.graph)
        out, _ = self._jitted.eval_shape(*args, **kwargs)
        return self._call.finish(out)

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Traces for these arguments; see `jax.stages.Traced`."""
        args, kwargs, _ = self._call.prepare((*self._bound, *args), kwargs, not self.graph)
        return Traced(self._jitted.trace(*args, **kwargs), self._call)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Traces and lowers for these arguments; see `jax.stages.Lowered`."""
        return self.trace(*args, **kwargs).lower()


@overload
def jit(
    fun: Callable[P, R],
    *,
    in_shardings: Shardings = None,
    out_shardings: Shardings = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    keep_unused: bool = False,
    device: Device | None = None,
    backend: str | None = None,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> JitWrapped[P, R]: ...
@overload
def jit(
    fun: None = None,
    *,
    in_shardings: Shardings = None,
    out_shardings: Shardings = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    keep_unused: bool = False,
    device: Device | None = None,
    backend: str | None = None,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Callable[[Callable[P, R]], JitWrapped[P, R]]: ...
def jit(
    fun: Callable[P, R] | None = None,
    *,
    in_shardings: Shardings = None,
    out_shardings: Shardings = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    keep_unused: bool = False,
    device: Device | None = None,
    backend: str | None = None,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """``jax.jit`` for functions of NNX graph nodes; call-compatible with ``flax.nnx.jit``.

    Arguments and outputs may mix arrays and graph nodes (Modules, Variables, Rngs,
    Optimizers, ``nnx.List``/``nnx.Dict``) at any depth. Shared references are kept;
    Variable updates and structure changes made inside reach the caller's objects;
    an output that is an input object comes back as that very object.

    Args:
      fun: the function; omit it to use ``jit(...)`` as a decorator factory.
      in_shardings: pytree prefix of the positional arguments; at a graph node a
        `StateSharding` (flax's ``nnx.StateSharding`` is converted into one), or one
        Sharding/PartitionSpec/None for all its Variables.
      out_shardings: the same for the output.
      static_argnums, static_argnames, donate_argnums, donate_argnames: as in
        ``jax.jit``; a donated module's Variables receive the new buffers. As with
        ``jax.jit``, donated buffers are consumed when the program starts, so a
        call that fails at run time leaves the donated Variables holding deleted
        arrays (values lost).
      keep_unused, device, backend, inline, compiler_options: as in ``jax.jit``.
      graph: as in ``flax.nnx.jit``: True runs the graph protocol above; False is
        flax's tree mode (graph nodes are pytrees: no shared Variables, no input
        Variable returned, only Variable values come back, an output node is a new
        object). None (the default) takes ``nnx.set_graph_mode``'s context, then
        flax's config, when `jit` is called.
      graph_updates: as in ``flax.nnx.jit``: with ``graph=True``, False keeps shared
        references but, as in tree mode, brings back only Variable values (no
        structure changes, no `StateSharding`). None: ``nnx.set_graph_updates``'s
        context, then flax's config.

    Returns:
      A `JitWrapped`.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import nnx_sharding
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> @nnx_sharding.jit
    ... def forward(model, x):
    ...     return model(x)
    >>> forward(model, jnp.ones((1, 2))).shape
    (1, 3)
    """
    given = locals()  # the keywords above, by name
    options: dict[str, Any] = {name: given[name] for name in JIT_DEFAULTS}
    graph, graph_updates = resolve_mode(graph, graph_updates)  # once, as flax does

    def make(f: Callable[P, R]) -> JitWrapped[P, R]:
        if graph and graph_updates:
            return JitWrapped(f, **options)
        return SimpleJitWrapped(f, options, graph=graph, graph_updates=graph_updates)

    return make if fun is None else make(fun)
