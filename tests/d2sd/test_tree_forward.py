"""The tree verify forward against a brute-force forward of each root-to-node path."""

import pytest
import torch

from sglang_adaflash.d2sd.cascade import TorchCascade
from sglang_adaflash.d2sd.tree import Branch, ancestor_matrix, build_row, flatten
from sglang_adaflash.d2sd.tree_target import commit_paths, gather_nodes, tree_forward
from sglang_adaflash.target.hf_target import TargetBatch
from sglang_adaflash.testing.fixtures import tiny_target

CAPTURE = [0, 2]


def _path(row, node):
    out = []
    while node >= 0:
        out.append(node)
        node = row.parents[node]
    return out[::-1]


def _trees():
    # row 0: chain of 5 with branches at slots 1 (3 long) and 3 (2 long); row 1: chain of 2, one
    # branch of 1; row 2: nothing drafted (node 0 only)
    return [
        build_row(7, [11, 12, 13, 14], [Branch(1, [21, 22, 23]), Branch(3, [31, 32])]),
        build_row(5, [40], [Branch(1, [41])]),
        build_row(9, [], []),
    ]


@pytest.fixture(scope="module")
def target():
    t = tiny_target(seed=3)
    t.capture_layer_ids = list(CAPTURE)
    return t


def _prefill(target, prompts, capacity=64):
    cache = target.new_cache(len(prompts), capacity)
    target.forward(TargetBatch.from_lists(prompts, [0] * len(prompts)), cache)
    return cache, torch.tensor([len(p) for p in prompts])


def test_ancestor_matrix():
    row = _trees()[0]
    anc = ancestor_matrix(row.parents)
    # node 5 is the slot-1 branch's first node: it sees node 0 and itself, not chain node 1
    assert row.depths[5] == 1 and row.parents[5] == 0
    assert anc[5].nonzero().flatten().tolist() == [0, 5]
    assert anc[7].nonzero().flatten().tolist() == [0, 5, 6, 7]
    assert anc[9].nonzero().flatten().tolist() == [0, 1, 2, 8, 9]


# where the nodes' K/V sit: in the cache past the context (the masked path's default), aside
# because the tree does not fit there (a 16-entry cache: context 7 + 10 nodes), aside for a cascade
PLACES = {"in_cache": (64, None), "aside_no_room": (16, None), "aside_cascade": (64, "torch")}


@pytest.mark.parametrize("place", list(PLACES))
def test_every_node_matches_a_plain_forward_of_its_path(target, place):
    """The masked call, and the two-level cascade (context and nodes attended apart, merged)."""
    capacity, cascade = PLACES[place]
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8], [2, 7]]
    cache, starts = _prefill(target, prompts, capacity)
    rows = _trees()
    flat = flatten(rows, "cpu")
    fwd = tree_forward(target, cache, flat, starts, TorchCascade() if cascade else None)
    assert (fwd.node_kv is None) == (place == "in_cache")
    every = fwd.logits  # computed from the final states on each read
    for b, (prompt, row) in enumerate(zip(prompts, rows)):
        for node in range(row.size):
            seq = prompt + [row.tokens[i] for i in _path(row, node)]
            # the engine's own chain forward of the path (same kernels): equal to round-off
            fresh = target.new_cache(1, 64)
            logits, aux = target.forward(TargetBatch.from_lists([seq], [0]), fresh)
            torch.testing.assert_close(every[b, node], logits[-1], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(fwd.aux[b, node], aux[-1], rtol=1e-10, atol=1e-10)
            # and Hugging Face's forward (its norms round through float32)
            with torch.no_grad():
                out = target.model(torch.tensor([seq]), output_hidden_states=True)
            torch.testing.assert_close(every[b, node], out.logits[0, -1], rtol=1e-5, atol=1e-6)
            want = torch.cat([out.hidden_states[i + 1][0, -1] for i in CAPTURE])
            torch.testing.assert_close(fwd.aux[b, node], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("place", list(PLACES))
def test_committed_path_kv_equals_a_chain_verify_of_the_path(target, place):
    capacity, cascade = PLACES[place]
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8], [2, 7]]
    rows = _trees()
    paths = [[0, 5, 6, 7], [0, 1], [0]]  # a branch path, a chain path, node 0 only
    cache, starts = _prefill(target, prompts, capacity)
    fwd = tree_forward(target, cache, flatten(rows, "cpu"), starts, TorchCascade() if cascade else None)
    assert (fwd.node_kv is None) == (place == "in_cache")
    width = max(map(len, paths))
    idx = torch.tensor([p + list(range(len(p), width)) for p in paths])
    commit_paths(cache, fwd, idx, starts)
    ref, _ = _prefill(target, prompts, capacity)
    toks = [[row.tokens[i] for i in p] for row, p in zip(rows, paths)]
    ref_logits, ref_aux = target.forward(TargetBatch.from_lists(toks, starts.tolist()), ref)
    for layer in range(target.num_layers):
        for b, p in enumerate(paths):
            end = int(starts[b]) + len(p)
            torch.testing.assert_close(cache.k[layer][b, :, :end], ref.k[layer][b, :, :end], rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(cache.v[layer][b, :, :end], ref.v[layer][b, :, :end], rtol=1e-9, atol=1e-9)
    feats = gather_nodes(fwd.aux, idx)
    offset = 0
    for b, p in enumerate(paths):
        torch.testing.assert_close(feats[b, : len(p)], ref_aux[offset : offset + len(p)], rtol=1e-9, atol=1e-9)
        offset += len(p)


def test_flatten_matches_a_walk_up_every_node():
    """The batched ancestor matrix against following parents node by node, on random trees of
    different sizes (so rows are padded); padding nodes see themselves only."""
    gen = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(7):
        chain = torch.randint(0, 50, (int(torch.randint(0, 9, (1,), generator=gen)),), generator=gen).tolist()
        branches = []
        for slot in range(1, len(chain) + 1):
            if torch.rand((), generator=gen) < 0.5:
                length = int(torch.randint(1, 4, (1,), generator=gen))
                branches.append(Branch(slot, torch.randint(0, 50, (length,), generator=gen).tolist()))
        rows.append(build_row(int(torch.randint(0, 50, (1,), generator=gen)), chain, branches))
    flat = flatten(rows, "cpu")
    n = max(r.size for r in rows)
    assert flat.ancestors.shape == (len(rows), n, n) and flat.ancestors.dtype == torch.bool
    for b, row in enumerate(rows):
        assert flat.tokens[b, : row.size].tolist() == row.tokens and not flat.tokens[b, row.size:].any()
        assert flat.depths[b, : row.size].tolist() == row.depths and not flat.depths[b, row.size:].any()
        for node in range(n):
            want = {node}
            p = row.parents[node] if node < row.size else -1
            while p >= 0:
                want.add(p)
                p = row.parents[p]
            assert set(flat.ancestors[b, node].nonzero().flatten().tolist()) == want, (b, node)
    assert flat.sizes.tolist() == [r.size for r in rows]


def test_flatten_dispatches_as_many_torch_ops_for_32_rows_as_for_2():
    """On a GPU each torch op is a launch or more: flattening trees node by node dispatched three
    ops a node (2,100 a step at c=32). The batched flatten's count does not grow with the batch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    row = _trees()[0]
    counts = []
    for bs in (2, 32):
        Count.ops = 0
        with Count():
            flatten([row] * bs, "cpu")
        counts.append(Count.ops)
    assert counts[0] == counts[1] and counts[1] < 20, counts


def test_parents_that_loop_are_refused_not_walked_forever():
    from sglang_adaflash.d2sd.tree import TreeRow

    with pytest.raises(ValueError, match="cycle"):
        flatten([TreeRow([1, 2, 3], [-1, 2, 1], [0, 1, 2], [None] * 3)], "cpu")


def test_nodes_kv_reads_the_same_kv_from_the_cache_as_kept_aside(target):
    """The in-cache forward's node K/V, read back by index, equal the ones a cascade keeps aside."""
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8], [2, 7]]
    flat = flatten(_trees(), "cpu")
    got = []
    for cascade in (None, TorchCascade()):
        cache, starts = _prefill(target, prompts)
        fwd = tree_forward(target, cache, flat, starts, cascade)
        got.append(fwd.nodes_kv(cache, starts))
    for (k, v), (k_aside, v_aside) in zip(*got):
        torch.testing.assert_close(k, k_aside, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(v, v_aside, rtol=1e-10, atol=1e-10)
