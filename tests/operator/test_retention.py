"""The retention CronJob's pruning (python -m adaflash_operator.retention) on a seeded volume."""

from __future__ import annotations

import os
import time
from pathlib import Path

from adaflash_operator import job_manifests
from adaflash_operator.retention import main
from adaflash_operator.spec import parse


def _volume(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    for v in range(1, 9):
        d = home / "drafters" / f"v{v:06d}"
        d.mkdir(parents=True)
        (d / "manifest.json").write_text("{}")
    (home / "drafters" / ".staging-x").mkdir()
    (home / "drafters" / "latest").write_text("v000008\n")
    old = time.time() - 40 * 86400
    for pod, age in (("p-1", old), ("p-2", time.time())):
        f = home / "traffic" / pod / "host_0.log"
        f.parent.mkdir(parents=True)
        f.write_text("{}\n")
        os.utime(f, (age, age))
        os.utime(f.parent, (age, age))
    return home


def test_prunes_old_traffic_and_old_versions_but_never_the_fleets(tmp_path: Path,
                                                                  capsys) -> None:
    home = _volume(tmp_path)
    fleet = tmp_path / "fleet"
    fleet.write_text("v000002")
    assert main(["--home", str(home), "--traffic-days", "30", "--keep-versions", "3",
                 "--fleet-version-file", str(fleet), "--protect", "v000001"]) == 0
    left = sorted(p.name for p in (home / "drafters").iterdir())
    assert left == [".staging-x", "latest", "v000001", "v000002", "v000006", "v000007",
                    "v000008"]
    assert not (home / "traffic" / "p-1").exists()
    assert (home / "traffic" / "p-2" / "host_0.log").exists()
    assert "v000003, v000004, v000005" in capsys.readouterr().out


def test_refuses_to_prune_without_the_fleet_version(tmp_path: Path) -> None:
    home = _volume(tmp_path)
    assert main(["--home", str(home), "--traffic-days", "30", "--keep-versions", "2",
                 "--fleet-version-file", str(tmp_path / "missing")]) == 1
    assert len(list((home / "drafters").glob("v*"))) == 8


def test_the_cronjob_runs_it_with_the_specs_settings() -> None:
    owner = {"apiVersion": "adaflash.io/v1alpha1", "kind": "AdaFlashService",
             "metadata": {"name": "qwen", "namespace": "ml", "uid": "u"}}
    s = parse({"model": {"target": "t"}, "serving": {"image": "img:1"},
               "retention": {"trafficDays": 7, "keepVersions": 4},
               "drafter": {"pinnedVersion": "v000003"}})
    cj = job_manifests.retention_cronjob(owner, s)
    pod = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    assert ctr["command"] == ["python", "-m", "adaflash_operator.retention"]
    args = ctr["args"]
    assert args[args.index("--traffic-days") + 1] == "7"
    assert args[args.index("--keep-versions") + 1] == "4"
    assert {args[i + 1] for i, a in enumerate(args) if a == "--protect"} == {"v000001",
                                                                            "v000003"}
    assert pod["automountServiceAccountToken"] is False
    assert cj["spec"]["suspend"] is False and cj["spec"]["concurrencyPolicy"] == "Forbid"
