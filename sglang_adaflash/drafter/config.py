"""Drafter configuration in the published DFlash / AdaFlash `config.json` format.

A DFlash drafter's config is a Qwen3 config plus `block_size`, `num_target_layers` and a
`dflash_config` section; AdaFlash adds the length-head keys inside `dflash_config`. Our own extra
settings live under `adaflash_config`. Unknown keys are kept verbatim so that a published
checkpoint written back by us is still loadable by the upstream code.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A drafter config.json that cannot describe a valid drafter."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default choice of target layers whose hidden states feed the drafter.

    One draft layer reads the middle target layer; more draft layers read layers spread evenly
    from the second layer to the fourth from last.
    """
    if num_draft_layers <= 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(raw.get("rope_theta", 1_000_000.0))


@dataclass
class DrafterConfig:
    """Everything needed to build a drafter; `raw` keeps the full original config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: list[int]
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    torch_dtype: str | None = None
    # AdaFlash adaptive length head ("thresh_head_two_model" upstream).
    use_length_head: bool = False
    length_head_bottleneck_dim: int = 256
    length_head_direct_len: bool = True
    # Ours (under adaflash_config): candidate length = clamp(round(ratio*B*rate), min_len, B).
    length_head_rate: float = 1.3
    length_head_min_len: int = 2
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, resolved: dict[str, Any] | None = None) -> DrafterConfig:
        """Parse a config.json dict, filling DFlash's defaults and checking consistency.

        Every spelling SGLang's DFLASH reads is accepted: ``num_target_layers``, ``block_size``,
        ``target_layer_ids`` and ``mask_token_id`` inside ``dflash_config`` (which wins) or at
        the top level. A drafter that names its mask token only as a string (``mask_token``)
        needs the tokenizer to become an id, and a drafter may leave ``num_target_layers`` to
        the target's config: a caller that resolved them (the SGLang worker does) passes them
        in ``resolved`` ({"mask_token": str, "mask_token_id": int, "num_target_layers": int});
        the file wins, and a resolved id is used only for the token string it was resolved from.
        """
        raw = copy.deepcopy(raw)
        resolved = resolved or {}
        dflash = raw.get("dflash_config") or {}
        ada = raw.get("adaflash_config") or {}

        def spelled(key: str, default: Any = None) -> Any:
            for value in (dflash.get(key), raw.get(key), resolved.get(key)):
                if value is not None:
                    return value
            return default

        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            vocab = int(raw["vocab_size"])
            intermediate = int(raw["intermediate_size"])
        except KeyError as e:
            raise ConfigError(
                f"drafter config.json lacks the key {e.args[0]!r}: a DFlash drafter config is a "
                "Qwen3 config plus block_size, num_target_layers and dflash_config"
            ) from None
        num_target_layers = spelled("num_target_layers")
        if num_target_layers is None:
            raise ConfigError(
                "drafter config.json has no num_target_layers (top level or in dflash_config): "
                "add the number of layers of the target the drafter reads"
            )
        num_target_layers = int(num_target_layers)
        mask_token_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
        named = spelled("mask_token")
        if mask_token_id is None and named in (None, resolved.get("mask_token")):
            # a resolved id stands only for the token string it was resolved from
            mask_token_id = resolved.get("mask_token_id")
        if mask_token_id is None:
            raise ConfigError(
                "drafter config.json has no dflash_config.mask_token_id"
                + (f" (only the mask token string {named!r}, which needs the target's tokenizer)"
                   if named else "")
                + ": the drafter cannot fill its block without knowing the mask token; add "
                "mask_token_id (a token id of the target's vocabulary)"
            )
        layer_ids = spelled("target_layer_ids")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(num_target_layers, layers)
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            num_target_layers=num_target_layers,
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(i) for i in layer_ids],
            block_size=int(spelled("block_size", 16)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            use_length_head=bool(dflash.get("use_thresh_head_two_model", False)),
            length_head_bottleneck_dim=int(dflash.get("thresh_head_bottleneck_dim", 256)),
            length_head_direct_len=bool(dflash.get("thresh_head_direct_len", True)),
            length_head_rate=float(ada.get("length_head_rate", 1.3)),
            length_head_min_len=int(ada.get("length_head_min_len", 2)),
            raw=raw,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject configs that would build a broken drafter, saying what to fix."""
        if self.block_size < 2:
            raise ConfigError(f"block_size must be at least 2 (slot 0 plus one proposal), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}): "
                "the mask token must be a token id of the target's vocabulary"
            )
        if not self.target_layer_ids:
            raise ConfigError("dflash_config.target_layer_ids is empty: list at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ConfigError(
                f"target_layer_ids {bad} are outside the target's {self.num_target_layers} layers "
                f"(valid ids 0..{self.num_target_layers - 1})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not 1 <= self.length_head_min_len <= self.block_size:
            raise ConfigError(
                f"adaflash_config.length_head_min_len {self.length_head_min_len} must lie in "
                f"[1, block_size={self.block_size}]"
            )

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict: the original keys, updated with this config's values."""
        out = copy.deepcopy(self.raw)
        out.setdefault("architectures", ["DFlashDraftModel"])
        out.setdefault("model_type", "qwen3")
        out.update(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            num_target_layers=self.num_target_layers,
            block_size=self.block_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            attention_bias=False,
            tie_word_embeddings=False,
        )
        if "rope_parameters" in out or "rope_theta" not in out:
            out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        else:
            out["rope_theta"] = self.rope_theta
        if self.torch_dtype:
            out["torch_dtype"] = self.torch_dtype
        dflash = dict(out.get("dflash_config") or {})
        dflash.update(mask_token_id=self.mask_token_id, target_layer_ids=list(self.target_layer_ids))
        if self.use_length_head:
            dflash.update(
                use_thresh_head_two_model=True,
                thresh_head_bottleneck_dim=self.length_head_bottleneck_dim,
                thresh_head_direct_len=self.length_head_direct_len,
            )
        else:
            dflash.pop("use_thresh_head_two_model", None)
        out["dflash_config"] = dflash
        ada = dict(out.get("adaflash_config") or {})
        ada.update(length_head_rate=self.length_head_rate, length_head_min_len=self.length_head_min_len)
        out["adaflash_config"] = ada
        return out

    def replace(self, **changes: Any) -> DrafterConfig:
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg
