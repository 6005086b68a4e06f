"""Live `adaflash serve` instances for the server tests, on 127.0.0.1 and a free port.

Servers are built by the real command line (`adaflash serve ...` parsed by the CLI's own parser,
then `build_server`) and run by uvicorn in a thread of the test process, so a test talks to a
real HTTP server through the official `openai` client while the model loads only once per
module. The pair is the tiny random one in float64, so greedy argmaxes never tie and T=0
outputs do not depend on how requests happen to be batched.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from sglang_adaflash.cli.main import build_parser  # noqa: E402
from sglang_adaflash.drafter.manifest import target_fingerprint  # noqa: E402
from sglang_adaflash.drafter.store import publish_checkpoint  # noqa: E402
from sglang_adaflash.testing.tiny_pair import build_tiny_pair  # noqa: E402

START_TIMEOUT_S = 60


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("server-pair") / "pair", seed=0, dtype="float64")


def publish_pair_drafter(home: Path, pair) -> str:
    """Publish the pair's own drafter as the next version under `home`."""
    return publish_checkpoint(home, pair.drafter_dir, target=target_fingerprint(pair.target_dir))


class LiveServer:
    """`adaflash serve ARGS` in a thread of this process; `url` is its base URL."""

    def __init__(self, args: list[str]):
        from sglang_adaflash.server.cli import bind, build_server

        parsed = build_parser().parse_args(["serve", "--host", "127.0.0.1", "--port", "0", *args])
        self.server = build_server(parsed)
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._uvicorn = self.server.uvicorn_server(log_level="warning", timeout_graceful_shutdown=2)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self.sock]},
                                        name="test-uvicorn", daemon=True)

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the test server did not become ready in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(30)
        self.sock.close()

    @property
    def running(self) -> bool:
        """Whether uvicorn still serves (it stops by itself once the engine loop failed)."""
        return self._thread.is_alive()

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=kw.pop("timeout", 60), **kw)

    def async_openai(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=kw.pop("timeout", 60), **kw)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10)

    def wait_for(self, predicate, timeout: float = 20.0, what: str = "condition"):
        """Poll `predicate()` until it returns a truthy value (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def live_server():
    """A factory: `live_server(args)` starts a server that is stopped when the test ends."""
    started: list[LiveServer] = []

    def start(args: list[str]) -> LiveServer:
        srv = LiveServer(args).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


def traffic_records(home: Path) -> list[dict]:
    from sglang_adaflash.serving.traffic import iter_records

    out = []
    for d in sorted((home / "traffic").iterdir()):
        out.extend(iter_records(d, include_partial=True))
    return out


def inject_prefill_fault(engine, prompt_ids: list[int]) -> None:
    """Make a live engine's first-token sampling raise whenever a request with exactly these
    prompt ids is admitted: a fault the engine must blame on that request alone."""
    real = engine._sample_rows

    def sample_rows(logits, seqs):
        if any(s.req.prompt_ids == prompt_ids for s in seqs):
            raise RuntimeError("injected: probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, seqs)

    engine._sample_rows = sample_rows
