"""Prompt files (JSONL) and turning prompts into engine requests.

One JSON object per line:

    {"prompt": "text"}                      tokenized with the target's tokenizer (chat format
                                            applied when the tokenizer carries a chat template)
    {"prompt_ids": [1, 4, 87, ...]}         used as is
    optional: "id" (a string or an integer), "domain", "max_new_tokens"; other keys are ignored

A line that cannot be read becomes a prompt with an error (naming the file and line number): it
fails alone, the other lines are still served. That covers bytes that are not UTF-8, text or ids
holding lone surrogates (JSON escapes such as "\\ud800", which no tokenizer or printer accepts),
and empty prompts. A file that cannot be opened is a CLIError.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import CLIError

__all__ = ["CLIError", "PromptSpec", "encode_prompt", "parse_prompt_record", "printable_path",
           "read_prompts", "resolve_prompt_ids", "unicode_problem"]


@dataclass
class PromptSpec:
    id: str
    text: str | None = None
    prompt_ids: list[int] | None = None
    max_new_tokens: int | None = None
    domain: str | None = None
    error: str | None = None  # set when the line itself is unusable
    where: str = ""  # "file:line" for messages


_JSON_TYPES = {dict: "object", list: "array", bool: "boolean"}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def unicode_problem(text: str, from_bytes: bool = False) -> str | None:
    """Why `text` cannot be encoded as UTF-8 (a lone surrogate), or None when it can.

    Lone surrogates come from JSON escapes ("\\ud800") or from command-line bytes that are not
    UTF-8 (Python maps byte 0xNN to U+DCNN); tokenizers reject them and printing them fails, so
    they are caught where the text comes in. `from_bytes` names U+DC80..U+DCFF as the bytes they
    stand for.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if from_bytes and 0xDC80 <= code <= 0xDCFF else f"lone surrogate \\u{code:04x}"
        return f"{what} at character {e.start + 1}"
    return None


def printable_path(path) -> str:
    """A path as text that prints anywhere (file names that are not UTF-8 come out escaped)."""
    return str(path).encode("utf-8", "backslashreplace").decode("utf-8")


def parse_prompt_record(obj, where: str, default_id: str) -> PromptSpec:
    """One decoded JSON value -> PromptSpec (with .error set when it is unusable)."""
    spec = PromptSpec(id=default_id, where=where)
    if not isinstance(obj, dict):
        spec.error = f"{where}: expected a JSON object with 'prompt' or 'prompt_ids', found {type(obj).__name__}"
        return spec
    if "id" in obj and obj["id"] is not None:
        raw_id = obj["id"]
        if not (isinstance(raw_id, str) or _is_int(raw_id)):  # str() would print a Python repr
            found = f"number {raw_id!r}" if isinstance(raw_id, float) else _JSON_TYPES.get(type(raw_id), "value")
            spec.error = f"{where}: 'id' must be a string or an integer, found {found}"
            return spec
        user_id = str(raw_id)
        bad = unicode_problem(user_id)
        if bad:  # refused rather than mangled: the record keeps the line's default id
            spec.error = f"{where}: 'id' is not valid Unicode text ({bad})"
            return spec
        spec.id = user_id
    domain = obj.get("domain")
    if domain is not None and not isinstance(domain, str):
        spec.error = f"{where}: 'domain' must be a string, found {domain!r}"
        return spec
    bad = unicode_problem(domain) if domain is not None else None
    if bad:
        spec.error = f"{where}: 'domain' is not valid Unicode text ({bad})"
        return spec
    spec.domain = domain
    has_text, has_ids = "prompt" in obj, "prompt_ids" in obj
    if has_text == has_ids:
        spec.error = f"{where}: give exactly one of 'prompt' (text) or 'prompt_ids' (token ids)"
        return spec
    if has_text:
        text = obj["prompt"]
        if not isinstance(text, str):
            spec.error = f"{where}: 'prompt' must be a string, found {type(text).__name__}"
            return spec
        if not text:
            spec.error = f"{where}: 'prompt' is empty: send some text"
            return spec
        bad = unicode_problem(text)
        if bad:
            spec.error = f"{where}: 'prompt' is not valid Unicode text ({bad})"
            return spec
        spec.text = text
    else:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            spec.error = f"{where}: 'prompt_ids' must be a list of integer token ids"
            return spec
        if not ids:
            spec.error = f"{where}: 'prompt_ids' is empty: send at least one token"
            return spec
        spec.prompt_ids = list(ids)
    if "max_new_tokens" in obj and obj["max_new_tokens"] is not None:
        n = obj["max_new_tokens"]
        if not _is_int(n) or n < 1:
            spec.error = f"{where}: 'max_new_tokens' must be an integer >= 1, found {n!r}"
            return spec
        spec.max_new_tokens = n
    return spec


# the line breaks a JSON text cannot hold inside a string; str.splitlines() would also split at
# U+2028, U+0085 and others, which are legal raw inside JSON strings
_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def read_prompts(paths: str | Path | list) -> list[PromptSpec]:
    """Read one or more JSONL prompt files. Blank lines are skipped.

    Lines are decoded one by one, so bytes that are not UTF-8 fail their own line only.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    specs: list[PromptSpec] = []
    for path in paths:
        path = Path(path)
        shown = printable_path(path)
        if not path.is_file():
            raise CLIError(f"prompt file {shown} does not exist (or is not a file)")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CLIError(f"cannot read prompt file {shown}: {e.strerror or e}") from None
        if data.startswith(codecs.BOM_UTF8):
            data = data[len(codecs.BOM_UTF8):]
        stem = printable_path(path.stem)
        for lineno, raw in enumerate(_LINE_BREAK.split(data), start=1):
            where = f"{shown}:{lineno}"
            default_id = f"{stem}:{lineno}" if len(paths) > 1 else str(lineno)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                specs.append(PromptSpec(id=default_id, where=where, error=(
                    f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line); "
                    "save the file as UTF-8")))
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                specs.append(PromptSpec(id=default_id, where=where, error=f"{where}: invalid JSON ({e.msg} at column {e.colno})"))
                continue
            specs.append(parse_prompt_record(obj, where, default_id))
    if not specs:
        raise CLIError(f"no prompts in {', '.join(map(printable_path, paths))}: the file(s) hold no JSON lines")
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
    where = spec.where or spec.id
    if tokenizer is None:
        raise ValueError(
            f"{where}: text prompt but the target directory has no tokenizer; "
            "add tokenizer files to the target directory or send 'prompt_ids'"
        )
    if not spec.text:
        raise ValueError(f"{where}: prompt is empty: send some text")
    try:
        ids = encode_prompt(tokenizer, spec.text, use_chat_template)
    except Exception as e:  # tokenizers raise TypeError, ValueError, Rust panics...: this prompt alone fails
        raise ValueError(f"{where}: the tokenizer cannot encode this prompt ({' '.join(str(e).split()) or type(e).__name__})") from None
    if not ids:
        raise ValueError(f"{where}: prompt is empty after tokenization")
    return ids
