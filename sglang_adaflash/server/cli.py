"""`adaflash serve`: load the pair, build the engine loop, reload, metrics and traffic, serve.

Which drafter is served at start-up:

- ``--drafter DIR``: that checkpoint. It is reported as its manifest's version (or
  ``ADAFLASH_DRAFTER_VERSION``, or ``initial:<dir name>``); it is replaced only when a reload
  source names a version (``--follow-latest``, the admin call, the pod's files);
- ``--drafter-version VERSION``: that published version under ``--home``, pinned;
- neither: the version ``drafters/latest`` names under ``--home``, followed as it moves.

Mode ``ar`` needs no drafter and never reloads.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
from pathlib import Path

from ..errors import CLIError

MODES = ("ar", "dflash", "adaflash", "d2sd")
DEFAULT_MAX_SEQ_LEN = 2048
logger = logging.getLogger(__name__)


def add_parser(sub, model_dir) -> argparse.ArgumentParser:
    """The `serve` subcommand; `model_dir` is the CLI's converter that knows `embedded`."""
    s = sub.add_parser(
        "serve", help="serve the engine over an OpenAI-compatible HTTP API",
        description="Serve the reference engine over an OpenAI-compatible HTTP API (FastAPI + uvicorn): "
                    "/v1/completions, /v1/chat/completions, /v1/models, /health, /ready, /metrics and "
                    "/adaflash/v1/drafter. See docs/serving.md.")
    s.add_argument("--target", required=True, metavar="DIR", type=model_dir("target"),
                   help="Hugging Face target model directory, or `embedded` for the bundled target")
    s.add_argument("--drafter", metavar="DIR", type=model_dir("drafter"),
                   help="start-up drafter checkpoint, or `embedded`; default: a published version under --home")
    s.add_argument("--home", metavar="DIR",
                   help="shared volume with drafters/ and traffic/ (default $ADAFLASH_HOME, else /var/lib/adaflash)")
    s.add_argument("--drafter-version", metavar="VERSION",
                   help="serve this published version from --home and stay on it (the admin call can still move it)")
    s.add_argument("--follow-latest", action="store_true",
                   help="hot-reload each new drafters/latest (the default when the drafter comes from --home unpinned)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one and prints it)")
    s.add_argument("--mode", choices=MODES, default="adaflash",
                   help="decoding mode (default adaflash; d2sd needs --recovery-drafter, or --branch-drafter first)")
    s.add_argument("--model-name", help="the model id clients send (default: the target directory's name)")
    s.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"),
                   help="run target and drafter in this dtype (default: the target's own)")
    s.add_argument("--device", default="cpu", help="torch device (default cpu)")
    s.add_argument("--seed", type=int, default=0, help="seed of the engine's sampler (default 0)")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    s.add_argument("--max-batch-size", type=int, default=32, help="requests decoded together, 1..4096 (default 32)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait for a slot; beyond them the server answers 429 (default 256)")
    s.add_argument("--max-seq-len", type=int, default=None,
                   help=f"longest prompt plus output, in tokens (default min({DEFAULT_MAX_SEQ_LEN}, the target's positions))")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before a request is aborted and answered 504 (default 600)")
    s.add_argument("--no-traffic", action="store_true", help="write no traffic records")
    s.add_argument("--log-text", action="store_true",
                   help="also write prompt and output text into traffic records (default: token ids only)")
    s.add_argument("--traffic-writer", metavar="NAME",
                   help="traffic/<NAME>/ directory (default $ADAFLASH_POD_NAME, else serve-<hostname>)")
    s.add_argument("--reload-poll-s", type=float, default=None,
                   help="seconds between checks for a new drafter version (default $ADAFLASH_RELOAD_POLL_S, else 5)")
    s.add_argument("--no-metrics", action="store_true", help="no /metrics")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    from ..d2sd.cli import add_d2sd_args

    add_d2sd_args(s)
    return s


def _check_flags(args) -> None:
    from ..launch.engine_factory import check_batch_size

    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {args.port}")
    check_batch_size(args.max_batch_size)
    if args.max_queue < 0:
        raise CLIError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_seq_len is not None and args.max_seq_len < 2:
        raise CLIError(f"--max-seq-len must be >= 2, got {args.max_seq_len}")
    if not args.request_timeout > 0:
        raise CLIError(f"--request-timeout must be > 0, got {args.request_timeout}")
    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads must be >= 1, got {args.threads}")
    if args.drafter and args.drafter_version:
        raise CLIError("give --drafter DIR or --drafter-version VERSION, not both")
    if args.drafter_version and args.follow_latest:
        raise CLIError("--drafter-version pins a version; --follow-latest follows drafters/latest: choose one")
    if args.reload_poll_s is not None and not args.reload_poll_s > 0:
        raise CLIError(f"--reload-poll-s must be > 0, got {args.reload_poll_s}")


def resolve_home(args) -> Path:
    from ..serving.reload import DEFAULT_HOME, ENV_HOME

    return Path(args.home or os.environ.get(ENV_HOME) or DEFAULT_HOME)


def resolve_drafter(args, home: Path) -> tuple[str | None, str | None, str | None, bool]:
    """(drafter directory, its version, pinned version, follow latest) for these flags."""
    from ..drafter.store import LATEST_NAME, drafters_dir
    from ..serving.reload import is_version, read_latest

    if args.mode == "ar":
        return args.drafter, None, None, False
    if args.drafter:
        from ..sglang_plugin.runtime import initial_version

        return args.drafter, initial_version(Path(args.drafter)), None, args.follow_latest
    if args.drafter_version and args.drafter_version != LATEST_NAME:
        version = args.drafter_version
        if not is_version(version):
            raise CLIError(f"--drafter-version {version!r} is not a version name such as v000001")
        if not (drafters_dir(home) / version).is_dir():
            raise CLIError(f"--drafter-version {version} is not published under {drafters_dir(home)}")
        return str(drafters_dir(home) / version), version, version, False
    version = read_latest(home)
    if version is None:
        raise CLIError(f"no drafter: {drafters_dir(home) / LATEST_NAME} names no published version; "
                       "pass --drafter DIR, --home DIR with published versions, or --mode ar")
    return str(drafters_dir(home) / version), version, None, True


def writer_name(args) -> str:
    from ..serving.reload import ENV_POD_NAME, ENV_POD_NAME_FALLBACK

    name = args.traffic_writer or os.environ.get(ENV_POD_NAME) or os.environ.get(ENV_POD_NAME_FALLBACK)
    if name:
        return name
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:100].strip(".-_") or "host"
    return f"serve-{host}"


def model_name(args) -> str:
    from ..assets import TARGET_DIR

    if args.model_name:
        return args.model_name
    target = Path(args.target).resolve()
    return "embedded" if target == TARGET_DIR.resolve() else target.name


def build_server(args):
    """Everything but the socket; raises CLIError with a one-line message."""
    import torch

    from ..core.sampling import SamplingParams
    from ..d2sd.cli import attach_recovery, options_from_args
    from ..engine.request import Request
    from ..launch.engine_factory import check_seed, make_engine, quiet_transformers
    from ..launch.loading import load_pair
    from ..serving.metrics import FanoutSink, LoggingSink, PrometheusSink
    from ..serving.traffic import TrafficError, TrafficWriter
    from .app import AdaFlashServer, ServerSettings
    from .engine_loop import EngineLoop
    from .records import TrafficRecorder
    from .reload import build_reloader, reload_env, write_static_status

    _check_flags(args)
    check_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    quiet_transformers()
    home = resolve_home(args)
    drafter_dir, version, pinned, follow = resolve_drafter(args, home)
    pair = load_pair(args.target, drafter_dir, dtype=args.dtype, device=args.device,
                     need_drafter=args.mode != "ar")
    # d2sd: the recovery drafter stays as loaded; hot reload swaps the first drafter in place
    attach_recovery(pair, options_from_args(args, [args.mode]))
    limit = getattr(pair.target.config, "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN
    max_seq = args.max_seq_len or min(DEFAULT_MAX_SEQ_LEN, int(limit))
    engine = make_engine(pair, args.mode, args.max_batch_size, max_seq, args.seed)
    # One short request first: adaflash profiles its step cost on the first step, and the first
    # client should not pay for it.
    engine.run([Request([pair.pad_token_id] * 4, SamplingParams(max_new_tokens=2), request_id="warm-up")])

    registry = sink = None
    if not args.no_metrics:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        prom = PrometheusSink(registry, max_block_size=max(engine.block_size, 1))
        sink = FanoutSink([prom, LoggingSink()])

    name = model_name(args)
    recorder = None
    if not args.no_traffic:
        try:
            writer = TrafficWriter(home, writer_name(args), include_text=args.log_text, sink=sink)
        except (OSError, TrafficError) as e:
            raise CLIError(f"cannot write traffic records under {home / 'traffic'} ({e}); pass --home DIR "
                           "you can write to, or --no-traffic") from None
        from ..serving.traffic import target_digest_of

        recorder = TrafficRecorder(writer, model=name, tokenizer=pair.tokenizer,
                                   target_digest=target_digest_of(args.target))

    env = reload_env(home, follow)
    reloader = None
    if args.mode != "ar":
        from ..serving.reload import ENV_POLL_S

        poll = args.reload_poll_s or float(env.get(ENV_POLL_S) or 5.0)
        reloader = build_reloader(pair.drafter, env=env, loaded_version=version, pinned=pinned,
                                  target_dir=args.target, sink=sink, poll_s=poll)
    else:
        write_static_status(env, None, "mode ar serves no drafter; nothing to reload")

    settings = ServerSettings(model_name=name, host=args.host, port=args.port,
                              request_timeout_s=args.request_timeout, mode=args.mode)
    loop = EngineLoop(engine, capacity=args.max_batch_size + args.max_queue, post=lambda fn: fn(),
                      reloader=reloader, sink=sink, version=version,
                      on_finish=recorder.record if recorder is not None else None)
    return AdaFlashServer(engine=engine, loop=loop, tokenizer=pair.tokenizer, stop_token_ids=pair.stop_token_ids,
                          settings=settings, reloader=reloader, recorder=recorder, registry=registry,
                          admin_env=env)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, so the port is known (and held) before uvicorn starts."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        raise CLIError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def cmd_serve(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_flags(args)
    server = build_server(args)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"adaflash serve: model {server.settings.model_name!r}, mode {args.mode}, drafter "
          f"{server.loop.version or 'none'}, listening on http://{shown}:{port}", flush=True)
    http = server.uvicorn_server(log_level=args.log_level, access_log=args.access_log,
                                 timeout_graceful_shutdown=10)
    try:
        # On SIGINT/SIGTERM uvicorn stops accepting, lets open requests finish (10 s at most),
        # runs the shutdown (engine loop, reload watcher, traffic shard closed) and re-raises
        # the signal: Ctrl-C then exits 130 through the CLI. A failed engine loop stops it too.
        http.run(sockets=[sock])
    finally:
        sock.close()
    if server.exit_code:
        print(f"adaflash serve: stopped because {server.loop.error}; exiting {server.exit_code} so that a "
              "supervisor restarts the server", file=sys.stderr, flush=True)
    return server.exit_code
