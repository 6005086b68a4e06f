"""Lossless acceptance over a draft tree: greedy walk at T=0, recursive rejection sampling at T>0.

Greedy: from node 0, move to the child whose token is the target's argmax at the current node;
stop when no child matches. The committed tokens are the path's proposals plus the target's
argmax at the last path node, so they are plain greedy decoding's tokens whatever the tree held.

Sampling (multi-candidate recursive rejection, as in SpecInfer): at the current node with target
distribution p, try its children in order. Child c, whose token x was drawn from q_c, is accepted
with probability min(1, p(x) / q_c(x)); on acceptance the walk moves to c. On rejection p becomes
norm(max(0, p - q_c)) and the next child is tried. When every child is rejected (or there is
none), one token is drawn from the current p and the step ends. Each child's token must have been
drawn from its q_c given everything the verifier saw before it (the path, and the siblings tried
before it): then every committed token follows the target's distribution exactly. A second
child drawn from q with the first child's token removed (renormalised) satisfies this, since the
first child's token is known when the second is tried.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import TreeRow


@dataclass
class PathResult:
    path: list[int]  # node indices from node 0 to the last accepted node
    tokens: list[int]  # committed tokens: accepted proposals then the bonus/recovered token

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def greedy_reads(row: TreeRow, chain_ids: list[int]) -> list[int]:
    """The nodes past the chain whose argmax a greedy walk may read, given the target's argmax
    at the chain's nodes (chain_ids[k] after chain node k): those hung, directly or down a
    branch, at the chain node where the walk stops following the chain. A branch token never
    equals its chain sibling's, and children are tried chain first, so the walk leaves the chain
    at the first node whose argmax is not the chain's next token, or not at all."""
    n_chain = row.chain_length
    stop = next((k for k in range(n_chain - 1) if chain_ids[k] != row.tokens[k + 1]), n_chain - 1)
    anchor: dict[int, int] = {}
    out = []
    for node in range(n_chain, row.size):
        parent = row.parents[node]
        anchor[node] = parent if parent < n_chain else anchor[parent]
        if anchor[node] == stop:
            out.append(node)
    return out


def greedy_walk(row: TreeRow, target_ids: list[int]) -> PathResult:
    """target_ids[i] = the target's argmax after node i; nodes the walk cannot reach may hold -1
    (not computed), and reading one is an error."""
    kids = row.children()
    path, cur = [0], 0
    while True:
        want = target_ids[cur]
        if want < 0:
            raise RuntimeError(f"greedy walk reached node {cur}, whose target argmax was not computed")
        nxt = next((c for c in kids[cur] if row.tokens[c] == want), None)
        if nxt is None:
            return PathResult(path, [row.tokens[i] for i in path[1:]] + [want])
        path.append(nxt)
        cur = nxt


def sampling_walk(row: TreeRow, target_probs: torch.Tensor, generator: torch.Generator | None) -> PathResult:
    """target_probs [N, V] (filtered) at each node; every proposal node has row.probs set."""
    kids = row.children()
    path, cur = [0], 0
    dev = target_probs.device
    while True:
        p = target_probs[cur].float()
        moved = False
        for c in kids[cur]:
            x, q = row.tokens[c], row.probs[c].float()
            u = float(torch.rand((), generator=generator, device=dev))
            if u * float(q[x]) < float(p[x]):  # u < p/q without dividing
                path.append(c)
                cur, moved = c, True
                break
            residual = (p - q).clamp(min=0)
            total = residual.sum()
            if total <= 0:  # p == q on the support: rejection had probability 0
                continue
            p = residual / total
        if not moved:
            last = int(torch.multinomial(p, 1, generator=generator))
            return PathResult(path, [row.tokens[i] for i in path[1:]] + [last])
