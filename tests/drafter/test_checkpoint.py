"""DFlash/AdaFlash checkpoints round-trip, and every bad one is refused with a usable message."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_adaflash.drafter.checkpoint import (
    CheckpointError,
    load_drafter,
    read_checkpoint,
    save_drafter,
)
from sglang_adaflash.drafter.config import DrafterConfig, default_target_layer_ids
from sglang_adaflash.drafter.manifest import build_manifest, target_fingerprint
from sglang_adaflash.drafter.store import latest_version, list_versions, publish_version
from sglang_adaflash.target.compat import CompatibilityError, check_compatibility
from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_drafter_config, tiny_target

H, FF, NH, KVH, HD, V = 48, 96, 4, 2, 12, 96


def published_state(layers=1, head=True, dtype=torch.bfloat16):
    """A state dict spelled with the published key names (not derived from our module)."""
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g).to(dtype) * 0.05

    sd = {"fc.weight": w(H, 3 * H), "hidden_norm.weight": w(H) + 1, "norm.weight": w(H) + 1}
    for n in range(layers):
        p = f"layers.{n}."
        sd.update({
            p + "self_attn.q_proj.weight": w(NH * HD, H),
            p + "self_attn.k_proj.weight": w(KVH * HD, H),
            p + "self_attn.v_proj.weight": w(KVH * HD, H),
            p + "self_attn.o_proj.weight": w(H, NH * HD),
            p + "self_attn.q_norm.weight": w(HD) + 1,
            p + "self_attn.k_norm.weight": w(HD) + 1,
            p + "mlp.gate_proj.weight": w(FF, H),
            p + "mlp.up_proj.weight": w(FF, H),
            p + "mlp.down_proj.weight": w(H, FF),
            p + "input_layernorm.weight": w(H) + 1,
            p + "post_attention_layernorm.weight": w(H) + 1,
        })
    if head:
        sd.update({
            "thresh_head_two_model.down.weight": w(256, 2 * H),
            "thresh_head_two_model.down.bias": w(256),
            "thresh_head_two_model.res.0.weight": w(256, 256),
            "thresh_head_two_model.res.0.bias": w(256),
            "thresh_head_two_model.out.weight": w(1, 256),
            "thresh_head_two_model.out.bias": w(1),
        })
    return sd


def published_config(layers=1, head=True):
    dflash = {"mask_token_id": V - 1, "target_layer_ids": [0, 1, 2]}
    if head:
        dflash.update(use_thresh_head_two_model=True, thresh_head_bottleneck_dim=256, thresh_head_direct_len=True)
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
        "intermediate_size": FF, "num_hidden_layers": layers, "num_attention_heads": NH,
        "num_key_value_heads": KVH, "head_dim": HD, "vocab_size": V, "num_target_layers": 3,
        "block_size": 16, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "torch_dtype": "bfloat16",
        "dflash_config": dflash, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    }


def write_published(path, cfg=None, sd=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg or published_config()))
    save_file(sd or published_state(), str(path / "model.safetensors"))
    return path


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B drafter
    assert default_target_layer_ids(28, 1) == [14]


@pytest.mark.parametrize("head", [True, False])
def test_published_checkpoint_round_trips(tmp_path, head):
    src = write_published(tmp_path / "src", published_config(head=head), published_state(head=head))
    model = load_drafter(src)
    assert (model.length_head is not None) == head
    save_drafter(tmp_path / "dst", model)
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "dst/model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.loads((tmp_path / "dst/config.json").read_text())
    orig = published_config(head=head)
    assert cfg["dflash_config"]["mask_token_id"] == orig["dflash_config"]["mask_token_id"]
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    assert cfg["auto_map"] == orig["auto_map"]  # unknown upstream keys survive
    assert cfg.get("dflash_config", {}).get("use_thresh_head_two_model", False) == head


def _corrupt(tmp_path, name, cfg_edit=None, sd_edit=None):
    cfg, sd = published_config(), published_state()
    if cfg_edit:
        cfg_edit(cfg)
    if sd_edit:
        sd_edit(sd)
    return write_published(tmp_path / name, cfg, sd)


@pytest.mark.parametrize(
    "name, cfg_edit, sd_edit, message",
    [
        ("nan", None, lambda sd: sd["norm.weight"].__setitem__(0, math.nan), "NaN"),
        ("shape", None, lambda sd: sd.__setitem__("fc.weight", sd["fc.weight"][:, :H].contiguous()), "shape"),
        ("missing", None, lambda sd: sd.pop("layers.0.mlp.up_proj.weight"), "lacks"),
        ("mixed", None, lambda sd: sd.__setitem__("norm.weight", sd["norm.weight"].float()), "mixes dtypes"),
        ("mask", lambda c: c["dflash_config"].__setitem__("mask_token_id", V), None, "mask_token_id"),
        ("layers", lambda c: c["dflash_config"].__setitem__("target_layer_ids", [0, 1, 7]), None, "target_layer_ids"),
        ("nokey", lambda c: c.pop("num_target_layers"), None, "num_target_layers"),
        ("dtype", lambda c: c.__setitem__("torch_dtype", "float16"), None, "torch_dtype"),
        ("head", lambda c: c["dflash_config"].pop("use_thresh_head_two_model"), None, "use_thresh_head_two_model"),
    ],
)
def test_bad_checkpoints_are_rejected(tmp_path, name, cfg_edit, sd_edit, message):
    path = _corrupt(tmp_path, name, cfg_edit, sd_edit)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(path)


def test_truncated_and_garbled_files(tmp_path):
    path = write_published(tmp_path / "t")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_checkpoint(path)
    path = write_published(tmp_path / "g")
    (path / "config.json").write_text('{"hidden_size": 4')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "nowhere")


def test_manifest_hash_mismatch_is_rejected(tmp_path):
    path = write_published(tmp_path / "m")
    manifest = build_manifest(path, version="v000001", parent=None, target={"name": "t", "config_sha256": "0"})
    (path / "manifest.json").write_text(json.dumps(manifest))
    read_checkpoint(path)  # intact: fine
    sd = published_state()
    sd["norm.weight"] = sd["norm.weight"] * 2
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="does not match the manifest"):
        read_checkpoint(path)


def _target_dir(tmp_path, target):
    d = tmp_path / "target"
    target.model.save_pretrained(d)
    return d


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_size=64, head_dim=16), "hidden size"),
        (dict(vocab_size=V + 8), "vocabulary size"),
        (dict(num_target_layers=4), "layers"),
    ],
)
def test_compatibility_errors(change, message):
    target = tiny_target()
    cfg = tiny_drafter_config().replace(**change)
    with pytest.raises(CompatibilityError, match=message):
        check_compatibility(cfg, target)


def test_dtype_and_foreign_target_are_rejected(tmp_path):
    target = tiny_target()  # float64
    cfg = tiny_drafter_config()
    with pytest.raises(CompatibilityError, match="pass --dtype"):
        check_compatibility(cfg, target, drafter_dtype=torch.float32)
    check_compatibility(cfg, target, drafter_dtype=torch.float32, allow_dtype_cast=True)
    # a drafter published for another target
    tdir = _target_dir(tmp_path, target)
    target.path = str(tdir)
    drafter = tiny_drafter()
    home = tmp_path / "home"
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 1}')
    v = publish_version(home, drafter.config, drafter.state_dict(), target=target_fingerprint(other))
    with pytest.raises(CompatibilityError, match="built for target 'other'"):
        check_compatibility(drafter.config, target, drafter_path=home / "drafters" / v)
    v2 = publish_version(home, drafter.config, drafter.state_dict(), target=target_fingerprint(tdir), parent=v)
    check_compatibility(drafter.config, target, drafter_path=home / "drafters" / v2)
    assert list_versions(home) == ["v000001", "v000002"] and latest_version(home) == "v000002"
    assert read_checkpoint(home / "drafters" / v2)[0].block_size == 8


def test_published_versions_are_immutable(tmp_path):
    drafter = tiny_drafter()
    save_drafter(tmp_path / "x", drafter)
    with pytest.raises(CheckpointError, match="immutable"):
        save_drafter(tmp_path / "x", drafter)


def test_config_round_trip_keeps_length_head_settings():
    raw = published_config()
    raw["adaflash_config"] = {"length_head_rate": 1.1, "length_head_min_len": 3}
    cfg = DrafterConfig.from_dict(raw)
    again = DrafterConfig.from_dict(cfg.to_dict())
    assert (again.length_head_rate, again.length_head_min_len, again.use_length_head) == (1.1, 3, True)
