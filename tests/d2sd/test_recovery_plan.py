"""Recovery points and the branch plan: first-fail probabilities, top-K placement, and the
expected-gain-per-cost rule shrinking the tree to a chain as verify tokens get dear."""

import pytest
import torch

from sglang_adaflash.d2sd.recovery import TreeCost, candidates, chain_tau, first_fail, plan_branches


def test_first_fail_is_a_distribution_over_the_first_rejection():
    conf = torch.tensor([[0.9, 0.5, 0.8, 0.3]])
    f = first_fail(conf)
    want = torch.tensor([[0.1, 0.9 * 0.5, 0.9 * 0.5 * 0.2, 0.9 * 0.5 * 0.8 * 0.7]])
    torch.testing.assert_close(f, want)
    # the chain either fails at some slot or survives all of them
    torch.testing.assert_close(f.sum() + conf.prod(), torch.tensor(1.0))
    torch.testing.assert_close(chain_tau(conf, torch.tensor([5])), torch.tensor([1 + 0.9 + 0.45 + 0.36 + 0.108]))


def test_candidates_are_the_likeliest_first_failures_inside_the_chain():
    conf = torch.tensor([[0.9, 0.5, 0.8, 0.3], [0.2, 0.9, 0.9, 0.9]])
    slots, f = candidates(conf, torch.tensor([5, 3]), k=2)
    assert slots[0].tolist() == [2, 4]  # f = .1, .45, .09, .252
    assert slots[1].tolist() == [1, 2]  # slots 3, 4 lie outside a chain of length 3
    assert (f[1] > 0).all()
    slots, f = candidates(conf, torch.tensor([5, 2]), k=2)
    assert f[1, 1] == 0  # a chain of 2 has one recovery slot


def _plan(bs, cost, k=2, branch_len=4):
    conf = torch.tensor([[0.95, 0.6, 0.9, 0.5, 0.9, 0.9, 0.9]]).repeat(bs, 1)
    rho = torch.full_like(conf, 0.8)
    return plan_branches(conf, rho, torch.full((bs,), 8), k=k, branch_len=branch_len, beta=0.7, cost=cost)


def test_cheap_verify_takes_whole_branches_and_dear_verify_a_chain():
    cheap = _plan(1, TreeCost(fixed=1.0, per_token=1e-3, per_branch=1e-3, branch_fixed=1e-3))
    assert cheap.lengths.tolist() == [[4, 4]]
    dear = _plan(1, TreeCost(fixed=1e-3, per_token=1.0, per_branch=1.0, branch_fixed=1.0))
    assert dear.lengths.sum() == 0


def test_the_tree_shrinks_as_the_batch_grows():
    """fixed = one step's cost whatever the batch; verified tokens cost per token."""
    sizes = []
    for bs in (1, 8, 64):
        cost = TreeCost(fixed=0.03, per_token=5e-4, per_branch=2e-4, branch_fixed=2e-3)
        sizes.append(int(_plan(bs, cost).lengths.sum()) / bs)
    assert sizes[0] > sizes[1] >= sizes[2]
    assert sizes[2] == 0


def test_fixed_rule_takes_every_candidate_whole():
    plan = _plan(3, None, k=3, branch_len=2)
    assert (plan.lengths == 2).all()


def test_plan_is_the_best_tokens_per_second_by_enumeration():
    import itertools

    g = torch.Generator().manual_seed(0)
    for trial in range(6):
        conf = torch.rand(2, 6, generator=g) * 0.6 + 0.35
        rho_all = torch.rand(2, 6, generator=g)
        lengths = torch.tensor([7, 5])
        cost = TreeCost(fixed=float(torch.rand((), generator=g)) * 0.05 + 0.005, per_token=1e-3,
                        per_branch=float(torch.rand((), generator=g)) * 2e-3, branch_fixed=2e-3)
        plan = plan_branches(conf, rho_all, lengths, k=2, branch_len=3, beta=0.6, cost=cost)
        slots, f = candidates(conf, lengths, 2)
        rho = rho_all.gather(1, slots - 1)
        room = (lengths[:, None] - slots).clamp(min=0).clamp(max=3)
        base = float(chain_tau(conf, lengths).sum())
        best = 0.0
        for ls in itertools.product(range(4), repeat=4):
            ls = torch.tensor(ls).view(2, 2)
            if (ls > room).any():
                continue
            gain = sum(float(f[i, j] * rho[i, j]) * sum(0.6 ** s for s in range(int(ls[i, j])))
                       for i in range(2) for j in range(2))
            spent = cost.fixed + float(ls.sum() + lengths.sum()) * cost.per_token + cost.per_branch * int((ls > 0).sum())
            spent += cost.branch_fixed * bool((ls > 0).any())
            best = max(best, (base + gain) / spent)
        assert plan.value >= best * (1 - 1e-5), (trial, plan.value, best)


def test_trimmed_chain_keeps_the_slots_that_pay():
    from sglang_adaflash.d2sd.recovery import plan_tree

    conf = torch.tensor([[0.9, 0.8, 0.5, 0.3, 0.2, 0.2, 0.2]])
    cap = torch.tensor([8])
    cheap = plan_tree(conf, conf * 0, cap, k=0, branch_len=1, beta=0.5,
                      cost=TreeCost(fixed=1.0, per_token=1e-4), trim_chain=True)
    assert cheap.chain.tolist() == [8]
    dear = plan_tree(conf, conf * 0, cap, k=0, branch_len=1, beta=0.5,
                     cost=TreeCost(fixed=1e-3, per_token=1.0), trim_chain=True)
    assert dear.chain.tolist() == [2]  # one proposal at least
    mid = plan_tree(conf, conf * 0, cap, k=0, branch_len=1, beta=0.5,
                    cost=TreeCost(fixed=0.01, per_token=0.01), trim_chain=True)
    assert 2 < mid.chain.item() < 8
    reach = torch.cumprod(conf, 1)[0]
    kept = mid.chain.item() - 1
    # the last kept slot survives at least as often as the plan's price per verified token asks
    assert reach[kept - 1] >= mid.value * 0.01 * (1 - 1e-6) or kept == 1


@pytest.mark.parametrize("drafter_cost", [True, False])
def test_plan_with_alternatives_is_the_best_by_enumeration(drafter_cost):
    """Each branch may add up to two one-node alternatives (worth f * rho_w, one verified token
    each, only beside a branch, a prefix of the ranking); the plan beats every enumerated tree.
    Without drafter cost (branches from the first drafter: verify tokens only) the plan makes
    one pass over the price, there being no shared cost to weigh against no branch at all."""
    import itertools

    alts = (0.25, 0.1)
    g = torch.Generator().manual_seed(1)
    used = 0
    for trial in range(6):
        conf = torch.rand(2, 6, generator=g) * 0.6 + 0.3
        rho_all = torch.rand(2, 6, generator=g) * 0.6
        lengths = torch.tensor([7, 6])
        scale = float(torch.rand((), generator=g)) * 2e-3
        cost = TreeCost(fixed=float(torch.rand((), generator=g)) * 0.03 + 0.004, per_token=1e-3,
                        per_branch=scale if drafter_cost else 0.0, branch_fixed=1e-3 if drafter_cost else 0.0)
        plan = plan_branches(conf, rho_all, lengths, k=2, branch_len=2, beta=0.5, cost=cost, alts=alts)
        slots, f = candidates(conf, lengths, 2)
        rho = rho_all.gather(1, slots - 1)
        room = (lengths[:, None] - slots).clamp(min=0).clamp(max=2)
        base = float(chain_tau(conf, lengths).sum())
        best = 0.0
        for choice in itertools.product([(ln, m) for ln in range(3) for m in range(3) if ln or not m], repeat=4):
            ls = torch.tensor([c[0] for c in choice]).view(2, 2)
            ms = torch.tensor([c[1] for c in choice]).view(2, 2)
            if (ls > room).any():
                continue
            gain = sum(float(f[i, j] * rho[i, j]) * sum(0.5 ** s for s in range(int(ls[i, j])))
                       + float(f[i, j]) * sum(alts[: int(ms[i, j])]) for i in range(2) for j in range(2))
            spent = cost.fixed + float(ls.sum() + ms.sum() + lengths.sum()) * cost.per_token
            spent += cost.per_branch * int((ls > 0).sum()) + cost.branch_fixed * bool((ls > 0).any())
            best = max(best, (base + gain) / spent)
        assert plan.value >= best * (1 - 1e-5), (trial, plan.value, best)
        for start in (0.4 * best, 3.0 * best):  # a warm first price, too low or too high, ends there too
            warm = plan_branches(conf, rho_all, lengths, k=2, branch_len=2, beta=0.5, cost=cost, alts=alts,
                                 start=start)
            assert warm.value >= best * (1 - 1e-5), (trial, start, warm.value, best)
        # and the value it reports is that of the tree it returns
        ls, ms = plan.lengths, plan.extra
        assert ((ms == 0) | (ls > 0)).all() and (ms <= len(alts)).all()
        gain = sum(float(f[i, j] * rho[i, j]) * sum(0.5 ** s for s in range(int(ls[i, j])))
                   + float(f[i, j]) * sum(alts[: int(ms[i, j])]) for i in range(2) for j in range(2))
        spent = cost.fixed + float(ls.sum() + ms.sum() + lengths.sum()) * cost.per_token
        spent += cost.per_branch * int((ls > 0).sum()) + cost.branch_fixed * bool((ls > 0).any())
        assert abs((base + gain) / spent - plan.value) <= 1e-6 * plan.value  # float32 inputs
        used += int(plan.extra.sum() > 0)
    assert 0 < used < 6 or (not drafter_cost and used), used  # some plans take alternatives and some do not


def test_fixed_rule_takes_every_alternative():
    plan = _plan(2, None, k=2, branch_len=3)
    assert (plan.extra == 0).all()
    conf = torch.tensor([[0.95, 0.6, 0.9, 0.5, 0.9, 0.9, 0.9]])
    plan = plan_branches(conf, conf * 0 + 0.5, torch.tensor([8]), k=2, branch_len=3, beta=0.7, cost=None, alts=(0.2, 0.1))
    assert plan.extra.tolist() == [[2, 2]]


def test_a_branch_worth_it_only_for_its_alternatives_is_taken():
    """The branch's own token is rarely right but its alternatives often are: the plan pays the
    recovery rows for the alternatives' sake."""
    conf = torch.tensor([[0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]])
    cost = TreeCost(fixed=0.01, per_token=1e-4, per_branch=5e-4, branch_fixed=5e-4)
    plan = plan_branches(conf, conf * 0 + 0.01, torch.tensor([8]), k=1, branch_len=2, beta=0.1, cost=cost,
                         alts=(0.6, 0.3))
    assert plan.lengths.tolist() == [[1]] and plan.extra.tolist() == [[2]]
    alone = plan_branches(conf, conf * 0 + 0.01, torch.tensor([8]), k=1, branch_len=2, beta=0.1, cost=cost)
    assert alone.lengths.tolist() == [[0]]


def _best_by_enumeration(conf, rho, lengths, cost, *, lmax, alts, beta, drafter_cost, k=2):
    """The best tokens per second over every tree of one source (branch lengths 0..lmax, a
    prefix of the alternatives beside each branch)."""
    import itertools

    slots, f = candidates(conf, lengths, k)
    rho = rho.gather(1, slots - 1)
    room = (lengths[:, None] - slots).clamp(min=0).clamp(max=lmax)
    base = float(chain_tau(conf, lengths).sum())
    best = 0.0
    n = conf.shape[0]
    opts = [(ln, m) for ln in range(lmax + 1) for m in range(len(alts) + 1) if ln or not m]
    for choice in itertools.product(opts, repeat=n * k):
        ls = torch.tensor([c[0] for c in choice]).view(n, k)
        ms = torch.tensor([c[1] for c in choice]).view(n, k)
        if (ls > room).any():
            continue
        gain = sum(float(f[i, j] * rho[i, j]) * sum(beta ** s for s in range(int(ls[i, j])))
                   + float(f[i, j]) * sum(alts[: int(ms[i, j])]) for i in range(n) for j in range(k))
        spent = cost.fixed + float(ls.sum() + ms.sum() + lengths.sum()) * cost.per_token
        if drafter_cost:
            spent += cost.per_branch * int((ls > 0).sum()) + cost.branch_fixed * bool((ls > 0).any())
        best = max(best, (base + gain) / spent)
    return best


def test_auto_plan_is_the_better_source_by_enumeration():
    """--branch-drafter auto: the recovery drafter's tree (paid drafter rows, branches of up to 2
    tokens, one more alternative) against the first drafter's next-ranked tokens (one node each,
    verify tokens only, two ranks); the plan beats every tree of either and names its source.
    Cases are drawn so that each source wins some of them."""
    g = torch.Generator().manual_seed(3)
    won = set()
    for trial in range(10):
        conf = torch.rand(2, 6, generator=g) * 0.6 + 0.3
        rho_all = torch.rand(2, 6, generator=g) * 0.6 + 0.4
        lengths = torch.tensor([7, 6])
        cost = TreeCost(fixed=float(torch.rand((), generator=g)) * 0.02 + 0.004, per_token=1e-3,
                        per_branch=float(torch.rand((), generator=g)) * 1e-3,
                        branch_fixed=float(torch.rand((), generator=g)) * 2e-3)
        first_rates = tuple(float(x) for x in torch.rand(2, generator=g) * 0.6)
        plan = plan_branches(conf, rho_all, lengths, k=2, branch_len=2, beta=0.5, cost=cost, alts=(0.2,),
                             first_rates=first_rates)
        rec = _best_by_enumeration(conf, rho_all, lengths, cost, lmax=2, alts=(0.2,), beta=0.5, drafter_cost=True)
        first = _best_by_enumeration(conf, torch.full_like(conf, first_rates[0]), lengths, cost, lmax=1,
                                     alts=first_rates[1:], beta=0.5, drafter_cost=False)
        assert plan.value >= max(rec, first) * (1 - 1e-5), (trial, plan.value, rec, first)
        if abs(rec - first) > 1e-4 * max(rec, first):
            assert plan.source == ("recovery" if rec > first else "first"), (trial, rec, first, plan.source)
            won.add(plan.source)
        if plan.source == "first":
            assert (plan.lengths <= 1).all()
    assert won == {"recovery", "first"}, won


def _random_plan_inputs(gen):
    n, s = int(gen.integers(1, 3)), int(gen.integers(2, 16))
    conf = torch.from_numpy(gen.uniform(0.02, 0.99, (n, s)))
    rho = gen.uniform(0.0, 0.9, (n, s))
    w = int(gen.integers(1, 5))
    kw = dict(k=int(gen.integers(0, 5)), branch_len=gen.integers(1, 5, s), beta=float(gen.uniform(0.1, 0.9)),
              alts=gen.uniform(0.0, 0.4, (s, w - 1)), trim_chain=bool(gen.integers(0, 2)),
              start=float(gen.choice([0.0, gen.uniform(0.5, 400.0)])))
    if gen.integers(0, 3) == 0:  # rates of exactly 0 (ties between choices at the zero price)
        rho[gen.uniform(size=rho.shape) < 0.5] = 0.0
        kw["alts"][gen.uniform(size=kw["alts"].shape) < 0.5] = 0.0
    if gen.integers(0, 3) == 0:  # --branch-drafter auto: the first drafter's ranks priced too
        kw["first_rates"] = list(gen.uniform(0.0, 0.5, w))
        kw["first_start"] = float(gen.uniform(0.0, 400.0))
    scale = 10.0 ** gen.uniform(-5, -2)  # verify tokens from nearly free to a step's worth
    cost = TreeCost(fixed=float(gen.uniform(0.002, 0.02)), per_token=float(scale),
                    per_branch=float(gen.choice([0.0, gen.uniform(0, 1e-3)])),
                    branch_fixed=float(gen.choice([0.0, gen.uniform(0, 3e-3)])))
    cap = torch.from_numpy(gen.integers(1, s + 2, n))
    return conf, rho, cap, cost, kw


def test_the_row_by_row_plan_is_the_numpy_plan(monkeypatch):
    """plan_tree makes the plan of one or two rows in plain Python (recovery._RowPlanner): on
    random rows, rates, costs, prices and options it must give the numpy path's plan."""
    import numpy as np

    from sglang_adaflash.d2sd import recovery

    gen = np.random.default_rng(7)
    branched = 0
    for case in range(400):
        conf, rho, cap, cost, kw = _random_plan_inputs(gen)
        plans = []
        for rows in (0, 2):  # 0: every plan through numpy; 2: these through the Python rows
            monkeypatch.setattr(recovery, "SMALL_PLAN_ROWS", rows)
            plans.append(recovery.plan_tree(conf, rho, cap, cost=cost, **kw))
        want, got = plans
        for field in ("slots", "lengths", "chain", "extra"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (case, field, want, got)
        assert got.value == pytest.approx(want.value, rel=1e-12) and got.source == want.source, case
        branched += bool(want.lengths.any())
    assert 100 < branched < 390, branched  # trees and chains both among the cases
