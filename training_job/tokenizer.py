"""The byte-level BPE tokenizer of the embedded model pair.

Built with ``tokenizers`` from the training splits of all three domains and saved as a standard
Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``), so
``transformers.AutoTokenizer.from_pretrained(dir)`` loads it offline.

- Byte-level: any text round-trips, there is no unknown token.
- Digits are split one per token, which makes the arithmetic of the math domain learnable.
- The special tokens of :mod:`sglang_adaflash.assets.chat_format` are reserved first, so their ids
  are 0..7 (``<|mask|>`` is 3, below the vocabulary size as DFlash requires). No token is added
  implicitly: the chat format writes ``<|bos|>`` itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sglang_adaflash.assets import chat_format as cf

DEFAULT_VOCAB_SIZE = 4096


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE,
                    min_frequency: int = 2) -> Tokenizer:
    """Train byte-level BPE on ``texts``; deterministic for the same texts in the same order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=list(cf.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(cf.SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise AssertionError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def to_hf(tok: Tokenizer, model_max_length: int):
    """Wrap as a ``transformers`` fast tokenizer with the special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=cf.BOS, eos_token=cf.EOS, pad_token=cf.PAD,
        mask_token=cf.MASK, model_max_length=model_max_length,
        additional_special_tokens=[cf.USER, cf.ASSISTANT, cf.END, cf.SYSTEM],
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = cf.CHAT_TEMPLATE
    return hf


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    to_hf(tok, model_max_length).save_pretrained(str(out_dir))


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def corpus_texts(records: Iterable[dict]) -> Iterator[str]:
    """The training text of each record, in the chat format the models see."""
    for r in records:
        yield cf.render_example(r["prompt"], r["response"])
