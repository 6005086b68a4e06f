"""`python -m adaflash_operator`: run the operator, or print the CRDs.

    python -m adaflash_operator run [--namespace NS ...] [--metrics-port 8080] [--health-port 8081]
                                    [--leader-elect --lease-namespace NS [--lease-name NAME]]
    python -m adaflash_operator crds [--out DIR]

With --leader-elect, replicas share a Lease (leader.py) and only its holder runs the handlers;
the others stand by and take over when it goes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m adaflash_operator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run the operator")
    run.add_argument("--namespace", "-n", action="append", default=[],
                     help="watch only these namespaces (default: all)")
    run.add_argument("--metrics-port", type=int, default=8080, help="Prometheus port (0: off)")
    run.add_argument("--health-port", type=int, default=8081,
                     help="liveness endpoint port: GET /healthz (0: off)")
    run.add_argument("--verbose", action="store_true")
    run.add_argument("--leader-elect", action="store_true",
                     help="run only while holding the Lease (several replicas are then safe)")
    run.add_argument("--lease-name", default="adaflash-operator")
    run.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", ""),
                     help="namespace of the Lease (default: $POD_NAMESPACE)")
    run.add_argument("--identity", default=os.environ.get("POD_NAME") or
                     f"{socket.gethostname()}-{os.getpid()}",
                     help="this replica's name in the Lease (default: $POD_NAME)")
    run.add_argument("--lease-duration", type=float, default=15.0,
                     help="seconds a silent leader keeps the Lease")
    run.add_argument("--renew-deadline", type=float, default=10.0,
                     help="a leader that could not renew for this long stops")
    run.add_argument("--retry-period", type=float, default=2.0,
                     help="seconds between two attempts to take or renew the Lease")
    crds = sub.add_parser("crds", help="print the CRDs (or write them to --out)")
    crds.add_argument("--out", type=Path, help="directory to write one file per CRD into")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    if args.cmd == "crds":
        from . import crds as crds_mod
        for fname in crds_mod.CRD_FILES:
            text = crds_mod.render(fname)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / fname).write_text(text)
            else:
                sys.stdout.write("---\n" + text)
        return 0

    os.environ["ADAFLASH_OPERATOR_METRICS_PORT"] = str(args.metrics_port)
    if args.leader_elect:
        if not args.lease_namespace:
            ap_error = "--leader-elect needs --lease-namespace (or $POD_NAMESPACE)"
            print(f"python -m adaflash_operator run: {ap_error}", file=sys.stderr)
            return 2
        from .elected import run_elected
        return asyncio.run(run_elected(args))

    import kopf.cli

    return kopf.cli.main(args=kopf_args(args), standalone_mode=False) or 0


def kopf_args(args: argparse.Namespace) -> list[str]:
    """The `kopf run` command line for our options."""
    kargs = ["run", "--standalone", "-m", "adaflash_operator.handlers"]
    kargs += [f"--namespace={ns}" for ns in args.namespace] or ["--all-namespaces"]
    if args.health_port:
        kargs.append(f"--liveness=http://0.0.0.0:{args.health_port}/healthz")
    if args.verbose:
        kargs.append("--verbose")
    return kargs


if __name__ == "__main__":
    raise SystemExit(main())
