"""The `adaflash` command line: generate, bench, demo, serve.

Exit codes: 0 success; 1 some requests failed (generate), outputs differed from plain decoding
under --strict (bench) or the engine loop failed (serve); 2 bad arguments or inputs (one-line
message, no traceback).
"""

from __future__ import annotations

import argparse
import sys

from ..d2sd.cli import add_d2sd_args
from ..demo.plan import defaults
from ..errors import CLIError
from ..launch.engine_factory import model_dir_arg

MODES = ("ar", "dflash", "adaflash", "d2sd")
BENCH_MODES = ("hf",) + MODES
DEFAULT_BENCH_MODES = ("hf", "ar", "dflash", "adaflash")  # d2sd needs --recovery-drafter or --branch-drafter first
SERVE_MODES = ("ar", "dflash", "adaflash")  # the demo loop's serving modes (it does not run d2sd yet)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,8,32, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1 such as 1,8,32, got {text!r}")
    return values


def _mode_list(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in BENCH_MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"modes must be a comma-separated subset of {','.join(BENCH_MODES)}, got {text!r}")
    return list(dict.fromkeys(modes))


def _add_model_args(p: argparse.ArgumentParser, drafter_required: bool) -> None:
    p.add_argument("--target", required=True, metavar="DIR", type=model_dir_arg("target"),
                   help="Hugging Face target model directory, or `embedded` for the bundled target")
    p.add_argument("--drafter", required=drafter_required, metavar="DIR", type=model_dir_arg("drafter"),
                   help="DFlash drafter checkpoint directory, or `embedded` for the bundled drafter")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"),
                   help="run target and drafter in this dtype (default: the target's own)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the engine's sampler (default 0); the same seed gives the same sample in modes "
                   "ar and dflash; adaflash and d2sd choose verify lengths from measured step costs, so a "
                   "sample can differ (equally distributed)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-response tokens")
    p.add_argument("--no-chat-template", action="store_true",
                   help="tokenize text prompts as plain text even if the tokenizer has a chat template")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaflash", description="AdaFlash reference engine: generate, benchmark, demo.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,bench,demo,serve,distill,drafters}")

    g = sub.add_parser("generate", help="generate with the reference engine",
                       description="Generate with the reference engine (continuous batching, lossless speculative decoding).")
    _add_model_args(g, drafter_required=False)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="one text prompt")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help="JSONL, one object per line: 'prompt' (text) or 'prompt_ids'; optional 'id', 'domain', 'max_new_tokens'")
    g.add_argument("--mode", choices=MODES, default="adaflash", help="ar = plain decoding; dflash = whole block; adaflash = length head (default); "
                   "d2sd = draft trees with a recovery drafter (--recovery-drafter), or from the first drafter alone "
                        "(--branch-drafter first)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="per request, unless its JSONL line says otherwise (default 64)")
    g.add_argument("--max-batch-size", type=int, default=32, help="most requests decoded together, 1..4096 (default 32)")
    g.add_argument("--json", action="store_true", help="print one JSON object per request")
    add_d2sd_args(g)
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--traffic-dir", metavar="DIR",
                   help="also write each finished request as a traffic record into DIR, which must be "
                        "HOME/traffic/<writer>; `adaflash distill --home HOME` learns from it")

    b = sub.add_parser("bench", help="throughput benchmark against HF generate()",
                       description="Throughput of each mode at each concurrency, with speculation statistics.")
    _add_model_args(b, drafter_required=False)
    b.add_argument("--prompts", required=True, nargs="+", metavar="FILE.jsonl", help="JSONL prompt file(s)")
    b.add_argument("--concurrency", type=_int_list, default=[1, 8, 32, 64], help="comma-separated (default 1,8,32,64)")
    b.add_argument("--modes", type=_mode_list, default=list(DEFAULT_BENCH_MODES), help="comma-separated subset of hf,ar,dflash,adaflash,d2sd (default all but d2sd)")
    b.add_argument("--max-new-tokens", type=_positive_int, default=64, help="per request (default 64)")
    b.add_argument("--mixed-lengths", action="store_true",
                   help="give each request its own max_new_tokens, uniform in [max/8, max] (seeded)")
    b.add_argument("--num-prompts", type=_positive_int, default=None,
                   help="requests per concurrency level = max(waves x concurrency, this); prompts are cycled (default: the file's count)")
    b.add_argument("--waves", type=_positive_int, default=1,
                   help="submit at least WAVES x concurrency requests, so finished requests' slots get refilled (default 1)")
    b.add_argument("--repeats", type=_positive_int, default=1, help="timed runs per (mode, concurrency), interleaved; the median is reported")
    b.add_argument("--warm-up", choices=("short", "full"), default="short",
                   help="untimed run before the timed ones, per (mode, concurrency): short (2 requests of 4 "
                        "tokens, default; enough on a CPU) or full (the whole workload once; use it on a GPU, "
                        "where each batch shape's first pass is slow)")
    b.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads (default: torch's choice); 1 gives steadier numbers on a shared machine")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="sample every request at this temperature, hf included (default 0: greedy; the "
                        "T=0 equality check against ar runs only at 0)")
    b.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature (default 1)")
    add_d2sd_args(b)
    b.add_argument("--strict", action="store_true", help="exit 1 when a speculative mode's output differs from ar's at T=0")
    b.add_argument("--out", required=True, metavar="DIR", help="writes DIR/results.json and DIR/bench.png")
    b.add_argument("--quiet", action="store_true", help="no progress bars")

    d = sub.add_parser("demo", help="the closed learning loop on one machine (--static: the old benchmark table)",
                       description="The closed loop: `adaflash serve` and `adaflash distill --follow` on a "
                                   "temporary volume, code+prose traffic then a shift to math through the openai "
                                   "client, live tau per domain and drafter version, hot reloads, and a final "
                                   "T=0 check against plain decoding (docs/serving.md). With --static: a benchmark "
                                   "of the embedded pair on its held-out workloads (no server, no training).")
    d.add_argument("--static", action="store_true", help="the static benchmark table instead of the loop")
    d.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default ./adaflash-demo; with --static ./bench-demo)")
    d.add_argument("--concurrency", type=_int_list, default=None,
                   help="clients in flight (default 1: on two cores the distiller takes one, and one request "
                        "at a time is where speculation pays on a CPU; docs/serving.md); with --static "
                        "comma-separated levels (default 1,8,32)")
    d.add_argument("--max-new-tokens", type=_positive_int, default=None,
                   help=f"per request ({defaults('max_tokens')})")
    d.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"), default=None,
                   help="default: float32 on CPU (faster there than the shipped bf16), else the target's")
    d.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads (loop: per process, default 1)")
    d.add_argument("--quiet", action="store_true")
    loop = d.add_argument_group("the closed loop")
    loop.add_argument("--quick", action="store_true", help="about 3 minutes: smaller phases and one small round")
    loop.add_argument("--mode", choices=SERVE_MODES, default="adaflash",
                      help="serving mode (default adaflash, the product: the length head and the load-aware "
                           "rule choose what to verify; dflash verifies every drafted slot, so its live tau shows "
                           "all the drafter learned; see docs/serving.md)")
    loop.add_argument("--target", default="embedded", type=model_dir_arg("target"), metavar="DIR",
                      help="target directory (default: the embedded one)")
    loop.add_argument("--drafter", default="embedded", type=model_dir_arg("drafter"), metavar="DIR",
                      help="drafter published as v000001 (default: the embedded one)")
    loop.add_argument("--first-requests", type=_positive_int, default=None,
                      help=f"requests of the code+prose phase ({defaults('first_requests')})")
    loop.add_argument("--rounds", type=_positive_int, default=None,
                      help=f"distillation rounds after which the follower stops ({defaults('rounds')})")
    loop.add_argument("--min-records", type=_positive_int, default=None,
                      help=f"new traffic records that start a round ({defaults('min_records')})")
    loop.add_argument("--max-records", type=_positive_int, default=None,
                      help=f"newest records a round trains on ({defaults('max_records')})")
    loop.add_argument("--epochs", type=_positive_int, default=None, help=f"passes over each round's records ({defaults('epochs')})")
    loop.add_argument("--lr", type=float, default=None,
                      help=f"the rounds' learning rate ({defaults('lr')}; the distillation job's own default is 3e-4)")
    loop.add_argument("--head-steps", type=int, default=None, help=f"length-head refit steps per round ({defaults('head_steps')})")
    loop.add_argument("--per-version", type=_positive_int, default=None,
                      help=f"math answers the final version serves before the end ({defaults('per_version')})")
    loop.add_argument("--replay", type=int, default=None,
                      help="first-phase prompts sent again after the last round, to show what the math rounds "
                           f"did to code and prose ({defaults('replay')}; 0: none)")
    loop.add_argument("--baseline-every", type=_positive_int, default=None,
                      help=f"every n-th prompt is answered by plain decoding too, right after ({defaults('baseline_every')})")
    loop.add_argument("--budget-s", type=float, default=None,
                      help=f"seconds of traffic at most, both phases ({defaults('budget_s')})")
    loop.add_argument("--check-prompts", type=_positive_int, default=None,
                      help=f"prompts of the final T=0 check ({defaults('check_prompts')})")
    loop.add_argument("--home", metavar="DIR", help="use (and keep) this volume instead of a temporary one")
    loop.add_argument("--keep-home", action="store_true", help="keep the temporary volume (its path is printed)")
    loop.add_argument("--start-timeout", type=float, default=300.0, help="seconds for each child to start")
    static = d.add_argument_group("--static only")
    static.add_argument("--modes", type=_mode_list, default=list(DEFAULT_BENCH_MODES))
    static.add_argument("--num-prompts", type=_positive_int, default=None)
    static.add_argument("--cache-dir", default=".cache", metavar="DIR",
                        help="where a tiny pair is built when the embedded one is missing")
    static.add_argument("--device", default="cpu")
    static.add_argument("--waves", type=_positive_int, default=1, help="submit at least WAVES x concurrency requests")
    static.add_argument("--repeats", type=_positive_int, default=1, help="timed runs per (mode, concurrency), interleaved")

    from ..server.cli import add_parser as add_serve_parser

    add_serve_parser(sub, model_dir_arg)
    from .distill import add_parser as add_distill_parser
    from .drafters import add_parser as add_drafters_parser

    add_distill_parser(sub)
    add_drafters_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            from .generate import cmd_generate

            return cmd_generate(args)
        if args.command == "bench":
            from ..bench.runner import cmd_bench

            return cmd_bench(args)
        if args.command == "serve":
            from ..server.cli import cmd_serve

            return cmd_serve(args)
        if args.command == "distill":
            from .distill import cmd_distill

            return cmd_distill(args)
        if args.command == "drafters":
            from .drafters import cmd_drafters

            return cmd_drafters(args)
        return _demo(args, argv)
    except CLIError as e:
        print(f"adaflash {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("adaflash: interrupted", file=sys.stderr)
        return 130


def _demo(args, argv: list[str] | None) -> int:
    if args.static:
        from ..bench.runner import cmd_demo

        args.out = args.out or "bench-demo"
        args.concurrency = args.concurrency or [1, 8, 32]
        args.max_new_tokens = args.max_new_tokens or 64
        return cmd_demo(args)
    from ..demo.loop import run_loop

    args.out = args.out or "adaflash-demo"
    args.concurrency = args.concurrency or [1]
    args.max_tokens = args.max_new_tokens
    args.threads = args.threads or 1
    args.dtype = args.dtype or "float32"
    args.argv_shown = list(sys.argv[1:] if argv is None else argv)[1:]
    return run_loop(args)


if __name__ == "__main__":
    sys.exit(main())
