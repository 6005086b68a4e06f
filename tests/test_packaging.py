"""The published artifacts work on their own: an sdist and a wheel built from the tracked files,
installed into a fresh venv outside the source tree, generate with the bundled model pair.

The fresh venv borrows the test environment's third-party packages (torch alone is gigabytes)
through a plain path entry, which does not run that environment's `.pth` hooks: the editable
install of this project is therefore invisible, and only the wheel can be imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSET_FILES = (
    "sglang_adaflash/assets/models/target/config.json",
    "sglang_adaflash/assets/models/target/model.safetensors",
    "sglang_adaflash/assets/models/target/tokenizer.json",
    "sglang_adaflash/assets/models/drafter/model.safetensors",
    "sglang_adaflash/assets/models/drafter/manifest.json",
    "sglang_adaflash/assets/models/recovery_drafter/model.safetensors",
    "sglang_adaflash/assets/models/recovery_drafter_shared/model.safetensors",
    "sglang_adaflash/assets/models/recovery_drafter_shared/manifest.json",
    "sglang_adaflash/assets/workloads/math.heldout.jsonl",
)


def _tracked_copy(dst: Path) -> Path:
    """The repository as a clean clone has it: tracked files only (falls back to a filtered copy)."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True
                               ).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(".git", ".venv*", ".cache", "build", "dist",
                                                                 "runs", "*.egg-info", "__pycache__"))
        return dst
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    return dst


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    pytest.importorskip("build", reason="needs the `build` package (pip install -e .[dev])")
    src = _tracked_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("dist")
    # Default `build`: the sdist first, then the wheel from the unpacked sdist, so a file missing
    # from the sdist is missing from the wheel too.
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                   check=True, capture_output=True)
    return out


def test_sdist_and_wheel_carry_the_model_pair_and_workloads(dist):
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for name in ASSET_FILES:
        assert name in in_wheel, f"{name} is not in the wheel"
        assert name in in_sdist, f"{name} is not in the sdist"
    assert not [n for n in in_wheel if "/." in n or n.endswith(".tmp")], "temp files in the wheel"


def test_installed_wheel_generates_with_the_bundled_pair(dist, tmp_path):
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_test_dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                    "--no-index", "--no-compile", str(wheel)], check=True, capture_output=True)

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    where = subprocess.run([str(py), "-c", "import sglang_adaflash; print(sglang_adaflash.__file__)"],
                           cwd=work, env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where).is_relative_to(venv), f"imported {where}, not the installed wheel"

    proc = subprocess.run(
        [str(venv / "bin" / "adaflash"), "generate", "--target", "embedded", "--drafter", "embedded",
         "--prompt", "def add(a, b):", "--mode", "adaflash", "--max-new-tokens", "12", "--json", "--quiet"],
        cwd=work, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    (record,) = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert len(record["output_ids"]) > 0 and record["text"]
