"""deploy/k8s: every overlay renders with kustomize, passes strict schema validation, and fits Titan itself.

Needs `kubectl` (>= 1.21: kustomize >= 4 built in) and `kubernetes-validate` (PyPI); skipped without them.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from titan.autoscale.hpa import Behavior
from titan.autoscale.policies import SHIPPED_BEHAVIOR, load_policies
from titan.entrypoints.cli import build_parser
from titan.router.args import flag_settings
from titan.router.config import RouterConfig, build_config

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "gpu-keda")
BUILT_IN_KINDS = {"Deployment", "Service", "PodDisruptionBudget", "PersistentVolumeClaim",
                  "HorizontalPodAutoscaler"}
# The oldest Kubernetes still commonly run, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.29.0", None)


def kustomize_version() -> tuple[int, ...] | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    completed = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True,
                               timeout=30)
    if completed.returncode != 0:
        return None
    found = re.search(r"v(\d+)\.(\d+)", json.loads(completed.stdout).get("kustomizeVersion", ""))
    return tuple(int(part) for part in found.groups()) if found else None


pytestmark = pytest.mark.skipif(
    (kustomize_version() or (0,)) < (4,),
    reason="needs kubectl with kustomize >= 4 (components); Debian's kubernetes-client 1.20 has kustomize 2",
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    documents = {}
    for overlay in OVERLAYS:
        command = ["kubectl", "kustomize", str(K8S / "overlays" / overlay)]
        completed = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert completed.returncode == 0, completed.stderr
        documents[overlay] = [doc for doc in yaml.safe_load_all(completed.stdout) if doc]
    return documents


def only(documents: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [doc for doc in documents if doc["kind"] == kind and name in (None, doc["metadata"]["name"])]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, got {len(matches)}"
    return matches[0]


def container(documents: list[dict]) -> dict:
    (titan,) = only(documents, "Deployment", "titan")["spec"]["template"]["spec"]["containers"]
    return titan


def serve_args(documents: list[dict]):
    return build_parser().parse_args(container(documents)["args"])


def router_pod(documents: list[dict]) -> dict:
    return only(documents, "Deployment", "titan-router")["spec"]["template"]


def router_container(documents: list[dict]) -> dict:
    (router,) = router_pod(documents)["spec"]["containers"]
    return router


def router_config(documents: list[dict]) -> RouterConfig:
    """The router's args through the real CLI parser and settings builder (which validates them)."""
    args = build_parser().parse_args(router_container(documents)["args"])
    assert args.command == "router"
    return build_config({}, flag_settings(args))


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_every_overlay_renders_the_expected_objects(rendered):
    kinds = {overlay: sorted(doc["kind"] for doc in docs) for overlay, docs in rendered.items()}
    common = ["Deployment", "PersistentVolumeClaim", "PodDisruptionBudget", "Service", "ServiceMonitor",
              "Deployment", "Service", "Service", "PodDisruptionBudget"]  # the router's, and the headless Service
    assert kinds["cpu"] == sorted([*common, "HorizontalPodAutoscaler"])
    assert kinds["gpu"] == sorted([*common, "HorizontalPodAutoscaler"])
    assert kinds["gpu-keda"] == sorted([*common, "ScaledObject"])  # KEDA owns the HPA there


def test_built_in_objects_pass_strict_schema_validation(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                              reason="pip install kubernetes-validate==1.37.0")
    checked = 0
    for documents in rendered.values():
        for doc in documents:
            if doc["kind"] not in BUILT_IN_KINDS:
                continue
            for version in KUBERNETES_VERSIONS:
                version = version or kubernetes_validate.latest_version()
                kubernetes_validate.validate(doc, version, strict=True)
                checked += 1
    assert checked == 2 * (9 + 9 + 8)  # with the router component's Deployment, two Services and budget
    # The validator does reject what it should: an unknown field under strict validation.
    broken = json.loads(json.dumps(only(rendered["cpu"], "Deployment", "titan")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


# The parts of the CRDs' schemas that the manifests use: required fields, types and formats.
DURATION = r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"]},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"], "additionalProperties": False,
                    "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                                   "interval": {"type": "string", "pattern": DURATION},
                                   "scrapeTimeout": {"type": "string", "pattern": DURATION}}}},
            },
        },
    },
}
SCALING_RULES = {"type": "object", "properties": {
    "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
    "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
    "policies": {"type": "array", "items": {"type": "object", "required": ["type", "value", "periodSeconds"],
                                            "properties": {"type": {"enum": ["Pods", "Percent"]},
                                                           "value": {"type": "integer", "minimum": 1},
                                                           "periodSeconds": {"type": "integer", "minimum": 1,
                                                                             "maximum": 1800}}}}}}
SCALED_OBJECT_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"]},
                "pollingInterval": {"type": "integer"},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "advanced": {"type": "object", "properties": {"horizontalPodAutoscalerConfig": {
                    "type": "object", "properties": {"name": {"type": "string"}, "behavior": {
                        "type": "object",
                        "properties": {"scaleUp": SCALING_RULES, "scaleDown": SCALING_RULES}}}}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"],
                    "properties": {
                        "type": {"type": "string"},
                        "name": {"type": "string"},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        # KEDA reads trigger metadata as a map of strings: a bare number fails to load.
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"},
                                     "required": ["serverAddress", "query", "threshold"]},
                    }}},
            },
        },
    },
}


def test_custom_resources_have_their_required_fields(rendered):
    jsonschema = pytest.importorskip("jsonschema", reason="comes with kubernetes-validate")
    for documents in rendered.values():
        jsonschema.validate(only(documents, "ServiceMonitor"), SERVICE_MONITOR_SCHEMA)
    scaled_object = only(rendered["gpu-keda"], "ScaledObject")
    jsonschema.validate(scaled_object, SCALED_OBJECT_SCHEMA)
    broken = json.loads(json.dumps(scaled_object))
    broken["spec"]["triggers"][0]["metadata"]["threshold"] = 5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCALED_OBJECT_SCHEMA)


def test_container_args_are_titan_serve_flags(rendered):
    devices = {overlay: serve_args(docs).device for overlay, docs in rendered.items()}
    assert devices == {"cpu": "cpu", "gpu": "cuda", "gpu-keda": "cuda"}
    for documents in rendered.values():
        args = serve_args(documents)
        assert args.command == "serve" and args.host == "0.0.0.0"
        assert args.port == container(documents)["ports"][0]["containerPort"]


def test_shutdown_fits_in_the_grace_period(rendered):
    from titan.server.serve import GRACEFUL_CLOSE_SECONDS

    for documents in rendered.values():
        pod = only(documents, "Deployment", "titan")["spec"]["template"]["spec"]
        pre_stop = container(documents)["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        worst_case = float(pre_stop[1]) + serve_args(documents).drain_timeout + GRACEFUL_CLOSE_SECONDS
        assert worst_case < pod["terminationGracePeriodSeconds"], "SIGKILL would cut the drain short"


def test_probes_cover_cold_start_readiness_and_liveness(rendered):
    minimum_cold_start_budget = {"cpu": 300, "gpu": 900, "gpu-keda": 900}
    for overlay, documents in rendered.items():
        titan = container(documents)
        startup, readiness, liveness = titan["startupProbe"], titan["readinessProbe"], titan["livenessProbe"]
        assert startup["httpGet"]["path"] == "/ready" and readiness["httpGet"]["path"] == "/ready"
        assert liveness["httpGet"]["path"] == "/health"
        port_names = {port["name"] for port in titan["ports"]}
        assert {probe["httpGet"]["port"] for probe in (startup, readiness, liveness)} <= port_names
        assert startup["periodSeconds"] * startup["failureThreshold"] >= minimum_cold_start_budget[overlay]
        # A liveness failure must take longer to trigger than a readiness one: drop traffic before restarting.
        assert (liveness["periodSeconds"] * liveness["failureThreshold"]
                > readiness["periodSeconds"] * readiness["failureThreshold"])


def test_services_budgets_and_monitors_select_the_pods(rendered):
    for documents in rendered.values():
        deployment = only(documents, "Deployment", "titan")
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        service = only(documents, "Service", "titan")
        assert service["spec"]["selector"].items() <= pod_labels.items()
        container_ports = {port["name"] for port in container(documents)["ports"]}
        assert {port["targetPort"] for port in service["spec"]["ports"]} <= container_ports
        pdb = only(documents, "PodDisruptionBudget", "titan")
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert "maxUnavailable" in pdb["spec"]  # minAvailable: 1 would block node drains at 1 replica
        monitor = only(documents, "ServiceMonitor")
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        service_ports = {port["name"] for port in service["spec"]["ports"]}
        assert {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]} <= service_ports
        volumes = {volume["name"]: volume for volume in deployment["spec"]["template"]["spec"]["volumes"]}
        claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
        assert only(documents, "PersistentVolumeClaim")["metadata"]["name"] == claim
        assert serve_args(documents).model.startswith("/models/")


def adapter_metric_names() -> set[str]:
    """The custom-metric names Prometheus Adapter exposes for Titan's gauges, by its rules' renaming."""
    values = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus-adapter-values.yaml").read_text())
    exposed = set()
    for rule in values["rules"]["custom"]:
        for series in ("titan:num_requests_waiting", "titan:num_requests_running",
                       "titan:kv_cache_usage_perc"):
            match = re.match(rule["name"]["matches"], series)
            if match:
                exposed.add(re.sub(r"\$\{(\d+)\}", lambda ref, found=match: found.group(int(ref.group(1))),
                                   rule["name"]["as"]))
    return exposed


def test_hpa_scales_the_deployment_on_metrics_the_adapter_serves(rendered):
    for overlay in ("cpu", "gpu"):
        documents = rendered[overlay]
        hpa = only(documents, "HorizontalPodAutoscaler")
        assert hpa["spec"]["scaleTargetRef"]["name"] == only(documents, "Deployment", "titan")["metadata"]["name"]
        targets = {m["pods"]["metric"]["name"]: float(m["pods"]["target"]["averageValue"])
                   for m in hpa["spec"]["metrics"]}
        assert set(targets) == {"titan_num_requests_waiting", "titan_num_requests_running"}
        assert set(targets) <= adapter_metric_names()
        # The running target is 75 % of the batch each replica may run.
        assert targets["titan_num_requests_running"] == 0.75 * serve_args(documents).max_num_seqs
        behavior = hpa["spec"]["behavior"]
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
        # The behavior `titan autoscale simulate` uses for its "queue-running" preset.
        assert Behavior.from_kubernetes(behavior) == SHIPPED_BEHAVIOR


def test_keda_alternative_matches_the_hpa(rendered):
    hpa = only(rendered["gpu"], "HorizontalPodAutoscaler")
    scaled = only(rendered["gpu-keda"], "ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == "titan"
    assert spec["minReplicaCount"] == hpa["spec"]["minReplicas"]
    assert spec["maxReplicaCount"] == hpa["spec"]["maxReplicas"]
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["spec"]["behavior"]
    thresholds = {trigger["name"]: float(trigger["metadata"]["threshold"]) for trigger in spec["triggers"]}
    averages = {metric["pods"]["metric"]["name"].removeprefix("titan_num_requests_"):
                float(metric["pods"]["target"]["averageValue"]) for metric in hpa["spec"]["metrics"]}
    assert thresholds == averages
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert f"titan:num_requests_{trigger['name']}" in trigger["metadata"]["query"]


def test_gpu_overlays_ask_for_a_gpu_and_cpu_gets_guaranteed_qos(rendered):
    for overlay in ("gpu", "gpu-keda"):
        resources = container(rendered[overlay])["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == "1"
        tolerations = only(rendered[overlay], "Deployment", "titan")["spec"]["template"]["spec"]["tolerations"]
        assert any(toleration["key"] == "nvidia.com/gpu" for toleration in tolerations)
    cpu = container(rendered["cpu"])["resources"]
    assert cpu["requests"] == cpu["limits"]
    threads = {env["name"]: env.get("value") for env in container(rendered["cpu"])["env"]}["OMP_NUM_THREADS"]
    assert threads == cpu["limits"]["cpu"]


def test_the_simulator_reads_the_shipped_hpa(rendered, tmp_path):
    manifest = tmp_path / "cpu.yaml"
    manifest.write_text(yaml.safe_dump_all(rendered["cpu"]))
    (policy,) = load_policies(manifest)
    assert policy.name == "titan"
    targets = {(metric.type, metric.target) for metric in policy.metrics}
    assert targets == {("waiting", 5.0), ("running", 12.0)}
    assert policy.hpa.behavior == SHIPPED_BEHAVIOR
    assert (policy.hpa.min_replicas, policy.hpa.max_replicas) == (1, 8)


# ---- the router (components/router) ---------------------------------------------------------------------

# After --drain-timeout the router cancels what is left and closes its client: well under this.
ROUTER_CLOSE_SECONDS = 5


def test_router_discovers_the_titan_pods_through_the_headless_service(rendered):
    for documents in rendered.values():
        config = router_config(documents)
        headless = only(documents, "Service", "titan-headless")
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["publishNotReadyAddresses"] is False  # only pods whose /ready passed
        titan_pods = only(documents, "Deployment", "titan")["spec"]["template"]["metadata"]["labels"]
        router_pods = router_pod(documents)["metadata"]["labels"]
        assert selects(headless["spec"]["selector"], titan_pods)
        assert not selects(headless["spec"]["selector"], router_pods)
        assert config.backends == []
        (target,) = config.discover_dns
        # The short name resolves through the pod's DNS search path, in whatever namespace this lands.
        assert target.host == headless["metadata"]["name"]
        # DNS of a headless Service gives pod IPs, so the router connects to the container port itself:
        # the Service port must be that port, and the router's must match it.
        (service_port,) = headless["spec"]["ports"]
        titan_ports = {port["name"]: port["containerPort"] for port in container(documents)["ports"]}
        assert target.port == service_port["port"] == titan_ports[service_port["targetPort"]]
        assert target.port == serve_args(documents).port
        # Titan listens on 0.0.0.0, IPv4 only.
        assert serve_args(documents).host == "0.0.0.0" and config.discover_family == "ipv4"
        assert 0 < config.discover_interval <= 10
        # The ServiceMonitor scrapes the Titan pods once, through the `titan` Service only.
        monitor = only(documents, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
        scraped = [doc["metadata"]["name"] for doc in documents
                   if doc["kind"] == "Service" and selects(monitor, doc["metadata"]["labels"])]
        assert scraped == ["titan"]


def test_router_deployment_serves_its_service_with_probes_and_a_drain_that_fits(rendered):
    for documents in rendered.values():
        config = router_config(documents)
        deployment = only(documents, "Deployment", "titan-router")
        pod, router = router_pod(documents), router_container(documents)
        router_pods = pod["metadata"]["labels"]
        titan_pods = only(documents, "Deployment", "titan")["spec"]["template"]["metadata"]["labels"]
        assert selects(deployment["spec"]["selector"]["matchLabels"], router_pods)
        # Neither side's selectors (Deployment, Service, budget) take the other's pods.
        for kind, name in (("Deployment", "titan"), ("PodDisruptionBudget", "titan")):
            assert not selects(only(documents, kind, name)["spec"]["selector"]["matchLabels"], router_pods)
        assert not selects(only(documents, "Service", "titan")["spec"]["selector"], router_pods)
        assert not selects(deployment["spec"]["selector"]["matchLabels"], titan_pods)
        service = only(documents, "Service", "titan-router")
        assert selects(service["spec"]["selector"], router_pods)
        assert not selects(service["spec"]["selector"], titan_pods)
        ports = {port["name"]: port["containerPort"] for port in router["ports"]}
        assert {port["targetPort"] for port in service["spec"]["ports"]} <= set(ports)
        assert config.host == "0.0.0.0" and config.port == ports["http"]
        assert router["image"] == container(documents)["image"]  # the overlay's `images:` sets both
        # Readiness: the router can route (some Titan pod is in its pool); liveness: the process serves.
        readiness, liveness = router["readinessProbe"], router["livenessProbe"]
        assert readiness["httpGet"]["path"] == "/ready" and liveness["httpGet"]["path"] == "/health"
        assert {readiness["httpGet"]["port"], liveness["httpGet"]["port"]} <= set(ports)
        assert (liveness["periodSeconds"] * liveness["failureThreshold"]
                > readiness["periodSeconds"] * readiness["failureThreshold"])
        # Shutdown: preStop, then the router's drain and close, all before SIGKILL; and the drain is at
        # least as long as the servers' own, so a generation they would finish is not cut at the router.
        pre_stop = router["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        worst_case = float(pre_stop[1]) + config.drain_timeout + ROUTER_CLOSE_SECONDS
        assert worst_case < pod["spec"]["terminationGracePeriodSeconds"], "SIGKILL would cut the drain short"
        assert config.drain_timeout >= serve_args(documents).drain_timeout
        resources = router["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
        assert deployment["spec"]["replicas"] >= 2
        budget = only(documents, "PodDisruptionBudget", "titan-router")
        assert selects(budget["spec"]["selector"]["matchLabels"], router_pods)
        assert not selects(budget["spec"]["selector"]["matchLabels"], titan_pods)
        assert budget["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]
