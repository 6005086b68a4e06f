"""`adaflash generate`: serve prompts with the reference engine and print each result as it finishes.

Records are printed in finish order, one per prompt, each flushed as soon as its request is done:
a run that is killed keeps every record printed before, and one stopped with Ctrl-C (SIGINT)
says on stderr how many prompts were left unfinished and exits with 130. Prompts refused before
decoding (unreadable lines, ids outside the vocabulary, ...) come first. Every record carries the
prompt's `id` and its `index` (0-based position among the prompts), so the order of the output
never matters for matching results to prompts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..core.sampling import RequestError, SamplingParams
from ..d2sd.cli import attach_recovery, options_from_args
from ..engine.request import Request, RequestOutput, RequestStats
from ..launch.engine_factory import check_batch_size, check_seed, make_engine, quiet_transformers
from ..launch.loading import LoadedPair, load_pair
from ..launch.prompts import CLIError, PromptSpec, read_prompts, resolve_prompt_ids, unicode_problem
from .traffic_sink import open_sink


@dataclass
class PreparedRequests:
    """Engine requests plus the prompts that failed before reaching the engine."""

    specs: list[PromptSpec]
    # index into specs -> engine request (only for prompts that could be tokenized)
    requests: dict[int, Request] = field(default_factory=dict)
    # index into specs -> error message
    errors: dict[int, str] = field(default_factory=dict)
    # set by iter_prepared when the engine failed in a way no request can be blamed for
    engine_failure: str | None = None

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
    limit = getattr(pair.target.config, "max_position_embeddings", None)
    for i, spec in enumerate(specs):
        try:
            ids = resolve_prompt_ids(spec, pair.tokenizer, use_chat_template)
        except ValueError as e:
            prep.errors[i] = str(e)
            continue
        n = spec.max_new_tokens or max_new_tokens
        if limit and len(ids) + n > limit:
            # refused here, so one line's huge max_new_tokens cannot size every request's cache
            prep.errors[i] = (f"{spec.where or spec.id}: prompt of {len(ids)} tokens plus max_new_tokens {n} "
                              f"exceeds the target's {limit} positions; shorten the prompt or lower max_new_tokens")
            continue
        sampling = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=n,
            stop_token_ids=stops,
        ).canonical(pair.target.vocab_size)  # as the traffic sink records it: what the engine does
        # engine ids are positional: user ids may repeat across lines
        prep.requests[i] = Request(ids, sampling, request_id=f"r{i}", domain=spec.domain)
    return prep


def iter_prepared(engine, prep: PreparedRequests, progress=None) -> Iterator[tuple[int, RequestOutput]]:
    """(prompt index, output) for every prompt, as each becomes final.

    Prompts that failed before the engine come first, in prompt order; then the engine's
    refusals and finished requests in the order the engine produces them. A request the engine
    fails on alone (engine.admission) is one error record among the others. When a step fails in
    a way no request can be blamed for, the engine stops: every request not finished yet gets an
    error record saying so, and ``prep.engine_failure`` says why.
    """
    block = getattr(engine, "block_size", 1)
    for i in sorted(prep.errors):
        if progress is not None:
            progress.update(1)
        yield i, RequestOutput(f"r{i}", [], [], "error", RequestStats(block), prep.errors[i], prep.specs[i].domain)
    order = sorted(prep.requests)
    if not order:
        return
    index = {prep.requests[i].request_id: i for i in order}
    done: set[int] = set()
    try:
        for out in engine.run_iter([prep.requests[i] for i in order], progress=progress):
            done.add(index[out.request_id])
            yield index[out.request_id], out
    except Exception as e:  # the engine's state is unknown: what finished stays, the rest fails
        prep.engine_failure = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        message = f"the engine failed ({prep.engine_failure}) before this request finished"
        for i in order:
            if i not in done:
                req = prep.requests[i]
                yield i, RequestOutput(req.request_id, list(req.prompt_ids), [], "error", RequestStats(block),
                                       message, req.domain, fault=True)


def decode(tokenizer, ids: list[int]) -> str | None:
    if tokenizer is None:
        return None
    return tokenizer.decode(ids, skip_special_tokens=True)


def output_record(index: int, spec: PromptSpec, out: RequestOutput, tokenizer) -> dict:
    s = out.stats
    error = out.error
    if error and spec.where and not error.startswith(spec.where):
        error = f"{spec.where}: {error}"  # engine refusals name the JSONL line too
    return {
        "id": spec.id,
        "index": index,
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


def _check_flags(args) -> None:
    """Everything that can be told wrong before a model is loaded."""
    check_batch_size(args.max_batch_size)
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:  # the shared sampling settings are checked once
        SamplingParams(args.temperature, args.top_k, args.top_p, args.max_new_tokens).validate(vocab_size=1)
    except RequestError as e:
        raise CLIError(str(e).replace("top_k", "--top-k").replace("top_p", "--top-p").replace("temperature", "--temperature")) from None
    check_seed(args.seed)
    if args.prompt is not None:
        bad = unicode_problem(args.prompt, from_bytes=True)
        if bad:
            raise CLIError(f"--prompt is not valid UTF-8 text ({bad}); pass UTF-8 text, or use --prompts FILE.jsonl")
        if not args.prompt:
            raise CLIError("--prompt is empty: give some text")


def cmd_generate(args) -> int:
    from tqdm import tqdm

    _check_flags(args)
    if args.prompt is not None:
        specs = [PromptSpec(id="0", text=args.prompt, where="--prompt")]
    else:
        specs = read_prompts(args.prompts)
    torch.manual_seed(args.seed)
    quiet_transformers()
    d2sd = options_from_args(args, [args.mode])
    pair = load_pair(args.target, args.drafter, dtype=args.dtype, device=args.device, need_drafter=args.mode != "ar")
    attach_recovery(pair, d2sd)
    limit = getattr(pair.target.config, "max_position_embeddings", None)
    if limit and args.max_new_tokens >= limit:
        raise CLIError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the target's {limit} positions")
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
    engine = make_engine(pair, args.mode, args.max_batch_size, prep.max_seq_len, args.seed,
                         num_requests=len(prep.requests))
    show = not args.quiet and len(specs) > 1
    printer = RecordPrinter(as_json=args.json)
    sink = open_sink(args, args.mode)  # --traffic-dir: what was served, for adaflash distill
    try:
        with tqdm(total=len(specs), desc=f"generate [{args.mode}]", unit="req", disable=not show, file=sys.stderr) as bar:
            for i, out in iter_prepared(engine, prep, progress=bar):
                printer.emit(output_record(i, specs[i], out, pair.tokenizer))
                if sink is not None and i in prep.requests:
                    sink.write(out, prep.requests[i].sampling, pair.tokenizer, request_id=specs[i].id)
    except KeyboardInterrupt:
        print(f"adaflash generate: interrupted: {len(specs) - printer.printed} of {len(specs)} request(s) unfinished; "
              f"the {printer.printed} finished are printed above", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing more can be delivered
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush is quiet too
        print(f"adaflash generate: stdout was closed after {printer.printed} record(s); stopped", file=sys.stderr)
        return 141
    finally:
        if sink is not None:
            sink.close()
    if prep.engine_failure:
        print(f"adaflash generate: the engine failed ({prep.engine_failure}); the requests it had not "
              "finished are error records", file=sys.stderr)
    if printer.failed:
        print(f"adaflash: {printer.failed} of {len(specs)} request(s) failed", file=sys.stderr)
    return 1 if printer.failed else 0


class RecordPrinter:
    """Writes whole records to stdout, flushed one by one, and counts them."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.printed = 0
        self.failed = 0

    def emit(self, rec: dict) -> None:
        """A Ctrl-C that comes while a record is written and counted takes effect right after: it
        lands between records, so every record printed is whole and the unfinished count exact."""
        with _sigint_deferred():
            try:
                sys.stdout.write(_render(rec, self.as_json, ascii_only=False))
            except UnicodeEncodeError:  # a stdout that cannot encode the text: escape, never drop it
                sys.stdout.write(_render(rec, self.as_json, ascii_only=True))
            sys.stdout.flush()
            self.printed += 1
            self.failed += rec["error"] is not None


@contextmanager
def _sigint_deferred():
    # A handler, not a signal mask: masks are per thread, and torch's threads would take the signal.
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def _render(rec: dict, as_json: bool, ascii_only: bool) -> str:
    if as_json:
        return json.dumps(rec, ensure_ascii=ascii_only) + "\n"
    text = _human(rec)
    return text.encode("ascii", "backslashreplace").decode("ascii") if ascii_only else text


def _human(rec: dict) -> str:
    head = f"=== {rec['id']}" + (f" [{rec['domain']}]" if rec["domain"] else "")
    if rec["error"]:
        return f"{head}  ERROR: {rec['error']}\n"
    n = len(rec["output_ids"])
    body = rec["text"] if rec["text"] is not None else rec["output_ids"]
    return f"{head}  {n} tokens, {rec['steps']} steps, tau {rec['tau']:.2f}, finish {rec['finish_reason']}\n{body}\n"
