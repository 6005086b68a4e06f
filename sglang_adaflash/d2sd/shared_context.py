"""A recovery drafter that shares modules with the first drafter.

A DFlash drafter turns the committed target features into each layer's context K/V (fc, its
norm, the K/V projections), and its block into block K/V. A recovery drafter trained with
those modules frozen at the first drafter's weights (training_job.d2sd_recovery
--share context) says so in its checkpoint (`"shared": "context"`), and the loader ties them to
the first drafter's modules. Both then read one context cache: the committed features are
projected once per step instead of twice, and the joint pass (joint.py) makes layer 0's block
K/V once for both. `--share attention` also freezes layer 0's query and output projections, so
the joint pass runs layer 0's attention once and the two drafters differ from its MLP on.

After a hot reload the first drafter's shared modules hold new weights, and the recovery
drafter reads them (in-place writes reach both, since the modules are the same objects): its
own weights were trained against the modules it was initialised from. Serving stays lossless;
how well its branches then do is what the engine's per-source acceptance records measure.
"""

from __future__ import annotations

from ..drafter.model import DFlashDrafter

SHARING = ("context", "attention")  # each shares what the one before it does, and more


def shared_modules(cfg, kind: str) -> list[str]:
    """The first drafter's modules a recovery drafter of this kind uses.

    context: what turns the committed target features into every layer's context K/V (fc, its
    norm, each layer's K/V projections and K norm), and what turns layer 0's block input into
    its block K/V (that layer's input norm). attention: also layer 0's query projection, query
    norm and output projection, so that layer 0's attention output is the same for both."""
    if kind not in SHARING:
        raise ValueError(f"sharing is one of {SHARING}, not {kind!r}")
    names = ["fc", "hidden_norm", "layers.0.input_layernorm"]
    for i in range(cfg.num_hidden_layers):
        names += [f"layers.{i}.self_attn.{m}" for m in ("k_proj", "v_proj", "k_norm")]
    if kind == "attention":
        names += [f"layers.0.self_attn.{m}" for m in ("q_proj", "q_norm", "o_proj")]
    return names


def tie_modules(recovery: DFlashDrafter, first: DFlashDrafter, kind: str) -> None:
    """Make the recovery drafter use the first drafter's modules of this kind (the same objects,
    so that a hot reload's in-place writes into the first reach both)."""
    for name in shared_modules(recovery.config, kind):
        parent, _, leaf = name.rpartition(".")
        owner = recovery.get_submodule(parent) if parent else recovery
        setattr(owner, leaf, first.get_submodule(name))


def sharing(first: DFlashDrafter, recovery: DFlashDrafter | None) -> str | None:
    """The widest kind of sharing whose modules the two drafters hold in common, or None."""
    if recovery is None or recovery.config.num_hidden_layers != first.config.num_hidden_layers:
        return None
    found = None
    for kind in SHARING:
        if not all(recovery.get_submodule(n) is first.get_submodule(n) for n in shared_modules(first.config, kind)):
            break
        found = kind
    return found
