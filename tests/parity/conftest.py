"""Every parity case runs in each of flax's modes (`_harness.MODES`)."""

from collections.abc import Iterator

import pytest
from flax import nnx

from . import _harness

_HAS_MODES = hasattr(nnx, "set_graph_mode") and hasattr(nnx, "set_graph_updates")


@pytest.fixture(autouse=True, params=list(_harness.MODES))
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Sets flax's graph mode and graph updates around the test, for flax and ours."""
    name = request.param
    if request.module.__name__.endswith("test_harness") and name != "graph":
        pytest.skip("the harness's own tests do not depend on the mode")
    if not _HAS_MODES and name != "graph":
        pytest.skip("this flax has no tree mode")
    graph, updates = _harness.MODES[name]
    _harness.MODE.name = name
    try:
        if not _HAS_MODES:
            yield name
            return
        with nnx.set_graph_mode(graph), nnx.set_graph_updates(updates):
            yield name
    finally:
        _harness.MODE.name = "graph"
