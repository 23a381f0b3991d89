"""torch distributed checkpointing (DCP) through ``moelayers.checkpoint``: experts by id, so a
checkpoint resumes training in another placement and expert-parallel size (gloo, world 2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import moelayers as ml
from moelayers import checkpoint as mlc
from moelayers.testing import run_distributed

H, F, E, K = 8, 6, 4, 2
STEPS = 3  # before the checkpoint, and again after it


class _Model(nn.Module):
    """A linear layer, then an MoE layer: something besides the experts to save and train."""

    def __init__(self, groups: ml.ParallelGroups, placement: ml.ExpertPlacement | None, device: str,
                 dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(H, H, dtype=dtype, device=device)
        cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, params_dtype=dtype)
        self.moe = ml.VanillaMoE(cfg, groups, placement=placement, seed=1, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.pre(x))


def _placements(ep: int) -> dict[str, ml.ExpertPlacement | None]:
    if ep == 1:
        return {"linear": None, "permuted": ml.ExpertPlacement(torch.tensor([[3, 0, 2, 1, -1]]), E)}
    return {"linear": None,
            "replicated": ml.ExpertPlacement(torch.tensor([[0, 1, 3], [2, 3, 0]]), E),
            "reversed": ml.ExpertPlacement(torch.tensor([[3, 2, -1], [1, 0, 2]]), E)}


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    """Adam steps on per-rank batches (the same on any layout: drawn from the step and rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    w = model.pre.weight
    for step in steps:
        x = torch.randn(5, H, dtype=w.dtype, generator=torch.Generator().manual_seed(100 * step + rank)).to(w.device)
        optim.zero_grad()
        model(x).pow(2).sum().backward()
        for p in model.pre.parameters():  # torch DDP's gradient over the world
            dist.all_reduce(p.grad)
            p.grad /= world
        dist.all_reduce(model.moe.router.weight.grad)
        model.moe.router.weight.grad /= world
        ml.reduce_expert_grads(model)
        optim.step()


def _logical(model: _Model, optim: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """The weights and (with ``optim``) Adam moments in logical expert order, gathered over the expert-parallel group."""
    from moelayers.experts import gather_logical

    layer = model.moe
    out = {"pre": model.pre.weight.detach().clone(), "router": layer.router.weight.detach().clone()}
    out["w13"], out["w2"] = gather_logical(layer.experts.w13.detach(), layer.experts.w2.detach(), layer.placement,
                                           layer.groups.ep)
    for name in ("exp_avg", "exp_avg_sq") if optim is not None else ():
        out[f"w13.{name}"], out[f"w2.{name}"] = gather_logical(
            optim.state[layer.experts.w13][name], optim.state[layer.experts.w2][name], layer.placement,
            layer.groups.ep)
    return out


def _build(ep: int, place: str, device: str = "cpu", dtype: torch.dtype = torch.float64
           ) -> tuple[_Model, torch.optim.Optimizer]:
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    model = _Model(ml.ParallelGroups.from_world(ep=ep), _placements(ep)[place], device, dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_and_resume(rank: int, world: int, root: str, device: str = "cpu", dtype: torch.dtype = torch.float64
                     ) -> dict:
    """Train, save, train on (the uninterrupted run); load into every layout and train on: the
    loaded state is checked bit for bit here, the largest difference to the uninterrupted run returned."""
    model, optim = _build(world, "replicated", device, dtype)
    _train(model, optim, range(STEPS))
    at_save = _logical(model, optim)
    dcp.save({"model": mlc.model_state_dict(model), "optim": mlc.optimizer_state_dict(model, optim)},
             checkpoint_id=root)
    _train(model, optim, range(STEPS, 2 * STEPS))
    uninterrupted = _logical(model, optim)
    errors = {}
    for ep in (world, 1):
        for place in _placements(ep):
            fresh, fresh_optim = _build(ep, place, device, dtype)
            placement = fresh.moe.placement.copy()
            state = {"model": mlc.model_state_dict(fresh), "optim": mlc.optimizer_state_dict(fresh, fresh_optim)}
            dcp.load(state, checkpoint_id=root)
            mlc.load_model_state_dict(fresh, state["model"])
            mlc.load_optimizer_state_dict(fresh, fresh_optim, state["optim"])
            assert fresh.moe.placement == placement  # the loading layer keeps its own
            loaded = _logical(fresh, fresh_optim)
            for key, value in at_save.items():  # bit for bit, replicas included
                assert torch.equal(loaded[key], value), (ep, place, key)
            assert fresh_optim.param_groups[0]["lr"] == 1e-2
            _train(fresh, fresh_optim, range(STEPS, 2 * STEPS))
            resumed = _logical(fresh, fresh_optim)
            errors[(ep, place)] = max(float((resumed[k] - uninterrupted[k]).abs().max()) for k in uninterrupted)
    return errors


def test_dcp_checkpoint_resumes_training_in_any_placement_and_expert_parallel_size(tmp_path):
    """Saved at EP2 in a replicated placement with Adam state; loaded at EP2 in the linear, the same
    and a reversed placement with an empty slot, and at EP1 x DP2 (every rank all experts), linear and
    permuted with an empty slot: the logical weights and moments are the saved ones bit for bit, and three more
    steps give the uninterrupted run's weights (up to the summation order of another layout)."""
    results = run_distributed(_save_and_resume, 2, str(tmp_path / "ckpt"), timeout=240)
    for errors in results:
        assert len(errors) == 5
        for case, err in errors.items():
            assert err < 1e-12, (case, err)


def _refusals(rank: int, world: int, root: str) -> list[str]:
    model, optim = _build(world, "linear")
    _train(model, optim, range(1))
    dcp.save({"model": mlc.model_state_dict(model)}, checkpoint_id=root)
    out = []
    fresh, _ = _build(world, "replicated")
    before = _logical(fresh)
    state = {k: v.clone() for k, v in mlc.model_state_dict(fresh).items()}  # not views: the model stays as built
    dcp.load({"model": state}, checkpoint_id=root)
    e = [e for e in fresh.moe.placement.experts_on(rank) if e >= 0][-1]  # w2 of the last expert: checked last
    for bad, error in ((lambda s: s.pop(f"moe.experts.w2.{e}"), KeyError),
                       (lambda s: s.__setitem__(f"moe.experts.w2.{e}", torch.zeros(H, F + 1)), ValueError)):
        broken = dict(state)
        bad(broken)
        with pytest.raises(error) as info:
            mlc.load_model_state_dict(fresh, broken)
        out.append(str(info.value))
        after = _logical(fresh)
        assert all(torch.equal(after[k], before[k]) for k in before), "something was loaded"
    # the optimizer: a state dict without one of this rank's experts (w2's last: checked last)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    mlc.optimizer_state_dict(fresh, fresh_optim)  # (gives the optimizer its state)
    experts = (fresh.moe.experts.w13, fresh.moe.experts.w2)
    fresh_optim.state[experts[0]]["count"] = 1  # a state that is not a tensor (as some optimizers keep)
    optim_state = mlc.optimizer_state_dict(fresh, fresh_optim)  # other values than the live ones (not views)
    optim_state["state"] = {k: {n: v + 1 if torch.is_tensor(v) else 99 if n == "count" else v for n, v in entry.items()}
                            for k, entry in optim_state["state"].items()}
    before = [{k: v.clone() if torch.is_tensor(v) else v for k, v in fresh_optim.state[p].items()} for p in experts]
    del optim_state["state"][f"moe.experts.w2.{e}"]
    with pytest.raises(KeyError) as info:
        mlc.load_optimizer_state_dict(fresh, fresh_optim, optim_state)
    out.append(str(info.value))
    for p, was in zip(experts, before):
        now = fresh_optim.state[p]
        assert now.keys() == was.keys() and all(torch.equal(now[k], v) if torch.is_tensor(v) else now[k] == v
                                                for k, v in was.items()), "something of the optimizer was loaded"
    return out


def test_dcp_checkpoint_refusals_load_nothing(tmp_path):
    """A state dict missing one of this rank's experts, or with a row of another shape, raises
    before anything of the model is loaded; an optimizer state dict missing an expert, before
    anything of the optimizer is."""
    for missing, misfit, optim_missing in run_distributed(_refusals, 2, str(tmp_path / "ckpt"), timeout=240):
        assert "missing the expert entries ['moe.experts.w2." in missing and "nothing was loaded" in missing
        assert "load_optimizer_state_dict: missing the expert entries ['moe.experts.w2." in optim_missing
        assert "[8, 7] in the checkpoint, [8, 6] here; nothing was loaded" in misfit


def _plain_state_dict_through_dcp(rank: int, world: int, root: str) -> str | None:
    model, _ = _build(world, "linear")
    dcp.save(model.state_dict(), checkpoint_id=root)
    fresh, _ = _build(world, "linear")
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=root)
    try:
        fresh.load_state_dict(state)
    except ValueError as exc:
        return str(exc)
    return None


def test_plain_state_dict_through_dcp_is_refused_naming_the_way(tmp_path):
    """dcp.save(model.state_dict()) writes one rank's slots (equal keys on every rank): the load
    raises on the ranks whose placement record came from another rank, and says what to save instead."""
    messages = run_distributed(_plain_state_dict_through_dcp, 2, str(tmp_path / "ckpt"), timeout=240)
    raised = [m for m in messages if m is not None]
    assert raised, "no rank refused a checkpoint with one rank's experts"
    for message in raised:
        assert "holds the expert slots of expert-parallel rank" in message
        assert "moelayers.checkpoint.model_state_dict(model)" in message


def _partial_loads(rank: int, world: int, root: str) -> list:
    model, _ = _build(world, "linear")
    dcp.save({"model": mlc.model_state_dict(model)}, checkpoint_id=root)
    saved = _logical(model)
    out = []
    for strict in (True, False):
        fresh, _ = _build(world, "replicated")
        torch.manual_seed(5)
        fresh.moe.router.weight.data.normal_()  # unlike the checkpoint's
        before = _logical(fresh)
        state = {k: v.clone() for k, v in mlc.model_state_dict(fresh).items()}
        dcp.load({"model": state}, checkpoint_id=root)
        del state["moe.router.weight"]  # e.g. experts and the rest, with a router of its own
        state["extra.weight"] = torch.zeros(1)
        try:
            result = mlc.load_model_state_dict(fresh, state, strict=strict)
        except RuntimeError as exc:
            out.append(str(exc))
            after = _logical(fresh)
            assert all(torch.equal(after[k], before[k]) for k in before), "something was loaded"
            continue
        out.append((result.missing_keys, result.unexpected_keys))
        after = _logical(fresh)
        assert torch.equal(after["router"], before["router"])
        assert all(torch.equal(after[k], saved[k]) for k in ("pre", "w13", "w2"))
    return out


def test_dcp_load_strict_as_torch(tmp_path):
    """A state dict without the MoE router and with an unknown key: strict raises before anything is
    loaded; strict=False loads the rest (the experts into another placement) and returns both keys."""
    for refused, (missing, unexpected) in run_distributed(_partial_loads, 2, str(tmp_path / "ckpt"), timeout=240):
        assert "missing keys ['moe.router.weight'], unexpected keys ['extra.weight']; nothing was loaded" in refused
        assert (missing, unexpected) == (["moe.router.weight"], ["extra.weight"])


class _Twice(_Model):
    """The same MoE layer at two depths: registered under two names."""

    def __init__(self, *args):
        super().__init__(*args)
        self.moe_again = self.moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe_again(super().forward(x))


def _shared_layer(rank: int, world: int, root: str) -> list[str]:
    models = []
    for place in ("linear", "reversed"):
        model = _Twice(ml.ParallelGroups.from_world(), _placements(world)[place], "cpu", torch.float64)
        models.append((model, torch.optim.AdamW(model.parameters(), lr=1e-2)))
    (model, optim), (fresh, fresh_optim) = models
    _train(model, optim, range(2))
    state = {"model": mlc.model_state_dict(model), "optim": mlc.optimizer_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=root)
    saved_keys = sorted(state["model"])
    state = {"model": mlc.model_state_dict(fresh), "optim": mlc.optimizer_state_dict(fresh, fresh_optim)}
    dcp.load(state, checkpoint_id=root)
    mlc.load_model_state_dict(fresh, state["model"])
    mlc.load_optimizer_state_dict(fresh, fresh_optim, state["optim"])
    want, got = _logical(model, optim), _logical(fresh, fresh_optim)
    return [k for k in want if not torch.equal(want[k], got[k])] + saved_keys


def test_dcp_checkpoint_of_a_layer_under_two_names(tmp_path):
    """A layer used at two depths has two names in the state dicts: its experts are named by id
    under the first (no slot tensor left under a key all ranks share), its Adam moments too, and
    the checkpoint loads bit for bit into another placement."""
    for rank, result in enumerate(run_distributed(_shared_layer, 2, str(tmp_path / "ckpt"), timeout=240)):
        experts = [f"moe.experts.{w}.{e}" for w in ("w13", "w2") for e in ((0, 1) if rank == 0 else (2, 3))]
        assert result == experts + ["moe.router.weight", "moe_again.router.weight", "pre.bias", "pre.weight"]


def _readme_snippet() -> str:
    """The README's DCP example (the python block of its torch-distributed-checkpointing bullet)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = text[text.index("**torch distributed checkpointing**"):].split("```python", 1)[1].split("```", 1)[0]
    return "\n".join(line[2:] if line.startswith("  ") else line for line in block.splitlines())


def _run_readme(rank: int, world: int, root: str, snippet: str) -> bool:
    model, optim = _build(world, "replicated")
    _train(model, optim, range(1))
    before = _logical(model, optim)
    exec(snippet, {"model": model, "optim": optim, "path": root})  # saves, then loads into the same model
    after = _logical(model, optim)
    return all(torch.equal(after[k], before[k]) for k in before)


def test_readme_dcp_example_runs(tmp_path):
    """The README's example, as written, saves and loads (a round trip leaves everything as it was)."""
    snippet = _readme_snippet()
    assert "dcp.save(" in snippet and "mlc.load_optimizer_state_dict(" in snippet
    assert run_distributed(_run_readme, 2, str(tmp_path / "ckpt"), snippet, timeout=240) == [True, True]


def _raw(model: _Model, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's slot tensors and their Adam moments, as laid out (not in logical order)."""
    w13, w2 = model.moe.experts.w13, model.moe.experts.w2
    out = {"w13": w13.detach().clone(), "w2": w2.detach().clone()}
    out.update({f"{n}.{k}": optim.state[p][k].clone() for n, p in (("w13", w13), ("w2", w2))
                for k in ("exp_avg", "exp_avg_sq")})
    return out


def _build_linear3(world: int, device: str) -> tuple[_Model, torch.optim.Optimizer]:
    """The linear placement with 3 slots per rank (one empty), the shape of ``_placements``' others."""
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    model = _Model(ml.ParallelGroups.from_world(), ml.ExpertPlacement.linear(E, world, 3), device, torch.float64)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _resume_in_saved_placement(rank: int, world: int, root: str, device: str = "cpu") -> dict:
    """Train in the linear placement, move to a reversed one (with the optimizer), save with the
    placements; a fresh linear model loads the weights and optimizer, then moves into the saved
    placement: its slots and moments are the saved ones bit for bit, and it trains on exactly as
    the uninterrupted run. Refusals move nothing. (Also over NCCL, tests/gpu.)"""
    model, optim = _build_linear3(world, device)
    _train(model, optim, range(STEPS))
    optim.zero_grad(set_to_none=True)
    model.moe.apply_placement(_placements(world)["reversed"], optimizer=optim)
    saved = _placements(world)["reversed"]
    placements = mlc.placement_state_dict(model)
    assert list(placements) == ["moe.placement"] and torch.equal(placements["moe.placement"], saved.phy2log)
    dcp.save({"model": mlc.model_state_dict(model), "optim": mlc.optimizer_state_dict(model, optim),
              "placements": placements}, checkpoint_id=root)
    at_save = _raw(model, optim)
    _train(model, optim, range(STEPS, 2 * STEPS))
    uninterrupted = _raw(model, optim)

    fresh, fresh_optim = _build_linear3(world, device)
    linear = fresh.moe.placement.copy()
    state = {"model": mlc.model_state_dict(fresh), "optim": mlc.optimizer_state_dict(fresh, fresh_optim),
             "placements": mlc.placement_state_dict(fresh)}
    dcp.load(state, checkpoint_id=root)
    mlc.load_model_state_dict(fresh, state["model"])
    mlc.load_optimizer_state_dict(fresh, fresh_optim, state["optim"])
    out = {}
    # refusals: nothing moves
    for case, bad, error in (("missing", {}, KeyError),
                             ("ep1", {"moe.placement": torch.tensor([[3, 2, 1, 0, -1, -1]])}, ValueError),
                             ("invalid", {"moe.placement": torch.tensor([[3, 2, 9], [1, 0, 2]])}, ValueError)):
        with pytest.raises(error) as info:
            mlc.load_placement_state_dict(fresh, bad, optimizer=fresh_optim)
        out[case] = str(info.value)
        assert fresh.moe.placement == linear
    mlc.load_placement_state_dict(fresh, state["placements"], optimizer=fresh_optim)
    out["placement"] = fresh.moe.placement == saved
    loaded = _raw(fresh, fresh_optim)
    out["bit_for_bit"] = all(torch.equal(loaded[k], at_save[k]) for k in at_save)
    _train(fresh, fresh_optim, range(STEPS, 2 * STEPS))
    resumed = _raw(fresh, fresh_optim)
    out["resumed"] = max(float((resumed[k] - uninterrupted[k]).abs().max()) for k in uninterrupted)
    return out


def test_dcp_checkpoint_resumes_in_the_saved_placement(tmp_path):
    """``placement_state_dict`` saved beside the weights; ``load_placement_state_dict`` moves a fresh
    model into it after loading (weights and Adam's moments with it): the slots are the saved ones
    bit for bit and training resumes exactly. A missing entry, another expert-parallel size and an
    invalid table are refused without moving."""
    for out in run_distributed(_resume_in_saved_placement, 2, str(tmp_path / "ckpt"), timeout=240):
        assert out["placement"] and out["bit_for_bit"], out
        assert out["resumed"] == 0.0, out["resumed"]
        assert "no entry 'moe.placement'" in out["missing"]
        assert "same expert-parallel size" in out["ep1"]
        assert "expert ids outside" in out["invalid"]


def _two_layers_one_frozen(rank: int, world: int) -> dict:
    """Layer ``a`` trained with AdamW, layer ``b`` frozen (not in the optimizer)."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    groups = ml.ParallelGroups.from_world()
    model = nn.ModuleDict({"a": ml.VanillaMoE(cfg, groups, seed=1), "b": ml.VanillaMoE(cfg, groups, seed=2)})
    model["b"].requires_grad_(False)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    model["b"](model["a"](x)).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim, x


def _load_placements_with_a_frozen_layer(rank: int, world: int) -> dict:
    """A frozen layer that the optimizer does not hold moves without state beside a trained one;
    a layer that cannot move (trained, but not in the optimizer) is refused before any layer moves."""
    saved = {"a.placement": torch.tensor([[3, 0], [1, 2]]), "b.placement": torch.tensor([[3, 0], [1, 2]])}
    model, optim, x = _two_layers_one_frozen(rank, world)
    before = model["b"](model["a"](x)).detach()
    moments = _logical_moments(model["a"], optim)
    mlc.load_placement_state_dict(model, saved, optimizer=optim)
    out = {"moved": [model[k].placement.phy2log.tolist() for k in "ab"],
           "same_output": torch.equal(model["b"](model["a"](x)).detach(), before),
           "same_moments": all(torch.equal(a, b) for a, b in zip(moments, _logical_moments(model["a"], optim)))}

    model, optim, x = _two_layers_one_frozen(rank, world)
    model["b"].requires_grad_(True)  # trained now, but the optimizer still does not hold it
    with pytest.raises(TypeError, match="does not hold this layer's expert weights"):
        mlc.load_placement_state_dict(model, saved, optimizer=optim)
    out["refused_unmoved"] = [model[k].placement.phy2log.tolist() for k in "ab"]
    return out


def _logical_moments(layer: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Adam's moments of ``layer``'s experts in logical order, gathered over the expert-parallel group."""
    from moelayers.experts import gather_logical

    w13, w2 = layer.experts.w13, layer.experts.w2
    return [t for key in ("exp_avg", "exp_avg_sq")
            for t in gather_logical(optim.state[w13][key], optim.state[w2][key], layer.placement, layer.groups.ep)]


def test_load_placement_state_dict_moves_frozen_layers_and_checks_every_layer_first():
    linear = [[0, 1], [2, 3]]
    for out in run_distributed(_load_placements_with_a_frozen_layer, 2, timeout=120):
        assert out["moved"] == [[[3, 0], [1, 2]]] * 2, out
        assert out["same_output"] and out["same_moments"], out
        assert out["refused_unmoved"] == [linear, linear], out


def _resume_on_a_rank_without_experts(rank: int, world: int, root: str) -> dict:
    """Save in the linear placement; load into a model whose expert-parallel rank 1 holds no expert,
    then move it back to four slots of two experts each, with the optimizer, and train on."""
    model, optim = _build(world, "linear")
    _train(model, optim, range(STEPS))
    dcp.save({"model": mlc.model_state_dict(model), "optim": mlc.optimizer_state_dict(model, optim)},
             checkpoint_id=root)
    _train(model, optim, range(STEPS, 2 * STEPS))
    uninterrupted = _logical(model, optim)

    all_on_0 = ml.ExpertPlacement(torch.tensor([[0, 1, 2, 3], [-1, -1, -1, -1]]), E)
    fresh = _Model(ml.ParallelGroups.from_world(), all_on_0, "cpu", torch.float64)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = {"model": mlc.model_state_dict(fresh), "optim": mlc.optimizer_state_dict(fresh, fresh_optim)}
    dcp.load(state, checkpoint_id=root)
    mlc.load_model_state_dict(fresh, state["model"])
    mlc.load_optimizer_state_dict(fresh, fresh_optim, state["optim"])
    steps = [float(fresh_optim.state[p]["step"]) for p in (fresh.moe.experts.w13, fresh.moe.experts.w2)]
    fresh.moe.apply_placement(ml.ExpertPlacement(torch.tensor([[0, 1, -1, -1], [2, 3, -1, -1]]), E),
                              optimizer=fresh_optim)
    _train(fresh, fresh_optim, range(STEPS, 2 * STEPS))
    resumed = _logical(fresh, fresh_optim)
    return {"steps": steps, "resumed": max(float((resumed[k] - uninterrupted[k]).abs().max()) for k in uninterrupted)}


def test_dcp_checkpoint_gives_the_step_to_a_rank_without_experts(tmp_path):
    """A rank holding none of a layer's experts read none of the expert entries, which carry the
    step: its fresh optimizer kept step 1 while the others had 3, and every move with the optimizer
    was refused (ranks at different steps). It now takes the step from the ranks that hold experts."""
    for out in run_distributed(_resume_on_a_rank_without_experts, 2, str(tmp_path / "ckpt"), timeout=120):
        assert out["steps"] == [float(STEPS)] * 2, out
        assert out["resumed"] < 1e-12, out


def test_placements_fit_tells_whether_saved_placements_load(tmp_path):
    """Resuming in the saved placements at another expert-parallel size or slot count failed inside
    dcp.load with a CheckpointException (not an Exception, so a fallback missed it): placements_fit
    reads the checkpoint's metadata first (a journey at odd shapes)."""
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from moelayers import checkpoint as mlc

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)

    def model(slots=None):
        place = ml.ExpertPlacement.linear(4, 1, slots_per_rank=slots)
        return nn.ModuleDict({"moe": ml.VanillaMoE(cfg, ml.ParallelGroups.single(), placement=place)})

    saved = model(5)
    dcp.save({"placements": mlc.placement_state_dict(saved)}, checkpoint_id=str(tmp_path / "ck"))
    assert mlc.placements_fit(model(5), tmp_path / "ck")
    assert not mlc.placements_fit(model(), tmp_path / "ck")  # 4 slots per rank, the checkpoint's 5
    assert not mlc.placements_fit(model(5), tmp_path / "ck", key="elsewhere")
    state = {"placements": mlc.placement_state_dict(model(5))}
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"))  # what fits loads
    with pytest.raises(FileNotFoundError, match="no torch.distributed.checkpoint metadata"):
        mlc.placements_fit(model(5), tmp_path / "nothing")
