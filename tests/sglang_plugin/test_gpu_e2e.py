"""The end-to-end check on a CUDA machine with sglang installed (the users' GPU script)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]


def test_e2e_script(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sglang_adaflash.sglang_plugin import e2e

    rc = e2e.main(["--out", str(tmp_path / "e2e"), "--requests", "32", "--max-new-tokens", "32"])
    assert rc == 0, (tmp_path / "e2e" / "results.json").read_text()
