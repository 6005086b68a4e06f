"""Tiny random target/drafter pairs, written exactly like real ones.

`build_tiny_pair(out_dir)` writes

    out_dir/target/    a Hugging Face Qwen3 causal LM (config.json, model.safetensors) plus a
                       byte-level tokenizer with the project's special tokens and chat template
    out_dir/drafter/   a DFlash drafter checkpoint for that target (config.json,
                       model.safetensors), with an AdaFlash length head unless disabled
    out_dir/tiny_pair.json   the spec and seed the pair was built from

so every loader, the CLI and the benchmark run on them through their normal code paths. The
weights are random: the drafter's proposals are almost never accepted, which makes these pairs
right for correctness checks (T=0 equality, plumbing, error paths) and for measuring engine
overheads, and wrong for measuring speculative speedups.

The same spec and seed always give the same weights; an existing pair built from the same spec
and seed is reused instead of rebuilt.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..assets import chat_format as cf

STAMP_NAME = "tiny_pair.json"
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TinyPairSpec:
    """Sizes of a tiny pair. The defaults build in well under a second."""

    target_layers: int = 4
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    drafter_layers: int = 1
    block_size: int = 8
    length_head: bool = True
    length_head_bottleneck_dim: int = 32
    dtype: str = "float32"
    max_position_embeddings: int = 4096
    # HF's default (0.02) gives near-uniform logits whose argmax flips under rounding noise;
    # a wider init makes greedy decoding of a random model well separated.
    initializer_range: float = 0.2

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.target_layers < 1 or self.drafter_layers < 1:
            raise ValueError("target_layers and drafter_layers must be >= 1")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")


# Named sizes. "engine-tiny": the target (8 layers, hidden 256) costs clearly more than the
# one-layer drafter, as in real pairs; used by `adaflash demo` and benchmarks/engine_tiny.
PRESETS: dict[str, dict] = {
    "default": {},
    "engine-tiny": {
        "target_layers": 8, "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "drafter_layers": 1, "block_size": 8,
        "length_head_bottleneck_dim": 64,
    },
}


@dataclass(frozen=True)
class TinyPair:
    root: Path
    target_dir: Path
    drafter_dir: Path
    spec: TinyPairSpec
    seed: int
    vocab_size: int


def _byte_level_tokenizer():
    """Special tokens at ids 0..7 (as in the embedded pair), then the 256 byte symbols."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(cf.SPECIAL_TOKENS)}
    for sym in alphabet:
        vocab[sym] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(cf.SPECIAL_TOKENS))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=cf.BOS,
        eos_token=cf.EOS,
        pad_token=cf.PAD,
        mask_token=cf.MASK,
        additional_special_tokens=[cf.USER, cf.ASSISTANT, cf.END, cf.SYSTEM],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    hf.chat_template = cf.CHAT_TEMPLATE
    return hf


def _stamp(spec: TinyPairSpec, seed: int) -> dict:
    return {"format": "adaflash.tiny_pair/v1", "seed": seed, "spec": dataclasses.asdict(spec)}


def build_tiny_pair(
    out_dir: str | Path, seed: int = 0, spec: TinyPairSpec | None = None, *, overwrite: bool = False, **sizes
) -> TinyPair:
    """Write (or reuse) a tiny random target + drafter pair under out_dir.

    `sizes` override fields of the default spec, e.g. build_tiny_pair(d, target_layers=8).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..drafter.config import DrafterConfig
    from ..drafter.model import DFlashDrafter

    spec = dataclasses.replace(spec or TinyPairSpec(), **sizes)
    root = Path(out_dir)
    stamp = _stamp(spec, seed)
    tokenizer = _byte_level_tokenizer()
    vocab_size = len(tokenizer)
    pair = TinyPair(root, root / "target", root / "drafter", spec, seed, vocab_size)
    stamp_path = root / STAMP_NAME
    if stamp_path.is_file() and not overwrite:
        try:
            if json.loads(stamp_path.read_text()) == stamp:
                return pair
        except (OSError, json.JSONDecodeError):
            pass
    if root.exists() and any(root.iterdir()) and not stamp_path.is_file():
        raise FileExistsError(f"{root} exists and is not a tiny pair directory; pass an empty or new directory")

    dtype = _DTYPES[spec.dtype]
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}.", suffix=".tmp"))
    try:
        torch.manual_seed(seed)
        tcfg = Qwen3Config(
            vocab_size=vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.target_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=spec.max_position_embeddings,
            tie_word_embeddings=False,
            initializer_range=spec.initializer_range,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        target = Qwen3ForCausalLM(tcfg).to(dtype).eval()
        target.generation_config.pad_token_id = tokenizer.pad_token_id
        target.save_pretrained(tmp / "target")
        tokenizer.save_pretrained(str(tmp / "target"))

        dflash = {"mask_token_id": tokenizer.mask_token_id}
        if spec.length_head:
            dflash.update(use_thresh_head_two_model=True, thresh_head_bottleneck_dim=spec.length_head_bottleneck_dim)
        dcfg = DrafterConfig.from_dict(
            {
                "hidden_size": spec.hidden_size,
                "intermediate_size": spec.intermediate_size,
                "num_hidden_layers": spec.drafter_layers,
                "num_attention_heads": spec.num_attention_heads,
                "num_key_value_heads": spec.num_key_value_heads,
                "head_dim": spec.head_dim,
                "vocab_size": vocab_size,
                "num_target_layers": spec.target_layers,
                "block_size": spec.block_size,
                "max_position_embeddings": spec.max_position_embeddings,
                "dflash_config": dflash,
            }
        )
        drafter = DFlashDrafter(dcfg).to(dtype)
        from ..drafter.checkpoint import save_drafter

        save_drafter(tmp / "drafter", drafter)
        (tmp / STAMP_NAME).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        if root.exists():
            shutil.rmtree(root)
        tmp.rename(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return pair


_WORDS = {
    "code": "def return for while import class self list dict print range len if else yield".split(),
    "math": "sum of two three seven times plus minus equals prime square root what is".split(),
    "prose": "the quiet river ran past old stone houses where children sang at dusk".split(),
}


def write_tiny_workload(path: str | Path, num_prompts: int = 12, seed: int = 0, words: tuple[int, int] = (3, 12)) -> Path:
    """A JSONL prompt file cycling over three domains: {"id", "domain", "prompt"} per line."""
    rng = random.Random(seed)
    domains = sorted(_WORDS)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(num_prompts):
            domain = domains[i % len(domains)]
            n = rng.randint(*words)
            text = " ".join(rng.choice(_WORDS[domain]) for _ in range(n))
            f.write(json.dumps({"id": f"{domain}-{i}", "domain": domain, "prompt": text}) + "\n")
    return path
