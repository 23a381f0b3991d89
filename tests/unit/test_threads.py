"""One layer called from several threads: its forwards take turns (moelayers/layers/turns.py)."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch

import moelayers as ml


def _in_two_threads(first, second, calls: int) -> None:
    start, errors = threading.Barrier(2), []

    def run(fn):
        try:
            start.wait()
            for _ in range(calls):
                fn()
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    assert not errors, errors


@pytest.mark.parametrize("kw", [{}, {"capacity": 64}], ids=["eager", "capacity"])
def test_a_shared_layer_checks_each_threads_input(kw):
    """The router's and the dispatcher's flags lived on the layer between the steps of a forward: with
    a second thread in the same layer, 8 % of the NaN inputs came back as NaN outputs without the
    error (capacity mode) and the clean thread's forwards were refused for the other's NaN."""
    check_shared_layer(kw, "cpu")


def check_shared_layer(kw: dict, device: str, calls: int = 300, dtype: torch.dtype = torch.float32) -> None:
    """Two threads in one layer, one feeding a NaN (every call raises), one clean input (each call
    gives the first call's output); the first forward before the threads (a CUDA graph's capture)."""
    torch.manual_seed(0)
    cfg = ml.MoEConfig(hidden_size=32, ffn_hidden_size=32, num_experts=8, top_k=2, params_dtype=dtype)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device=device, **kw)
    good = torch.randn(32, 32, device=device, dtype=dtype)
    bad = good.clone()
    bad[0, 0] = float("nan")
    with torch.no_grad():
        want = layer(good)
    seen = {"good": 0, "bad": 0}

    def clean():
        with torch.no_grad():
            y = layer(good)
        assert torch.equal(y, want)
        seen["good"] += 1

    def poisoned():
        with torch.no_grad(), pytest.raises(ValueError, match="NaN or inf"):
            layer(bad)
        seen["bad"] += 1

    _in_two_threads(clean, poisoned, calls)
    assert seen == {"good": calls, "bad": calls}


def test_a_shared_variability_layer_records_every_threads_tokens():
    """Its load window lost about 0.1 % of the expert uses of two threads' forwards."""
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=8, top_k=2)
    layer = ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.single(), window=1000, auto_replan=False)
    x = torch.randn(16, 16)

    def forward():
        with torch.no_grad():
            layer(x)

    _in_two_threads(forward, forward, 300)
    assert int(layer.window_loads().sum()) == 2 * 300 * 16 * 2


def test_copies_and_pickles_of_a_layer_have_their_own_turn():
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=4, top_k=2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    x = torch.randn(4, 16)
    with torch.no_grad():
        y = layer(x)
        for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert twin.__dict__.get("_turn") is None  # made on first use
            assert torch.equal(twin(x), y) and twin._turn is not layer._turn


@pytest.mark.parametrize("how", ["apply_placement", "load_state_dict", "load_full_weights"])
def test_a_move_waits_for_a_forward_in_another_thread(how):
    """A checkpoint load (set_extra_state's placement, the weights' copy) did not wait: a forward
    paused after planning its routes in the old placement computed with the new one's weights."""
    torch.manual_seed(0)
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=8, top_k=2)
    groups = ml.ParallelGroups.single()
    reversed_ = ml.ExpertPlacement(torch.arange(8).flip(0).view(1, 8), 8)
    layer = ml.VanillaMoE(cfg, groups)
    x = torch.randn(32, 16)
    full = layer.export_full_weights()
    with torch.no_grad():
        want = layer(x)
        moved = ml.VanillaMoE(cfg, groups, placement=reversed_)
        moved.load_full_weights(*full)
    change = {"apply_placement": lambda: layer.apply_placement(reversed_),
              "load_state_dict": lambda: layer.load_state_dict(moved.state_dict()),
              "load_full_weights": lambda: layer.load_full_weights(*(2 * w for w in full))}[how]
    planned, go, done, out = threading.Event(), threading.Event(), threading.Event(), {}
    plan = layer.plan

    def paused_plan(*args, **kwargs):
        routes = plan(*args, **kwargs)
        planned.set()
        go.wait(30)
        return routes

    def in_thread(fn):
        def run():
            try:
                with torch.no_grad():  # (grad mode is per thread)
                    fn()
            except BaseException as exc:  # noqa: BLE001 (reported by the test)
                out["error"] = exc
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    layer.plan = paused_plan
    forward = in_thread(lambda: out.update(y=layer(x)))
    assert planned.wait(30)
    mover = in_thread(lambda: (change(), done.set()))
    assert not done.wait(0.5), f"{how} ran inside another thread's forward"
    go.set()
    forward.join(30)
    mover.join(30)
    del layer.plan
    assert "error" not in out, out["error"]
    assert done.is_set() and torch.equal(out["y"], want)
