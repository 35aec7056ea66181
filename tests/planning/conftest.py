"""The planning tests' shared simulator run: `throughput.run("h200")` (the fit plus every
prediction, several CPU seconds) computed once per test process and read, never changed,
by test_sim.py and test_mesh_plan.py."""

import pytest

from jlco.planning import throughput


@pytest.fixture(scope="session")
def h200_sim():
    return throughput.run("h200")
