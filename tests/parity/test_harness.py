"""The harness itself: it must see each kind of difference it claims to compare."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._harness import EAGER, FLAX, Log, compare, mesh8, run


def differences(observe_flax, observe_ours):
    """``compare`` of two scenarios that log different things under flax and ours."""
    return compare(
        run(lambda impl, log: observe_flax(log), FLAX),
        run(lambda impl, log: observe_ours(log), EAGER),
    )


def test_equal_observations_agree():
    def observe(log: Log):
        m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        log.value("out", (m(jnp.ones((1, 2))), 3, None))
        log.state("m", m)
        log.fact("fact", True)

    assert differences(observe, observe) == []


def test_values_kinds_dtypes_and_weak_types_are_compared():
    cases = [
        (jnp.ones(2), jnp.ones(2) + 1e-3),  # value
        (jnp.ones(2), np.ones(2, np.float32)),  # jax or numpy
        (jnp.ones(2), jnp.ones(2, jnp.int32)),  # dtype
        (jnp.asarray(1.0), jnp.float32(1.0)),  # weak type
    ]
    for a, b in cases:
        assert differences(lambda log, a=a: log.value("x", a), lambda log, b=b: log.value("x", b))


def test_state_structure_variables_and_shardings_are_compared():
    def model(extra=False, spec=None):
        m = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        if extra:
            m.extra = nnx.BatchStat(jnp.zeros(()))
        if spec is not None:
            m.kernel.set_value(jax.device_put(m.kernel[...], NamedSharding(mesh8(), spec)))
        return m

    base = lambda log: log.state("m", model())  # noqa: E731
    assert differences(base, lambda log: log.state("m", model(extra=True)))
    assert differences(base, lambda log: log.state("m", model(spec=P("x"))))
    written = lambda log: log.state("m", model(spec=P("x", None)))  # noqa: E731
    assert differences(written, lambda log: log.state("m", model(spec=P("x"))))


def test_errors_are_compared_by_type_and_missing_entries_are_reported():
    def raising(error):
        def observe(log):
            log.raises("call", lambda: (_ for _ in ()).throw(error))

        return observe

    assert differences(raising(ValueError()), raising(ValueError())) == []
    assert differences(raising(ValueError()), raising(TypeError()))
    assert differences(raising(ValueError()), lambda log: log.raises("call", lambda: 1))
    assert differences(lambda log: log.fact("a", 1), lambda log: None)
