"""``GET/POST /adaflash/v1/drafter`` on SGLang's own HTTP server.

SGLang's HTTP server runs in the launcher process; the drafter lives in the scheduler processes.
They talk through two files (defaults under a per-launch directory, set before SGLang spawns its
subprocesses so that all of them see the same paths):

- the scheduler (TP rank 0) writes the status JSON to ``ADAFLASH_LOADED_VERSION_FILE``; GET
  returns it;
- POST ``{"version": "v000007" | "latest" | null, "force": false}`` writes
  ``ADAFLASH_ADMIN_OVERRIDE_FILE``, which the scheduler's watcher reads with the highest
  priority (null clears it).

POST is closed by default: the override outranks the operator's gate, canary and rollback, so
anyone who can reach the port could otherwise choose the weights. It needs
``Authorization: Bearer $ADAFLASH_ADMIN_TOKEN`` (the operator sets the variable from a
per-service Secret); without a configured token it answers 403, unless the mounting server says
it listens on loopback only (``adaflash serve``). A version listed in
``ADAFLASH_BLOCKED_VERSIONS_FILE`` (Rejected or RolledBack) answers 409 unless ``"force": true``.
Every accepted call is logged with the caller's address, as is every refusal.
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` class.
import hmac
import logging
import os
import tempfile
from pathlib import Path

from sglang_adaflash.serving import reload as rl
from sglang_adaflash.validation import parse_flag, parse_json_body

logger = logging.getLogger(__name__)

ROUTE = "/adaflash/v1/drafter"
ENV_ADMIN_TOKEN = "ADAFLASH_ADMIN_TOKEN"
EXPECTED_BODY = 'expected a JSON body {"version": "v000001" | "latest" | null, "force": false}'


def ensure_runtime_files(env=None) -> tuple[str, str]:
    """Default the status and override file paths (in the launcher, before any spawn)."""
    env = os.environ if env is None else env
    if not env.get(rl.ENV_STATUS_FILE) or not env.get(rl.ENV_OVERRIDE_FILE):
        run_dir = Path(tempfile.mkdtemp(prefix="adaflash-"))
        env.setdefault(rl.ENV_STATUS_FILE, str(run_dir / "drafter-status.json"))
        env.setdefault(rl.ENV_OVERRIDE_FILE, str(run_dir / "desired-drafter-version"))
    return env[rl.ENV_STATUS_FILE], env[rl.ENV_OVERRIDE_FILE]


def authorize(token: str | None, authorization: str | None, *,
              open_without_token: bool = False) -> tuple[int, str] | None:
    """None when the admin call may proceed, else (HTTP status, why)."""
    if not token:
        if open_without_token:
            return None
        return 403, (f"the admin call is disabled: no {ENV_ADMIN_TOKEN} is configured on this "
                     "server (the operator sets it from the service's admin Secret)")
    # Bytes, so that a header with non-ASCII characters compares (and fails) in constant time
    # instead of raising.
    given = (authorization or "").encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(given, f"Bearer {token}".encode("utf-8", "surrogateescape")):
        return 401, "missing or wrong bearer token"
    return None


def _caller(request) -> str:
    client = getattr(request, "client", None)
    return f"{client.host}:{client.port}" if client else "unknown"


def add_routes(app, env=None, *, open_without_token: bool = False) -> None:
    """Mount the drafter endpoint on a FastAPI app (idempotent).

    ``open_without_token``: POST needs no token while none is configured; only for a server
    that listens on loopback addresses alone.
    """
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
        who = _caller(request)
        denied = authorize(env.get(ENV_ADMIN_TOKEN), request.headers.get("authorization"),
                           open_without_token=open_without_token)
        if denied is not None:
            logger.warning("adaflash admin: refused POST %s from %s: %s", ROUTE, who, denied[1])
            return JSONResponse({"error": denied[1]}, status_code=denied[0])
        try:
            body = parse_json_body(await request.body())
        except ValueError as e:
            return JSONResponse({"error": f"{e}; {EXPECTED_BODY}"}, status_code=400)
        if not isinstance(body, dict) or "version" not in body or \
                not isinstance(body.get("force", False), bool):
            return JSONResponse({"error": EXPECTED_BODY}, status_code=400)
        version, force = body["version"], body.get("force", False)
        try:
            result = rl.set_override(
                override_file, version, home, force=force,
                blocked=rl.read_blocked_versions(env.get(rl.ENV_BLOCKED_VERSIONS_FILE)))
        except rl.BlockedVersion as e:
            logger.warning("adaflash admin: refused override %s from %s: %s", version, who, e)
            return JSONResponse({"error": str(e)}, status_code=409)
        except (ValueError, rl.ReloadError) as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        logger.warning(
            "adaflash admin: %s set the drafter override to %s%s", who,
            version if version is not None else "none (cleared)",
            f" (forced past {result['forced_past']})" if result.get("forced_past") else "")
        return JSONResponse({**result, "status": rl.read_status(status_file)}, status_code=202)


def _before_launch_server(*args, **kwargs):
    from sglang.srt.entrypoints import http_server

    add_routes(http_server.app)
    return None


#: A request with this header set to a "yes" spelling (sglang_adaflash.validation: true, 1, yes,
#: on, in any case) leaves no traffic record (the same header and spellings as ``adaflash
#: serve``'s; its ``metadata.adaflash_no_log`` has no counterpart here: SGLang's request logger
#: sees the parsed request, not our metadata). SGLang has already accepted the request when the
#: logger runs, so a value that is no documented spelling cannot be refused with a 400 as
#: ``adaflash serve`` does: it keeps the request out of the log (the client asked for something
#: about its privacy; logging it would be the silent choice) and is logged as a warning.
NO_LOG_HEADER = "x-adaflash-no-log"
#: SGLang 0.5.23's request-log entry points; each gets the client's HTTP request.
REQUEST_LOG_METHODS = (
    "sglang.srt.utils.request_logger.RequestLogger.log_received_request",
    "sglang.srt.utils.request_logger.RequestLogger.log_openai_received_request",
    "sglang.srt.utils.request_logger.RequestLogger.log_finished_request",
)


def opted_out(request) -> bool:
    headers = getattr(request, "headers", None)
    if headers is None:
        return False
    try:
        return parse_flag(headers.get(NO_LOG_HEADER), f"the {NO_LOG_HEADER} header")
    except ValueError as e:
        logger.warning("adaflash: %s; the request is kept out of the traffic log", e)
        return True


def _skip_opted_out(original, *args, **kwargs):
    """Around SGLang's request log: SGLang has no per-request switch, and its log is the pod's
    traffic record, so an opted-out request must not reach it (received or finished)."""
    from starlette.requests import Request

    request = kwargs.get("request")
    if request is None:
        request = next((a for a in args if isinstance(a, Request)), None)
    if opted_out(request):
        return None
    return original(*args, **kwargs)


def install_routes_when_server_starts() -> None:
    """Add the routes just before SGLang's HTTP server starts (a plugin BEFORE hook), and the
    per-request traffic opt-out around SGLang's request logger (both in the launcher process,
    where the HTTP server and the request logger live)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    ensure_runtime_files()
    HookRegistry.register(
        "sglang.srt.entrypoints.http_server.launch_server",
        _before_launch_server,
        HookType.BEFORE,
    )
    for target in REQUEST_LOG_METHODS:
        HookRegistry.register(target, _skip_opted_out, HookType.AROUND)
