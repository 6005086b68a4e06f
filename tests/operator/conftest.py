"""Fixtures of the operator tests: the package on sys.path, the in-memory cluster, one namespace
per test, and a kubeconfig that points kopf at it."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# The control loop ticks fast under test; read once when the handlers module is imported.
os.environ.setdefault("ADAFLASH_OPERATOR_TICK_SECONDS", "0.25")

from operator_harness import Cluster  # noqa: E402


@pytest.fixture()
def cluster() -> Iterator[Cluster]:
    cl = Cluster()
    yield cl
    cl.close()


@pytest.fixture()
def namespace(request: pytest.FixtureRequest) -> str:
    return "t-" + request.node.name.lower().replace("_", "-")[:40] + "-" + uuid.uuid4().hex[:5]


@pytest.fixture()
def kubeconfig(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": cluster.url}}],
        "users": [{"name": "kmock", "user": {"token": "test"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path


