"""deploy/prometheus and deploy/grafana: promtool checks the config, the rules and every query we ship, the
rule unit tests pass (and fail when a rule is broken), and every `titan:` series we query is exported.

Needs `promtool` (Debian: `apt-get install prometheus`); skipped without it.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULE_FILES = sorted((PROMETHEUS / "rules").glob("*.yml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "titan-dashboard.json"
SCALED_OBJECT = ROOT / "deploy" / "k8s" / "components" / "keda" / "scaledobject.yaml"
PROMTOOL = shutil.which("promtool")
# Series the rules may use that Titan does not export (yet): admission control is being written; the rest
# come from Prometheus itself and kube-state-metrics.
NOT_FROM_TITAN = {"titan:admission_rejections_total"}

pytestmark = pytest.mark.skipif(PROMTOOL is None,
                                reason="promtool not installed (apt-get install prometheus)")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def test_rules_are_valid():
    completed = promtool("check", "rules", *map(str, RULE_FILES))
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_rule_unit_tests_pass():
    completed = promtool("test", "rules", str(PROMETHEUS / "tests" / "titan-rules.test.yml"))
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_rule_unit_tests_catch_a_broken_rule(tmp_path):
    """The same unit tests against alert rules whose tail-latency threshold was loosened: they must fail."""
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    for rule_file in RULE_FILES:
        text = rule_file.read_text()
        if "TitanTailLatencySpike" in text:
            assert ") > 3\n" in text
            text = text.replace(") > 3\n", ") > 30\n")
        (tmp_path / "rules" / rule_file.name).write_text(text)
    shutil.copy(PROMETHEUS / "tests" / "titan-rules.test.yml", tmp_path / "tests")
    completed = promtool("test", "rules", str(tmp_path / "tests" / "titan-rules.test.yml"))
    assert completed.returncode != 0 and "TitanTailLatencySpike" in completed.stdout + completed.stderr


def test_scrape_config_is_valid(tmp_path):
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    config["rule_files"] = [str(PROMETHEUS / path) for path in config["rule_files"]]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    completed = promtool("check", "config", str(path))
    unsupported = "field kubernetes_sd_configs not found" in completed.stdout + completed.stderr
    if completed.returncode != 0 and unsupported:
        # Debian builds Prometheus without Kubernetes discovery; check everything else (relabelling included)
        # with the discovery swapped for a static target.
        for job in config["scrape_configs"]:
            if job.pop("kubernetes_sd_configs", None) is not None:
                job["static_configs"] = [{"targets": ["pod.invalid:8000"]}]
        path.write_text(yaml.safe_dump(config))
        completed = promtool("check", "config", str(path))
    assert completed.returncode == 0, completed.stdout + completed.stderr


def dashboard_queries() -> dict[str, str]:
    """Every panel target's query, with Grafana's variables replaced by values PromQL accepts."""
    dashboard = json.loads(DASHBOARD.read_text())
    substitutions = {"$__rate_interval": "1m", "$__interval": "1m", "$model": ".*", "$namespace": ".*"}
    queries = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in substitutions.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"unknown variable in {target['expr']}"
            queries[f"panel {panel['id']} {panel['title']} {target['refId']}"] = expr
    return queries


def shipped_queries() -> dict[str, str]:
    """The dashboard's queries, KEDA's, and Prometheus Adapter's metricsQuery with its template filled in."""
    queries = dashboard_queries()
    for trigger in yaml.safe_load(SCALED_OBJECT.read_text())["spec"]["triggers"]:
        queries[f"keda {trigger['name']}"] = trigger["metadata"]["query"]
    values = yaml.safe_load((PROMETHEUS / "prometheus-adapter-values.yaml").read_text())
    for index, rule in enumerate(values["rules"]["custom"]):
        query = (rule["metricsQuery"].replace("<<.Series>>", "titan:num_requests_waiting")
                 .replace("<<.LabelMatchers>>", 'namespace="default",pod=~"titan-a|titan-b"')
                 .replace("<<.GroupBy>>", "pod"))
        queries[f"adapter rule {index}"] = query
    return queries


def test_every_shipped_query_is_valid_promql(tmp_path):
    queries = shipped_queries()
    assert len(queries) > 30
    rules = {"groups": [{"name": "shipped-queries", "rules": [
        {"record": f"check:query_{index}", "expr": expr} for index, expr in enumerate(queries.values())]}]}
    path = tmp_path / "queries.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    completed = promtool("check", "rules", str(path))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    # And the check does reject a broken query.
    rules["groups"][0]["rules"].append({"record": "check:broken", "expr": "sum(rate(titan:x[5m])"})
    path.write_text(yaml.safe_dump(rules))
    assert promtool("check", "rules", str(path)).returncode != 0


def exported_series() -> set[str]:
    """Series names a Titan server exposes, from its own metrics registry."""
    pytest.importorskip("prometheus_client", reason="the server's metrics need prometheus_client")
    from titan.server.metrics import ServerMetrics

    text = ServerMetrics("model", max_model_len=2048, max_num_batched_tokens=512).render().decode()
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
        elif kind == "counter":
            names |= {name if name.endswith("_total") else f"{name}_total"}
        else:
            names.add(name)
    return names


def test_every_titan_series_we_query_is_exported():
    texts = [rule_file.read_text() for rule_file in RULE_FILES]
    texts += list(shipped_queries().values())  # the adapter's series regex is checked below
    used = {name for text in texts for name in re.findall(r"\btitan:[a-z0-9_]+", text)}
    exported = exported_series()
    assert len(used) >= 15
    assert {"titan:num_requests_waiting", "titan:inter_token_latency_seconds_bucket"} <= exported
    assert used - exported - NOT_FROM_TITAN == set()
    # The regex in the adapter's seriesQuery names the gauges too.
    adapter = yaml.safe_load((PROMETHEUS / "prometheus-adapter-values.yaml").read_text())
    pattern = re.search(r'__name__=~"([^"]+)"', adapter["rules"]["custom"][0]["seriesQuery"]).group(1)
    assert {name for name in exported if re.fullmatch(pattern, name)} == {
        "titan:num_requests_waiting", "titan:num_requests_running"}


def test_dashboard_structure():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "Titan"
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace", "model"}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len(graphs) >= 15
    for panel in graphs:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all(target["expr"] for target in panel["targets"])
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24
    titles = " ".join(panel["title"] for panel in graphs)
    for needed in ("Time to first token", "Inter-token latency", "KV cache", "Waiting", "Tokens / s"):
        assert needed in titles
