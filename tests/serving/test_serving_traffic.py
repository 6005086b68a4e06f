"""Traffic shards on the shared volume: rotation, atomic close, crash recovery, torn lines."""

from __future__ import annotations

import json
import threading

import pytest

from sglang_adaflash.serving.metrics import NullSink
from sglang_adaflash.serving.traffic import (
    ReadReport,
    TrafficError,
    TrafficRecord,
    TrafficWriter,
    iter_records,
    recover_partial,
)


def rec(i, domain=None, **kw):
    base = dict(
        id=f"r{i}",
        model="tiny",
        drafter_version="v000001",
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5, 6, 7],
        sampling={"temperature": 0.0, "top_p": 1.0, "top_k": -1},
        accept_lens=[3, 1],
        finish_reason="length",
        domain=domain,
        ts=1000.0 + i,
        prompt_text="secret prompt",
        output_text="secret answer",
    )
    base.update(kw)
    return TrafficRecord(**base)


class Count(NullSink):
    def __init__(self):
        self.n = {}

    def count_traffic_records(self, n=1, domain=None):
        self.n[domain] = self.n.get(domain, 0) + n


def test_shards_rotate_and_close_atomically(tmp_path):
    sink = Count()
    w = TrafficWriter(tmp_path, "pod-a", max_records=2, sink=sink)
    for i in range(5):
        w.write(rec(i, domain="code" if i % 2 else None))
    d = tmp_path / "traffic" / "pod-a"
    assert sorted(p.name for p in d.iterdir()) == [
        "00000001.jsonl",
        "00000002.jsonl",
        "00000003.jsonl.partial",
    ]
    assert [r["id"] for r in iter_records(d)] == ["r0", "r1", "r2", "r3"]
    assert [r["id"] for r in iter_records(d, include_partial=True)][-1] == "r4"
    w.close()
    assert sorted(p.name for p in d.iterdir())[-1] == "00000003.jsonl"
    first = json.loads((d / "00000001.jsonl").read_text().splitlines()[0])
    assert set(first) == {
        "id",
        "ts",
        "model",
        "drafter_version",
        "domain",
        "prompt_ids",
        "output_ids",
        "sampling",
        "accept_lens",
        "finish_reason",
    }  # no text unless opted in
    assert sink.n == {None: 3, "code": 2}


def test_text_only_when_opted_in(tmp_path):
    with TrafficWriter(tmp_path, "w", include_text=True) as w:
        w.write(rec(0))
    (r,) = iter_records(tmp_path / "traffic" / "w")
    assert r["prompt_text"] == "secret prompt"


def test_age_rotation(tmp_path):
    now = [0.0]
    w = TrafficWriter(tmp_path, "w", max_age_s=10, clock=lambda: now[0])
    w.write(rec(0))
    now[0] = 11
    w.write(rec(1))  # the first shard is too old: closed before this write
    w.close()
    assert len(list((tmp_path / "traffic" / "w").glob("*.jsonl"))) == 2


def test_restart_recovers_a_torn_partial_and_continues_numbering(tmp_path):
    w = TrafficWriter(tmp_path, "w", max_records=100)
    w.write(rec(0))
    w.write(rec(1))
    d = tmp_path / "traffic" / "w"
    partial = d / "00000001.jsonl.partial"
    with open(partial, "a") as f:
        f.write('{"id": "r2", "model": "ti')  # the process died mid-line
    # a torn last line is skipped by readers of the partial shard
    assert [r["id"] for r in iter_records(d, include_partial=True)] == ["r0", "r1"]
    w2 = TrafficWriter(tmp_path, "w")  # restart
    assert w2.recovered == [d / "00000001.jsonl"]
    assert [r["id"] for r in iter_records(d)] == ["r0", "r1"]
    w2.write(rec(3))
    w2.close()
    assert sorted(p.name for p in d.iterdir()) == ["00000001.jsonl", "00000002.jsonl"]


def test_recover_empty_partial_removes_it(tmp_path):
    p = tmp_path / "00000001.jsonl.partial"
    p.write_text('{"torn')
    assert recover_partial(p) is None and not p.exists()


def _line(i, **kw) -> bytes:
    return (json.dumps(rec(i, **kw).to_json(include_text=False)) + "\n").encode()


def _shard(d, name, *lines: bytes):
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(b"".join(lines))
    return d / name


def test_a_garbage_line_skips_that_line_only(tmp_path, caplog):
    d = tmp_path / "traffic" / "w"
    first = _shard(d, "00000001.jsonl", _line(0), b"not json\n", _line(1))
    _shard(d, "00000002.jsonl", _line(2))
    report = ReadReport()
    with caplog.at_level("WARNING"):
        ids = [r["id"] for r in iter_records(d, report=report)]
    assert ids == ["r0", "r1", "r2"]  # the rest of the shard and the next shard still come
    assert report.records == 3 and report.skipped == {"bad_json": 1} and report.torn == 0
    (problem,) = report.problems
    assert problem.startswith(f"{first}:2: bad_json: ")
    assert f"{first}:2: bad_json" in caplog.text


def test_a_torn_partial_shard_does_not_hide_later_shards(tmp_path, caplog):
    d = tmp_path / "traffic" / "w"
    _shard(d, "00000001.jsonl.partial", _line(0), b'{"id": "r1", "mod')
    _shard(d, "00000002.jsonl", _line(2))
    report = ReadReport()
    with caplog.at_level("WARNING"):
        ids = [r["id"] for r in iter_records(d, include_partial=True, report=report)]
    assert ids == ["r0", "r2"]
    assert report.torn == 1 and report.skipped_total == 0 and report.problems == []
    assert caplog.text == ""  # a torn tail is expected, not corruption


def test_an_unterminated_line_of_a_closed_shard_is_not_torn(tmp_path):
    d = tmp_path / "traffic" / "w"
    _shard(d, "00000001.jsonl", _line(0), b'{"id": "r1", "mod')
    report = ReadReport()
    assert [r["id"] for r in iter_records(d, report=report)] == ["r0"]
    assert report.torn == 0 and report.skipped == {"bad_json": 1}


@pytest.mark.parametrize(
    "line, reason",
    [
        (b"42\n", "not_object"),
        (b'["x"]\n', "not_object"),
        (b"null\n", "not_object"),
        (b'{"prompt_ids": "x"}\n', "bad_schema"),
        (b"\xff\xfe\xfa garbage\n", "bad_utf8"),
        (b'{"id": "r9", "model": "ti\xc3"}\n', "bad_utf8"),
        (b"[" * 100_000 + b"\n", "bad_json"),
    ],
)
def test_lines_that_are_not_records_are_skipped_and_reported(tmp_path, line, reason):
    d = tmp_path / "traffic" / "w"
    shard = _shard(d, "00000001.jsonl", _line(0), line, _line(1))
    report = ReadReport()
    assert [r["id"] for r in iter_records(d, report=report)] == ["r0", "r1"]
    assert report.skipped == {reason: 1}
    assert report.problems[0].startswith(f"{shard}:2: {reason}: ")


def _fields(**change):
    out = rec(0).to_json(include_text=True)
    out.update(change)
    return {k: v for k, v in out.items() if v != "DROP"}


@pytest.mark.parametrize(
    "record, why",
    [
        (_fields(id="DROP"), "non-empty id"),
        (_fields(id=7), "non-empty id"),
        (_fields(id=""), "non-empty id"),
        (_fields(model=None), "model"),
        (_fields(prompt_ids=[1, -2]), "prompt_ids"),
        (_fields(prompt_ids="123"), "prompt_ids"),
        (_fields(output_ids=[4, 5.0]), "output_ids"),
        (_fields(output_ids=[True]), "output_ids"),
        (_fields(output_ids="DROP"), "output_ids"),
        (_fields(accept_lens=["3"]), "accept_lens"),
        (_fields(accept_lens=[9, 9]), "accept_lens sum"),
        (_fields(sampling=[0.0]), "sampling must be an object"),
        (_fields(sampling={"temp": 1}), "unknown keys"),
        (_fields(domain=5), "domain"),
        (_fields(drafter_version=1), "drafter_version"),
        (_fields(ts="yesterday"), "ts"),
    ],
)
def test_records_of_the_wrong_shape_are_skipped(tmp_path, record, why):
    d = tmp_path / "traffic" / "w"
    _shard(d, "00000001.jsonl", _line(0), (json.dumps(record) + "\n").encode(), _line(1))
    report = ReadReport()
    assert [r["id"] for r in iter_records(d, report=report)] == ["r0", "r1"]
    assert report.skipped == {"bad_schema": 1}
    assert why in report.problems[0]


def test_optional_fields_may_be_absent_or_null(tmp_path):
    d = tmp_path / "traffic" / "w"
    bare = _fields(domain="DROP", ts="DROP", drafter_version=None, finish_reason=None)
    _shard(d, "00000001.jsonl", (json.dumps(bare) + "\n").encode())
    assert [r["id"] for r in iter_records(d)] == ["r0"]


def test_the_report_caps_its_list_but_not_its_counts(tmp_path):
    d = tmp_path / "traffic" / "w"
    _shard(d, "00000001.jsonl", *[b"junk\n"] * 10, _line(0))
    report = ReadReport(max_problems=3)
    assert [r["id"] for r in iter_records(d, report=report)] == ["r0"]
    assert report.skipped_total == 10 and len(report.problems) == 3
    assert report.problems[-1].startswith(f"{d / '00000001.jsonl'}:3:")
    assert "and 7 more" in report.summary()


def test_a_partial_shard_closed_while_listed_is_read_under_its_new_name(tmp_path):
    d = tmp_path / "traffic" / "w"
    _shard(d, "00000001.jsonl", _line(0))
    _shard(d, "00000002.jsonl.partial", _line(1))
    records = iter_records(d, include_partial=True)
    assert next(records)["id"] == "r0"  # both shards listed by now
    (d / "00000002.jsonl.partial").rename(d / "00000002.jsonl")  # the writer closes it
    assert [r["id"] for r in records] == ["r1"]


def test_recovery_keeps_only_valid_records(tmp_path, caplog):
    d = tmp_path / "traffic" / "w"
    partial = _shard(
        d,
        "00000001.jsonl.partial",
        _line(0),
        b"\x00\x00\x00\x00\n",  # a block of zeros from a crash
        b'{"id": "r1"}\n',
        _line(2),
        b'{"id": "r3", "mod',
    )
    report = ReadReport()
    with caplog.at_level("WARNING"):
        closed = recover_partial(partial, report)
    assert closed == d / "00000001.jsonl" and not partial.exists()
    assert closed.read_bytes() == _line(0) + _line(2)
    assert report.records == 2 and report.torn == 1
    assert report.skipped == {"bad_json": 1, "bad_schema": 1}
    assert f"{partial}:2: bad_json" in caplog.text
    assert [r["id"] for r in iter_records(d)] == ["r0", "r2"]


def test_recovery_of_nothing_but_garbage_removes_the_shard(tmp_path):
    partial = _shard(tmp_path, "00000001.jsonl.partial", b"junk\n", b"[1, 2]\n")
    report = ReadReport()
    assert recover_partial(partial, report) is None and not partial.exists()
    assert report.skipped == {"bad_json": 1, "not_object": 1}


def test_restart_reports_what_recovery_dropped(tmp_path):
    d = tmp_path / "traffic" / "w"
    _shard(d, "00000001.jsonl.partial", _line(0), b"junk\n", _line(1))
    w = TrafficWriter(tmp_path, "w")
    assert w.recovered == [d / "00000001.jsonl"]
    assert w.recovery.records == 2 and w.recovery.skipped == {"bad_json": 1}
    w.close()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(id=""), "non-empty id"),
        (dict(output_ids=[1, "x"]), "list of ints"),
        (dict(accept_lens=[9, 9]), "accept_lens sum"),
        (dict(sampling={"temp": 1}), "unknown keys"),
        (dict(prompt_ids=[1, -1]), "ints >= 0"),  # what readers would skip is never written
        (dict(domain=3), "domain"),
    ],
)
def test_bad_records_are_rejected(tmp_path, kw, match):
    w = TrafficWriter(tmp_path, "w")
    with pytest.raises(TrafficError, match=match):
        w.write(rec(0, **kw))
    w.close()
    assert list(iter_records(tmp_path / "traffic" / "w", include_partial=True)) == []


def test_writer_name_is_checked(tmp_path):
    with pytest.raises(TrafficError, match="use the pod name"):
        TrafficWriter(tmp_path, "../escape")


def test_concurrent_writers_threads_produce_whole_lines(tmp_path):
    w = TrafficWriter(tmp_path, "w", max_records=7)
    threads = [
        threading.Thread(target=lambda k=k: [w.write(rec(k * 100 + i)) for i in range(20)])
        for k in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    ids = [r["id"] for r in iter_records(tmp_path / "traffic" / "w")]
    assert len(ids) == 80 and len(set(ids)) == 80


def test_traffic_is_readable_by_owner_and_group_only(tmp_path):
    """Whatever the process umask (0 here: everything world-readable by default), shards and
    directories keep other users out; recovered shards too."""
    import os
    import stat

    old = os.umask(0)
    try:
        w = TrafficWriter(tmp_path, "pod-a", max_records=2)
        for i in range(3):
            w.write(rec(i))
        w.close()
        d = tmp_path / "traffic" / "pod-a"
        (d / "00000009.jsonl.partial").write_text(
            json.dumps(rec(9).to_json(False)) + "\n" + '{"torn')
        TrafficWriter(tmp_path, "pod-a").close()  # recovers the torn shard
    finally:
        os.umask(old)

    def mode(p):
        return stat.S_IMODE(p.stat().st_mode)

    assert mode(tmp_path / "traffic") == 0o750 and mode(d) == 0o750
    shards = sorted(d.iterdir())
    assert len(shards) == 3 and all(p.suffix == ".jsonl" for p in shards)
    assert {p.name: mode(p) for p in shards} == {p.name: 0o640 for p in shards}
