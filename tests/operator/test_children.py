"""children.reconcile against a scripted API: a refused child becomes a Problem with the
server's message and the others are still applied; transient failures still propagate; a
deleted admin Secret comes back; optional children go when the spec drops them."""

from __future__ import annotations

import asyncio

import pytest
from adaflash_operator import children, kube
from adaflash_operator import contract as c
from adaflash_operator.spec import parse

MIN = {"model": {"target": "Qwen/Qwen3-8B"}, "serving": {"image": "img:1"}}
OWNER = {"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND,
         "metadata": {"name": "qwen", "namespace": "ml", "uid": "u-1"}}


class FakeApi:
    """Objects by (kind, name); `refuse` maps a kind to the ApiError its writes get."""

    def __init__(self, refuse: dict[str, kube.ApiError] | None = None) -> None:
        self.objects: dict[tuple[str, str], dict] = {}
        self.refuse = refuse or {}
        self.writes: list[tuple[str, str, str]] = []

    async def get(self, kind, ns, name):
        return self.objects.get((kind, name))

    async def apply(self, body):
        kind, name = body["kind"], body["metadata"]["name"]
        self.writes.append(("apply", kind, name))
        if kind in self.refuse:
            raise self.refuse[kind]
        obj = {**body, "metadata": {**body["metadata"], "uid": f"uid-{name}"}}
        self.objects[(kind, name)] = obj
        return obj

    async def create(self, body):
        kind, name = body["kind"], body["metadata"]["name"]
        self.writes.append(("create", kind, name))
        if (kind, name) in self.objects:
            raise kube.ApiError(409, "already exists", "AlreadyExists")
        self.objects[(kind, name)] = body
        return body

    async def delete(self, kind, ns, name):
        self.writes.append(("delete", kind, name))
        self.objects.pop((kind, name), None)


@pytest.fixture()
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    fake = FakeApi()
    for fn in ("get", "apply", "create", "delete"):
        monkeypatch.setattr(kube, fn, getattr(fake, fn))
    for cache in (children._applied, children._admin_secrets):
        cache.clear()
    children._absent.clear()
    return fake


def run(spec: dict, recheck: float = 60.0, keda: bool = False) -> children.Result:
    return asyncio.run(children.reconcile(OWNER, parse(spec), secret_recheck_s=recheck,
                                          keda_served=keda))


def test_a_refused_deployment_is_a_problem_and_the_rest_is_applied(api: FakeApi) -> None:
    msg = ('Deployment.apps "qwen" is invalid: spec.strategy.rollingUpdate.maxUnavailable: '
           'Invalid value: 0: may not be 0 when `maxSurge` is 0')
    api.refuse["Deployment"] = kube.ApiError(422, msg, "Invalid")
    res = run(MIN)
    assert res.deployment is None
    assert res.problems == [children.Problem("Deployment", "qwen", "ChildRefused", msg)]
    applied = {k for op, k, _ in api.writes if op == "apply"}
    assert {"Service", "CronJob", "PodDisruptionBudget", "ConfigMap"} <= applied
    assert res.fleet_ok and res.fleet_data[c.FLEET_VERSION_KEY] == "v000001"


def test_a_refused_configmap_keeps_the_live_fleet_version(api: FakeApi) -> None:
    api.objects[("ConfigMap", "qwen-drafter")] = {"metadata": {"name": "qwen-drafter"},
                                                  "data": {c.FLEET_VERSION_KEY: "v000007"}}
    api.refuse["ConfigMap"] = kube.ApiError(403, 'configmaps "qwen-drafter" is forbidden: '
                                            'exceeded quota', "Forbidden")
    res = run(MIN)
    assert not res.fleet_ok and res.fleet_data[c.FLEET_VERSION_KEY] == "v000007"
    assert [p.kind for p in res.problems] == ["ConfigMap"]
    assert res.deployment is not None


@pytest.mark.parametrize("status", [0, 429, 500, 503])
def test_transient_failures_still_propagate(api: FakeApi, status: int) -> None:
    api.refuse["Service"] = kube.ApiError(status, "try again")
    with pytest.raises(kube.ApiError):
        run(MIN)


def test_a_child_owned_by_another_controller_is_a_conflict(api: FakeApi) -> None:
    api.objects[("Service", "qwen")] = {"metadata": {"name": "qwen", "ownerReferences": [
        {"kind": "Gateway", "name": "gw", "uid": "other", "controller": True}]}}
    res = run(MIN)
    assert [(p.kind, p.reason) for p in res.problems] == [("Service", "ChildConflict")]
    assert "controlled by Gateway gw" in res.problems[0].message
    assert res.deployment is not None


def test_a_deleted_admin_secret_comes_back_without_a_restart(api: FakeApi) -> None:
    assert not run(MIN, recheck=0).admin_secret_recreated  # first creation: not a re-creation
    token = api.objects[("Secret", "qwen-admin")]["data"][c.ADMIN_TOKEN_KEY]
    assert not run(MIN, recheck=0).admin_secret_recreated  # 409: kept as it is
    assert api.objects[("Secret", "qwen-admin")]["data"][c.ADMIN_TOKEN_KEY] == token
    del api.objects[("Secret", "qwen-admin")]
    res = run(MIN, recheck=0)
    assert res.admin_secret_recreated and ("Secret", "qwen-admin") in api.objects
    assert api.objects[("Secret", "qwen-admin")]["data"][c.ADMIN_TOKEN_KEY] != token
    # Between rechecks nothing is sent.
    n = len(api.writes)
    run(MIN, recheck=3600)
    assert not [w for w in api.writes[n:] if w[1] == "Secret"]


def test_optional_children_go_when_the_spec_drops_them(api: FakeApi) -> None:
    auto = {**MIN, "autoscaling": {"enabled": True}}
    run(auto)
    assert ("HorizontalPodAutoscaler", "qwen") in api.objects
    run({**auto, "autoscaling": {"enabled": True, "prometheusAddress": "http://p:9090"}},
        keda=True)
    assert ("ScaledObject", "qwen") in api.objects
    assert ("HorizontalPodAutoscaler", "qwen") not in api.objects  # one autoscaler at a time
    run({**MIN, "serving": {"image": "i", "podDisruptionBudget": {"enabled": False}}},
        keda=True)
    assert ("ScaledObject", "qwen") not in api.objects
    assert ("PodDisruptionBudget", "qwen") not in api.objects
    # Someone else's object of that name is not ours to delete.
    api.objects[("NetworkPolicy", "qwen")] = {"metadata": {"name": "qwen"}}
    children._absent.clear()
    run(MIN)
    assert ("NetworkPolicy", "qwen") in api.objects
