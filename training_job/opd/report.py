"""The Job report the operator reads from the termination message, built from the manifest.

The manifest (the volume's record) and the report (the operator's) spell the same facts
differently (docs/contracts.md, "Distillation job"): ``training.final_loss`` becomes
``training.finalLoss``, ``eval.tau_by_domain`` becomes ``eval.tau``, the target's
``config_digest`` becomes ``target.sha256``. The report must fit the termination message
(4096 bytes) and the DrafterVersion schema, whose ``training`` and ``eval`` objects know only a
few keys, so only those are sent; the manifest keeps the rest.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from sglang_adaflash.fsio import atomic_path

#: Kubernetes' limit on a termination message.
MAX_REPORT_BYTES = 4096
#: What of the gate's decision the report carries (the manifest keeps the per-prompt numbers).
GATE_KEYS = ("passed", "reason", "message", "meanTau", "parentMeanTau", "gain", "gainLow",
             "minGain", "confidence", "resamples", "prompts", "domains")
#: ``outcome`` of a published round's report, and of a job with too few new records.
OUTCOME_PUBLISHED = "Published"
OUTCOME_NOT_ENOUGH = "NotEnoughRecords"


def build_report(manifest: dict[str, Any], *, target_name: str) -> dict[str, Any]:
    training = manifest.get("training") or {}
    ev = manifest.get("eval") or {}
    target = manifest.get("target") or {}
    report: dict[str, Any] = {"outcome": OUTCOME_PUBLISHED, "version": manifest["version"]}
    if manifest.get("parent"):
        report["parent"] = manifest["parent"]
    if manifest.get("created"):
        report["created"] = manifest["created"]
    sha = target.get("config_digest") or target.get("config_sha256")
    report["target"] = {"name": target_name, **({"sha256": sha} if sha else {})}
    t: dict[str, Any] = {}
    if training.get("algorithm"):
        t["algorithm"] = str(training["algorithm"])
    for key in ("records", "steps"):
        if isinstance(training.get(key), int) and training[key] >= 0:
            t[key] = training[key]
    loss = training.get("final_loss")
    if isinstance(loss, (int, float)) and math.isfinite(loss):
        t["finalLoss"] = round(float(loss), 6)
    if t:
        report["training"] = t
    e: dict[str, Any] = {}
    for src, dst in (("tau_by_domain", "tau"), ("parent_tau_by_domain", "parentTau")):
        m = ev.get(src) or {}
        m = {str(k): round(float(v), 4) for k, v in m.items()
             if isinstance(v, (int, float)) and math.isfinite(v) and v >= 0}
        if m:
            e[dst] = m
    gate = ev.get("gate")
    if isinstance(gate, dict) and "passed" in gate:
        e["gate"] = {k: gate[k] for k in GATE_KEYS if k in gate}
    if e:
        report["eval"] = e
    return report


def idle_report(*, parent: str, usable: int, required: int, message: str,
                created: str, skipped: dict[str, int] | None = None) -> dict[str, Any]:
    """The report of a job that found too few new records: no version, nothing published, and
    nothing consumed. ``outcome`` tells the operator it is not a failure; ``skipped`` counts
    the lines and records passed over, by reason (damaged, another target's, ...)."""
    report: dict[str, Any] = {"outcome": OUTCOME_NOT_ENOUGH, "created": created,
                              "records": {"usable": int(usable), "required": int(required)},
                              "message": message[:1000]}
    if skipped:
        report["skipped"] = {str(k): int(v) for k, v in sorted(skipped.items())}
    if parent:
        report["parent"] = parent
    return report


def encode_report(report: dict[str, Any], weight: dict[str, int] | None = None,
                  limit: int = MAX_REPORT_BYTES) -> bytes:
    """Compact JSON of at most ``limit`` bytes.

    With too many domains, the ones with the least held-out weight are dropped from both tau
    maps and the gate's per-domain numbers (together, so the gate still compares like with
    like) until it fits; the gate's decision itself always stays.
    """
    report = json.loads(json.dumps(report))
    data = json.dumps(report, separators=(",", ":")).encode()
    ev = report.get("eval") or {}
    domains = sorted(set(ev.get("tau") or {}) | set(ev.get("parentTau") or {}),
                     key=lambda d: ((weight or {}).get(d, 0), d))
    while len(data) > limit and domains:
        drop = domains.pop(0)
        for part in (ev.get("tau"), ev.get("parentTau"), (ev.get("gate") or {}).get("domains")):
            (part or {}).pop(drop, None)
        data = json.dumps(report, separators=(",", ":")).encode()
    if len(data) > limit and ev.get("gate"):
        ev["gate"]["message"] = ev["gate"].get("message", "")[:200]
        data = json.dumps(report, separators=(",", ":")).encode()
    if len(data) > limit:
        gate = (report.get("eval") or {}).get("gate") or {}
        report = {k: report[k] for k in ("outcome", "version", "parent") if k in report}
        if gate:
            report["eval"] = {"gate": {k: gate[k] for k in ("passed", "reason") if k in gate}}
        data = json.dumps(report, separators=(",", ":")).encode()
    return data


def write_report(path: str | os.PathLike, data: bytes) -> None:
    """Write the report; atomically where the path allows it.

    `/dev/termination-log` is a file the kubelet bind-mounts: nothing can be renamed onto it
    (and the root filesystem is read-only), but it is read only after the container exits, so
    a plain write is enough there.
    """
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            tmp.write_bytes(data)
        return
    except OSError:
        pass
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
