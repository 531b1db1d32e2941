"""Hardening (issue 8), items 3 and 4: threads and leaks.

3. Threads: one `JitWrapped`, 8 threads with modules of their own, 1000 calls.
4. No leaks: 10,000 calls keep the caches and RSS flat; wrappers and modules are collected.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hardening_common import MLP, XX, Boom, Counter, X, clone, forward, named

import nnx_sharding
from nnx_sharding import StateSharding

# ======================================================================================
# 3. Threads: one JitWrapped, 8 threads, 1000 calls
# ======================================================================================


class Accumulator(nnx.Module):
    def __init__(self, start: float, size: int = 3):
        self.w = nnx.Param(jnp.full((size,), start, jnp.float32))
        self.calls = nnx.BatchStat(jnp.array(0))


def accumulate(acc, x):
    acc.calls[...] += 1
    acc.w[...] += x
    return acc, acc.w[...].sum(), acc.calls[...]


@pytest.mark.parametrize("sizes", ["one_shape", "two_shapes"])
def test_eight_threads_share_one_jit_wrapped(sizes):
    threads, calls = 8, 125
    step = nnx_sharding.jit(accumulate)
    size = (lambda t: 3) if sizes == "one_shape" else (lambda t: 3 + 2 * (t % 2))
    accs = [Accumulator(1000.0 * t, size(t)) for t in range(threads)]
    results: list[list[Any]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def work(t):
        try:
            barrier.wait()
            for i in range(1, calls + 1):
                out, total, count = step(accs[t], jnp.full((size(t),), float(i)))
                results[t].append((out is accs[t], float(total), int(count)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    for t in range(threads):
        n = size(t)
        expected = [(True, n * (1000.0 * t + i * (i + 1) / 2), i) for i in range(1, calls + 1)]
        assert results[t] == expected, f"thread {t}"
        assert int(accs[t].calls[...]) == calls
        final = 1000.0 * t + calls * (calls + 1) / 2
        np.testing.assert_array_equal(accs[t].w[...], np.full(n, final))


# ======================================================================================
# 4. No leaks
# ======================================================================================


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cache_sizes(wrapped) -> dict[str, int]:
    """The size of every cache a `JitWrapped` holds: its dicts (plans, entries) and, for
    each cached plan, the number of programs in its ``jax.jit`` cache."""
    sizes = {}
    for name, value in vars(wrapped).items():
        if isinstance(value, dict) and name.startswith("_") and not name.startswith("__"):
            sizes[name] = len(value)
            for i, item in enumerate(value.values()):
                jitted = getattr(item, "jitted", None)
                if hasattr(jitted, "_cache_size"):
                    sizes[f"{name}[{i}] jax.jit"] = jitted._cache_size()
    assert any(k.endswith("jax.jit") for k in sizes), f"no jax.jit cache found: {sizes}"
    return sizes


def test_ten_thousand_calls_keep_caches_and_memory_flat():
    step = nnx_sharding.jit(accumulate)
    acc, x = Accumulator(0.0), jnp.ones(3)
    for _ in range(500):  # warm-up: traces, compiles, allocator pools
        step(acc, x)
    gc.collect()
    sizes, rss = cache_sizes(step), rss_bytes()
    for _ in range(10_000):
        step(acc, x)
    gc.collect()
    assert cache_sizes(step) == sizes
    grown = rss_bytes() - rss
    assert grown < 20 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 10,000 calls"
    assert int(acc.calls[...]) == 10_500
    np.testing.assert_array_equal(acc.w[...], np.full(3, 10_500.0))


def test_calls_with_fresh_modules_keep_caches_bounded():
    step = nnx_sharding.jit(accumulate)
    x = jnp.ones(3)
    for _ in range(50):
        step(Accumulator(0.0), x)
    gc.collect()
    sizes, rss = cache_sizes(step), rss_bytes()
    for _ in range(1_000):  # each module dies after its call
        step(Accumulator(0.0), x)
    gc.collect()
    assert cache_sizes(step) == sizes
    assert rss_bytes() - rss < 20 * 2**20
    alive = [Accumulator(0.0) for _ in range(200)]  # all alive: the entry cache is capped
    for acc in alive:
        step(acc, x)
    limit = getattr(getattr(nnx_sharding, "_cache", None), "MAX_ENTRIES", 64)
    assert len(step._entries) <= limit
    assert {k: v for k, v in cache_sizes(step).items() if "jax.jit" in k} == {
        k: v for k, v in sizes.items() if "jax.jit" in k
    }


def _gc_function():
    f = nnx_sharding.jit(forward)
    model = Counter()
    for _ in range(3):
        f(model, XX)
    return [f, model]


def _gc_stages():
    f = nnx_sharding.jit(forward, donate_argnums=0)
    model = Counter()
    traced = f.trace(model, XX)
    lowered = traced.lower()
    compiled = lowered.compile()
    compiled(model, XX)
    return [f, model, traced, lowered, compiled]


class Stepper(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.arange(3.0))

    @nnx_sharding.jit
    def step(self, x):
        self.w[...] += x
        return self.w[...]


def _gc_method():
    model = Stepper()
    for _ in range(3):
        model.step(1.0)
    return [model, model.step]


def _forward_two_rows(model, x):
    if x.shape[0] != 2:
        raise Boom("two rows only")
    return model(x)


def _gc_after_errors():
    f = nnx_sharding.jit(_forward_two_rows)
    model = Counter()
    f(model, XX)
    for _ in range(2):
        with pytest.raises(Boom):
            f(model, jnp.ones((3, 4)))
    with pytest.raises(TypeError):
        f.lower(model, XX).compile()(model, jnp.ones((3, 4)))
    return [f, model]


def _gc_sharded():
    f = nnx_sharding.jit(forward, in_shardings=(StateSharding({...: named()}), None))
    model = MLP()
    for _ in range(3):
        f(model, X)
    return [f, model]


@pytest.mark.parametrize(
    "make",
    [_gc_function, _gc_stages, _gc_method, _gc_after_errors, _gc_sharded],
    ids=["function", "stages", "method", "after_errors", "sharded"],
)
def test_jit_wrapped_and_modules_are_collected(make):
    refs = [weakref.ref(obj) for obj in make()]
    gc.collect()
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert not alive, f"still referenced: {alive}"


def test_module_dies_before_the_jit_wrapped_and_the_other_way():
    f = nnx_sharding.jit(forward)
    model = Counter()
    f(model, XX)
    f(model, XX)
    dead_model = weakref.ref(model)
    del model
    gc.collect()
    assert dead_model() is None and len(f._entries) == 0
    model = Counter()
    f(model, XX)
    dead_f = weakref.ref(f)
    del f
    gc.collect()
    assert dead_f() is None
    np.testing.assert_allclose(nnx_sharding.jit(forward)(model, XX), clone(model)(XX), 1e-6)
