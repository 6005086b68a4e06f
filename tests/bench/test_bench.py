"""`adaflash bench` on a tiny random float64 pair: results.json, the plot, the T=0 equality check."""

from __future__ import annotations

import json

import pytest

from sglang_adaflash.bench import runner
from sglang_adaflash.bench.metrics import aggregate, first_difference, pearson
from sglang_adaflash.cli.main import main
from sglang_adaflash.core import rejection as rejection_mod
from sglang_adaflash.core.rejection import verify_greedy
from sglang_adaflash.engine.request import RequestOutput, RequestStats

MODES = ["hf", "ar", "dflash", "adaflash"]


def _bench(pair, workload, out, *extra):
    return main(["bench", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir), "--prompts", str(workload),
                 "--concurrency", "1,3", "--max-new-tokens", "8", "--ignore-eos", "--quiet", "--out", str(out), *extra])


def test_bench_writes_results_and_plot(tiny_pair, workload, tmp_path, capsys):
    assert _bench(tiny_pair, workload, tmp_path) == 0
    out = capsys.readouterr().out
    assert "T=0 equality: OK" in out and "tok/s" in out
    doc = json.loads((tmp_path / "results.json").read_text())
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert not list(tmp_path.glob(".*tmp*"))  # atomic writes leave no temp files
    # ratios move with the CPU, so a result names the CPU it came from
    assert set(doc["environment"]["cpu"]) == {"model", "torch_capability"}
    rows = {(r["mode"], r["concurrency"]): r for r in doc["results"]}
    assert set(rows) == {(m, c) for m in MODES for c in (1, 3)}
    for r in rows.values():
        # 5 prompts -> max(c, 5) requests, each exactly 8 tokens (stop tokens ignored)
        assert r["requests"] == 5 and r["generated_tokens"] == 40
        assert r["throughput_tok_s"] > 0 and r["speedup_vs_hf"] is not None
    for c in (1, 3):
        ar = rows[("ar", c)]
        assert ar["tau"] == 1.0 and ar["verify_efficiency"] == 1.0 and ar["mean_verify_len"] == 1.0
        assert ar["steps"] == 5 * 7  # the first token of each request comes from prefill
        for mode in ("dflash", "adaflash"):
            r = rows[(mode, c)]
            assert r["committed_tokens"] == 35 and r["verified_tokens"] >= r["steps"]
            assert r["verify_efficiency"] == pytest.approx(r["committed_tokens"] / r["verified_tokens"])
            assert len(r["accepted_by_position"]) == 3  # block size 4
            assert set(r["per_domain"]) == {"code", "math", "prose"}
        lh = rows[("adaflash", c)]["length_head"]
        assert lh["steps"] == rows[("adaflash", c)]["steps"] and 0 < lh["mean_predicted_ratio"] < 1
        assert rows[("dflash", c)]["length_head"] is None
        assert rows[("dflash", c)]["mean_verify_len"] > 1
    assert doc["equality"]["ok"] and doc["equality"]["checked_modes"] == ["dflash", "adaflash"]
    # float64: HF's padded batches give the very same greedy tokens as the engine
    assert doc["equality"]["hf_exact_agreement"] == {"1": 1.0, "3": 1.0}
    assert doc["config"]["modes"] == MODES and doc["models"]["drafter"]["block_size"] == 4


def test_mixed_lengths_are_honoured_by_every_mode(tiny_pair, workload, tmp_path, capsys):
    assert _bench(tiny_pair, workload, tmp_path, "--mixed-lengths", "--modes", "hf,ar", "--waves", "2", "--repeats", "2") == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["mode"], r["concurrency"]): r for r in doc["results"]}
    rng = runner.random.Random(0)
    lengths = [rng.randint(1, 8) for _ in range(6)]  # one length per request index, shared by all modes
    # 5 prompts, 2 waves: c=1 serves max(2, 5) = 5 requests, c=3 serves max(6, 5) = 6
    assert doc["config"]["requests_per_concurrency"] == {"1": 5, "3": 6}
    for (_mode, c), r in rows.items():
        assert r["generated_tokens"] == sum(lengths[: 5 if c == 1 else 6])
    # HF's padded batches run to their longest request; the engine's running batch shrinks instead
    assert rows[("hf", 3)]["padding_waste"] > 0
    assert rows[("hf", 3)]["decoded_tokens_incl_padding"] == 3 * max(lengths[:3]) + 3 * max(lengths[3:6])
    assert rows[("ar", 3)]["mean_batch_size"] < 3
    assert len(doc["runs"]) == 2 * 2 * 2  # modes x concurrencies x repeats
    for c in (1, 3):
        ar, hf = rows[("ar", c)], rows[("hf", c)]
        assert len(ar["throughput_samples"]) == 2 and ar["paired_speedup_vs_ar"] == 1.0
        runs = {(r["mode"], r["repeat"]): r["throughput_tok_s"] for r in doc["runs"] if r["concurrency"] == c}
        per_repeat = sorted(runs[("ar", i)] / runs[("hf", i)] for i in range(2))
        assert ar["paired_speedup_vs_hf"] == pytest.approx(sum(per_repeat) / 2)
        assert hf["cpu_speedup_vs_hf"] == pytest.approx(1.0)


def test_equality_check_catches_a_lossy_verifier(tiny_pair, workload, tmp_path, capsys, monkeypatch):
    def accept_everything(draft_ids, target_logits, num_candidates):  # wrong on purpose
        res = verify_greedy(draft_ids, target_logits, num_candidates)
        k = draft_ids.shape[1]
        n = num_candidates.long()
        res.num_accepted = n.clone()
        res.tokens[:, :k] = draft_ids
        res.tokens.scatter_(1, n[:, None], target_logits.argmax(-1).gather(1, n[:, None]))
        return res

    monkeypatch.setattr(rejection_mod, "verify_greedy", accept_everything)
    rc = _bench(tiny_pair, workload, tmp_path, "--modes", "ar,dflash", "--strict")
    err = capsys.readouterr().err
    assert rc == 1 and "MISMATCH" in err
    doc = json.loads((tmp_path / "results.json").read_text())
    assert not doc["equality"]["ok"] and doc["equality"]["mismatches"]
    m = doc["equality"]["mismatches"][0]
    assert m["mode"] == "dflash" and m["first_diff"] >= 1  # the prefill token is the target's own


def test_bench_argument_errors(tiny_pair, workload, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--target", "t", "--prompts", "p", "--out", "o", "--modes", "ar,fast"])
    assert "subset of hf,ar,dflash,adaflash" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--target", "t", "--prompts", "p", "--out", "o", "--concurrency", "1,0"])
    rc = main(["bench", "--target", str(tiny_pair.target_dir), "--prompts", str(workload), "--modes", "ar,dflash",
               "--out", str(tmp_path), "--quiet"])
    assert rc == 2 and "need a drafter: pass --drafter DIR" in capsys.readouterr().err


def _out(accept_lens, verify_lens, domain=None, ratios=(), block=4):
    s = RequestStats(block)
    for a, v in zip(accept_lens, verify_lens):
        s.record(v, a - 1)
    s.predicted_ratios = list(ratios)
    return RequestOutput("r", [1], [0] * (1 + sum(accept_lens)), "length", s, None, domain)


def test_aggregate_by_hand():
    outs = [_out([3, 1], [4, 4], "a", ratios=[0.75, 0.25]), _out([4, 2, 1], [4, 2, 1], "b", ratios=[1.0, 0.5, 0.25])]
    agg = aggregate(outs, block_size=4)
    assert agg["steps"] == 5 and agg["committed_tokens"] == 11 and agg["verified_tokens"] == 15
    assert agg["tau"] == pytest.approx(11 / 5) and agg["verify_efficiency"] == pytest.approx(11 / 15)
    assert agg["accepted_by_position"] == [3, 2, 1]
    assert agg["per_domain"] == {"a": {"requests": 1, "steps": 2, "tau": 2.0}, "b": {"requests": 1, "steps": 3, "tau": 7 / 3}}
    lh = agg["length_head"]
    assert lh["pearson"] == pytest.approx(1.0)  # ratios are exactly tau / B here
    assert lh["mean_abs_error"] == pytest.approx(0.0)


def test_pearson_and_first_difference():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 1, 1], [1, 2, 3]) is None and pearson([1], [1]) is None
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_demo_falls_back_to_a_tiny_random_pair(tmp_path, capsys, monkeypatch):
    import sglang_adaflash.assets as assets

    monkeypatch.setattr(assets, "MODELS_DIR", tmp_path / "no-models")
    rc = main(["demo", "--static", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--concurrency", "2",
               "--modes", "ar,adaflash", "--max-new-tokens", "3", "--num-prompts", "2", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 0 and "tiny RANDOM pair" in err
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["equality"]["ok"] and doc["models"]["target"]["layers"] == 8
    assert (tmp_path / "cache" / "tiny-pair" / "drafter" / "model.safetensors").is_file()


def test_tiny_pair_module_main_reuses_the_pair(tmp_path, capsys):
    from sglang_adaflash.testing.__main__ import main as tiny_main

    assert tiny_main([str(tmp_path / "p"), "--workload", "4"]) == 0
    weights = tmp_path / "p" / "target" / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert tiny_main([str(tmp_path / "p")]) == 0 and weights.stat().st_mtime_ns == mtime  # same spec: reused
    lines = (tmp_path / "p" / "workload.jsonl").read_text().splitlines()
    assert len(lines) == 4 and {json.loads(line)["domain"] for line in lines} == {"code", "math", "prose"}


def test_demo_uses_the_embedded_pair_when_present(tiny_pair, tmp_path, capsys, monkeypatch):
    import shutil

    import sglang_adaflash.assets as assets

    models = tmp_path / "models"
    shutil.copytree(tiny_pair.target_dir, models / "target")
    shutil.copytree(tiny_pair.drafter_dir, models / "drafter")
    workloads = tmp_path / "workloads"
    workloads.mkdir()
    for domain in ("code", "math"):
        rows = [{"id": f"{domain}/{i}", "domain": domain, "prompt": f"{domain} question {i}", "response": "x"} for i in range(5)]
        (workloads / f"{domain}.heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(assets, "MODELS_DIR", models)
    monkeypatch.setattr(assets, "WORKLOADS_DIR", workloads)
    rc = main(["demo", "--static", "--out", str(tmp_path / "out"), "--concurrency", "2", "--modes", "ar,dflash",
               "--max-new-tokens", "3", "--num-prompts", "4", "--quiet"])
    assert rc == 0 and "the embedded pair" in capsys.readouterr().err
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["workload"]["prompts"] == 4  # two from each domain's file
    assert set(next(r for r in doc["results"] if r["mode"] == "dflash")["per_domain"]) == {"code", "math"}


def test_step_mae_floor_matches_a_simulated_geometric_acceptance():
    import random

    from sglang_adaflash.bench.metrics import step_mae_floor

    assert step_mae_floor(1 / 8, 8, 8) < 1e-9 and step_mae_floor(1.0, 8, 8) < 1e-9
    a, length, block = 0.7, 8, 8
    rng = random.Random(0)
    taus = []
    for _ in range(200_000):
        k = 1
        while k < length and rng.random() < a:
            k += 1
        taus.append(k)
    mu = sum(taus) / len(taus)
    simulated = sum(abs(t - mu) for t in taus) / len(taus) / block
    assert abs(step_mae_floor(mu / block, length, block) - simulated) < 2e-3


@pytest.mark.parametrize("warm_up", ["short", "full"])
def test_the_warm_up_runs_before_the_timed_runs(tiny_pair, workload, tmp_path, capsys, monkeypatch, warm_up):
    from sglang_adaflash.bench import hf_baseline
    from sglang_adaflash.engine.engine import SpecEngine

    seen, real_run, real_hf = [], SpecEngine.run, runner.run_hf

    def run(self, requests, *a, **k):
        seen.append((self.mode, [r.request_id.startswith("warm-") for r in requests],
                     [r.sampling.max_new_tokens for r in requests]))
        return real_run(self, requests, *a, **k)

    def hf(model, prompts, max_new, *a, **k):
        seen.append(("hf", len(prompts), list(max_new)))
        return real_hf(model, prompts, max_new, *a, **k)

    monkeypatch.setattr(SpecEngine, "run", run)
    monkeypatch.setattr(runner, "run_hf", hf)
    assert hf_baseline.run_hf is not hf  # the runner's own name is the one replaced
    assert _bench(tiny_pair, workload, tmp_path, "--modes", "hf,ar,dflash", "--concurrency", "3",
                  "--warm-up", warm_up) == 0
    warm = [s for s in seen if s[0] != "hf" and all(s[1])]
    timed = [s for s in seen if s[0] != "hf" and not any(s[1])]
    assert [s[0] for s in warm] == ["ar", "dflash"] and [s[0] for s in timed] == ["ar", "dflash"]
    hf_calls = [s for s in seen if s[0] == "hf"]
    if warm_up == "full":  # the timed workload itself: 5 requests of 8 tokens, hf's too
        assert all(len(s[1]) == 5 and s[2] == [8] * 5 for s in warm)
        assert hf_calls[0][1:] == (5, [8] * 5)
    else:
        assert all(len(s[1]) == 2 and s[2] == [4, 4] for s in warm)
        assert hf_calls[0][1:] == (1, [2])
    assert hf_calls[-1][1:] == (5, [8] * 5)  # the timed hf run
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["config"]["warm_up"] == warm_up and doc["equality"]["ok"]
