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


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """[n, n] bool, row i true at i and each ancestor of i (parents come before children)."""
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def flatten(rows: list[TreeRow], device) -> FlatTree:
    n = max(r.size for r in rows)
    bs = len(rows)
    tokens = torch.zeros(bs, n, dtype=torch.long)
    depths = torch.zeros(bs, n, dtype=torch.long)
    anc = torch.eye(n, dtype=torch.bool).repeat(bs, 1, 1)  # padding sees itself only
    for i, r in enumerate(rows):
        tokens[i, : r.size] = torch.tensor(r.tokens)
        depths[i, : r.size] = torch.tensor(r.depths)
        anc[i, : r.size, : r.size] = ancestor_matrix(r.parents)
    sizes = torch.tensor([r.size for r in rows], dtype=torch.long)
    return FlatTree(tokens.to(device), depths.to(device), anc.to(device), sizes)
