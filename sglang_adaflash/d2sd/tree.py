"""Draft trees: the first drafter's chain plus recovery branches, flattened for one verify.

Node 0 of every row is the last committed token (it always commits); node k (1 <= k < L) is the
chain's proposal for block slot k. A branch re-anchored at chain slot r is a run of nodes whose
first node (the alternative token for slot r) hangs under chain node r - 1 and whose later
nodes continue it, one slot deeper each. A node's depth is its block slot, so its position is
`cache_len + depth`; its index is where its K/V sit until the accepted path is committed.
Children of a node are ordered: the chain's child first, then branches by rising slot, which is
the order the multi-candidate rejection sampler tries them in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Branch:
    """One recovery branch: tokens for slots slot, slot+1, ... (first = the alternative)."""

    slot: int  # chain slot r it replaces (1 <= r < chain length)
    tokens: list[int]
    # draft distributions the tokens were sampled from ([len(tokens), V]), None at T=0
    probs: torch.Tensor | None = None


@dataclass
class TreeRow:
    """One request's tree: parallel lists over nodes."""

    tokens: list[int]
    parents: list[int]  # -1 for node 0
    depths: list[int]
    # node -> draft distribution its token was sampled from (T > 0 only)
    probs: list[torch.Tensor | None]

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def chain_length(self) -> int:
        """Nodes 0 .. chain_length - 1 are node 0 and the chain (build_row puts them first)."""
        n = 1
        while n < self.size and self.parents[n] == n - 1 and self.depths[n] == n:
            n += 1
        return n

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents):
            if p >= 0:
                out[p].append(i)  # nodes are appended chain first, so order is preserved
        return out


def build_row(last: int, chain: list[int], branches: list[Branch], chain_probs: torch.Tensor | None = None) -> TreeRow:
    """Chain of len(chain) proposals after `last`, plus branches; validates their slots."""
    tokens, parents, depths = [last], [-1], [0]
    probs: list[torch.Tensor | None] = [None]
    for k, tok in enumerate(chain, start=1):
        tokens.append(tok)
        parents.append(k - 1)
        depths.append(k)
        probs.append(None if chain_probs is None else chain_probs[k - 1])
    for br in sorted(branches, key=lambda b: b.slot):
        if not 1 <= br.slot <= len(chain):
            raise ValueError(f"branch slot {br.slot} outside the chain's slots 1..{len(chain)}")
        parent = br.slot - 1  # chain node r - 1 has index r - 1
        for j, tok in enumerate(br.tokens):
            tokens.append(tok)
            parents.append(parent)
            depths.append(br.slot + j)
            probs.append(None if br.probs is None else br.probs[j])
            parent = len(tokens) - 1
    return TreeRow(tokens, parents, depths, probs)


@dataclass
class FlatTree:
    """Rows padded to N nodes: what the tree verify forward takes."""

    tokens: torch.Tensor  # [bs, N] long
    depths: torch.Tensor  # [bs, N] long (0 on padding)
    ancestors: torch.Tensor  # [bs, N, N] bool: node i may attend to node j (j ancestor of i, or i)
    sizes: torch.Tensor  # [bs] nodes per row

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def _ancestors(parents: np.ndarray) -> np.ndarray:
    """parents [bs, n] (-1: none) -> [bs, n, n] bool: node i sees itself and its ancestors.

    Pointer jumping over every row at once: step d marks each node's ancestor d levels up, so a
    step costs a few array operations whatever the batch, and there are as many steps as the
    deepest tree is deep (a block's slots at most). Building the matrix node by node in torch
    dispatched three ops a node: 2,100 a step at c=32, a tenth of a CPU tree step and more
    than the target's whole forward on a GPU (benchmarks/gpu/README.md).
    """
    bs, n = parents.shape
    anc = np.zeros((bs, n, n), dtype=bool)
    rows, nodes = np.nonzero(np.ones((bs, n), dtype=bool))
    anc[rows, nodes, nodes] = True
    up = parents
    for _ in range(n + 1):  # no path up is longer than the row (build_row lists parents first)
        rows, nodes = np.nonzero(up >= 0)
        if rows.size == 0:
            return anc
        anc[rows, nodes, up[rows, nodes]] = True
        up = np.where(up >= 0, np.take_along_axis(parents, np.maximum(up, 0), axis=1), -1)
    raise ValueError("a tree's parents form a cycle")


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """[n, n] bool, row i true at i and each ancestor of i (parents come before children)."""
    return torch.from_numpy(_ancestors(np.asarray([parents], dtype=np.int64))[0])


def flatten(rows: list[TreeRow], device) -> FlatTree:
    n = max(r.size for r in rows)
    bs = len(rows)
    tokens = np.zeros((bs, n), dtype=np.int64)
    depths = np.zeros((bs, n), dtype=np.int64)
    parents = np.full((bs, n), -1, dtype=np.int64)  # padding has none: it sees itself only
    for i, r in enumerate(rows):
        tokens[i, : r.size] = r.tokens
        depths[i, : r.size] = r.depths
        parents[i, : r.size] = r.parents
    sizes = torch.tensor([r.size for r in rows], dtype=torch.long)
    return FlatTree(torch.from_numpy(tokens).to(device), torch.from_numpy(depths).to(device),
                    torch.from_numpy(_ancestors(parents)).to(device), sizes)
