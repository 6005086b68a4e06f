"""`adaflash generate`: serve prompts with the reference engine and print the results."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import torch

from ..engine.request import Request, RequestOutput, RequestStats
from ..engine.sampling import RequestError, SamplingParams
from .loading import LoadedPair, load_pair
from .prompts import CLIError, PromptSpec, read_prompts, resolve_prompt_ids


@dataclass
class PreparedRequests:
    """Engine requests plus the prompts that failed before reaching the engine."""

    specs: list[PromptSpec]
    # index into specs -> engine request (only for prompts that could be tokenized)
    requests: dict[int, Request] = field(default_factory=dict)
    # index into specs -> error message
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def max_seq_len(self) -> int:
        lens = [len(r.prompt_ids) + r.sampling.max_new_tokens for r in self.requests.values() if r.prompt_ids]
        return max(lens, default=16)


def prepare_requests(
    specs: list[PromptSpec],
    pair: LoadedPair,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_new_tokens: int = 64,
    ignore_eos: bool = False,
    use_chat_template: bool = True,
) -> PreparedRequests:
    prep = PreparedRequests(specs)
    stops = () if ignore_eos else pair.stop_token_ids
    for i, spec in enumerate(specs):
        try:
            ids = resolve_prompt_ids(spec, pair.tokenizer, use_chat_template)
        except ValueError as e:
            prep.errors[i] = str(e)
            continue
        sampling = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=spec.max_new_tokens or max_new_tokens,
            stop_token_ids=stops,
        )
        # engine ids are positional: user ids may repeat across lines
        prep.requests[i] = Request(ids, sampling, request_id=f"r{i}", domain=spec.domain)
    return prep


def run_prepared(engine, prep: PreparedRequests, progress=None) -> list[RequestOutput]:
    """Outputs in prompt order; prompts that failed early get an error output of their own."""
    order = sorted(prep.requests)
    outs = engine.run([prep.requests[i] for i in order], progress=progress)
    by_index = dict(zip(order, outs))
    block = getattr(engine, "block_size", 1)
    result = []
    for i, spec in enumerate(prep.specs):
        if i in by_index:
            result.append(by_index[i])
        else:
            result.append(RequestOutput(f"r{i}", [], [], "error", RequestStats(block), prep.errors[i], spec.domain))
    return result


def decode(tokenizer, ids: list[int]) -> str | None:
    if tokenizer is None:
        return None
    return tokenizer.decode(ids, skip_special_tokens=True)


def output_record(spec: PromptSpec, out: RequestOutput, tokenizer) -> dict:
    s = out.stats
    error = out.error
    if error and spec.where and not error.startswith(spec.where):
        error = f"{spec.where}: {error}"  # engine refusals name the JSONL line too
    return {
        "id": spec.id,
        "domain": spec.domain,
        "prompt_tokens": len(out.prompt_ids),
        "output_ids": list(out.output_ids),
        "text": decode(tokenizer, out.output_ids) if out.ok else None,
        "accept_lens": list(s.accept_lens),
        "verify_lens": list(s.verify_lens),
        "tau": s.tau,
        "steps": s.steps,
        "finish_reason": out.finish_reason,
        "error": error,
    }


def make_engine(pair: LoadedPair, mode: str, max_batch_size: int, max_seq_len: int, seed: int):
    from ..engine.engine import SpecEngine

    limit = getattr(pair.target.config, "max_position_embeddings", None)
    if limit:
        max_seq_len = min(max_seq_len, int(limit))
    try:
        return SpecEngine(
            pair.target,
            pair.drafter if mode != "ar" else None,
            mode=mode,
            max_batch_size=max_batch_size,
            max_seq_len=max(max_seq_len, 2),
            seed=seed,
        )
    except ValueError as e:
        raise CLIError(" ".join(str(e).split())) from None


def quiet_transformers() -> None:
    """Our own progress bars only: hide transformers' weight-loading bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def cmd_generate(args) -> int:
    from tqdm import tqdm

    if args.max_batch_size < 1:
        raise CLIError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:  # the shared sampling settings are checked once, before any model is loaded
        SamplingParams(args.temperature, args.top_k, args.top_p, args.max_new_tokens).validate(vocab_size=1)
    except RequestError as e:
        raise CLIError(str(e).replace("top_k", "--top-k").replace("top_p", "--top-p").replace("temperature", "--temperature")) from None
    if args.prompt is not None:
        specs = [PromptSpec(id="0", text=args.prompt, where="--prompt")]
    else:
        specs = read_prompts(args.prompts)
    torch.manual_seed(args.seed)
    quiet_transformers()
    pair = load_pair(args.target, args.drafter, dtype=args.dtype, device=args.device, need_drafter=args.mode != "ar")
    prep = prepare_requests(
        specs,
        pair,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=args.ignore_eos,
        use_chat_template=not args.no_chat_template,
    )
    engine = make_engine(pair, args.mode, args.max_batch_size, prep.max_seq_len, args.seed)
    show = not args.quiet and len(prep.requests) > 1
    with tqdm(total=len(prep.requests), desc=f"generate [{args.mode}]", unit="req", disable=not show, file=sys.stderr) as bar:
        outs = run_prepared(engine, prep, progress=bar)
    records = [output_record(spec, out, pair.tokenizer) for spec, out in zip(specs, outs)]
    for rec in records:
        if args.json:
            print(json.dumps(rec, ensure_ascii=False))
        else:
            _print_human(rec)
    failed = sum(r["error"] is not None for r in records)
    if failed:
        print(f"adaflash: {failed} of {len(records)} request(s) failed", file=sys.stderr)
    return 1 if failed else 0


def _print_human(rec: dict) -> None:
    head = f"=== {rec['id']}" + (f" [{rec['domain']}]" if rec["domain"] else "")
    if rec["error"]:
        print(f"{head}  ERROR: {rec['error']}")
        return
    n = len(rec["output_ids"])
    print(f"{head}  {n} tokens, {rec['steps']} steps, tau {rec['tau']:.2f}, finish {rec['finish_reason']}")
    print(rec["text"] if rec["text"] is not None else rec["output_ids"])
