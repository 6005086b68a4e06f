"""The distillation Job's contract, run for real: exactly the command and arguments the operator
puts in the Job (job_manifests.job), on a tiny seeded volume, and the report parsed by the operator's
own parser into a DrafterVersion its CRD schema accepts.

Only the two paths Kubernetes provides are moved into a temp dir: the shared volume's mount
point (/var/lib/adaflash) and the termination-message file (/dev/termination-log). It skips,
saying so, while training_job/distill.py (issue "On-policy distillation") is not in the
repository, and turns green when that job lands and keeps the contract.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from adaflash_operator import contract as c
from adaflash_operator import crds, distill, job_manifests
from adaflash_operator.spec import parse

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not (ROOT / "training_job" / "distill.py").exists(),
    reason="training_job/distill.py does not exist yet (issue 'On-policy distillation'): this "
           "contract test runs the operator's Job command against it once it lands")

N_RECORDS = 24


def _seed(root: Path) -> tuple[Path, Path]:
    """A volume with drafter v000001 (the tiny pair's) and traffic SGLang logged for it."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_adaflash.drafter.manifest import target_fingerprint
    from sglang_adaflash.drafter.store import publish_checkpoint
    from sglang_adaflash.testing.tiny_pair import build_tiny_pair

    pair = build_tiny_pair(root / "pair", seed=0)
    home = root / "home"
    publish_checkpoint(home, pair.drafter_dir, target=target_fingerprint(pair.target_dir))
    target = AutoModelForCausalLM.from_pretrained(pair.target_dir).eval()
    rng = random.Random(0)
    logdir = home / "traffic" / "qwen-5d8f7-0"  # --log-requests-target of a serving pod
    logdir.mkdir(parents=True)
    with open(logdir / "host_0.log", "w") as f:
        for i in range(N_RECORDS):
            prompt = [1, 4] + [rng.randrange(8, pair.vocab_size) for _ in range(6)]
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      do_sample=False, max_new_tokens=10, min_new_tokens=10,
                                      pad_token_id=0)
            obj = {"event": "request.finished", "rid": f"r{i}",
                   "obj": {"rid": f"r{i}", "input_ids": prompt, "sampling_params": {
                       "temperature": 0.0,
                       "custom_params": {"domain": ("chat", "code")[i % 2]}}},
                   "out": {"output_ids": out[0, len(prompt):].tolist(), "meta_info": {}}}
            f.write(f"[2026-11-30 09:00:00] {json.dumps(obj)}\n")
    return pair.target_dir, home


OWNER = {"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND,
         "metadata": {"name": "qwen", "namespace": "ml", "uid": "u-1"}}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _container_command(ctr: dict, place) -> list[str]:
    """The container's command and arguments as a process here runs them: this interpreter
    for `python`, torch's launcher module for `torchrun` (on a free port)."""
    head = ctr["command"]
    if head[0] == "python":
        return [sys.executable, *head[1:], *map(place, ctr["args"])]
    assert head[0] == "torchrun", head
    return [sys.executable, "-m", "torch.distributed.run", "--master-port", str(_free_port()),
            *head[1:], *map(place, ctr["args"])]


def _run_job(tmp_path: Path, target: Path, home: Path, min_new_records: int, gpus: int = 1):
    """Run the container of the Job the operator builds, as the kubelet would."""
    # Small settings go where a user puts them: spec.distillation.extraArgs.
    spec = parse({"model": {"target": str(target)}, "serving": {"image": "img"},
                  "distillation": {"minNewRecords": min_new_records, "gpus": gpus, "extraArgs": [
                      "--epochs", "1", "--batch-size", "4", "--threads", "1"]}})
    job = job_manifests.job(OWNER, spec, 1, 1, "v000001")
    (ctr,) = job["spec"]["template"]["spec"]["containers"]
    report = tmp_path / "termination-log"

    def place(arg: str) -> str:  # the two paths the kubelet provides
        return arg.replace(c.TERMINATION_LOG, str(report)).replace(c.HOME, str(home))

    cmd = _container_command(ctr, place)
    env = {**os.environ, **{e["name"]: place(e["value"]) for e in ctr["env"] if "value" in e},
           "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, cwd=tmp_path)
    # A non-zero exit is a failed Job (backoffLimit 0): the operator would back off and retry.
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr[-3000:]}"
    return job, report.read_text(), r


def test_too_little_traffic_completes_the_job_with_a_report_not_a_failure(
        tmp_path: Path) -> None:
    target, home = _seed(tmp_path)
    _, message, r = _run_job(tmp_path, target, home, min_new_records=N_RECORDS + 1)
    parsed = distill.parse_report(message)
    assert parsed["outcome"] == distill.OUTCOME_NOT_ENOUGH
    assert parsed["records"] == {"usable": N_RECORDS, "required": N_RECORDS + 1}
    assert "version" not in parsed and parsed["parent"] == "v000001"
    assert sorted(p.name for p in (home / "drafters").glob("v*")) == ["v000001"]
    assert distill.parse_report(distill.report_from_log(r.stdout)) == parsed
    # Nothing was consumed: the same records make the next round.
    _, message, _ = _run_job(tmp_path, target, home, min_new_records=16)
    assert distill.parse_report(message)["version"] == "v000002"


def test_the_operators_job_command_publishes_a_version_the_operator_accepts(
        tmp_path: Path) -> None:
    target, home = _seed(tmp_path)
    owner = OWNER
    job, message, r = _run_job(tmp_path, target, home, min_new_records=16)
    assert len(message.encode()) <= distill.MAX_MESSAGE_BYTES  # what Kubernetes keeps
    parsed = distill.parse_report(message)
    assert parsed["version"] == "v000002" and parsed["parent"] == "v000001"
    assert parsed["outcome"] == distill.OUTCOME_PUBLISHED
    assert (home / "drafters" / parsed["version"]).is_dir()
    # The DrafterVersion the operator would create passes the CRD schema.
    import jsonschema

    dv = job_manifests.drafter_version(owner, parsed, job["metadata"]["name"])
    schema = crds.openapi_schema(c.DRAFTER_KIND)
    schema["properties"]["metadata"] = {"type": "object"}
    jsonschema.Draft4Validator(schema).validate(dv)
    # The gate has what it needs.
    assert parsed.get("eval", {}).get("tau"), "the report has no eval.tau: every version would " \
                                             "be Rejected (NoEvaluation)"
    # The last stdout line is the report too (what the operator reads if the message is cut).
    assert distill.parse_report(distill.report_from_log(r.stdout))["version"] == "v000002"


@pytest.mark.slow  # two torchrun workers (gloo on this CPU) and one plain run: about a minute
def test_the_torchrun_job_of_two_gpus_publishes_what_one_process_publishes(
        tmp_path: Path) -> None:
    """spec.distillation.gpus: 2 makes `torchrun --nproc-per-node=2 -m training_job.distill`;
    run as the container runs it, its two ranks publish the weights one process publishes."""
    import shutil

    from safetensors.torch import load_file

    target, home = _seed(tmp_path / "seed")
    weights, reports = {}, {}
    for gpus in (1, 2):
        vol = tmp_path / f"home{gpus}"
        shutil.copytree(home, vol)
        job, message, _ = _run_job(tmp_path, target, vol, min_new_records=16, gpus=gpus)
        assert job["spec"]["template"]["spec"]["containers"][0]["command"][0] == \
            ("torchrun" if gpus == 2 else "python")
        reports[gpus] = distill.parse_report(message)
        weights[gpus] = load_file(str(vol / "drafters" / "v000002" / "model.safetensors"))
    assert reports[2]["version"] == "v000002" and reports[2]["training"]["steps"] == \
        reports[1]["training"]["steps"]
    for k, v in weights[1].items():
        assert (v.double() - weights[2][k].double()).abs().max() < 1e-5, k


def test_the_operators_bootstrap_job_imports_the_first_version(tmp_path: Path) -> None:
    """spec.drafter.bootstrap {source: Import}: the Job's command, run as the container runs
    it, publishes v000001 and reports what the operator's parser reads."""
    import shutil

    from sglang_adaflash.testing.tiny_pair import build_tiny_pair

    pair = build_tiny_pair(tmp_path / "pair", seed=0, length_head=False)
    home = tmp_path / "home"
    shutil.copytree(pair.drafter_dir, home / "seed" / "dflash")  # put on the claim by a user
    spec = parse({"model": {"target": str(pair.target_dir)}, "serving": {"image": "img"},
                  "drafter": {"bootstrap": {"source": "Import", "path": "seed/dflash"}}})
    ctr = job_manifests.bootstrap_job(OWNER, spec, 1)["spec"]["template"]["spec"]["containers"][0]
    report = tmp_path / "termination-log"

    def place(arg: str) -> str:
        return arg.replace(c.TERMINATION_LOG, str(report)).replace(c.HOME, str(home))

    r = subprocess.run(_container_command(ctr, place), capture_output=True, text=True,
                       timeout=600, cwd=tmp_path,
                       env={**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    parsed = distill.parse_bootstrap_report(report.read_text())
    assert parsed["outcome"] == "Imported" and parsed["version"] == "v000001"
    assert (home / "drafters" / "v000001" / "manifest.json").exists()
