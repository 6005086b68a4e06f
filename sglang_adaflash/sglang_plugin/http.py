"""``GET/POST /adaflash/v1/drafter`` on SGLang's own HTTP server.

SGLang's HTTP server runs in the launcher process; the drafter lives in the scheduler processes.
They talk through two files (defaults under a per-launch directory, set before SGLang spawns its
subprocesses so that all of them see the same paths):

- the scheduler (TP rank 0) writes the status JSON to ``ADAFLASH_LOADED_VERSION_FILE``; GET
  returns it;
- POST ``{"version": "v000007" | "latest" | null}`` writes ``ADAFLASH_ADMIN_OVERRIDE_FILE``,
  which the scheduler's watcher reads with the highest priority (null clears it). When
  ``ADAFLASH_ADMIN_TOKEN`` is set, POST needs ``Authorization: Bearer <token>``.
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` class.
import hmac
import logging
import os
import tempfile
from pathlib import Path

from sglang_adaflash.serving import reload as rl

logger = logging.getLogger(__name__)

ROUTE = "/adaflash/v1/drafter"
ENV_ADMIN_TOKEN = "ADAFLASH_ADMIN_TOKEN"


def ensure_runtime_files(env=None) -> tuple[str, str]:
    """Default the status and override file paths (in the launcher, before any spawn)."""
    env = os.environ if env is None else env
    if not env.get(rl.ENV_STATUS_FILE) or not env.get(rl.ENV_OVERRIDE_FILE):
        run_dir = Path(tempfile.mkdtemp(prefix="adaflash-"))
        env.setdefault(rl.ENV_STATUS_FILE, str(run_dir / "drafter-status.json"))
        env.setdefault(rl.ENV_OVERRIDE_FILE, str(run_dir / "desired-drafter-version"))
    return env[rl.ENV_STATUS_FILE], env[rl.ENV_OVERRIDE_FILE]


def add_routes(app, env=None) -> None:
    """Mount the drafter endpoint on a FastAPI app (idempotent)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    if any(getattr(r, "path", None) == ROUTE for r in app.router.routes):
        return
    env = os.environ if env is None else env
    status_file, override_file = ensure_runtime_files(env)
    home = env.get(rl.ENV_HOME) or rl.DEFAULT_HOME

    @app.get(ROUTE)
    async def adaflash_drafter_status():
        return JSONResponse(rl.read_status(status_file))

    @app.post(ROUTE)
    async def adaflash_drafter_request(request: Request):
        token = env.get(ENV_ADMIN_TOKEN)
        if token:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given, f"Bearer {token}"):
                return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or "version" not in body:
            return JSONResponse(
                {"error": 'expected a JSON body {"version": "v000001" | "latest" | null}'},
                status_code=400,
            )
        try:
            result = rl.set_override(override_file, body["version"], home)
        except (ValueError, rl.ReloadError) as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        return JSONResponse({**result, "status": rl.read_status(status_file)}, status_code=202)


def _before_launch_server(*args, **kwargs):
    from sglang.srt.entrypoints import http_server

    add_routes(http_server.app)
    return None


def install_routes_when_server_starts() -> None:
    """Add the routes just before SGLang's HTTP server starts (a plugin BEFORE hook)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    ensure_runtime_files()
    HookRegistry.register(
        "sglang.srt.entrypoints.http_server.launch_server",
        _before_launch_server,
        HookType.BEFORE,
    )
