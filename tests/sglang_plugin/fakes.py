"""Stand-ins for SGLang objects that cannot be built without CUDA."""

from __future__ import annotations

import torch

from sglang_adaflash.drafter.model import DFlashDrafter


class FusedDraft(torch.nn.Module):
    """Stands in for SGLang's DFlash draft model: fused qkv / gate_up parameters that
    ``load_weights`` fills slice by slice, in place, like SGLang's weight loaders."""

    def __init__(self, cfg):
        super().__init__()
        ref = DFlashDrafter(cfg)
        self.q = cfg.num_attention_heads * cfg.head_dim
        self.kv = cfg.num_key_value_heads * cfg.head_dim
        self.params = torch.nn.ParameterDict()
        for name, t in ref.state_dict().items():
            if name.startswith("thresh_head_two_model."):
                continue
            fused = name.replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj")
            if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
                continue
            shape = list(t.shape)
            if "qkv_proj" in fused:
                shape[0] = self.q + 2 * self.kv
            if "gate_up_proj" in fused:
                shape[0] *= 2
            self.params[fused.replace(".", "__")] = torch.nn.Parameter(torch.zeros(shape))

    def load_weights(self, weights):
        for name, w in weights:
            for part, fused, offset in [
                ("q_proj", "qkv_proj", 0),
                ("k_proj", "qkv_proj", self.q),
                ("v_proj", "qkv_proj", self.q + self.kv),
                ("gate_proj", "gate_up_proj", 0),
                ("up_proj", "gate_up_proj", None),
            ]:
                if f".{part}." in name:
                    p = self.params[name.replace(part, fused).replace(".", "__")]
                    start = p.shape[0] // 2 if offset is None else offset
                    p.data.narrow(0, start, w.shape[0]).copy_(w)
                    break
            else:
                self.params[name.replace(".", "__")].data.copy_(w)
