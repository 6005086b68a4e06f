"""leader.Elector.hold: a renewal that fails in any way (an API error, a network or client
error) counts as a failed renewal; past the renew deadline the replica stops leading. An
exception that escaped would end the renewals while kopf's handlers went on acting, and a second
replica would take the Lease over: two leaders."""

from __future__ import annotations

import asyncio

import pytest
from adaflash_operator import kube, leader


@pytest.mark.parametrize("error", [kube.ApiError(503, "unavailable"),
                                   AssertionError(), OSError("connection reset")])
def test_a_renewal_that_fails_in_any_way_ends_leadership_at_the_deadline(error) -> None:
    el = leader.Elector(leader.LeaseConfig(namespace="ns", name="op", identity="me",
                                           duration_s=1.0, renew_deadline_s=0.05,
                                           retry_s=0.01))
    el.leading = True
    calls = []

    async def failing() -> bool:
        calls.append(1)
        raise error

    el.try_acquire_or_renew = failing  # type: ignore[method-assign]

    async def main() -> bool:
        lost = asyncio.Event()
        await asyncio.wait_for(el.hold(lost), timeout=5)
        return lost.is_set()

    assert asyncio.run(main()) is True
    assert el.leading is False and len(calls) >= 2  # retried until the deadline


def test_a_failed_renewal_right_after_taking_the_lease_over_is_no_loss(monkeypatch) -> None:
    """The replica takes over an expired Lease, then its first renewal fails (at shutdown,
    kopf's cleanup closes the client): it still leads until the deadline. (It used to read the
    previous holder, seen before its own write, as someone who had taken the Lease.)"""
    el = leader.Elector(leader.LeaseConfig(namespace="ns", name="op", identity="me",
                                           duration_s=1.0, renew_deadline_s=10.0,
                                           retry_s=0.01))
    lease = {"metadata": {"resourceVersion": "7"},
             "spec": {"holderIdentity": "old", "renewTime": "t0", "leaseDurationSeconds": 1}}

    async def get(kind, ns, name):
        return lease

    async def patch(kind, ns, name, body, sub=None):
        return {}

    monkeypatch.setattr(kube, "get", get)
    monkeypatch.setattr(kube, "patch", patch)
    el._seen, el._seen_at = ("old", "t0"), -1e9  # seen long ago: expired
    assert asyncio.run(el.try_acquire_or_renew()) is True
    el.leading = True

    async def failing() -> bool:
        raise AssertionError  # aiohttp's, on a closed client

    el.try_acquire_or_renew = failing  # type: ignore[method-assign]

    async def main() -> bool:
        lost = asyncio.Event()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(el.hold(lost), timeout=0.2)
        return lost.is_set()

    assert asyncio.run(main()) is False and el.leading is True
