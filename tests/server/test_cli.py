"""The command line: --help, bad flags, and README's first command (no arguments: stories260k)."""

import json
import subprocess
import sys

from tests.server.conftest import ServerProcess, get
from tests.server.helpers import post, run


def test_help_explains_the_knobs():
    out = subprocess.run([sys.executable, "-m", "tinyserve", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--model", "--max-num-seqs", "--max-num-batched-tokens", "--num-kv-blocks",
                 "--kv-cache-memory", "--batch-timeout-ms", "--max-model-len", "--api-key",
                 "--quantization", "--block-size", "--served-model-name"):
        assert flag in out.stdout


def test_a_bad_flag_value_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "tinyserve", "--block-size", "12"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "block_size" in out.stderr


def test_no_arguments_serve_the_bundled_stories260k(tmp_path):
    """README's first command: no --model serves the real model shipped in the package."""
    srv = ServerProcess(log_path=tmp_path / "default.log", model=None)
    try:
        models = json.loads(get(srv.url + "/v1/models")[1])
        assert models["data"][0]["id"] == "stories260k"
        status, body, _ = run(post(srv.url, "/v1/completions", {
            "model": "stories260k", "prompt": "Once upon a time", "max_tokens": 5,
            "temperature": 0}))
        assert status == 200 and body["choices"][0]["text"] == ", there was a little"
        assert "random weights" not in srv.log().lower()
    finally:
        assert srv.stop() == 0


def test_demo_flag_serves_the_random_weight_model(tmp_path):
    srv = ServerProcess("--demo", log_path=tmp_path / "demo.log", model=None,
                        env={"TINYSERVE_CACHE": str(tmp_path / "cache")})
    try:
        models = json.loads(get(srv.url + "/v1/models")[1])
        assert models["data"][0]["id"] == "tinyserve-demo"
        status, body, _ = run(post(srv.url, "/v1/chat/completions", {
            "model": "tinyserve-demo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3}))
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        assert "random weights" in srv.log().lower()
    finally:
        assert srv.stop() == 0
