"""(a) The kernel tests on the device: tests/kernels under pytest-xdist, with every dtype the
tests have (bf16 cases whose math the CPU interpreter cannot do run here).

test_gpu_compile.py is left out: it compiles every variant for sm_90 without a GPU and runs in
CI on the CPU already (minutes of compiles that would prove nothing more here).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import checklib as L

SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
PROGRESS = re.compile(r"^([.FEsxX]+)\s*(\[\s*\d+%\])?\s*$")


def parse(text: str) -> dict:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "deselected": 0,
              "xfailed": 0, "xpassed": 0}
    final = [ln for ln in text.splitlines() if re.search(r" in [\d.]+s", ln) and SUMMARY.search(ln)]
    if final:
        for n, kind in SUMMARY.findall(final[-1]):
            counts["errors" if kind.startswith("error") else kind] = int(n)
        counts["completed"] = True
    else:  # cut short: count the progress characters printed so far
        for ln in text.splitlines():
            m = PROGRESS.match(ln.strip())
            if m:
                s = m.group(1)
                counts["passed"] += s.count(".")
                counts["failed"] += s.count("F")
                counts["errors"] += s.count("E")
                counts["skipped"] += s.count("s")
        counts["completed"] = False
    skips = [ln for ln in text.splitlines() if ln.startswith("SKIPPED [")]
    counts["bf16_skipped"] = sum(int(re.match(r"SKIPPED \[(\d+)\]", ln).group(1)) for ln in skips
                                 if "bf16" in ln or "interpreter" in ln)
    counts["failures"] = [ln[:300] for ln in text.splitlines()
                          if ln.startswith(("FAILED ", "ERROR "))][:10]
    return counts


def run(piece: L.Piece, P: dict, ctx) -> None:
    log = ctx.out / "kernel_tests.log"
    cmd = [sys.executable, "-m", "pytest", *P["paths"], "-q", "-rfEs", "-p", "no:cacheprovider",
           "--timeout=120", *P["extra"]]
    if P["workers"]:
        cmd += ["-n", str(P["workers"])]
    env = dict(os.environ)
    if ctx.dry:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    piece.info(command=" ".join(cmd[1:]), log=log.name)
    t0 = time.time()
    with open(log, "w") as f:
        # pytest and its xdist workers in a session of their own: killed together, at this
        # piece's deadline or when the orchestrator ends this piece (SIGTERM)
        p = subprocess.Popen(cmd, cwd=L.ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)

        def kill(*_):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        def on_term(signum, frame):
            kill()
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_term)
        try:
            rc = p.wait(timeout=max(5.0, ctx.deadline.left() - 3))
        except subprocess.TimeoutExpired:
            kill()
            p.wait()
            rc = None
    seconds = time.time() - t0
    c = parse(log.read_text(errors="replace"))
    t = piece.table("pytest", ["passed", "failed", "errors", "skipped", "deselected",
                               "bf16 cases skipped", "seconds", "ran to the end"])
    piece.row(t, [c["passed"], c["failed"], c["errors"], c["skipped"], c["deselected"],
                  c["bf16_skipped"], round(seconds, 1), c["completed"]])
    for line in c["failures"]:
        piece.note(line)
    piece.check("no test failed or errored", c["failed"] + c["errors"] == 0,
                value=f"{c['failed']} failed, {c['errors']} errors")
    piece.check("pytest ran to the end within the budget", rc is not None and c["completed"],
                value=f"exit {rc}" if rc is not None else "stopped at the budget")
    piece.check("some tests ran", c["passed"] > 0, value=c["passed"])
    if ctx.dry:
        piece.check("no bf16 case skipped", skipped="under the interpreter the bf16-math cases "
                    f"skip by design (tests/kernels/dtypes.py; {c['bf16_skipped']} here)")
    else:
        piece.check("no bf16 case skipped", c["bf16_skipped"] == 0, value=c["bf16_skipped"])
