"""The demo's clients: the official `openai` client in a few threads, and a `/ready` poller.

Each answer's ``adaflash`` extension says how many decode steps each drafter version served for
it and how many tokens they committed, so live tau can be split by domain and by version even
for a request that spans a hot reload. The poller records the server's step counter and loaded
version twice a second: that timeline is where throughput per version and "serving never
stopped" come from.

Plain decoding is measured beside it in the same run: given a ``baseline`` replayer (a second
``adaflash serve --mode ar``), a worker sends every ``baseline_every``-th prompt of each domain there too, right
after the speculative server answered it and before its next request. Only one of the two
servers works at a time, so both see the same machine (the distiller busy on the other core),
and the pair of answers to one prompt is what the speedup is computed from (report.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import httpx

from .workload import Prompt


@dataclass
class Answer:
    id: str
    phase: str
    domain: str
    start: float  # seconds since the demo's clock started
    end: float
    ok: bool
    error: str | None = None
    completion_tokens: int = 0
    fingerprint: str | None = None  # the version serving when the request finished
    by_version: list[dict] = field(default_factory=list)  # [{version, decode_steps, committed_tokens}]
    server: str = "spec"  # "spec": the speculative server; "plain": plain decoding (mode ar)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def version(self) -> str | None:
        """The drafter version that served most of this answer's decode steps."""
        if not self.by_version:
            return self.fingerprint
        return max(self.by_version, key=lambda p: p["decode_steps"])["version"]

    def to_dict(self) -> dict:
        return asdict(self)


class Replayer:
    """Sends prompts through ``/v1/chat/completions`` with ``concurrency`` requests in flight."""

    def __init__(self, base_url: str, model: str, *, concurrency: int, max_tokens: int,
                 temperature: float = 0.0, clock: Callable[[], float], timeout_s: float = 600.0,
                 server: str = "spec", baseline: Replayer | None = None, baseline_every: int = 2):
        import openai

        if baseline_every < 1:
            raise ValueError(f"baseline_every must be >= 1, got {baseline_every}")
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=timeout_s)
        self.model, self.concurrency, self.max_tokens = model, concurrency, max_tokens
        self.temperature, self.clock, self.server = temperature, clock, server
        self.baseline, self.baseline_every = baseline, baseline_every

    def ask(self, prompt: Prompt, phase: str, max_tokens: int | None = None,
            token_ids: bool = False) -> tuple[Answer, list[int] | None]:
        t0 = self.clock()
        try:
            extra = {"metadata": {"domain": prompt.domain}}
            if token_ids:
                extra["return_token_ids"] = True
            out = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": prompt.text}],
                max_tokens=max_tokens or self.max_tokens, temperature=self.temperature,
                extra_body=extra)
        except Exception as e:  # every failure is counted: the loop's goal is zero
            return Answer(prompt.id, phase, prompt.domain, t0, self.clock(), False,
                          f"{type(e).__name__}: {e}", server=self.server), None
        body = out.model_dump()
        spec = body.get("adaflash") or {}
        ids = body["choices"][0].get("token_ids") if token_ids else None
        return Answer(prompt.id, phase, prompt.domain, t0, self.clock(), True,
                      completion_tokens=out.usage.completion_tokens if out.usage else 0,
                      fingerprint=out.system_fingerprint,
                      by_version=list(spec.get("by_version") or []), server=self.server), ids

    def run(self, prompts: Iterator[Prompt], phase: str, *, until: Callable[[], bool] | None = None,
            on_answer: Callable[[Answer], None] | None = None) -> list[Answer]:
        """Closed loop: each worker sends its next prompt when its answer arrives, until the
        prompts run out or ``until()`` says stop (asked before each request)."""
        lock = threading.Lock()
        answers: list[Answer] = []
        errors: list[BaseException] = []
        sent: dict[str, int] = {}  # answers per domain: each domain gets its own plain baseline

        def next_prompt() -> Prompt | None:
            with lock:
                if errors or (until is not None and until()):
                    return None
                return next(prompts, None)

        def worker() -> None:
            try:
                while (p := next_prompt()) is not None:
                    a, _ = self.ask(p, phase)
                    with lock:
                        answers.append(a)
                        n = sent[p.domain] = sent.get(p.domain, 0) + 1
                        pair_it = self.baseline is not None and n % self.baseline_every == 1 % self.baseline_every
                    if on_answer is not None:
                        on_answer(a)
                    if pair_it and a.ok:  # the same prompt through plain decoding, before the next one
                        b, _ = self.baseline.ask(p, phase)
                        with lock:
                            answers.append(b)
                        if on_answer is not None:
                            on_answer(b)
            except BaseException as e:  # a bug in the demo itself: stop every worker, re-raise
                with lock:
                    errors.append(e)

        threads = [threading.Thread(target=worker, name=f"demo-client-{i}", daemon=True)
                   for i in range(self.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return answers


class Poller:
    """``GET /ready`` every ``interval_s`` in a thread: (t, steps, version, running, waiting)."""

    def __init__(self, base_url: str, clock: Callable[[], float], interval_s: float = 0.5):
        self.url = base_url + "/ready"
        self.clock, self.interval_s = clock, interval_s
        self.samples: list[dict] = []
        self.failures = 0
        self.last: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-poller", daemon=True)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self._stop.is_set():
                try:
                    r = http.get(self.url)
                    state = r.json()
                    ok = r.status_code == 200
                except (httpx.HTTPError, ValueError):
                    ok, state = False, {}
                if ok:
                    self.last = state
                    self.samples.append({"t": self.clock(), "steps": state.get("steps"),
                                         "version": state.get("drafter_version"),
                                         "running": state.get("running"),
                                         "waiting": state.get("waiting")})
                else:
                    self.failures += 1
                self._stop.wait(self.interval_s)

    def version(self) -> str | None:
        return self.last.get("drafter_version")
