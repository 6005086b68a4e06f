"""Traffic in: the project's shards and SGLang's request log, keys, the ledger, the selection."""

from __future__ import annotations

import json
import os
import random

from sglang_adaflash.serving.traffic import ReadReport, TrafficRecord, TrafficWriter
from training_job.opd.traffic import (
    UNTAGGED,
    Ledger,
    Sample,
    scan_traffic,
    select_round,
)


def _sglang_line(rid, prompt, output, domain=None, ts="2026-11-30T09:00:00.000001",
                 event="request.finished"):
    sp = {"temperature": 0.0, "max_new_tokens": 8}
    if domain:
        sp["custom_params"] = {"domain": domain}
    obj = {"timestamp": ts, "event": event, "rid": rid,
           "obj": {"rid": rid, "input_ids": prompt, "sampling_params": sp}}
    if event == "request.finished":
        obj["out"] = {"output_ids": output, "meta_info": {"finish_reason": {"type": "length"}}}
    return f"[2026-11-30 09:00:00] {json.dumps(obj, ensure_ascii=False)}\n"


def _record(i, domain="code", n_out=5):
    return TrafficRecord(id=f"r{i}", model="m", drafter_version="v000001",
                         prompt_ids=[1, 4, 10 + i], output_ids=list(range(20, 20 + n_out)),
                         sampling={"temperature": 0.0}, accept_lens=[1] * n_out,
                         finish_reason="stop", domain=domain, ts=1000.0 + i)


def _write_sglang(home, pod, lines):
    d = home / "traffic" / pod
    d.mkdir(parents=True, exist_ok=True)
    path = d / "host-a_0.log"
    with open(path, "ab") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else line.encode())
    return path


def test_reads_both_formats_and_reports_what_it_skipped(tmp_path):
    home = tmp_path
    with TrafficWriter(home, "pod-a", max_records=2) as w:
        for i in range(3):
            w.write(_record(i, domain=None if i == 2 else "code"))
    _write_sglang(home, "pod-b", [
        _sglang_line("s1", [1, 4, 7], [30, 31, 32], domain="math"),
        _sglang_line("s1", [1, 4, 7], [], event="request.received"),
        _sglang_line("s2", [1, 4, 8], [33, 34]),
        "[2026-11-30 09:00:01] Finish: obj=GenerateReqInput(rid='x'), out={}\n",
        _sglang_line("s3", [1, 2, "..."], [33, 34]),
        _sglang_line("s4", [[1, 2], [3]], [33, 34]),
        b'[2026-11-30 09:00:02] {"event": "request.finished", "rid": "\xff"}\n',
        _sglang_line("s5", [1], [2, 3])[:-20],  # SGLang is mid-line
    ])
    report = ReadReport()
    samples = list(scan_traffic(home, report))
    got = {(s.source, s.writer, s.id, s.domain) for s in samples}
    assert got == {("traffic", "pod-a", "r0", "code"), ("traffic", "pod-a", "r1", "code"),
                   ("traffic", "pod-a", "r2", UNTAGGED), ("sglang", "pod-b", "s1", "math"),
                   ("sglang", "pod-b", "s2", UNTAGGED)}
    s1 = next(s for s in samples if s.id == "s1")
    assert (s1.prompt_ids, s1.output_ids, s1.temperature) == ([1, 4, 7], [30, 31, 32], 0.0)
    assert report.records == 5
    assert report.skipped == {"text_format": 1, "bad_schema": 2, "bad_utf8": 1}
    assert report.torn == 1
    assert any("truncated by the logger" in p for p in report.problems)
    assert any("a batch of requests" in p for p in report.problems)


def test_keys_survive_sglang_rotation_and_partial_recovery(tmp_path):
    home = tmp_path
    log = _write_sglang(home, "pod-b", [_sglang_line("s1", [1, 2], [3, 4, 5])])
    w = TrafficWriter(home, "pod-a")
    w.write(_record(0))  # left in a .partial shard, as after a crash
    before = {s.id: s.key for s in scan_traffic(home, ReadReport())}
    os.rename(log, log.with_name(log.name + ".2026-11-30_09"))  # SGLang's hourly rename
    TrafficWriter(home, "pod-a").close()  # a restarted writer closes the partial shard
    assert not list((home / "traffic" / "pod-a").glob("*.partial"))
    after = {s.id: s.key for s in scan_traffic(home, ReadReport())}
    assert before == after and set(after) == {"s1", "r0"}


def _sample(i, ts=None, n_out=4, domain="code"):
    return Sample(key=f"{i:032x}"[::-1], source="traffic", writer="w", id=str(i), domain=domain,
                  prompt_ids=[1, 2], output_ids=list(range(n_out)),
                  ts=float(i) if ts is None else ts)


def test_selection_skips_consumed_keeps_newest_and_holds_out_by_key():
    samples = [_sample(i) for i in range(40)] + [_sample(100, n_out=1)]
    consumed = {samples[0].key, samples[1].key}
    sel = select_round(samples, consumed, max_records=30, eval_fraction=0.1, min_eval=2,
                       max_eval=8)
    assert sel.new == 39 and sel.too_short == 1 and sel.over_cap == 8
    kept = {s.id for s in sel.train + sel.eval}
    assert kept == {str(i) for i in range(10, 40)}  # the newest 30
    assert len(sel.eval) == 3 and not ({s.key for s in sel.eval} & {s.key for s in sel.train})
    assert set(sel.consumed) == {s.key for s in samples} - consumed
    shuffled = samples[:]
    random.Random(0).shuffle(shuffled)
    again = select_round(shuffled, consumed, max_records=30, eval_fraction=0.1, min_eval=2,
                         max_eval=8)
    assert {s.key for s in again.eval} == {s.key for s in sel.eval}


def test_ledger_adds_atomically_and_only_new_keys(tmp_path):
    ledger = Ledger(tmp_path / "distill" / "consumed.keys")
    assert ledger.load() == set()
    assert ledger.add(["b", "a"]) == 2
    assert ledger.add(["a", "c"]) == 1
    assert ledger.load() == {"a", "b", "c"}
    assert [p.name for p in ledger.path.parent.iterdir()] == ["consumed.keys"]


def test_ledger_forgets_keys_of_deleted_records(tmp_path):
    ledger = Ledger(tmp_path / "consumed.keys")
    ledger.add(["a", "b", "c"])
    assert ledger.retain({"b", "c", "z"}) == 1
    assert ledger.load() == {"b", "c"}
    assert ledger.retain({"b", "c"}) == 0


def _old_and_new():
    """Earlier rounds consumed 20 prose records (ts 0-19) and 4 code ones (ts 20-23), and held out
    the two newest prose ones and one code one; 40 math records are new."""
    prose = [_sample(i, domain="prose") for i in range(20)]
    code = [_sample(20 + i, domain="code") for i in range(4)]
    math_ = [_sample(100 + i, domain="math") for i in range(40)]
    held_out = {prose[19].key, prose[18].key, code[3].key}
    consumed = {s.key for s in prose + code}
    return prose, code, math_, consumed, held_out


def test_replay_spreads_earlier_records_over_domains_and_never_trains_on_held_out_ones():
    prose, code, math_, consumed, held_out = _old_and_new()
    kw = dict(max_records=64, eval_fraction=0.1, min_eval=2, max_eval=8, held_out=held_out)
    sel = select_round(prose + code + math_, consumed, replay_share=0.25, standing_per_domain=2, **kw)
    assert len(sel.train) == 36 and len(sel.eval) == 4 and sel.new == 40
    assert {s.domain for s in sel.train + sel.eval} == {"math"}  # new records are this round's
    # ceil(0.25 x 36) = 9 replayed: code gives its 3 (it has no more), prose the other 6, newest
    # first, and none an earlier round held out
    assert len(sel.replay) == 9
    assert [s.id for s in sel.replay if s.domain == "code"] == ["22", "21", "20"]
    assert [s.id for s in sel.replay if s.domain == "prose"] == [str(i) for i in range(17, 11, -1)]
    assert not {s.key for s in sel.replay} & held_out
    # the standing held-out records: each domain's earlier held-out ones, the smallest keys first
    assert sorted(s.key for s in sel.standing) == sorted(held_out)
    assert set(sel.consumed) == {s.key for s in math_}  # replay consumes nothing again
    # the same selection whatever the order the volume is read in
    shuffled = prose + code + math_
    random.Random(1).shuffle(shuffled)
    again = select_round(shuffled, consumed, replay_share=0.25, standing_per_domain=2, **kw)
    assert [s.key for s in again.replay] == [s.key for s in sel.replay]
    assert [s.key for s in again.standing] == [s.key for s in sel.standing]
    # control: without replay and standing records the round is the new records alone
    alone = select_round(prose + code + math_, consumed, **kw)
    assert not alone.replay and not alone.standing
    assert [s.key for s in alone.train] == [s.key for s in sel.train]
    assert [s.key for s in alone.eval] == [s.key for s in sel.eval]


def test_standing_held_out_records_are_capped_per_domain():
    prose, code, math_, consumed, _ = _old_and_new()
    held_out = {s.key for s in prose[:10]}
    sel = select_round(prose + code + math_, consumed, max_records=64, eval_fraction=0.1,
                       min_eval=2, max_eval=8, held_out=held_out, standing_per_domain=3)
    assert [s.key for s in sel.standing] == sorted(held_out)[:3]
    assert not sel.replay
