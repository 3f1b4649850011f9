"""The H200 device check: one prepared run of everything this project wants measured on a GPU.

    bash loadtest/gpu/prepare.sh                       # here: the wheels the device lacks
    # then through the device tool, with carry [".gpu-wheels"]:
    bash loadtest/gpu/check.sh                         # -> $OUT/results.json, results.md
    python loadtest/gpu/check.py --dry-run --out DIR   # here, on the CPU: the same, in miniature

It installs the carried wheels and the project without network, sets one TRITON_CACHE_DIR for
every piece (cold at the start), and runs the pieces in order, each in its own process under
its own budget (a timeout), rewriting results.json and results.md as each one ends, so a run
cut short still returns what finished:

    (a) kernel_tests       tests/kernels under pytest-xdist (bf16 cases run on a GPU)
    (b) stories260k        greedy 48 tokens == reference.json (fp32); fp16 / bf16 agreement
    (c) graphs_vs_eager    a random GQA Llama (bf16) through DeviceEngine: CUDA graphs == eager
    (d) decode_8b          Llama-3-8B shapes: ms/step (bf16 / int8 / int4, batch 1/16/64, eager
                           vs graphs), each kernel's GB/s against the measured copy bandwidth,
                           every timing beside a check against torch
    (e) transformers_peer  the same decode through transformers' LlamaForCausalLM
    (f) server_e2e         python -m tinyserve on a random 8B checkpoint with a 128k-token
                           tokenizer, 64 streaming clients: TTFT / ITL percentiles, tokens/s

The server of (f) is prepared in the background from the start (its 16 GB checkpoint written,
then loaded and warmed up: Triton compiles on a cold cache take minutes), so that its start
overlaps (a)-(c); (d) waits for that warm-up to end before it times anything. Everything ends
inside the 540 s the device command is given (``DEVICE["total_s"]`` in checklib.py).

``--dry-run`` runs every piece at toy shapes on the CPU (Triton's interpreter) through the
same code; what needs a GPU (CUDA graphs, bf16 math, bandwidth) runs its CPU equivalent or is
reported as skipped with the reason. tests/loadtest/test_gpu_check_dry_run.py runs it in CI.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # loadtest/: bench.py, bench_kernels.py as libraries

import checklib as L  # noqa: E402
import wheels as W  # noqa: E402

MODULES = {"kernel_tests": "piece_kernels", "stories260k": "piece_stories",
           "graphs_vs_eager": "piece_graphs", "decode_8b": "piece_decode",
           "transformers_peer": "piece_peer", "server_e2e": "piece_server",
           "server_prep": "piece_server"}
GRACE_S = 8  # a piece stops itself this long before it is killed
LOG_LIMIT = 12 << 20  # bytes kept of each log in $OUT (the tool returns files up to 16 MiB)


# -- child mode: one piece in this process --------------------------------------------------

def run_piece(args) -> int:
    piece = L.Piece(args.piece, args.result, args.dry_run)
    P = L.params(args.dry_run)
    key = "server_e2e" if args.piece == "server_prep" else args.piece
    ctx = SimpleNamespace(dry=args.dry_run, device="cpu" if args.dry_run else "cuda",
                          deadline=L.Deadline(args.deadline), out=Path(args.out),
                          work=Path(args.work), server=None)
    if args.server_state:
        ctx.server = json.loads(Path(args.server_state).read_text())
    try:
        mod = importlib.import_module(MODULES[args.piece])
        (mod.prepare if args.piece == "server_prep" else mod.run)(piece, P[key], ctx)
        if piece.data["status"] == "running":
            piece.finish()
    except BaseException as e:  # noqa: BLE001 (recorded, then the piece fails)
        piece.fail(e)
        return 1
    return 0 if piece.data["status"] in ("ok", "skipped") else 1


# -- the orchestrator -----------------------------------------------------------------------

class Run:
    def __init__(self, args) -> None:
        self.dry = args.dry_run
        self.P = L.params(self.dry)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work or Path(tempfile.gettempdir()) / "tinyserve-gpu-check-work")
        self.work.mkdir(parents=True, exist_ok=True)
        self.keep_work = args.keep_work
        self.t0 = time.time()
        self.end = self.t0 + (args.total_s or self.P["total_s"])
        self.only = args.only or L.PIECES
        self.children: set[subprocess.Popen] = set()
        self.server = None  # ServerPrep
        self.results = {"meta": {"mode": "dry run (CPU, Triton interpreter, toy shapes)"
                                 if self.dry else "device", "started": time.strftime(
                                     "%Y-%m-%d %H:%M:%S %Z"), "total_budget_s": round(
                                     self.end - self.t0), "pieces_selected": self.only},
                        "pieces": []}
        # One Triton cache for every piece. A fresh machine starts it cold (compile times are
        # part of what this run measures); a rerun on a machine still warm finds it filled.
        cache = self.work / "triton-cache"
        cache.mkdir(exist_ok=True)
        entries = sum(1 for _ in cache.iterdir())
        os.environ["TRITON_CACHE_DIR"] = str(cache)
        os.environ["PYTHONUNBUFFERED"] = "1"
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        self.results["meta"]["triton_cache_dir"] = str(cache)
        self.results["meta"]["triton_cache_at_start"] = \
            f"warm ({entries} entries)" if entries else "cold (empty)"

    def left(self) -> float:
        return self.end - time.time()

    # results ------------------------------------------------------------------------------
    def record(self, data: dict) -> None:
        self.results["pieces"] = [p for p in self.results["pieces"] if p["name"] != data["name"]]
        self.results["pieces"].append(data)
        self.write()

    def write(self) -> None:
        self.results["meta"]["elapsed_s"] = round(time.time() - self.t0, 1)
        done = {p["name"] for p in self.results["pieces"]}
        self.results["meta"]["not_run_yet"] = [n for n in self.only if n not in done]
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        os.replace(tmp, self.out / "results.json")
        tmp = self.out / "results.md.tmp"
        tmp.write_text(render_md(self.results))
        os.replace(tmp, self.out / "results.md")

    # children -----------------------------------------------------------------------------
    def child(self, name: str, timeout: float, server_state: Path | None = None) -> dict:
        """Run one piece in its own process (its own session: a timeout kills its whole
        tree); -> its result, with status timeout if it ran past ``timeout``."""
        result = self.work / f"{name}.json"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--piece", name,
               "--result", str(result), "--deadline", str(time.time() + timeout - GRACE_S),
               "--out", str(self.out), "--work", str(self.work)]
        if self.dry:
            cmd.append("--dry-run")
        if server_state is not None:
            cmd += ["--server-state", str(server_state)]
        t = time.time()
        print(f"== {name}: start (budget {timeout:.0f} s, {self.left():.0f} s of the run left)",
              flush=True)
        p = subprocess.Popen(cmd, cwd=L.ROOT, start_new_session=True)
        self.children.add(p)
        timed_out = False
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(p)
        finally:
            self.children.discard(p)
        seconds = round(time.time() - t, 1)
        try:
            data = json.loads(result.read_text())
        except (OSError, json.JSONDecodeError):
            data = {"name": name, "status": "failed", "checks": [], "tables": {}, "notes": [],
                    "info": {}, "reason": f"the piece's process exited {p.returncode} "
                                          "without a result (see check.log)"}
        if timed_out:
            data["status"] = "timeout"
            data["reason"] = f"ran past its budget of {timeout:.0f} s: what it finished is kept"
        elif data.get("status") == "running":
            data["status"], data["reason"] = "failed", f"exited {p.returncode} mid-piece"
        data["seconds"], data["budget_s"] = seconds, round(timeout)
        print(f"== {name}: {data['status']} in {seconds} s"
              + (f" ({data.get('reason')})" if data.get("reason") else ""), flush=True)
        return data

    def piece(self, name: str, info: dict | None = None, notes: list[str] = ()) -> dict:
        timeout = min(self.P["budgets"][name], self.left() - 5)
        if timeout < 15:
            data = skipped(name, f"no time left: {self.left():.0f} s of the run remained")
        else:
            data = self.child(name, timeout)
        data["title"] = L.TITLES.get(name, name)
        data.setdefault("info", {}).update(info or {})
        data.setdefault("notes", []).extend(notes)
        self.record(data)
        return data

    # the whole run ------------------------------------------------------------------------
    def run(self) -> int:
        inst = install(self)
        self.record(inst)
        if inst["status"] != "ok":
            for name in self.only:
                self.record(skipped(name, "the install failed: nothing can be imported"))
            return 1
        if "server_e2e" in self.only:
            self.server = ServerPrep(self)
            self.server.start()
        for name in self.only:
            if name == "server_e2e":
                self.record(self.server_piece())
                continue
            info, notes = {}, []
            if name == "decode_8b" and self.server is not None:
                # up to 60 s, as long as the pieces still to run keep their whole budgets
                rest = sum(self.P["budgets"][n] for n in self.only[self.only.index(name):])
                waited = self.server.wait_ready(min(60.0, max(0.0, self.left() - rest - 5)))
                phase = self.server.state.get("phase")
                info = {"waited_for_server_warmup_s": round(waited, 1), "server_then": phase}
                if not self.server.done.is_set():
                    notes.append(f"the server of (f) was still in '{phase}' when these timings "
                                 "began: its warm-up shared the GPU and CPU with them")
            self.piece(name, info, notes)
        return 0 if all(p["status"] in ("ok", "skipped") for p in self.results["pieces"]) else 1

    def server_piece(self) -> dict:
        budget = min(self.P["budgets"]["server_e2e"], self.left() - 5)
        srv = self.server
        wait = srv.wait_ready(max(0.0, min(self.left() - budget, self.left() - 30)))
        state = self.work / "server_state.json"
        state.write_text(json.dumps(srv.state, default=str))
        if not srv.state.get("ready"):
            data = {"name": "server_e2e", "status": "failed", "checks": [{
                "name": "the server became ready", "ok": False,
                "value": srv.state.get("error") or srv.state.get("phase"), "limit": None}],
                "tables": {}, "notes": [], "info": {"server": srv.state},
                "reason": f"the server is not ready ({srv.state.get('phase')}): "
                          f"{srv.state.get('error') or 'see server.log'}"}
            srv.stop()
        else:
            timeout = min(self.P["budgets"]["server_e2e"], self.left() - 5)
            data = self.child("server_e2e", timeout, state) if timeout >= 15 else \
                skipped("server_e2e", "no time left")
            stop = srv.stop()
            data.setdefault("checks", []).append({
                "name": "the server exits 0 on SIGTERM (drain)", "ok": stop["returncode"] == 0,
                "value": stop, "limit": None})
            if stop["returncode"] != 0 and data["status"] == "ok":
                data["status"], data["reason"] = "failed", "the server did not exit cleanly"
        data.setdefault("info", {})["server"] = {k: srv.state.get(k) for k in (
            "phase", "error", "checkpoint_s", "start_to_ready_s", "prep_to_ready_s")}
        data["info"]["waited_for_ready_s"] = round(wait, 1)
        data["title"] = L.TITLES["server_e2e"]
        return data

    def cleanup(self) -> None:
        for p in list(self.children):
            kill_group(p)
        if self.server is not None:
            self.server.stop()
        for name in ("kernel_tests.log", "server.log"):  # keep an oversized log's newest part
            f = self.out / name  # (check.log is tee's, still open: left alone)
            if f.is_file() and f.stat().st_size > LOG_LIMIT:
                data = f.read_bytes()[-LOG_LIMIT:]
                f.write_bytes(b"[... cut: the first part of this log was dropped ...]\n" + data)
        if not self.keep_work:  # the checkpoints (16 GB on the device); the cache stays
            for d in self.work.glob("*-model"):
                shutil.rmtree(d, ignore_errors=True)


def kill_group(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            p.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def skipped(name: str, reason: str) -> dict:
    return {"name": name, "title": L.TITLES.get(name, name), "status": "skipped",
            "reason": reason, "checks": [], "tables": {}, "notes": [], "info": {},
            "seconds": 0.0, "budget_s": 0}


# -- install: the carried wheels and the project, no network --------------------------------

def install(run: Run) -> dict:
    t0 = time.time()
    data = {"name": "install", "title": L.TITLES["install"], "status": "ok", "reason": None,
            "checks": [], "tables": {}, "notes": [], "info": {}}

    def check(name, ok, value=None, skip=None):
        entry = {"name": name, "ok": None if skip else bool(ok), "value": value, "limit": None}
        if skip:
            entry["skipped"] = skip
        data["checks"].append(entry)

    def pip(*args, timeout=120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True,
                              text=True, timeout=timeout, cwd=L.ROOT)

    if run.dry:
        why = "dry run: this interpreter's environment (the .venv) already holds them"
        check("carried wheels installed (--no-index)", None, skip=why)
        check("project installed (pip install -e . --no-deps --no-index)", None, skip=why)
    else:
        wheels = sorted((L.ROOT / W.WHEEL_DIR).glob("*.whl"))
        site = run.work / "site"
        if not wheels:
            check("carried wheels installed (--no-index)", False,
                  f"no wheels in {W.WHEEL_DIR}/: run `bash loadtest/gpu/prepare.sh` here and "
                  f"carry {W.WHEEL_DIR}")
        else:
            r = pip("install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                    "--upgrade", "--target", str(site), *map(str, wheels))
            check("carried wheels installed (--no-index)", r.returncode == 0,
                  [w.name for w in wheels] if r.returncode == 0 else r.stderr[-1500:])
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
        r = pip("install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-e", ".")
        how = "editable"
        if r.returncode != 0:  # (an image whose setuptools cannot do editable installs)
            data["notes"].append("pip install -e . failed, a plain install was used: "
                                 + r.stderr[-800:])
            r = pip("install", "-q", "--no-deps", "--no-build-isolation", "--no-index", ".")
            how = "plain"
        check("project installed (pip install -e . --no-deps --no-index)", r.returncode == 0,
              how if r.returncode == 0 else r.stderr[-1500:])
    # Every runtime dependency imports, and what the run will use, with versions.
    probe = ("import importlib, json, platform, sys\n"
             f"mods = {W.import_names()!r}\n"
             "v = {'python': platform.python_version()}\nbad = {}\n"
             "for m in mods + ['tinyserve.kernels', 'transformers', 'pytest', 'xdist']:\n"
             "    try:\n        mod = importlib.import_module(m)\n"
             "        v[m] = getattr(mod, '__version__', 'ok')\n"
             "    except Exception as e:\n        bad[m] = repr(e)[:300]\n"
             "import torch\nv['cuda'] = torch.version.cuda\n"
             "if torch.cuda.is_available():\n"
             "    p = torch.cuda.get_device_properties(0)\n"
             "    v['device'] = p.name; v['sms'] = p.multi_processor_count\n"
             "    v['memory_gib'] = round(p.total_memory / 2**30, 1)\n"
             "print(json.dumps({'versions': v, 'failed': bad}))\n")
    env = dict(os.environ)
    if run.dry:
        env["TRITON_INTERPRET"] = "1"
    try:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=180, cwd=L.ROOT, env=env)
        found = json.loads(r.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        found = {"versions": {}, "failed": {"probe": repr(e)[:300]}}
    check("every runtime dependency and tinyserve.kernels import", not found["failed"],
          found["failed"] or "ok")
    if not run.dry:
        check("a CUDA device is visible", "device" in found["versions"],
              found["versions"].get("device"))
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run([smi, "--query-gpu=name,driver_version,clocks.sm,clocks.mem,"
                                "temperature.gpu,power.draw", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            found["versions"]["nvidia-smi"] = q.stdout.strip()
    run.results["meta"].update(found["versions"])
    if any(c["ok"] is False for c in data["checks"]):
        data["status"] = "failed"
        data["reason"] = "; ".join(c["name"] for c in data["checks"] if c["ok"] is False)
    data["seconds"], data["budget_s"] = round(time.time() - t0, 1), run.P["budgets"]["install"]
    return data


# -- the server of (f), prepared in the background -----------------------------------------

class ServerPrep(threading.Thread):
    """Writes the random checkpoint (a piece process), starts ``python -m tinyserve`` on it
    (its log in $OUT/server.log) and waits for /ready; ``state`` says how far it got."""

    def __init__(self, run: Run) -> None:
        super().__init__(daemon=True)
        self.r = run
        self.S = run.P["server_e2e"]
        self.deadline = time.time() + min(run.P["server_prep_s"], run.left())
        self.state: dict = {"phase": "writing the checkpoint", "ready": False}
        self.proc: subprocess.Popen | None = None
        self.done = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001
            self.state.update(phase="failed", error=f"{type(e).__name__}: {e}")
        finally:
            self.done.set()

    def _run(self) -> None:
        t0 = time.time()
        prep = self.r.child("server_prep", max(15.0, (self.deadline - time.time()) * 0.5))
        self.state["checkpoint"] = prep.get("info", {})
        self.state["checkpoint_s"] = prep.get("seconds")
        if prep["status"] != "ok":
            self.state.update(phase="failed", error="writing the checkpoint: "
                              + str(prep.get("reason")))
            return
        model = prep["info"]["model_dir"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "tinyserve", "--model", model, "--port", str(port),
               "--dtype", self.S["dtype"], "--max-num-seqs", str(self.S["max_num_seqs"]),
               "--max-model-len", str(self.S["max_model_len"]),
               "--num-kv-blocks", str(self.S["num_kv_blocks"]), "--log-level", "info",
               "--device", "cpu" if self.r.dry else "cuda"]
        url = f"http://127.0.0.1:{port}"
        self.state.update(phase="starting (load + warm-up)", url=url, command=" ".join(cmd))
        t_start = time.time()
        with self.lock:
            log = open(self.r.out / "server.log", "ab")  # noqa: SIM115 (the server's lifetime)
            self.proc = subprocess.Popen(cmd, cwd=L.ROOT, stdout=log, stderr=subprocess.STDOUT)
        while time.time() < self.deadline:
            if self.proc.poll() is not None:
                self.state.update(phase="failed", error=f"the server exited with "
                                  f"{self.proc.returncode} before it was ready (server.log)")
                return
            try:
                with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
                    if resp.status == 200:
                        self.state.update(phase="ready", ready=True,
                                          start_to_ready_s=round(time.time() - t_start, 1),
                                          prep_to_ready_s=round(time.time() - t0, 1))
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.state.update(phase="failed", error="not ready within its "
                          f"{self.r.P['server_prep_s']} s (load + warm-up; server.log)")

    def wait_ready(self, limit: float) -> float:
        t = time.time()
        self.done.wait(timeout=max(0.0, limit))
        return time.time() - t

    def stop(self) -> dict:
        with self.lock:
            p, self.proc = self.proc, None
        if p is None:
            return {"returncode": None, "seconds": 0.0}
        t = time.time()
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return {"returncode": p.returncode, "seconds": round(time.time() - t, 1)}


# -- results.md -----------------------------------------------------------------------------

def fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        if v != v:
            return "-"
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.4g}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
        return f"{v:.2e}"
    if v is None:
        return "-"
    if isinstance(v, (list, tuple, dict)):
        v = json.dumps(v, default=str)
    return str(v).replace("|", "\\|").replace("\n", " ")[:300]


def render_md(results: dict) -> str:
    m = results["meta"]
    lines = [f"# tinyserve device check: {m['mode']}", ""]
    keys = ["device", "sms", "memory_gib", "nvidia-smi", "python", "torch", "cuda", "triton",
            "transformers", "numpy", "msgspec", "llguidance", "started", "elapsed_s",
            "total_budget_s", "triton_cache_at_start"]
    lines.append("; ".join(f"{k}: {m[k]}" for k in keys if k in m))
    lines.append("")
    if m["mode"] != "device":
        lines += ["> Dry run: CPU, Triton's interpreter, toy shapes. Times and bandwidths "
                  "below are interpreter numbers, **not GPU timings**; they only show that "
                  "every piece's code runs.", ""]
    lines += ["| piece | status | seconds | budget s | checks passed | reason |",
              "|---|---|---|---|---|---|"]
    for p in results["pieces"]:
        checks = p.get("checks", [])
        run_ = [c for c in checks if c.get("ok") is not None]
        lines.append(f"| {p.get('title', p['name'])} | {p['status']} | {fmt(p.get('seconds'))} "
                     f"| {fmt(p.get('budget_s'))} | {sum(1 for c in run_ if c['ok'])}/{len(run_)}"
                     f"{f' ({len(checks) - len(run_)} skipped)' if len(checks) > len(run_) else ''}"
                     f" | {fmt(p.get('reason'))} |")
    if m.get("not_run_yet"):
        lines += ["", f"Not run (yet): {', '.join(m['not_run_yet'])}"]
    lines += comparison(results)
    for p in results["pieces"]:
        lines += ["", f"## {p.get('title', p['name'])}: {p['status']}", ""]
        if p.get("checks"):
            lines += ["| check | result | value | limit |", "|---|---|---|---|"]
            for c in p["checks"]:
                res = f"skipped: {c['skipped']}" if c.get("skipped") else \
                    ("pass" if c["ok"] else "**FAIL**")
                lines.append(f"| {fmt(c['name'])} | {fmt(res)} | {fmt(c.get('value'))} | "
                             f"{fmt(c.get('limit'))} |")
        for title, t in p.get("tables", {}).items():
            lines += ["", f"**{title}**", "", "| " + " | ".join(t["columns"]) + " |",
                      "|" + "---|" * len(t["columns"])]
            lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in t["rows"]]
        if p.get("info"):
            lines += ["", "info: " + json.dumps(p["info"], default=str)[:800]]
        for n in p.get("notes", []):
            lines += ["", "note: " + str(n)[:1500]]
    return "\n".join(lines) + "\n"


def comparison(results: dict) -> list[str]:
    """tinyserve's decode ms/step (d) beside transformers' (e), where both ran."""
    by = {p["name"]: p for p in results["pieces"]}
    d, e = by.get("decode_8b"), by.get("transformers_peer")
    if not d or not e:
        return []
    ours, float_name = {}, "float"
    for row in d.get("tables", {}).get("decode steps", {}).get("rows", []):
        weights, path, batch, ms = row[0], row[1], row[2], row[4]
        if weights not in ("int8", "int4"):
            float_name, weights = weights, "float"
        ours[(weights, "eager" if path == "eager" else "graphs", batch)] = ms
    peer = {row[0]: row[2] for row in e.get("tables", {}).get("decode steps", {}).get("rows", [])}
    rows = []
    for b, ms_peer in peer.items():
        cells = [ours.get((w, p, b)) for w, p in (("float", "eager"), ("float", "graphs"),
                                                  ("int8", "graphs"), ("int4", "graphs"))]
        if any(c is not None for c in cells):
            rows.append(f"| {b} | {' | '.join(fmt(c) for c in cells)} | {fmt(ms_peer)} |")
    if not rows:
        return []
    return ["", "**decode ms/step: tinyserve (d) vs transformers (e)**", "",
            f"| batch | {float_name} eager | {float_name} graphs (buckets) | int8 graphs | "
            "int4 graphs | transformers |",
            "|---|---|---|---|---|---|", *rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, toy shapes")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/tinyserve-gpu-check-out")
    ap.add_argument("--work", default=None, help="scratch: checkpoints (removed at the end "
                    "unless --keep-work) and the Triton cache (kept for a rerun)")
    ap.add_argument("--keep-work", action="store_true")
    ap.add_argument("--only", nargs="+", choices=L.PIECES, default=None,
                    help="run these pieces only (install always runs)")
    ap.add_argument("--total-s", type=float, default=None, help="the whole run's budget")
    ap.add_argument("--piece", choices=sorted(MODULES), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--server-state", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.piece:
        return run_piece(args)
    run = Run(args)

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    rc = 1
    try:
        rc = run.run()
    finally:
        run.cleanup()
        run.write()
        print((run.out / "results.md").read_text()[:6000], flush=True)
        print(f"results: {run.out / 'results.json'}, {run.out / 'results.md'} "
              f"({time.time() - run.t0:.0f} s)", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
