"""SGLang's own request log, configured as docs/sglang.md says, carries what the training job
needs, including the request's domain tag (sampling_params.custom_params.domain)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")

from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang.srt.utils.request_logger import RequestLogger  # noqa: E402


def test_finished_request_line_has_ids_and_domain(tmp_path):
    target = tmp_path / "traffic" / "pod-0"
    # the flags: --log-requests --log-requests-level 3 --log-requests-format json
    #            --log-requests-target $ADAFLASH_HOME/traffic/<pod>
    log = RequestLogger(
        log_requests=True,
        log_requests_level=3,
        log_requests_format="json",
        log_requests_target=[str(target)],
    )
    obj = GenerateReqInput(
        input_ids=[5, 6, 7],
        sampling_params={
            "temperature": 0.0,
            "max_new_tokens": 4,
            "custom_params": {"domain": "code"},
        },
        rid="req-1",
    )
    out = {
        "output_ids": [8, 9, 10, 11],
        "meta_info": {"e2e_latency": 0.25, "finish_reason": {"type": "length"}},
    }
    log.log_finished_request(obj, out)
    for t in log.targets:
        for h in t.handlers:
            h.flush()
    files = list(target.glob("*.log"))
    assert len(files) == 1 and files[0].name.endswith("_0.log")  # <host>_<rank>.log
    line = files[0].read_text().strip().splitlines()[-1]
    record = json.loads(line[line.index("{") :])
    assert record["event"] == "request.finished" and record["rid"] == "req-1"
    assert record["obj"]["input_ids"] == [5, 6, 7]
    assert record["obj"]["sampling_params"]["custom_params"] == {"domain": "code"}
    assert record["out"]["output_ids"] == [8, 9, 10, 11]
    for t in log.targets:
        for h in list(t.handlers):
            t.removeHandler(h)
            h.close()
