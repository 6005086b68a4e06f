"""One round of run.py's first traffic (an earlier run's --work, .cache/opd-bench) from the
shipped drafter with another --gamma, evaluated as run.py evaluates: the offline recipe trained
the shipped drafter with gamma 2 and the job's default is the reference's 7. Does the position
weighting explain code and prose's drop after round 1?

    python benchmarks/opd/gamma_probe.py 2    # writes benchmarks/opd/gamma2_round1.json
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run as R  # noqa: E402

from sglang_adaflash.drafter.manifest import target_fingerprint  # noqa: E402
from sglang_adaflash.drafter.store import publish_checkpoint  # noqa: E402


def main() -> int:
    gamma = sys.argv[1]
    work, log, _ = R.fresh_work(f".cache/opd-gamma{gamma}")
    src = R.ROOT / ".cache" / "opd-bench" / "traffic" / "traffic" / "round1"
    shutil.copytree(src, work / "home" / "traffic" / "round1")
    publish_checkpoint(work / "home", R.DRAFTER, target=target_fingerprint(R.TARGET),
                       training={"algorithm": "dflash-offline (shipped)"})
    job = ["--eval-max-new-tokens", "32", "--head-steps", "200", "--gamma", gamma]
    rep, (secs, cpu) = R.distil_round(work / "home", work / "report.json", "rkl", 1280, 2, job, log)
    tok = R.tokenizer()
    samples = [s for d in R.DOMAINS for s in R.heldout(tok, d, 32)]
    ev = R.evaluate(work / "home" / "drafters" / rep["version"], samples, 2)
    out = {"command": f"python benchmarks/opd/gamma_probe.py {gamma}", "gamma": float(gamma),
           "job_args": job, "tau": ev["tau"], "cv": ev["cv"], "round_seconds": round(secs, 1),
           "round_cpu_seconds": round(cpu, 1), "gate": rep.get("eval", {}).get("gate")}
    print(json.dumps(out))
    (R.ROOT / f"benchmarks/opd/gamma{gamma}_round1.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
