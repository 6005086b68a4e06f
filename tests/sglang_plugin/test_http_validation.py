"""The plugin's HTTP pieces check input with the server's own rules (sglang_adaflash.validation):
the admin call's version, its body, and the traffic opt-out header. They need FastAPI, not
SGLang, so they run everywhere; test_sglang_http.py covers the rest on SGLang's own app."""

from __future__ import annotations

import logging

import pytest

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from starlette.datastructures import Headers  # noqa: E402

from sglang_adaflash.sglang_plugin import http  # noqa: E402
from sglang_adaflash.validation import FALSE_SPELLINGS, TRUE_SPELLINGS  # noqa: E402

TOKEN = "t0ken"


@pytest.fixture
def client(tmp_path):
    (tmp_path / "home" / "drafters" / "v000002").mkdir(parents=True)
    (tmp_path / "home" / "drafters" / "v００００03").mkdir(parents=True)  # fullwidth digits
    env = {"ADAFLASH_HOME": str(tmp_path / "home"), "ADAFLASH_ADMIN_TOKEN": TOKEN,
           "ADAFLASH_LOADED_VERSION_FILE": str(tmp_path / "status.json"),
           "ADAFLASH_ADMIN_OVERRIDE_FILE": str(tmp_path / "override")}
    app = fastapi.FastAPI()
    http.add_routes(app, env)
    return TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}), tmp_path


@pytest.mark.parametrize("version", [5, 2.0, True, ["v000002"], {"v": 2}, "v００００03", "v000002\n"])
def test_a_version_that_is_not_a_version_name_is_a_400(client, version):
    """A number or a list was a 500 TypeError; fullwidth digits passed as a version name."""
    c, tmp = client
    r = c.post(http.ROUTE, json={"version": version})
    assert r.status_code == 400 and "is not of the form v000001" in r.json()["error"], r.text
    assert not (tmp / "override").exists()
    assert c.post(http.ROUTE, json={"version": "v000002"}).status_code == 202


@pytest.mark.parametrize("body, match", [
    (b"[" * 100_000, "nested too deeply"),  # was a 500 RecursionError
    (b'{"version": "v0000', "not valid JSON"),
    (b'{"version": "caf\xff"}', "not UTF-8"),
])
def test_a_body_that_cannot_be_read_is_a_400(client, body, match):
    c, tmp = client
    r = c.post(http.ROUTE, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and match in r.json()["error"] and "expected a JSON body" in r.json()["error"]
    assert not (tmp / "override").exists()


@pytest.mark.parametrize("value", [*TRUE_SPELLINGS, "True", "YES", "On", " on "])
def test_every_yes_spelling_opts_out(value):
    assert http.opted_out(type("R", (), {"headers": Headers({http.NO_LOG_HEADER: value})})())


@pytest.mark.parametrize("value", [*FALSE_SPELLINGS, "False", "NO", "Off"])
def test_every_no_spelling_is_logged(value):
    assert not http.opted_out(type("R", (), {"headers": Headers({http.NO_LOG_HEADER: value})})())
    assert not http.opted_out(type("R", (), {"headers": Headers({})})())


def test_an_unknown_spelling_stays_out_of_the_log_with_a_warning(caplog):
    """The request is already accepted when SGLang's logger runs: it cannot be refused, and the
    client asked for something about its privacy, so it is not logged."""
    with caplog.at_level(logging.WARNING):
        assert http.opted_out(type("R", (), {"headers": Headers({http.NO_LOG_HEADER: "maybe"})})())
    assert "must be true or false" in caplog.text
