"""The chat format of the embedded model pair: the one place that defines it.

The embedded target was trained on conversations written exactly like this, so the engine, the
CLI, the benchmarks and the training job all build prompts with :func:`render_prompt` and stop
on :data:`END`. Each special token is a single id in the shipped tokenizer.

A one-turn conversation, as text (no spaces or newlines around the special tokens)::

    <|bos|><|user|>{prompt}<|end|><|assistant|>{response}<|end|>

The model generates ``{response}`` and then ``<|end|>``; ``<|eos|>`` closes a document in the
pretraining stream and is also accepted as a stop token. ``<|mask|>`` never appears in text: it
fills the draft slots of a DFlash block (slot 0 holds the last committed token, slots 1..B-1
the mask token).
"""

from __future__ import annotations

PAD = "<|pad|>"
BOS = "<|bos|>"
EOS = "<|eos|>"
MASK = "<|mask|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
SYSTEM = "<|system|>"

# Reserved in this order, so their ids are 0..7 in every tokenizer the project builds.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, MASK, USER, ASSISTANT, END, SYSTEM)

# Token strings that end a response.
STOP_TOKENS: tuple[str, ...] = (END, EOS)

# The same format as a Jinja template, stored in tokenizer_config.json so that
# ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` agrees with
# :func:`render_prompt`.
CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>' + message['content'] + '<|end|>' }}"
    "{% else %}{{ '<|assistant|>' + message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def render_prompt(prompt: str, system: str | None = None) -> str:
    """The text the model sees before it writes its answer to ``prompt``."""
    head = BOS if system is None else f"{BOS}{SYSTEM}{system}{END}"
    return f"{head}{USER}{prompt}{END}{ASSISTANT}"


def render_example(prompt: str, response: str, system: str | None = None) -> str:
    """A whole training conversation: the prompt, the response and the stop token."""
    return f"{render_prompt(prompt, system)}{response}{END}"


def strip_response(text: str) -> str:
    """Cut a decoded response at its first stop token."""
    cut = len(text)
    for stop in STOP_TOKENS:
        at = text.find(stop)
        if at != -1:
            cut = min(cut, at)
    return text[:cut]
