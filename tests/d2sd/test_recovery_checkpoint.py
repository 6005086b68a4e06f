"""The recovery drafter on the command line: a good checkpoint serves mode d2sd (equal to ar at
T=0), and every bad one is refused with a one-line message before anything runs."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_adaflash.cli.main import main
from sglang_adaflash.d2sd.recovery_drafter import RECOVERY_KEY, recovery_marker
from sglang_adaflash.drafter.checkpoint import load_drafter, write_checkpoint
from sglang_adaflash.testing import build_tiny_pair

from ..cli.conftest import TINY, write_jsonl


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("pair") / "p", seed=0, **TINY)


def make_recovery(src, out, *, marker=True, config=None, state=None):
    """A recovery checkpoint from a first drafter's weights (length head dropped)."""
    d = load_drafter(src)
    cfg = d.config.replace(use_length_head=False)
    raw = dict(cfg.raw)
    ada = dict(raw.get("adaflash_config") or {})
    if marker is True:
        ada[RECOVERY_KEY] = recovery_marker()
    elif marker is not None:
        ada[RECOVERY_KEY] = marker
    raw["adaflash_config"] = ada
    cfg = cfg.replace(raw=raw, **(config or {}))
    weights = {k: v for k, v in d.state_dict().items() if not k.startswith("thresh_head")}
    if state is not None:
        weights = state(weights)
    write_checkpoint(out, cfg, weights, overwrite=True)
    return out


def _generate(capsys, pair, *extra, mode="d2sd"):
    rc = main(["generate", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir), "--mode", mode,
               "--prompt", "hello world", "--max-new-tokens", "12", "--ignore-eos", "--json", *map(str, extra)])
    out, err = capsys.readouterr()
    return rc, [json.loads(x) for x in out.splitlines() if x.startswith("{")], err


def test_good_recovery_drafter_serves_d2sd_equal_to_ar(tiny_pair, tmp_path, capsys):
    rec = make_recovery(tiny_pair.drafter_dir, tmp_path / "rec")
    rc, ar, _ = _generate(capsys, tiny_pair, mode="ar")
    assert rc == 0
    for rule in ("fixed", "load_aware"):
        rc, out, err = _generate(capsys, tiny_pair, "--recovery-drafter", rec, "--tree-k", 2, "--branch-len", 2,
                                 "--tree-rule", rule)
        assert rc == 0, err
        assert out[0]["output_ids"] == ar[0]["output_ids"]
    for flags in (["--tree-attention", "torch"], ["--branch-width", 3, "--tree-rule", "fixed"]):
        rc, out, err = _generate(capsys, tiny_pair, "--recovery-drafter", rec, *flags)
        assert rc == 0, err
        assert out[0]["output_ids"] == ar[0]["output_ids"]


def test_first_drafter_branches_need_no_recovery_drafter(tiny_pair, capsys):
    """--branch-drafter first: trees from the first drafter alone, equal to ar, no
    --recovery-drafter asked for (a path given anyway is not loaded)."""
    ar = _generate(capsys, tiny_pair, mode="ar")[1]
    for extra in ([], ["--recovery-drafter", "/nonexistent"]):
        rc, out, err = _generate(capsys, tiny_pair, "--branch-drafter", "first", "--tree-k", 3, "--branch-width", 2,
                                 "--tree-rule", "fixed", *extra)
        assert rc == 0, err
        assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ar]


def test_branch_width_zero_is_refused(tiny_pair, tmp_path, capsys):
    rec = make_recovery(tiny_pair.drafter_dir, tmp_path / "rec")
    rc, out, err = _generate(capsys, tiny_pair, "--recovery-drafter", rec, "--branch-width", 0)
    assert rc == 2 and not out and "Traceback" not in err
    assert "--branch-width must be >= 1" in err.strip().splitlines()[-1]


def test_flashinfer_tree_attention_off_cuda_is_refused(tiny_pair, tmp_path, capsys):
    rec = make_recovery(tiny_pair.drafter_dir, tmp_path / "rec")
    rc, out, err = _generate(capsys, tiny_pair, "--recovery-drafter", rec, "--tree-attention", "flashinfer")
    assert rc == 2 and not out and "Traceback" not in err
    assert "tree attention 'flashinfer' needs a CUDA device" in err.strip().splitlines()[-1]


def _refused(capsys, pair, rec, *needles):
    rc, out, err = _generate(capsys, pair, *(["--recovery-drafter", rec] if rec is not None else []))
    assert rc == 2 and not out
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err
    for n in needles:
        assert n in line, line
    return line


def test_missing_flag(tiny_pair, capsys):
    _refused(capsys, tiny_pair, None, "needs a recovery drafter", "--recovery-drafter")


def test_missing_directory(tiny_pair, tmp_path, capsys):
    _refused(capsys, tiny_pair, tmp_path / "nope", "does not exist")


def test_plain_dflash_drafter_is_not_a_recovery_drafter(tiny_pair, capsys):
    _refused(capsys, tiny_pair, tiny_pair.drafter_dir, "is not a recovery drafter", RECOVERY_KEY)


def test_unknown_marker_format(tiny_pair, tmp_path, capsys):
    rec = make_recovery(tiny_pair.drafter_dir, tmp_path / "rec", marker={"format": 99, "prefix": "variable"})
    _refused(capsys, tiny_pair, rec, "format")


@pytest.mark.parametrize("change, name", [({"block_size": 8}, "block_size"), ({"target_layer_ids": [0]}, "target_layer_ids"),
                                          ({"mask_token_id": None}, "mask_token_id")])
def test_recovery_drafter_for_other_features_or_block(tiny_pair, tmp_path, capsys, change, name):
    if name == "mask_token_id":
        change = {"mask_token_id": load_drafter(tiny_pair.drafter_dir).config.mask_token_id - 1}
    rec = make_recovery(tiny_pair.drafter_dir, tmp_path / "rec", config=change,
                        state=(lambda w: _resize(w, change)) if "target_layer_ids" in change else None)
    _refused(capsys, tiny_pair, rec, name, "first drafter")


def _resize(weights, change):
    """fc reads one context layer fewer: shrink it so only the mismatch is wrong."""
    w = dict(weights)
    h = w["fc.weight"].shape[0]
    w["fc.weight"] = w["fc.weight"][:, : h * len(change["target_layer_ids"])].clone()
    return w


def test_nan_weights(tiny_pair, tmp_path, capsys):
    def poison(w):
        w = dict(w)
        k = next(iter(w))
        w[k] = w[k].clone()
        w[k].view(-1)[0] = float("nan")
        return w

    rec = tmp_path / "rec"
    make_recovery(tiny_pair.drafter_dir, rec)
    from safetensors.torch import load_file, save_file

    save_file(poison(load_file(str(rec / "model.safetensors"))), str(rec / "model.safetensors"))
    _refused(capsys, tiny_pair, rec, "NaN")


def test_truncated_weights(tiny_pair, tmp_path, capsys):
    rec = make_recovery(tiny_pair.drafter_dir, tmp_path / "rec")
    data = (rec / "model.safetensors").read_bytes()
    (rec / "model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(capsys, tiny_pair, rec, "safetensors")


def test_bench_runs_d2sd_beside_ar_and_records_no_machine_paths(tiny_pair, tmp_path, capsys):
    rec = make_recovery(tiny_pair.drafter_dir, tmp_path / "rec")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello world"}, {"prompt": "abc def"}])
    out = tmp_path / "bench"
    rc = main(["bench", "--target", str(tiny_pair.target_dir), "--drafter", str(tiny_pair.drafter_dir),
               "--recovery-drafter", str(rec), "--prompts", prompts, "--modes", "ar,dflash,d2sd",
               "--concurrency", "1,2", "--max-new-tokens", "8", "--ignore-eos", "--strict", "--out", str(out), "--quiet"])
    capsys.readouterr()
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["equality"]["ok"] and "d2sd" in doc["equality"]["checked_modes"]
    assert doc["config"]["d2sd"]["recovery_drafter"].startswith("<outside>")
    rows = [r for r in doc["results"] if r["mode"] == "d2sd"]
    assert len(rows) == 2 and all("tree" in r for r in rows)
    assert torch.isfinite(torch.tensor([r["throughput_tok_s"] for r in rows])).all()


def test_first_drafter_options_record_what_runs():
    """Results record the tree that ran: one-node branches and no recovery drafter."""
    import argparse

    from sglang_adaflash.d2sd.cli import add_d2sd_args, options_from_args

    p = argparse.ArgumentParser()
    add_d2sd_args(p)
    opts = options_from_args(p.parse_args(["--branch-drafter", "first", "--recovery-drafter", "x", "--branch-len", "4"]),
                             ["d2sd"])
    assert (opts.recovery_drafter, opts.branch_len, opts.branch_drafter) == (None, 1, "first")
    opts = options_from_args(p.parse_args(["--recovery-drafter", "x", "--branch-len", "3"]), ["d2sd"])
    assert (opts.recovery_drafter, opts.branch_len, opts.branch_drafter) == ("x", 3, "recovery")


def test_joint_drafting_serves_equal_to_ar_and_refuses_another_shape(tiny_pair, tmp_path, capsys):
    """--branch-drafter joint stacks the two drafters: a recovery drafter of the first one's
    shape serves, equal to ar; one with a narrower MLP (a valid recovery drafter for the
    sequential modes) is refused for joint with a one-line reason, and still serves `recovery`."""
    ar = _generate(capsys, tiny_pair, mode="ar")[1]
    rec = make_recovery(tiny_pair.drafter_dir, tmp_path / "rec")
    for rule in ("fixed", "load_aware"):
        rc, out, err = _generate(capsys, tiny_pair, "--recovery-drafter", rec, "--branch-drafter", "joint",
                                 "--tree-k", 3, "--branch-width", 2, "--tree-rule", rule)
        assert rc == 0, err
        assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ar]
    width = load_drafter(tiny_pair.drafter_dir).config.intermediate_size // 2

    def narrower(w):
        for name in list(w):
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                w[name] = w[name][:width].contiguous()
            elif name.endswith("down_proj.weight"):
                w[name] = w[name][:, :width].contiguous()
        return w

    other = make_recovery(tiny_pair.drafter_dir, tmp_path / "narrow", config={"intermediate_size": width},
                          state=narrower)
    rc, out, err = _generate(capsys, tiny_pair, "--recovery-drafter", other, "--branch-drafter", "joint")
    assert rc == 2 and not out and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert "--branch-drafter joint" in line and "intermediate_size" in line, line
    rc, out, err = _generate(capsys, tiny_pair, "--recovery-drafter", other, "--branch-drafter", "recovery")
    assert rc == 0, err
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ar]


def test_a_shared_module_marker_ties_serves_equal_to_ar_and_a_bad_one_is_refused(tiny_pair, tmp_path, capsys):
    """A checkpoint marked `shared` (training_job.d2sd_recovery --share) serves every source
    equal to ar; an unknown kind, or a shared checkpoint of another shape, is refused."""
    ar = _generate(capsys, tiny_pair, mode="ar")[1]
    for kind in ("context", "attention"):
        rec = make_recovery(tiny_pair.drafter_dir, tmp_path / kind, marker=recovery_marker(shared=kind))
        for source in ("joint", "recovery"):
            rc, out, err = _generate(capsys, tiny_pair, "--recovery-drafter", rec, "--branch-drafter", source,
                                     "--tree-k", 3, "--branch-width", 2)
            assert rc == 0, err
            assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ar]
    bad = make_recovery(tiny_pair.drafter_dir, tmp_path / "bad", marker=recovery_marker(shared="everything"))
    _refused(capsys, tiny_pair, bad, "shared", "everything")
    other = make_recovery(tiny_pair.drafter_dir, tmp_path / "other", marker=recovery_marker(shared="context"))
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_attention_heads"] *= 2  # refused from config.json alone, before any weights are read
    (other / "config.json").write_text(json.dumps(cfg))
    _refused(capsys, tiny_pair, other, "num_attention_heads", "first drafter")


def test_prefix_range_limits_the_branch_sources_and_a_bad_one_is_refused(tiny_pair, tmp_path, capsys):
    """A checkpoint trained for the slot-1 branch alone (prefix_range [0, 0], `--max-prefix 0`)
    serves joint drafting equal to ar, and is refused for the sources that branch deeper; a
    malformed range is refused before anything runs."""
    ar = _generate(capsys, tiny_pair, mode="ar")[1]
    top = load_drafter(tiny_pair.drafter_dir).config.block_size - 2
    slot1 = make_recovery(tiny_pair.drafter_dir, tmp_path / "slot1", marker=recovery_marker(prefix_range=[0, 0]))
    rc, out, err = _generate(capsys, tiny_pair, "--recovery-drafter", slot1, "--branch-drafter", "joint",
                             "--tree-k", 3, "--branch-width", 2)
    assert rc == 0, err
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ar]
    for source in ("recovery", "auto"):
        rc, out, err = _generate(capsys, tiny_pair, "--recovery-drafter", slot1, "--branch-drafter", source)
        assert rc == 2 and not out and "Traceback" not in err
        line = err.strip().splitlines()[-1]
        assert f"--branch-drafter {source}" in line and "prefix_range [0, 0]" in line, line
    full = make_recovery(tiny_pair.drafter_dir, tmp_path / "full", marker=recovery_marker(prefix_range=[0, top]))
    rc, out, err = _generate(capsys, tiny_pair, "--recovery-drafter", full, "--branch-drafter", "recovery")
    assert rc == 0, err
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ar]
    for n, span in enumerate(([1, 3], [0, top + 1], [0], "0-3", [0, 1.5], [0, -1])):
        bad = make_recovery(tiny_pair.drafter_dir, tmp_path / f"bad{n}", marker=recovery_marker(prefix_range=span))
        _refused(capsys, tiny_pair, bad, "prefix_range")


def test_engine_refuses_a_short_prefix_range_for_deep_sources(tiny_pair, tmp_path):
    from sglang_adaflash.d2sd.engine import D2SDEngine
    from sglang_adaflash.d2sd.recovery_drafter import load_recovery_drafter
    from sglang_adaflash.launch.loading import load_pair

    pair = load_pair(tiny_pair.target_dir, tiny_pair.drafter_dir, dtype="float32")
    rec = load_recovery_drafter(make_recovery(tiny_pair.drafter_dir, tmp_path / "r",
                                              marker=recovery_marker(prefix_range=[0, 1])), pair.drafter)
    for source in ("recovery", "auto"):
        with pytest.raises(ValueError, match=r"prefix_range \[0, 1\]"):
            D2SDEngine(pair.target, pair.drafter, rec, branch_drafter=source, max_batch_size=1, max_seq_len=64)
    D2SDEngine(pair.target, pair.drafter, rec, branch_drafter="joint", max_batch_size=1, max_seq_len=64)
