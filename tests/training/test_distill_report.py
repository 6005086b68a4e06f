"""The Job report: the manifest's facts in the operator's spelling, within 4096 bytes."""

from __future__ import annotations

import errno
import json

from training_job.opd import report as rep


def _manifest(n_domains=2):
    tau = {f"d{i:03d}": 2.0 + i / 1000 for i in range(n_domains)}
    return {
        "format": "adaflash.drafter/v1", "version": "v000002", "parent": "v000001",
        "created": "2026-11-30T09:00:00Z",
        "target": {"name": "target", "config_digest": "ab" * 32, "config_sha256": "cd" * 32},
        "files": {}, "training": {"algorithm": "opd-rkl", "records": 512, "steps": 64,
                                  "final_loss": 0.41234567, "round": "r", "lr": 3e-4},
        "eval": {"method": "m", "tau_by_domain": tau,
                 "parent_tau_by_domain": {k: v - 0.5 for k, v in tau.items()},
                 "records_by_domain": {k: 10 + i for i, k in enumerate(tau)}},
    }


def test_report_uses_the_operators_spelling():
    from adaflash_operator.distill import parse_report

    r = rep.build_report(_manifest(), target_name="Qwen/Qwen3-8B")
    assert r == {
        "outcome": "Published", "version": "v000002", "parent": "v000001", "created": "2026-11-30T09:00:00Z",
        "target": {"name": "Qwen/Qwen3-8B", "sha256": "ab" * 32},
        "training": {"algorithm": "opd-rkl", "records": 512, "steps": 64,
                     "finalLoss": 0.412346},
        "eval": {"tau": {"d000": 2.0, "d001": 2.001}, "parentTau": {"d000": 1.5, "d001": 1.501}},
    }
    assert parse_report(rep.encode_report(r).decode()) == r


def test_non_finite_loss_and_first_versions_are_left_out():
    m = _manifest()
    m["parent"] = None
    m["training"]["final_loss"] = float("nan")
    r = rep.build_report(m, target_name="t")
    assert "parent" not in r and "finalLoss" not in r["training"]


def test_many_domains_are_trimmed_together_least_weighted_first():
    from adaflash_operator.distill import parse_report

    m = _manifest(300)
    r = rep.build_report(m, target_name="t")
    data = rep.encode_report(r, m["eval"]["records_by_domain"])
    assert len(data) <= rep.MAX_REPORT_BYTES
    out = parse_report(data.decode())
    kept = set(out["eval"]["tau"])
    assert kept == set(out["eval"]["parentTau"]) and 0 < len(kept) < 300
    # the heaviest domains survive
    assert "d299" in kept and "d000" not in kept


def test_report_is_written_even_where_nothing_can_be_renamed(tmp_path, monkeypatch):
    path = tmp_path / "termination-log"
    path.write_text("old")

    class Busy:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            raise OSError(errno.EBUSY, "Device or resource busy")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(rep, "atomic_path", Busy)
    rep.write_report(path, json.dumps({"version": "v000002"}).encode())
    assert json.loads(path.read_text()) == {"version": "v000002"}
