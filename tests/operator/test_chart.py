"""The Helm chart: lint, render, validate every manifest against Kubernetes 1.30+ schemas, the
CRDs against their Python definition, the examples against the CRD schemas, and the alert rules
with promtool."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from adaflash_operator import contract as c
from adaflash_operator import crds
from adaflash_operator.spec import parse

kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                          reason="pip install -e .[dev] brings it")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "adaflash"
K8S_VERSIONS = ["1.30.0", "1.37.0"]
ALL_ON = ["--set", "metrics.serviceMonitor.enabled=true", "--set",
          "metrics.servingMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true",
          "--set", "example.enabled=true", "--set", "servingPodGuard.enabled=true"]
VALUE_SETS = {
    "defaults": [],
    "everything": ALL_ON,
    "namespaced": ALL_ON + ["--set", "operator.watchNamespaces={team-a,team-b}",
                            "--set", "serviceAccount.name=op", "--set", "operator.verbose=true"],
}


def helm_path() -> str:
    for cand in (os.environ.get("HELM"), str(ROOT / ".cache" / "tools" / "helm"),
                 shutil.which("helm")):
        if cand and os.access(cand, os.X_OK):
            return cand
    msg = "helm not found: run `make tools` (puts it in .cache/tools) or set $HELM"
    if os.environ.get("CI"):
        pytest.fail(msg)  # CI installs it; a missing helm there is a failure, not a skip
    pytest.skip(msg)


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_path(), *args], capture_output=True, text=True, timeout=60)


def render(*values: str) -> list[dict]:
    r = helm("template", "rel", str(CHART), "--namespace", "adaflash-system", "--include-crds",
             "--kube-version", "1.30.0", *values)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def test_chart_crds_are_generated_from_the_python_definition() -> None:
    for name in crds.CRD_FILES:
        on_disk = (CHART / "crds" / name).read_text()
        assert on_disk == crds.render(name), (
            f"helm/adaflash/crds/{name} is stale: run "
            f"`PYTHONPATH=operator python -m adaflash_operator crds --out helm/adaflash/crds`")


def _walk(schema: dict, path: str):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("kind", [c.SERVICE_KIND, c.DRAFTER_KIND])
def test_crd_schemas_are_structural(kind: str) -> None:
    for path, node in _walk(crds.openapi_schema(kind), kind):
        typed = "type" in node or node.get("x-kubernetes-int-or-string") or \
            node.get("x-kubernetes-preserve-unknown-fields")
        assert typed, f"{path} has no type: structural schemas need one everywhere"
        assert "description" in node or path.count(".") <= 1 or "{}" in path or \
            path.endswith("[]"), f"{path} has no description"
        if "default" in node:  # a default must satisfy its own schema
            jsonschema.Draft4Validator(node).validate(node["default"])


def test_printer_columns_show_versions_ready_pods_and_tau() -> None:
    cols = crds.service_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    paths = {col["jsonPath"] for col in cols if not col.get("priority")}
    assert {".status.servingVersion", ".status.candidateVersion", ".status.latestVersion",
            ".status.readyReplicas", ".status.tau"} <= paths
    sub = crds.service_crd()["spec"]["versions"][0]["subresources"]
    assert sub["scale"]["specReplicasPath"] == ".spec.replicas" and "status" in sub


def test_helm_lint() -> None:
    for values in VALUE_SETS.values():
        r = helm("lint", "--strict", str(CHART), *values)
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_rendered_manifest_validates(name: str) -> None:
    docs = render(*VALUE_SETS[name])
    kinds = sorted({d["kind"] for d in docs})
    assert "CustomResourceDefinition" in kinds and "Deployment" in kinds
    checked = 0
    for doc in docs:
        api = doc["apiVersion"]
        if api.startswith("monitoring.coreos.com/"):
            assert doc["kind"] in ("ServiceMonitor", "PrometheusRule") and doc["spec"]
            continue
        if api == c.API_VERSION:
            _validate_cr(doc)
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked >= 6


def test_operator_pod_is_hardened_and_rbac_is_least_privilege() -> None:
    docs = render()
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"]
    assert ctr["securityContext"] == {"allowPrivilegeEscalation": False,
                                      "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                                      "capabilities": {"drop": ["ALL"]}}
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # Leader election: a new pod waits for the Lease, so a rolling update is safe.
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "--leader-elect" in ctr["args"]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert "*" not in verbs and "escalate" not in verbs and "bind" not in verbs
    assert not any("*" in rule["resources"] for rule in role["rules"])
    # Deletes: only the optional children the spec can turn off (the guard: only its own).
    deletable = {r for rule in role["rules"] if "delete" in rule["verbs"]
                 for r in rule["resources"]}
    assert deletable == {"poddisruptionbudgets", "networkpolicies", "horizontalpodautoscalers",
                         "scaledobjects"}
    # What RBAC cannot narrow, the admission policy does, for this ServiceAccount.
    guard = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"
                 and d["metadata"]["name"].endswith("-operator-writes"))
    assert guard["spec"]["matchConditions"][0]["expression"] == \
        "request.userInfo.username == 'system:serviceaccount:adaflash-system:rel-adaflash'"
    # No parameters: the server looks them up before matchConditions, so "none found: deny"
    # would deny every user's writes in namespaces without an AdaFlashService.
    assert "paramKind" not in guard["spec"]
    binding = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
                   and d["spec"]["policyName"] == guard["metadata"]["name"])
    assert "paramRef" not in binding["spec"] and binding["spec"]["validationActions"] == ["Deny"]
    # Leases: in the release namespace only, by name but for create.
    lease = next(d for d in docs if d["kind"] == "Role" and "leader" in d["metadata"]["name"])
    assert lease["metadata"]["namespace"] == "adaflash-system"
    assert {tuple(r["verbs"]) for r in lease["rules"]} == {("create",), ("get", "patch")}
    # Secrets: it creates the serving pods' admin token and can read none.
    assert [rule["verbs"] for rule in role["rules"] if "secrets" in rule["resources"]] == \
        [["create"]]
    # Namespaced mode: no cluster-wide grant at all.
    docs = render("--set", "operator.watchNamespaces={team-a}")
    assert not any(d["kind"].startswith("Cluster") for d in docs
                   if d["kind"] != "CustomResourceDefinition")
    assert "--namespace=team-a" in next(
        d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"][0]["args"]


def _rules(docs: list[dict], kind: str = "ClusterRole") -> set[tuple[str, str]]:
    role = next(d for d in docs if d["kind"] == kind)
    return {(res, verb) for rule in role["rules"] for res in rule["resources"]
            for verb in rule["verbs"]}


@pytest.mark.parametrize("values", [[], ["--set", "operator.watchNamespaces={team-a}"]])
def test_operator_may_set_block_owner_deletion_and_read_job_logs(values: list[str]) -> None:
    """OwnerReferencesPermissionEnforcement (OpenShift) refuses blockOwnerDeletion without
    update on the owner's finalizers; a report cut at 4096 bytes is read from pods/log."""
    rules = _rules(render(*values), "Role" if values else "ClusterRole")
    assert ("adaflashservices/finalizers", "update") in rules
    assert ("pods/log", "get") in rules
    assert {("cronjobs", v) for v in ("get", "create", "patch")} <= rules


def test_service_monitors_keep_the_labels_the_alerts_join_on() -> None:
    for d in render(*ALL_ON):
        if d["kind"] == "ServiceMonitor":
            assert all(ep.get("honorLabels") is True for ep in d["spec"]["endpoints"]), d


def test_serving_pod_guard_is_on_and_matches_only_serving_accounts() -> None:
    docs = render()
    policy = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"
                  and d["metadata"]["name"].endswith("-serving-pods"))
    binding = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
                   and d["spec"]["policyName"] == policy["metadata"]["name"])
    assert policy["spec"]["paramKind"] == {"apiVersion": "v1", "kind": "ConfigMap"}
    assert "endsWith" not in yaml.safe_dump(policy)
    assert c.SERVING_ACCOUNT_KEY in yaml.safe_dump(policy)
    ref = binding["spec"]["paramRef"]
    assert ref["parameterNotFoundAction"] == "Allow"
    # The fleet ConfigMap the operator builds is what the binding selects.
    from adaflash_operator import manifests
    cm = manifests.configmap({"metadata": {"name": "qwen", "namespace": "ml", "uid": "u"}},
                             "v000001")
    assert ref["selector"]["matchLabels"].items() <= cm["metadata"]["labels"].items()
    assert cm["data"][c.SERVING_ACCOUNT_KEY] == "qwen-serving"


def test_chart_requires_kubernetes_1_30() -> None:
    r = helm("template", "rel", str(CHART), "--kube-version", "1.29.0")
    assert r.returncode != 0 and "kubeVersion" in r.stderr, r.stderr


def test_crds_are_kept_on_uninstall() -> None:
    for d in render():
        if d["kind"] == "CustomResourceDefinition":
            assert d["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert (CHART / "crds").is_dir()  # Helm never deletes what crds/ installed


def test_without_leader_election_one_operator_and_recreate() -> None:
    docs = render("--set", "operator.leaderElection.enabled=false")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    assert "--leader-elect" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any("leader" in d["metadata"]["name"] for d in docs if d["kind"] == "Role")
    dep = next(d for d in render("--set", "operator.replicas=2") if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 2


@pytest.mark.parametrize("values,needle", [
    (["--set", "operator.replicas=2", "--set", "operator.leaderElection.enabled=false"],
     "needs operator.leaderElection"),
    (["--set", "operator.leaderElection.renewDeadlineSeconds=20"], "less than"),
    (["--set", "operator.tickSeconds=0"], "tickSeconds"),
    (["--set", "operator.image.pullPolicy=Sometimes"], "pullPolicy"),
    (["--set", "metrics.prometheusRule.acceptanceDropRatio=2"], "acceptanceDropRatio"),
    (["--set", "operator.unknownKey=1"], "unknownKey"),
])
def test_values_schema_rejects_bad_values(values: list[str], needle: str) -> None:
    r = helm("template", "rel", str(CHART), *values)
    assert r.returncode != 0 and needle in r.stderr, r.stderr


def _schema_for(kind: str) -> dict:
    """The CRD's openAPIV3Schema as draft-4 JSON Schema with the API server's defaults applied
    by the caller; metadata is checked by the API server, not here."""
    schema = copy.deepcopy(crds.openapi_schema(kind))
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def _validate_cr(doc: dict) -> None:
    jsonschema.Draft4Validator(_schema_for(doc["kind"])).validate(doc)
    if doc["kind"] == c.SERVICE_KIND:
        parse(doc["spec"])  # the operator's own checks agree


def test_examples_validate_against_the_crd_schemas() -> None:
    examples = sorted((CHART / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        for doc in yaml.safe_load_all(path.read_text()):
            _validate_cr(doc)
    rendered = [d for d in render(*ALL_ON) if d["apiVersion"] == c.API_VERSION]
    assert [d["kind"] for d in rendered] == [c.SERVICE_KIND]
    # And the schema does reject a broken one.
    bad = yaml.safe_load((CHART / "examples" / "adaflashservice.yaml").read_text())
    bad["spec"]["rollout"]["canaryFraction"] = 0
    with pytest.raises(jsonschema.ValidationError, match="canaryFraction|minimum"):
        _validate_cr(bad)


def test_alert_rules_pass_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus); .ci/run installs it")
    rule = next(d for d in render(*ALL_ON) if d["kind"] == "PrometheusRule")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts == {"AdaFlashAcceptanceDrop", "AdaFlashRolloutStuck",
                      "AdaFlashDistillationFailing"}
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule["spec"]))
    r = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # The alerts fire on the series the operator exports (promtool unit test).
    by_name = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}

    def firing(alert: str, value: str) -> list[dict]:
        ann = {k: v.replace("{{ $labels.namespace }}", "ml")
               .replace("{{ $labels.service }}", "qwen")
               .replace('{{ $value | printf "%.2f" }}', f"{float(value):.2f}")
               .replace("{{ $value }}", value)
               for k, v in by_name[alert]["annotations"].items()}
        return [{"exp_labels": {"severity": "warning", "namespace": "ml", "service": "qwen"},
                 "exp_annotations": ann}]

    tests = tmp_path / "tests.yaml"
    tests.write_text(yaml.safe_dump({
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": 'adaflash_operator_distill_consecutive_failures'
                           '{namespace="ml",service="qwen"}', "values": "0 1 2 3x20"},
                {"series": 'adaflash_operator_rollout_active{namespace="ml",service="qwen"}',
                 "values": "1x200"},
                {"series": 'adaflash_operator_rollout_started_timestamp_seconds'
                           '{namespace="ml",service="qwen"}', "values": "0x200"},
                {"series": 'adaflash_operator_live_tau{namespace="ml",service="qwen"}',
                 "values": "5x30 3x60"},
            ],
            "alert_rule_test": [
                {"eval_time": "20m", "alertname": "AdaFlashDistillationFailing",
                 "exp_alerts": firing("AdaFlashDistillationFailing", "3")},
                {"eval_time": "2m", "alertname": "AdaFlashDistillationFailing",
                 "exp_alerts": []},
                {"eval_time": "60m", "alertname": "AdaFlashRolloutStuck", "exp_alerts": []},
                {"eval_time": "130m", "alertname": "AdaFlashRolloutStuck",
                 "exp_alerts": firing("AdaFlashRolloutStuck", "7800")},
                {"eval_time": "80m", "alertname": "AdaFlashAcceptanceDrop",
                 "exp_alerts": firing("AdaFlashAcceptanceDrop", "3")},
                {"eval_time": "20m", "alertname": "AdaFlashAcceptanceDrop", "exp_alerts": []},
            ],
        }, {
            # The operator pod restarts (or another replica takes the Lease) at minute 61: the
            # same gauges under another pod label. The alerts carry on across it.
            "interval": "1m",
            "input_series": [
                {"series": 'adaflash_operator_live_tau{namespace="ml",service="qwen",'
                           'pod="op-a"}', "values": "5x60"},
                {"series": 'adaflash_operator_live_tau{namespace="ml",service="qwen",'
                           'pod="op-b"}', "values": "_x61 3x60"},
                {"series": 'adaflash_operator_distill_consecutive_failures{namespace="ml",'
                           'service="qwen",pod="op-a"}', "values": "3x30"},
                {"series": 'adaflash_operator_distill_consecutive_failures{namespace="ml",'
                           'service="qwen",pod="op-b"}', "values": "_x31 3x60"},
            ],
            "alert_rule_test": [
                {"eval_time": "100m", "alertname": "AdaFlashAcceptanceDrop",
                 "exp_alerts": firing("AdaFlashAcceptanceDrop", "3")},
                {"eval_time": "40m", "alertname": "AdaFlashDistillationFailing",
                 "exp_alerts": firing("AdaFlashDistillationFailing", "3")},
            ],
        }],
    }))
    r = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_manifest_the_operator_builds_validates() -> None:
    from adaflash_operator import job_manifests, manifests

    owner = {"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND,
             "metadata": {"name": "qwen", "namespace": "ml", "uid": "0b1c-2d3e"}}
    example = yaml.safe_load((CHART / "examples" / "adaflashservice.yaml").read_text())
    s = parse(example["spec"])
    from adaflash_operator import autoscaling, policies

    s_all = parse({**example["spec"], "autoscaling": {"enabled": True, "maxReplicas": 1},
                   "storage": {"accessMode": "ReadWriteOnce"}, "replicas": 1})
    built = [manifests.pvc(owner, s), manifests.configmap(owner, "v000001"),
             manifests.service_account(owner), manifests.role(owner),
             manifests.role_binding(owner), manifests.deployment(owner, s),
             manifests.service(owner, s), job_manifests.job(owner, s, 1, 1, "v000001"),
             manifests.jobs_service_account(owner), job_manifests.retention_cronjob(owner, s_all),
             job_manifests.job(owner, s_all, 1, 1, "v000001"),
             policies.pod_disruption_budget(owner, s), policies.network_policy(owner, s),
             autoscaling.hpa(owner, s_all)]
    for doc in built:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    dv = job_manifests.drafter_version(owner, {
        "version": "v000002", "parent": "v000001", "created": "2026-11-30T09:00:00Z",
        "target": {"name": "Qwen/Qwen3-8B", "sha256": "ab" * 32},
        "training": {"algorithm": "opd-rkl", "records": 10, "steps": 2, "finalLoss": 0.5},
        "eval": {"tau": {"chat": 5.0}, "parentTau": {"chat": 4.0}}}, "qwen-distill-1-1")
    _validate_cr(dv)


def test_docs_describe_every_crd_field_and_annotation() -> None:
    doc = (ROOT / "docs" / "operator.md").read_text()
    for kind in (c.SERVICE_KIND, c.DRAFTER_KIND):
        schema = crds.openapi_schema(kind)
        for top in ("spec", "status"):
            for path, _ in _walk(schema["properties"][top], top):
                if path == top or ".kopf" in path or path.endswith(("[]", "{}")):
                    continue
                assert f"`{path}`" in doc, f"docs/operator.md does not describe {kind} {path}"
    for name in (c.DESIRED_VERSION, c.LOADED_VERSION, c.LOAD_ERROR, c.ACCEPTANCE_TAU,
                 c.TRAFFIC_RECORDS, c.FLEET_VERSION_FILE, c.POD_ANNOTATIONS_FILE):
        assert name in doc, f"docs/operator.md does not document {name}"
