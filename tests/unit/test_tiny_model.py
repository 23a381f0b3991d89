"""TinyDecoder (moelayers.models.tiny): cached continuous-batching steps vs the full forward, and its
MoE slot vs the dense reference (single process)."""

import pytest
import torch

import moelayers as ml
from moelayers.models import StepRequest, TinyConfig, TinyDecoder
from moelayers.reference import moe_forward
from moelayers.testing import check_close, error_of

V, H, E, K = 128, 32, 8, 2


def make_model(dtype=torch.float64, seed=0, num_layers=2):
    moe_cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=E, top_k=K, params_dtype=dtype, init_std=0.2)
    cfg = TinyConfig(vocab_size=V, hidden_size=H, num_layers=num_layers, num_heads=4, dtype=dtype, init_std=0.2)
    return TinyDecoder(cfg, lambda i: ml.VanillaMoE(moe_cfg, ml.ParallelGroups.single(), seed=seed + i), seed=seed)


@pytest.mark.timeout(60)
def test_step_with_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    model = make_model()
    ids = torch.randint(0, V, (3, 14))
    with torch.no_grad():
        full = model(ids)  # [3, 14, V]
        # step 1: two whole prompts (prefill) of different lengths
        out = model.step([StepRequest("a", ids[0, :6]), ("b", ids[1, :9])])
        assert set(out) == {"a", "b"}
        torch.testing.assert_close(out["a"], full[0, 5], rtol=0, atol=1e-10)
        torch.testing.assert_close(out["b"], full[1, 8], rtol=0, atol=1e-10)
        # steps 2..: decode tokens of a and b mixed with a new prefill of c, then a chunk after a cache
        out = model.step([("a", ids[0, 6:7]), ("c", ids[2, :4]), ("b", ids[1, 9:10])])
        torch.testing.assert_close(out["a"], full[0, 6], rtol=0, atol=1e-10)
        torch.testing.assert_close(out["b"], full[1, 9], rtol=0, atol=1e-10)
        torch.testing.assert_close(out["c"], full[2, 3], rtol=0, atol=1e-10)
        for pos in range(7, 14):
            out = model.step([("a", ids[0, pos:pos + 1]), ("c", ids[2, pos - 3:pos - 2])])
            torch.testing.assert_close(out["a"], full[0, pos], rtol=0, atol=1e-10)
            torch.testing.assert_close(out["c"], full[2, pos - 3], rtol=0, atol=1e-10)
        out = model.step([("c", ids[2, 11:14])])  # a multi-token chunk continuing a cache
        torch.testing.assert_close(out["c"], full[2, 13], rtol=0, atol=1e-10)
        assert model.cache_length("a") == 14 and model.cache_length("c") == 14
        model.release("a")
        assert model.cache_length("a") == 0 and "a" not in model.caches


@pytest.mark.timeout(60)
def test_greedy_decode_matches_recomputation():
    torch.manual_seed(1)
    model = make_model(dtype=torch.float32)
    prompt = torch.randint(0, V, (5,))
    with torch.no_grad():
        seq = prompt.tolist()
        nxt = int(model.step([("r", prompt)])["r"].argmax())
        for _ in range(6):
            seq.append(nxt)
            ref = int(model(torch.tensor([seq]))[0, -1].argmax())
            nxt = int(model.step([("r", torch.tensor([nxt]))])["r"].argmax())
            assert nxt == ref


def test_a_step_that_fails_part_way_changes_no_cache():
    """A collective may raise in a later block (e.g. a capacity overflow on some rank): the caches
    stay as before the step, so retrying gives what a clean run gives."""
    torch.manual_seed(2)
    model, clean = make_model(seed=5), make_model(seed=5)
    ids = torch.randint(0, V, (2, 8))
    with torch.no_grad():
        for m in (model, clean):
            m.step([("a", ids[0, :5]), ("b", ids[1, :3])])
        num_blocks = len(model.blocks)
        bad = [None] * (num_blocks - 1) + [torch.zeros(3, 5, dtype=torch.int64)]  # last block: wrong shape
        with pytest.raises(ValueError, match="forced routing"):
            model.step([("a", ids[0, 5:6]), ("c", ids[1, 3:5])], forced_topk=bad)
        assert model.cache_length("a") == 5 and model.cache_length("b") == 3 and "c" not in model.caches
        got = model.step([("a", ids[0, 5:6]), ("c", ids[1, 3:5])])
        want = clean.step([("a", ids[0, 5:6]), ("c", ids[1, 3:5])])
        for rid in ("a", "c"):
            torch.testing.assert_close(got[rid], want[rid], rtol=0, atol=0)
        with pytest.raises(ValueError, match="twice"):
            model.step([("a", ids[0, 6:7]), ("a", ids[0, 7:8])])


def test_empty_step_and_determinism():
    a, b = make_model(seed=3), make_model(seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    with torch.no_grad():
        assert a.step([]) == {}
        with pytest.raises(ValueError):
            a.step([("x", torch.zeros(0, dtype=torch.int64))])


@pytest.mark.parametrize("forced", [False, True])
def test_moe_slot_matches_reference(forced):
    torch.manual_seed(2)
    model = make_model(dtype=torch.float32)
    seen = {}

    def hook(mod, args, kwargs, out):
        seen["x"], seen["token_ids"], seen["y"] = args[0].detach().clone(), kwargs["token_ids"], out.detach().clone()

    slot = model.blocks[1].moe
    handle = slot.register_forward_hook(hook, with_kwargs=True)
    ids = [torch.randint(0, V, (n,)) for n in (7, 1, 4)]
    topk = torch.stack([torch.randperm(E)[:K] for _ in range(5)]) if forced else None
    with torch.no_grad():
        model.step([("p", ids[0])])
        model.step([("p", ids[1]), ("q", ids[2])], forced_topk=[None, topk] if forced else None)
    handle.remove()
    # the slot got every token of the step in one call, in batch order, with their token ids
    assert seen["x"].shape == (5, H) and seen["token_ids"].tolist() == torch.cat(ids[1:]).tolist()
    if forced:
        assert torch.equal(slot.last_topk_ids, topk)
        assert not torch.equal(model.blocks[0].moe.last_topk_ids, topk)  # block 0 routed itself
    rw, w13, w2 = slot.export_full_weights()
    ref64 = moe_forward(seen["x"].double(), rw.double(), w13.double(), w2.double(), slot.config, topk_ids=topk)
    assert check_close("tiny moe slot", seen["y"], ref64) is None


def test_bad_ids_and_config_values_are_refused():
    """step() truncated float ids (forward() refuses them); rope_theta=0 made RoPE NaN, which the
    attention kernel turned into zeros: a model without attention, silently."""
    model = make_model()
    with pytest.raises(TypeError, match="token_ids must be an integer tensor"):
        model.step([StepRequest("r", torch.tensor([3.7, 5.2]))])
    assert model.cache_length("r") == 0
    with pytest.raises(ValueError, match=r"input_ids must be \[B, S\], got \[20\]: one sequence .* input_ids\[None\]"):
        model(torch.randint(0, V, (20,)))  # it failed unpacking the shape ("not enough values to unpack")
    with pytest.raises(TypeError, match="input_ids must be an integer tensor, got torch.float32"):
        model(torch.rand(2, 5))
    assert model(torch.randint(0, V, (20,))[None]).shape == (1, 20, V)
    for name, value in (("rope_theta", 0.0), ("rope_theta", float("nan")), ("norm_eps", -1e-6), ("init_std", float("inf"))):
        with pytest.raises(ValueError, match=f"TinyConfig.{name} must be a finite number"):
            TinyConfig(**{name: value})


def test_empty_batches_narrow_ids_and_out_of_vocabulary_ids():
    """forward() crashed on [B, 0] and [0, S] (an ambiguous reshape of 0 elements) and on uint8/int16
    ids (nn.Embedding takes int32/int64 only), which step() cast; an id outside the vocabulary was
    nn.Embedding's bare 'index out of range in self' in both paths."""
    model = make_model()
    with torch.no_grad():
        assert model(torch.zeros(2, 0, dtype=torch.int64)).shape == (2, 0, V)
        assert model(torch.zeros(0, 5, dtype=torch.int64)).shape == (0, 5, V)
        ids = torch.randint(0, V, (2, 6))
        want = model(ids)
        for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
            assert torch.equal(model(ids.to(dtype)), want), dtype
        for bad in (V, -1):
            with pytest.raises(ValueError, match=rf"input_ids: token id {bad} outside \[0, vocab_size={V}\)"):
                model(torch.tensor([[1, bad, 2]]))
            with pytest.raises(ValueError, match=rf"request 'r': token_ids: token id {bad} outside"):
                model.step([("r", torch.tensor([1, bad]))])
        assert model.caches == {}


def test_malformed_step_items_are_refused():
    """A [2, 3] tensor was taken as one 6-token prompt, a bare id tensor as (ids[0], ids[1]) (a
    request keyed by a tensor, a cache nobody could find again), a 1-tuple as a bare IndexError."""
    model = make_model()
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"request 'r': token_ids must be \[n\], got \[2, 3\]"):
            model.step([("r", torch.arange(6).view(2, 3))])
        with pytest.raises(TypeError, match="batch item 0: expected a StepRequest or \\(request_id, token_ids\\), "
                                            "got Tensor of shape \\[3\\]"):
            model.step([torch.tensor([7, 8, 9])])
        with pytest.raises(TypeError, match="batch item 1: expected"):
            model.step([("a", torch.tensor([1])), ("r2",)])
        with pytest.raises(TypeError, match="request_id must be hashable by value"):
            model.step([(torch.tensor(3), torch.tensor([1, 2]))])
        assert model.caches == {}
        model.step([["a", torch.tensor(5)]])  # a list pair and a 0-d tensor (one token) are fine
        assert model.cache_length("a") == 1


def test_moe_slots_that_cannot_serve_are_refused_at_construction():
    """These used to build and fail at the first forward (or, for a dp-mode SemanticMoE under
    attention='tp', pass the forward_tp check)."""
    cfg = TinyConfig(vocab_size=V, hidden_size=H, num_layers=2, num_heads=4, dtype=torch.float64)
    moe = ml.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=E, top_k=K, params_dtype=torch.float64)
    single = ml.ParallelGroups.single()
    with pytest.raises(TypeError, match=r"moe_factory\(0\) returned NoneType, not an nn.Module"):
        TinyDecoder(cfg, lambda i: None)
    with pytest.raises(ValueError, match=r"moe_factory\(0\): the MoE layer computes in torch.float32, the model in torch.float64"):
        TinyDecoder(cfg, lambda i: ml.VanillaMoE(moe.replace(params_dtype=torch.float32), single))
    with pytest.raises(ValueError, match=r"moe_factory\(0\): the MoE layer's hidden_size 16 is not the model's 32"):
        TinyDecoder(cfg, lambda i: ml.VanillaMoE(moe.replace(hidden_size=16), single))
    with pytest.raises(ValueError, match="attention='tp' needs MoE slots with forward_tp .* block 0 holds VanillaMoE"):
        TinyDecoder(cfg, lambda i: ml.VanillaMoE(moe, single), attention="tp", groups=single)
    from tests.distributed.test_semantic import make_plan

    plan = make_plan(E, 1, mode="dp", vocab=V)
    with pytest.raises(ValueError, match=r"block 0 holds SemanticMoE\(mode='dp'\)"):
        TinyDecoder(cfg, lambda i: ml.SemanticMoE.from_plan(plan, i, moe, single), attention="tp", groups=single)
    tp_plan = make_plan(E, 1, mode="tp", vocab=V)
    model = TinyDecoder(cfg, lambda i: ml.SemanticMoE.from_plan(tp_plan, i, moe, single), attention="tp", groups=single)
    with torch.no_grad():
        assert model(torch.randint(0, V, (2, 5))).shape == (2, 5, V)


def test_check_close_refuses_a_coarser_low_precision_reference():
    """A bf16 ref_low for a float16 output loosened the tolerance enough to pass a 2 % error."""
    ref64 = torch.linspace(-1, 1, 64, dtype=torch.float64).reshape(8, 8)
    y = (ref64 * 1.02).half()
    assert check_close("y", y, ref64, ref64.half()) is not None
    with pytest.raises(ValueError, match=r"ref_low must be the reference computed in torch.float16 \(the precision of the rule\)"):
        check_close("y", y, ref64, ref64.bfloat16())


def test_check_close_refuses_outputs_too_small_to_check():
    """Outputs of about 1e-4 (weights drawn with the default init_std 0.02) passed a 5 % error under
    the float tolerance's absolute floor of 1e-5."""
    ref64 = 1e-4 * torch.linspace(-1, 1, 64, dtype=torch.float64).reshape(8, 8)
    msg = check_close("y", (ref64 * 1.05).float(), ref64)
    assert msg is not None and "so small that the torch.float32 tolerance" in msg, msg
    assert check_close("y", ref64.float(), ref64) is not None  # even a right one: it checks too little
    assert check_close("y", (ref64 * 1.05).float(), ref64, allow_loose=True) is None  # asked for
    assert check_close("y", ref64.float(), ref64 * 1e3) is not None and check_close("y", ref64 * 1e3, ref64 * 1e3) is None
    assert check_close("empty", torch.zeros(0, 8), torch.zeros(0, 8, dtype=torch.float64)) is None
    assert check_close("zeros", torch.zeros(3, 8), torch.zeros(3, 8, dtype=torch.float64)) is None
    round_off = 1e-17 * torch.randn(3, 8, dtype=torch.float64)  # a gradient zero but for round-off
    msg = check_close("router grad", round_off.float(), round_off)
    assert "is zero up to round-off" in msg and "top_k=1" in msg, msg


def test_step_items_of_three_or_more_fields_are_refused():
    """A (request_id, token_ids, extra) item was taken as a pair, silently dropping the third field."""
    model = make_model()
    with torch.no_grad():
        with pytest.raises(TypeError, match=r"batch item 0: expected a StepRequest or \(request_id, token_ids\), "
                                            r"got tuple"):
            model.step([("a", torch.tensor([1, 2]), torch.tensor([3]))])
        with pytest.raises(TypeError, match="batch item 1: expected"):
            model.step([("b", torch.tensor([1])), ["c", torch.tensor([1]), None]])
    assert model.caches == {}


def test_step_keeps_no_autograd_graph_across_steps():
    """Outside no_grad every cached k/v carried its step's graph, and each cache kept the graphs
    of all earlier steps alive (memory growing with the square of the sequence length)."""
    model = make_model()
    out = model.step([("r", torch.tensor([1, 2, 3]))])
    for pos in range(3):
        out = model.step([("r", torch.tensor([4 + pos]))])
    cache = model.caches["r"][0]
    assert out["r"].grad_fn is None and cache.k.grad_fn is None and cache.v.grad_fn is None


def _forced_of_a_bad_type_on_one_rank(rank, world, attention):
    """Rank 1 has no request this step and builds its empty forced routing as torch.empty(0, K):
    float32. force_routing raised TypeError on that rank alone, and rank 0 waited in the MoE
    exchange until gloo's connection failed. Every rank now raises, and the next step serves."""
    from tests.distributed.test_semantic import make_plan

    groups = ml.ParallelGroups.from_world(ep=world, tp=world if attention == "tp" else 1)
    moe_cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=E, top_k=K, params_dtype=torch.float64)
    cfg = TinyConfig(vocab_size=V, hidden_size=H, num_layers=2, num_heads=4, dtype=torch.float64)
    if attention == "tp":
        plan = make_plan(E, world, mode="tp", vocab=V)
        model = TinyDecoder(cfg, lambda i: ml.SemanticMoE.from_plan(plan, i, moe_cfg, groups, seed=i),
                            attention="tp", groups=groups)
        batch = [("a", torch.tensor([1, 2, 3]))]  # every rank runs the same tokens
        forced = [torch.zeros(3, K, dtype=torch.int64)] * 2
        if rank == 1:
            forced = [torch.zeros(3, K)] * 2  # float ids
    else:
        model = TinyDecoder(cfg, lambda i: ml.VanillaMoE(moe_cfg, groups, seed=i))
        batch = [("a", torch.tensor([1, 2, 3]))] if rank == 0 else []
        forced = [torch.zeros(3, K, dtype=torch.int64)] * 2 if rank == 0 else [torch.empty(0, K)] * 2
    try:
        model.step(batch, forced_topk=forced)
        got = "no error"
    except (TypeError, ValueError) as exc:
        got = type(exc).__name__
    return got, sorted(model.step(batch))  # the ranks are still in step


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attention", ["dp", "tp"])
def test_step_refuses_forced_ids_of_one_rank_on_every_rank(attention):
    from moelayers.testing import run_distributed

    res = run_distributed(_forced_of_a_bad_type_on_one_rank, 2, attention, timeout=60)
    assert res[1][0] == "TypeError" and res[0][0] in ("TypeError", "ValueError"), res
    assert res[0][1] == ["a"] and res[1][1] == (["a"] if attention == "tp" else []), res


def _forced_out_of_range_in_capacity_mode(rank, world):
    """Capacity mode without the NaN check reads the exchanged flags only on ranks that force their
    routing: a rank without tokens passing forced_topk=None went on into the next layer's exchange
    while the other raised (a hang). With empty [0, K] ids, as serve.py now passes, both raise."""
    groups = ml.ParallelGroups.from_world()
    moe_cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=E, top_k=K, params_dtype=torch.float64)
    cfg = TinyConfig(vocab_size=V, hidden_size=H, num_layers=2, num_heads=4, dtype=torch.float64)
    model = TinyDecoder(cfg, lambda i: ml.VanillaMoE(moe_cfg, groups, seed=i, capacity=8, check_finite=False))
    if rank == 0:
        batch, forced = [("a", torch.tensor([1, 2, 3]))], [torch.full((3, K), E, dtype=torch.int64)] * 2
    else:
        batch, forced = [], [torch.zeros(0, K, dtype=torch.int64)] * 2
    return error_of(model.step, batch, forced_topk=forced)


@pytest.mark.timeout(120)
def test_idle_ranks_forcing_empty_ids_raise_with_the_others_in_capacity_mode():
    from moelayers.testing import run_distributed

    for got in run_distributed(_forced_out_of_range_in_capacity_mode, 2, timeout=60):
        assert "forced routing (force_routing) holds expert ids outside" in got, got


def test_check_close_takes_autocasts_precision_and_refuses_an_overflowed_reference():
    """A float32 layer under bf16 autocast returns float32 computed in bf16: check_close applied the
    float32 rule (1.8e-2 against 2.5e-5) or refused the bf16 reference; and an fp16 reference that
    overflowed gave 'tolerance nan' (a low-precision journey)."""
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, init_std=0.5)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=3)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(0)).bfloat16()  # as an nn.Linear hands it on
    weights = layer.export_full_weights()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        ref = ml.reference.moe_forward(x, *weights, cfg, topk_ids=layer.last_topk_ids)
    with torch.no_grad():
        ref64 = ml.reference.moe_forward(x.double(), *(w.double() for w in weights), cfg, topk_ids=layer.last_topk_ids)
    assert y.dtype == torch.float32 and ref.dtype == torch.bfloat16
    assert check_close("y", y, ref64, ref, dtype=torch.bfloat16) is None
    with pytest.raises(ValueError, match="under autocast pass dtype= its dtype"):
        check_close("y", y, ref64, ref)
    assert check_close("y", y, ref64) is not None  # the float32 rule: off by bf16's error
    inf = ref.clone()
    inf[0, 0] = float("inf")
    assert "reference is not finite (it overflowed)" in check_close("y", y, ref64, inf, dtype=torch.bfloat16)
    nan64 = ref64.clone()
    nan64[1, 1] = float("nan")
    assert "the float64 reference is not finite" in check_close("y", y, nan64, ref, dtype=torch.bfloat16)
    assert "the float64 reference is not finite" in check_close("y", y.double(), nan64)  # (the rule's floor hid it)
