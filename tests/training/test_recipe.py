"""`python -m training_job.dflash_offline`: a first drafter for a Hugging Face causal LM (a tiny
random Qwen3 here), from a prompts file or logged traffic; and the operator's bootstrap Job."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from sglang_adaflash.drafter.checkpoint import load_drafter, read_checkpoint
from sglang_adaflash.drafter.manifest import target_fingerprint
from sglang_adaflash.drafter.store import list_versions, verify_version
from sglang_adaflash.testing.tiny_pair import build_tiny_pair
from training_job import bootstrap, recipe

WORDS = ["alpha", "beta", "gamma", "delta", "sum", "loop", "print", "river", "stone", "light"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("recipe") / "pair", seed=0)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [{"id": f"p{i}", "domain": ("code", "prose")[i % 2],
              "prompt": " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(2 + i % 4))}
             for i in range(22)]
    lines.append({"id": "chat", "messages": [{"role": "user", "content": "alpha beta"}]})
    lines.append({"id": "ids", "prompt_ids": [1, 4, 20, 21, 22]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


SMALL = ["--layers", "1", "--block-size", "4", "--max-new-tokens", "10", "--epochs", "2",
         "--batch-size", "4", "--anchors-per-seq", "4", "--eval-max-new-tokens", "6",
         "--min-heldout", "4", "--max-heldout", "4", "--threads", "1", "--quiet",
         "--save-dtype", "float32", "--ckpt-every", "2"]


def test_the_recipe_publishes_a_first_drafter_for_a_qwen3_target(pair, prompts, tmp_path,
                                                                  capsys):
    home = tmp_path / "home"
    report = tmp_path / "report.json"
    argv = ["--target", str(pair.target_dir), "--prompts", str(prompts), "--home", str(home),
            "--report", str(report), *SMALL]
    assert recipe.main(argv) == 0
    rep = json.loads(report.read_text())
    assert rep["outcome"] == "Trained" and rep["version"] == "v000001"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == rep
    assert list_versions(home) == ["v000001"]
    manifest = verify_version(home, "v000001")
    assert manifest["parent"] is None
    assert manifest["target"]["config_digest"] == \
        target_fingerprint(pair.target_dir)["config_digest"]
    training = manifest["training"]
    assert training["algorithm"] == "dflash-offline" and training["loss"] == "sft"
    assert training["records"] + training["eval_records"] == 24 == training["regenerated"]
    assert training["length_head"]["mode"] == "joint"
    assert "calibration" in training["length_head"]
    assert set(manifest["eval"]["tau_by_domain"]) <= {"code", "prose", "untagged"}
    drafter = load_drafter(home / "drafters" / "v000001", dtype=torch.float32)
    cfg = drafter.config
    assert (cfg.num_target_layers, cfg.target_layer_ids, cfg.block_size) == (4, [2], 4)
    assert cfg.hidden_size == 64 and cfg.use_length_head
    assert 0 <= cfg.mask_token_id < cfg.vocab_size
    # a first version only: the volume has one now
    assert recipe.main(argv) == 1
    assert "already holds v000001" in report.read_text()


def test_the_recipe_answers_the_prompts_of_logged_traffic(base, tmp_path):
    """--traffic: the prompts of the records on the volume (both formats), answered again by
    the target; --save writes a checkpoint directory with its manifest."""
    pair, home = base
    out = tmp_path / "drafter"
    assert recipe.main(["--target", str(pair.target_dir), "--traffic", str(home),
                        "--save", str(out), *SMALL]) == 0
    cfg, state = read_checkpoint(out)  # the manifest's hashes are checked too
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["training"]["source"] == "traffic"
    assert manifest["training"]["regenerated"] == 24
    assert cfg.use_length_head and "thresh_head_two_model.out.weight" in state


def test_bad_arguments_are_refused_before_any_work(pair, prompts, tmp_path):
    args = ["--target", str(pair.target_dir), "--prompts", str(prompts)]
    assert recipe.main(args) == 2  # neither --home nor --save
    assert recipe.main([*args, "--save", str(tmp_path / "d"), "--lr", "nan"]) == 2
    assert not (tmp_path / "d.work").exists()
    assert recipe.main([*args, "--save", str(tmp_path / "d"), "--mask-token-id", "99999",
                        *SMALL]) == 1


def test_bootstrap_imports_trains_or_finds_the_first_version(pair, prompts, tmp_path, capsys):
    plain = build_tiny_pair(tmp_path / "plain", seed=0, length_head=False)
    home = tmp_path / "home"
    report = tmp_path / "report"
    base_args = ["--home", str(home), "--target", str(pair.target_dir), "--report", str(report)]
    assert bootstrap.main([*base_args, "--import", str(plain.drafter_dir)]) == 0
    assert json.loads(report.read_text())["outcome"] == "Imported"
    assert verify_version(home, "v000001")["training"]["length_head"]["mode"] == "neutral"
    # a retried Job finds it, whatever it was asked to do
    assert bootstrap.main([*base_args, "--train", "--prompts", str(prompts)]) == 0
    assert json.loads(report.read_text()) == {
        "outcome": "Present", "version": "v000001",
        "message": "v000001 is on the volume already"}
    assert list_versions(home) == ["v000001"]
    # training, with the recipe's own arguments after --
    home2 = tmp_path / "home2"
    assert bootstrap.main(["--home", str(home2), "--target", str(pair.target_dir), "--report",
                           str(report), "--train", "--prompts", str(prompts), "--",
                           *[a for a in SMALL if a != "--quiet"]]) == 0
    assert json.loads(report.read_text())["outcome"] == "Trained"
    assert verify_version(home2, "v000001")["training"]["algorithm"] == "dflash-offline"
    # the operator's parser reads both reports
    from adaflash_operator.distill import parse_bootstrap_report

    assert parse_bootstrap_report(report.read_text())["version"] == "v000001"
    # another version than the pods wait for: a clear failure
    assert bootstrap.main([*base_args[:4], "--version", "v000002", "--report", str(report),
                           "--import", str(plain.drafter_dir)]) == 1
    assert "not v000002, the version the pods wait for" in report.read_text()
    # on an empty volume too, before any import or training (both publish v000001)
    home3 = tmp_path / "home3"
    assert bootstrap.main(["--home", str(home3), "--target", str(pair.target_dir), "--report",
                           str(report), "--version", "v000002", "--train", "--prompts",
                           str(prompts)]) == 1
    assert "first version is v000001, and the pods wait for v000002" in report.read_text()
    assert not (home3 / "drafters").exists() and not (home3 / "bootstrap").exists()


@pytest.mark.slow  # two torchrun workers and one plain run of the recipe: about a minute here
def test_the_recipe_under_torchrun_matches_one_process(pair, prompts, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = {}
    for name, launcher in (
        ("one", [sys.executable, "-m", "training_job.dflash_offline"]),
        ("two", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(port), "-m", "training_job.dflash_offline"]),
    ):
        dest = tmp_path / name
        r = subprocess.run(launcher + ["--target", str(pair.target_dir), "--prompts",
                                       str(prompts), "--save", str(dest), *SMALL],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        out[name] = read_checkpoint(dest)[1]
        regen = sorted((tmp_path / f"{name}.work").glob("regen.rank*.jsonl"))
        assert len(regen) == (1 if name == "one" else 2)  # each rank answered its share
        shutil.rmtree(tmp_path / f"{name}.work")
    for k, v in out["one"].items():
        assert (v.double() - out["two"][k].double()).abs().max() < 1e-5, k
