"""`adaflash drafters list|show|publish|import|pin`: the versions on the shared volume, by hand.

The same store functions the distillation job and the serving side use
(:mod:`sglang_adaflash.drafter.store`), so what a person publishes or pins here is exactly what a
job would have: hashed, numbered above every version the volume ever had, and verified before a
serving process is pointed at it. On Kubernetes the operator owns the fleet version (pin with
`spec.drafter.pinnedVersion`); `pin` is for serving processes that poll a fleet version file
themselves (`ADAFLASH_FLEET_VERSION_FILE`, docs/sglang.md). Like the admin call, `pin` refuses
a version the operator blocked (listed in `ADAFLASH_BLOCKED_VERSIONS_FILE`: Rejected or
RolledBack) unless told `--force`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..launch.prompts import CLIError

ENV_HOME = "ADAFLASH_HOME"
DEFAULT_HOME = "/var/lib/adaflash"
FLEET_FILE_ENVS = ("ADAFLASH_FLEET_VERSION_FILE", "ADAFLASH_DESIRED_VERSION_FILE")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("drafters", help="list, show, publish and pin drafter versions",
                       description="Drafter versions on the shared volume ($ADAFLASH_HOME/drafters).")
    verbs = p.add_subparsers(dest="drafters_command", required=True,
                             metavar="{list,show,publish,import,pin}")

    def home(q):
        q.add_argument("--home", default=os.environ.get(ENV_HOME, DEFAULT_HOME),
                       help="shared volume (default $ADAFLASH_HOME, else /var/lib/adaflash)")

    q = verbs.add_parser("list", help="published versions, oldest first")
    home(q)
    q.add_argument("--json", action="store_true", help="one JSON object per version")
    q = verbs.add_parser("show", help="a version's manifest, after checking its hashes")
    home(q)
    q.add_argument("version", help="v000001, ... or latest")
    q.add_argument("--json", action="store_true", help="print the manifest as JSON")
    q = verbs.add_parser("publish", help="publish a checkpoint directory as the next version")
    home(q)
    q.add_argument("checkpoint", metavar="DIR", help="drafter checkpoint (config.json, model.safetensors)")
    q.add_argument("--target", required=True, metavar="DIR",
                   help="the target directory it was trained for (its config is fingerprinted)")
    q.add_argument("--parent", default=None, help="version it was trained from, if any")
    q = verbs.add_parser("import", help="publish a published DFlash checkpoint as the first "
                                        "version, with a length head (a new target's start)")
    home(q)
    q.add_argument("checkpoint", metavar="DIR",
                   help="a published DFlash checkpoint (config.json, model.safetensors)")
    q.add_argument("--target", required=True, metavar="DIR",
                   help="the target directory it drafts for (its config is fingerprinted)")
    q.add_argument("--target-name", default=None,
                   help="the target's name in the manifest (default: the directory's name; the "
                        "distillation job records its --target there)")
    q.add_argument("--neutral-ratio", type=float, default=None, metavar="R",
                   help="what the length head a plain DFlash checkpoint is given predicts until "
                        "the first distillation round trains it (default 0.95: verify almost "
                        "the whole block, as DFlash does)")
    q = verbs.add_parser("pin", help="write the fleet version file that serving processes poll")
    home(q)
    q.add_argument("version", nargs="?", help="v000001, ... or latest")
    q.add_argument("--file", default=None, metavar="PATH",
                   help="fleet version file (default $ADAFLASH_FLEET_VERSION_FILE)")
    q.add_argument("--clear", action="store_true", help="remove the pin (the file)")
    q.add_argument("--blocked-file", default=None, metavar="PATH",
                   help="versions the operator took out of service, one `VERSION REASON` a line "
                        "(default $ADAFLASH_BLOCKED_VERSIONS_FILE); a version listed there is refused")
    q.add_argument("--force", action="store_true",
                   help="pin a version even though the blocked-versions file lists it")
    return p


def _resolve(home: str, version: str) -> str:
    from ..drafter.checkpoint import CheckpointError
    from ..drafter.store import LATEST_NAME, latest_version

    if version != LATEST_NAME:
        return version
    try:
        v = latest_version(home)
    except (CheckpointError, OSError, UnicodeDecodeError) as e:
        raise CLIError(f"{home}/drafters/latest cannot be read: {e}") from None
    if v is None:
        raise CLIError(f"{home}/drafters/latest names no version yet: nothing is published")
    return v


def _summary(version: str, manifest: dict | None, latest: str | None, error: str | None) -> dict:
    m = manifest or {}
    training, ev = m.get("training") or {}, m.get("eval") or {}
    tau = ev.get("tau_by_domain") or {}
    ptau = ev.get("parent_tau_by_domain") or {}
    return {
        "version": version, "latest": version == latest, "created": m.get("created"),
        "parent": m.get("parent"), "algorithm": training.get("algorithm"),
        "records": training.get("records"), "steps": training.get("steps"),
        "tau": tau, "parent_tau": ptau, "error": error,
    }


def _mean(d: dict) -> str:
    vals = [float(v) for v in d.values() if isinstance(v, (int, float))]
    return f"{sum(vals) / len(vals):.2f}" if vals else "-"


def cmd_list(args) -> int:
    from ..drafter.checkpoint import CheckpointError
    from ..drafter.manifest import ManifestError, read_manifest
    from ..drafter.store import latest_version, list_versions, version_path

    try:
        latest = latest_version(args.home)
    except (CheckpointError, OSError, UnicodeDecodeError):
        latest = None
    rows = []
    for v in list_versions(args.home):
        try:
            rows.append(_summary(v, read_manifest(version_path(args.home, v)), latest, None))
        except ManifestError as e:
            rows.append(_summary(v, None, latest, str(e)))
    if args.json:
        for r in rows:
            print(json.dumps(r, sort_keys=True))
        return 0
    if not rows:
        print(f"no versions under {Path(args.home) / 'drafters'}")
        return 0
    print(f"{'VERSION':<10} {'':1} {'CREATED':<20} {'PARENT':<9} {'ALGORITHM':<15} "
          f"{'RECORDS':>7} {'TAU':>5} {'PARENT':>6}")
    for r in rows:
        if r["error"]:
            print(f"{r['version']:<10} {'*' if r['latest'] else '':1} unreadable: {r['error']}")
            continue
        print(f"{r['version']:<10} {'*' if r['latest'] else '':1} {r['created'] or '-':<20} "
              f"{r['parent'] or '-':<9} {r['algorithm'] or '-':<15} "
              f"{r['records'] if r['records'] is not None else '-':>7} {_mean(r['tau']):>5} "
              f"{_mean(r['parent_tau']):>6}")
    return 0


def cmd_show(args) -> int:
    from ..drafter.checkpoint import CheckpointError
    from ..drafter.store import verify_version

    version = _resolve(args.home, args.version)
    try:
        manifest = verify_version(args.home, version)
    except CheckpointError as e:
        raise CLIError(str(e)) from None
    if args.json:
        print(json.dumps(manifest, indent=2, sort_keys=True))
        return 0
    training, ev = manifest.get("training") or {}, manifest.get("eval") or {}
    print(f"version   {version} (files verified against manifest.json)")
    print(f"created   {manifest.get('created')}")
    print(f"parent    {manifest.get('parent') or '-'}")
    print(f"target    {(manifest.get('target') or {}).get('name', '-')}")
    for key in ("algorithm", "records", "steps", "final_loss"):
        if key in training:
            print(f"{key:<9} {training[key]}")
    for key, label in (("tau_by_domain", "tau"), ("parent_tau_by_domain", "parent tau")):
        if ev.get(key):
            print(f"{label:<9} " + ", ".join(f"{d} {t}" for d, t in sorted(ev[key].items())))
    return 0


def cmd_publish(args) -> int:
    from ..drafter.checkpoint import CheckpointError
    from ..drafter.manifest import ManifestError, target_fingerprint
    from ..drafter.store import publish_checkpoint, verify_version

    if args.parent:
        try:
            verify_version(args.home, args.parent)
        except CheckpointError as e:
            raise CLIError(f"--parent: {e}") from None
    try:
        fingerprint = target_fingerprint(args.target)
    except ManifestError as e:
        raise CLIError(f"--target: {e}") from None
    _check_fits_target(args.checkpoint, args.target)
    try:
        version = publish_checkpoint(args.home, args.checkpoint, target=fingerprint,
                                     parent=args.parent, training={"algorithm": "manual"})
    except CheckpointError as e:
        raise CLIError(str(e)) from None
    print(version)
    return 0


def _check_fits_target(checkpoint: str, target: str) -> None:
    """A drafter must share the target's width and vocabulary (it borrows its embedding and
    LM head) and read only layers the target has."""
    from ..drafter.checkpoint import CheckpointError, read_config
    from ..drafter.importing import check_fits_target

    try:
        check_fits_target(read_config(checkpoint), target)
    except CheckpointError as e:
        raise CLIError(f"{checkpoint}: {e}") from None


def cmd_import(args) -> int:
    from ..drafter.checkpoint import CheckpointError
    from ..drafter.importing import NEUTRAL_RATIO, import_checkpoint

    ratio = NEUTRAL_RATIO if args.neutral_ratio is None else args.neutral_ratio
    try:
        version = import_checkpoint(args.home, args.checkpoint, args.target,
                                    target_name=args.target_name, ratio=ratio)
    except (CheckpointError, ValueError) as e:
        raise CLIError(str(e)) from None
    print(version)
    return 0


def cmd_pin(args) -> int:
    from ..drafter.checkpoint import CheckpointError
    from ..drafter.store import write_pin
    from ..serving.reload import ENV_BLOCKED_VERSIONS_FILE, read_blocked_versions

    path = args.file or next((os.environ[e] for e in FLEET_FILE_ENVS if os.environ.get(e)), None)
    if not path:
        raise CLIError("no fleet version file: pass --file PATH or set ADAFLASH_FLEET_VERSION_FILE "
                       "(on Kubernetes, pin with spec.drafter.pinnedVersion instead)")
    if args.clear == bool(args.version):
        raise CLIError("pass a version to pin, or --clear to remove the pin")
    if args.clear:
        write_pin(path, args.home, None)
        print(f"unpinned: removed {path}")
        return 0
    version = _resolve(args.home, args.version)
    # the admin call's rule: a version the operator's gate or rollback blocked needs --force
    blocked = read_blocked_versions(args.blocked_file or os.environ.get(ENV_BLOCKED_VERSIONS_FILE))
    why = blocked.get(version)
    if why and not args.force:
        raise CLIError(f"drafter version {version} is {why} by the operator's gate or rollback "
                       f"(listed in the blocked-versions file); pass --force to pin it anyway")
    try:
        write_pin(path, args.home, version)
    except CheckpointError as e:
        raise CLIError(str(e)) from None
    print(f"pinned {version} in {path}" + (f" (forced past {version} {why})" if why else ""))
    return 0


def cmd_drafters(args) -> int:
    return {"list": cmd_list, "show": cmd_show, "publish": cmd_publish, "import": cmd_import,
            "pin": cmd_pin}[args.drafters_command](args)
