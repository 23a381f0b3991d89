#!/usr/bin/env python
"""A Hugging Face MoE model with its sparse blocks swapped for moelayers layers, against the same
model as transformers runs it: greedy ``generate`` on left-padded prompts of mixed lengths, one
process (world 1). Measures the prefill (one forward of the padded batch, the logits of its last
position only, as ``generate``'s) and the decode step (the median interval between the steps of
a ``generate`` of N tokens, timed by a stopping criterion that synchronises, as ``generate``
does after each step anyway), medians of ``--reps``, the variants
interleaved within each repetition, and their ratios to ``hf``'s per repetition (median and range), for:

* ``hf``: the model as transformers builds it (transformers >= 5: its ``grouped_mm`` experts on
  GPU by default);
* ``moelayers``: ``swap_moe_blocks(model, ParallelGroups.single())`` (``VanillaMoE``);
* ``moelayers_skip_padding``: the same with ``skip_padding=True`` (padded positions left out);
* ``moelayers_unchecked``: ``swap_moe_blocks(..., check_finite=False)``: no NaN/inf check of the
  router logits, so (one process, inference) no host sync in the layers;
* ``moelayers_deferred``: ``swap_moe_blocks(..., check_finite='deferred')``: the check kept, each
  layer's flag word read at its next forward (no host sync in the layers either);
  ``moelayers.check_pending`` after each ``generate``, in its time;
* ``moelayers_graphs``: ``swap_moe_blocks(..., capacity=(16, 32, ..., 2^n), cuda_graph=True)`` (the
  powers of two up to the batch's padded prompt tokens): each call padded to the smallest that
  holds it and replayed from that size's CUDA graph (on CPU: run eagerly);
* ``moelayers_graphs_unchecked``: the same with ``check_finite=False`` (no flag read after a replay);
* ``moelayers_graphs_deferred``: the same with ``check_finite='deferred'`` (each layer's flags copied
  to the host behind its replay and read at its next forward; ``moelayers.check_pending`` after each
  ``generate``, in its time).

It also reports the share of generated tokens equal to ``hf``'s (random weights in bf16: a rounding
can flip a near tie, after which a sequence goes its own way) and the padding share of the batch.

Usage::

    python tools/hf_bench.py --device cuda --out DIR          # Qwen3-30B-A3B's layer shape, 4 layers
    python tools/hf_bench.py --smoke                           # CPU, a tiny shape (a check of the script)

Writes ``DIR/hf_bench.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _args import positive_int  # noqa: E402  (tools/ is the script's directory)
import moelayers as ml  # noqa: E402
from moelayers.integrations.hf import swap_moe_blocks  # noqa: E402

#: Qwen3-30B-A3B's decoder shape (the layer count is --layers)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, norm_topk_prob=True, max_position_embeddings=8192)
VARIANTS = ("hf", "moelayers", "moelayers_skip_padding", "moelayers_unchecked", "moelayers_deferred",
            "moelayers_graphs", "moelayers_graphs_unchecked", "moelayers_graphs_deferred")
SMOKE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
             num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, norm_topk_prob=True,
             max_position_embeddings=512)


def build(shape: dict, layers: int, device: str, dtype: torch.dtype):
    import transformers

    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=layers, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # every sequence generates --new tokens
    model.generation_config.pad_token_id = 0
    return model


def prompts(batch: int, lo: int, hi: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, hi]`` left-padded ids (0) of lengths uniform in ``[lo, hi]`` and their attention mask."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(lo, hi + 1, (batch,), generator=g)
    lengths[0] = hi
    ids = torch.randint(1, vocab, (batch, hi), generator=g)
    mask = (torch.arange(hi)[None, :] >= (hi - lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def timed(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


class StepClock:
    """A ``generate`` stopping criterion that stops nothing and records when each step ended
    (synchronised with the GPU)."""

    def __init__(self, device: str):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores, **kwargs):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def step(self) -> float:
        """The median interval between steps (seconds): the decode step."""
        return statistics.median(b - a for a, b in zip(self.times, self.times[1:]))


def measure(models: dict, ids, mask, new: int, reps: int, device: str) -> dict:
    """Each model's prefill and decode step, the variants interleaved within each repetition (the
    machine's drift between repetitions then falls on every variant alike; the first variant of a
    repetition rotates): ``{name: {"prefill": [s], "decode": [s], "full": [s], "tokens": ...}}``."""
    from transformers import StoppingCriteriaList

    gen = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    names = list(models)
    out = {name: {"prefill": [], "decode": [], "full": []} for name in names}
    with torch.inference_mode():
        for model in models.values():  # warm-up, as timed (and the CUDA graphs' captures)
            model(ids, attention_mask=mask, logits_to_keep=1)
            model.generate(ids, max_new_tokens=new, min_new_tokens=new,
                           stopping_criteria=StoppingCriteriaList([StepClock(device)]), **gen)
        for rep in range(reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                model, got, clock = models[name], out[name], StepClock(device)
                # as generate's prefill: the logits of the last position only (not the LM head over every position)
                got["prefill"].append(timed(lambda: model(ids, attention_mask=mask, logits_to_keep=1), device)[0])
                t, tokens = timed(lambda: checked(model.generate(ids, max_new_tokens=new, min_new_tokens=new,
                                                                 stopping_criteria=StoppingCriteriaList([clock]),
                                                                 **gen), model), device)
                got["full"].append(t)
                got["decode"].append(clock.step())
                got["tokens"] = tokens[:, ids.shape[1]:].cpu()
    return out


def checked(tokens: torch.Tensor, model) -> torch.Tensor:
    """``tokens``, after raising what deferred NaN checks left from the last forwards (a no-op for
    other layers, and for transformers' own model)."""
    if any(isinstance(m, ml.MoELayerBase) for m in model.modules()):
        ml.check_pending(model)
    return tokens


def summary(times: dict, hf: dict | None) -> dict:
    """Medians (ms) of one variant's prefill and decode step, and against ``hf``'s: the median and
    range of the per-repetition ratios."""
    row = {"prefill_ms": 1e3 * statistics.median(times["prefill"]),
           "decode_step_ms": 1e3 * statistics.median(times["decode"]),
           "prefill_ms_all": [1e3 * t for t in times["prefill"]], "decode_step_ms_all": [1e3 * t for t in times["decode"]],
           "generate_ms_all": [1e3 * t for t in times["full"]]}
    if hf is not None:
        for key in ("prefill", "decode"):
            ratios = [a / b for a, b in zip(times[key], hf[key])]
            row[f"{key}_vs_hf"] = statistics.median(ratios)
            row[f"{key}_vs_hf_range"] = [min(ratios), max(ratios)]
    return row


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """``(low, 2 low, 4 low, ...)`` up to the first at least ``high``."""
    sizes = [low]
    while sizes[-1] < high:
        sizes.append(2 * sizes[-1])
    return tuple(sizes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers (default 4)")
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--prompt", type=positive_int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX] (default 64 512; 8 32 with --smoke)")
    p.add_argument("--new", type=positive_int, default=32, help="tokens generated (default 32)")
    p.add_argument("--reps", type=positive_int, default=5)
    p.add_argument("--smoke", action="store_true", help="a tiny shape on CPU (checks the script)")
    p.add_argument("--out", type=Path, default=None, help="folder for hf_bench.json")
    args = p.parse_args(argv)
    if args.prompt is None:
        args.prompt = [8, 32] if args.smoke else [64, 512]
    if args.new < 2:
        p.error("--new must be at least 2 (the decode step is the interval between two steps)")
    if args.prompt[0] > args.prompt[1]:
        p.error("--prompt MIN MAX: MIN must not exceed MAX")
    shape, dtype = (SMOKE, torch.float32) if args.smoke else (QWEN3_30B_A3B, torch.bfloat16)
    device = "cpu" if args.smoke else args.device
    import transformers

    base = build(shape, args.layers, device, dtype)
    ids, mask = prompts(args.batch, *args.prompt, shape["vocab_size"], device)
    models = {}
    for name in VARIANTS:
        model = base if name == "hf" else copy.deepcopy(base)
        if name != "hf":
            graphs = {}
            if "graphs" in name:
                graphs = dict(capacity=powers_of_two(16, ids.numel()), cuda_graph=device.startswith("cuda"))
            check = {"unchecked": False, "deferred": "deferred"}.get(name.rsplit("_", 1)[-1], True)
            swap_moe_blocks(model, ml.ParallelGroups.single(), skip_padding=name.endswith("skip_padding"),
                            check_finite=check, **graphs)
        models[name] = model
    times = measure(models, ids, mask, args.new, args.reps, device)
    results = {name: summary(times[name], None if name == "hf" else times["hf"]) for name in VARIANTS}
    for name in VARIANTS:
        print(f"{name:28s} prefill {results[name]['prefill_ms']:9.2f} ms   decode step "
              f"{results[name]['decode_step_ms']:8.2f} ms", flush=True)
    for name in VARIANTS[1:]:
        results[name]["same_tokens_as_hf"] = float((times[name]["tokens"] == times["hf"]["tokens"]).float().mean())
    record = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "hf_experts_implementation": getattr(base.config, "_experts_implementation_internal", None)
        or getattr(base.config, "_experts_implementation", None),
        "shape": "smoke" if args.smoke else "qwen3_30b_a3b", "layers": args.layers, "dtype": str(dtype),
        "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new, "reps": args.reps,
        "padding_share": float(1 - mask.float().mean()), "results": results,
        "command": " ".join(sys.argv),
    }
    for name in VARIANTS[1:]:
        r = results[name]
        print(f"{name:28s} / hf: prefill {r['prefill_vs_hf']:.3f} ({r['prefill_vs_hf_range'][0]:.3f}-"
              f"{r['prefill_vs_hf_range'][1]:.3f})  decode {r['decode_vs_hf']:.3f} ({r['decode_vs_hf_range'][0]:.3f}-"
              f"{r['decode_vs_hf_range'][1]:.3f})  same tokens {r['same_tokens_as_hf']:.3f}")
    print(f"padding share of the prompts: {record['padding_share']:.3f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hf_bench.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
