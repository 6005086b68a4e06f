"""Pure pieces: spec validation and defaults, manifest builders, the distillation trigger and
Job report, conditions."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from adaflash_operator import contract as c
from adaflash_operator import distill, job_manifests, manifests
from adaflash_operator.conditions import is_subset, replace_patch, set_condition
from adaflash_operator.spec import InvalidSpec, parse

MIN = {"model": {"target": "Qwen/Qwen3-8B"}, "serving": {"image": "img:1"}}
OWNER = {"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND,
         "metadata": {"name": "qwen", "namespace": "ml", "uid": "u-1"}}


def test_defaults_come_from_the_crd_schema() -> None:
    s = parse(MIN)
    assert (s.replicas, s.block_size, s.port, s.gpus) == (1, 16, 30000, 1)
    assert s.initial_version == "v000001" and s.pinned_version == ""
    assert s.access_mode == "ReadWriteMany" and s.storage_size == "200Gi"
    assert s.distillation.image == "img:1" and s.distillation.min_new_records == 128
    assert s.rollout.canary_fraction == 0.25 and s.rollout.auto_promote


@pytest.mark.parametrize("over,needle", [
    ({"model": {}}, "spec.model: 'target' is a required property"),
    ({"serving": {"image": "i", "blockSize": 65}}, "spec.serving.blockSize"),
    ({"drafter": {"pinnedVersion": "latest"}}, "spec.drafter.pinnedVersion"),
    ({"rollout": {"canaryFraction": 0}}, "spec.rollout.canaryFraction"),
    ({"storage": {"accessMode": "ReadWriteMostly"}}, "spec.storage.accessMode"),
    ({"distillation": {"backoffSeconds": 100, "maxBackoffSeconds": 10}}, "maxBackoffSeconds"),
    ({"replicas": "two"}, "spec.replicas"),
])
def test_invalid_specs_say_which_field(over: dict, needle: str) -> None:
    with pytest.raises(InvalidSpec, match="Fix the AdaFlashService spec") as e:
        parse({**MIN, **over})
    assert needle in str(e.value)


def test_deployment_follows_the_hot_reload_contract() -> None:
    s = parse({**MIN, "replicas": 3, "serving": {
        "image": "img:1", "gpus": 2, "blockSize": 8, "extraArgs": ["--mem-fraction-static", "0.8"],
        "resources": {"limits": {"memory": "64Gi"}}}})
    dep = manifests.deployment(OWNER, s)
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["selector"]["matchLabels"] == {c.LABEL_SERVICE: "qwen",
                                                      c.LABEL_COMPONENT: "serving"}
    pod = dep["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    args = ctr["args"]
    assert ctr["command"] == manifests.SERVING_COMMAND
    assert args[args.index("--speculative-algorithm") + 1] == "ADAFLASH"
    # New pods start on the fleet's version, read from the ConfigMap when the container starts.
    assert args[args.index("--speculative-draft-model-path") + 1] == \
        f"/var/lib/adaflash/drafters/$({c.ENV_FLEET_VERSION})"
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "8"
    assert args[args.index("--tp-size") + 1] == "2"
    assert args[-2:] == ["--mem-fraction-static", "0.8"]
    assert ctr["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 2}
    env = {e["name"]: e for e in ctr["env"]}
    assert env["ADAFLASH_HOME"]["value"] == c.HOME
    assert env[c.ENV_FLEET_VERSION]["valueFrom"]["configMapKeyRef"] == {
        "name": "qwen-drafter", "key": c.FLEET_VERSION_KEY}
    assert [e["name"] for e in ctr["env"]].index(c.ENV_FLEET_VERSION) < len(ctr["env"])
    assert env[c.ENV_POD_NAME]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    mounts = {m["name"]: m["mountPath"] for m in ctr["volumeMounts"]}
    assert mounts["home"] == c.HOME
    assert c.FLEET_VERSION_FILE.startswith(mounts["fleet"] + "/")
    assert c.POD_ANNOTATIONS_FILE.startswith(mounts["podinfo"] + "/")
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["fleet"]["configMap"]["name"] == "qwen-drafter"
    assert vols["podinfo"]["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"] == \
        "metadata.annotations"
    assert vols["home"]["persistentVolumeClaim"]["claimName"] == "qwen-home"
    assert pod["serviceAccountName"] == "qwen-serving"
    sc = ctr["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert pod["securityContext"]["runAsNonRoot"]
    assert ctr["startupProbe"]["failureThreshold"] * ctr["startupProbe"]["periodSeconds"] == 1800


def test_every_child_is_owned_by_the_service() -> None:
    s = parse(MIN)
    ref = manifests.owner_reference(OWNER)
    assert ref == {"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND, "name": "qwen",
                   "uid": "u-1", "controller": True, "blockOwnerDeletion": True}
    built = [manifests.configmap(OWNER, "v000001"), job_manifests.retention_cronjob(OWNER, s),
             manifests.service_account(OWNER), manifests.role(OWNER),
             manifests.role_binding(OWNER), manifests.deployment(OWNER, s),
             manifests.service(OWNER, s), job_manifests.job(OWNER, s, 1, 1, "v000001"),
             job_manifests.drafter_version(OWNER, {"version": "v000002"}, "qwen-distill-1-1")]
    for m in built:
        assert m["metadata"]["ownerReferences"] == [ref], m["kind"]
        assert m["metadata"]["namespace"] == "ml"
        assert m["metadata"]["labels"][c.LABEL_SERVICE] == "qwen"


def test_the_shared_volume_is_kept_unless_deletion_is_asked_for() -> None:
    """kubectl delete afs must not take the drafters and the traffic with it."""
    claim = manifests.pvc(OWNER, parse(MIN))
    assert "ownerReferences" not in claim["metadata"]
    assert claim["metadata"]["labels"][c.LABEL_SERVICE] == "qwen"
    claim = manifests.pvc(OWNER, parse({**MIN, "storage": {"deleteWithService": True}}))
    assert claim["metadata"]["ownerReferences"] == [manifests.owner_reference(OWNER)]


def test_probes_use_sglangs_probe_endpoints_with_sane_timeouts() -> None:
    """sglang 0.5.23's /health runs a generation and sleeps 1 s first (up to 20 s): a 1 s
    probe timeout always failed. Startup and readiness use the flag checks (/ping, /ready);
    liveness may use the generating check, with a timeout above its 20 s."""
    ctr = manifests.deployment(OWNER, parse(MIN))["spec"]["template"]["spec"]["containers"][0]
    paths = {k: ctr[k]["httpGet"]["path"] for k in ("startupProbe", "readinessProbe",
                                                      "livenessProbe")}
    assert paths == {"startupProbe": "/ping", "readinessProbe": "/ready",
                     "livenessProbe": "/health_generate"}
    assert "/health" not in paths.values()
    assert ctr["livenessProbe"]["timeoutSeconds"] > 20 + 1
    assert ctr["livenessProbe"]["periodSeconds"] >= ctr["livenessProbe"]["timeoutSeconds"]
    for k in ("startupProbe", "readinessProbe"):
        assert ctr[k]["timeoutSeconds"] >= 2


def test_deployment_strategy_needs_no_spare_gpu_by_default() -> None:
    strategy = manifests.deployment(OWNER, parse(MIN))["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate",
                        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    s = parse({**MIN, "serving": {"image": "i", "updateStrategy": {"maxSurge": "25%",
                                                                   "maxUnavailable": 0}}})
    assert manifests.deployment(OWNER, s)["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": "25%", "maxUnavailable": 0}
    s = parse({**MIN, "serving": {"image": "i", "updateStrategy": {"type": "Recreate"}}})
    assert manifests.deployment(OWNER, s)["spec"]["strategy"] == {"type": "Recreate"}


def test_traffic_with_prompt_text_is_logged_only_when_asked() -> None:
    args = manifests.server_args(parse(MIN))
    assert "--log-requests" not in args and "--log-requests-level" not in args
    args = manifests.server_args(parse({**MIN, "serving": {"image": "i", "logTraffic": True}}))
    assert args[args.index("--log-requests-level") + 1] == "3"


@pytest.mark.parametrize("name,ok", [
    ("qwen", True), ("a" * 40, True), ("a" * 41, False), ("8b-qwen", False), ("Qwen", False),
    ("qwen-", False),
])
def test_service_names_must_fit_every_child(name: str, ok: bool) -> None:
    from adaflash_operator import crds
    from adaflash_operator.spec import check_name

    if ok:
        check_name(name)
    else:
        with pytest.raises(InvalidSpec, match="metadata.name"):
            check_name(name)
    rules = crds.service_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "x-kubernetes-validations"]
    assert {r["rule"] for r in rules} == {r["rule"] for r in crds.SERVICE_NAME_RULES}


def test_child_names_stay_within_kubernetes_limits() -> None:
    name = "a" * 40
    owner = {**OWNER, "metadata": {**OWNER["metadata"], "name": name}}
    s = parse(MIN)
    assert len(job_manifests.job(owner, s, 12345, 99, "v000001")["metadata"]["name"]) <= 63
    assert len(job_manifests.retention_cronjob(owner, s)["metadata"]["name"]) <= 52
    long_job = manifests.job_name("b" * 60, 3, 1)
    # 54: a JobSet of that name gives its pods the hostname `<name>-node-0-<index>`
    assert len(long_job) == 54 and long_job.endswith("-distill-3-1")
    assert long_job != manifests.job_name("b" * 59 + "c", 3, 1)  # the hash keeps them apart
    assert len(job_manifests.bootstrap_job_name("b" * 60, 12)) == 54


def _container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def test_a_job_with_several_gpus_runs_torchrun_with_a_process_per_gpu() -> None:
    """The Job trains on every GPU it is given: torchrun, one process per GPU of the pod."""
    one = _container(job_manifests.job(OWNER, parse(MIN), 1, 1, "v000001"))
    assert one["command"] == ["python", "-m", "training_job.distill"]
    s = parse({**MIN, "distillation": {"gpus": 8}})
    job = job_manifests.job(OWNER, s, 1, 1, "v000001")
    ctr = _container(job)
    assert ctr["command"] == ["torchrun", "--nproc-per-node=8", "-m", "training_job.distill"]
    assert ctr["args"] == job_manifests.distill_args(s, "v000001")
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "completionMode" not in job["spec"] and "subdomain" not in \
        job["spec"]["template"]["spec"]


def test_several_nodes_make_an_indexed_job_that_meets_at_its_first_pod() -> None:
    s = parse({**MIN, "distillation": {"gpus": 4, "nodes": 3}})
    job = job_manifests.job(OWNER, s, 2, 1, "v000001")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    assert spec["backoffLimit"] == 0  # one lost node fails the round; the operator retries
    assert pod["subdomain"] == "qwen-distill-2-1"
    assert _container(job)["command"] == [
        "torchrun", "--nproc-per-node=4", "--nnodes=3", "--rdzv-backend=c10d",
        "--rdzv-endpoint=qwen-distill-2-1-0.qwen-distill-2-1.ml.svc:29500",
        "--rdzv-id=qwen-distill-2-1", "-m", "training_job.distill"]
    created = {**job, "metadata": {**job["metadata"], "uid": "job-uid"}}
    svc = job_manifests.rendezvous_service(created)
    assert svc["metadata"]["name"] == "qwen-distill-2-1"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"] == {c.LABEL_DISTILL_JOB: "qwen-distill-2-1"}
    assert job["spec"]["template"]["metadata"]["labels"][c.LABEL_DISTILL_JOB] == \
        "qwen-distill-2-1"
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "job-uid"  # goes with the Job
    # where the cluster serves JobSet: one JobSet, whose own headless Service names the pods
    js = job_manifests.job(OWNER, s, 2, 1, "v000001", jobset=True)
    assert js["kind"] == "JobSet" and js["apiVersion"] == job_manifests.JOBSET_API
    assert js["spec"]["network"]["subdomain"] == "qwen-distill-2-1"
    rjob = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert rjob["completions"] == 3 and "subdomain" not in rjob["template"]["spec"]
    assert "--rdzv-endpoint=qwen-distill-2-1-node-0-0.qwen-distill-2-1.ml.svc:29500" in \
        rjob["template"]["spec"]["containers"][0]["command"]


def test_several_nodes_need_a_volume_every_node_can_mount() -> None:
    with pytest.raises(InvalidSpec, match="distillation.nodes > 1"):
        parse({**MIN, "distillation": {"nodes": 2}, "storage": {"accessMode": "ReadWriteOnce"}})
    parse({**MIN, "distillation": {"nodes": 2}, "storage": {"existingClaim": "nfs"}})


def test_the_bootstrap_job_imports_or_trains_the_first_version() -> None:
    imp = parse({**MIN, "drafter": {"bootstrap": {"source": "Import", "path": "seed/dflash"}}})
    job = job_manifests.bootstrap_job(OWNER, imp, 1)
    ctr = _container(job)
    assert job["metadata"]["name"] == "qwen-bootstrap-1"
    assert ctr["name"] == c.BOOTSTRAP_CONTAINER
    assert ctr["command"] == ["python", "-m", "training_job.bootstrap"]
    assert ctr["args"] == ["--home", c.HOME, "--target", "Qwen/Qwen3-8B", "--version",
                           "v000001", "--report", c.TERMINATION_LOG, "--import",
                           f"{c.HOME}/seed/dflash"]
    assert "nvidia.com/gpu" not in ctr["resources"].get("limits", {})
    train = parse({**MIN, "distillation": {"gpus": 8}, "drafter": {"bootstrap": {
        "source": "Train", "path": "seed/prompts.jsonl", "extraArgs": ["--max-steps", "9"]}}})
    ctr = _container(job_manifests.bootstrap_job(OWNER, train, 2))
    assert ctr["command"] == ["torchrun", "--nproc-per-node=8", "-m", "training_job.bootstrap"]
    assert ctr["args"][-5:] == ["--prompts", f"{c.HOME}/seed/prompts.jsonl", "--",
                                "--max-steps", "9"]
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == 8
    with pytest.raises(InvalidSpec, match="bootstrap.path"):
        parse({**MIN, "drafter": {"bootstrap": {"source": "Import"}}})


def test_serving_pods_wait_for_their_drafter_instead_of_crash_looping() -> None:
    pod = manifests.deployment(OWNER, parse(MIN))["spec"]["template"]["spec"]
    (wait,) = pod["initContainers"]
    assert wait["name"] == c.WAIT_DRAFTER_CONTAINER
    assert "until [ -f" in wait["command"][-1] and "manifest.json" in wait["command"][-1]
    assert wait["env"][1]["valueFrom"]["configMapKeyRef"]["key"] == c.FLEET_VERSION_KEY
    assert wait["volumeMounts"] == [{"name": "home", "mountPath": c.HOME, "readOnly": True}]


@pytest.mark.parametrize("mode", ["ReadWriteOnce", "ReadWriteOncePod"])
def test_single_node_volumes_refuse_several_replicas(mode: str) -> None:
    # One pod may hold a ReadWriteOncePod claim: the Jobs could never mount it alongside.
    jobs_off = {"distillation": {"enabled": False}, "retention": {"enabled": False}} \
        if mode == "ReadWriteOncePod" else {}
    parse({**MIN, "replicas": 1, "storage": {"accessMode": mode}, **jobs_off})
    with pytest.raises(InvalidSpec, match="ReadWriteMany"):
        parse({**MIN, "replicas": 2, "storage": {"accessMode": mode}, **jobs_off})
    parse({**MIN, "replicas": 2, "storage": {"accessMode": mode, "existingClaim": "mine"}})


def test_serving_role_can_only_get_and_patch_pods() -> None:
    assert manifests.role(OWNER)["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}]


def test_existing_claim_is_used_as_is() -> None:
    s = parse({**MIN, "storage": {"existingClaim": "shared"}})
    vols = manifests.deployment(OWNER, s)["spec"]["template"]["spec"]["volumes"]
    assert vols[0]["persistentVolumeClaim"]["claimName"] == "shared"


def test_job_takes_the_serving_placement_and_resources_and_no_token() -> None:
    serving = {"image": "i", "nodeSelector": {"gpu": "h100"},
               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                "effect": "NoSchedule"}],
               "resources": {"requests": {"memory": "64Gi", "cpu": "8"}}}
    job = job_manifests.job(OWNER, parse({**MIN, "serving": serving}), 1, 1, "v000001")
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == serving["tolerations"]
    assert pod["containers"][0]["resources"] == {"requests": {"memory": "64Gi", "cpu": "8"},
                                                 "limits": {"nvidia.com/gpu": 1}}
    assert pod["automountServiceAccountToken"] is False
    # The job's own placement wins.
    own = {"nodeSelector": {"pool": "train"}, "resources": {"limits": {"memory": "100Gi"}}}
    job = job_manifests.job(OWNER, parse({**MIN, "serving": serving, "distillation": own}), 1, 1,
                        "v000001")
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "train"}
    assert pod["containers"][0]["resources"]["limits"] == {"memory": "100Gi",
                                                           "nvidia.com/gpu": 1}


def test_job_reports_through_its_termination_message() -> None:
    s = parse({**MIN, "distillation": {"gpus": 4, "extraArgs": ["--epochs", "2"]}})
    job = job_manifests.job(OWNER, s, 3, 2, "v000004")
    assert job["metadata"]["name"] == "qwen-distill-3-2" and job["spec"]["backoffLimit"] == 0
    (ctr,) = job["spec"]["template"]["spec"]["containers"]
    assert ctr["command"] == ["torchrun", "--nproc-per-node=4", "-m", "training_job.distill"]
    assert ctr["args"][ctr["args"].index("--parent") + 1] == "v000004"
    assert ctr["args"][-2:] == ["--epochs", "2"]
    assert ctr["terminationMessagePath"] == c.TERMINATION_LOG
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert job["spec"]["template"]["metadata"]["labels"]["adaflash.io/distill-job"] == \
        "qwen-distill-3-2"


def test_new_records_survive_pod_restarts_and_churn() -> None:
    assert distill.new_records({"a": 50, "b": 30}, {"a": 40, "b": 10}) == 30
    assert distill.new_records({"a": 5}, {"a": 40}) == 5  # restarted: counter went down
    assert distill.new_records({"c": 7}, {"a": 40}) == 7  # a new pod


def test_trigger() -> None:
    d = parse({**MIN, "distillation": {"minNewRecords": 10, "intervalSeconds": 600}}).distillation
    now = dt.datetime(2026, 11, 30, 9, tzinfo=dt.timezone.utc)
    recent, old = now - dt.timedelta(seconds=60), now - dt.timedelta(seconds=601)
    kw = dict(active_job=None, retry_after=None, now=now)
    assert distill.should_start(d, new=10, last_round_at=recent, **kw).reason == "Records"
    assert distill.should_start(d, new=9, last_round_at=old, **kw).reason == "Interval"
    assert not distill.should_start(d, new=9, last_round_at=recent, **kw).start
    assert distill.should_start(d, new=99, last_round_at=old, active_job="j", retry_after=None,
                                now=now).reason == "Running"
    later = now + dt.timedelta(seconds=5)
    assert distill.should_start(d, new=0, last_round_at=recent, active_job=None,
                                retry_after=later, now=now, retrying=True).reason == "Backoff"
    assert distill.should_start(d, new=0, last_round_at=recent, active_job=None,
                                retry_after=now, now=now, retrying=True).reason == "Retry"


def test_backoff_doubles_and_caps() -> None:
    assert [distill.backoff_seconds(n, 60, 300) for n in (1, 2, 3, 4)] == [60, 120, 240, 300]


@pytest.mark.parametrize("status,want", [
    ({}, "running"),
    ({"active": 1}, "running"),
    ({"conditions": [{"type": "Complete", "status": "True"}]}, "succeeded"),
    ({"succeeded": 1}, "succeeded"),
    ({"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]},
     "failed"),
    ({"failed": 1}, "failed"),
])
def test_job_outcome(status: dict, want: str) -> None:
    assert distill.job_outcome({"status": status})[0] == want


@pytest.mark.parametrize("msg,needle", [
    (None, "wrote no report"),
    ("oops", "not JSON"),
    ("[1]", "JSON object"),
    ('{"version": "2"}', "look like v000002"),
    ('{"version": "v000002", "parent": "x"}', "parent"),
    ('{"version": "v000002", "eval": {"tau": {"chat": -1}}}', "eval.tau"),
    ('{"version": "v000002", "eval": {"gate": {"passed": "yes"}}}', "eval.gate"),
    ('{"outcome": "Done", "version": "v000002"}', "outcome must be"),
    ('{"outcome": "NotEnoughRecords"}', "usable and required"),
    ('{"outcome": "NotEnoughRecords", "records": {"usable": 3, "required": "9"}}', "required"),
    ('{"outcome": "Published", "records": {"usable": 3, "required": 9}}', "v000002"),
])
def test_bad_reports_say_what_to_write(msg: str | None, needle: str) -> None:
    with pytest.raises(distill.ReportError, match=needle):
        distill.parse_report(msg)


def test_a_not_enough_records_report_needs_no_version() -> None:
    rep = distill.parse_report(json.dumps({"outcome": "NotEnoughRecords", "parent": "v000001",
                                           "records": {"usable": 40, "required": 128}}))
    assert rep["records"] == {"usable": 40, "required": 128} and "version" not in rep


def test_a_cut_report_says_so_and_the_log_line_is_the_fallback() -> None:
    big = json.dumps({"version": "v000002", "eval": {"tau": {f"d{i}": 5.0 for i in range(400)}}})
    assert len(big) > distill.MAX_MESSAGE_BYTES
    cut = big[-distill.MAX_MESSAGE_BYTES:]  # the kubelet keeps the end
    with pytest.raises(distill.ReportError, match="4096-byte termination message and was cut"):
        distill.parse_report(cut)
    log = "distill: training\nstep 3 loss 0.4\n" + big + "\n"
    assert distill.parse_report(distill.report_from_log(log))["version"] == "v000002"
    assert distill.report_from_log("no report here\n") is None


@pytest.mark.parametrize("pods,phase,needle", [
    ([], "Pending", "not created"),
    ([{"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}}],
     "Pending", "Insufficient nvidia.com/gpu"),
    ([{"spec": {"nodeName": "n1"}, "status": {"phase": "Pending", "containerStatuses": [
        {"name": "distill", "state": {"waiting": {"reason": "ImagePullBackOff"}}}]}}],
     "Pending", "ImagePullBackOff"),
    ([{"status": {"phase": "Pending"}}], "Pending", "waiting for a node"),
    ([{"status": {"phase": "Running"}}], "Running", ""),
])
def test_a_job_waiting_for_a_node_is_pending(pods: list, phase: str, needle: str) -> None:
    got, why = distill.job_pod_phase(pods, "distill")
    assert got == phase and needle in why


def test_rollout_start_gauge_is_cleared_when_the_rollout_ends() -> None:
    from adaflash_operator import metrics

    metrics.set_rollout("ml", "gauge-test", True, 1000.0)
    assert ("ml", "gauge-test") in metrics.ROLLOUT_STARTED._metrics
    metrics.set_rollout("ml", "gauge-test", False, 1000.0)
    assert ("ml", "gauge-test") not in metrics.ROLLOUT_STARTED._metrics
    assert metrics.ROLLOUT_ACTIVE.labels("ml", "gauge-test")._value.get() == 0


def test_report_becomes_a_drafter_version() -> None:
    rep = distill.parse_report(json.dumps({"version": "v000002", "parent": "v000001",
                                           "eval": {"tau": {"chat": 5.0}}}))
    dv = job_manifests.drafter_version(OWNER, rep, "qwen-distill-1-1")
    assert dv["metadata"]["name"] == "qwen-v000002"
    assert dv["spec"] == {"service": "qwen", "version": "v000002", "jobName": "qwen-distill-1-1",
                          "parent": "v000001", "eval": {"tau": {"chat": 5.0}}}


def test_conditions_keep_transition_time_until_status_changes() -> None:
    conds = set_condition(None, "Ready", True, "A", "a", "t1", 1)
    conds = set_condition(conds, "Ready", True, "B", "b", "t2", 2)
    assert conds == [{"type": "Ready", "status": "True", "reason": "B", "message": "b",
                      "lastTransitionTime": "t1", "observedGeneration": 2}]
    conds = set_condition(conds, "Ready", False, "C", "c", "t3")
    assert conds[0]["lastTransitionTime"] == "t3"


def test_patch_helpers() -> None:
    assert replace_patch({"a": 1, "b": 2}, {"a": 3}) == {"b": None, "a": 3}
    assert is_subset({"x": [{"y": 1}]}, {"x": [{"y": 1, "z": 2}], "w": 0})
    assert not is_subset({"x": [1, 2]}, {"x": [1]})
    assert is_subset({"gpu": 1}, {"gpu": "1"})


def test_dockerfile_installs_the_operator_extra() -> None:
    import re
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["operator"]
    docker = (root / "operator" / "Dockerfile").read_text()
    pinned = set(re.findall(r'"([A-Za-z0-9_.\-]+[=<>!~]=?[^"]+)"', docker))
    assert pinned == set(extra), "operator/Dockerfile and the pyproject `operator` extra differ"


def test_command_line() -> None:
    from adaflash_operator.__main__ import kopf_args, parser

    args = kopf_args(parser().parse_args(["run", "-n", "a", "-n", "b", "--verbose"]))
    assert args == ["run", "--standalone", "-m", "adaflash_operator.handlers", "--namespace=a",
                    "--namespace=b", "--liveness=http://0.0.0.0:8081/healthz", "--verbose"]
    args = kopf_args(parser().parse_args(["run", "--health-port", "0"]))
    assert "--all-namespaces" in args and not any(a.startswith("--liveness") for a in args)


def test_crds_command_writes_the_chart_files(tmp_path, capsys) -> None:
    from adaflash_operator import crds
    from adaflash_operator.__main__ import main

    assert main(["crds", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(crds.CRD_FILES)
    assert main(["crds"]) == 0
    assert capsys.readouterr().out.count("kind: CustomResourceDefinition") == 2


def test_the_serving_command_runs_sglang_under_umask_027(tmp_path) -> None:
    """The command as the kubelet runs it, with a stand-in `python` on PATH: SGLang's request
    log (the traffic) is created under this umask, and the arguments arrive intact."""
    import os
    import subprocess

    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\numask\nfor a in "$@"; do echo "[$a]"; done\n')
    fake.chmod(0o755)
    out = subprocess.run([*manifests.SERVING_COMMAND, "--model-path", "a b", "--port", "1"],
                         env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "0027"
    assert out[1:7] == ["[-m]", "[sglang.launch_server]", "[--model-path]", "[a b]", "[--port]",
                        "[1]"]


def test_admin_secret_and_blocked_versions() -> None:
    import base64

    sec = manifests.admin_secret(OWNER, "tok-1")
    assert sec["metadata"]["name"] == "qwen-admin" and sec["type"] == "Opaque"
    assert base64.b64decode(sec["data"][c.ADMIN_TOKEN_KEY]) == b"tok-1"
    assert sec["metadata"]["ownerReferences"][0]["uid"] == OWNER["metadata"]["uid"]
    dvs = [{"spec": {"version": v}, "status": {"phase": ph}} for v, ph in [
        ("v000004", "RolledBack"), ("v000002", "Rejected"), ("v000003", "Retired"),
        ("v000005", "Serving"), ("v000006", None)]]
    blocked = manifests.blocked_versions(dvs)
    assert blocked == {"v000002": "Rejected", "v000004": "RolledBack"}
    cm = manifests.configmap(OWNER, "v000005", blocked)
    assert cm["data"][c.BLOCKED_VERSIONS_KEY] == "v000002 Rejected\nv000004 RolledBack\n"
    assert manifests.configmap(OWNER, "v000005")["data"][c.BLOCKED_VERSIONS_KEY] == ""
