"""Mode d2sd on the command line: its flags, loading the recovery drafter, building the engine."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import CLIError
from . import BRANCH_DRAFTERS, TREE_RULES
from .cascade import BACKENDS as TREE_ATTENTION

RECOVERY_DIR = Path(__file__).resolve().parent.parent / "assets" / "models" / "recovery_drafter"
# trained with the first drafter's context modules frozen (shared_context.py): one context cache
RECOVERY_SHARED_DIR = RECOVERY_DIR.parent / "recovery_drafter_shared"


@dataclass
class D2SDOptions:
    recovery_drafter: str | None = None
    tree_k: int = 2
    branch_len: int = 4
    branch_width: int = 1
    tree_rule: str = "load_aware"
    tree_attention: str = "auto"
    branch_drafter: str = "recovery"
    draft_off: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def _recovery_dir(text: str) -> str:
    return {"embedded": str(RECOVERY_DIR), "embedded-shared": str(RECOVERY_SHARED_DIR)}.get(text, text)


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def add_d2sd_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mode d2sd (dual-drafter prefix trees)")
    g.add_argument("--recovery-drafter", metavar="DIR", type=_recovery_dir,
                   help="variable-prefix recovery drafter checkpoint, or `embedded` for the bundled one, "
                        "or `embedded-shared` for the bundled one made for --branch-drafter joint: it "
                        "shares the first drafter's context modules (one context cache) and was trained "
                        "for the slot-1 branch alone (refused by the sources that branch deeper)")
    g.add_argument("--tree-k", type=_count, default=D2SDOptions.tree_k,
                   help=f"most recovery branches per request and step (default {D2SDOptions.tree_k}; 0 = a chain)")
    g.add_argument("--branch-len", type=_count, default=D2SDOptions.branch_len,
                   help=f"most tokens per branch (default {D2SDOptions.branch_len})")
    g.add_argument("--branch-width", type=_count, default=D2SDOptions.branch_width,
                   help="most alternatives for a branch's slot: the branch's own, then the recovery drafter's "
                        f"next-ranked tokens there, one node each (default {D2SDOptions.branch_width})")
    g.add_argument("--tree-rule", choices=TREE_RULES, default=D2SDOptions.tree_rule,
                   help="load_aware: the step's cost decides how much of the tree to use (default); fixed: all of it")
    g.add_argument("--branch-drafter", choices=BRANCH_DRAFTERS, default=D2SDOptions.branch_drafter,
                   help="who proposes the branches: the recovery drafter (default, D2SD), or `first`: the first "
                        "drafter's next-ranked tokens at each recovery point, one node per branch, no second "
                        "drafter and no --recovery-drafter needed (the one-drafter token tree baseline); `auto`: "
                        "each step the load-aware rule prices both and takes the better tree (needs "
                        "--recovery-drafter and --tree-rule load_aware); `joint`: both drafters in one stacked "
                        "forward over the chain's block, the recovery drafter's branch at slot 1 and the first "
                        "drafter's ranks at the other recovery points (needs --recovery-drafter of the first "
                        "drafter's shape)")
    g.add_argument("--tree-attention", choices=TREE_ATTENTION, default=D2SDOptions.tree_attention,
                   help="how the target attends over a tree: cascade attention through FlashInfer (CUDA, float16/"
                        "bfloat16), `torch` (the same two levels in torch), or one `masked` call; auto (default) "
                        "is flashinfer where it fits, else masked")
    g.add_argument("--draft-off", action="store_true",
                   help="let the load-aware rule leave out requests whose trees do not pay for their drafting, "
                        "from each request's measured tree acceptance, probing them now and then (as mode "
                        "adaflash does with chains); needs --tree-rule load_aware")


def options_from_args(args, modes: list[str]) -> D2SDOptions | None:
    if "d2sd" not in modes:
        return None
    if args.recovery_drafter is None and args.branch_drafter != "first":
        raise CLIError("mode d2sd needs a recovery drafter: pass --recovery-drafter DIR (or `embedded`), "
                       "or --branch-drafter first for trees from the first drafter alone")
    if args.branch_drafter == "auto" and args.tree_rule != "load_aware":
        raise CLIError("--branch-drafter auto needs --tree-rule load_aware: the fixed rule does not price the "
                       "two sources of branches against each other")
    draft_off = bool(getattr(args, "draft_off", False))
    if draft_off and args.tree_rule != "load_aware":
        raise CLIError("--draft-off needs --tree-rule load_aware: the fixed rule does not price drafting")
    if args.branch_len < 1:
        raise CLIError(f"--branch-len must be >= 1, got {args.branch_len}")
    if args.branch_width < 1:
        raise CLIError(f"--branch-width must be >= 1, got {args.branch_width}")
    if args.branch_drafter == "first":  # recorded as run: no second drafter, one-node branches
        return D2SDOptions(None, args.tree_k, 1, args.branch_width, args.tree_rule, args.tree_attention, "first",
                           draft_off)
    return D2SDOptions(args.recovery_drafter, args.tree_k, args.branch_len, args.branch_width, args.tree_rule,
                       args.tree_attention, args.branch_drafter, draft_off)


def attach_recovery(pair, options: D2SDOptions | None) -> None:
    """Load the recovery drafter next to the pair's first drafter (CLIError when it is unusable)."""
    from ..drafter.checkpoint import CheckpointError
    from .recovery_drafter import load_recovery_drafter, source_limitation

    if options is None:
        return
    if pair.drafter is None:
        raise CLIError("mode d2sd needs --drafter DIR (the first drafter)")
    pair.recovery = None
    if options.branch_drafter == "first":  # the second drafter is not used (nor loaded)
        pair.d2sd = options
        return
    try:
        pair.recovery = load_recovery_drafter(options.recovery_drafter, pair.drafter, dtype=pair.target.dtype,
                                              device=pair.target.device)
    except CheckpointError as e:
        raise CLIError(" ".join(str(e).split())) from None
    except (OSError, RuntimeError, ValueError) as e:
        raise CLIError(f"recovery drafter {options.recovery_drafter} cannot be loaded: {' '.join(str(e).split())}") from None
    why = source_limitation(options.branch_drafter, pair.recovery)
    if why is not None:
        raise CLIError(f"recovery drafter {options.recovery_drafter} cannot serve --branch-drafter "
                       f"{options.branch_drafter}: {why}")
    if options.branch_drafter == "joint":
        from .joint import incompatibility

        why = incompatibility(pair.drafter, pair.recovery)
        if why is not None:
            raise CLIError(f"--branch-drafter joint runs both drafters as one stacked forward, but {why}; "
                           "use --branch-drafter recovery or auto with this recovery drafter")
    pair.d2sd = options


def make_d2sd_engine(pair, max_batch_size: int, max_seq_len: int, seed: int):
    from .engine import D2SDEngine

    opts = getattr(pair, "d2sd", None)
    if opts is None or (getattr(pair, "recovery", None) is None and opts.branch_drafter != "first"):
        raise CLIError("mode d2sd needs a recovery drafter: pass --recovery-drafter DIR (or `embedded`)")
    return D2SDEngine(pair.target, pair.drafter, pair.recovery, tree_k=opts.tree_k, branch_len=opts.branch_len,
                      branch_width=opts.branch_width, tree_rule=opts.tree_rule, tree_attention=opts.tree_attention,
                      branch_drafter=opts.branch_drafter, draft_off=opts.draft_off, max_batch_size=max_batch_size, max_seq_len=max_seq_len, seed=seed)
