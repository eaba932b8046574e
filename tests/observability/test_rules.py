"""The dashboard and the alerts (manifests/observability), checked with Prometheus's own tools:
`promtool check rules` and `promtool test rules` (tests/observability/rules_test.yaml: every
recording rule's value, every alert firing and not firing), and, without a tool, that every
metric and label they name is one the server exports (predictor/observability/metrics.py).
test_prometheus.py runs the same rules and every panel's query in a real Prometheus.

The tools: Debian's prometheus package, which `make prometheus-tools` unpacks into .tools/.
`make test` sets PROMETHEUS_TOOLS to that folder: a tool missing there fails the test. A plain
`pytest` looks in .tools/ and on PATH and skips, saying why, where it finds none.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from predictor.observability.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
OBSERVABILITY = REPO / "manifests" / "observability"
PROMETHEUS_RULE = OBSERVABILITY / "prometheusrule.yaml"
DASHBOARD = OBSERVABILITY / "gptq-predictor-dashboard.json"
UNIT_TESTS = Path(__file__).resolve().parent / "rules_test.yaml"
TOOLS_VARIABLE = "PROMETHEUS_TOOLS"
LOCAL_TOOLS = REPO / ".tools" / "prometheus" / "usr" / "bin"
# labels Prometheus adds to every series it scrapes (and the Kubernetes discovery's usual ones)
TARGET_LABELS = {"instance", "job", "namespace", "pod", "service", "container", "endpoint"}
# what Grafana puts in place of its variables, for a query sent to Prometheus directly
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1m"}
METRIC = re.compile(r"\b((?:predictor_|vllm:)[a-zA-Z0-9_:]+)")


def prometheus_tool(name: str) -> str:
    """The path of promtool or prometheus (see the module's docstring)."""
    folder = os.environ.get(TOOLS_VARIABLE)
    if folder:
        path = Path(folder) / name
        if not path.is_file():
            pytest.fail(f"{TOOLS_VARIABLE}={folder} has no {name}: run `make prometheus-tools`")
        return str(path)
    for candidate in (LOCAL_TOOLS / name, shutil.which(name)):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.skip(
        f"no {name}: `make prometheus-tools` puts Debian's prometheus package in .tools/ "
        f"(`make test` does, and fails without it)"
    )


def rule_spec() -> dict[str, Any]:
    """The PrometheusRule's spec: a Prometheus rule file, the one place the rules are kept."""
    doc = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    return doc["spec"]


def write_rules(folder: Path) -> Path:
    path = folder / "rules.yaml"
    path.write_text(yaml.safe_dump(rule_spec(), sort_keys=False))
    return path


def rules() -> list[dict[str, Any]]:
    return [rule for group in rule_spec()["groups"] for rule in group["rules"]]


def recording_rules() -> list[str]:
    return [rule["record"] for rule in rules() if "record" in rule]


def alerts() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "alert" in rule]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def panel_queries(model: str) -> list[tuple[str, str]]:
    """(panel title, query) for every target of every panel, Grafana's variables filled as
    Grafana fills them for one selected model."""
    filled = {**GRAFANA_VARIABLES, "$model": re.escape(model)}
    queries = []
    for panel in panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in filled.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{panel['title']}: a variable left in {expr}"
            queries.append((panel["title"], expr))
    return queries


def run(*args: str, cwd: Path | None = None) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# ---- promtool --------------------------------------------------------------------------------
def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    out = run(prometheus_tool("promtool"), "check", "rules", str(write_rules(tmp_path)))
    assert f"SUCCESS: {len(rules())} rules found" in out


def test_promtool_unit_tests_pass(tmp_path: Path) -> None:
    write_rules(tmp_path)
    shutil.copyfile(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    out = run(prometheus_tool("promtool"), "test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert "SUCCESS" in out


def test_every_rule_is_unit_tested() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    checked = {
        t["expr"].split("{")[0].strip()
        for group in tests
        for t in group.get("promql_expr_test", [])
    }
    assert set(recording_rules()) <= checked
    fired, quiet = set(), set()
    for group in tests:
        for t in group.get("alert_rule_test", []):
            (fired if t["exp_alerts"] else quiet).add(t["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names == fired, "every alert fires in a unit test"
    assert names == quiet, "every alert is also seen not firing"


# ---- the rules and the dashboard, read without a tool ------------------------------------------
def test_the_alerts_the_issue_asks_for_each_with_a_runbook() -> None:
    assert {a["alert"] for a in alerts()} == {
        "PredictorErrorRatioHigh", "PredictorTTFTHigh", "PredictorQueueGrowing",
        "PredictorKVCacheNearFull", "PredictorNoTokensGenerated", "PredictorReadinessFlapping",
    }  # fmt: skip
    for alert in alerts():
        notes = alert["annotations"]
        assert set(notes) == {"summary", "description", "runbook"}, alert["alert"]
        assert all(notes[k].strip() for k in notes), alert["alert"]
        assert "\n" not in notes["runbook"].strip(), f"{alert['alert']}: a one-line runbook"
        assert alert["labels"]["severity"] in ("warning", "critical")


def exported() -> dict[str, set[str]]:
    """Every sample name the server can export -> its labels (the vLLM aliases included)."""
    registry = CollectorRegistry()
    Metrics(registry, "m", vllm_aliases=True)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",), "info": ("_info",)}  # fmt: skip
    names: dict[str, set[str]] = {}
    for collector in list(registry._collector_to_names):  # labels even of unused collectors
        for family in collector.describe():
            labels = set(getattr(collector, "_labelnames", ()))
            for suffix in suffixes[family.type]:
                bucket = {"le"} if suffix == "_bucket" else set()
                names[family.name + suffix] = labels | bucket
    return names


def used_labels(expr: str) -> set[str]:
    grouped = re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr)
    matched = re.findall(r"[{,]\s*(\w+)\s*(?:=~|!~|!=|=)", expr)
    return {label.strip() for group in grouped for label in group.split(",") if label.strip()} | {
        *matched
    }


def level_labels(record: str) -> set[str]:
    """namespace_model_reason:metric:operation -> {namespace, model, reason}."""
    return set(record.split(":")[0].split("_"))


@pytest.mark.parametrize("where", ["rules", "dashboard"])
def test_only_exported_metrics_and_their_labels(where: str) -> None:
    names = exported()
    recorded = {name: level_labels(name) for name in recording_rules()}
    exprs = (
        [(r.get("record") or r["alert"], r["expr"]) for r in rules()]
        if where == "rules"
        else panel_queries("m")
    )
    for name, expr in exprs:
        uses = [r for r in recorded if r in expr]
        raw = set(METRIC.findall(functools.reduce(lambda e, r: e.replace(r, " "), uses, expr)))
        assert raw or uses, f"{name}: no metric in {expr}"
        unknown = raw - set(names)
        assert not unknown, f"{name}: {unknown} are not on /metrics (metrics.py)"
        allowed = TARGET_LABELS.union(*(names[m] for m in raw), *(recorded[r] for r in uses))
        assert used_labels(expr) <= allowed, f"{name}: labels {used_labels(expr) - allowed}"


def test_each_recording_rule_is_named_by_what_it_keeps() -> None:
    """level:metric:operation, the level being the labels the rule keeps."""
    for rule in rules():
        if "record" in rule:
            kept = {
                label.strip()
                for group in re.findall(r"\bby\s*\(([^)]*)\)", rule["expr"])
                for label in group.split(",")
            } - {"le"}
            assert kept == level_labels(rule["record"]), rule["record"]


def test_the_dashboard_has_the_panels_the_issue_asks_for() -> None:
    board = dashboard()
    titles = {p["title"] for p in panels()}
    assert {
        "Model ready", "Traffic", "Errors by reason", "Time to first token",
        "Time per output token", "End-to-end request latency", "Generated tokens/s", "Queue",
        "KV cache usage", "Preemptions", "Prefix cache hit rate", "Tokens/s by tenant",
    } <= titles  # fmt: skip
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in board["templating"]["list"]}
    assert variables == {"datasource", "model"}
    for panel in panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
    ttft = [q for title, q in panel_queries("m") if title == "Time to first token"]
    assert [re.findall(r"histogram_quantile\(([\d.]+)", q) for q in ttft] == [
        ["0.5"], ["0.95"], ["0.99"],
    ]  # fmt: skip


def test_the_monitoring_page_names_every_alert_and_rule_and_only_real_flags() -> None:
    from predictor.config import build_parser

    page = (REPO / "docs" / "monitoring.md").read_text()
    for name in [a["alert"] for a in alerts()] + recording_rules():
        assert f"`{name}`" in page, f"docs/monitoring.md does not name {name}"
    flags = {f for action in build_parser({})._actions for f in action.option_strings}
    named = set(re.findall(r"`(--[a-z][a-z-]*)", page))
    assert named and named <= flags, named - flags
    variables = set(re.findall(r"\bPREDICTOR_[A-Z_]+", page))
    assert {f"--{v[len('PREDICTOR_') :].lower().replace('_', '-')}" for v in variables} <= flags
