"""`adaflash drafters list|show|publish|pin` on a volume."""

from __future__ import annotations

import argparse
import json

import pytest

from sglang_adaflash.cli.drafters import add_parser, cmd_drafters
from sglang_adaflash.drafter.checkpoint import write_checkpoint
from sglang_adaflash.drafter.store import latest_version
from sglang_adaflash.launch.prompts import CLIError
from sglang_adaflash.testing.fixtures import drafter_config, random_state
from sglang_adaflash.testing.tiny_pair import build_tiny_pair


def run(*argv: str) -> int:
    """As `adaflash drafters ...`: a CLIError is exit code 2 with its message."""
    p = argparse.ArgumentParser(prog="adaflash")
    add_parser(p.add_subparsers(dest="command"))
    try:
        return cmd_drafters(p.parse_args(["drafters", *argv]))
    except CLIError as e:
        print(f"error: {e}")
        return 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("pair") / "p", seed=0)


def test_publish_list_show(pair, tmp_path, capsys, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("ADAFLASH_HOME", str(home))
    assert run("list") == 0
    assert "no versions" in capsys.readouterr().out
    assert run("publish", str(pair.drafter_dir), "--target", str(pair.target_dir)) == 0
    assert capsys.readouterr().out.strip() == "v000001"
    assert run("publish", str(pair.drafter_dir), "--target", str(pair.target_dir),
               "--parent", "v000001") == 0
    assert capsys.readouterr().out.strip() == "v000002"
    assert latest_version(home) == "v000002"
    assert run("list", "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["version"], r["latest"], r["parent"]) for r in rows] == [
        ("v000001", False, None), ("v000002", True, "v000001")]
    assert run("list") == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("VERSION") and table[2].startswith("v000002    *")
    assert run("show", "latest") == 0
    out = capsys.readouterr().out
    assert "version   v000002 (files verified" in out and "parent    v000001" in out
    assert run("show", "v000001", "--json") == 0
    assert json.loads(capsys.readouterr().out)["version"] == "v000001"
    (home / "drafters" / "v000001" / "config.json").write_text("{}")
    assert run("show", "v000001") == 2
    assert "does not match the manifest" in capsys.readouterr().out
    assert run("list") == 0  # list reads manifests only; show is the one that verifies


def test_publish_refuses_what_cannot_serve(pair, tmp_path, capsys):
    home = tmp_path / "home"
    cfg = drafter_config()  # hidden 16: not the tiny pair's 64
    other = write_checkpoint(tmp_path / "small", cfg, random_state(cfg, 0))
    assert run("publish", str(other), "--home", str(home), "--target", str(pair.target_dir)) == 2
    assert "does not fit target" in capsys.readouterr().out
    assert run("publish", str(pair.drafter_dir), "--home", str(home), "--target",
               str(pair.target_dir), "--parent", "v000004") == 2
    assert "v000004 is not published" in capsys.readouterr().out
    assert not (home / "drafters").exists() or latest_version(home) is None


def test_pin(pair, tmp_path, capsys, monkeypatch):
    home = tmp_path / "home"
    for _ in range(2):
        assert run("publish", str(pair.drafter_dir), "--home", str(home), "--target",
                   str(pair.target_dir)) == 0
    fleet = tmp_path / "fleet" / "drafter-version"
    monkeypatch.delenv("ADAFLASH_FLEET_VERSION_FILE", raising=False)
    monkeypatch.delenv("ADAFLASH_DESIRED_VERSION_FILE", raising=False)
    assert run("pin", "v000001", "--home", str(home)) == 2
    assert "no fleet version file" in capsys.readouterr().out
    monkeypatch.setenv("ADAFLASH_FLEET_VERSION_FILE", str(fleet))
    assert run("pin", "v000001", "--home", str(home)) == 0
    assert fleet.read_text() == "v000001\n"
    assert run("pin", "v000003", "--home", str(home)) == 2
    assert fleet.read_text() == "v000001\n"
    assert run("pin", "latest", "--home", str(home)) == 0
    assert fleet.read_text() == "v000002\n"
    assert run("pin", "--clear", "--home", str(home)) == 0
    assert not fleet.exists()
    assert run("pin", "--home", str(home)) == 2


def test_pin_refuses_a_version_the_operator_blocked_unless_forced(pair, tmp_path, capsys, monkeypatch):
    """The admin call honours the blocked-versions file (Rejected, RolledBack); `pin` did not."""
    home = tmp_path / "home"
    for _ in range(2):
        assert run("publish", str(pair.drafter_dir), "--home", str(home), "--target",
                   str(pair.target_dir)) == 0
    fleet = tmp_path / "fleet" / "drafter-version"
    blocked = tmp_path / "blocked-drafter-versions"
    blocked.write_text("v000002 Rejected\n")
    monkeypatch.setenv("ADAFLASH_FLEET_VERSION_FILE", str(fleet))
    monkeypatch.setenv("ADAFLASH_BLOCKED_VERSIONS_FILE", str(blocked))
    capsys.readouterr()
    for version in ("v000002", "latest"):  # latest resolves to v000002 now
        assert run("pin", version, "--home", str(home)) == 2
        out = capsys.readouterr().out
        assert "v000002 is Rejected" in out and "--force" in out and len(out.splitlines()) == 1
        assert not fleet.exists()
    assert run("pin", "v000001", "--home", str(home)) == 0
    assert run("pin", "v000002", "--home", str(home), "--force") == 0
    assert fleet.read_text() == "v000002\n"
    assert "forced past v000002 Rejected" in capsys.readouterr().out
    monkeypatch.delenv("ADAFLASH_BLOCKED_VERSIONS_FILE")
    other = tmp_path / "other-blocked"
    other.write_text("v000001 RolledBack\n")
    assert run("pin", "v000001", "--home", str(home), "--blocked-file", str(other)) == 2


@pytest.mark.parametrize("version", ["v００００01", "v000001\n", "5"])
def test_pin_and_show_refuse_what_is_not_a_version_name(pair, tmp_path, capsys, monkeypatch, version):
    home = tmp_path / "home"
    assert run("publish", str(pair.drafter_dir), "--home", str(home), "--target", str(pair.target_dir)) == 0
    (home / "drafters" / version).mkdir()
    monkeypatch.setenv("ADAFLASH_FLEET_VERSION_FILE", str(tmp_path / "fleet"))
    capsys.readouterr()
    assert run("pin", version, "--home", str(home)) == 2
    assert run("show", version, "--home", str(home)) == 2
    out = capsys.readouterr().out
    assert out.count("is not of the form v000001") == 2
    assert not (tmp_path / "fleet").exists()
