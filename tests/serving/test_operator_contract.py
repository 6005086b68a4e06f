"""The serving-pod contract, checked from both sides.

The operator (``operator/adaflash_operator/contract.py``, ``manifests.py``) and the serving side
(``sglang_adaflash.serving.reload`` / ``pod_status``, the SGLang plugin's options) were written
apart; these tests import both and fail as soon as a shared name drifts. They also drive the pod
annotation reporter against a fake API (no network) and read its result back with the operator's
own pod reader.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "operator") not in sys.path:  # the operator package is a source root
    sys.path.insert(0, str(ROOT / "operator"))

from adaflash_operator import contract as c  # noqa: E402

from sglang_adaflash.serving import reload as rl  # noqa: E402
from sglang_adaflash.serving.metrics import AcceptanceWindow, SpecStepStats  # noqa: E402
from sglang_adaflash.serving.pod_status import (  # noqa: E402
    PodStatsPublisher,
    RequestLogCounter,
    request_log_dirs,
)
from sglang_adaflash.sglang_plugin.options import ENV_VARS  # noqa: E402
from sglang_adaflash.testing.fixtures import (  # noqa: E402
    drafter_config,
    publish_random,
    random_drafter,
)

# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------


def test_env_var_names_agree():
    assert rl.ENV_HOME == c.ENV_HOME
    assert rl.ENV_POD_NAME == c.ENV_POD_NAME
    assert rl.ENV_POD_NAMESPACE == c.ENV_POD_NAMESPACE
    assert rl.ENV_FLEET_VERSION_FILE == c.ENV_FLEET_VERSION_FILE
    assert rl.ENV_ANNOTATIONS_FILE == c.ENV_POD_ANNOTATIONS_FILE
    for name in (c.ENV_HOME, c.ENV_POD_NAME, c.ENV_POD_NAMESPACE, c.ENV_FLEET_VERSION_FILE,
                 c.ENV_POD_ANNOTATIONS_FILE):
        assert name in ENV_VARS, f"the plugin does not document {name}"


def test_annotation_keys_agree():
    assert rl.DESIRED_ANNOTATION == c.DESIRED_VERSION
    assert rl.LOADED_ANNOTATION == c.LOADED_VERSION
    assert rl.LOAD_ERROR_ANNOTATION == c.LOAD_ERROR
    assert rl.ACCEPTANCE_TAU_ANNOTATION == c.ACCEPTANCE_TAU
    assert rl.TRAFFIC_RECORDS_ANNOTATION == c.TRAFFIC_RECORDS
    assert rl.DesiredVersionSource(home=Path("/")).annotation_key == c.DESIRED_VERSION


def test_paths_agree():
    assert rl.DEFAULT_HOME == c.HOME
    assert rl.FLEET_VERSION_FILE == c.FLEET_VERSION_FILE
    assert rl.POD_ANNOTATIONS_FILE == c.POD_ANNOTATIONS_FILE
    assert rl.BLOCKED_VERSIONS_FILE == c.BLOCKED_VERSIONS_FILE
    assert rl.ENV_BLOCKED_VERSIONS_FILE == c.ENV_BLOCKED_VERSIONS_FILE
    assert rl.OVERRIDE_ANNOTATION == c.OVERRIDE


def test_the_pod_reads_the_blocked_versions_the_operator_writes(tmp_path):
    from adaflash_operator import manifests

    from sglang_adaflash.sglang_plugin.http import ENV_ADMIN_TOKEN

    assert ENV_ADMIN_TOKEN == c.ENV_ADMIN_TOKEN
    blocked = {"v000002": "Rejected", "v000004": "RolledBack"}
    text = manifests.configmap({"metadata": {"name": "q", "namespace": "n", "uid": "u"}},
                               "v000003", blocked)["data"][c.BLOCKED_VERSIONS_KEY]
    (tmp_path / "blocked").write_text(text)
    assert rl.read_blocked_versions(tmp_path / "blocked") == blocked
    assert rl.read_blocked_versions(tmp_path / "absent") == {}


def test_both_documents_use_the_operator_names():
    sglang_doc = (ROOT / "docs" / "sglang.md").read_text()
    operator_doc = (ROOT / "docs" / "operator.md").read_text()
    shared = [c.ENV_HOME, c.ENV_POD_NAME, c.ENV_POD_NAMESPACE, c.ENV_FLEET_VERSION_FILE,
              c.ENV_POD_ANNOTATIONS_FILE, c.FLEET_VERSION_FILE, c.POD_ANNOTATIONS_FILE,
              c.DESIRED_VERSION, c.LOADED_VERSION, c.LOAD_ERROR, c.ACCEPTANCE_TAU,
              c.TRAFFIC_RECORDS]
    for doc, text in (("docs/sglang.md", sglang_doc), ("docs/operator.md", operator_doc)):
        missing = [name for name in shared if name not in text]
        assert not missing, f"{doc} does not name {missing}"
    # The pod-spec fragment in docs/sglang.md is the operator's, not an older variant.
    assert "/etc/podinfo/" not in sglang_doc
    assert "{name: POD_NAME," not in sglang_doc


def _rendered_env(pod="serve-abc", namespace="ml") -> tuple[dict, dict]:
    """The serving container's env as the kubelet resolves it, and the rendered Deployment."""
    pytest.importorskip("jsonschema")
    from adaflash_operator import manifests
    from adaflash_operator.spec import parse

    owner = {"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND,
             "metadata": {"name": "qwen", "namespace": namespace, "uid": "u-1"}}
    spec = parse({"model": {"target": "Qwen/Qwen3-8B"},
                  "serving": {"image": "img:1", "logTraffic": True}})
    dep = manifests.deployment(owner, spec)
    (ctr,) = dep["spec"]["template"]["spec"]["containers"]
    fields = {"metadata.name": pod, "metadata.namespace": namespace}
    env = {}
    for e in ctr["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in e["valueFrom"]:  # the fleet ConfigMap's version
            env[e["name"]] = "v000001"
        elif "secretKeyRef" in e["valueFrom"]:  # the admin Secret's token
            env[e["name"]] = "token-from-the-secret"
        else:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env, dep


def test_serving_side_reads_what_the_operator_renders():
    env, dep = _rendered_env()
    src = rl.DesiredVersionSource.from_env(env)
    assert src.home == Path(c.HOME)
    assert src.version_file == Path(c.FLEET_VERSION_FILE)
    assert src.annotations_file == Path(c.POD_ANNOTATIONS_FILE)
    assert rl.pod_identity(env) == ("serve-abc", "ml")
    rep = rl.PodAnnotationReporter.from_env({**env, "KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert (rep.pod, rep.namespace) == ("serve-abc", "ml")
    # The request log goes where the traffic counter looks.
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    target = args[args.index("--log-requests-target") + 1]
    resolved = target.replace(f"$({c.ENV_POD_NAME})", env[c.ENV_POD_NAME])
    assert resolved == f"{c.HOME}/traffic/serve-abc"
    from types import SimpleNamespace

    assert request_log_dirs(SimpleNamespace(log_requests=True, log_requests_target=[resolved])) \
        == [resolved]


def test_older_names_still_work():
    env = {"ADAFLASH_DESIRED_VERSION_FILE": "/x/v", "POD_NAME": "p", "POD_NAMESPACE": "n"}
    assert rl.DesiredVersionSource.from_env(env).version_file == Path("/x/v")
    assert rl.pod_identity(env) == ("p", "n")
    both = {**env, c.ENV_FLEET_VERSION_FILE: "/y/v", c.ENV_POD_NAME: "q",
            c.ENV_POD_NAMESPACE: "m"}
    assert rl.DesiredVersionSource.from_env(both).version_file == Path("/y/v")
    assert rl.pod_identity(both) == ("q", "m")


# ---------------------------------------------------------------------------------------------
# The reporter against a fake API
# ---------------------------------------------------------------------------------------------


class FakeAPI:
    """Applies JSON merge patches to one pod's annotations; can be told to fail."""

    def __init__(self):
        self.annotations: dict[str, str] = {c.DESIRED_VERSION: "v000002"}
        self.bodies: list[dict] = []
        self.fail = 0

    def __call__(self, body: dict) -> None:
        if self.fail:
            self.fail -= 1
            raise OSError("connection refused")
        self.bodies.append(body)
        for key, value in body["metadata"]["annotations"].items():
            if value is None:
                self.annotations.pop(key, None)
            else:
                self.annotations[key] = value

    def pod(self) -> dict:
        return {"metadata": {"name": "serve-0", "annotations": dict(self.annotations)},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def _reporter(api: FakeAPI) -> rl.PodAnnotationReporter:
    return rl.PodAnnotationReporter("serve-0", "ml", transport=api)


def _annotations(body: dict) -> dict:
    return body["metadata"]["annotations"]


def test_reporter_patches_loaded_version_and_load_error():
    api = FakeAPI()
    rep = _reporter(api)
    rep.report({"loaded_version": "v000001"})
    assert _annotations(api.bodies[-1]) == {c.LOADED_VERSION: "v000001", c.LOAD_ERROR: None}
    rep.report({"loaded_version": "v000001"})
    assert len(api.bodies) == 1  # nothing changed: no call
    rep.report({"loaded_version": "v000001", "last_error": "manifest hash\nmismatch",
                "last_error_version": "v000002"})
    assert _annotations(api.bodies[-1]) == {c.LOAD_ERROR: "v000002: manifest hash mismatch"}
    rep.report({"loaded_version": "v000002"})  # a successful load clears the error
    assert _annotations(api.bodies[-1]) == {c.LOADED_VERSION: "v000002", c.LOAD_ERROR: None}
    assert c.LOAD_ERROR not in api.annotations
    assert api.annotations[c.DESIRED_VERSION] == "v000002"  # never touched by the pod


def test_load_error_is_one_capped_line():
    value = rl.load_error_value("v000003", "x" * 5000)
    assert value.startswith("v000003: ") and len(value) <= len("v000003: ") + rl.MAX_ERROR_CHARS
    assert "\n" not in rl.load_error_value("v000003", "a\nb")


def test_failed_patch_is_not_fatal_and_is_retried():
    api = FakeAPI()
    api.fail = 2
    rep = _reporter(api)
    rep.report({"loaded_version": "v000001"})  # must not raise
    assert api.bodies == [] and rep.failures == 1
    assert rep.update({c.TRAFFIC_RECORDS: "5"}) is False
    assert rep.pending() == {c.LOADED_VERSION: "v000001", c.LOAD_ERROR: None,
                             c.TRAFFIC_RECORDS: "5"}
    assert rep.flush() is True  # the API is back: everything pending goes in one patch
    assert _annotations(api.bodies[-1]) == {c.LOADED_VERSION: "v000001", c.LOAD_ERROR: None,
                                            c.TRAFFIC_RECORDS: "5"}
    assert rep.pending() == {} and rep.failures == 0


def _step(accepts: list[int], block: int = 8) -> SpecStepStats:
    return SpecStepStats(block, [block] * len(accepts), accepts)


def test_publisher_reports_tau_and_records_only_when_they_change(tmp_path):
    from adaflash_operator.rollout import PodInfo

    api = FakeAPI()
    rep = _reporter(api)
    rep.report({"loaded_version": "v000001"})
    window = AcceptanceWindow(min_drafts=4)
    window.set_drafter_version("v000001")
    logdir = tmp_path / "traffic" / "serve-0"
    logdir.mkdir(parents=True)
    log = logdir / "serve-0_0.log"
    finished = '[2026-11-30 09:00:00] {"timestamp": "2026-11-30T09:00:00", ' \
        '"event": "request.finished", "rid": "r%d", "obj": {}, "out": {}}\n'
    received = '[2026-11-30 09:00:00] {"timestamp": "2026-11-30T09:00:00", ' \
        '"event": "request.received", "rid": "r%d", "obj": {}}\n'
    log.write_text(received % 1 + finished % 1 + finished % 2)
    pub = PodStatsPublisher(rep, window=window, traffic=RequestLogCounter([logdir]),
                            interval_s=15)

    pub.tick()  # no drafts yet: no tau; two records
    assert _annotations(api.bodies[-1]) == {c.ACCEPTANCE_TAU: None, c.TRAFFIC_RECORDS: "2"}
    window.observe_step(_step([3, 5]))
    pub.tick()  # two drafts < min_drafts: the window grows, nothing changed
    assert len(api.bodies) == 2
    window.observe_step(_step([1, 3]))
    pub.tick()  # 12 accepted over 4 drafts: tau 4
    assert _annotations(api.bodies[-1]) == {c.ACCEPTANCE_TAU: "4.000"}
    pub.tick()  # idle: the last tau holds, no call
    assert len(api.bodies) == 3

    info = PodInfo.from_pod(api.pod())  # the operator reads what the pod wrote
    assert (info.loaded, info.tau, info.records, info.error) == ("v000001", 4.0, 2, None)

    # SGLang rotates the file hourly (a rename) and starts a new one: nothing counted twice,
    # and a torn last line waits until it is complete.
    log.rename(logdir / "serve-0_0.log.2026-11-30_09")
    new = logdir / "serve-0_0.log"
    new.write_text(finished % 3 + (finished % 4)[:30])
    pub.tick()
    assert _annotations(api.bodies[-1]) == {c.TRAFFIC_RECORDS: "3"}
    with new.open("a") as f:
        f.write((finished % 4)[30:])
    pub.tick()
    assert _annotations(api.bodies[-1]) == {c.TRAFFIC_RECORDS: "4"}

    # A new version starts a new window: the old tau is removed, not passed off as the new one's.
    window.set_drafter_version("v000002")
    rep.report({"loaded_version": "v000002"})
    pub.tick()
    assert _annotations(api.bodies[-1]) == {c.ACCEPTANCE_TAU: None}
    assert PodInfo.from_pod(api.pod()).tau is None


def test_publisher_without_request_log_reports_zero_records():
    api = FakeAPI()
    pub = PodStatsPublisher(_reporter(api), window=None, traffic=None)
    pub.tick()
    assert _annotations(api.bodies[-1]) == {c.TRAFFIC_RECORDS: "0"}
    from types import SimpleNamespace

    assert request_log_dirs(SimpleNamespace(log_requests=False, log_requests_target=["/x"])) == []
    assert request_log_dirs(SimpleNamespace(log_requests=True, log_requests_target=None)) == []
    assert request_log_dirs(
        SimpleNamespace(log_requests=True, log_requests_target=["stdout", "/d"])
    ) == ["/d"]


def test_reloader_sets_and_clears_the_load_error(tmp_path):

    home = tmp_path / "home"
    v1 = publish_random(home, seed=1)
    # two layers where the served drafter has one: cannot be hot-reloaded
    bad = publish_random(home, seed=2, cfg=drafter_config(num_hidden_layers=2))
    cfg = drafter_config()
    live = random_drafter(cfg, 1)
    fleet = tmp_path / "drafter-version"
    fleet.write_text(v1)
    api = FakeAPI()
    reloader = rl.HotReloader(
        source=rl.DesiredVersionSource.from_env(
            {c.ENV_HOME: str(home), c.ENV_FLEET_VERSION_FILE: str(fleet)}
        ),
        target=rl.ModuleTarget(live),
        loaded_version=v1,
        live_config=cfg,
        reporters=[_reporter(api)],
        report_async=False,
    )
    assert api.annotations[c.LOADED_VERSION] == v1 and c.LOAD_ERROR not in api.annotations

    fleet.write_text(bad)
    reloader.poll_once()
    assert api.annotations[c.LOAD_ERROR].startswith(f"{bad}: ")
    assert api.annotations[c.LOADED_VERSION] == v1  # still serving the old one

    fleet.write_text(v1)  # rolled back: the error no longer describes the desired version
    reloader.poll_once()
    assert c.LOAD_ERROR not in api.annotations
    fleet.write_text(bad)  # asked again, same bytes: not retried, but the error is said again
    reloader.poll_once()
    assert api.annotations[c.LOAD_ERROR].startswith(f"{bad}: ")

    good = publish_random(home, seed=3)
    fleet.write_text(good)
    reloader.poll_once()
    assert reloader.at_step_boundary() == good
    assert api.annotations[c.LOADED_VERSION] == good
    assert c.LOAD_ERROR not in api.annotations


def test_async_reports_reach_the_api_in_order(tmp_path):
    from sglang_adaflash.drafter.model import DFlashDrafter

    home = tmp_path / "home"
    v1 = publish_random(home, seed=1)
    cfg = drafter_config()
    fleet = tmp_path / "drafter-version"
    fleet.write_text(v1)
    api = FakeAPI()
    reloader = rl.HotReloader(
        source=rl.DesiredVersionSource(home=home, version_file=fleet),
        target=rl.ModuleTarget(DFlashDrafter(cfg)),
        loaded_version=v1,
        live_config=cfg,
        reporters=[_reporter(api)],
        report_async=True,
    )
    for i in range(20):  # alternate failing and clearing; the last word must win
        reloader._fail("rejected", f"v{i + 2:06d}", "bad")
        reloader.status.last_error = reloader.status.last_error_version = None
        reloader._report()
    assert reloader.flush_reports(timeout=10)
    assert api.annotations[c.LOADED_VERSION] == v1
    assert c.LOAD_ERROR not in api.annotations


def test_an_admin_override_reaches_the_operator_and_leaves_with_it(tmp_path):
    """Also when the override names the version already loaded (nothing to reload), which is
    how an override pins a pod against later rollouts."""
    from adaflash_operator.rollout import PodInfo

    home = tmp_path / "home"
    v1 = publish_random(home, seed=1)
    cfg = drafter_config()
    fleet, override = tmp_path / "drafter-version", tmp_path / "override"
    fleet.write_text(v1)
    api = FakeAPI()
    reloader = rl.HotReloader(
        source=rl.DesiredVersionSource(home=home, version_file=fleet, override_file=override),
        target=rl.ModuleTarget(random_drafter(cfg, 1)), loaded_version=v1, live_config=cfg,
        reporters=[_reporter(api)], report_async=False)
    reloader.poll_once()
    assert PodInfo.from_pod(api.pod()).override is None
    rl.set_override(override, v1, home)
    reloader.poll_once()
    assert api.annotations[c.OVERRIDE] == v1 and PodInfo.from_pod(api.pod()).override == v1
    rl.set_override(override, None, home)
    reloader.poll_once()
    assert c.OVERRIDE not in api.annotations and PodInfo.from_pod(api.pod()).override is None
