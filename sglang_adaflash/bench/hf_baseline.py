"""The baseline: Hugging Face `generate()` with static batching, greedy or sampled.

Requests are taken in submission order, `batch_size` at a time, left-padded into one tensor.
A padded batch runs until its longest request is done (its largest max_new_tokens, or every row
has stopped), so shorter requests are truncated afterwards: the time spent on their padding is
what continuous batching saves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class HFRun:
    outputs: list[list[int]]  # per request, truncated to its own max_new_tokens / first stop
    wall_s: float
    decoded_tokens: int  # rows x generated positions, padding included


def _left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def truncate(tokens: list[int], max_new: int, stop_ids: tuple[int, ...]) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in stop_ids:
            break
    return out


@torch.inference_mode()
def hf_generate_batch(model, prompts: list[list[int]], max_new: list[int], pad_id: int, stop_ids: tuple[int, ...],
                      temperature: float = 0.0, top_p: float = 1.0) -> tuple[list[list[int]], int]:
    ids, mask = _left_pad(prompts, pad_id, model.device)
    sample = temperature > 0
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max(max_new),
        do_sample=sample,
        temperature=temperature if sample else None,
        top_p=top_p if sample else None,
        top_k=0 if sample else None,
        eos_token_id=list(stop_ids) or None,
        pad_token_id=pad_id,
    )
    new = out[:, ids.shape[1]:]
    rows = new.tolist()
    return [truncate(r, n, stop_ids) for r, n in zip(rows, max_new)], new.numel()


def run_hf(model, prompts: list[list[int]], max_new: list[int], batch_size: int, pad_id: int,
           stop_ids: tuple[int, ...] = (), progress=None, temperature: float = 0.0, top_p: float = 1.0) -> HFRun:
    outputs: list[list[int]] = []
    decoded = 0
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch_size):
        outs, n = hf_generate_batch(model, prompts[s:s + batch_size], max_new[s:s + batch_size], pad_id, stop_ids,
                                    temperature, top_p)
        outputs.extend(outs)
        decoded += n
        if progress is not None:
            progress.update(len(outs))
    return HFRun(outputs, time.perf_counter() - t0, decoded)
