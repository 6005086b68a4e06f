"""benchmarks/adaptive/spread.py: one cell over repeated runs, medians per drafter.

What a reader takes from it is the median over runs, so the grouping (by the run's --drafter, the
shipped drafter where none was given) and the columns a run may lack (the paired ratio) are
checked on runs written here, with known figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.conftest import load_benchmark


@pytest.fixture(scope="module")
def spread():
    return load_benchmark("adaptive/spread.py")


def _run(path: Path, *, drafter: str | None, ar: float, ada: float, paired: float | None, modes=None) -> Path:
    tok = {"ar": ar, "dflash": ar * 0.9, "adaflash": ada, "oracle": ar * 1.4}
    results = []
    for m in modes or tok:
        row = {"workload": "in_domain", "concurrency": 1, "mode": m, "cpu_throughput_tok_s": tok[m],
               "tau": 2.5, "drafted_share": 0.5}
        if m == "adaflash" and paired is not None:
            row["paired_vs_ar"] = paired
        results.append(row)
    results.append({"workload": "math", "concurrency": 1, "mode": "ar", "cpu_throughput_tok_s": 1.0})
    path.write_text(json.dumps({"config": {"drafter": drafter}, "results": results}))
    return path


def test_medians_per_drafter_over_runs(spread, tmp_path):
    files = [
        _run(tmp_path / "a.json", drafter=None, ar=100, ada=110, paired=1.12),
        _run(tmp_path / "b.json", drafter=None, ar=100, ada=130, paired=None),  # an older run: no pairs
        _run(tmp_path / "c.json", drafter=None, ar=100, ada=120, paired=1.16),
        _run(tmp_path / "d.json", drafter="/x/drafter_wide", ar=200, ada=250, paired=1.3),
        _run(tmp_path / "e.json", drafter=None, ar=100, ada=999, paired=9.0, modes=("ar", "adaflash")),  # no oracle
    ]
    rs = spread.rows("in_domain", 1, files)
    assert len(rs) == 4  # the run without all four modes is left out
    med = spread.medians(rs)
    assert set(med) == {"shipped", "wide"}
    assert med["shipped"]["runs"] == 3
    assert med["shipped"]["adaflash"] == pytest.approx(1.2)
    assert med["shipped"]["paired"] == pytest.approx(1.14)  # over the two runs that have it
    assert med["shipped"]["adaflash/oracle"] == pytest.approx(1.2 / 1.4)
    assert med["wide"]["adaflash"] == pytest.approx(1.25) and med["wide"]["runs"] == 1
    assert spread.main(["--workload", "in_domain", "--concurrency", "1", *map(str, files)]) == 0
    with pytest.raises(SystemExit):  # one run is no spread
        spread.main(["--workload", "math", "--concurrency", "1", *map(str, files)])
