"""A local Ray cluster for the fleet tests that need one (marked ``ray``), and what they ask
of it: deploy the fleet, list its replicas, wait for a state, read Serve's recent events."""

import asyncio
import os
import time

import pytest

ray = pytest.importorskip("ray", reason="the fleet tests need: pip install -e '.[ray]'")
from ray import serve  # noqa: E402

from tinyserve.fleet.app import FleetConfig, build  # noqa: E402

APP = "tinyserve"

# A starved CI machine must not make Serve kill its own HTTP proxy (its readiness and health
# checks time out after 5 s and 10 s by default); read when the cluster's processes start.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
# A replica's queue length answered within 1 s, not 0.1 s: on a busy CI machine the probe
# missed its deadline and every request went to the one replica that answered in time
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def running():
    """A local cluster for the ``ray_cluster`` fixture's module (conftest.py)."""
    # Logical CPUs: replicas take fractions; the Triton interpreter steps are what use the
    # machine's real cores.
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=128 * 2**20,
             log_to_driver=False, runtime_env={"env_vars": {"OPENBLAS_NUM_THREADS": "1"}})
    yield
    serve.shutdown()
    ray.shutdown()


def deploy(cfg: FleetConfig, port: int) -> str:
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(cfg), name=APP, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def replica_pids() -> dict[str, int]:
    """Live TinyserveReplica actors: replica id -> the actor's process id (from Ray's GCS;
    the state API would need the dashboard)."""
    from ray._private import state

    out = {}
    for a in state.actors().values():
        name = a.get("Name") or ""
        if a.get("State") == "ALIVE" and "#TinyserveReplica#" in name:
            out[name.rsplit("#", 1)[-1]] = a["Pid"]
    return out


def running_replicas() -> int:
    st = serve.status().applications[APP].deployments["TinyserveReplica"]
    return st.replica_states.get("RUNNING", 0)


def serve_events(limit: int = 20) -> str:
    """Serve's recent health-check and replica-stop lines, and the servers' exits, for a
    failing test's message (the replicas' own logs stay in Ray's session directory)."""
    import glob

    logs = "/tmp/ray/session_latest/logs/serve/"
    lines = []
    for path in sorted(glob.glob(logs + "controller_*.log") + glob.glob(logs + "replica_*.log")
                       + glob.glob(logs + "proxy_*.log")):
        with open(path, errors="replace") as f:
            lines += [line[:300] for line in f if any(k in line for k in (
                "Health check", "unhealthy", "stopping it", "died", "exited", "Traceback",
                "Failed to get queue length", "Failed to fetch queue length",
                "temporarily unavailable", "prefix tree"))]
    return "\n".join(lines[-limit:]) or "(no health-check events in Serve's logs)"


def wait_for(pred, timeout_s: float, what: str, step_s: float = 0.25):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(step_s)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}\n{serve_events()}")


async def await_for(pred, timeout_s: float, what: str, step_s: float = 0.25):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        await asyncio.sleep(step_s)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}\n{serve_events()}")
