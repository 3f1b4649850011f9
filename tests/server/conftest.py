"""Real servers (``python -m tinyserve`` subprocesses) on free ports, with stories260k."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import STORIES_DIR

STARTUP_TIMEOUT = 180


def get(url: str, headers: dict | None = None, timeout: float = 10) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Sum the samples of ``name`` in Prometheus text whose labels include ``labels``."""
    want = set(re.findall(r'(\w+)="([^"]*)"', labels))
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        base, _, rest = key.partition("{")
        if base == name and want <= set(re.findall(r'(\w+)="([^"]*)"', rest)):
            total += float(value)
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, log_path: Path, model: Path | None = STORIES_DIR,
                 env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = log_path
        self._log = open(log_path, "w")
        model_args = ["--model", str(model)] if model else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tinyserve", *model_args, "--port", str(self.port),
             "--log-level", "info", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                if get(self.url + "/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready in {STARTUP_TIMEOUT}s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def metric(self, name: str, labels: str = "") -> float:
        """The sum of a metric's samples whose labels include ``labels`` ('{a="x",b="y"}')."""
        return metric_value(get(self.url + "/metrics")[1], name, labels)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def stories_model(stories_dir):
    return stories_dir


def _launch(tmp_path_factory, name, *args):
    return ServerProcess(*args, log_path=tmp_path_factory.mktemp(name) / "server.log")


@pytest.fixture(scope="session")
def server(stories_model, tmp_path_factory):
    srv = _launch(tmp_path_factory, "main")
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()


@pytest.fixture(scope="session")
def launch(stories_model, tmp_path_factory):
    """Start an extra server with other flags; stopped (and checked) at the end."""
    started = []

    def start(*args: str) -> ServerProcess:
        srv = _launch(tmp_path_factory, "extra", *args)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()
