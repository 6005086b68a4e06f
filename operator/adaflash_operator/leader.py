"""Leader election on a coordination.k8s.io/v1 Lease, so that several operator replicas are safe.

Only the holder of the Lease runs the handlers; the others wait, answering their liveness probe.
The rules are client-go's:

- a replica takes the Lease when it is free (no holder) or expired: its record (holder and
  renewTime) has not changed for `leaseDurationSeconds` by this replica's own clock (so clock
  skew between nodes does not matter);
- every write carries the resourceVersion it read, so of two replicas racing for it one gets
  a 409 and waits;
- the holder renews every `retry` seconds; if it cannot renew for `renew_deadline` seconds (less
  than the lease duration) it stops: another replica may take over after the duration, and two
  leaders must never act at once. The process then exits and its pod restarts as a standby.
- a clean shutdown releases the Lease (no holder), so a successor starts at once.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from dataclasses import dataclass, field

from . import kube

logger = logging.getLogger(__name__)


@dataclass
class LeaseConfig:
    namespace: str
    name: str
    identity: str
    duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_s: float = 2.0


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Elector:
    cfg: LeaseConfig
    leading: bool = False
    # The lease record last seen (holder, renewTime) and when (monotonic) it was first seen.
    _seen: tuple[str, str] | None = None
    _seen_at: float = field(default=0.0)

    def _body(self, spec: dict, rv: str | None = None) -> dict:
        meta: dict = {"name": self.cfg.name, "namespace": self.cfg.namespace}
        if rv is not None:
            meta["resourceVersion"] = rv
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                "spec": spec}

    async def try_acquire_or_renew(self) -> bool:
        """One attempt: True if this replica holds the Lease afterwards."""
        c = self.cfg
        live = await kube.get("Lease", c.namespace, c.name)
        now = _now()
        mine = {"holderIdentity": c.identity, "leaseDurationSeconds": int(c.duration_s),
                "renewTime": now}
        if live is None:
            try:
                await kube.create(self._body({**mine, "acquireTime": now,
                                              "leaseTransitions": 0}))
            except kube.ApiError as e:
                if e.status == 409:
                    return False
                raise
            self._wrote(now)
            return True
        spec = live.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime") or "")
        if record != self._seen:
            self._seen, self._seen_at = record, time.monotonic()
        duration = float(spec.get("leaseDurationSeconds") or c.duration_s)
        expired = time.monotonic() - self._seen_at > duration
        if holder and holder != c.identity and not expired:
            return False
        if holder != c.identity:
            mine["acquireTime"] = now
            mine["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        try:
            await kube.patch("Lease", c.namespace, c.name,
                             {"metadata": {"resourceVersion": live["metadata"].get(
                                 "resourceVersion")}, "spec": mine})
        except kube.ApiError as e:
            if e.status in (404, 409):  # someone else wrote it first: look again
                return False
            raise
        self._wrote(now)
        return True

    def _wrote(self, renew_time: str) -> None:
        """The record is now ours: a renewal that fails next must not take the previous
        holder, last seen before this write, for a new one."""
        self._seen, self._seen_at = (self.cfg.identity, renew_time), time.monotonic()

    async def acquire(self) -> None:
        """Wait until this replica holds the Lease."""
        announced = False
        while True:
            try:
                if await self.try_acquire_or_renew():
                    self.leading = True
                    logger.info(f"leader election: {self.cfg.identity} holds Lease "
                                f"{self.cfg.namespace}/{self.cfg.name}")
                    return
            except kube.ApiError as e:
                logger.warning(f"leader election: {e}")
            if not announced:
                logger.info(f"leader election: {self._seen[0] if self._seen else 'another'} "
                            f"holds Lease {self.cfg.namespace}/{self.cfg.name}; standing by")
                announced = True
            await asyncio.sleep(self.cfg.retry_s)

    async def hold(self, lost: asyncio.Event) -> None:
        """Renew until a renewal has failed for renew_deadline_s; then set `lost`."""
        last_ok = time.monotonic()
        while self.leading:
            await asyncio.sleep(self.cfg.retry_s)
            try:
                ok = await self.try_acquire_or_renew()
            except kube.ApiError as e:
                logger.warning(f"leader election: renewing failed: {e}")
                ok = False
            # A network or client failure (e.g. the client kopf's cleanup closed at shutdown) is
            # a failed renewal too: never the end of renewing while the handlers go on.
            except Exception as e:
                logger.warning(f"leader election: renewing failed: {type(e).__name__}: {e}")
                ok = False
            taken = bool(self._seen and self._seen[0] not in ("", self.cfg.identity))
            if ok:
                last_ok = time.monotonic()
            elif taken or time.monotonic() - last_ok > self.cfg.renew_deadline_s:
                logger.error(f"leader election: lost Lease {self.cfg.namespace}/"
                             f"{self.cfg.name}; stopping")
                self.leading = False
                lost.set()
                return

    async def release(self) -> None:
        """Give the Lease up (a clean shutdown): the next replica need not wait it out."""
        if not self.leading:
            return
        self.leading = False
        c = self.cfg
        try:
            live = await kube.get("Lease", c.namespace, c.name)
            if live and (live.get("spec") or {}).get("holderIdentity") == c.identity:
                await kube.patch("Lease", c.namespace, c.name, {
                    "metadata": {"resourceVersion": live["metadata"].get("resourceVersion")},
                    "spec": {"holderIdentity": None, "renewTime": None,
                             "leaseDurationSeconds": 1}})
        except kube.ApiError as e:
            logger.warning(f"leader election: releasing the Lease failed: {e}")
