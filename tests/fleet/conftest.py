"""The fleet's tests: the ones that run a local Ray cluster (marked ``ray``: they need the
``ray`` extra and take minutes) run as a step of their own in ``.ci/run``
(``python -m pytest -m ray``); the fleet's pure parts (routing policy, relay) run with the rest.
"""

import pytest

# Per test, fixture setup included: a cluster start, replicas warming up and health waits of up
# to 90 s each on a starved machine take minutes, more than the suite-wide default (pyproject);
# still finite, so a hang fails its test.
FLEET_TIMEOUT_S = 1200


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # (a hook of this conftest still sees the whole session's items)
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.timeout(FLEET_TIMEOUT_S))


@pytest.fixture(scope="module")
def ray_cluster():
    from tests.fleet import cluster  # (imports ray: only the tests marked ray ask for it)

    yield from cluster.running()
