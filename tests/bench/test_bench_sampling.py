"""`adaflash bench --temperature`: every mode samples (hf too), and the T=0 equality check is off."""

from __future__ import annotations

import json

import pytest

from sglang_adaflash.cli.main import main


def _bench(pair, workload, out, *extra):
    return main(["bench", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir), "--prompts", str(workload),
                 "--concurrency", "2", "--max-new-tokens", "8", "--ignore-eos", "--quiet", "--out", str(out), *extra])


def _outputs_by_mode(tmp_path, monkeypatch, pair, workload, *extra):
    """Run the bench and capture each mode's first-repeat outputs through the metrics hook."""
    from sglang_adaflash.bench import runner

    seen: dict[str, list[list[int]]] = {}
    real = runner.run_hf

    def spy_hf(*a, **kw):
        run = real(*a, **kw)
        if len(a[1]) > 1:  # not the warm-up
            seen.setdefault("hf", run.outputs)
        return run

    monkeypatch.setattr(runner, "run_hf", spy_hf)
    assert _bench(pair, workload, tmp_path, *extra) == 0
    return json.loads((tmp_path / "results.json").read_text()), seen


def test_sampled_bench_samples_in_every_mode(tiny_pair, workload, tmp_path, monkeypatch, capsys):
    greedy_doc, greedy = _outputs_by_mode(tmp_path / "t0", monkeypatch, tiny_pair, workload, "--modes", "hf,ar,dflash")
    doc, sampled = _outputs_by_mode(tmp_path / "t1", monkeypatch, tiny_pair, workload, "--modes", "hf,ar,dflash",
                                    "--temperature", "1.5", "--top-p", "0.95")
    assert doc["config"]["temperature"] == 1.5 and doc["config"]["top_p"] == 0.95
    assert greedy_doc["config"]["temperature"] == 0.0
    # equality is a T=0 property: off when sampling, on for greedy
    assert doc["equality"]["reference"] is None and doc["equality"]["checked_modes"] == []
    assert "T=0 equality: not applicable (sampled at T=1.5" in capsys.readouterr().out
    assert greedy_doc["equality"]["checked_modes"] == ["dflash"]
    # a random tiny target at T=1.5 samples away from its argmax: hf really sampled
    assert sampled["hf"] != greedy["hf"]
    rows = {r["mode"]: r for r in doc["results"]}
    g_rows = {r["mode"]: r for r in greedy_doc["results"]}
    # sampled verification accepts differently from greedy on the same prompts and drafter
    assert rows["dflash"]["accepted_by_position"] != g_rows["dflash"]["accepted_by_position"] or \
        rows["dflash"]["tau"] != g_rows["dflash"]["tau"]


@pytest.mark.parametrize("flags, msg", [(["--temperature", "-1"], "--temperature"),
                                        (["--temperature", "nan"], "--temperature"),
                                        (["--temperature", "0.7", "--top-p", "0"], "--top-p")])
def test_bad_sampling_flags_are_refused(tiny_pair, workload, tmp_path, capsys, flags, msg):
    assert _bench(tiny_pair, workload, tmp_path, "--modes", "ar", *flags) != 0
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
