"""Hot reload in `adaflash serve`: the SGLang pod's machinery, on the reference drafter.

Nothing here reimplements reloading. The watcher, verification, in-place copy with rollback and
reporting are :class:`~sglang_adaflash.serving.reload.HotReloader`'s; the admin endpoints are
the SGLang plugin's (:func:`sglang_adaflash.sglang_plugin.http.add_routes`), mounted on this
server's app. What is specific to the embedded server:

- the reload target is the reference :class:`DFlashDrafter` itself (its state-dict names are
  the checkpoint names), swapped by the engine loop between two steps;
- a version pinned on the command line (``--drafter-version``) is the last source consulted,
  after the pod's own (admin override, pod annotation, fleet version file, ``drafters/latest``
  when following it), so an operator can still move a pinned server with the admin call;
- the admin call is refused (403) when no ``ADAFLASH_ADMIN_TOKEN`` is set, unless the server
  listens on a loopback address only: on any other address an unauthenticated POST would let
  anyone on the network choose which weights this process serves.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from ..serving import reload as rl
from ..serving.metrics import MetricsSink
from ..sglang_plugin import http as admin_http


class PinnedSource:
    """The pod's desired-version sources, then the version pinned at start-up."""

    def __init__(self, base: rl.DesiredVersionSource, pinned: str | None):
        self.base = base
        self.pinned = pinned
        self.home = base.home

    def read(self) -> tuple[str, str] | None:
        found = self.base.read()
        if found is not None or self.pinned is None:
            return found
        return self.pinned, "--drafter-version"


def reload_env(home: str | os.PathLike, follow_latest: bool,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the reload pieces read: the process's own, with this server's choices.

    The status and override files default to a fresh per-launch directory, exactly as in the
    SGLang pod, so that GET and POST ``/adaflash/v1/drafter`` behave the same in both.
    """
    env = dict(os.environ if base is None else base)
    env[rl.ENV_HOME] = str(home)
    env[rl.ENV_FOLLOW_LATEST] = "1" if follow_latest else "0"
    admin_http.ensure_runtime_files(env)
    return env


def build_reloader(
    drafter,
    *,
    env: Mapping[str, str],
    loaded_version: str | None,
    pinned: str | None,
    target_dir: str | os.PathLike | None,
    sink: MetricsSink | None,
    poll_s: float,
) -> rl.HotReloader:
    return rl.HotReloader(
        source=PinnedSource(rl.DesiredVersionSource.from_env(env), pinned),
        target=rl.ModuleTarget(drafter),
        loaded_version=loaded_version,
        live_config=drafter.config,
        sink=sink,
        reporters=[rl.StatusFileReporter(env[rl.ENV_STATUS_FILE])],
        poll_interval_s=poll_s,
        require_manifest=env.get(rl.ENV_REQUIRE_MANIFEST, "1") != "0",
        target_dir=target_dir,
    )


def write_static_status(env: Mapping[str, str], version: str | None, why: str) -> None:
    """Status for a server that cannot reload (mode ``ar``: no drafter), so GET says why."""
    path = Path(env[rl.ENV_STATUS_FILE])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"loaded_version": version, "last_error": None, "reloads": {},
                                "reload": why}))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def mount_admin(app, env: MutableMapping[str, str], host: str) -> None:
    """``GET/POST /adaflash/v1/drafter``, as in the SGLang pod, with the loopback rule above."""
    admin_http.add_routes(app, env, open_without_token=is_loopback(host))
    app.add_middleware(AdminGuard, env=env, loopback=is_loopback(host))


class AdminGuard:
    """Refuses the admin POST when no token is configured and the server is reachable from
    other hosts (a plain ASGI middleware: it must not buffer the streamed responses)."""

    def __init__(self, app, *, env: Mapping[str, str], loopback: bool):
        self.app = app
        self.env = env
        self.loopback = loopback

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] == admin_http.ROUTE
            and not self.loopback
            and not self.env.get(admin_http.ENV_ADMIN_TOKEN)
        ):
            body = json.dumps({"error": (
                f"the admin call is disabled: set {admin_http.ENV_ADMIN_TOKEN} (then send "
                "Authorization: Bearer <token>), or serve on a loopback address only")}).encode()
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)
