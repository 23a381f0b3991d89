"""VanillaMoE equals the dense float64 reference at world sizes 1, 2 and 4 (gloo, CPU).

Each world size spawns its processes once (module-scoped fixture) and runs every case of
tests/equivalence_cases.py; each case is then reported as its own test.
"""

import pytest
import torch

import moelayers as ml
from moelayers.testing import run_distributed
from tests.equivalence_cases import case_list, run_cases

WORLD_SIZES = (1, 2, 4)
_results: dict[int, list[dict]] = {}


def results_for(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = [run_cases(0, 1)] if world == 1 else run_distributed(run_cases, world, timeout=600)
    return _results[world]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", [c["name"] for c in case_list(2)])
def test_vanilla_matches_reference(world, case):
    for rank, res in enumerate(results_for(world)):
        assert case in res, f"case {case} did not run on rank {rank}"
        assert res[case] is None, f"world {world}, rank {rank}: {res[case]}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [c["name"] for c in case_list(4) if c.get("ep")])
def test_vanilla_matches_reference_in_expert_parallel_groups_smaller_than_the_world(case):
    """World 4 as two expert-parallel groups of 2 ranks (data parallel x expert parallel): each group's
    experts see the tokens of its own ranks only."""
    for rank, res in enumerate(results_for(4)):
        assert case in res, f"case {case} did not run on rank {rank}"
        assert res[case] is None, f"world 4, rank {rank}: {res[case]}"


def _routing_choices(rank, world):
    """What the equivalence cases cannot see (outputs are equal whichever replica or path is used):
    the replica policy keeps tokens local, spreads remote ones over the replicas, and de-duplication
    sends a token once per rank."""
    import torch

    import moelayers as ml

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    groups = ml.ParallelGroups.from_world()
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    out = {}
    # experts 0 and 2 on both ranks, 1 only on rank 0, 3 only on rank 1
    replicas = ml.ExpertPlacement(torch.tensor([[0, 1, 2], [2, 3, 0]]), 4)
    layer = ml.VanillaMoE(cfg, groups, placement=replicas)
    layer.force_routing(torch.tensor([[0, 2]] * 6))  # replicated experts: all local
    with torch.no_grad():
        layer(x)
    st = layer.last_stats
    out["local"] = (st.lar, st.rows_sent[1 - rank])
    layer.force_routing(torch.tensor([[1, 3]] * 6))  # each on one rank only: one activation goes across
    with torch.no_grad():
        layer(x)
    out["single"] = (layer.last_stats.lar, layer.last_stats.rows_sent[1 - rank])
    # de-duplication: both experts of every token on the other rank (linear: 0, 1 | 2, 3)
    theirs = [2, 3] if rank == 0 else [0, 1]
    for dedup in (True, False):
        m = ml.VanillaMoE(cfg, groups, dedup=dedup)
        m.force_routing(torch.tensor([theirs] * 6))
        with torch.no_grad():
            m(x)
        out[f"dedup={dedup}"] = (m.dispatcher.dedup, m.last_stats.rows_sent[1 - rank], m.last_stats.pairs_sent[1 - rank])
    return out


@pytest.mark.timeout(120)
def test_replica_policy_and_dedup_route_as_documented():
    for rank, out in enumerate(run_distributed(_routing_choices, 2)):
        assert out["local"] == (1.0, 0), (rank, out)  # a local replica: nothing crosses
        assert out["single"] == (0.5, 6), (rank, out)
        assert out["dedup=True"] == (True, 6, 12), (rank, out)  # one row per token for its 2 activations
        assert out["dedup=False"] == (False, 12, 12), (rank, out)  # one row per activation


def _reduce_stats(rank, world):
    """Rank 0 reads its expert loads before reducing, rank 1 does not; then mismatched records."""
    import torch

    import moelayers as ml
    from moelayers.metrics import MoEStats

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world())
    with torch.no_grad():
        layer(torch.randn(5 + rank, 8, generator=torch.Generator().manual_seed(rank)))
    mine = torch.bincount(layer.last_topk_ids.flatten(), minlength=4)
    if rank == 0:
        layer.last_stats.expert_loads  # noqa: B018 - a read before the collective must not change it
    total = layer.last_stats.reduce(layer.groups.ep)
    out = {"mine": mine.tolist(), "total": total.expert_loads.tolist(), "pairs": total.pairs_sent}
    other = layer.last_stats if rank == 0 else MoEStats.from_counts(rank, [3, 3], [3, 3], 8)  # no loads
    try:
        other.reduce(layer.groups.ep)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


@pytest.mark.timeout(120)
def test_stats_reduce_does_not_depend_on_what_was_read():
    """MoEStats.reduce sums the expert loads whether or not a rank read them first (a rank that had
    read them sent a longer vector: gloo aborted); records that differ raise on every rank."""
    outs = run_distributed(_reduce_stats, 2)
    want = [a + b for a, b in zip(outs[0]["mine"], outs[1]["mine"])]
    for out in outs:
        assert out["total"] == want and sum(out["pairs"]) == 2 * (5 + 6)
        assert "the ranks' records differ" in out["mismatch"] and "expert loads of 0..4 experts" in out["mismatch"]


def _load_weights_across_ranks(rank, world):
    """load_full_weights: identical weights load; weights drawn with another seed on each rank, or
    refused on one rank, raise on every rank and load nothing; verify=False skips the check."""
    import torch

    import moelayers as ml

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.bfloat16)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), seed=5)
    before = [t.detach().clone() for t in layer.export_full_weights()]

    def weights(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(s, generator=g).to(torch.bfloat16) for s in ((4, 8), (4, 8, 8), (4, 8, 4))]

    out = {}
    for kind in ("same", "seed per rank", "one expert differs", "gate and up swapped", "bad shape on rank 1",
                 "verify off"):
        w = weights(rank if kind in ("seed per rank", "verify off") else 0)
        if kind == "one expert differs" and rank == 1:
            w[2][3, 0, 0] += 1.0
        if kind == "gate and up swapped" and rank == 1:  # the same values in another order: a sum misses it
            w[1] = torch.cat([w[1][:, 4:], w[1][:, :4]], 1)
        if kind == "bad shape on rank 1" and rank == 1:
            w[1] = w[1][:, :-1]
        try:
            layer.load_full_weights(*w, verify=kind != "verify off")
            # export gathers each expert from the rank that holds it: equal to w where ranks agreed
            out[kind] = "loaded" if kind == "verify off" or torch.equal(layer.export_full_weights()[1], w[1]) \
                else "loaded other weights"
        except (TypeError, ValueError) as e:
            unchanged = all(torch.equal(a, b) for a, b in zip(layer.export_full_weights(), before))
            out[kind] = (str(e) if unchanged else "partly loaded: " + str(e))
        before = [t.detach().clone() for t in layer.export_full_weights()]
    return out


@pytest.mark.timeout(120)
def test_load_full_weights_checks_the_ranks_agree():
    outs = run_distributed(_load_weights_across_ranks, 2)
    for rank, out in enumerate(outs):
        assert out["same"] == "loaded" and out["verify off"] == "loaded", out
        assert "differ between ranks of the layer (router_weight of expert(s) [0, 1, 2, 3]" in out["seed per rank"]
        assert "(w2 of expert(s) [3];" in out["one expert differs"]
        assert "(w13 of expert(s) [0, 1, 2, 3];" in out["gate and up swapped"]
        if rank == 1:
            assert out["bad shape on rank 1"].startswith("w13 must have shape [4, 8, 8], got [4, 7, 8]")
        else:
            assert "refused the weights of expert-parallel rank(s) [1]" in out["bad shape on rank 1"]


def _allgather_stats_with_unequal_tokens(rank, world):
    """The all-gather dispatcher pads every rank to the largest token count: what it sends is
    ``t_max`` rows to each other rank, whatever this rank holds (none too), and ``rows_sent`` counts
    them as documented (serve.py's ``a2a_rows`` and combine bytes follow: the reduce-scatter moves
    as many back)."""
    import torch

    import moelayers as ml

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=3)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), dispatcher="allgather", seed=1)
    out = []
    for tokens in ((5, 3), (4, 0)):
        with torch.no_grad():
            layer(torch.randn(tokens[rank], 8, generator=torch.Generator().manual_seed(rank)))
        s = layer.last_stats
        out.append((s.rows_sent, s.bytes_sent))
    return out, 64  # a row: 8 hidden + 3 weights (float32) + 3 slots (int32) = 56 B, 16-aligned


@pytest.mark.timeout(120)
def test_allgather_stats_count_the_padded_rows():
    for rank, (runs, row) in enumerate(run_distributed(_allgather_stats_with_unequal_tokens, 2)):
        for tokens, (rows, sent) in zip(((5, 3), (4, 0)), runs):
            assert rows == [max(tokens)] * 2, (rank, tokens, rows)
            assert sent == [0 if r == rank else max(tokens) * row for r in range(2)], (rank, tokens, sent, row)


def _fp16_partial_sums(rank, world, dispatcher, device="cpu"):
    """One token whose four experts (all weights exactly 1: sigmoid scores, no renormalisation) give
    -25000, -25000, +40000, +40000: at EP2 each rank's subtotal is +-50000 or +80000, past float16's
    65504 for one of them, though the total, 30000, is not. The subtotals went back in float16: inf."""
    import torch

    import moelayers as ml

    h, f, e = 8, 1, 4
    outs = [-25000.0, -25000.0, 40000.0, 40000.0]
    router = torch.zeros(e, h, dtype=torch.float64)
    router[:, 0] = 20.0  # sigmoid(20) rounds to 1
    w13 = torch.zeros(e, 2 * f, h, dtype=torch.float64)
    w13[:, 0, 0], w13[:, 1, 0] = 16.0, 50.0
    w2 = torch.zeros(e, h, f, dtype=torch.float64)
    silu16 = torch.nn.functional.silu(torch.tensor(16.0, dtype=torch.float64)).item()
    for i, o in enumerate(outs):
        w2[i, 0, 0] = o / (silu16 * 50.0)
    x = torch.zeros(2, h, dtype=torch.float64)
    x[:, 0] = 1.0
    cfg = ml.MoEConfig(hidden_size=h, ffn_hidden_size=f, num_experts=e, top_k=4, score_fn="sigmoid",
                       norm_topk_prob=False, params_dtype=torch.float16)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), dispatcher=dispatcher, device=device)
    layer.load_full_weights(*(t.half().to(device) for t in (router, w13, w2)))
    with torch.no_grad():
        y = layer(x.half().to(device)).cpu()
    ref = ml.reference.moe_forward(x, *(t.half().double() for t in (router, w13, w2)),
                                   cfg.replace(params_dtype=torch.float64))
    return y.double(), ref


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_float16_partial_sums_do_not_overflow(dispatcher):
    import torch

    for rank, (y, ref) in enumerate(run_distributed(_fp16_partial_sums, 2, dispatcher, timeout=90)):
        assert torch.isfinite(y).all(), (rank, y[:, 0])
        torch.testing.assert_close(y, ref, rtol=2e-3, atol=1e-3)


class _PolicyFailingOnce:
    """Valid picks, except that rank 1's first call raises (a lookup bug, say)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, topk_ids, placement, rank):
        self.calls += 1
        if rank == 1 and self.calls == 1:
            raise KeyError("no replica table for this batch")
        return placement.first_replica(topk_ids.device)[topk_ids]


def _policy_raising_on_one_rank(rank, world, kwargs):
    """Rank 1's policy raised alone: the other ranks waited in the exchange, or paired their next
    forward with it (a forward out of step). Now every rank raises, and the next forwards serve."""
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, params_dtype=torch.float64)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), replica_policy=_PolicyFailingOnce(), **kwargs)
    weights = layer.export_full_weights()
    log = []
    for step in range(3):
        x = torch.randn(5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))
        with torch.no_grad():
            try:
                y = layer(x)
            except ValueError as e:  # (the rank whose policy raised: its own error, the policy's as the cause)
                said = "raised KeyError" in str(e) and isinstance(e.__cause__, KeyError)
                log.append(("raised", said) if "replica policy" in str(e) else str(e))
                continue
        ref = ml.reference.moe_forward(x, *weights, cfg, topk_ids=layer.last_topk_ids)
        log.append("exact" if torch.allclose(y, ref, rtol=1e-10, atol=1e-12) else "wrong output")
    return log


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kwargs", [{}, {"dispatcher": "allgather"}, {"capacity": 8}], ids=["alltoall", "allgather", "capacity"])
def test_a_replica_policy_raising_on_one_rank_raises_on_every_rank(kwargs):
    out = run_distributed(_policy_raising_on_one_rank, 2, kwargs, timeout=60)
    assert out == [[("raised", False), "exact", "exact"], [("raised", True), "exact", "exact"]]


class SpreadingMoE(ml.VanillaMoE):
    """A strategy of its own (step 2 only, as docs/architecture.md says): token t's k-th expert goes
    to its replica ``(t + k + rank) % replicas``, wherever that is (no preference for local ones)."""

    def plan(self, topk_ids, topk_weights, token_ids):
        _, log2phy, logcnt = self.placement.device_tables(topk_ids.device)
        t = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
        k = torch.arange(topk_ids.shape[1], device=topk_ids.device)[None, :]
        pick = (t + k + self.groups.ep_rank) % logcnt[topk_ids]
        phys = torch.gather(log2phy[topk_ids], 2, pick[..., None]).squeeze(-1)
        slots = self.placement.slots_per_rank
        return ml.Routes(topk_ids, topk_weights, phys // slots, phys % slots)


def _spreading_cases(rank, world):
    return run_cases(rank, world, names=[c["name"] for c in case_list(world) if c["name"].startswith("replicas")
                                         and "float32" in c["name"]], layer_cls=SpreadingMoE)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_plan_of_its_own_matches_the_reference(world):
    """run_cases(layer_cls=...) runs the suite on a strategy's layer: here one overriding plan()
    (the float32 cases with replicas, where the choice of replica matters)."""
    results = [_spreading_cases(0, 1)] if world == 1 else run_distributed(_spreading_cases, world, timeout=300)
    for rank, res in enumerate(results):
        assert res and all(v is None for v in res.values()), (rank, res)
