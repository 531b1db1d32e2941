"""Test set-up: 8 simulated CPU devices, configured before any backend starts."""

import math

import jax
import pytest
from flax import nnx

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

# Run by the launcher in processes of its own (test_multihost.py), never imported here:
# importing it initializes jax.distributed.
collect_ignore = ["multihost_worker.py"]


# --- flax features newer than the oldest flax the suite runs with (0.12.6, see noxfile.py)
# Tests that use them, or check flax's own behaviour, are skipped on a flax without them.


def _flax_rejects_graph_node_prefixes() -> bool:
    """Whether flax's transforms refuse a graph node (or a Variable) in a prefix when
    wrapping, in the words the tests quote ("Graph nodes are not allowed as prefixes"):
    flax 0.12.8's check; 0.12.6 accepts it then fails at the call with a pytree error."""
    try:
        nnx.jit(lambda m: m, in_shardings=(nnx.Dict(),))
    except ValueError:
        return True
    return False


needs_nnx_prefix = pytest.mark.skipif(
    not hasattr(nnx, "prefix"), reason="nnx.prefix is new in flax 0.12.8"
)
needs_flax_prefix_check = pytest.mark.skipif(
    not _flax_rejects_graph_node_prefixes(),
    reason="flax refuses graph nodes as prefixes when wrapping only since 0.12.8",
)


@pytest.fixture
def saved_elements(capsys):
    """``saved_elements(f, *args)``: the element counts of what ``jax.vjp(f)`` saves for
    the backward pass beyond its arguments and constants, as
    ``jax.ad_checkpoint.print_saved_residuals`` lists them."""

    def counts(f, *args) -> list[int]:
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(f, *args)
        found = []
        for line in capsys.readouterr().out.splitlines():
            if "from the argument" in line or "from a constant" in line:
                continue
            dims = line.split("[", 1)[1].split("]", 1)[0]  # f32[2,64@context,4,16] ...
            found.append(math.prod(int(d.split("@")[0]) for d in dims.split(",") if d))
        return found

    return counts
