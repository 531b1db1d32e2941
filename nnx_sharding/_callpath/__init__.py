"""The call path every transform shares: a call of graph nodes across the jax boundary.

A call ``f(*args)`` whose arguments hold NNX graph nodes crosses jax in four steps,
flax's ``update_context`` protocol: `outside` splits the call into arrays (1) and merges
the results back (4); `inside` merges fresh copies inside the traced program (2) and
splits them again after the function ran (3). `jit_body` is the function `jit` has jax
trace; `call` (`CachedCall`) runs one call, trying the fast path first; `boundary` calls
jax and names what jax says in the caller's terms; `changes` finds what a call changed;
`argnums` reads static and donated argument numbers; `simple` is the simple path, flax's
``graph=False`` (tree mode) and ``graph_updates=False``.
"""
