"""Two data-parallel ranks (gloo, CPU) train to the weights one process reaches on the whole batch."""

from __future__ import annotations

import random
import socket

import pytest
import torch
import torch.multiprocessing as mp

from sglang_adaflash.testing.fixtures import tiny_drafter, tiny_target
from training_job.opd.train import OPDConfig, train_opd


def _seqs():
    rng = random.Random(5)
    return [{"prompt_ids": [rng.randrange(1, 90) for _ in range(rng.randint(3, 6))],
             "output_ids": [rng.randrange(1, 90) for _ in range(rng.randint(6, 12))]}
            for _ in range(7)]  # batches of 3: the last one of each epoch leaves rank 1 idle


def _cfg(**kw):
    return OPDConfig(epochs=2, batch_size=3, anchors_per_seq=3, seed=3, lr=3e-3, ckpt_every=2,
                     tau=0.002, **kw)


#: The reference's step (per-sequence groups, joint head) and our earlier one.
SETTINGS = [{}, {"scope": "batch", "head": "refit", "norm": "count"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, work: str, out: str, kw: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=world)
    try:
        drafter = tiny_drafter(seed=1)
        stats = train_opd(tiny_target(seed=0).model, drafter, _seqs(), _cfg(**kw), work)
        torch.save({"state": drafter.state_dict(), "stats": stats}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kw", SETTINGS)
def test_two_gloo_ranks_match_one_process(tmp_path, kw):
    single = tiny_drafter(seed=1)
    want = train_opd(tiny_target(seed=0).model, single, _seqs(), _cfg(**kw), tmp_path / "one")
    out = str(tmp_path / "ddp.pt")
    mp.start_processes(_rank, args=(2, _free_port(), str(tmp_path / "two"), out, kw), nprocs=2,
                       start_method="spawn", join=True)
    for rank in (0, 1):
        got = torch.load(f"{out}.{rank}", weights_only=False)
        assert got["stats"]["ranks"] == 2 and got["stats"]["steps"] == want["steps"]
        assert abs(got["stats"]["final_loss"] - want["final_loss"]) < 1e-6
        for k, v in single.state_dict().items():
            assert torch.allclose(got["state"][k], v, atol=1e-6), (rank, k)
