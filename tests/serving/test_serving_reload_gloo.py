"""Tensor-parallel lockstep of hot reload over a real gloo group of two processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from sglang_adaflash.testing.fixtures import publish_random

RANK = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from sglang_adaflash.drafter.model import DFlashDrafter
    from sglang_adaflash.serving.reload import (
        DesiredVersionSource, HotReloader, ModuleTarget, TorchDistGroup)
    from sglang_adaflash.testing.fixtures import drafter_config

    rank, store_path, home, desired, fail_rank = sys.argv[1:6]
    rank, fail_rank = int(rank), int(fail_rank)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    model = DFlashDrafter(drafter_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}

    class Target(ModuleTarget):
        def write(self, state):
            if rank == fail_rank:
                raise RuntimeError("simulated copy failure on rank %d" % rank)
            super().write(state)

    r = HotReloader(source=DesiredVersionSource(home=__import__("pathlib").Path(home),
                    version_file=__import__("pathlib").Path(desired)),
                    target=Target(model), loaded_version="v000001",
                    group=TorchDistGroup(), sync_every_steps=3, report_async=False)
    r.poll_once()
    swapped = [r.at_step_boundary() for _ in range(6)]
    same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    print(json.dumps({"rank": rank, "swapped": swapped, "unchanged": same,
                      "reloads": r.status.reloads, "loaded": r.status.loaded_version}))
    dist.destroy_process_group()
    """
)


def _run(tmp_path, fail_rank):
    home = tmp_path / "home"
    for seed in (1, 2):
        publish_random(home, seed)
    desired = tmp_path / "desired"
    desired.write_text("v000002")
    store = tmp_path / f"store{fail_rank}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK,
                str(rank),
                str(store),
                str(home),
                str(desired),
                str(fail_rank),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_ranks_swap_together_over_gloo(tmp_path):
    r0, r1 = _run(tmp_path, fail_rank=-1)
    # the agreement runs every 3rd step: both ranks swap on step 3, none before
    assert r0["swapped"] == r1["swapped"] == [None, None, "v000002", None, None, None]
    assert not r0["unchanged"] and not r1["unchanged"]


def test_one_rank_failing_rolls_back_both(tmp_path):
    r0, r1 = _run(tmp_path, fail_rank=1)
    assert r0["swapped"] == r1["swapped"] == [None] * 6
    assert r0["unchanged"] and r1["unchanged"]
    assert r0["reloads"] == {"rolled_back": 1} and r1["reloads"] == {"failed": 1}
    assert r0["loaded"] == r1["loaded"] == "v000001"
