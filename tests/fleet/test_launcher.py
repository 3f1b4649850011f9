"""The two ways to start a fleet: ``python -m tinyserve.fleet`` end to end, and the Serve
config file (validated against Serve's own schema and built)."""

# ruff: noqa: E402 (imports below the skip: without the ray extra, collecting is skipping)
import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
pytestmark = pytest.mark.ray  # a step of its own in .ci/run

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from tinyserve.fleet.app import FleetConfig, build_app

ROOT = Path(__file__).resolve().parents[2]


def test_serve_config_file_validates_and_builds():
    doc = yaml.safe_load((ROOT / "deploy/ray/serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(doc)
    app = schema.applications[0]
    assert app.import_path == "tinyserve.fleet.app:build_app"
    assert isinstance(build_app(app.args), Application)  # every key a valid FleetConfig field
    cfg = FleetConfig.from_dict(app.args)
    assert cfg.num_gpus == 1 and cfg.max_replicas > cfg.min_replicas  # autoscaling, on GPUs
    assert "autoscaling_config" in cfg.deployment_options()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def test_launcher_serves_and_stops_cleanly(tmp_path):
    port = _free_port()
    log = (tmp_path / "fleet.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinyserve.fleet", "--host", "127.0.0.1", "--port", str(port),
         "--replicas", "1", "--num-cpus", "0.5", "--", "--max-num-seqs", "8"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_DISABLE_USAGE_STATS": "1"},
        start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "fleet.log").read_text()[-3000:]
            try:
                if _get(url + "/ready")[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            assert time.monotonic() < end, (tmp_path / "fleet.log").read_text()[-3000:]
            time.sleep(0.5)
        body = json.dumps({"model": "stories260k", "prompt": "Once upon a time",
                           "max_tokens": 5, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            doc = json.loads(r.read())
            assert r.headers["x-tinyserve-replica"]
        assert doc["usage"]["completion_tokens"] == 5 and doc["choices"][0]["text"]
        status, models = _get(url + "/v1/models")
        assert status == 200 and json.loads(models)["data"][0]["id"] == "stories260k"
        assert _get(url + "/health")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        log.close()
        if proc.poll() is None:  # failed: take its Ray cluster down with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
                           capture_output=True, timeout=60)
