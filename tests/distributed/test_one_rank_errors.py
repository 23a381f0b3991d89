"""An error on one rank raises on every rank (gloo, 2 ranks): a rank that refuses its input or its
state alone must still take part in the collectives the other ranks run (or all must agree first),
so that none waits forever and none goes on with another state. Each check returns every rank's
outcome; a rank left waiting fails the run by its timeout."""

from __future__ import annotations

import random
import traceback
import warnings

import pytest
import torch
import torch.nn.functional as tnf

import moelayers as ml
from moelayers.testing import run_distributed

TIMEOUT = 90


def _outcome(fn, *args, **kwargs) -> str:
    """``'ok'`` or ``'<ExceptionType>: <message>'``."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
        return f"{type(exc).__name__}: {exc}"
    return "ok"


REFUSED_ELSEWHERE = "ValueError: the layer refused the input of expert-parallel rank(s) [1]"


# ------------------------------------------------------------------------------ one spawn per group of checks
# Starting the ranks costs more than most checks here (at world 4 on 2 cores about 3 s, the first
# load_placement_state_dict of a process alone 2 s): the checks of one group (one world size, see
# GROUPS at the end) run in one spawn, in sequence, each from the global RNG state and warning
# filters a fresh rank starts with. The first test of a group starts it, the others read its
# results; every test asserts its own check's outcomes, as with a spawn of its own.
_group_results: dict[str, list[dict] | Exception] = {}


def _run_checks(rank: int, world: int, checks: list[tuple[str, object, tuple]]) -> dict:
    import numpy as np

    fresh = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
    out = {}
    for key, fn, args in checks:
        torch.random.set_rng_state(fresh[0])
        np.random.set_state(fresh[1])
        random.setstate(fresh[2])
        with warnings.catch_warnings():
            try:
                out[key] = ("returned", fn(rank, world, *args))
            except Exception:  # noqa: BLE001 - reported by the check's own test
                out[key] = ("raised", traceback.format_exc())
    return out


def _outcomes(group: str, key: str) -> list:
    """Every rank's result of check ``key`` of ``group`` (what ``run_distributed(fn, world, *args)``
    returned for it alone)."""
    if group not in _group_results:
        world, checks = GROUPS[group]
        try:
            _group_results[group] = run_distributed(_run_checks, world, checks, timeout=TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - failed once: every test of the group says so, none runs it again
            _group_results[group] = exc
    results = _group_results[group]
    if isinstance(results, Exception):
        raise RuntimeError(f"the spawn of group {group!r} (check {key!r} among them) failed") from results
    out = []
    for rank, by_key in enumerate(results):
        how, value = by_key[key]
        assert how == "returned", f"check {key!r} raised on rank {rank}:\n{value}"
        out.append(value)
    return out


def _assert_all_raise(outcomes: list[str], own: str, others: str = REFUSED_ELSEWHERE) -> None:
    """Rank 1 raised its own error (starting ``own``), every other rank ``others`` -- not gloo's
    "connection closed" of a rank left waiting in a collective when rank 1 exited."""
    assert outcomes[1].startswith(own), f"rank 1: {outcomes[1]}"
    for rank, got in enumerate(outcomes):
        assert rank == 1 or got.startswith(others), f"rank {rank}: {got}"


# ------------------------------------------------------------------------------ megatron adapter
def _adapter_check(rank: int, world: int, case: str) -> str:
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moelayers.integrations import megatron as mi

    warnings.simplefilter("ignore")
    extra = dict(moe_aux_loss_coeff=0.01) if case == "training_losses" else {}
    tc = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=4, moe_ffn_hidden_size=4,
                           num_moe_experts=4 * world, moe_router_topk=2, gated_linear_unit=True, activation_func=tnf.silu,
                           add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0, **extra)
    if case == "semantic_tp":  # its refuse_input agrees in forward_tp's way; the adapter runs the base forward
        adapter = mi.MegatronMoEAdapter(tc, ml.SemanticMoE, groups=ml.ParallelGroups.from_world(tp=world),
                                        mode="tp").eval()
        case = "intermediate_tensors"
    else:
        adapter = mi.MegatronMoEAdapter(tc, ml.VanillaMoE, groups=ml.ParallelGroups.from_world()).eval()
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(rank))
    if case == "intermediate_tensors":
        with torch.no_grad():
            return _outcome(adapter, x, [torch.zeros(1)] if rank == 1 else None)
    adapter.train(rank == 1)  # rank 1 alone trains, with a loss moelayers does not implement
    return _outcome(adapter, x)


@pytest.mark.parametrize("case", ["intermediate_tensors", "training_losses", "semantic_tp"])
def test_megatron_adapter_refusals_on_one_rank(case):
    """``semantic_tp``: an adapter over ``SemanticMoE(mode="tp")`` hung (its refusal went through the
    layer's tp agreement while the other ranks were in the base forward's exchange)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    own = {"intermediate_tensors": "NotImplementedError: MegatronMoEAdapter does not support partial CUDA-graph",
           "semantic_tp": "NotImplementedError: MegatronMoEAdapter does not support partial CUDA-graph",
           "training_losses": "RuntimeError: the transformer_config turns on training losses"}[case]
    _assert_all_raise(_outcomes("megatron", case), own)


# ------------------------------------------------------------------------------ tiny decoder
def _tiny_check(rank: int, world: int, case: str, attention: str) -> str:
    from moelayers.models import TinyConfig, TinyDecoder

    vocab, h = 64, 32
    groups = ml.ParallelGroups.from_world(ep=world, tp=world if attention == "tp" else 1)
    moe_cfg = ml.MoEConfig(hidden_size=h, ffn_hidden_size=16, num_experts=4, top_k=2, params_dtype=torch.float64)
    cfg = TinyConfig(vocab_size=vocab, hidden_size=h, num_layers=2, num_heads=4, dtype=torch.float64)
    if attention == "tp":
        model = TinyDecoder(cfg, lambda i: ml.SemanticMoE(moe_cfg, groups, mode="tp", seed=i), attention="tp",
                            groups=groups)
    else:
        model = TinyDecoder(cfg, lambda i: ml.VanillaMoE(moe_cfg, groups, seed=i))
    bad = rank == 1
    with torch.no_grad():
        if case == "forward_out_of_vocab":
            return _outcome(model, torch.tensor([[1, 2, 3, vocab + 5 if bad else 4]]))
        if case == "forward_one_dimensional":
            ids = torch.tensor([[1, 2, 3, 4]])
            return _outcome(model, ids[0] if bad else ids)
        if case == "step_out_of_vocab":
            return _outcome(model.step, [("a", torch.tensor([1, 2, vocab + 5 if bad else 3]))])
        return _outcome(model.step, [("a", torch.tensor([1, 2])), ("a" if bad else "b", torch.tensor([3]))])


TINY_OWN = {"forward_out_of_vocab": "ValueError: input_ids: token id 69 outside",
            "forward_one_dimensional": "ValueError: input_ids must be [B, S]",
            "step_out_of_vocab": "ValueError: request 'a': token_ids: token id 69 outside",
            "step_request_twice": "ValueError: a request appears twice in one step"}


@pytest.mark.parametrize("attention", ["dp", "tp"])
@pytest.mark.parametrize("case", sorted(TINY_OWN))
def test_tiny_decoder_refusals_on_one_rank(case, attention):
    others = REFUSED_ELSEWHERE if attention == "dp" else "ValueError: forward_tp refused the input of TP rank(s) [1]"
    _assert_all_raise(_outcomes("world2", f"tiny/{case}/{attention}"), TINY_OWN[case], others)


# ------------------------------------------------------------------------------ SemanticMoE.forward_tp
def _forward_tp_check(rank: int, world: int, case: str) -> str:
    import dataclasses

    from tests.distributed.test_semantic import H, V, _norm, make_plan

    groups = ml.ParallelGroups.from_world(tp=world)
    e = 4 * world
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=e, top_k=2, params_dtype=torch.float64)
    plan = make_plan(e, world, seed=3)
    if case == "other_token_tables" and rank == 1:  # the same experts' placement, other token tables
        other = make_plan(e, world, seed=11)
        plan = dataclasses.replace(plan, token_rank=other.token_rank, token_conf=other.token_conf)
    layer = ml.SemanticMoE.from_plan(plan, 2, cfg, groups, mode="tp", seed=7)
    gen = torch.Generator().manual_seed(4)
    t = 12
    partials = [torch.randn(t, H, generator=gen, dtype=torch.float64) for _ in range(world)]
    residual = torch.randn(t, H, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, V - 8, (t,), generator=gen)
    forced = {}
    if case == "other_forced_routing":
        forced["topk_ids"] = torch.stack([torch.arange(t), torch.arange(t) + 1 + rank], 1) % e
    if case == "ids_on_meta" and rank == 1:
        ids = ids.to("meta")
    if case == "history_on_meta" and rank == 1:  # the history predictor's bincount has no meta kernel
        forced["prev_ranks"] = torch.zeros(2, t, dtype=torch.int64, device="meta")
    with torch.no_grad():
        return _outcome(layer.forward_tp, partials[rank], residual, _norm(torch.float64), token_ids=ids, **forced)


@pytest.mark.parametrize("case,message", [("other_token_tables", "shuffle the same tokens differently"),
                                          ("other_forced_routing", "force different routing")])
def test_forward_tp_ranks_that_disagree_all_raise(case, message):
    """Token tables or forced ids that differ on one rank gave a silently wrong output (each rank
    shuffled, or routed, its chunk by its own)."""
    outcomes = _outcomes("world2", f"forward_tp/{case}")
    assert all(message in got for got in outcomes), outcomes


@pytest.mark.parametrize("case,own", [("ids_on_meta", "TypeError: token_ids are on meta"),
                                      ("history_on_meta", "")])
def test_forward_tp_input_error_of_any_type_on_one_rank_raises_everywhere(case, own):
    """Only TypeError and ValueError reached the TP agreement: token ids on another device (a
    NotImplementedError from bincount, or a copy out of a meta tensor) left the other ranks waiting
    in the agreement's all-reduce."""
    outcomes = _outcomes("world2", f"forward_tp/{case}")
    _assert_all_raise(outcomes, own, "ValueError: forward_tp refused the input of TP rank(s) [1]")


def _dp_ids_check(rank: int, world: int) -> str:
    layer = ml.VanillaMoE(ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=2 * world, top_k=2),
                          ml.ParallelGroups.from_world(), seed=1)
    ids = torch.arange(5, device="meta" if rank == 1 else "cpu")
    with torch.no_grad():
        return _outcome(layer, torch.randn(5, 8), token_ids=ids)


def test_token_ids_on_another_device_on_one_rank():
    outcomes = _outcomes("world2", "dp_ids")
    _assert_all_raise(outcomes, "TypeError: token_ids are on meta, x on cpu")


# ------------------------------------------------------------------------------ checkpoint placements
def _on(device: str, rank: int) -> None:
    """Build on ``device`` (``"cuda"``: this rank's GPU, for the NCCL runs of tests/gpu)."""
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.set_default_device("cuda")


def _placement_check(rank: int, world: int, case: str, device: str = "cpu") -> list[str]:
    from moelayers import checkpoint as mlc

    _on(device, rank)

    e, ep = 4, 2  # at world 4: two expert-parallel groups, {0, 1} and {2, 3}
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=e, top_k=2, params_dtype=torch.float64)
    saved = torch.arange(e).roll(1).view(ep, e // ep)  # [[3, 0], [1, 2]]
    start = ml.ExpertPlacement.from_phy2log(saved, e) if case == "already_there" and rank == 0 else None
    model = torch.nn.ModuleDict({"moe": ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(ep=ep), placement=start)})
    state = {"moe.placement": saved.clone()}
    if rank == 1 and case == "bad_entry":
        state["moe.placement"][-1, -1] = 7
    if rank == 1 and case == "missing_entry":
        state = {}
    if rank == 1 and case == "meta_entry":  # not a KeyError or ValueError: told to the others all the same
        state["moe.placement"] = torch.empty_like(saved, device="meta")
    if rank == 1 and case == "float_entry":  # [[3.4, 0.7], ...]: was truncated to [[3, 0], ...] and moved
        state["moe.placement"] = saved.double() + torch.tensor([[0.4, 0.7], [0.2, 0.9]])
    loaded = _outcome(mlc.load_placement_state_dict, model, state)
    moved = model["moe"].placement != ml.ExpertPlacement.linear(e, ep)
    with torch.no_grad():  # the job goes on: every rank serves the next step
        served = _outcome(model["moe"], torch.randn(3, 8, dtype=torch.float64))
    return [loaded, served, moved]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["bad_entry", "missing_entry", "meta_entry", "float_entry", "already_there"])
def test_load_placement_state_dict_with_one_rank_apart(case, world):
    """One rank's entry refused (or missing) raised on that rank while the others waited in the
    move; a rank already in the saved placement skipped the move the others made. At world 4 the
    other expert-parallel group {2, 3} moved alone: the layer's two copies in other placements."""
    outcomes = _outcomes(f"world{world}", f"placement/{case}")
    if case == "already_there":  # the ranks started in different placements: the move refuses that everywhere
        assert all(loaded.startswith("PlacementRejected") for loaded, _, _ in outcomes[:2]), outcomes
        return
    own = {"bad_entry": "ValueError: load_placement_state_dict: moe.placement is not a placement of 4 experts",
           "missing_entry": "KeyError", "meta_entry": "",
           "float_entry": "TypeError: load_placement_state_dict: moe.placement holds torch.float64"}[case]
    _assert_all_raise([loaded for loaded, _, _ in outcomes], own,
                      "ValueError: load_placement_state_dict: another rank refused its entry")
    assert [served for _, served, _ in outcomes] == ["ok"] * world, outcomes
    assert not any(moved for _, _, moved in outcomes), outcomes  # nothing moved anywhere


def _placement_one_group_there_already(rank: int, world: int) -> list:
    from moelayers import checkpoint as mlc

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    groups = ml.ParallelGroups.from_world(ep=2)
    model = torch.nn.ModuleDict({k: ml.VanillaMoE(cfg, groups, seed=1) for k in "ab"})
    saved = {f"{k}.placement": torch.tensor([[3, 0], [1, 2]]) for k in "ab"}
    if rank < 2:  # group {0, 1} already serves layer a's saved placement (a re-plan of its own, say)
        model["a"].apply_placement(ml.ExpertPlacement(saved["a.placement"], 4))
    return [_outcome(mlc.load_placement_state_dict, model, saved), [m.placement.phy2log.tolist() for m in model.values()]]


def test_load_placement_state_dict_with_one_group_there_already():
    """World 4, EP2 x EDP2: group {0, 1} already served layer a's saved placement, group {2, 3} did
    not, so only {2, 3} moved it and waited for {0, 1} in the move's agreement over the copies
    (which {0, 1} ran for layer b instead): a hang. The groups now decide to move together."""
    for loaded, placements in _outcomes("world4", "placement/one_group_there_already"):
        assert loaded == "ok" and placements == [[[3, 0], [1, 2]]] * 2, (loaded, placements)


def _placement_mixed_groups(rank: int, world: int, device: str = "cpu") -> list:
    import torch.distributed as dist

    from moelayers import checkpoint as mlc

    _on(device, rank)

    blocks = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    model = torch.nn.ModuleDict({"a": ml.VanillaMoE(cfg, ml.ParallelGroups.from_groups(ep=blocks[rank // 2])),
                                 "b": ml.VanillaMoE(cfg, ml.ParallelGroups.from_world())})
    good = {"a.placement": torch.tensor([[3, 0], [1, 2]]), "b.placement": torch.tensor([[3], [2], [1], [0]])}
    state = {k: v for k, v in good.items() if not (rank == 1 and k == "a.placement")}
    first = _outcome(mlc.load_placement_state_dict, model, state)
    unmoved = all(m.placement == ml.ExpertPlacement.linear(4, m.groups.ep_size) for m in model.values())
    retry = _outcome(mlc.load_placement_state_dict, model, good)
    return [first, unmoved, retry, model["b"].placement.phy2log.flatten().tolist()]


def test_load_placement_state_dict_refusal_reaches_a_later_layers_group():
    """Layer a on two expert-parallel groups without edp, layer b over the world; rank 1 lacks a's
    entry: ranks 0 and 1 raised at layer a, while ranks 2 and 3 waited in layer b's all-reduce (or,
    agreed there, in b's move) forever."""
    outcomes = _outcomes("world4", "placement/mixed_groups")
    _assert_all_raise([first for first, *_ in outcomes], "KeyError",
                      "ValueError: load_placement_state_dict: another rank refused its entry")
    assert all(unmoved and retry == "ok" and b == [3, 2, 1, 0] for _, unmoved, retry, b in outcomes), outcomes


def _placement_move_fails_in_one_group(rank: int, world: int, device: str = "cpu") -> list:
    from moelayers import checkpoint as mlc

    _on(device, rank)
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    groups = ml.ParallelGroups.from_world(ep=2)  # {0, 1} and {2, 3}
    model = torch.nn.ModuleDict({"a": ml.VanillaMoE(cfg, groups, seed=1), "b": ml.VanillaMoE(cfg, groups, seed=2)})
    x = torch.randn(6, 8, dtype=torch.float64)
    with torch.no_grad():
        before = model["b"](model["a"](x))

    def fault(staging):
        raise RuntimeError("injected transfer fault")

    if rank == 2:  # layer a's move fails while staging in group {2, 3} only
        model["a"]._staging_fault_hook = fault
    saved = {"a.placement": torch.tensor([[3, 2], [1, 0]]), "b.placement": torch.tensor([[1, 0], [3, 2]])}
    loaded = _outcome(mlc.load_placement_state_dict, model, saved)
    model["a"]._staging_fault_hook = None
    with torch.no_grad():
        same = torch.equal(model["b"](model["a"](x)), before)
    return [loaded, [m.placement.phy2log.flatten().tolist() for m in model.values()], same]


def test_load_placement_state_dict_move_failing_in_one_group_moves_no_group():
    """World 4, EP2 x EDP2: layer a's move failed while staging in group {2, 3}, which raised and
    kept its placement, while group {0, 1} moved both layers and returned: the layer's copies then
    served different placements. The group that moved now moves back, and every rank raises."""
    outcomes = _outcomes("world4", "placement/move_fails_in_one_group")
    for rank, (loaded, placements, same) in enumerate(outcomes):
        expected = "failed while staging" if rank >= 2 else "the move failed in another expert-parallel group"
        assert loaded.startswith("PlacementMoveError") and expected in loaded, (rank, loaded)
        assert placements == [[0, 1, 2, 3]] * 2 and same, (rank, placements, same)


# ------------------------------------------------------------------------------ checkpoint weights
def _model_state_check(rank: int, world: int, case: str, device: str = "cpu") -> list:
    from moelayers import checkpoint as mlc

    _on(device, rank)

    e = 8
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=e, top_k=2, params_dtype=torch.float64)
    model = torch.nn.ModuleDict({"pre": torch.nn.Linear(8, 8, dtype=torch.float64),
                                 "moe": ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(ep=2))})
    before = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    state = {k: v.detach() + 1 if torch.is_tensor(v) and v.is_floating_point() else v
             for k, v in mlc.model_state_dict(model).items()}
    held = [x for x in model["moe"].placement.experts_on(model["moe"].groups.ep_rank) if x >= 0]
    if rank == 1:
        if case == "missing_expert":
            del state[f"moe.experts.w2.{held[-1]}"]
        elif case == "dense_shape":
            state["pre.weight"] = torch.zeros(8, 9, dtype=torch.float64)
        elif case == "unexpected_key":
            state["extra.weight"] = torch.zeros(1)
        elif case == "not_a_mapping":  # read before the agreement: the other ranks waited in it
            state = None
        elif case == "meta_expert":  # copied on rank 1 only as far as the meta tensor
            state[f"moe.experts.w2.{held[-1]}"] = torch.empty(8, 4, dtype=torch.float64, device="meta")
    if case.startswith("optimizer"):
        params = model.parameters()
        if rank == 1 and case == "optimizer_holds_other_weights":  # the optimizers differ: refused on every rank
            params = [p for n, p in model.named_parameters() if "experts" not in n]
        optim = torch.optim.AdamW(params)
        model["moe"](model["pre"](torch.randn(6, 8, dtype=torch.float64))).sum().backward()
        optim.step()
        before = {p: {k: v.clone() for k, v in optim.state.get(p, {}).items()} for p in model.parameters()}
        state = mlc.optimizer_state_dict(model, optim)
        state["state"] = {k: {n: v + 1 for n, v in entry.items()} for k, entry in state["state"].items()}
        if rank == 1 and case == "optimizer_missing_expert":
            del state["state"][f"moe.experts.w2.{held[-1]}"]
        if rank == 1 and case == "optimizer_no_param_groups":  # torch's own load raised, after the experts
            del state["param_groups"]
        if rank == 1 and case == "optimizer_no_dense_state":  # the same
            del state["state"]["pre.weight"]
        if rank == 1 and case == "optimizer_dense_without_a_moment":  # loaded on rank 1: its next step raised
            del state["state"]["pre.weight"]["exp_avg"]
        if rank == 1 and case == "optimizer_dense_not_a_dict":  # left rank 1's optimizer broken for good
            state["state"]["pre.weight"] = 5
        loaded = _outcome(mlc.load_optimizer_state_dict, model, optim, state)
        return [loaded, all(isinstance(optim.state.get(p, {}), dict) and optim.state.get(p, {}).keys() == was.keys()
                            and all(torch.equal(optim.state[p][k], v) for k, v in was.items())
                            for p, was in before.items())]
    loaded = _outcome(mlc.load_model_state_dict, model, state)
    after = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    return [loaded, all(torch.equal(after[k], v) for k, v in before.items())]


LOAD_CASES = {"missing_expert": "KeyError", "dense_shape": "ValueError",
              "unexpected_key": "RuntimeError: load_model_state_dict: missing keys [], unexpected keys ['extra.weight']",
              "optimizer_missing_expert": "KeyError", "optimizer_no_param_groups": "KeyError",
              "optimizer_no_dense_state": "KeyError", "optimizer_dense_without_a_moment": "KeyError",
              "optimizer_dense_not_a_dict": "TypeError", "meta_expert": "ValueError",
              "not_a_mapping": "TypeError: load_model_state_dict: the state dict must be a mapping"}


def _model_state_checks(rank: int, world: int, device: str = "cpu") -> dict:
    return {case: _model_state_check(rank, world, case, device) for case in LOAD_CASES}  # one spawn for every case


def test_load_optimizer_state_dict_with_optimizers_holding_other_weights():
    """Rank 1's optimizer does not hold the expert weights: each rank's own state dict is fine, but
    the step sharing for ranks without experts (and any later move) needs every rank's optimizer
    alike; every rank refuses, and none loads."""
    for loaded, unchanged in _outcomes("world2", "load/optimizer_holds_other_weights"):
        assert loaded.startswith("ValueError: load_optimizer_state_dict: the ranks' optimizers"), loaded
        assert unchanged


@pytest.mark.parametrize("world", [2, 4])
def test_load_model_state_dict_refused_on_one_rank_loads_nowhere(world):
    """One rank's state dict (model or optimizer) refused: that rank loaded nothing and raised, while
    the other ranks loaded theirs and went on, holding experts of another checkpoint than rank 1's.
    Now every rank raises and none loads (at world 4, with two expert-parallel groups, the agreement
    crosses the groups too)."""
    results = _outcomes(f"world{world}", "load/every_case")
    for case, own in LOAD_CASES.items():
        outcomes = [by_case[case] for by_case in results]
        what = "load_optimizer_state_dict" if case.startswith("optimizer") else "load_model_state_dict"
        _assert_all_raise([loaded for loaded, _ in outcomes], own, f"ValueError: {what}: another rank refused its state dict")
        assert all(unchanged for _, unchanged in outcomes), (case, outcomes)


# ------------------------------------------------------------------------------ capacity mode, placements
def _capacity_placement_check(rank: int, world: int, served_before: bool) -> str:
    e = 4
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=e, top_k=2, params_dtype=torch.float64)
    groups = ml.ParallelGroups.from_world()
    layer = ml.VanillaMoE(cfg, groups, check_finite=False, capacity=8)  # linear placement
    rotated = ml.VanillaMoE(cfg, groups, check_finite=False, capacity=8,
                            placement=ml.ExpertPlacement.from_phy2log(torch.arange(e).roll(1).view(world, -1), e))
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(20 + rank))
    with torch.no_grad():
        if served_before:
            layer(x)
        # every rank loads its checkpoint; rank 1's was saved in another placement
        layer.load_state_dict((rotated if rank == 1 else layer).state_dict())
        return _outcome(layer, x)


@pytest.mark.parametrize("served_before", [False, True])
def test_capacity_mode_compares_placements_after_a_load(served_before):
    """Capacity mode with check_finite=False reads no flags: ranks that loaded checkpoints of
    different placements served a silently wrong output (off by about the output's size)."""
    outcomes = _outcomes("world2", f"capacity/served_before={served_before}")
    assert all("serve different placements" in got for got in outcomes), outcomes


# ------------------------------------------------------------------------------ autograd on some ranks only
def _autograd_check(rank: int, world: int, dispatcher: str, how: str) -> str:
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), dispatcher=dispatcher)
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    if how == "frozen" and rank == 0:
        layer.requires_grad_(False)
    with torch.no_grad() if how == "no_grad" and rank == 0 else torch.enable_grad():
        return _outcome(lambda: layer(x).sum().backward() if torch.is_grad_enabled() else layer(x))


@pytest.mark.parametrize("how", ["no_grad", "frozen"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_autograd_on_some_ranks_only_raises_in_the_forward(dispatcher, how):
    """Rank 0 ran its forward without autograd (no_grad, or its layer frozen): the forward passed,
    and rank 1's backward then waited forever in the reverse exchange rank 0 never ran."""
    outcomes = _outcomes("world2", f"autograd/{dispatcher}/{how}")
    assert all("record autograd in this forward and rank(s) [0] do not" in got for got in outcomes), outcomes


# ------------------------------------------------------------------------------ training helpers
def _frozen_experts_check(rank: int, world: int) -> str:
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(ep=1))  # every rank holds every expert: edp = world
    if rank == 1:
        layer.experts.requires_grad_(False)
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    layer(x).pow(2).sum().backward()
    return _outcome(ml.reduce_expert_grads, layer)


def test_reduce_expert_grads_with_experts_frozen_on_one_rank():
    """Rank 1 skipped the all-reduce of its frozen experts' gradients; rank 0 waited in it."""
    outcomes = _outcomes("world2", "frozen_experts")
    assert all("require grad on some ranks and not on others" in got for got in outcomes), outcomes


# ------------------------------------------------------------------------------ VariabilityAwareMoE re-plans
def _replan_check(rank: int, world: int, main_grad: bool) -> list:
    warnings.simplefilter("ignore")
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    layer = ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.from_world(), window=2, auto_replan=True,
                                   variability="high")
    if main_grad:  # megatron's DDP: gradients accumulate in main_grad (zeros here)
        for w in (layer.experts.w13, layer.experts.w2):
            w.main_grad = torch.zeros_like(w)
    g = torch.Generator().manual_seed(rank)
    kept, log = None, []
    for step in range(8):
        y = layer(torch.randn(6, 8, generator=g))
        if rank == 1 and step == 1:
            kept = y  # rank 1 holds this output's graph two steps longer (the re-plan falls due meanwhile)
        if step == 3:
            kept = None
        del y
        log.append((layer.num_replans, layer._replan_pending))
    return log


@pytest.mark.parametrize("main_grad", [False, True])
def test_auto_replan_waits_for_every_rank(main_grad):
    """A due re-plan ran at once on the rank without a live graph and waited on the other: the
    first rank's move then waited forever for the second (with megatron's main_grad, the check of
    the gradients was a collective that only the rank without a live graph ran)."""
    logs = _outcomes("world2", f"replan/main_grad={main_grad}")
    assert logs[0] == logs[1], logs
    assert logs[0][-1][0] >= 1, logs  # it did re-plan, once every rank could


# ------------------------------------------------------------------------------ settings that differ by rank
def _settings_check(rank: int, world: int, case: str) -> str:
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=2 * world, top_k=2)
    groups = ml.ParallelGroups.from_world()
    if case == "ffn_hidden_size" and rank == 1:
        cfg = cfg.replace(ffn_hidden_size=6)
    if case == "norm_topk_prob" and rank == 1:
        cfg = cfg.replace(norm_topk_prob=False)
    if case == "autocast float64":  # autocast leaves float64 alone: nothing differs
        cfg = cfg.replace(params_dtype=torch.float64)
    if case == "window":
        layer = ml.VariabilityAwareMoE(cfg, groups, window=2 + rank, auto_replan=True, seed=1)
    else:
        layer = ml.VanillaMoE(cfg, groups, seed=1)
    on = case == "autocast everywhere" or (case in ("autocast", "autocast float64") and rank == 0)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)
    with torch.no_grad(), amp:
        return _outcome(lambda: [layer(torch.randn(4, 8, dtype=cfg.params_dtype)) for _ in range(4)])


def _rank0_settings_check(rank: int, world: int) -> str:
    """Settings of the planner, which rank 0 alone runs: they may differ on the other ranks."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=2 * world, top_k=2)
    kw = dict(plan_seed=7, restarts=3, variability="high") if rank == 0 else {}
    layer = ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.from_world(), window=2, auto_replan=True, seed=1, **kw)
    with torch.no_grad():
        got = _outcome(lambda: [layer(torch.randn(4, 8)) for _ in range(4)])
    return f"{got} replans={layer.num_replans}"


def test_variability_planner_settings_read_on_rank_0_may_differ():
    assert _outcomes("world2", "rank0_settings") == ["ok replans=1"] * 2


@pytest.mark.parametrize("case", ["ffn_hidden_size", "norm_topk_prob", "window", "autocast"])
def test_ranks_built_with_other_settings_all_raise(case):
    """Another ffn_hidden_size or norm_topk_prob on one rank served another model silently; a
    VariabilityAwareMoE with another window on one rank re-planned at another step: a hang. Under
    torch.autocast on one rank only, its experts computed in bf16 and the other's in fp32, unflagged."""
    outcomes = _outcomes("world2", f"settings/{case}")
    assert all("serve different placements or layer settings" in got for got in outcomes), outcomes
    named = {"ffn_hidden_size": "config.ffn_hidden_size is 4 on rank(s) [0], 6 on rank(s) [1]",
             "norm_topk_prob": "config.norm_topk_prob is True on rank(s) [0], False on rank(s) [1]",
             "window": "window is 2 on rank(s) [0], 3 on rank(s) [1]",
             "autocast": "autocast dtype is torch.bfloat16 on rank(s) [0], None on rank(s) [1]. Every rank must "
                         "compute in the same dtype (torch.autocast on every rank or on none)"}[case]
    assert all(named in got for got in outcomes), outcomes  # what differs, named


@pytest.mark.parametrize("case", ["autocast everywhere", "autocast float64"])
def test_autocast_on_every_rank_or_of_float64_agrees(case):
    """(A float64 layer under autocast on one rank only was refused: autocast does not touch it.)"""
    assert _outcomes("world2", f"settings/{case}") == ["ok", "ok"]


def _groups_check(rank: int, world: int, case: str) -> str:
    ep = {"other_ep": [2, 1], "bad_ep_on_one": [2, 3]}[case][rank]
    return _outcome(ml.ParallelGroups.from_world, ep=ep)


@pytest.mark.parametrize("case", ["other_ep", "bad_ep_on_one"])
def test_from_world_with_other_sizes_on_one_rank(case):
    """ep=2 on rank 0 and 1 on rank 1 made other groups on each rank: the first forward returned on
    one rank and failed (or waited) on the other; ep=3 on one rank raised there alone."""
    outcomes = _outcomes("world2", f"from_world/{case}")
    if case == "bad_ep_on_one":
        assert outcomes[1].startswith("ValueError: ep=3 does not divide the world size 2"), outcomes
        assert "the ranks asked for different sizes or one refused its own" in outcomes[0], outcomes
    else:
        assert all("the ranks asked for different sizes" in got for got in outcomes), outcomes


def _load_full_check(rank: int, world: int, ep: int, case: str) -> str:
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=8, top_k=2, params_dtype=torch.float64)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(ep=ep), seed=1)
    group = rank // ep  # this rank's expert-parallel group
    g = torch.Generator().manual_seed(7 + (group if case == "seed_per_group" else 0))
    w = [torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 8, 8, generator=g, dtype=torch.float64),
         torch.randn(8, 8, 4, generator=g, dtype=torch.float64)]
    if case == "bad_shape_on_2" and rank == 2:
        w[1] = w[1][:, :-1]
    return _outcome(layer.load_full_weights, *w)


@pytest.mark.parametrize("ep", [2, 1])
@pytest.mark.parametrize("case", ["seed_per_group", "bad_shape_on_2"])
def test_load_full_weights_agrees_across_expert_parallel_groups(case, ep):
    """The check compared the expert-parallel group's ranks only (none at ep=1): weights drawn with
    another seed in each group were accepted (outputs 20-44 apart across ranks, a checkpoint of
    them a mix), and a refusal in one group loaded the others."""
    outcomes = _outcomes("world4", f"load_full/{case}/ep={ep}")
    if case == "seed_per_group":
        assert all("the weights differ between ranks of the layer" in got for got in outcomes), outcomes
    else:
        assert outcomes[2].startswith("ValueError: w13 must have shape"), outcomes
        assert all(got.startswith("ValueError: load_full_weights refused the weights of expert-parallel rank(s)")
                   for r, got in enumerate(outcomes) if r != 2), outcomes


# ------------------------------------------------------------------------------ refuse_input
def _refused_with_routing_forced(rank: int, world: int, kind: str) -> list:
    """Every rank forced the next forward's routing; rank 1's own check refused its batch through
    ``refuse_input`` while the others ran the forward, which used their forced ids up. Rank 1 kept its
    own, and its next forward, which the router should have routed, took them silently."""
    from moelayers.testing import check_close

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4 * world, top_k=2, params_dtype=torch.float64,
                       init_std=0.5)
    groups = ml.ParallelGroups.from_world(tp=world if kind == "semantic_tp" else 1)
    layer = (ml.SemanticMoE(cfg, groups, mode="tp" if kind == "semantic_tp" else "dp", seed=1) if kind != "vanilla"
             else ml.VanillaMoE(cfg, groups, seed=1))
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    residual = torch.zeros_like(x)

    def run(inputs):
        if kind == "semantic_tp":
            return layer.forward_tp(inputs, residual, lambda h: h, token_ids=None)
        return layer(inputs)

    out = []
    with torch.no_grad():
        layer.force_routing(torch.zeros(5, 2, dtype=torch.int64) + torch.tensor([0, 1]))
        out.append(_outcome(layer.refuse_input, ValueError("bad token ids")) if rank == 1 else _outcome(run, x))
        out.append(layer._forced_ids is None)
        y = run(x)
    ref = ml.reference.moe_forward(x, *layer.export_full_weights(), cfg)
    if kind == "semantic_tp":  # forward_tp sums the ranks' partial inputs, and adds them to the output
        full = sum(torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
                   for r in range(world))
        ref = full + ml.reference.moe_forward(full, *layer.export_full_weights(), cfg)
    out.append(check_close("next forward", y, ref))
    return out


@pytest.mark.parametrize("kind", ["vanilla", "semantic_dp", "semantic_tp"])
def test_refuse_input_drops_routing_forced_for_that_forward(kind):
    outcomes = _outcomes("world2", f"refuse_input/{kind}")
    assert outcomes[1][0] == "ValueError: bad token ids" and outcomes[0][0].startswith("ValueError"), outcomes
    assert all(o[1:] == [True, None] for o in outcomes), outcomes


# ------------------------------------------------------------------------------ the groups of checks
PLACEMENT_CASES = ["bad_entry", "missing_entry", "meta_entry", "float_entry", "already_there"]
GROUPS: dict[str, tuple[int, list[tuple[str, object, tuple]]]] = {
    # (megatron's checks apart: that group runs only where megatron-core is installed)
    "megatron": (2, [(case, _adapter_check, (case,)) for case in ("intermediate_tensors", "training_losses",
                                                                  "semantic_tp")]),
    "world2": (2, [
        *[(f"tiny/{case}/{attention}", _tiny_check, (case, attention)) for case in sorted(TINY_OWN)
          for attention in ("dp", "tp")],
        *[(f"forward_tp/{case}", _forward_tp_check, (case,)) for case in ("other_token_tables", "other_forced_routing",
                                                                           "ids_on_meta", "history_on_meta")],
        ("dp_ids", _dp_ids_check, ()),
        *[(f"placement/{case}", _placement_check, (case,)) for case in PLACEMENT_CASES],
        ("load/every_case", _model_state_checks, ()),
        ("load/optimizer_holds_other_weights", _model_state_check, ("optimizer_holds_other_weights",)),
        *[(f"capacity/served_before={served}", _capacity_placement_check, (served,)) for served in (False, True)],
        *[(f"autograd/{dispatcher}/{how}", _autograd_check, (dispatcher, how)) for dispatcher in ("alltoall", "allgather")
          for how in ("no_grad", "frozen")],
        ("frozen_experts", _frozen_experts_check, ()),
        *[(f"replan/main_grad={main_grad}", _replan_check, (main_grad,)) for main_grad in (False, True)],
        ("rank0_settings", _rank0_settings_check, ()),
        *[(f"settings/{case}", _settings_check, (case,)) for case in ("ffn_hidden_size", "norm_topk_prob", "window",
                                                                       "autocast", "autocast everywhere",
                                                                       "autocast float64")],
        *[(f"from_world/{case}", _groups_check, (case,)) for case in ("other_ep", "bad_ep_on_one")],
        *[(f"refuse_input/{kind}", _refused_with_routing_forced, (kind,)) for kind in ("vanilla", "semantic_dp",
                                                                                         "semantic_tp")],
    ]),
    "world4": (4, [
        *[(f"placement/{case}", _placement_check, (case,)) for case in PLACEMENT_CASES],
        ("placement/one_group_there_already", _placement_one_group_there_already, ()),
        ("placement/mixed_groups", _placement_mixed_groups, ()),
        ("placement/move_fails_in_one_group", _placement_move_fails_in_one_group, ()),
        ("load/every_case", _model_state_checks, ()),
        *[(f"load_full/{case}/ep={ep}", _load_full_check, (ep, case)) for case in ("seed_per_group", "bad_shape_on_2")
          for ep in (2, 1)],
    ]),
}
