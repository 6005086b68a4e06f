"""Prompt files (JSONL) and turning prompts into engine requests.

One JSON object per line:

    {"prompt": "text"}                      tokenized with the target's tokenizer (chat format
                                            applied when the tokenizer carries a chat template)
    {"prompt_ids": [1, 4, 87, ...]}         used as is
    optional: "id", "domain", "max_new_tokens"; other keys are ignored

A line that cannot be read becomes a prompt with an error (naming the file and line number): it
fails alone, the other lines are still served. A file that cannot be opened is a CLIError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class CLIError(Exception):
    """A problem with the command line or its inputs; printed as one line, exit code 2."""


@dataclass
class PromptSpec:
    id: str
    text: str | None = None
    prompt_ids: list[int] | None = None
    max_new_tokens: int | None = None
    domain: str | None = None
    error: str | None = None  # set when the line itself is unusable
    where: str = ""  # "file:line" for messages


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_prompt_record(obj, where: str, default_id: str) -> PromptSpec:
    """One decoded JSON value -> PromptSpec (with .error set when it is unusable)."""
    spec = PromptSpec(id=default_id, where=where)
    if not isinstance(obj, dict):
        spec.error = f"{where}: expected a JSON object with 'prompt' or 'prompt_ids', found {type(obj).__name__}"
        return spec
    if "id" in obj and obj["id"] is not None:
        spec.id = str(obj["id"])
    domain = obj.get("domain")
    if domain is not None and not isinstance(domain, str):
        spec.error = f"{where}: 'domain' must be a string, found {domain!r}"
        return spec
    spec.domain = domain
    has_text, has_ids = "prompt" in obj, "prompt_ids" in obj
    if has_text == has_ids:
        spec.error = f"{where}: give exactly one of 'prompt' (text) or 'prompt_ids' (token ids)"
        return spec
    if has_text:
        if not isinstance(obj["prompt"], str):
            spec.error = f"{where}: 'prompt' must be a string, found {type(obj['prompt']).__name__}"
            return spec
        spec.text = obj["prompt"]
    else:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            spec.error = f"{where}: 'prompt_ids' must be a list of integer token ids"
            return spec
        spec.prompt_ids = list(ids)
    if "max_new_tokens" in obj and obj["max_new_tokens"] is not None:
        n = obj["max_new_tokens"]
        if not _is_int(n) or n < 1:
            spec.error = f"{where}: 'max_new_tokens' must be an integer >= 1, found {n!r}"
            return spec
        spec.max_new_tokens = n
    return spec


def read_prompts(paths: str | Path | list) -> list[PromptSpec]:
    """Read one or more JSONL prompt files. Blank lines are skipped."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    specs: list[PromptSpec] = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise CLIError(f"prompt file {path} does not exist (or is not a file)")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"cannot read prompt file {path}: {e}") from None
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            default_id = f"{path.stem}:{lineno}" if len(paths) > 1 else str(lineno)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                specs.append(PromptSpec(id=default_id, where=where, error=f"{where}: invalid JSON ({e.msg} at column {e.colno})"))
                continue
            specs.append(parse_prompt_record(obj, where, default_id))
    if not specs:
        raise CLIError(f"no prompts in {', '.join(map(str, paths))}: the file(s) hold no JSON lines")
    return specs


def encode_prompt(tokenizer, text: str, use_chat_template: bool = True) -> list[int]:
    """Text -> token ids: the chat format when the tokenizer has a template, else plain text."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    else:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return [int(t) for t in ids]


def resolve_prompt_ids(spec: PromptSpec, tokenizer, use_chat_template: bool = True) -> list[int]:
    """The token ids of a prompt; raises ValueError with a message fit for the user."""
    if spec.error:
        raise ValueError(spec.error)
    if spec.prompt_ids is not None:
        return spec.prompt_ids
    if tokenizer is None:
        raise ValueError(
            f"{spec.where or spec.id}: text prompt but the target directory has no tokenizer; "
            "add tokenizer files to the target directory or send 'prompt_ids'"
        )
    return encode_prompt(tokenizer, spec.text, use_chat_template)
