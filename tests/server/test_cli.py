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
                 "--quantization", "--block-size", "--served-model-name", "--kv-cache-dtype"):
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
    # (and --access-log: its lines are bare JSON on stdout, beside the formatted server log)
    srv = ServerProcess("--demo", "--access-log", log_path=tmp_path / "demo.log", model=None,
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
    # (read after the stop: a writer thread puts the lines out, and flushes them at exit)
    access = [json.loads(line) for line in srv.log_path.read_text().splitlines()
              if line.startswith("{")]
    assert [(a["path"], a["status"], a["model"]) for a in access] == [
        ("/v1/models", 200, None), ("/v1/chat/completions", 200, "tinyserve-demo")]
    assert access[1]["completion_tokens"] == body["usage"]["completion_tokens"]


def test_two_models_stories260k_and_its_int8_variant_behind_a_route(tmp_path):
    """Acceptance (issue 7): the bundled model and its int8 variant served side by side, a
    route splitting an alias between them (sticky per user), a fallback from one to the other;
    each model answers under its own name and has its own metrics. (q8 also keeps its KV cache
    in int8: a per-model option, reported in the log and cache_config_info.)"""
    from tinyserve.core.routing import Router

    srv = ServerProcess("--model", "fp=stories260k",
                        "--model", "q8=stories260k,quantization=int8,kv_cache_dtype=int8",
                        "--route", "chat=fp:50,q8:50", "--fallback", "fp=q8",
                        log_path=tmp_path / "two.log", model=None)
    try:
        models = json.loads(get(srv.url + "/v1/models")[1])
        assert [m["id"] for m in models["data"]] == ["fp", "q8", "chat"]
        prompt = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
        status, body, headers = run(post(srv.url, "/v1/completions", {"model": "fp", **prompt}))
        assert status == 200 and body["choices"][0]["text"] == ", there was a little"
        assert headers["X-Tinyserve-Model"] == "fp" and body["model"] == "fp"
        status, body, headers = run(post(srv.url, "/v1/completions", {"model": "q8", **prompt}))
        assert status == 200 and body["usage"]["completion_tokens"] == 5
        assert headers["X-Tinyserve-Model"] == "q8" and body["model"] == "q8"
        # Two users the route sends to different versions, each answered by its own.
        router = Router(["fp", "q8"], [("chat", (("fp", 50.0), ("q8", 50.0)))])
        users = {}
        for i in range(64):
            users.setdefault(router.resolve("chat", f"default\0user-{i}"), f"user-{i}")
        for model, user in users.items():
            for _ in range(2):
                status, body, headers = run(post(srv.url, "/v1/completions", {
                    "model": "chat", "user": user, **prompt}))
                assert status == 200 and headers["X-Tinyserve-Model"] == model == body["model"]
        for model in ("fp", "q8"):
            assert srv.metric("tinyserve:request_success_total", f'{{model="{model}"}}') == 3
        assert "route chat: fp:50,q8:50" in srv.log() and "fallback fp -> q8" in srv.log()
        assert srv.metric("tinyserve:cache_config_info", 'cache_dtype="int8"') == 1
        assert "KV cache (int8 + fp16 scales, 400 B/token)" in srv.log()
        assert "KV cache (float32, 1280 B/token)" in srv.log()
    finally:
        assert srv.stop() == 0


def test_bad_routes_and_model_lists_are_clear_errors():
    for args, needle in [(["--route", "chat=zz:1"], "not a served model"),
                         (["--fallback", "stories260k=stories260k"], "fallback"),
                         (["--model", "a=stories260k", "--model", "a=stories260k"], "two models"),
                         (["--model", "a=stories260k,kv_share=2"], "kv_share"),
                         (["--model", "a=stories260k,colour=red"], "unknown option")]:
        out = subprocess.run([sys.executable, "-m", "tinyserve", *args], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2 and needle in out.stderr, (args, out.stderr)


def test_a_gguf_file_is_served_as_its_stem(tmp_path, server):
    """--model FILE.gguf: stories260k written as llama.cpp writes a Llama (F32, q / k rows
    permuted) answers token ids as the bundled safetensors model does, under its file's stem;
    --dequantize is accepted (a no-op on floats)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from tests.conftest import STORIES_DIR
    from tests.gguf_writer import Q, write_model

    hf = transformers.LlamaForCausalLM.from_pretrained(STORIES_DIR)
    path = write_model(hf, STORIES_DIR, tmp_path / "stories.gguf", Q.F32)
    srv = ServerProcess("--dequantize", log_path=tmp_path / "gguf.log", model=path)
    try:
        assert json.loads(get(srv.url + "/v1/models")[1])["data"][0]["id"] == "stories"
        body = {"prompt": [1, 403, 251, 263, 431], "max_tokens": 8, "temperature": 0,
                "logprobs": 0, "return_tokens_as_token_ids": True}
        status, got, _ = run(post(srv.url, "/v1/completions", {**body, "model": "stories"}))
        assert status == 200, got
        status, want, _ = run(post(server.url, "/v1/completions",
                                   {**body, "model": "stories260k"}))
        assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]
    finally:
        assert srv.stop() == 0
