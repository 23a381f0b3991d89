"""Routing traces: npz format, validation, atomic I/O, recorder, synthetic generator, calibration."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import moelayers as ml

from moelayers import trace as trace_mod
from moelayers import trace_synthetic as ts
from moelayers.models.tiny import TinyConfig, TinyDecoder
from moelayers.trace import RoutingTrace, TraceRecorder, load_trace, save_trace, synthetic_trace, trace_statistics

REPO = Path(__file__).resolve().parents[2]
REAL_COUNTS = REPO.parent / "shared" / "traces" / "olmoe_mixtral_counts"


def small_arrays(weights: bool = True) -> dict:
    """A valid 3-sequence trace: T=7, L=2, K=2, E=4, vocab 10."""
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.permutation(4)[:2] for _ in range(2)]) for _ in range(7)]).astype(np.int64)
    out = dict(
        topk_ids=ids,
        token_ids=np.array([1, 2, 3, 1, 9, 0, 2], dtype=np.int64),
        seq_offsets=np.array([0, 3, 3, 7], dtype=np.int64),
        num_experts=4,
        vocab_size=10,
    )
    if weights:
        out["topk_weights"] = rng.random((7, 2, 2)).astype(np.float32)
    return out


def assert_same(a: RoutingTrace, b: RoutingTrace) -> None:
    for name in ("topk_ids", "token_ids", "seq_offsets"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert getattr(a, name).dtype == getattr(b, name).dtype
    assert (a.num_experts, a.vocab_size) == (b.num_experts, b.vocab_size)
    if a.topk_weights is None:
        assert b.topk_weights is None
    else:
        np.testing.assert_array_equal(a.topk_weights, b.topk_weights)


# ---- format and I/O ----------------------------------------------------------------------------
def test_round_trip(tmp_path: Path) -> None:
    trace = RoutingTrace(**small_arrays())
    path = tmp_path / "t.npz"
    save_trace(trace, path)
    assert_same(trace, load_trace(path))
    with np.load(path, allow_pickle=False) as raw:
        assert set(raw.files) == {"topk_ids", "token_ids", "seq_offsets", "num_experts", "topk_weights", "vocab_size",
                                  "format_version"}
        assert raw["num_experts"].ndim == 0 and raw["token_ids"].dtype == np.int64
    assert os.listdir(tmp_path) == ["t.npz"]


def test_round_trip_without_optional_keys(tmp_path: Path) -> None:
    arrays = small_arrays(weights=False)
    del arrays["vocab_size"]
    path = tmp_path / "raw.npz"
    np.savez(path, **arrays)
    trace = load_trace(path)
    assert trace.topk_weights is None and trace.vocab_size == 10  # max id + 1
    save_trace(trace, tmp_path / "again.npz", compress=True)
    assert_same(trace, load_trace(tmp_path / "again.npz"))


def test_properties() -> None:
    trace = RoutingTrace(**small_arrays())
    assert (trace.num_tokens, trace.num_layers, trace.top_k, trace.num_sequences) == (7, 2, 2, 3)
    np.testing.assert_array_equal(trace.seq_lengths, [3, 0, 4])
    counts = trace.expert_counts()
    assert counts.shape == (2, 4) and (counts.sum(1) == 7 * 2).all()
    expected = np.stack([np.bincount(trace.topk_ids[:, l].ravel(), minlength=4) for l in range(2)])
    np.testing.assert_array_equal(counts, expected)


def test_repr_gives_sizes_not_arrays(tmp_path: Path) -> None:
    """The dataclass repr printed every array (a new-user journey: millions of ids in a REPL)."""
    trace = RoutingTrace(**small_arrays())
    assert repr(trace) == ("RoutingTrace(tokens=7, sequences=3, layers=2, top_k=2, num_experts=4, vocab_size=10, "
                           "weights=True)")
    save_trace(trace, tmp_path / "t.npz")
    assert repr(load_trace(tmp_path / "t.npz")).endswith(f"weights=True, source={str(tmp_path / 't.npz')!r})")


BAD = {
    "ids above E": (lambda a: a["topk_ids"].__setitem__((0, 0, 0), 70), ValueError, "'topk_ids'.*out of range \\[0, 4\\): found 70"),
    "negative id": (lambda a: a["topk_ids"].__setitem__((1, 1, 1), -1), ValueError, "'topk_ids'.*found -1"),
    "float ids": (lambda a: a.update(topk_ids=a["topk_ids"].astype(np.float32)), TypeError, "'topk_ids'.*integer"),
    "ids 2-D": (lambda a: a.update(topk_ids=a["topk_ids"][:, 0]), ValueError, "'topk_ids'.*3 dimension"),
    "K > E": (lambda a: a.update(num_experts=1, topk_ids=np.zeros((7, 2, 2), np.int64)), ValueError, "'topk_ids'.*more than num_experts"),
    "no layers": (lambda a: a.update(topk_ids=np.zeros((7, 0, 2), np.int64), topk_weights=None), ValueError, "'topk_ids'.*L >= 1"),
    "no tokens": (lambda a: a.update(topk_ids=np.zeros((0, 2, 2), np.int64)), ValueError, "'topk_ids'.*no tokens"),
    "repeated expert": (lambda a: a["topk_ids"].__setitem__((5, 1), [3, 3]), ValueError,
                        "'topk_ids' repeats an expert within a token's top-k at 1 .* first token 5 at layer 1: \\[3, 3\\]"),
    "num_experts float": (lambda a: a.update(num_experts=4.0), TypeError, "'num_experts'"),
    "num_experts zero": (lambda a: a.update(num_experts=0), ValueError, "'num_experts'"),
    "token length": (lambda a: a.update(token_ids=a["token_ids"][:6]), ValueError, "'token_ids'.*6 tokens"),
    "token float": (lambda a: a.update(token_ids=a["token_ids"].astype(np.float64)), TypeError, "'token_ids'"),
    "token >= vocab": (lambda a: a.update(vocab_size=9), ValueError, "'token_ids'.*found 9"),
    "token negative": (lambda a: a["token_ids"].__setitem__(0, -3), ValueError, "'token_ids'.*found -3"),
    "vocab zero": (lambda a: a.update(vocab_size=0), ValueError, "'vocab_size'"),
    # >= 2**63 (uint64) used to validate and load, then fail to save (OverflowError casting to int64)
    "num_experts over int64": (lambda a: a.update(num_experts=np.uint64(2**64 - 1)), ValueError,
                               "'num_experts' must be <= 9223372036854775807"),
    "vocab at 2**63": (lambda a: a.update(vocab_size=np.uint64(2**63)), ValueError,
                       "'vocab_size' must be <= 9223372036854775807"),
    "vocab over int64": (lambda a: a.update(vocab_size=np.uint64(2**63 + 10)), ValueError,
                         "'vocab_size' must be <= 9223372036854775807"),
    "offsets start": (lambda a: a.update(seq_offsets=np.array([1, 3, 7])), ValueError, "'seq_offsets'.*start at 0"),
    "offsets end": (lambda a: a.update(seq_offsets=np.array([0, 3, 6])), ValueError, "'seq_offsets'.*end at T = 7"),
    "offsets decrease": (lambda a: a.update(seq_offsets=np.array([0, 4, 3, 7])), ValueError, "'seq_offsets'.*non-decreasing"),
    "offsets short": (lambda a: a.update(seq_offsets=np.array([0])), ValueError, "'seq_offsets'"),
    "offsets float": (lambda a: a.update(seq_offsets=np.array([0.0, 3.0, 7.0])), TypeError, "'seq_offsets'"),
    "weights shape": (lambda a: a.update(topk_weights=np.ones((7, 2, 3), np.float32)), ValueError, "'topk_weights'.*shape"),
    "weights nan": (lambda a: a["topk_weights"].__setitem__((0, 0, 0), np.nan), ValueError, "'topk_weights'.*non-finite"),
    "weights int": (lambda a: a.update(topk_weights=np.ones((7, 2, 2), np.int64)), TypeError, "'topk_weights'"),
}


def test_repeated_experts_are_found_across_chunks(monkeypatch) -> None:
    """The check runs by chunks of tokens (a sorted copy of a 1M-token trace took 465 MiB): the count
    and the first repeat are the whole trace's."""
    import moelayers.trace as mt

    monkeypatch.setattr(mt, "_CHECK_CHUNK", 2)
    arrays = small_arrays()
    arrays["topk_ids"][5, 1] = [3, 3]
    arrays["topk_ids"][2, 0] = [1, 1]
    with pytest.raises(ValueError, match="at 2 \\(token, layer\\) pair\\(s\\), first token 2 at layer 0: \\[1, 1\\]"):
        RoutingTrace(**arrays)


@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_in_memory(case: str) -> None:
    mutate, exc, pattern = BAD[case]
    arrays = small_arrays()
    mutate(arrays)
    with pytest.raises(exc, match="<memory>: field " + pattern):
        RoutingTrace(**arrays)


@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_on_save_writes_nothing(case: str, tmp_path: Path) -> None:
    mutate, exc, pattern = BAD[case]
    trace = RoutingTrace(**small_arrays())
    arrays = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in trace.to_arrays().items()}
    arrays["num_experts"], arrays["vocab_size"] = trace.num_experts, trace.vocab_size
    mutate(arrays)
    for name, value in arrays.items():  # corrupt the trace after construction
        setattr(trace, name, value)
    path = tmp_path / "bad.npz"
    with pytest.raises(exc, match="bad.npz: field " + pattern):
        save_trace(trace, path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_on_load_names_the_file(case: str, tmp_path: Path) -> None:
    mutate, exc, pattern = BAD[case]
    arrays = small_arrays()
    mutate(arrays)
    path = tmp_path / "bad.npz"
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    with pytest.raises(exc, match=f"{path}: field " + pattern):
        load_trace(path)


def test_load_key_errors(tmp_path: Path) -> None:
    arrays = small_arrays()
    missing = {k: v for k, v in arrays.items() if k != "seq_offsets"}
    np.savez(tmp_path / "missing.npz", **missing)
    with pytest.raises(ValueError, match=r"missing.npz: missing key\(s\) \['seq_offsets'\]"):
        load_trace(tmp_path / "missing.npz")
    np.savez(tmp_path / "typo.npz", **{k: v for k, v in arrays.items() if k != "topk_ids"}, topk_id=arrays["topk_ids"])
    with pytest.raises(ValueError, match=r"typo.npz: missing key\(s\) \['topk_ids'\], unknown key\(s\) "
                                         r"\['topk_id'\]; 'topk_id': did you mean 'topk_ids'\?"):
        load_trace(tmp_path / "typo.npz")
    np.savez(tmp_path / "weight_typo.npz", **small_arrays(weights=False), topk_weight=arrays["topk_weights"])
    with pytest.raises(ValueError, match=r"'topk_weight': did you mean 'topk_weights'\?"):
        load_trace(tmp_path / "weight_typo.npz")


def test_load_ignores_a_recorders_metadata_with_a_warning(tmp_path: Path) -> None:
    """Keys a recorder adds (a model name, layer ids) made the whole trace refused."""
    arrays = small_arrays()
    np.savez(tmp_path / "meta.npz", **arrays, model=np.array("deepseek-v2-lite"), layer_ids=np.arange(1, 27))
    with pytest.warns(UserWarning, match=r"meta.npz: ignoring key\(s\) \['layer_ids', 'model'\]"):
        trace = load_trace(tmp_path / "meta.npz")
    np.testing.assert_array_equal(trace.topk_ids, arrays["topk_ids"])
    # a name close to a field the file has is metadata too (only an absent field can be misspelt)
    np.savez(tmp_path / "near.npz", **arrays, num_shared_experts=np.int64(2), token_ids_raw=arrays["token_ids"])
    with pytest.warns(UserWarning, match=r"ignoring key\(s\) \['num_shared_experts', 'token_ids_raw'\]"):
        load_trace(tmp_path / "near.npz")


def test_load_missing_and_garbage_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        load_trace(tmp_path / "nope.npz")
    (tmp_path / "garbage.npz").write_bytes(b"not a zip file at all")
    with pytest.raises(ValueError, match="garbage.npz"):
        load_trace(tmp_path / "garbage.npz")
    np.save(tmp_path / "plain.npy", np.zeros(3))
    with pytest.raises(ValueError, match="plain.npy: not an npz"):
        load_trace(tmp_path / "plain.npy")


def test_atomic_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.npz"
    old = RoutingTrace(**small_arrays())
    save_trace(old, path)
    before = path.read_bytes()

    def broken_savez(file, **arrays):
        file.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken_savez)
    new = RoutingTrace(**small_arrays(weights=False))
    with pytest.raises(OSError, match="disk full"):
        save_trace(new, path)
    assert os.listdir(tmp_path) == ["t.npz"] and path.read_bytes() == before
    monkeypatch.undo()
    save_trace(new, path)  # replaces
    assert os.listdir(tmp_path) == ["t.npz"]
    assert load_trace(path).topk_weights is None
    with pytest.raises(FileNotFoundError, match="no_dir"):
        save_trace(new, tmp_path / "no_dir" / "t.npz")


# ---- selection ---------------------------------------------------------------------------------
def test_select_sequence_split_steps() -> None:
    trace = RoutingTrace(**small_arrays())
    sub = trace.select_sequences([2, 0])
    np.testing.assert_array_equal(sub.seq_offsets, [0, 4, 7])
    np.testing.assert_array_equal(sub.token_ids, np.r_[trace.token_ids[3:7], trace.token_ids[0:3]])
    np.testing.assert_array_equal(sub.topk_ids, np.concatenate([trace.topk_ids[3:7], trace.topk_ids[0:3]]))
    np.testing.assert_array_equal(sub.topk_weights, np.concatenate([trace.topk_weights[3:7], trace.topk_weights[0:3]]))
    assert sub.vocab_size == 10 and sub.num_experts == 4

    seq = trace.sequence(-1)
    assert seq.num_sequences == 1 and seq.num_tokens == 4
    assert trace.sequence_slice(0) == slice(0, 3)
    with pytest.raises(IndexError):
        trace.sequence(3)
    with pytest.raises(IndexError):
        trace.select_sequences([5])
    with pytest.raises(ValueError, match="only empty sequences"):
        trace.select_sequences([1])

    train, held = trace.split(0.5)  # floor(1.5) = 1 sequence
    assert (train.num_sequences, held.num_sequences) == (1, 2)
    assert_same(train, trace.select_sequences([0]))
    with pytest.raises(ValueError, match="empty part"):
        trace.split(0.2)  # floor(0.6) = 0
    for bad in (1.0, 0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"train_fraction must be in \(0, 1\)"):
            trace.split(bad)

    steps = trace.steps(3)
    assert steps == [slice(0, 3), slice(3, 6), slice(6, 7)]
    with pytest.raises(ValueError, match="tokens_per_step"):
        trace.steps(0)


def test_split_fraction_rounding() -> None:
    arrays = dict(topk_ids=np.zeros((100, 1, 1), np.int64), token_ids=np.zeros(100, np.int64),
                  seq_offsets=np.arange(101, dtype=np.int64), num_experts=2)
    train, held = RoutingTrace(**arrays).split(0.29)
    assert (train.num_sequences, held.num_sequences) == (29, 71)


# ---- recorder ----------------------------------------------------------------------------------
class FakeMoE(nn.Module):
    """Stands in for a moelayers layer: routes token t to experts (t * (salt + 1) + k) % E."""

    moe_layer_marker = True

    def __init__(self, num_experts: int, top_k: int, salt: int, with_config: bool = True) -> None:
        super().__init__()
        if with_config:
            self.config = SimpleNamespace(num_experts=num_experts)
        self.num_experts, self.top_k, self.salt = num_experts, top_k, salt
        self.drop, self.hide_tokens = 0, False  # fault injection
        self.last_topk_ids = self.last_token_ids = None

    def route(self, token_ids: torch.Tensor) -> torch.Tensor:
        return (token_ids[:, None] * (self.salt + 1) + torch.arange(self.top_k)) % self.num_experts

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        ids = self.route(token_ids)
        self.last_topk_ids = ids[: ids.shape[0] - self.drop]
        self.last_token_ids = None if self.hide_tokens else token_ids
        return x + 1


class FakeModel(nn.Module):
    def __init__(self, with_config: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 4)
        self.moe_a = FakeMoE(8, 2, salt=1, with_config=with_config)
        self.mlp = nn.Linear(4, 4)
        self.moe_b = FakeMoE(8, 2, salt=2, with_config=with_config)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(token_ids)
        x = self.moe_a(x, token_ids=token_ids)
        return self.moe_b(self.mlp(x), token_ids=token_ids)


def expected_ids(model: FakeModel, tokens: list[int]) -> np.ndarray:
    t = torch.tensor(tokens)
    return torch.stack([model.moe_a.route(t), model.moe_b.route(t)], dim=1).numpy()


def no_hooks(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_recorder_drops_a_forward_that_raised_part_way() -> None:
    """The model raises between its MoE layers: that forward (and its tag) is not recorded, and the
    next tag() and forward work as if it had not happened."""
    model = FakeModel()
    with pytest.warns(RuntimeWarning, match=r"dropped 2 incomplete model forward\(s\)"), \
            TraceRecorder(model, vocab_size=50) as rec:
        rec.tag(["a", "a"])
        model(torch.tensor([1, 2]))
        rec.tag(["b", "b"])
        model.mlp.register_forward_pre_hook(_raise_once)  # after moe_a ran, before moe_b
        with pytest.raises(RuntimeError, match="mlp broke"):
            model(torch.tensor([3, 4]))
        rec.tag(["c"])  # not "tag() called twice"
        model(torch.tensor([5]))
        model(torch.tensor([6]))  # untagged, right after a good one
        model.mlp.register_forward_pre_hook(_raise_once)
        with pytest.raises(RuntimeError, match="mlp broke"):
            model(torch.tensor([7]))
        model(torch.tensor([8]))  # untagged, after a broken untagged forward
    trace = rec.result
    np.testing.assert_array_equal(trace.token_ids, [1, 2, 5, 6, 8])
    np.testing.assert_array_equal(trace.seq_offsets, [0, 2, 3, 4, 5])
    np.testing.assert_array_equal(trace.topk_ids, expected_ids(model, [1, 2, 5, 6, 8]))


def test_recorder_drops_a_last_forward_that_raised_part_way() -> None:
    """The last forward of the with-block raised after moe_a: result holds the complete ones."""
    model = FakeModel()
    with pytest.warns(RuntimeWarning, match=r"dropped 1 incomplete .* holds the 2 complete"):
        with TraceRecorder(model, vocab_size=50) as rec:
            model(torch.tensor([1, 2]))
            model(torch.tensor([3]))
            model.mlp.register_forward_pre_hook(_raise_once)
            with pytest.raises(RuntimeError, match="mlp broke"):
                model(torch.tensor([4, 5]))
    np.testing.assert_array_equal(rec.result.token_ids, [1, 2, 3])
    np.testing.assert_array_equal(rec.result.topk_ids, expected_ids(model, [1, 2, 3]))


class SkippingModel(FakeModel):
    """Returns after moe_a when told to (an early exit): moe_b never runs."""

    def forward(self, token_ids: torch.Tensor, skip: bool = False) -> torch.Tensor:
        x = self.moe_a(self.embed(token_ids), token_ids=token_ids)
        return x if skip else self.moe_b(self.mlp(x), token_ids=token_ids)


def test_recorder_refuses_a_forward_that_skipped_a_layer() -> None:
    """A forward that returns without running every MoE layer is an error naming the missing layer,
    not a silent loss of its tokens; the recording goes on."""
    model = SkippingModel()
    with pytest.warns(RuntimeWarning, match=r"dropped 2 incomplete"), TraceRecorder(model, vocab_size=50) as rec:
        rec.tag(["a"])
        with pytest.raises(RuntimeError, match=r"only 1 of 2 MoE layers ran \(MoE layer 1 \('moe_b'\) did not\)"):
            model(torch.tensor([1]), skip=True)
        rec.tag(["b", "b"])  # the skipped forward's tag is gone with it
        model(torch.tensor([2, 3]))
        with pytest.raises(RuntimeError, match="did not"):
            model(torch.tensor([4]), skip=True)  # the last forward
    np.testing.assert_array_equal(rec.result.token_ids, [2, 3])
    np.testing.assert_array_equal(rec.result.topk_ids, expected_ids(model, [2, 3]))
    assert no_hooks(model)


def _raise_once(module: nn.Module, args) -> None:
    for key, hook in list(module._forward_pre_hooks.items()):
        if hook is _raise_once:
            del module._forward_pre_hooks[key]
    raise RuntimeError("mlp broke")


def test_recorder_untagged_and_tagged() -> None:
    model = FakeModel()
    with TraceRecorder(model, vocab_size=50) as rec:
        model(torch.tensor([5, 6, 7]))  # untagged: sequence 0
        rec.tag(["a", "a", "b"])
        model(torch.tensor([10, 11, 20]))
        rec.tag(torch.tensor([7, 7]))  # tensor keys
        model(torch.tensor([30, 31]))
        rec.tag(["b", "a"])
        model(torch.tensor([21, 12]))
        model(torch.tensor([40]))  # untagged: its own sequence
        snapshot = rec.trace()
    trace = rec.result
    assert_same(snapshot, trace)
    tokens = [5, 6, 7, 10, 11, 12, 20, 21, 30, 31, 40]  # sequences by first appearance: untagged, a, b, 7, untagged
    np.testing.assert_array_equal(trace.token_ids, tokens)
    np.testing.assert_array_equal(trace.seq_offsets, [0, 3, 6, 8, 10, 11])
    np.testing.assert_array_equal(trace.topk_ids, expected_ids(model, tokens))
    assert trace.num_experts == 8 and trace.vocab_size == 50 and trace.topk_ids.dtype == np.int16
    assert no_hooks(model)


def test_untagged_batches_are_one_sequence_per_row_or_column() -> None:
    """An untagged forward of a [B, S] batch of token ids (the tiny decoder) records B sequences, and
    a MoE layer's [S, B, H] input B sequences, one per column: they were one sequence (the prompts
    fused, the columns interleaved token by token). [T, H] input stays one sequence."""
    from moelayers.models.tiny import TinyConfig, TinyDecoder

    moe = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2)
    model = TinyDecoder(TinyConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2),
                        lambda i: ml.VanillaMoE(moe, ml.ParallelGroups.single(), seed=i))
    with torch.no_grad(), TraceRecorder(model) as rec:
        model(torch.tensor([[1, 2, 3], [41, 42, 43]]))
        model(torch.tensor([[7, 8]]))
    np.testing.assert_array_equal(rec.result.token_ids, [1, 2, 3, 41, 42, 43, 7, 8])
    np.testing.assert_array_equal(rec.result.seq_offsets, [0, 3, 6, 8])
    layer = ml.VanillaMoE(moe, ml.ParallelGroups.single(), seed=0)
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), TraceRecorder(layer) as rec:
        layer(x, token_ids=torch.tensor([[1, 41], [2, 42], [3, 43]]))  # column b is sequence b
        layer(x.reshape(6, 16), token_ids=torch.tensor([1, 41, 2, 42, 3, 43]))  # [T, H]: one sequence
    np.testing.assert_array_equal(rec.result.token_ids, [1, 2, 3, 41, 42, 43, 1, 41, 2, 42, 3, 43])
    np.testing.assert_array_equal(rec.result.seq_offsets, [0, 3, 6, 12])
    with torch.no_grad():
        layer(x, token_ids=torch.tensor([[1, 41], [2, 42], [3, 43]]))
        by_column = layer.last_topk_ids.view(3, 2, -1).transpose(0, 1).reshape(6, -1).numpy()
    np.testing.assert_array_equal(rec.result.topk_ids[:6, 0], by_column)

    class SequenceFirst(nn.Module):  # [B, S] ids in, but the blocks run [S, B, H] (megatron's order)
        def __init__(self):
            super().__init__()
            self.emb, self.moe = nn.Embedding(50, 16), ml.VanillaMoE(moe, ml.ParallelGroups.single(), seed=0)

        def forward(self, input_ids):
            ids = input_ids.t()
            return self.moe(self.emb(ids), token_ids=ids)

    first = SequenceFirst()
    with torch.no_grad(), TraceRecorder(first) as rec:
        first(torch.tensor([[1, 2, 3], [41, 42, 43]]))  # the layer sees 1, 41, 2, 42, ...: the columns
        first(torch.tensor([[5, 6], [7, 8]]).t().contiguous().t())  # (a view: still read as rows of ids)
    np.testing.assert_array_equal(rec.result.token_ids, [1, 2, 3, 41, 42, 43, 5, 6, 7, 8])
    np.testing.assert_array_equal(rec.result.seq_offsets, [0, 3, 6, 8, 10])


def test_hugging_face_style_keywords_and_decode_steps_keep_their_sequences() -> None:
    """A journey with a Hugging Face model: model(input_ids=ids) recorded one sequence of B x S
    tokens, and generate()'s decode steps ([B, 1] ids with a cache) a new sequence each step: 3
    prompts of 11 tokens and 3 steps gave [33, 3, 3, 3] instead of [14, 14, 14]."""
    moe = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2)

    class HFStyle(nn.Module):  # HF's calling convention: keywords, a cache position on decode steps
        def __init__(self):
            super().__init__()
            self.emb, self.moe = nn.Embedding(100, 16), ml.VanillaMoE(moe, ml.ParallelGroups.single(), seed=0)

        def forward(self, input_ids=None, past_key_values=None, cache_position=None, cache=None):
            return self.moe(self.emb(input_ids), token_ids=input_ids)

    class Cache:  # the part of transformers' Cache the recorder reads
        def __init__(self, n):
            self.n = n

        def get_seq_length(self):
            return self.n

    model = HFStyle()
    prompts = torch.tensor([[1, 2, 3], [11, 12, 13]])
    with torch.no_grad(), TraceRecorder(model) as rec:
        model(input_ids=prompts, cache_position=torch.arange(3))  # prefill: two sequences
        for step in range(2):  # decode: each continues its row
            model(input_ids=torch.tensor([[4 + step], [14 + step]]), cache_position=torch.tensor([3 + step]))
        model(input_ids=torch.tensor([[21, 22], [31, 32]]), past_key_values=Cache(0))  # a new batch: new sequences
        model(input_ids=torch.tensor([[23], [33]]), cache=Cache(2))  # continues it (transformers 5: cache=)
        model(input_ids=torch.tensor([[40], [41], [42]]), cache_position=torch.tensor([9]))  # other rows: new
        model(input_ids=torch.tensor([[43], [44], [45]]), past_key_values=[None, None])  # nothing cached: new
        legacy = [(torch.zeros(3, 2, 4, 8), torch.zeros(3, 2, 4, 8))]  # the legacy format, 4 tokens cached
        model(input_ids=torch.tensor([[46], [47], [48]]), past_key_values=legacy)  # continues
        rec.tag(["t", "t"])
        model(input_ids=torch.tensor([[50, 51]]))
        model(input_ids=torch.tensor([[60], [61]]), cache_position=torch.tensor([5]))  # after a tag: new
    np.testing.assert_array_equal(rec.result.token_ids, [1, 2, 3, 4, 5, 11, 12, 13, 14, 15, 21, 22, 23, 31, 32, 33,
                                                         40, 41, 42, 43, 46, 44, 47, 45, 48, 50, 51, 60, 61])
    np.testing.assert_array_equal(np.diff(rec.result.seq_offsets), [5, 5, 3, 3, 1, 1, 1, 2, 2, 2, 2, 1, 1])


def test_padding_is_left_out_and_the_vocabulary_is_the_models() -> None:
    """A journey recording an HF model's generate: left padding and the pad tokens fed to finished
    rows were 20 % of the trace (the held-out LAR 0.634 against 0.586 on real tokens), and the trace's
    vocabulary was the largest id seen + 1, so a plan of it refused the model's last ids."""
    moe = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2)

    class HFStyle(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(vocab_size=100)
            self.emb, self.moe = nn.Embedding(100, 16), ml.VanillaMoE(moe, ml.ParallelGroups.single(), seed=0)

        def forward(self, input_ids=None, attention_mask=None, cache_position=None):
            return self.moe(self.emb(input_ids), token_ids=input_ids)

    model, pad = HFStyle(), 0
    with torch.no_grad(), TraceRecorder(model, pad_token_id=pad) as rec:
        prompts = torch.tensor([[pad, pad, 5, 6], [7, 8, 9, 10]])  # left padding
        mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
        model(input_ids=prompts, attention_mask=mask, cache_position=torch.arange(4))
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        model(input_ids=torch.tensor([[11], [12]]), attention_mask=mask, cache_position=torch.tensor([4]))
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)  # row 1 finished: the pad token, mask 1
        model(input_ids=torch.tensor([[13], [pad]]), attention_mask=mask, cache_position=torch.tensor([5]))
        model(torch.tensor([[20, 21], [22, 23]]))  # no mask: every token
        model(input_ids=torch.tensor([[30, 31], [32, 33]]), attention_mask=torch.tensor([[0, 0], [1, 1]]))
    trace = rec.result
    np.testing.assert_array_equal(trace.token_ids, [5, 6, 11, 13, 7, 8, 9, 10, 12, 20, 21, 22, 23, 32, 33])
    np.testing.assert_array_equal(np.diff(trace.seq_offsets), [4, 5, 2, 2, 2])  # (an all-padding row: none)
    assert rec.padding_dropped == 5 and trace.vocab_size == 100  # (the model's, not 33 + 1)
    trace.split(0.5)  # (an empty sequence made split refuse the trace)
    for pads in ([98, 99], torch.tensor([98, 99]), np.array([98, 99])):  # a list of ids, as HF's EOS lists
        with torch.no_grad(), TraceRecorder(model, pad_token_id=pads) as rec:
            model(torch.tensor([[1, 98, 2, 99]]))
        assert rec.result.token_ids.tolist() == [1, 2]
    assert TraceRecorder(model, 64).vocab_size == 64  # given: as given
    with pytest.raises(ValueError, match="pad_token_id must be a token id"):
        TraceRecorder(model, pad_token_id=-1)
    with pytest.raises(TypeError, match="pad_token_id must be a token id"):
        TraceRecorder(model, pad_token_id=0.5)


def test_recorder_removes_hooks_on_exception() -> None:
    model = FakeModel()
    with pytest.raises(KeyError):
        with TraceRecorder(model):
            model(torch.tensor([1, 2]))
            raise KeyError("boom")
    assert no_hooks(model)
    model(torch.tensor([1, 2]))  # still usable, nothing recorded


def test_recorder_errors() -> None:
    model = FakeModel()
    model.moe_b.drop = 1
    with pytest.raises(ValueError, match="same tokens"):
        with TraceRecorder(model):
            model(torch.tensor([1, 2, 3]))
    model.moe_b.drop = 0
    assert no_hooks(model)
    with pytest.raises(ValueError, match="2 sequence keys but forward 0 had T = 3"):
        with TraceRecorder(model) as rec:
            rec.tag([0, 1])
            model(torch.tensor([1, 2, 3]))
    with pytest.raises(RuntimeError, match="ran when layer 0 was expected"):
        with TraceRecorder(model):
            model.moe_b(torch.zeros(1, 4), token_ids=torch.tensor([1]))  # layer 1 alone
    with pytest.raises(ValueError, match="no MoE layers"):
        with TraceRecorder(nn.Linear(2, 2)):
            pass
    with TraceRecorder(model) as rec:
        with pytest.raises(RuntimeError, match="after the with-block"):
            rec.result
        with pytest.raises(ValueError, match="no model forward"):
            rec.trace()
        rec.tag([1])
        with pytest.raises(RuntimeError, match="twice"):
            rec.tag([1])
    with pytest.raises(RuntimeError, match="records once"):
        with rec:
            pass
    model.moe_a.hide_tokens = model.moe_b.hide_tokens = True
    with pytest.raises(ValueError, match="no token ids"):
        with TraceRecorder(model):
            model(torch.tensor([1, 2]))
    assert no_hooks(model)


def test_recorder_refuses_a_moe_module_used_by_two_layers() -> None:
    """A module under two names is one entry of named_modules(): its second use in a forward would
    be stored as a new sequence and the layer dimension lost, so the recorder refuses it."""
    moe = ml.MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=2)
    shared = ml.VanillaMoE(moe, ml.ParallelGroups.single(), seed=0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4), lambda i: shared)
    with pytest.raises(ValueError, match=r"one module is registered as 'blocks\.0\.moe' and 'blocks\.1\.moe'"):
        with TraceRecorder(model):
            pass
    assert no_hooks(model)


def test_recorder_token_ids_from_any_layer() -> None:
    model = FakeModel()
    model.moe_a.hide_tokens = True
    with TraceRecorder(model) as rec:
        model(torch.tensor([4, 3]))
    np.testing.assert_array_equal(rec.result.token_ids, [4, 3])


def test_recorder_num_experts_sources() -> None:
    model = FakeModel(with_config=False)
    with TraceRecorder(model) as rec:
        model(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="num_experts unknown"):
        rec.result
    with TraceRecorder(model, num_experts=8) as rec:
        model(torch.tensor([1, 2]))
    assert rec.result.num_experts == 8 and rec.result.vocab_size == 3


# ---- statistics --------------------------------------------------------------------------------
def test_count_statistics() -> None:
    counts = np.round(1e6 * np.arange(1, 201) ** -1.2)
    assert ts.rank_frequency_exponent(counts) == pytest.approx(1.2, abs=1e-3)
    assert np.isnan(ts.rank_frequency_exponent(np.array([9, 8, 7])))
    table = np.array([[5, 3, 0, 2], [0, 1, 4, 0]])
    assert ts.table_recall(table, 2) == pytest.approx((8 + 5) / 15)
    assert ts.cross_table_recall(table, np.array([[0, 1, 6, 3], [1, 0, 0, 3]]), 2) == pytest.approx(1 / 14)
    assert ts.normalized_mutual_information(np.eye(4)) == pytest.approx(1.0)
    assert ts.normalized_mutual_information(np.ones((4, 4))) == pytest.approx(0.0, abs=1e-12)
    assert ts.load_skew(np.array([1, 1, 1, 5])) == pytest.approx((2.5, np.std([1, 1, 1, 5]) / 2))


def test_trace_statistics_of_a_deterministic_router() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50, size=20000)
    ids = np.stack([(tokens[:, None] + np.arange(2)) % 16, (3 * tokens[:, None] + np.arange(2)) % 16], axis=1)
    trace = RoutingTrace(ids, tokens, np.array([0, 20000]), 16)
    st = trace_statistics(trace)
    np.testing.assert_allclose(st["token_topk_recall"], 1.0)
    np.testing.assert_allclose(st["frequent_token_recall"], 1.0)
    assert st["layer_pairs"] == [(0, 1)] and 0.5 < st["crosslayer_nmi"][0] <= 1.0
    assert st["distinct_tokens"] == 50 and st["load_max_mean"].shape == (2,)
    assert ts.default_layer_pairs(16) == [(0, 7), (7, 15)] and ts.reference_layers(16) == [0, 7, 15]
    assert ts.default_layer_pairs(1) == []


# ---- synthetic traces --------------------------------------------------------------------------
def test_synthetic_is_valid_and_deterministic() -> None:
    kw = dict(num_sequences=12, num_layers=5, num_experts=16, top_k=3, vocab_size=500, seq_len=(5, 40))
    a = synthetic_trace(**kw, seed=3, with_weights=True)
    assert_same(a, synthetic_trace(**kw, seed=3, with_weights=True))
    assert not np.array_equal(a.topk_ids, synthetic_trace(**kw, seed=4).topk_ids)
    assert a.num_sequences == 12 and a.num_layers == 5 and a.top_k == 3 and a.vocab_size == 500
    assert ((a.seq_lengths >= 5) & (a.seq_lengths <= 40)).all()
    assert a.topk_ids.dtype == np.int16
    srt = np.sort(a.topk_ids, axis=2)
    assert (np.diff(srt, axis=2) > 0).all()  # K distinct experts per token and layer
    w = a.topk_weights
    np.testing.assert_allclose(w.sum(axis=2), 1.0, rtol=1e-5)
    assert (np.diff(w, axis=2) <= 1e-7).all()  # highest score first
    assert (np.diff(w, axis=2) < 0).mean() > 0.99 and w[..., 0].mean() > 0.5  # a softmax of scores, not uniform
    fixed = synthetic_trace(3, 2, 8, 2, 100, seq_len=7, seed=0)
    np.testing.assert_array_equal(fixed.seq_offsets, [0, 7, 14, 21])


def test_synthetic_scales_to_large_models() -> None:
    trace = synthetic_trace(4, 48, 128, 8, 150_000, seq_len=1000, seed=0)
    assert trace.topk_ids.shape == (4000, 48, 8) and int(trace.topk_ids.max()) < 128
    assert int(trace.token_ids.max()) < 150_000


def test_synthetic_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="top_k"):
        synthetic_trace(2, 2, 4, 5, 100)
    with pytest.raises(ValueError, match="seq_len"):
        synthetic_trace(2, 2, 4, 2, 100, seq_len=(10, 5))
    with pytest.raises(ValueError, match="crosslayer_carry"):
        synthetic_trace(2, 2, 4, 2, 100, crosslayer_carry=1.0)
    with pytest.raises(ValueError, match="token_scale"):
        synthetic_trace(2, 2, 4, 2, 100, token_scale=(1.0, 2.0))
    with pytest.raises(ValueError, match="num_experts"):
        synthetic_trace(2, 2, ts.MAX_EXPERTS + 1, 2, 100)


@pytest.mark.parametrize("knob, value", [
    ("zipf_exponent", float("nan")), ("zipf_exponent", float("inf")), ("zipf_exponent", -1.0),
    ("zipf_offset", -1.0), ("zipf_offset", float("nan")), ("active_vocab", 0), ("active_vocab", 2.5),
    ("topic_vocab_jitter", float("nan")), ("topic_vocab_jitter", -0.5),
])
def test_synthetic_rejects_a_bad_token_law(knob: str, value: float) -> None:
    """NaN used to collapse the trace to one token id, offset <= -1 too (or raise an IndexError)."""
    with pytest.raises(ValueError, match=f"synthetic_trace: {knob} must be"):
        synthetic_trace(2, 1, 4, 1, 100, seq_len=50, **{knob: value})
    with pytest.raises(ValueError, match="over-/underflows"):
        synthetic_trace(2, 1, 4, 1, 100, seq_len=50, zipf_exponent=1e6)


@pytest.mark.parametrize("seq_len", [8.0, "8", (3,), (1, 2, 3), (2.7, 3.9), (2.0, 4.0), np.array([3.0, 6.0]),
                                     True, (True, 3), None, 0, (4, 3)], ids=repr)
def test_synthetic_rejects_a_bad_seq_len(seq_len) -> None:
    """Floats, strings, bools and 1- or 3-tuples used to raise raw TypeError / unpacking errors, or were
    truncated silently ((2.7, 3.9) gave sequences of 2 tokens), or taken as 1 (True)."""
    with pytest.raises(ValueError, match=r"synthetic_trace: seq_len must be an int >= 1 or a \(lo, hi\) pair of ints"):
        synthetic_trace(4, 1, 8, 2, 50, seq_len=seq_len)


def test_synthetic_accepts_every_documented_seq_len() -> None:
    assert synthetic_trace(3, 1, 8, 2, 50, seq_len=7).seq_lengths.tolist() == [7, 7, 7]
    assert synthetic_trace(3, 1, 8, 2, 50, seq_len=np.int64(7)).seq_lengths.tolist() == [7, 7, 7]
    ref = synthetic_trace(6, 1, 8, 2, 50, seq_len=(3, 9), seed=2)
    assert ((ref.seq_lengths >= 3) & (ref.seq_lengths <= 9)).all()
    for same in ([3, 9], np.array([3, 9]), (np.int64(3), np.int32(9))):
        assert_same(ref, synthetic_trace(6, 1, 8, 2, 50, seq_len=same, seed=2))


@pytest.mark.parametrize("knob, value", [
    ("seed", -1), ("seed", 1.5), ("seed", "3"), ("seed", True),
    ("logit_tail", "3"), ("logit_tail", [1.0, 2.0]), ("logit_tail", True), ("context_tail", "1"),
    ("logit_tail", 5.0), ("context_tail", float("nan")),
])
def test_synthetic_rejects_a_bad_seed_or_tail(knob: str, value) -> None:
    """seed=-1 and logit_tail="3" used to fail with raw numpy / comparison errors not naming the argument."""
    with pytest.raises(ValueError, match=f"synthetic_trace: {knob} must be"):
        synthetic_trace(2, 1, 8, 2, 50, seq_len=4, **{knob: value})


def test_synthetic_seed_may_be_none_or_a_numpy_int() -> None:
    assert synthetic_trace(2, 1, 8, 2, 50, seq_len=4, seed=None).num_tokens == 8
    assert_same(synthetic_trace(2, 1, 8, 2, 50, seq_len=4, seed=np.uint64(5)), synthetic_trace(2, 1, 8, 2, 50, seq_len=4, seed=5))


@pytest.mark.parametrize("knob, value", [
    ("token_scale", 1e40), ("cluster_scale", (1.0, 1.0, 1e39)), ("topic_scale", 1e38), ("sequence_scale", 1e31),
    ("expert_skew", 3e38),
])
def test_synthetic_rejects_a_scale_that_overflows_float32(knob: str, value) -> None:
    """Finite in float64 but inf in float32: used to give NaN scores, a meaningless trace and only RuntimeWarnings."""
    with pytest.raises(ValueError, match=f"synthetic_trace: {knob} must be <= 1e\\+30"):
        synthetic_trace(4, 2, 8, 2, 50, seq_len=8, **{knob: value})


def test_synthetic_largest_scales_stay_finite() -> None:
    big = dict(token_scale=ts.MAX_SCALE, cluster_scale=ts.MAX_SCALE, topic_scale=ts.MAX_SCALE,
               sequence_scale=ts.MAX_SCALE, expert_skew=ts.MAX_SCALE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow / invalid-value RuntimeWarning
        for tail in (0.25, 4.0):
            trace = synthetic_trace(8, 2, 16, 4, 500, seq_len=64, seed=1, logit_tail=tail, context_tail=tail,
                                    with_weights=True, **big)
            assert np.isfinite(trace.topk_weights).all()
            assert len({tuple(r) for r in trace.topk_ids[:, 0].tolist()}) > 10  # not a NaN-collapsed routing


def test_synthetic_refuses_a_vocabulary_too_large_to_shuffle() -> None:
    """vocab_size=2**40 used to raise MemoryError (the sampler permutes the whole vocabulary)."""
    with pytest.raises(ValueError, match="synthetic_trace: vocab_size must be <= 2147483648"):
        synthetic_trace(2, 1, 8, 2, 2**40, seq_len=4)
    with pytest.raises(ValueError, match="vocab_size must be <= 2147483648"):
        ts._check_generator_args(2, 1, 8, 2, 2**31 + 1, 4, 8)
    ts._check_generator_args(2, 1, 8, 2, 2**31, 4, 8)  # the limit itself is allowed


def _table_recalls(train: RoutingTrace, test: RoutingTrace, layer: int, min_count: int = 1) -> tuple[float, float]:
    """(in-sample recall on test, recall on test of train's table) over tokens seen in both."""
    tr_tok, tr_table = ts.token_expert_table(train, layer)
    te_tok, te_table = ts.token_expert_table(test, layer)
    _, i_tr, i_te = np.intersect1d(tr_tok, te_tok, return_indices=True)
    keep = (tr_table[i_tr].sum(1) >= min_count * train.top_k) & (te_table[i_te].sum(1) >= min_count * test.top_k)
    tr, te = tr_table[i_tr][keep], te_table[i_te][keep]
    return ts.table_recall(te, test.top_k), ts.cross_table_recall(tr, te, test.top_k)


def test_synthetic_routing_depends_on_context() -> None:
    """A token table from one half does worse on the other half, and much worse on a new topic."""
    trace = synthetic_trace(32, 3, 64, 8, 50280, seq_len=2048, seed=5)  # 4 topics; depths 0, 7.5, 15 of 16
    train, held = trace.split(0.5)
    topic3 = np.arange(3, 32, 4)
    others = trace.select_sequences(np.setdiff1d(np.arange(32), topic3))
    for layer in range(3):
        in_sample, heldout = _table_recalls(train, held, layer)
        assert heldout < in_sample - 0.02, (layer, heldout, in_sample)
        in_sample, cross = _table_recalls(others, trace.select_sequences(topic3), layer, min_count=20)
        assert cross < in_sample - 0.15, (layer, cross, in_sample)


def test_synthetic_matches_calibration_targets() -> None:
    """One topic of 102 x 2048 tokens with OLMoE's shape is one 'domain' of the real data."""
    trace = synthetic_trace(102, 16, 64, 8, 50280, seq_len=2048, seed=11, num_topics=1)
    st = trace_statistics(trace)
    layers = ts.reference_layers(16)
    assert st["zipf_exponent"] == pytest.approx(ts.TARGET_ZIPF_EXPONENT, abs=0.1)
    assert st["top_token_share"] == pytest.approx(ts.TARGET_TOP_TOKEN_SHARE, abs=0.02)
    assert st["distinct_tokens"] == pytest.approx(ts.TARGET_DISTINCT_TOKENS, rel=0.2)
    np.testing.assert_allclose(st["token_topk_recall"][layers], ts.TARGET_TOKEN_RECALL, atol=0.1)
    np.testing.assert_allclose(st["frequent_token_recall"][layers], ts.TARGET_FREQUENT_RECALL, atol=0.1)
    np.testing.assert_allclose(st["crosslayer_nmi"], ts.TARGET_CROSSLAYER_NMI, atol=0.01)
    # the carry itself, alone (no token, cluster or topic structure): strong carry links the layers
    alone = dict(token_scale=0, cluster_scale=0, topic_scale=0, expert_skew=0)
    nmi = [trace_statistics(synthetic_trace(20, 2, 16, 2, 500, seq_len=500, seed=0, crosslayer_carry=c, **alone),
                            layer_pairs=[(0, 1)])["crosslayer_nmi"][0] for c in (0.9, 0.0)]
    assert nmi[0] > 0.2 and nmi[1] < 0.02, nmi
    # load skew of one layer varies a lot between draws (real layer-0 CV: 0.56..0.95 over domains):
    # compare the geometric mean over the three layers tightly, single layers loosely
    for name, target in (("load_cv", ts.TARGET_LOAD_CV), ("load_max_mean", ts.TARGET_LOAD_MAX_MEAN)):
        got = np.log(st[name][layers])
        assert got.mean() == pytest.approx(np.log(target).mean(), abs=0.3), name
        np.testing.assert_allclose(got, np.log(target), atol=0.8, err_msg=name)


# ---- real data ---------------------------------------------------------------------------------
def _calibration_tool():
    spec = importlib.util.spec_from_file_location("calibrate_trace", REPO / "tools" / "calibrate_trace.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def _real_counts_present() -> bool:
    """Both count files, not just their folder (an empty or partial copy skips too)."""
    names = ("olmoe_routing_counts_layers0_7_15.npz", "mistral_routing_counts_layers0_7_15.npz")
    return all((REAL_COUNTS / name).is_file() for name in names)


@pytest.mark.skipif(not _real_counts_present(), reason=f"real routing counts not present at {REAL_COUNTS}")
def test_calibration_constants_match_real_counts() -> None:
    tool = _calibration_tool()
    olmoe = tool.real_stats(REAL_COUNTS / tool.FILES["olmoe"])
    assert olmoe.zipf_exponent == pytest.approx(ts.TARGET_ZIPF_EXPONENT, abs=1e-3)
    assert olmoe.top_token_share == pytest.approx(ts.TARGET_TOP_TOKEN_SHARE, abs=1e-3)
    assert olmoe.distinct_tokens == pytest.approx(ts.TARGET_DISTINCT_TOKENS, abs=1)
    assert olmoe.pair_union_ratio == pytest.approx(ts.TARGET_PAIR_UNION_RATIO, abs=1e-3)
    for name, target in (("token_recall", ts.TARGET_TOKEN_RECALL), ("frequent_recall", ts.TARGET_FREQUENT_RECALL),
                         ("cross_domain_recall", ts.TARGET_CROSS_DOMAIN_RECALL), ("crosslayer_nmi", ts.TARGET_CROSSLAYER_NMI),
                         ("load_max_mean", ts.TARGET_LOAD_MAX_MEAN), ("load_cv", ts.TARGET_LOAD_CV)):
        np.testing.assert_allclose(getattr(olmoe, name), target, atol=1e-3, err_msg=name)
    mixtral = tool.real_stats(REAL_COUNTS / tool.FILES["mixtral"])
    for name, target in (("token_recall", ts.MIXTRAL_TOKEN_RECALL), ("crosslayer_nmi", ts.MIXTRAL_CROSSLAYER_NMI),
                         ("load_cv", ts.MIXTRAL_LOAD_CV)):
        np.testing.assert_allclose(getattr(mixtral, name), target, atol=1e-3, err_msg=name)
    # PROVENANCE.txt: arxiv recall OLMoE 0.61/0.74/0.78, Mixtral 0.62/0.64/0.66 (uniform 0.125 / 0.25)
    assert ts.TARGET_TOKEN_RECALL[0] > 0.125 * 4 and ts.MIXTRAL_TOKEN_RECALL[0] > 0.25 * 2


def test_split_rounds_float_products_but_not_fractions_below_a_boundary() -> None:
    """floor(f * S) with a relative tolerance: 0.29 * 100 (28.999999999999996) gives 29, while
    0.37499999995 * 8 gives 2 (an absolute 1e-9 made it 3) and 0.1249999999 * 8 gives 0."""
    from moelayers.trace import train_sequences

    assert train_sequences(0.29, 100) == 29 and train_sequences(0.7, 10) == 7 and train_sequences(0.5, 7) == 3
    assert train_sequences(0.37499999995, 8) == 2 and train_sequences(0.1249999999, 8) == 0


# ---- recorder: buffers, a layer as the model, early argument checks ------------------------------
class StaticBufferMoE(FakeMoE):
    """Writes its routing into one persistent ``last_topk_ids`` buffer (like a captured graph's outputs)."""

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        ids = self.route(token_ids)
        if self.last_topk_ids is None or self.last_topk_ids.shape != ids.shape:
            self.last_topk_ids = torch.empty_like(ids)
        self.last_topk_ids.copy_(ids)
        self.last_token_ids = token_ids
        return x + 1


def test_recorder_copies_buffers_the_caller_reuses() -> None:
    """A decode loop that writes each step's tokens into one CPU int64 buffer (and a layer that keeps
    its routing in one buffer): every recorded forward keeps its own token and expert ids."""
    layer = StaticBufferMoE(8, 2, salt=1)
    buf = torch.zeros(2, dtype=torch.int64)
    with TraceRecorder(layer, vocab_size=50) as rec:
        for step in range(3):
            buf.copy_(torch.tensor([10 * step + 1, 10 * step + 2]))
            layer(torch.zeros(2, 4), token_ids=buf)
    tokens = [1, 2, 11, 12, 21, 22]
    np.testing.assert_array_equal(rec.result.token_ids, tokens)
    np.testing.assert_array_equal(rec.result.topk_ids[:, 0], layer.route(torch.tensor(tokens)).numpy())


def test_recorder_of_a_moe_layer_itself_keeps_tags() -> None:
    """TraceRecorder(layer): the layer's tokens are recorded under the pending tag before the model's
    return hook (on the same module) clears it."""
    layer = FakeMoE(8, 2, salt=1)
    with TraceRecorder(layer, vocab_size=50) as rec:
        rec.tag(["a", "a"])
        layer(torch.zeros(2, 4), token_ids=torch.tensor([1, 2]))
        rec.tag(["b"])
        layer(torch.zeros(1, 4), token_ids=torch.tensor([3]))
        rec.tag(["a"])
        layer(torch.zeros(1, 4), token_ids=torch.tensor([4]))
        layer(torch.zeros(1, 4), token_ids=torch.tensor([5]))  # untagged: its own sequence
    trace = rec.result
    np.testing.assert_array_equal(trace.token_ids, [1, 2, 4, 3, 5])
    np.testing.assert_array_equal(trace.seq_offsets, [0, 3, 4, 5])
    np.testing.assert_array_equal(trace.topk_ids[:, 0], layer.route(torch.tensor([1, 2, 4, 3, 5])).numpy())
    assert no_hooks(layer)


def test_recorder_refuses_bad_arguments_before_recording() -> None:
    """vocab_size / num_experts and unhashable tag keys are refused when given, not at ``result``."""
    model = FakeModel()
    for kw, exc, match in ((dict(vocab_size=0), ValueError, "'vocab_size' must be >= 1, got 0"),
                           (dict(num_experts=-3), ValueError, "'num_experts' must be >= 1, got -3"),
                           (dict(vocab_size=2.5), TypeError, "'vocab_size' must be an integer"),
                           (dict(num_experts=True), TypeError, "'num_experts' must be an integer")):
        with pytest.raises(exc, match=match):
            TraceRecorder(model, **kw)
    assert no_hooks(model)
    rec = TraceRecorder(model, np.int64(50), num_experts=np.uint8(8))  # numpy integers are fine
    with rec:
        with pytest.raises(TypeError, match=r"tag\(\): seq_ids\[1\] = \[1\] is not hashable \(list\)"):
            rec.tag(["a", [1]])
        rec.tag(["a", "a"])  # the refused tag left nothing pending
        model(torch.tensor([1, 2]))
    np.testing.assert_array_equal(rec.result.seq_offsets, [0, 2])
    assert rec.result.vocab_size == 50 and rec.result.num_experts == 8


def test_validation_messages_for_unsigned_offsets_and_huge_ints() -> None:
    """uint64 offsets are compared as given (no wrap-around to a false entry); a Python int beyond
    int64 is an integer that is too large, not a non-integer."""
    ids, tok = np.array([[[0, 1]], [[2, 3]]]), np.array([3, 4])
    with pytest.raises(ValueError, match=r"non-decreasing: entry 2 \(2\) < entry 1 \(9223372036854775813\)"):
        RoutingTrace(ids, tok, np.array([0, 2**63 + 5, 2], dtype=np.uint64), 4)
    for kw in (dict(vocab_size=2**70), dict(num_experts=2**70)):
        with pytest.raises(ValueError, match=r"must be <= 9223372036854775807 \(stored as int64\), got 1180591620717411303424"):
            RoutingTrace(ids, tok, np.array([0, 2]), **(dict(num_experts=4) | kw))
    with pytest.raises(ValueError, match="must be >= 1"):
        RoutingTrace(ids, tok, np.array([0, 2]), 4, vocab_size=-(2**70))


@pytest.mark.parametrize("knob, value", [
    ("token_scale", "2"), ("expert_skew", True), ("crosslayer_carry", None), ("topic_scale", [1, 2, "x"]),
    ("cluster_scale", float("nan")), ("sequence_scale", [1.0, np.inf, 1.0]),
])
def test_synthetic_depth_knobs_must_be_numbers(knob, value):
    """The depth knobs went through float() unchecked: '2' and True were accepted, None and 'x'
    raised numpy's errors without the knob's name."""
    with pytest.raises(ValueError, match=rf"synthetic_trace: {knob} must be a finite number or 3 of them"):
        synthetic_trace(2, 2, 8, 2, 50, seq_len=4, **{knob: value})
    synthetic_trace(2, 2, 8, 2, 50, seq_len=4, **{knob: np.float32(0.5) if knob != "topic_scale" else [1, 2, 3]})


@pytest.mark.parametrize("per_layer,reentrant", [(False, True), (True, True), (False, False)])
def test_recorder_ignores_forwards_rerun_by_activation_checkpointing(per_layer, reentrant):
    """The backward of a checkpointed model re-runs the MoE layers' forwards: they were stored a
    second time (whole-model, reentrant), made backward() raise (per layer), or left a half forward
    pending that broke the next tag() (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=16, num_experts=4, top_k=2)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1)
            self.b = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=2)

        def forward(self, x, tok):
            if per_layer:
                x = checkpoint(lambda y: self.a(y, token_ids=tok), x, use_reentrant=reentrant)
                return checkpoint(lambda y: self.b(y, token_ids=tok), x, use_reentrant=reentrant)
            return checkpoint(lambda y: self.b(self.a(y, token_ids=tok), token_ids=tok), x, use_reentrant=reentrant)

    m = Model()
    with TraceRecorder(m, vocab_size=10) as rec:
        rec.tag(["r", "r"])
        m(torch.randn(2, 8, requires_grad=True), torch.tensor([1, 2])).sum().backward()
        rec.tag(["s"])
        m(torch.randn(1, 8, requires_grad=True), torch.tensor([3])).sum().backward()
    assert rec.result.token_ids.tolist() == [1, 2, 3] and rec.result.seq_offsets.tolist() == [0, 2, 3]


def test_recorder_drops_a_decoding_step_that_raised_part_way():
    """TinyDecoder.step runs the layers without model.forward: after a step that raised in its
    second block, every tag() raised and the next valid step was refused and lost."""
    from moelayers.models.tiny import TinyConfig, TinyDecoder

    moe = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2)
    model = TinyDecoder(TinyConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2),
                        lambda i: ml.VanillaMoE(moe, ml.ParallelGroups.single(), seed=i))
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="dropped 1 incomplete"), \
            TraceRecorder(model, vocab_size=50) as rec:
        rec.tag(["a", "a"])
        model.step([("a", torch.tensor([1, 2]))])
        with pytest.raises(ValueError):  # block 1 refuses its forced ids
            model.step([("b", torch.tensor([3]))], forced_topk=[None, torch.tensor([[0, 99]])])
        model.step([("c", torch.tensor([4]))])  # untagged, after the failure
        rec.tag(["d"])
        model.step([("d", torch.tensor([5]))])
    assert rec.result.token_ids.tolist() == [1, 2, 4, 5]


def test_split_does_not_check_its_parts_again_and_step_loads_keep_compact_ids(monkeypatch) -> None:
    """Planning a 3M-token trace ran the trace checks three times (load, then both halves of the
    split: 7 s each), and step_loads made an int64 copy of every layer's ids at once (the run's
    memory peak, twice the size of an int16 file)."""
    import tracemalloc

    import moelayers.trace as trace_mod
    from moelayers.planning.steps import trace_step_loads

    trace = synthetic_trace(60, 16, 16, 4, 500, seq_len=(200, 400), seed=3)
    trace.topk_ids = trace.topk_ids.astype(np.int16)
    calls = []
    real = trace_mod._check_distinct
    monkeypatch.setattr(trace_mod, "_check_distinct", lambda *a: calls.append(1) or real(*a))
    train, held = trace.split(0.5)
    assert calls == [] and train.topk_ids.dtype == np.int16
    np.testing.assert_array_equal(np.concatenate([train.topk_ids, held.topk_ids]), trace.topk_ids)
    assert train.vocab_size == trace.vocab_size and held.num_experts == 16 and train.token_ids.dtype == np.int64
    tracemalloc.start()
    try:
        loads = trace_step_loads(trace, 512)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < trace.topk_ids.size * 8 / 2, peak  # an int64 copy of every layer's ids would be the whole size
    from moelayers.planning.steps import step_loads

    np.testing.assert_array_equal(loads, step_loads(trace.topk_ids.astype(np.int64), 16, 512))


@pytest.mark.parametrize("num_experts", [8, 40_000])
def test_recorder_keeps_narrow_ids_while_recording(num_experts) -> None:
    """A long recording holds every token's [L, K] expert ids until the trace is built: int16 where the
    ids fit (a quarter of int64's memory), wider where they do not, the values exact either way."""
    model = FakeModel()
    for layer in (model.moe_a, model.moe_b):
        layer.num_experts = layer.config.num_experts = num_experts
        layer.salt = 999 if num_experts > 32_768 else layer.salt  # token 35 -> experts 35,000 and 35,001
    tokens = [[3, 35, 17], [1, 2]]
    with TraceRecorder(model, vocab_size=50) as rec:
        for forward in tokens:
            model(torch.tensor(forward))
    held = [ids for ids, _, _ in rec._forwards]
    wide = np.int16 if num_experts <= 32_768 else np.int32
    assert [a.dtype for a in held] == [wide, np.int16], [a.dtype for a in held]
    expected = np.concatenate([expected_ids(model, f) for f in tokens])
    np.testing.assert_array_equal(rec.result.topk_ids, expected)


def test_recorder_memory_of_decode_steps_is_their_tokens() -> None:
    """A long recording of one-token forwards (decode steps) grows by about the documented 2 L K + 16
    bytes a token, not by the three small arrays of each forward (about 0.7 KB each before they
    were joined), and the trace is the same as the forwards' routing, tagged and untagged alike."""
    import tracemalloc

    model = FakeModel()
    L, K = 2, 2
    n = 3 * trace_mod._JOIN_FORWARDS
    with TraceRecorder(model, vocab_size=50) as rec:
        tracemalloc.start()
        try:
            for step in range(2 * n):
                if step == n:
                    before = tracemalloc.get_traced_memory()[0]
                if step % 2:
                    rec.tag([f"request {step % 5}"])  # five tagged requests; the even steps untagged
                model(torch.tensor([step % 50]))
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    per_forward = grown / n
    assert per_forward < 2 * (2 * L * K + 16), f"{per_forward:.0f} bytes a one-token forward"
    trace = rec.result
    assert trace.num_sequences == 5 + n  # the five tagged requests and every untagged step
    tagged = [step for step in range(2 * n) if step % 2]
    first = trace.sequence(1)  # "request 1" (sequence 0 is the untagged step 0): steps 1, 11, 21, ...
    np.testing.assert_array_equal(first.token_ids, [s % 50 for s in tagged if s % 5 == 1])
    np.testing.assert_array_equal(trace.topk_ids, np.concatenate(
        [expected_ids(model, [int(t)]) for t in trace.token_ids]))


def test_a_split_with_an_empty_part_names_the_file(tmp_path: Path) -> None:
    arrays = dict(small_arrays(), seq_offsets=np.array([0, 7], dtype=np.int64))  # one sequence
    np.savez(tmp_path / "one.npz", **arrays)
    with pytest.raises(ValueError, match=r"one.npz: split\(0.5\) of 1 sequences leaves an empty part"):
        load_trace(tmp_path / "one.npz").split(0.5)
    with pytest.raises(ValueError, match=r"<memory>: split\(0.5\) of 1 sequences"):  # a trace cut from another
        load_trace(tmp_path / "one.npz").select_sequences([0]).split(0.5)
    # a fraction too small for the sequences: the message said the trace needs "at least two"
    twenty = dict(small_arrays(), seq_offsets=np.array([0, *range(1, 8), *[7] * 13], dtype=np.int64))
    np.savez(tmp_path / "twenty.npz", **twenty)
    with pytest.raises(ValueError, match=r"so it needs a train_fraction of at least 1/20 for its 20 sequences"):
        load_trace(tmp_path / "twenty.npz").split(0.01)


def test_recorder_ignores_a_deep_copy_of_the_model():
    """A reference model deep-copied from the recorded policy carries the recorder's hooks: its
    forwards were recorded as the policy's (and went on being recorded after the with-block)."""
    import copy

    class Policy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
            self.a = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1)
            self.b = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=2)

        def forward(self, x, ids):
            return self.b(self.a(x, token_ids=ids), token_ids=ids)

    policy, x, ids = Policy(), torch.randn(5, 8, dtype=torch.float64), torch.arange(5)
    with torch.no_grad(), TraceRecorder(policy, vocab_size=20) as recorder:
        reference = copy.deepcopy(policy)
        policy(x, ids)
        reference(2 * x, ids + 7)
        policy(x, ids)
    with torch.no_grad():
        reference(x, ids)
    trace = recorder.trace()
    assert trace.num_tokens == 10 and sorted(set(trace.token_ids.tolist())) == list(range(5))
    assert recorder._num_forwards == 2
    # the copy's model hooks reach this recorder (ignored), not a copy of it that records on
    assert all(h.__self__ is recorder for h in list(reference._forward_pre_hooks.values())
               + list(reference._forward_hooks.values()))


def test_synthetic_trace_progress_bar_changes_nothing_else(capsys):
    """A DeepSeek-V3-sized synthetic trace takes minutes with nothing on the screen (a scale
    journey): ``progress=True`` draws a bar over the layers; the trace is the same."""
    from moelayers.trace import synthetic_trace

    quiet = synthetic_trace(6, 3, 8, 2, 50, seq_len=(4, 9), seed=3)
    shown = synthetic_trace(6, 3, 8, 2, 50, seq_len=(4, 9), seed=3, progress=True)
    assert np.array_equal(quiet.topk_ids, shown.topk_ids) and np.array_equal(quiet.token_ids, shown.token_ids)
    assert "synthetic trace" in capsys.readouterr().err


def test_split_parts_are_the_selected_sequences_without_a_copy() -> None:
    """split() copied both parts (plan.py held a large trace twice, a memory journey): its parts are
    now views, equal to select_sequences' copies."""
    trace = synthetic_trace(40, 3, 8, 2, 100, seed=0)
    for part, idx in zip(trace.split(0.3), (np.arange(12), np.arange(12, 40))):
        copy = trace.select_sequences(idx)
        for name in ("topk_ids", "token_ids", "seq_offsets"):
            got, want = getattr(part, name), getattr(copy, name)
            assert np.array_equal(got, want) and got.dtype == want.dtype, name
        assert (part.num_experts, part.vocab_size, part.topk_weights) == (copy.num_experts, copy.vocab_size, None)
        assert np.shares_memory(part.topk_ids, trace.topk_ids) and np.shares_memory(part.token_ids, trace.token_ids)
