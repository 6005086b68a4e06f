"""The OpenAI wire format `adaflash serve` speaks: request models, response bodies, error bodies.

Requests are parsed by pydantic so that every malformed field becomes one 400 with an
OpenAI-style error naming the field, instead of a 422 in FastAPI's own shape that OpenAI clients
do not understand. Fields the OpenAI API defines but this server cannot honour (``n > 1``,
``logprobs``, penalties, tools, ...) are refused by name rather than silently ignored, because a
client that asked for them would otherwise get answers it did not ask for. Unknown fields are
ignored, as OpenAI-compatible servers commonly do, so newer clients keep working.

Responses are plain dicts built here, in the shapes the official client parses; the response
models below document and test those shapes without paying pydantic on every streamed chunk.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..launch.prompts import unicode_problem
from ..validation import parse_flag

#: Longest domain tag accepted (it becomes a metric label and a traffic record field).
MAX_DOMAIN_CHARS = 128
#: Most stop strings one request may carry (OpenAI allows 4; a few more cost nothing here).
MAX_STOPS = 16
#: The per-request traffic opt-out header (the SGLang plugin honours the same one).
NO_LOG_HEADER = "x-adaflash-no-log"


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def check_text(text: str, param: str) -> None:
    """400 for text that holds a lone surrogate (a JSON escape such as "\\ud800"): no tokenizer,
    metric label or traffic record can take it, and the client should hear which field it was."""
    bad = unicode_problem(text)
    if bad:
        raise bad_request(f"{param} is not valid Unicode text ({bad}); send UTF-8 text", param)


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by adaflash serve", "invalid_request_error",
                    param, "unsupported_parameter")


# -- requests ---------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    # null means the default: OpenAI's temperature 1 (0 decodes greedily, and is what makes
    # outputs equal plain decoding token for token), top_p 1, no top-k.
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # -1 and 0 both mean no top-k (vLLM and SGLang clients send -1); so does any value at or
    # beyond the vocabulary (recorded as 0: SamplingParams.canonical).
    top_k: int | None = Field(None, ge=-1)
    stop: str | list[str] | None = None
    # a sampled request with a seed draws from its own generator (docs/serving.md)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    metadata: dict[str, Any] | None = None
    user: str | None = None
    # Extensions (extra_body in the official client).
    ignore_eos: bool = False
    return_token_ids: bool = False
    # Refused when set to anything but their neutral value.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    def sampling_values(self) -> tuple[float, float, int]:
        """(temperature, top_p, top_k) with the defaults filled in."""
        t = 1.0 if self.temperature is None else float(self.temperature)
        p = 1.0 if self.top_p is None else float(self.top_p)
        return t, p, max(self.top_k or 0, 0)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        for s in stops:
            bad = unicode_problem(s)
            if bad:  # it could never match decoded text
                raise ValueError(f"stop strings must be valid Unicode text ({bad})")
        return stops

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise unsupported("n", "n other than 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise unsupported(name, name)
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias")

    def domain(self, header: str | None) -> str | None:
        """The request's domain tag: ``metadata.domain``, else the ``x-adaflash-domain`` header."""
        value = (self.metadata or {}).get("domain")
        if value is None:
            value = header
        if value is None or value == "":
            return None
        if not isinstance(value, str) or len(value) > MAX_DOMAIN_CHARS:
            raise bad_request(f"metadata.domain must be a string of at most {MAX_DOMAIN_CHARS} "
                              "characters", "metadata.domain")
        # it becomes a metric label and a record field: both must be writable as UTF-8
        check_text(value, "metadata.domain")
        return value

    def no_log(self, header: str | None) -> bool:
        """The per-request traffic opt-out: ``metadata.adaflash_no_log`` or ``x-adaflash-no-log``.

        Either one set to a "yes" spelling opts out (sglang_adaflash.validation: true, 1, yes,
        on, in any case); a value that is no documented spelling is a 400, not a silent "log it".
        """
        found = False
        for value, param in (((self.metadata or {}).get("adaflash_no_log"), "metadata.adaflash_no_log"),
                             (header, NO_LOG_HEADER)):
            try:
                found = parse_flag(value, param) or found
            except ValueError as e:
                raise bad_request(str(e), param) from None
        return found

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise unsupported("echo", "echo")
        if self.logprobs:
            raise unsupported("logprobs", "logprobs")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "best_of other than 1")
        if self.suffix:
            raise unsupported("suffix", "suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a list of one prompt is unwrapped)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise unsupported("prompt", "more than one prompt per request")
            p = p[0]
        if isinstance(p, list) and (not p or isinstance(p[0], int)):
            return list(p)
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise unsupported("messages", f"content parts of type {part.type!r}")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise unsupported("logprobs", "logprobs")
        if self.tools:
            raise unsupported("tools", "tool calling")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise unsupported("response_format", "response_format other than text")

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """Messages for the tokenizer's chat template (``developer`` is a system message)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


def parse(model: type[BaseModel], body: Any) -> Any:
    """``model.model_validate(body)``, with a ValidationError turned into one 400."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ())) or None
        more = f" (and {e.error_count() - 1} more problems)" if e.error_count() > 1 else ""
        raise bad_request(f"{param}: {first.get('msg')}{more}" if param else str(first.get("msg")),
                          param) from None


# -- responses --------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    """``/v1/completions`` (and, with ``object: text_completion`` chunks, its stream)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatChoice(BaseModel):
    index: int
    message: dict[str, Any]
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculation(by_version: dict[str, list[int]]) -> dict[str, Any]:
    """The ``adaflash`` extension object of a response: how this request was decoded.

    Live tau per domain and per drafter version is what the closed loop watches rise; the
    Prometheus counters give it per domain only, and a request that spans a hot reload was
    served by two versions, so each version's share comes with the answer.
    ``decode_steps`` counts steps (prefill's first token is not one), ``committed_tokens`` the
    tokens committed in them (accepted proposals plus the bonus), so tau = committed / steps.
    """
    versions = {v or None: (steps, tokens) for v, (steps, tokens) in by_version.items() if steps}
    steps = sum(s for s, _ in versions.values())
    tokens = sum(t for _, t in versions.values())
    return {"decode_steps": steps, "committed_tokens": tokens,
            "tau": tokens / steps if steps else None,
            "by_version": [{"version": v, "decode_steps": s, "committed_tokens": t}
                           for v, (s, t) in versions.items()]}


class ResponseBuilder:
    """Bodies of one request, in the endpoint's shape (``chat`` or text completions)."""

    def __init__(self, chat: bool, model: str, request_id: str, fingerprint: str | None):
        self.chat, self.model, self.id, self.fingerprint = chat, model, request_id, fingerprint
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def full(self, text: str, finish: str, prompt_tokens: int, output_ids: list[int],
             token_ids: bool, spec: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = self._head("text_completion")
        if token_ids:
            choice["token_ids"] = list(output_ids)
        body["choices"] = [choice]
        body["usage"] = usage(prompt_tokens, len(output_ids))
        if spec is not None:
            body["adaflash"] = spec
        return body

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = self._head("text_completion")
        body["choices"] = [choice]
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                    spec: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens)
        if spec is not None:
            body["adaflash"] = spec
        return body
