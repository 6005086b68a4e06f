"""kopf handlers: glue between the cluster and the pure modules.

- create/update/resume of an AdaFlashService: validate the spec, create missing children, adopt
  and update existing ones, patch status.
- a daemon per AdaFlashService that ticks every ADAFLASH_OPERATOR_TICK_SECONDS (default 10):
  the same reconciliation, then the distillation loop, then one rollout step. Progress lives in
  the object's status, so a restarted operator resumes.
Deletion needs no handler: every child carries an owner reference and the garbage collector
removes it with the AdaFlashService (the shared volume's claim only when
spec.storage.deleteWithService asks for it).

Children are written by server-side apply (field manager `adaflash-operator`), and only when
what the operator would apply changed, or someone else took a field the operator applies; status
is written with the resourceVersion it was computed from (a 409 means: read again, retry).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from . import (
    autoscaling,
    children,
    job_phases,
    kube,
    manifests,
    metrics,
    rollout,
    rollout_phase,
)
from . import contract as c
from . import spec as spec_mod
from .clock import now as _now
from .clock import ts as _ts
from .conditions import get_condition, is_subset, set_condition

TICK = float(os.environ.get("ADAFLASH_OPERATOR_TICK_SECONDS", "10"))
SERVICE = dict(group=c.GROUP, version=c.VERSION, plural=c.SERVICE_PLURAL)




@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Fires once when the operator starts."""
    settings.posting.level = logging.WARNING  # handler logs; our own events are explicit
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix="kopf.adaflash.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kopf.adaflash.io", key="last-handled-configuration")
    # The control-loop daemon needs a finalizer so that it stops before the object goes.
    settings.persistence.finalizer = "adaflash.io/operator"
    settings.watching.server_timeout = 300
    # The chart installs the CRDs before the operator starts and names the namespaces to watch
    # (or all of them), so neither CRDs nor namespaces need watching: less RBAC.
    settings.scanning.disabled = True
    port = int(os.environ.get("ADAFLASH_OPERATOR_METRICS_PORT", "0"))
    if port:
        metrics.serve(port)


@kopf.on.login()
async def login(**_: Any) -> kopf.ConnectionInfo:
    """In a pod: its service account; elsewhere: KUBECONFIG or ~/.kube/config (exec plugins
    included). kopf's watches and our calls use the same credentials; kopf calls this again
    after a 401."""
    cfg = await kube.load_config()
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert or None,
        insecure=not cfg.verify_ssl,
        token=kube.bearer_token(cfg),
        certificate_path=cfg.cert_file or None,
        private_key_path=cfg.key_file or None,
        username=cfg.username or None,
        password=cfg.password or None,
    )


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    await kube.close()


# ---------------------------------------------------------------------------------------------
# Children (children.py applies them and reports what the API server refused)

# A deleted admin Secret is noticed (and recreated) within this many seconds.
SECRET_RECHECK_S = 3 * TICK


def _owner(body: kopf.Body) -> dict:
    meta = body["metadata"]
    return {"apiVersion": body.get("apiVersion", c.API_VERSION),
            "kind": body.get("kind", c.SERVICE_KIND),
            "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                         "uid": meta.get("uid")}}


async def _parse_or_condition(body: kopf.Body, status: dict, patch: kopf.Patch,
                              logger: logging.Logger) -> spec_mod.ServiceSpec | None:
    gen = body["metadata"].get("generation")
    try:
        spec_mod.check_name(body["metadata"]["name"])
        s = spec_mod.parse(body.get("spec"))
    except spec_mod.InvalidSpec as e:
        conds = set_condition(status.get("conditions"), "Ready", False, "InvalidSpec", str(e),
                              _ts(_now()), gen)
        patch.status["conditions"] = conds
        if get_condition(status.get("conditions"), "Ready") != get_condition(conds, "Ready"):
            kopf.warn(body, reason="InvalidSpec", message=str(e))
        logger.error(f"invalid spec: {e}")
        metrics.RECONCILES.labels("invalid").inc()
        return None
    if not body["metadata"].get("uid"):
        raise kopf.TemporaryError("the AdaFlashService has no uid yet", delay=5)
    return s


async def _reconcile(body: kopf.Body, status: dict, patch: kopf.Patch,
                     logger: logging.Logger) -> tuple[spec_mod.ServiceSpec, str, list] | None:
    s = await _parse_or_condition(body, status, patch, logger)
    if s is None:
        return None
    owner = _owner(body)
    ns, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    now = _ts(_now())
    gen = body["metadata"].get("generation")
    conds = list(status.get("conditions") or [])
    # Asked with autoscaling off too: a ScaledObject left from when it was on must go.
    keda = await kube.has_api(autoscaling.KEDA_API)
    res = await children.reconcile(owner, s, secret_recheck_s=SECRET_RECHECK_S,
                                   keda_served=keda)
    patch.problems, patch.claim_modes = res.problems, res.claim_modes
    metrics.RECONCILES.labels(res.problems[0].reason.removeprefix("Child").lower()
                              if res.problems else "ok").inc()
    if res.admin_secret_recreated:
        kopf.warn(body, reason="AdminSecretRecreated", message=(
            f"Secret {manifests.admin_secret_name(name)} was deleted; recreated with a new "
            f"token. Pods started before keep the old one until they restart."))
    fleet_data = res.fleet_data
    fleet = fleet_data[c.FLEET_VERSION_KEY]
    # Serving pods: not the ones going away, nor evicted or otherwise terminated ones.
    pods = [p for p in await kube.list_("Pod", ns, manifests.selector(name))
            if not (p.get("metadata") or {}).get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded")]
    infos = [rollout.PodInfo.from_pod(p) for p in pods]
    ready = sum(1 for p in infos if p.ready)
    taus = [p.tau for p in infos if p.ready and p.tau is not None]
    tau = round(sum(taus) / len(taus), 4) if taus else None
    patch.status["observedGeneration"] = gen
    patch.status["servingVersion"] = fleet
    patch.status["replicas"] = len(infos)
    patch.status["readyReplicas"] = ready
    patch.status["selector"] = manifests.selector_string(name)
    patch.status["tau"] = tau
    patch.status["pods"] = [{k: v for k, v in {
        "name": p.name, "ready": p.ready, "desiredVersion": p.desired,
        "loadedVersion": p.loaded, "tau": p.tau, "loadError": p.error,
        "override": p.override, "waitingForDrafter": p.waiting_for_drafter or None}.items()
        if v is not None} for p in sorted(infos, key=lambda p: p.name)]
    conds = _override_condition(body, conds, infos, fleet, fleet_data.get(
        c.BLOCKED_VERSIONS_KEY) or "", now, gen)
    dep_problem = next((p for p in res.problems if p.kind == "Deployment"), None)
    if dep_problem is not None:  # the pods do not follow this spec: not ready, whatever runs
        conds = set_condition(conds, "Ready", False, dep_problem.reason,
                              f"the serving Deployment was not applied: {dep_problem.message}",
                              now, gen)
    elif s.replicas == 0:
        conds = set_condition(conds, "Ready", True, "ScaledToZero", "replicas is 0", now, gen)
    elif ready < s.replicas and any(p.waiting_for_drafter for p in infos):
        conds = _drafter_missing(body, conds, s, fleet, status, ready, now, gen)
    else:  # with what keeps pods from running, e.g. a surge pod no GPU is left for (the old
        # pods may all be ready while it waits: Ready stays True and says why the rollout waits)
        why = children.serving_trouble(res.deployment, pods)
        msg = f"{ready}/{s.replicas} serving pods ready" + (f" ({why})" if why else "")
        conds = set_condition(conds, "Ready", ready >= s.replicas,
                              "AllPodsReady" if ready >= s.replicas else "PodsNotReady", msg,
                              now, gen)
    conds = _child_condition(body, conds, res.problems, now, gen)
    patch.status["conditions"] = conds
    metrics.set_serving(ns, name, fleet)
    metrics.set_live_tau(ns, name, tau)
    logger.debug(f"reconciled: fleet {fleet}, {len(res.problems)} child problem(s)")
    return s, fleet_data, infos


CHILD_REASONS = ("ChildConflict", "ChildRefused")


def _child_condition(body: dict, conds: list, problems: list[children.Problem], now: str,
                     gen: int | None, event: bool = True) -> list:
    """Degraded=True while a child could not be written, with the server's message per child
    (a Warning event when that changes); cleared when every child is applied again."""
    if not problems:
        was = get_condition(conds, "Degraded")
        if was and was.get("reason") in CHILD_REASONS:
            return set_condition(conds, "Degraded", False, "Healthy", "every child is applied",
                                 now, gen)
        return conds
    msg = "; ".join(p.text() for p in problems)[:2000]
    was = get_condition(conds, "Degraded")
    if event and (not was or was.get("message") != msg):
        kopf.warn(body, reason=problems[0].reason, message=msg)
    return set_condition(conds, "Degraded", True, problems[0].reason, msg, now, gen)


def _drafter_missing(body: dict, conds: list, s: spec_mod.ServiceSpec, fleet: str, st: dict,
                     ready: int, now: str, gen: int | None) -> list:
    """Ready=False while serving pods wait for a drafter that is not on the volume: Bootstrapping
    when spec.drafter.bootstrap is making it, else DrafterMissing (a Warning event, once)."""
    where = f"drafters/{fleet}/manifest.json on the shared volume"
    if s.bootstrap is not None:
        b = st.get("bootstrap") or {}
        msg = (f"{ready}/{s.replicas} serving pods ready: they wait for drafter {fleet}, which "
               f"spec.drafter.bootstrap ({s.bootstrap.source}) is making "
               f"({b.get('phase') or 'starting'}{': ' + b['message'] if b.get('message') else ''})")
        return set_condition(conds, "Ready", False, "Bootstrapping", msg, now, gen)
    msg = (f"{ready}/{s.replicas} serving pods ready: they wait for drafter {fleet}, and "
           f"{where} is missing. Set spec.drafter.bootstrap (Import a published DFlash "
           f"checkpoint, or Train one offline), or publish it on the claim by hand "
           f"(adaflash drafters import DIR --target <target> --home <claim>)")
    was = get_condition(conds, "Ready")
    if not was or was.get("reason") != "DrafterMissing":
        kopf.warn(body, reason="DrafterMissing", message=msg)
    return set_condition(conds, "Ready", False, "DrafterMissing", msg, now, gen)


def _override_condition(body: dict, conds: list, infos: list, fleet: str, blocked_text: str,
                        now: str, gen: int | None) -> list:
    """AdminOverride: True while a pod serves (or is asked for) a version an admin call chose
    over the operator's; a Warning event when that starts."""
    blocked = dict(line.split(" ", 1) for line in blocked_text.splitlines() if " " in line)
    over = sorted((p for p in infos if p.override), key=lambda p: p.name)
    if not over:
        return set_condition(conds, "AdminOverride", False, "NoOverride",
                             "no serving pod runs an admin override", now, gen)
    parts = []
    for p in over:
        note = f", {blocked[p.override]} by the operator" if p.override in blocked else ""
        parts.append(f"{p.name} -> {p.override}{note} (loaded {p.loaded or 'nothing yet'})")
    msg = (f"{len(over)} pod(s) run an admin override instead of the fleet's {fleet}: "
           f"{'; '.join(parts)}; clear it with POST /adaflash/v1/drafter "
           '{"version": null}')
    was = get_condition(conds, "AdminOverride")
    if not was or was.get("status") != "True":
        kopf.warn(body, reason="AdminOverride", message=msg)
    return set_condition(conds, "AdminOverride", True, "PodsOverridden", msg, now, gen)


class _StatusPatch:
    """What one pass changes in status, saved as one conditional merge patch."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {}
        self.problems: list[children.Problem] = []  # children not written in this pass
        self.claim_modes: list[str] | None = None  # the shared claim's access modes


async def save_status(body: dict, status: dict) -> bool:
    """Merge `status` into the object's status if the object is still at the resourceVersion it
    was computed from; False on a conflict (another writer came first: read again).

    A write that changed neither the spec (generation) nor the status, such as kopf recording
    in an annotation that its handler is done, is no conflict for this pass: the patch is sent
    again at the new resourceVersion. Otherwise a pass that already acted (annotated a canary
    pod) would lose its record of it to an unrelated annotation."""
    meta = body["metadata"]
    if not status or is_subset(status, body.get("status") or {}):
        return True
    rv = meta.get("resourceVersion")
    for _attempt in range(3):
        try:
            await kube.patch(c.SERVICE_KIND, meta["namespace"], meta["name"],
                             {"metadata": {"resourceVersion": rv}, "status": status},
                             sub="status")
            return True
        except kube.ApiError as e:
            if e.status == 404:
                return True
            if e.status != 409:
                raise
        now = await kube.get(c.SERVICE_KIND, meta["namespace"], meta["name"])
        if now is None:
            return True
        if (now["metadata"].get("generation") != meta.get("generation")
                or (now.get("status") or {}) != (body.get("status") or {})):
            return False
        rv = now["metadata"].get("resourceVersion")
    return False


async def pass_once(namespace: str, name: str, logger: logging.Logger, *,
                    full: bool) -> bool | None:
    """One reconciliation from a fresh read: children and status, and with `full` the
    distillation loop and one rollout step. True: done; False: status conflict, retry;
    None: the object is gone or going."""
    body = await kube.get(c.SERVICE_KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    patch = _StatusPatch()
    try:
        if full:
            await _tick(body, patch, logger)
        else:
            await _reconcile(body, dict(body.get("status") or {}), patch, logger)
    finally:  # what was done is recorded, even when a later step failed
        saved = await save_status(body, patch.status)
    return saved


@kopf.on.resume(**SERVICE)
@kopf.on.create(**SERVICE)
@kopf.on.update(**SERVICE, field="spec")
async def reconcile(name: str, namespace: str, spec: kopf.Spec, logger: kopf.Logger,
                    **_: Any) -> None:
    """Fires when an AdaFlashService appears, its spec changes, or the operator restarts."""
    for _attempt in range(5):
        saved = await pass_once(namespace, name, logger, full=False)
        if saved is not False:
            break
    else:
        raise kopf.TemporaryError("status kept changing under us; retrying", delay=2)
    try:
        spec_mod.check_name(name)
        spec_mod.parse(dict(spec))
    except spec_mod.InvalidSpec as e:
        raise kopf.PermanentError("invalid spec; see the Ready condition") from e


# The control loop


# On shutdown the loop finishes its tick (cancellation_backoff) so that status matches what it did.
@kopf.daemon(**SERVICE, cancellation_backoff=15.0, cancellation_timeout=5.0,
             initial_delay=min(TICK, 1.0))
async def control_loop(name: str, namespace: str, stopped: kopf.DaemonStopped,
                       logger: kopf.Logger, **_: Any) -> None:
    """Runs while an AdaFlashService exists; every TICK seconds: children, distillation, one
    rollout step. It reads the object afresh each tick, so all progress is in its status.
    Nothing escapes it: an error is logged and the next tick tries again."""
    while not stopped:
        wait = TICK
        try:
            saved = await pass_once(namespace, name, logger, full=True)
            if saved is None:
                return
            if saved is False:  # another writer came first: redo from a fresh read soon
                wait = min(TICK, 0.5)
        except (kube.ApiError, kopf.TemporaryError, OSError) as e:
            logger.warning(f"control loop: {e}; retrying in {TICK}s")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must not end the loop for good
            logger.exception(f"control loop: unexpected {type(e).__name__}: {e}")
        await stopped.wait(wait)


async def _tick(body: dict, patch: Any, logger: logging.Logger) -> None:
    st = dict(body.get("status") or {})
    result = await _reconcile(body, st, patch, logger)
    if result is None:
        return
    s, fleet_data, infos = result
    fleet = fleet_data[c.FLEET_VERSION_KEY]
    owner = _owner(body)
    conds = patch.status.get("conditions") or st.get("conditions") or []
    patch.status["conditions"] = conds
    conds = await job_phases.bootstrap(owner, body, s, st, patch, conds)
    patch.status["conditions"] = conds
    conds = await job_phases.distillation(owner, body, s, fleet, infos, st, patch, conds, logger)
    patch.status["conditions"] = conds
    if not any(p.kind == "ConfigMap" for p in patch.problems):  # the rollout writes it
        conds = await rollout_phase.rollout_step(owner, body, s, fleet_data, infos, st, patch, conds, logger)
    # A child problem outranks the rollout's verdict on Degraded (both are in the message).
    conds = _child_condition(body, conds, patch.problems, _ts(_now()),
                             body["metadata"].get("generation"), event=False)
    patch.status["conditions"] = conds
    # The gauges follow status on every tick, so they are right again after a restart.
    d = {**(st.get("distillation") or {}), **(patch.status.get("distillation") or {})}
    metrics.DISTILL_FAILURES.labels(owner["metadata"]["namespace"], owner["metadata"][
        "name"]).set(int(d.get("consecutiveFailures") or 0))


@kopf.on.delete(**SERVICE, optional=True)
def forget(name: str, namespace: str, **_: Any) -> None:
    """Fires when an AdaFlashService is deleted; the garbage collector removes its children."""
    metrics.forget(namespace, name)
    children.forget(namespace)
