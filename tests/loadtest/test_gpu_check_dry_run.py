"""The H200 device check (loadtest/gpu/check.py) in its CPU dry run: every piece runs at toy
shapes through the same code as on the device, so the prepared check cannot rot between the
rare runs that get a GPU. Each piece must end ok, or skipped with a reason; every check inside
must pass or say why it was not run here (CUDA graphs, bf16 math, bandwidth).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "loadtest" / "gpu"
PIECES = ["install", "kernel_tests", "stories260k", "graphs_vs_eager", "decode_8b",
          "transformers_peer", "server_e2e"]


def test_dry_run_runs_every_piece_and_every_check_passes(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OUT", None)
    r = subprocess.run([sys.executable, str(GPU / "check.py"), "--dry-run", "--out", str(out),
                        "--work", str(tmp_path / "work")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=540)
    assert (out / "results.json").exists(), r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    by = {p["name"]: p for p in results["pieces"]}
    assert list(by) == PIECES, list(by)
    problems = []
    for name, p in by.items():
        if p["status"] not in ("ok", "skipped") or (p["status"] == "skipped" and not p["reason"]):
            problems.append(f"{name}: {p['status']} ({p.get('reason')}) {p.get('notes')}")
        for c in p["checks"]:
            if c["ok"] is False or (c["ok"] is None and not c.get("skipped")):
                problems.append(f"{name}: check {c['name']!r}: {c}")
        assert p["title"] in md
    assert not problems, "\n".join(problems) + "\n" + r.stdout[-3000:]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "not GPU timings" in md and results["meta"]["mode"].startswith("dry run")
    # the pieces that must have measured something did, and their correctness checks ran
    assert by["kernel_tests"]["tables"]["pytest"]["rows"][0][0] > 0
    decode = by["decode_8b"]
    kernels = decode["tables"]["kernels"]["rows"]
    assert {r[0].split(" (")[0] for r in kernels} >= {
        "matmul qkv", "matmul o", "matmul gate_up", "matmul down", "matmul LM head",
        "decode attention", "sample"}
    assert all(row[-1] is True for row in kernels)
    assert {(r[0], r[1]) for r in decode["tables"]["decode steps"]["rows"]} == {
        (w, p) for w in ("fp32", "int8", "int4") for p in ("eager", "buckets (CPU replay)")}
    ran = [c["name"] for p in by.values() for c in p["checks"] if c["ok"]]
    assert any("reference.json" in n for n in ran)
    assert any("== eager" in n for n in ran)
    assert any("alone" in n for n in ran)
    # nothing beyond what the device tool returns: at most 8 files, none in subfolders
    assert len(list(out.iterdir())) <= 8 and all(f.is_file() for f in out.iterdir())


def test_every_runtime_dependency_is_on_the_device_or_carried():
    sys.path.insert(0, str(GPU))
    try:
        import wheels
    finally:
        sys.path.remove(str(GPU))
    assert wheels.uncovered() == []
    assert {"msgspec", "llguidance"} <= set(wheels.WHEELS)
    for script in ("prepare.sh", "check.sh"):
        r = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert "/.gpu-wheels/" in (ROOT / ".gitignore").read_text().split()
