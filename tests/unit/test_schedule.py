"""moelayers.schedule (request scheduler, token rebatch, shuffled collectives) and SemanticMoE in one
process."""

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import moelayers as ml
from moelayers.planning.semantic_eval import evaluate_tp
from moelayers.planning.semantic import SemanticPlan
from moelayers.planning.semantic_solvers import plan_semantic
from moelayers.schedule import (
    LayerTables,
    RoundRobinScheduler,
    SemanticScheduler,
    inverse_permutation,
    predict_ranks,
    rebatch,
    rebatch_tokens,
    shuffled_all_gather,
    shuffled_reduce_scatter,
)
from moelayers.schedule.token_shuffle import HistoryPredictor, capacity_ranks, even_capacity, rebatch_history
from moelayers.trace import synthetic_trace
from moelayers.testing import check_close
from tests.distributed.test_semantic import H, _norm, make_plan, weights64


# ---------------------------------------------------------------------- request schedulers
def _plan_for_requests(num_ranks=3, vocab=12):
    plan = make_plan(6, num_ranks, vocab=vocab, unseen=2)
    plan.token_rank[0] = np.arange(vocab) % num_ranks     # token v votes for rank v % R ...
    plan.token_conf[0] = 1.0                              # ... with weight 1, except the unseen
    plan.token_conf[0, vocab - 2:] = 0.0
    return plan


def test_round_robin():
    s = RoundRobinScheduler(3)
    assert [s.assign([1, 2]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    s.reset()
    assert s.assign(None) == 0
    assert RoundRobinScheduler(np.int64(2)).num_ranks == 2  # numpy ints, as SemanticScheduler takes them
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            RoundRobinScheduler(bad)
    with pytest.raises(ValueError, match="None or an int"):
        SemanticScheduler(_plan_for_requests(num_ranks=2), num_ranks=2.0)
    assert SemanticScheduler(_plan_for_requests(num_ranks=2), num_ranks=np.int64(2)).num_ranks == 2


def test_a_request_over_the_cap_everywhere_still_goes_where_it_votes():
    """Fewer requests than ranks, one long prompt: no rank can take it within 1.3x the mean, so it
    went to the least-loaded rank with the lowest index (rank 0) whatever it voted. Among the
    least-loaded ranks its votes (unmasked ranks first) now decide."""
    plan = make_plan(8, 4, vocab=12, unseen=2)
    plan.token_rank[0], plan.token_conf[0] = np.arange(12) % 4, 1.0  # token v votes for rank v % 4
    for batch in (False, True):
        s = SemanticScheduler(plan, total_tokens=30)  # cap 9.75
        reqs = [[3] * 20, [2] * 10]  # each over the cap, voting rank 3 and rank 2
        got = s.assign_batch(reqs) if batch else [s.assign(q) for q in reqs]
        assert got == [3, 2], (batch, got)
    s = SemanticScheduler(plan, total_tokens=12)  # cap 3.9: rank 1 is least loaded after the first two
    assert [s.assign(q) for q in ([1] * 2, [0] * 2, [1] * 8)] == [1, 0, 2]
    with pytest.raises(ValueError):
        RoundRobinScheduler(0)


def test_semantic_scheduler_affinity_mask_and_reset():
    s = SemanticScheduler(_plan_for_requests())
    np.testing.assert_allclose(s.scores([0, 3, 4, 10, 11]), [2.0, 1.0, 0.0])  # 10, 11 unseen (confidence 0)
    assert s.assign(torch.tensor([2, 5, 0])) == 2  # affinity
    assert s.assign([1, 4, 7, 2]) == 1
    assert s.assign([1, 4, 7]) == 0  # 1 is masked (and 2): the only rank left
    assert not s.mask.any()  # every rank taken: the mask was reset
    # all requests want rank 0: balanced anyway, R consecutive requests on R different ranks
    assert [s.assign([0, 3, 6]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert s.loads.tolist() == [3, 3, 3]
    assert s.assign([]) == 0 and s.assign(np.array([10, 11])) == 1  # no votes: lowest unmasked rank
    s.reset()
    assert s.loads.sum() == 0 and not s.mask.any()


def test_a_batch_handed_to_assign_is_refused():
    """A tokenizer's [B, S] batch given to assign was flattened into one request: all B prompts
    went to one rank without a word (a new-user journey). [1, S] is one request."""
    s = SemanticScheduler(_plan_for_requests())
    assert s.assign(torch.tensor([[2, 5, 0]])) == 2  # [1, S]: the request [2, 5, 0]
    np.testing.assert_allclose(s.scores(np.array([[0, 3, 4]])), s.scores([0, 3, 4]))
    loads = s.loads.copy()
    for batch in (torch.tensor([[2, 5, 0], [1, 4, 7]]), [[2, 5], [1, 4]], np.zeros((1, 2, 3), np.int64)):
        with pytest.raises(ValueError, match=r"must be \[N\] \(or \[1, N\]\), got shape .*assign_batch"):
            s.assign(batch)
        with pytest.raises(ValueError, match="assign_batch"):
            s.assign_batch([batch])
    assert (s.loads == loads).all()  # nothing assigned by the refused calls
    rows = [[2, 5, 0], [1, 4, 7], [0, 3, 6]]  # a [B, S] tensor to assign_batch: its rows, one request each
    assert SemanticScheduler(_plan_for_requests()).assign_batch(torch.tensor(rows)) == [2, 1, 0]
    assert SemanticScheduler(_plan_for_requests()).assign_batch(rows) == [2, 1, 0]


def test_a_ragged_batch_to_assign_and_one_request_to_assign_batch_are_refused():
    """A tokenizer's unpadded batch (a ragged list of lists) to assign got numpy's "inhomogeneous
    shape" without a word of assign_batch; one request's ids to assign_batch became one request per
    token, spread over the ranks without a word."""
    s = SemanticScheduler(_plan_for_requests())
    with pytest.raises(ValueError, match=r"got a ragged sequence .*assign_batch"):
        s.assign([[2, 5, 0], [1, 4]])
    for one in ([2, 5, 0], torch.tensor([2, 5, 0]), np.array([2, 5, 0])):
        with pytest.raises(ValueError, match=r"requests\[0\] is one token id.*call assign\(token_ids\)"):
            s.assign_batch(one)
    assert s.loads.sum() == 0
    assert s.assign_batch([[2, 5, 0], [1, 4]]) == [2, 1]  # a ragged batch is assign_batch's


def test_semantic_scheduler_token_cap_is_the_evaluations():
    """Given the total tokens, the online scheduler closes ranks at 1.3x the mean exactly as the
    held-out evaluation (request_schedule) does without its look-ahead; without the total, the mask
    alone balances."""
    from moelayers.planning.semantic_eval import request_schedule

    plan = _plan_for_requests(num_ranks=2)
    reqs = [[0, 2, 4, 6, 8, 0, 2, 4, 6, 8], [0]] * 3  # 10, 1, 10, 1, 10, 1 tokens, all voting for rank 0
    lengths = np.array([len(q) for q in reqs])
    capped = SemanticScheduler(plan, total_tokens=int(lengths.sum()))
    got = [capped.assign(q) for q in reqs]
    scores = np.stack([SemanticScheduler(plan).scores(q) for q in reqs])
    assert got == request_schedule(scores, lengths, 2, lookahead=False).tolist()
    assert capped.token_loads.max() <= 1.3 * lengths.sum() / 2 and capped.token_loads.tolist() == [21, 12]
    free = SemanticScheduler(plan)
    assert [free.assign(q) for q in reqs] == [0, 1] * 3 and free.token_loads.tolist() == [30, 3]
    rng = np.random.default_rng(0)  # random requests and lengths: the same schedule
    for r in (2, 3):
        plan = _plan_for_requests(num_ranks=r)
        reqs = [rng.integers(0, 12, size=rng.integers(1, 40)) for _ in range(50)]
        lengths = np.array([q.size for q in reqs])
        online = SemanticScheduler(plan, total_tokens=int(lengths.sum()))
        scores = np.stack([online.scores(q) for q in reqs])
        assert [online.assign(q) for q in reqs] == request_schedule(scores, lengths, r, lookahead=False).tolist()
        batch = SemanticScheduler(plan, total_tokens=int(lengths.sum()))
        assert batch.assign_batch(reqs) == request_schedule(scores, lengths, r, lookahead=False, joint=True).tolist()
    for _ in range(100):  # heavy-tailed lengths, where a look-ahead would change the schedule
        plan = _plan_for_requests(num_ranks=3)
        reqs = [rng.integers(0, 12, size=int(rng.choice([3, 5, 40, 120]))) for _ in range(12)]
        lengths = np.array([q.size for q in reqs])
        online = SemanticScheduler(plan, total_tokens=int(lengths.sum()))
        scores = np.stack([online.scores(q) for q in reqs])
        assert [online.assign(q) for q in reqs] == request_schedule(scores, lengths, 3, lookahead=False).tolist()
        batch = SemanticScheduler(plan, total_tokens=int(lengths.sum()))
        assert batch.assign_batch(reqs) == request_schedule(scores, lengths, 3, lookahead=False, joint=True).tolist()
    with pytest.raises(ValueError, match="total_tokens"):
        SemanticScheduler(plan, total_tokens=-1)
    with pytest.raises(ValueError, match="max_ratio"):
        SemanticScheduler(plan, total_tokens=10, max_ratio=0.5)


def test_assign_batch_gives_a_mask_cycle_the_best_total_vote():
    """A cycle of requests is assigned jointly: the one that cares most gets the contested rank, the
    one that cares less its second choice (one by one, the first request would take the rank that
    the second needs)."""
    plan = _plan_for_requests(num_ranks=2)
    reqs = [[0, 2, 1], [0, 2, 4]]  # votes [2, 1] and [3, 0]: one by one 0 then 1 (total 2), jointly 1, 0 (total 4)
    assert [SemanticScheduler(plan).assign(q) for q in reqs] == [0, 0]  # a fresh scheduler each: both want 0
    one_by_one = SemanticScheduler(plan)
    assert [one_by_one.assign(q) for q in reqs] == [0, 1]
    joint = SemanticScheduler(plan)
    assert joint.assign_batch(reqs) == [1, 0]
    assert joint.loads.tolist() == [1, 1] and joint.token_loads.tolist() == [3, 3] and not joint.mask.any()
    assert joint.assign_batch(reqs, joint=False) == [0, 1]  # the same as assign in turn
    assert joint.assign_batch([]) == []
    # a batch that starts mid-cycle fills the unmasked ranks first: rank 0 is masked, so [0, 2, 4] takes 1
    mid = SemanticScheduler(plan)
    assert mid.assign([0]) == 0 and mid.assign_batch([[0, 2, 4], [0, 2, 1]]) == [1, 0]
    # a bad id anywhere in the batch: an error before anything is assigned
    bad = SemanticScheduler(plan)
    with pytest.raises(ValueError, match="outside the plan's vocabulary"):
        bad.assign_batch([[0, 1], [99]])
    assert bad.loads.sum() == 0 and bad.token_loads.sum() == 0 and not bad.mask.any()
    rr = RoundRobinScheduler(3)
    assert rr.assign_batch([[1], [2], [3], [4]]) == [0, 1, 2, 0] and rr.assign() == 1  # the turn moved on
    counted = SemanticScheduler(plan)
    counted.assign([0], num_tokens=8)  # a prompt of 8 tokens, voting with its first
    assert counted.token_loads.sum() == 8
    by_numpy = SemanticScheduler(plan, layer=np.int64(0))
    assert by_numpy.assign_batch(reqs) == SemanticScheduler(plan, layer=0).assign_batch(reqs)


def test_semantic_scheduler_token_ids_outside_the_plans_vocabulary():
    """An id >= the plan's vocab_size (or < 0) is an error naming vocab_size and the id, not a
    silently dropped vote (the plan was made for another vocabulary)."""
    plan = _plan_for_requests(vocab=12)
    plan.source = "/some/plan.npz"
    s = SemanticScheduler(plan)
    for bad, ids in ((12, [0, 3, 12]), (99, [99, 1]), (-1, [4, -1])):
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the plan's vocabulary "
                                             rf"\[0, vocab_size=12\)") as e:
            s.assign(ids)
        assert "/some/plan.npz" in str(e.value)
        with pytest.raises(ValueError, match="vocab_size=12"):
            s.scores(np.array(ids))
    assert s.loads.sum() == 0 and not s.mask.any()  # a refused request changes nothing
    huge = np.array([3, 2**63 + 5], dtype=np.uint64)  # above int64: named as it is, not wrapped negative
    with pytest.raises(ValueError, match=rf"token id {2**63 + 5} is outside"):
        s.assign(huge)
    assert s.assign(np.array([11, 0], dtype=np.uint64)) == 0  # uint64 ids inside the vocabulary are fine
    s.reset()
    assert s.assign([11, 0]) == 0  # the last id of the vocabulary is fine


def test_semantic_scheduler_errors():
    plan = _plan_for_requests()
    with pytest.raises(ValueError, match="3 ranks"):
        SemanticScheduler(plan, num_ranks=4)
    with pytest.raises(ValueError, match="out of range"):
        SemanticScheduler(plan, layer=5)
    with pytest.raises(ValueError, match=">= 0"):
        SemanticScheduler(plan).assign([1, -2])
    with pytest.raises(TypeError):
        SemanticScheduler(plan).assign([0.5])
    plan.token_rank, plan.token_conf = plan.token_rank[0], plan.token_conf[0]  # a single shared [V] table
    assert SemanticScheduler(plan).assign([1, 1, 2]) == 1


# ---------------------------------------------------------------------- prediction
def _tables(num_ranks=3):
    tr = torch.tensor([0, 1, 2, 2, -1, 0])
    tc = torch.tensor([0.9, 0.2, 0.5, 0.0, 0.0, 0.3])
    nr = torch.arange(num_ranks * num_ranks).view(num_ranks, num_ranks) % num_ranks
    nc = torch.full((num_ranks, num_ranks), 0.4)
    nc[0, 0] = 0.0
    return LayerTables(tr, tc, nr, nc)


def test_predict_ranks_takes_the_more_confident_table():
    t = _tables()
    ids = torch.tensor([0, 1, 2, 3, 4, 9, 5, 1])
    pred, conf = predict_ranks(ids, t)  # T only; id 4 has rank -1, id 9 is outside the vocabulary
    assert pred.tolist() == [0, 1, 2, 2, -1, -1, 0, 1]
    assert torch.allclose(conf, torch.tensor([0.9, 0.2, 0.5, 0.0, 0.0, 0.0, 0.3, 0.2]))
    prev = torch.tensor([[1, 1, 1, 1, 1, 1, 0, -1], [2, 2, 2, 2, 2, 2, 0, 2]])  # A: rank (1*3+2)%3 = 2, conf 0.4
    pred, conf = predict_ranks(ids, t, prev)
    assert pred.tolist() == [0, 2, 2, 2, 2, 2, 0, 1]  # A wins where more confident; [0,0] has conf 0; -1 unknown
    assert torch.allclose(conf, torch.tensor([0.9, 0.4, 0.5, 0.4, 0.4, 0.4, 0.3, 0.2]))
    assert predict_ranks(ids, t, (None, prev[1]))[0].tolist() == predict_ranks(ids, t)[0].tolist()  # A needs both
    with pytest.raises(ValueError):
        predict_ranks(ids, t, prev[:1])
    with pytest.raises(TypeError):
        predict_ranks(ids.float(), t)
    # as the history predictor: numpy ranks are taken, float and bool ones refused (2.25 was rank 2)
    assert predict_ranks(ids, t, prev.numpy())[0].tolist() == pred.tolist()
    for bad in (prev.double() + 0.25, prev.bool()):
        with pytest.raises(TypeError, match="prev_ranks entries must be integer ranks"):
            predict_ranks(ids, t, bad)


def test_layer_tables_from_plan_checks():
    plan = make_plan(8, 2)
    tables = LayerTables.from_plan(plan, 2)
    assert tables.num_ranks == 2 and tables.vocab_size == plan.vocab_size
    with pytest.raises(ValueError, match="out of range"):
        LayerTables.from_plan(plan, 3)
    plan.ngram_rank = plan.ngram_rank[:, :1]
    with pytest.raises(ValueError, match="ngram"):
        LayerTables.from_plan(plan, 0)


# ---------------------------------------------------------------------- rebatch
def _check_rebatch(rb, pred, conf, t, r):
    c = -(-t // r)
    assert rb.chunk_size == c and rb.perm.numel() == r * c and rb.num_dummies == r * c - t < r
    real = rb.perm[rb.perm >= 0]
    assert sorted(real.tolist()) == list(range(t))  # every token exactly once
    assert torch.equal(rb.perm[rb.inverse], torch.arange(t)) and torch.equal(rb.rank, rb.inverse // max(c, 1))
    assert torch.equal(rb.inverse, inverse_permutation(rb.perm, t))
    for q in range(r):
        chunk = rb.chunk(q)
        n = rb.valid_rows(q)
        assert (chunk[:n] >= 0).all() and (chunk[n:] < 0).all()  # real rows first, at most one dummy
        mine = pred == q
        stay, gone = mine & (rb.rank == q), mine & (rb.rank != q)
        if gone.any():  # overflow only from a full rank, and only its least confident tokens
            assert int(stay.sum()) == n
            assert not stay.any() or conf[gone].max() <= conf[stay].min()
    dummies = [q for q in range(r) if rb.valid_rows(q) < c]
    assert dummies == list(range(r - (r * c - t), r))  # on the last chunks, as the held-out evaluation's


@pytest.mark.parametrize("t,r", [(0, 2), (1, 4), (3, 4), (8, 4), (13, 4), (50, 3), (64, 8)])
def test_rebatch_equal_chunks_and_overflow(t, r):
    gen = torch.Generator().manual_seed(t * 10 + r)
    pred = torch.randint(-1, r, (t,), generator=gen)
    pred[: t // 2] = 0  # rank 0 overflows
    conf = torch.randint(0, 5, (t,), generator=gen).float() / 4
    rb = rebatch(pred, conf, r)
    _check_rebatch(rb, pred, torch.where(pred >= 0, conf, 0.0), t, r)
    again = rebatch(pred.clone(), conf.clone(), r)
    assert torch.equal(rb.perm, again.perm)  # deterministic


def test_rebatch_without_plan_keeps_token_order():
    rb = rebatch_tokens(torch.arange(7), None, 3)
    assert rb.perm.tolist() == [0, 1, 2, 3, 4, -1, 5, 6, -1]  # no demand anywhere: dummies on the last ranks
    with pytest.raises(ValueError, match="ranks"):
        rebatch_tokens(torch.arange(7), _tables(3), 2)
    with pytest.raises(ValueError):
        rebatch(torch.zeros(3, dtype=torch.int64), torch.zeros(3), 0)


# ---------------------------------------------------------------------- history predictor: online == offline
@pytest.fixture(scope="module")
def fitted():
    train, held = synthetic_trace(200, 6, 16, 4, 500, seq_len=(8, 64), seed=3).split(0.6)
    return plan_semantic(train, 4, "tp", progress=False, history=3), held


def _history(trace, rows, layer, depth):
    """``[D', T, K]`` experts of ``rows`` at layers ``layer-1, layer-2, ...`` (``None`` at layer 0)."""
    d = min(depth, layer)
    if d == 0:
        return None
    return torch.as_tensor(trace.topk_ids[rows][:, [layer - j for j in range(1, d + 1)]].astype(np.int64)).permute(1, 0, 2)


@pytest.mark.parametrize("tps", [256, 64])
def test_online_rebatch_equals_offline_evaluation(fitted, tps):
    """Every batch the held-out evaluation cuts (tps tokens in file order, the last one partial),
    shuffled online from the token ids and the previous layers' experts: the same rank for every
    token, exactly tps / R tokens per rank (the partial batch: T // R, +1 on the first T % R ranks)."""
    plan, held = fitted
    _, offline = evaluate_tp(plan, held, tps)
    assert held.num_tokens % tps and held.num_tokens > 4 * tps  # a partial last batch too
    for start in range(0, held.num_tokens, tps):
        rows = np.arange(start, min(start + tps, held.num_tokens))
        ids = torch.as_tensor(held.token_ids[rows])
        for layer in range(held.num_layers):
            rb = rebatch_history(ids, HistoryPredictor.from_plan(plan, layer), 4, _history(held, rows, layer, 3))
            np.testing.assert_array_equal(rb.rank.numpy(), offline[rows, layer], err_msg=f"batch {start}, layer {layer}")
            counts = torch.bincount(rb.rank, minlength=4)
            assert counts.tolist() == [rows.size // 4 + (q < rows.size % 4) for q in range(4)]
            assert torch.equal(rb.perm[rb.inverse], torch.arange(rows.size))
            for q in range(4):  # chunk q: its tokens in token order, then at most one dummy
                chunk = rb.chunk(q)
                assert torch.equal(chunk[: rb.valid_rows(q)], torch.nonzero(rb.rank == q).flatten())


@pytest.mark.parametrize("tps", [256, 64])
def test_online_alg3_rebatch_equals_offline_with_unsure_tokens(fitted, tps):
    """Algorithm 3 (token table or n-gram, the more confident) online from the token ids and the
    previous two layers' ranks equals the held-out evaluation's, also for tokens whose confidence is
    0 (they still ask for their rank first, least sure; the evaluation used to send them to rank 0)."""
    from moelayers.planning.semantic import majority_rank

    plan, held = fitted
    path = Path(tempfile.mkdtemp()) / "p.npz"
    plan.save(path)
    plan = SemanticPlan.load(path)  # a copy to edit
    plan.token_logq = plan.history_pmi = plan.history_weight = None  # Algorithm 3 tables only
    plan.token_conf[:, ::3] = 0.0  # a third of the vocabulary: no confidence
    plan.ngram_conf[:, :, ::2] = 0.0
    _, offline = evaluate_tp(plan, held, tps)
    zero = plan.token_conf[0][held.token_ids] == 0
    assert zero.mean() > 0.2
    for start in range(0, held.num_tokens, tps):
        rows = np.arange(start, min(start + tps, held.num_tokens))
        ids = torch.as_tensor(held.token_ids[rows])
        for layer in range(held.num_layers):
            prev = None
            if layer >= 2:
                prev = torch.as_tensor(np.stack([majority_rank(held.topk_ids[rows, layer - d], plan.expert_rank[layer - d], 4)
                                                 for d in (2, 1)]))
            rb = rebatch_tokens(ids, LayerTables.from_plan(plan, layer), 4, prev)
            np.testing.assert_array_equal(rb.rank.numpy(), offline[rows, layer], err_msg=f"batch {start}, layer {layer}")


def test_history_predictor_refuses_a_layer_outside_the_plan(fitted):
    """layer=-1 read the last layer's table with no history (depth -1); layer=L an IndexError."""
    plan, _ = fitted
    for layer in (-1, plan.num_layers):
        with pytest.raises(ValueError, match=f"layer {layer!r} is out of range for a plan of {plan.num_layers}"):
            HistoryPredictor.from_plan(plan, layer)
    for layer in (True, 1.0):  # 1.0 was "out of range"
        with pytest.raises(TypeError, match=f"layer must be an int .*got {layer!r}"):
            HistoryPredictor.from_plan(plan, layer)
        with pytest.raises(TypeError, match=f"layer must be an int .*got {layer!r}"):
            LayerTables.from_plan(plan, layer)


def test_online_alg3_rebatch_equals_offline_in_batches_smaller_than_the_ranks(fitted):
    """With fewer tokens than ranks some rank has no room: online, a token predicted for it went
    with the overflow in token order; the evaluation sends it first to the lowest rank with room."""
    from moelayers.planning.semantic import majority_rank
    from moelayers.trace import RoutingTrace

    plan, held = fitted
    path = Path(tempfile.mkdtemp()) / "p.npz"
    plan.save(path)
    plan = SemanticPlan.load(path)
    plan.token_logq = plan.history_pmi = plan.history_weight = None  # Algorithm 3 tables only
    rng = np.random.default_rng(0)
    for trial in range(60):
        t = int(rng.integers(1, 9))
        rows = rng.integers(0, held.num_tokens, t)
        part = RoutingTrace(held.topk_ids[rows], held.token_ids[rows], np.array([0, t]), held.num_experts,
                            vocab_size=held.vocab_size)
        _, offline = evaluate_tp(plan, part, 4 * -(-t // 4))  # one batch of t tokens
        for layer in range(part.num_layers):
            prev = None
            if layer >= 2:
                prev = torch.as_tensor(np.stack([majority_rank(part.topk_ids[:, layer - d], plan.expert_rank[layer - d], 4)
                                                 for d in (2, 1)]))
            rb = rebatch_tokens(torch.as_tensor(part.token_ids), LayerTables.from_plan(plan, layer), 4, prev)
            np.testing.assert_array_equal(rb.rank.numpy(), offline[:, layer], err_msg=f"trial {trial}, layer {layer}")


def test_rebatch_tokens_gives_the_ranks_of_capacity_ranks():
    """The one-pass online rebatch equals capacity_ranks on the evaluation's scores (confidence on the
    predicted rank, -1 elsewhere), with ties, T < R and ids outside the table (no prediction)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(400):
        r = int(torch.randint(1, 9, (1,), generator=g))
        t = int(torch.randint(0, 30, (1,), generator=g))
        v = 20
        tables = LayerTables(torch.randint(0, r, (v,), generator=g), torch.randint(0, 4, (v,), generator=g) / 4.0,
                             torch.zeros(r, r, dtype=torch.int64), torch.zeros(r, r))
        ids = torch.randint(0, v + 5, (t,), generator=g)  # ids >= v: no prediction
        rb = rebatch_tokens(ids, tables, r)
        pred, conf = rb.pred, rb.conf
        scores = torch.full((t, r), -1.0)
        has = pred >= 0
        scores[has.nonzero().squeeze(1), pred[has]] = conf[has]
        assert torch.equal(rb.rank, capacity_ranks(scores, even_capacity(t, r))), (r, t)
        assert torch.bincount(rb.rank, minlength=r).tolist() == even_capacity(t, r).tolist()


def test_capacity_ranks_ties_and_overflow():
    scores = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.5], [0.2, 0.1], [0.0, 1.0]])
    # rank 0 holds 2: the two highest 1.0s win, ties to the earlier token; token 2 overflows, token 3 too
    assert capacity_ranks(scores, torch.tensor([2, 3])).tolist() == [0, 0, 1, 1, 1]
    assert capacity_ranks(scores[:0], torch.tensor([0, 0])).tolist() == []


def test_tiny_decoder_tp_carries_the_expert_history():
    """Attention-TP tiny decoder in one process: each SemanticMoE layer hands the next its experts
    and the previous ones' ([D', T, K], newest first), as the plan's predictor reads them."""
    from moelayers.models import TinyConfig, TinyDecoder

    one = plan_semantic(synthetic_trace(40, 3, 8, 2, 48, seq_len=(4, 16), seed=1), 1, "tp", progress=False, history=2)
    assert one.history_pmi is not None
    one.history_pmi[:] = 0.1  # some weight at every depth: the layers gather their context
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=8, top_k=2, params_dtype=torch.float64)
    groups = ml.ParallelGroups.single()
    model = TinyDecoder(TinyConfig(vocab_size=48, hidden_size=H, num_layers=3, num_heads=4, dtype=torch.float64),
                        lambda i: ml.SemanticMoE.from_plan(one, i, cfg, groups, mode="tp", seed=i), attention="tp",
                        groups=groups)
    with torch.no_grad():
        model(torch.randint(0, 48, (2, 5), generator=torch.Generator().manual_seed(0)))
    moes = model.moe_layers
    topk = [m.last_topk_ids for m in moes]
    assert torch.equal(moes[0].last_context_ranks, topk[0][None])
    assert torch.equal(moes[1].last_context_ranks, torch.stack([topk[1], topk[0]]))
    assert moes[2].last_context_ranks is None  # the last layer: nobody reads it


def test_shuffled_collectives_single_process():
    x = torch.randn(5, 4)
    perm = torch.tensor([3, 1, -1, 4, 0, 2])
    chunk = shuffled_reduce_scatter(x, perm, None)
    assert torch.equal(chunk[[0, 1, 3]], x[[3, 1, 4]]) and (chunk[2] == 0).all()
    assert torch.equal(shuffled_all_gather(chunk, perm, None), x)
    assert torch.equal(shuffled_all_gather(chunk, perm, None, inverse=inverse_permutation(perm, 5)), x)
    with pytest.raises(ValueError, match="do not fit"):
        shuffled_all_gather(chunk[:3], perm, None)
    with pytest.raises(ValueError, match=r"partial must be \[T, H\], got \[4\]"):
        shuffled_reduce_scatter(x[0], perm, None)
    with pytest.raises(ValueError, match=r"perm must be \[R\*C\]"):
        shuffled_reduce_scatter(x, perm.view(2, 3), None)


# ---------------------------------------------------------------------- SemanticMoE, one process
def _layer(mode, dtype=torch.float64, e=8, plan_seed=0, **kw):
    plan = make_plan(e, 1, seed=plan_seed, mode=mode)
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=e, top_k=2, params_dtype=dtype)
    layer = ml.SemanticMoE.from_plan(plan, 2, cfg, ml.ParallelGroups.single(), **kw)
    w64 = weights64(e)
    layer.load_full_weights(*(w.to(dtype) for w in w64))
    return layer, cfg, w64


@pytest.mark.parametrize("mode", ["dp", "tp"])
def test_semantic_moe_from_a_plan_under_the_meta_device(mode):
    """Deferred init: the plan's token tables were built on the meta device (no data: the
    constructor raised); they are host tables, and the layer then serves like one built on the CPU."""
    layer, cfg, w64 = _layer(mode)
    plan = make_plan(8, 1, seed=0, mode=mode)
    with torch.device("meta"):
        lazy = ml.SemanticMoE.from_plan(plan, 2, cfg, ml.ParallelGroups.single())
    assert lazy.router.weight.is_meta
    lazy.load_state_dict(layer.state_dict(), assign=True)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ids = torch.arange(9)
    with torch.no_grad():
        if mode == "dp":
            assert torch.equal(lazy(x, token_ids=ids), layer(x, token_ids=ids))
        else:
            norm = _norm(torch.float64)
            assert torch.equal(lazy.forward_tp(x, x, norm, token_ids=ids), layer.forward_tp(x, x, norm, token_ids=ids))


def test_semantic_moe_single_process_dp_and_tp():
    layer, cfg, w64 = _layer("dp")
    assert layer.mode == "dp"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, H, generator=g, dtype=torch.float64)
    assert check_close("dp", layer(x, token_ids=torch.arange(9)), ml.reference.moe_forward(x, *w64, cfg)) is None
    with pytest.raises(ValueError, match="mode='tp'"):
        layer.forward_tp(x, x, _norm(torch.float64), token_ids=torch.arange(9))

    layer, cfg, w64 = _layer("tp")
    assert layer.mode == "tp"
    partial, residual, norm = torch.randn(9, H, generator=g, dtype=torch.float64), x, _norm(torch.float64)
    first = torch.randint(0, 8, (9,), generator=g)
    forced = torch.stack([first, (first + 3) % 8], 1)  # replayed routing, two distinct experts per token
    layer.force_routing(forced)
    out = layer.forward_tp(partial, residual, norm, token_ids=torch.arange(9))
    h = residual + partial
    ref = h + ml.reference.moe_forward(norm(h), *w64, cfg, topk_ids=forced)
    assert check_close("tp forced", out, ref) is None
    assert layer.last_ranks.tolist() == [0] * 9
    out3 = layer.forward_tp(partial.view(3, 3, H), residual.view(3, 3, H), norm, token_ids=torch.arange(9).view(3, 3))
    assert out3.shape == (3, 3, H)
    assert check_close("tp 3d", out3.view(9, H), h + ml.reference.moe_forward(norm(h), *w64, cfg)) is None


def test_semantic_moe_errors():
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=8, top_k=2)
    single = ml.ParallelGroups.single()
    with pytest.raises(ValueError, match="field 'num_experts' is 16, but the model/parallel setup needs 8"):
        ml.SemanticMoE.from_plan(make_plan(16, 1), 0, cfg, single)
    with pytest.raises(ValueError, match="field 'num_ranks' is 2, but the model/parallel setup needs 1"):
        ml.SemanticMoE.from_plan(make_plan(8, 2), 0, cfg, single)
    with pytest.raises(ValueError, match="out of range"):
        ml.SemanticMoE.from_plan(make_plan(8, 1), 7, cfg, single)
    with pytest.raises(ValueError, match="mode"):
        ml.SemanticMoE(cfg, single, mode="ep")
    with pytest.raises(ValueError, match="predictor"):
        ml.SemanticMoE(cfg, single, mode="tp", predictor="oracle")
    with pytest.raises(TypeError, match="SemanticPlan"):
        ml.SemanticMoE(cfg, single, plan=object())
    # ep over 2 ranks, tp = 1, in one process: unchecked (ParallelGroups refuses ep=None with ep_size=2)
    fake = ml.ParallelGroups.__new__(ml.ParallelGroups)
    for name, value in zip(("ep", "tp", "dp", "ep_size", "ep_rank", "tp_size", "tp_rank", "dp_size", "dp_rank",
                            "world_size", "rank"), (None, None, None, 2, 0, 1, 0, 2, 0, 2, 0)):
        object.__setattr__(fake, name, value)
    with pytest.raises(ValueError, match="tp = ep"):
        ml.SemanticMoE(cfg, fake, mode="tp")
    # a tp plan's mode is taken when none is given: the message said "mode='tp'", which the caller never passed
    with pytest.raises(ValueError, match=r"plan was made for mode='tp' \(plan.mode.*pass mode='dp'"):
        ml.SemanticMoE.from_plan(make_plan(8, 2, mode="tp"), 0, cfg, fake)
    layer = ml.SemanticMoE.from_plan(make_plan(8, 1, mode="tp"), 0, cfg, single)
    x = torch.randn(4, H)
    with pytest.raises(ValueError, match="token_ids"):
        layer.forward_tp(x, x, _norm(torch.float32), token_ids=None)
    with pytest.raises(ValueError, match="residual"):
        layer.forward_tp(x, x[:3], _norm(torch.float32), token_ids=torch.arange(4))
    plain = ml.SemanticMoE(cfg, single, mode="tp")  # no plan: plain chunks, token_ids optional
    assert plain.forward_tp(x, x, _norm(torch.float32), token_ids=None).shape == (4, H)


def test_predictors_refuse_float_token_ids():
    """Float ids (2.7) used to be truncated into another token's prediction."""
    predictor = HistoryPredictor(torch.zeros(10, 2), torch.zeros(0, 1, 2), (), 0)
    for ids in (torch.tensor([2.7, 1.0]), torch.tensor([True, False])):
        with pytest.raises(TypeError, match=r"token_ids must be a \[T\] integer tensor"):
            predictor.scores(ids)
        with pytest.raises(TypeError, match=r"token_ids must be a \[T\] integer tensor"):
            rebatch_history(ids, predictor, 2)
    assert predictor.scores(torch.tensor([2, 1])).shape == (2, 2)


def test_forward_tp_takes_forced_routing_laid_out_like_the_input():
    """force_routing takes [S, B, K] for [S, B, H] input; forward_tp compared S with T and refused it."""
    layer, cfg, w64 = _layer("tp")
    g = torch.Generator().manual_seed(0)
    partial, residual = (torch.randn(3, 3, H, generator=g, dtype=torch.float64) for _ in range(2))
    first = torch.randint(0, 8, (3, 3), generator=g)
    forced = torch.stack([first, (first + 3) % 8], -1)  # [S, B, K]
    norm = _norm(torch.float64)
    layer.force_routing(forced)
    out = layer.forward_tp(partial, residual, norm, token_ids=torch.arange(9).view(3, 3))
    h = (residual + partial).view(-1, H)
    ref = h + ml.reference.moe_forward(norm(h), *w64, cfg, topk_ids=forced.view(-1, 2))
    assert (out.view(-1, H) - ref).abs().max() < 1e-9
    # [B, S, K] for [S, B, H] has the right number of rows but pairs token (s, b) with row b * S + s:
    # refused, as forward() refuses it (it was used silently)
    partial, residual = (torch.randn(3, 2, H, generator=g, dtype=torch.float64) for _ in range(2))
    layer.force_routing(torch.zeros(2, 3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"forced routing has shape \[2, 3, 2\], expected \[6, 2\]"):
        layer.forward_tp(partial, residual, norm, token_ids=torch.arange(6).view(3, 2))


def test_forward_tp_forces_nothing_after_a_norm_that_raises():
    """The chunk's forced rows were set before norm() ran: a norm that raised left them for the next call."""
    layer, cfg, w64 = _layer("tp")
    g = torch.Generator().manual_seed(0)
    partial, residual = (torch.randn(9, H, generator=g, dtype=torch.float64) for _ in range(2))
    norm = _norm(torch.float64)

    def bad_norm(x):
        raise RuntimeError("norm failed")

    layer.force_routing(torch.tensor([[0, 1]] * 9))
    with pytest.raises(RuntimeError, match="norm failed"):
        layer.forward_tp(partial, residual, bad_norm, token_ids=torch.arange(9))
    out = layer.forward_tp(partial, residual, norm, token_ids=torch.arange(9))  # routed by the router
    h = residual + partial
    assert (out - (h + ml.reference.moe_forward(norm(h), *w64, cfg))).abs().max() < 1e-9


@pytest.mark.parametrize("bad", ["dtype", "shape", "type"])
def test_forward_tp_names_a_norm_that_returns_another_dtype_or_shape(bad):
    """The norm's output went to forward() unchecked, whose message then blamed an ``x`` the caller never passed."""
    layer, cfg, w64 = _layer("tp")
    partial, residual = (torch.randn(6, H, dtype=torch.float64) for _ in range(2))
    norm = {"dtype": lambda z: z.float(), "shape": lambda z: z[:, : H // 2], "type": lambda z: z.tolist()}[bad]
    with pytest.raises(ValueError, match=rf"norm must return a tensor shaped and typed like its input \(\[6, {H}\]"):
        layer.forward_tp(partial, residual, norm, token_ids=torch.arange(6))


def test_an_expert_history_that_is_not_three_dimensional_is_refused():
    """A pair's second entry is the ranks at layer l-1 [T] or the history [D', T, K]; one layer's
    [T, K] ids were silently read as no history at all."""
    from moelayers.layers.semantic import _history_of

    ids = torch.arange(4)
    with pytest.raises(ValueError, match=r"expert history \[D', T, K\], got shape \[4, 2\]"):
        _history_of((None, torch.zeros(4, 2, dtype=torch.int64)), ids)
    assert _history_of((None, torch.zeros(4, dtype=torch.int64)), ids) is None  # ranks at l-1: no history
    assert _history_of((None, torch.zeros(1, 4, 2, dtype=torch.int64)), ids).shape == (1, 4, 2)


@pytest.mark.parametrize("kw, match", [
    (dict(num_tokens=-100), r"num_tokens must be None or an int >= 0, got -100"),  # lifted the cap
    (dict(num_tokens=2.7), r"num_tokens must be None or an int >= 0, got 2\.7"),  # was 2
])
def test_scheduler_checks_the_request_token_count(kw, match):
    s = SemanticScheduler(_plan_for_requests(), total_tokens=20)
    with pytest.raises(ValueError, match=match):
        s.assign([0], **kw)
    for bad in (float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="total_tokens must be None or an int >= 0"):
            SemanticScheduler(_plan_for_requests(), total_tokens=bad)
    assert s.assign([0], num_tokens=np.int64(3)) in (0, 1)
