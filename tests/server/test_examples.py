"""Every example runs as README shows it (after its two commands), against a real server."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(cmd: list[str], url: str, timeout: float = 240) -> str:
    env = {**os.environ, "TINYSERVE_URL": url, "URL": url, "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=EXAMPLES.parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_openai_client_example(server):
    out = _run([sys.executable, str(EXAMPLES / "openai_client.py")], server.url)
    assert "completion:" in out and "chat (streaming):" in out and "tokens]" in out


def test_chat_example_one_question(server):
    out = _run([sys.executable, str(EXAMPLES / "chat.py"), "--max-tokens", "8", "Tell me a story"],
               server.url)
    assert out.startswith("stories260k> ") and len(out.strip()) > len("stories260k>")


@pytest.mark.skipif(not any((Path(p) / "curl").exists() for p in os.environ["PATH"].split(":")),
                    reason="no curl on this machine")
def test_curl_example(server):
    out = _run(["bash", str(EXAMPLES / "curl.sh")], server.url)
    assert '"object":"text_completion"' in out.replace(" ", "") and '"error"' in out


def test_offline_example():
    out = _run([sys.executable, str(EXAMPLES / "offline.py")], "", timeout=400)
    assert "'Once upon a time' ->" in out and "int8 weights:" in out
