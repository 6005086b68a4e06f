"""`python -m adaflash_operator run --leader-elect`: kopf's operator, run only while this
replica holds the Lease (leader.py).

A standby replica serves /healthz and its metrics (adaflash_operator_leader 0) and waits. The
leader runs kopf in standalone mode (no kopf peering: the Lease is the lock) until SIGTERM,
when it releases the Lease, or until it loses the Lease, when it drops its per-service gauges
and exits 1 (its pod restarts as a standby): a deposed leader must not act a moment longer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

from aiohttp import web

logger = logging.getLogger(__name__)


async def _serve_health(port: int, elector) -> web.AppRunner:
    """GET /healthz: 200 while this process runs its loop (leader or standby)."""
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"leader": elector.leading})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


async def run_elected(args: argparse.Namespace) -> int:
    import kopf

    from . import (
        handlers,  # noqa: F401  (registers the handlers)
        kube,
        leader,
        metrics,
    )

    kopf.configure(verbose=args.verbose)
    await kube.load_config()
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    metrics.LEADER.set(0)
    elector = leader.Elector(leader.LeaseConfig(
        namespace=args.lease_namespace, name=args.lease_name, identity=args.identity,
        duration_s=args.lease_duration, renew_deadline_s=args.renew_deadline,
        retry_s=args.retry_period))
    health = await _serve_health(args.health_port, elector) if args.health_port else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        acquiring = asyncio.create_task(elector.acquire())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not elector.leading:
            acquiring.cancel()
            return 0
        stopping.cancel()
        metrics.LEADER.set(1)
        lost = asyncio.Event()
        renewing = asyncio.create_task(elector.hold(lost))
        # kopf stops on SIGTERM (its own handlers), or when the Lease is lost.
        await kopf.operator(standalone=True, clusterwide=not args.namespace,
                            namespaces=args.namespace, stop_flag=lost)
        renewing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewing
        if lost.is_set():
            metrics.forget_all()
            metrics.LEADER.set(0)
            logger.error("the Lease was lost: exiting so that this replica restarts as a "
                         "standby")
            return 1
        await elector.release()
        return 0
    finally:
        if health is not None:
            await health.cleanup()
        await kube.close()
