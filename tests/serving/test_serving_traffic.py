"""Traffic shards on the shared volume: rotation, atomic close, crash recovery, torn lines."""

from __future__ import annotations

import json
import threading

import pytest

from sglang_adaflash.serving.metrics import NullSink
from sglang_adaflash.serving.traffic import (
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


def test_corrupt_closed_shard_is_an_error(tmp_path):
    d = tmp_path / "traffic" / "w"
    d.mkdir(parents=True)
    (d / "00000001.jsonl").write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(TrafficError, match="00000001.jsonl:2"):
        list(iter_records(d))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(id=""), "non-empty id"),
        (dict(output_ids=[1, "x"]), "list of ints"),
        (dict(accept_lens=[9, 9]), "accept_lens sum"),
        (dict(sampling={"temp": 1}), "unknown keys"),
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
