"""The central equivalence suite: VanillaMoE vs the dense float64 reference.

One function, ``run_cases``, runs every case on one rank of any world size (1 without
torch.distributed, 2 and 4 with gloo, 2+ with NCCL) and returns ``{case name: error or None}``.
Inputs are regenerated from seeds on every rank, so each rank can compute the reference for all
ranks' tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import moelayers as ml
from moelayers.testing import check_close, redraw_near_ties

H, F = 32, 16


class LastReplicaPolicy:
    """A deliberately different replica choice: always the last replica."""

    def __call__(self, topk_ids, placement, rank):
        _, log2phy, logcnt = placement.device_tables(topk_ids.device)
        return torch.gather(log2phy[topk_ids], 2, (logcnt[topk_ids] - 1)[..., None]).squeeze(-1)


def placements(kind: str, num_experts: int, ranks: int, seed: int = 7) -> ml.ExpertPlacement:
    g = torch.Generator().manual_seed(seed)
    if kind == "linear":
        return ml.ExpertPlacement.linear(num_experts, ranks)
    if kind == "permuted":
        return ml.ExpertPlacement.from_phy2log(torch.randperm(num_experts, generator=g).view(ranks, -1), num_experts)
    if kind == "replicas":  # two spare slots per rank, filled with replicas of random experts
        per = num_experts // ranks
        table = torch.full((ranks, per + 2), -1, dtype=torch.int64)
        table[:, :per] = torch.randperm(num_experts, generator=g).view(ranks, per)
        for r in range(ranks):
            others = [e for e in torch.randperm(num_experts, generator=g).tolist() if e not in table[r].tolist()]
            table[r, per:per + len(others[:2])] = torch.tensor(others[:2], dtype=torch.int64)  # one rank: spares stay empty
        return ml.ExpertPlacement.from_phy2log(table, num_experts)
    raise ValueError(kind)


def case_list(world: int) -> list[dict]:
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for place in ("linear", "permuted", "replicas"):
            for disp, dedup in (("alltoall", True), ("alltoall", False), ("allgather", True)):
                cases.append(dict(place=place, dispatcher=disp, dedup=dedup, dtype=dtype))
        cases.append(dict(place="replicas", dispatcher="alltoall", dedup=True, dtype=dtype, policy="last"))
        cases.append(dict(place="replicas", dispatcher="allgather", dedup=True, dtype=dtype, policy="last"))
        for disp, dedup in (("alltoall", True), ("alltoall", False), ("allgather", True)):
            cases.append(dict(place="permuted", dispatcher=disp, dedup=dedup, dtype=dtype, zero_tokens=True))
            cases.append(dict(place="linear", dispatcher=disp, dedup=dedup, dtype=dtype, one_expert=True))
            cases.append(dict(place="replicas", dispatcher=disp, dedup=dedup, dtype=dtype, topk_all=True))
            cases.append(dict(place="linear", dispatcher=disp, dedup=dedup, dtype=dtype, sigmoid=True, shape3d=True))
        for place in ("permuted", "replicas"):  # fixed-capacity mode (inference only)
            cases.append(dict(place=place, dispatcher="alltoall", dedup=True, dtype=dtype, capacity=True))
        cases.append(dict(place="linear", dispatcher="alltoall", dedup=True, dtype=dtype, capacity=True, zero_tokens=True))
        # several capacities: each forward padded to the smallest that holds every rank's tokens (the NaN
        # check deferred: its flags read at the next forward, check_pending after the last)
        cases.append(dict(place="replicas", dispatcher="alltoall", dedup=True, dtype=dtype, capacity=True, buckets=True,
                          deferred=True))
        # without capacity: one rank's inference forward defers its NaN check too (several ranks: as True)
        cases.append(dict(place="permuted", dispatcher="alltoall", dedup=True, dtype=dtype, deferred=True))
        # and more tokens than the largest on some rank: every rank runs exact (beyond_capacity='exact')
        cases.append(dict(place="permuted", dispatcher="alltoall", dedup=True, dtype=dtype, capacity=True, buckets=True,
                          beyond=True))
        # apply_placement (a transactional move) before the forward and backward, and between two
        # fixed-capacity forwards (the captured graph is dropped and captured again on CUDA)
        cases.append(dict(place="replicas", dispatcher="alltoall", dedup=True, dtype=dtype, moved=True))
        cases.append(dict(place="permuted", dispatcher="alltoall", dedup=True, dtype=dtype, capacity=True, moved=True))
    # megatron-core 0.16's ranking in bf16 (MoEConfig.rank_in_logits_dtype, rank_post_softmax_by_logits): sigmoid scores rounded to bf16, softmax by the logits
    for extra in (dict(sigmoid=True), {}):
        cases.append(dict(place="permuted", dispatcher="alltoall", dedup=True, dtype=torch.bfloat16, megatron_rank=True,
                          **extra))
    # fp32 router logits from bf16 weights (MoEConfig.router_dtype; megatron's moe_router_dtype='fp32')
    for disp, dedup in (("alltoall", True), ("allgather", True)):
        cases.append(dict(place="replicas", dispatcher=disp, dedup=dedup, dtype=torch.bfloat16, fp32_router=True))
    cases.append(dict(place="permuted", dispatcher="alltoall", dedup=True, dtype=torch.bfloat16, capacity=True,
                      fp32_router=True))
    if world >= 4:  # expert-parallel groups smaller than the world (data parallel x expert parallel)
        sub = world // 2
        cases += [dict(place="permuted", dispatcher="alltoall", dedup=True, dtype=torch.float32, ep=sub),
                  dict(place="replicas", dispatcher="allgather", dedup=True, dtype=torch.float32, ep=sub),
                  dict(place="replicas", dispatcher="alltoall", dedup=True, dtype=torch.bfloat16, ep=sub, moved=True),
                  dict(place="permuted", dispatcher="alltoall", dedup=True, dtype=torch.float32, ep=sub, capacity=True,
                       moved=True),
                  dict(place="linear", dispatcher="alltoall", dedup=True, dtype=torch.bfloat16, ep=sub, capacity=True,
                       buckets=True, zero_tokens=True)]
    for c in cases:
        flags = [k for k in ("policy", "zero_tokens", "one_expert", "topk_all", "sigmoid", "capacity", "fp32_router",
                             "megatron_rank", "moved", "buckets", "beyond", "deferred") if c.get(k)]
        c["name"] = f"{c['place']}-{c['dispatcher']}-{'dedup' if c['dedup'] else 'nodedup'}-" \
                    f"{str(c['dtype']).split('.')[-1]}" + "".join(f"-{f}" for f in flags) \
                    + (f"-ep{c['ep']}" if c.get("ep") else "")
    return cases


def _capacity(world: int, case: dict) -> int | tuple[int, ...] | None:
    """The layer's ``capacity``: the most tokens of a rank, or sizes around it with ``buckets``."""
    if not case.get("capacity"):
        return None
    if case.get("beyond"):
        return (3, 6)  # the 6 + 3 * rank tokens of rank 1 and up exceed them
    return (3, 6, 3 * world + 6) if case.get("buckets") else 3 * world + 6


def _tokens(rank: int, case: dict) -> int:
    if case.get("zero_tokens") and rank == 1:
        return 0
    return 6 + 3 * rank


def run_cases(rank: int, world: int, device: str = "cpu", names: list[str] | None = None,
              layer_cls: type | None = None) -> dict[str, str | None]:
    """Every case of :func:`case_list` on this rank: ``{name: None or what differs}``. ``layer_cls``:
    the layer to check (default ``VanillaMoE``), built like it (``(config, groups, placement=, ...)``;
    a strategy overriding ``plan`` is run through every placement, dispatcher and dtype)."""
    layer_cls = ml.VanillaMoE if layer_cls is None else layer_cls
    groups = ml.ParallelGroups.from_world() if world > 1 else ml.ParallelGroups.single()
    sub_groups = {}  # ep size -> groups, made the first time a case needs them (by every rank alike)
    results = {}
    for case in case_list(world):
        if names is not None and case["name"] not in names:
            continue
        if case.get("ep") and case["ep"] not in sub_groups:
            sub_groups[case["ep"]] = ml.ParallelGroups.from_world(ep=case["ep"])
        try:
            results[case["name"]] = _run_case(rank, world, sub_groups[case["ep"]] if case.get("ep") else groups, case,
                                              torch.device(device), layer_cls)
        except Exception as e:  # a failing case must not desynchronise the others
            results[case["name"]] = f"{case['name']}: raised {type(e).__name__}: {e}"
            if world > 1:
                raise
    return results


def _run_case(rank: int, world: int, groups, case: dict, device: torch.device,
              layer_cls: type = ml.VanillaMoE) -> str | None:
    num_experts = 8 if world <= 2 else 16
    top_k = num_experts if case.get("topk_all") else (1 if case.get("one_expert") else 2)
    dtype = case["dtype"]
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=num_experts, top_k=top_k,
                       score_fn="sigmoid" if case.get("sigmoid") else "softmax", params_dtype=dtype,
                       router_dtype=torch.float32 if case.get("fp32_router") else None,
                       rank_in_logits_dtype=bool(case.get("megatron_rank")),
                       rank_post_softmax_by_logits=bool(case.get("megatron_rank")))
    cfg64 = cfg.replace(params_dtype=torch.float64)
    gen = torch.Generator().manual_seed(1234)
    router64 = torch.randn(num_experts, H, generator=gen, dtype=torch.float64) * 0.5
    w13_64 = torch.randn(num_experts, 2 * F, H, generator=gen, dtype=torch.float64) * H ** -0.5
    w2_64 = torch.randn(num_experts, H, F, generator=gen, dtype=torch.float64) * F ** -0.5
    if case.get("one_expert"):
        router64 = router64 * 0.01
        router64[3] += 1.0
    xs = []
    for r in range(world):
        g = torch.Generator().manual_seed(100 + r)
        draw = (lambda n, g=g: torch.randn(n, H, generator=g, dtype=torch.float64).abs() + 0.1) if case.get("one_expert") \
            else (lambda n, g=g: torch.randn(n, H, generator=g, dtype=torch.float64))
        xs.append(redraw_near_ties(draw(_tokens(r, case)), router64, top_k, draw,
                                   score_fn=cfg.score_fn if case.get("megatron_rank") else None))
    gys = [torch.randn(x.shape, generator=torch.Generator().manual_seed(200 + r), dtype=torch.float64)
           for r, x in enumerate(xs)]

    policy = LastReplicaPolicy() if case.get("policy") == "last" else None
    layer = layer_cls(cfg, groups, placement=placements(case["place"], num_experts, groups.ep_size),
                          dispatcher=case["dispatcher"], dedup=case["dedup"], replica_policy=policy, device=device,
                          capacity=_capacity(world, case), beyond_capacity="exact" if case.get("beyond") else "raise",
                          check_finite="deferred" if case.get("deferred") else True,
                          cuda_graph=bool(case.get("capacity")) and device.type == "cuda" and dtype == torch.bfloat16)
    layer.load_full_weights(router64.to(dtype).to(device), w13_64.to(dtype).to(device), w2_64.to(dtype).to(device))

    # layer forward and backward on this rank's tokens
    x = xs[rank].to(dtype).to(device).clone()  # its own leaf, also in float64 (where .to() returns xs[rank] itself)
    if case.get("shape3d") and x.shape[0] % 3 == 0:
        x = x.view(3, -1, H)
    moved = placements(case["place"], num_experts, groups.ep_size, seed=8) if case.get("moved") else None
    if case.get("capacity"):  # inference only: outputs, then a second call to exercise graph replay
        with torch.inference_mode():
            layer(x.flip(0))
        if moved is not None:
            layer.apply_placement(moved)
            assert layer.placement == moved != placements(case["place"], num_experts, groups.ep_size)
        with torch.inference_mode():
            y = layer(x)
        ref_y, low_y = _reference_outputs(xs[rank], router64, w13_64, w2_64, cfg, cfg64, dtype)
        err = check_close(f"{case['name']} output", y.reshape(ref_y.shape), ref_y, low_y)
        err = err or _stats_error(case, layer, x.shape[0], top_k)
        if case.get("buckets") and not err:  # the size every rank's tokens fit, then a smaller one (its own graph)
            members = dist.get_process_group_ranks(groups.ep) if groups.ep is not None else [rank]
            for rows in (None, 2):
                if rows is not None:
                    with torch.inference_mode():
                        y = layer(x.reshape(-1, H)[:rows])
                    err = check_close(f"{case['name']} output of {rows} rows", y, ref_y[:rows],
                                      None if low_y is None else low_y[:rows])
                    err = err or _stats_error(case, layer, y.shape[0], top_k)
                most = max(min(rows or _tokens(r, case), _tokens(r, case)) for r in members)
                want = min((c for c in layer.capacities if c >= most), default=None)  # None: exact, beyond them
                if not err and (layer.last_capacity != want or layer.dispatcher.capacity != want):
                    err = f"{case['name']}: ran at capacity {layer.last_capacity}, not {want} ({most} rows)"
        layer.check_pending()  # (deferred: the last forward's flags, clean)
        layer.release_graphs()
        return err
    if moved is not None:
        layer.apply_placement(moved)
        assert layer.placement == moved != placements(case["place"], num_experts, groups.ep_size)
    if case.get("deferred"):  # an inference forward first (the deferred check's path), then training (at once)
        with torch.inference_mode():
            y = layer(x)
        ref_y, low_y = _reference_outputs(xs[rank], router64, w13_64, w2_64, cfg, cfg64, dtype)
        layer.check_pending()
        err = check_close(f"{case['name']} inference output", y.reshape(ref_y.shape), ref_y, low_y)
        if err:
            return err
    x.requires_grad_(True)
    y = layer(x)
    (y.float() * gys[rank].view(y.shape).float().to(device)).sum().backward()
    g13, g2 = layer.expert_grads_full()
    g_router = layer.router.weight.grad.detach().clone()
    if groups.ep is not None:
        dist.all_reduce(g_router, group=groups.ep)

    # references on the tokens of all ranks of this rank's expert-parallel group, float64 and the layer's dtype
    members = dist.get_process_group_ranks(groups.ep) if groups.ep is not None else [rank]

    def reference(ref_dtype):
        params = [t.to(ref_dtype).clone().requires_grad_(True) for t in (router64, w13_64, w2_64)]
        x_all = [xi.to(ref_dtype).clone().requires_grad_(True) for xi in xs]
        c = cfg64 if ref_dtype == torch.float64 else cfg
        outs = [ml.reference.moe_forward(xi, *params, c) for xi in x_all]
        loss = sum((outs[r].double() * gys[r]).sum() for r in members)
        loss.backward()
        gx = x_all[rank].grad if x_all[rank].grad is not None else torch.zeros_like(x_all[rank])
        return outs[rank], gx, params

    ref_y, ref_gx, ref_p = reference(torch.float64)
    low = reference(dtype) if dtype not in (torch.float32, torch.float64) else (None, None, [None, None, None])
    low_y, low_gx, low_p = low
    name = case["name"]
    checks = [
        check_close(f"{name} output", y.reshape(ref_y.shape), ref_y, low_y),
        check_close(f"{name} d/dx", x.grad.reshape(ref_gx.shape), ref_gx, low_gx),
        check_close(f"{name} d/dw13", g13, ref_p[1].grad, None if low_p[1] is None else low_p[1].grad),
        check_close(f"{name} d/dw2", g2, ref_p[2].grad, None if low_p[2] is None else low_p[2].grad),
        check_close(f"{name} d/drouter", g_router, ref_p[0].grad, None if low_p[0] is None else low_p[0].grad),
    ]
    checks.append(_stats_error(case, layer, xs[rank].shape[0], top_k))
    errors = [c for c in checks if c]
    return "; ".join(errors) if errors else None


def _stats_error(case: dict, layer, tokens: int, top_k: int) -> str | None:
    """``layer.last_stats`` against counts made here from the routing (``last_topk_ids``) and the
    placement: every activation counted once, each on a rank that holds its expert (exactly where
    every expert has one replica), the LAR, and the payload rows of the all-to-all (one per token and
    rank with de-duplication, one per activation without)."""
    st, name = layer.last_stats, case["name"]
    if st is None:
        return f"{name}: no last_stats"
    ids = layer.last_topk_ids.reshape(-1, top_k).cpu()  # [T, K]
    place, ep, rank = layer.placement, layer.groups.ep_size, layer.groups.ep_rank
    holds = torch.zeros(ep, place.num_experts, dtype=torch.bool)  # holds[r, e]: rank r has a replica of e
    for r in range(ep):
        holds[r, [e for e in place.experts_on(r) if e >= 0]] = True
    pairs, rows = list(st.pairs_sent), list(st.rows_sent)
    want = {"tokens": (ids.shape[0], tokens), "activations": (sum(pairs), tokens * top_k)}
    if ids.numel():
        most = [int(holds[r][ids].sum()) for r in range(ep)]  # activations rank r could serve
        if any(p > m for p, m in zip(pairs, most)):
            return f"{name}: pairs_sent {pairs} exceeds what each rank holds {most}"
        if int(place.logcnt.max()) == 1:  # one replica each: the rank of every activation is known
            on = holds[:, ids]  # [R, T, K]
            want["pairs_sent"] = (pairs, on.sum((1, 2)).tolist())
            if case["dispatcher"] == "alltoall":
                want["rows_sent"] = (rows, on.any(2).sum(1).tolist() if case["dedup"] else on.sum((1, 2)).tolist())
    want["lar"] = (st.lar, pairs[rank] / sum(pairs) if sum(pairs) else st.lar)
    bad = [f"{key} {got} != {exp}" for key, (got, exp) in want.items()
           if (abs(got - exp) > 1e-12 if isinstance(got, float) else got != exp)]
    return f"{name}: last_stats: " + ", ".join(bad) if bad else None


def _reference_outputs(x64, router64, w13_64, w2_64, cfg, cfg64, dtype):
    ref = ml.reference.moe_forward(x64, router64, w13_64, w2_64, cfg64)
    if dtype in (torch.float32, torch.float64):
        return ref, None
    return ref, ml.reference.moe_forward(x64.to(dtype), router64.to(dtype), w13_64.to(dtype), w2_64.to(dtype), cfg)
