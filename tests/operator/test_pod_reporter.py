"""The serving pod's annotation PATCH (PodAnnotationReporter) re-reads its rotated token."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

from sglang_adaflash.serving.reload import PodAnnotationReporter


def test_reporter_sends_the_current_token_of_the_mounted_file(tmp_path: Path) -> None:
    seen: list[tuple[str, str, dict]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("Authorization", ""), body))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("first\n")
    try:
        rep = PodAnnotationReporter("serve-0", "ml", api_url=f"http://127.0.0.1:{server.server_port}",
                                    token_file=str(token))
        assert rep.update({"adaflash.io/acceptance-tau": "4.2"})
        token.write_text("rotated")  # the kubelet refreshed the bound token
        assert rep.update({"adaflash.io/acceptance-tau": "4.3"})
    finally:
        server.shutdown()
    assert [a for _, a, _ in seen] == ["Bearer first", "Bearer rotated"]
    assert seen[0][0] == "/api/v1/namespaces/ml/pods/serve-0"
    assert seen[1][2] == {"metadata": {"annotations": {"adaflash.io/acceptance-tau": "4.3"}}}
