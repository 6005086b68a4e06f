"""What goes into the engine and what comes out, with the per-request statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.sampling import SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    domain: str | None = None


@dataclass
class RequestStats:
    """Speculation statistics of one request (prefill's first token is not a step)."""

    block_size: int
    # tau of every decode step (committed tokens per step)
    accept_lens: list[int] = field(default_factory=list)
    # [B-1] how often proposal k (1-based position k) was accepted
    accepted_by_position: list[int] = field(default_factory=list)
    # target tokens verified over all steps (sum of verify lengths)
    verified_tokens: int = 0
    # verify length chosen at every step
    verify_lens: list[int] = field(default_factory=list)
    # predicted E[tau | L] / B at every step (adaflash only): the calibrated head's expectation
    # for the verify length chosen, 1/B on a step the request was not drafted
    predicted_ratios: list[float] = field(default_factory=list)
    # whether the drafter ran for this request at every step (adaflash only)
    drafted: list[bool] = field(default_factory=list)
    # the raw length head's E[tau] / B on every drafted step (adaflash only)
    head_ratios: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_by_position:
            self.accepted_by_position = [0] * max(self.block_size - 1, 0)

    @property
    def steps(self) -> int:
        return len(self.accept_lens)

    @property
    def committed_tokens(self) -> int:
        return sum(self.accept_lens)

    @property
    def tau(self) -> float:
        return self.committed_tokens / self.steps if self.steps else 0.0

    def record(self, verify_len: int, num_accepted: int) -> None:
        self.verify_lens.append(verify_len)
        self.verified_tokens += verify_len
        self.accept_lens.append(num_accepted + 1)
        for k in range(num_accepted):
            self.accepted_by_position[k] += 1

    def to_dict(self) -> dict:
        return {
            "tau": self.tau,
            "steps": self.steps,
            "committed_tokens": self.committed_tokens,
            "verified_tokens": self.verified_tokens,
            "accept_lens": self.accept_lens,
            "accepted_by_position": self.accepted_by_position,
            "verify_lens": self.verify_lens,
        }


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" | "length" | "error" | "abort" (SpecEngine.abort)
    stats: RequestStats
    error: str | None = None
    domain: str | None = None
    # finish_reason "error" because the engine failed on this request (engine.admission), not
    # because its input was refused: a server answers 500 rather than 400
    fault: bool = False

    @property
    def ok(self) -> bool:
        return self.finish_reason != "error"
