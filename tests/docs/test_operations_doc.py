"""docs/operations.md stays true to the code: every alert's runbook_url lands on an anchor of
the page, every --flag it names is one the server parses, every tinyserve: metric it names is
one the server exports, and every relative link resolves (anchors in Markdown files included).

Each checker is a function of the page's text, also run on bad samples, so a checker that
stops finding anything fails here instead of passing quietly.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operations.md"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

# Long options of other programs the page shows, with the file that must define each: checked
# against that file's source, so they cannot go stale either.
FOREIGN_FLAGS = {"--url": "loadtest/bench.py", "--concurrency": "loadtest/bench.py",
                 "--requests": "loadtest/bench.py", "--max-tokens": "loadtest/bench.py",
                 "--plot": "loadtest/bench.py", "--warm-up": "tests/kernels/gpu_compile_check.py",
                 "--resources": "tests/kernels/gpu_compile_check.py"}
# Options of third-party programs the pages show in commands (nothing here defines them).
THIRD_PARTY_FLAGS = {"--headless": "locust", "--dist": "pytest-xdist"}

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
HTML_ID = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
METRIC = re.compile(r"tinyserve:[A-Za-z_][A-Za-z0-9_:]*")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def slug(heading: str) -> str:
    """GitHub's heading anchor: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Explicit <a id> anchors plus heading slugs (with GitHub's -1, -2 for repeats)."""
    found = set(HTML_ID.findall(markdown))
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        s = slug(heading)
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


def alerts() -> list[dict]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def server_flags() -> set[str]:
    """Flags of the server and of the fleet launcher (python -m tinyserve.fleet)."""
    from tinyserve.cli.flags import build_parser
    from tinyserve.fleet.__main__ import build_parser as fleet_parser

    return {s for p in (build_parser(), fleet_parser()) for a in p._actions
            for s in a.option_strings if s.startswith("--")}


def exported_metrics() -> set[str]:
    """Every name the server's registry can expose, as PromQL sees it (the optional LoRA and
    speculation families included)."""
    from tinyserve.actors.metrics import Metrics

    names = set()
    for family in Metrics(64, 64, lora=True, speculation=True, moe=True).registry.collect():
        name, kind = family.name, family.type
        if kind == "counter":
            names.add(name + "_total")
        elif kind == "histogram":
            names |= {name, name + "_bucket", name + "_sum", name + "_count"}
        elif kind == "info":
            names.add(name + "_info")
        else:
            names.add(name)
    return names


# -- checkers: each returns what is wrong with a page's text ---------------------------------------

def missing_runbooks(markdown: str, rules: list[dict]) -> list[str]:
    own = anchors(markdown)
    bad = []
    for rule in rules:
        url = rule.get("annotations", {}).get("runbook_url", "")
        path, _, fragment = url.partition("#")
        explicit = f'<a id="{fragment}"></a>\n### {rule["alert"]}\n'
        if path != "docs/operations.md" or fragment not in own or explicit not in markdown:
            bad.append(f"{rule['alert']}: {url!r}")
    return bad


def stale_runbooks(markdown: str, rules: list[dict]) -> list[str]:
    """Alert anchors on the page with no alert behind them (a renamed or removed alert)."""
    wanted = {r["annotations"]["runbook_url"].partition("#")[2] for r in rules}
    return sorted(a for a in HTML_ID.findall(markdown)
                  if a.startswith("tinyserve-") and a not in wanted)


def unknown_flags(markdown: str, known: set[str]) -> list[str]:
    return sorted({f for f in FLAG.findall(markdown)
                   if f not in known and f not in FOREIGN_FLAGS and f not in THIRD_PARTY_FLAGS})


def unknown_metrics(markdown: str, exported: set[str]) -> list[str]:
    return sorted(set(METRIC.findall(markdown)) - exported)


def broken_links(markdown: str, base: Path) -> list[str]:
    bad = []
    for target in LINK.findall(markdown):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        if not path:
            if fragment not in anchors(markdown):
                bad.append(target)
            continue
        file = (base / path).resolve()
        if not file.exists() or not file.is_relative_to(ROOT):
            bad.append(target)
        elif fragment and (file.suffix != ".md"
                           or fragment not in anchors(file.read_text(encoding="utf-8"))):
            bad.append(target)
    return bad


# -- the page ----------------------------------------------------------------------------------------

def test_every_alert_has_its_runbook_anchor() -> None:
    rules = alerts()
    assert len(rules) >= 10  # the rules file parsed and holds the alerts
    text = doc()
    assert not missing_runbooks(text, rules), missing_runbooks(text, rules)
    assert not stale_runbooks(text, rules), stale_runbooks(text, rules)


def test_every_flag_is_one_the_server_parses() -> None:
    text = doc()
    known = server_flags()
    assert {"--max-num-seqs", "--kv-cache-memory", "--route", "--access-log"} <= known
    assert len(set(FLAG.findall(text))) >= 20  # the page does name flags
    assert not unknown_flags(text, known), unknown_flags(text, known)


def test_foreign_flags_exist_in_their_programs() -> None:
    for flag, where in FOREIGN_FLAGS.items():
        source = (ROOT / where).read_text(encoding="utf-8")
        assert f'"{flag}"' in source, f"{flag} is not an option of {where}"


def test_every_metric_is_one_the_server_exports() -> None:
    text = doc()
    exported = exported_metrics()
    assert "tinyserve:kv_cache_usage_perc" in exported
    assert len(set(METRIC.findall(text))) >= 15
    assert not unknown_metrics(text, exported), unknown_metrics(text, exported)


def test_every_relative_link_resolves() -> None:
    text = doc()
    assert len(LINK.findall(text)) >= 30
    assert not broken_links(text, DOC.parent), broken_links(text, DOC.parent)


# -- the checkers catch what they should -------------------------------------------------------------

def test_checkers_reject_bad_pages() -> None:
    rule = {"alert": "TinyserveKVCacheFull",
            "annotations": {"runbook_url": "docs/operations.md#tinyserve-kv-cache-full"}}
    good = '<a id="tinyserve-kv-cache-full"></a>\n### TinyserveKVCacheFull\n'
    assert not missing_runbooks(good, [rule])
    assert missing_runbooks("### TinyserveKVCacheFull\n", [rule])  # slug differs, no <a id>
    assert missing_runbooks('<a id="tinyserve-kv-cache-ful"></a>\n### TinyserveKVCacheFull\n',
                            [rule])
    assert stale_runbooks(good + '<a id="tinyserve-gone"></a>\n', [rule]) == ["tinyserve-gone"]

    known = {"--max-num-seqs"}
    assert unknown_flags("`--max-num-seqs 8` and `--gpu-memory-utilization 0.9`", known) == [
        "--gpu-memory-utilization"]
    assert not unknown_flags("a well-known -- dash, max_num_seqs, --max-num-seqs", known)

    exported = {"tinyserve:num_preemptions_total", "tinyserve:time_to_first_token_seconds_bucket"}
    assert unknown_metrics("rate(tinyserve:num_preemptions[5m])", exported) == [
        "tinyserve:num_preemptions"]
    assert not unknown_metrics("`tinyserve:` and tinyserve:time_to_first_token_seconds_bucket{le}",
                               exported)

    page = "# Top\n[a](#top) [b](#nowhere) [c](../README.md) [d](../no/such.md) [e](https://x.y)"
    assert broken_links(page, DOC.parent) == ["#nowhere", "../no/such.md"]
    assert broken_links("[r](../README.md#no-such-heading)", DOC.parent) == [
        "../README.md#no-such-heading"]


def test_slug_and_anchors() -> None:
    assert slug("4. SLO tuning: targets, ladder, tenants, fallbacks") == \
        "4-slo-tuning-targets-ladder-tenants-fallbacks"
    assert slug("Several models, routes and fallbacks") == "several-models-routes-and-fallbacks"
    assert anchors("# A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1"}
