"""`GroupedExperts`: the SwiGLU experts in this rank's physical slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moelayers.dispatch.comm import all_gather_flat
from moelayers.groups import collective_device
from moelayers.placement import ExpertPlacement
from moelayers.router import autocast_on


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One slot's SwiGLU: ``x [N, H]``, ``w13 [2F, H]`` (gate rows, then up), ``w2 [H, F]`` -> ``[N, H]``
    (the loop backend; ``moelayers.reference`` has its own, independent version)."""
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


#: dtypes ``torch._grouped_mm`` takes
GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


#: compute capability majors where ``torch._grouped_mm`` runs bf16 in its CUTLASS kernel (sm90,
#: sm100); elsewhere, and in other dtypes, it falls back to a loop that reads the offsets on the host
GROUPED_MM_FAST_MAJORS = (9, 10)


def _grouped_mm_supported(x: torch.Tensor, hidden: int, ffn: int, *, fast_path: bool = False) -> bool:
    """Whether ``backend='auto'`` runs ``torch._grouped_mm`` on ``x``: bf16 on a GPU of compute
    capability 9.0 or later, rows 16-byte aligned. ``fast_path``: only where it runs its CUTLASS
    kernel (``GROUPED_MM_FAST_MAJORS``), which is also free of host syncs (CUDA-graph capturable)."""
    major = torch.cuda.get_device_capability(x.device)[0] if x.is_cuda else 0
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and (major in GROUPED_MM_FAST_MAJORS if fast_path else major >= 9)
        and hidden % 8 == 0
        and ffn % 8 == 0
    )


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes ``x``'s matmuls in, where it is on and not ``x``'s own
    (float64 it leaves alone)."""
    if x.dtype == torch.float64 or not autocast_on(x):
        return None
    dtype = torch.get_autocast_dtype(x.device.type)
    return None if dtype == x.dtype else dtype


def _grouped_mm_fits(dtype: torch.dtype, hidden: int, ffn: int) -> bool:
    """Whether ``torch._grouped_mm`` takes ``dtype`` with rows of ``hidden`` and ``ffn`` elements
    (a dtype of ``GROUPED_MM_DTYPES``, rows 16-byte aligned)."""
    return dtype in GROUPED_MM_DTYPES and (hidden * dtype.itemsize) % 16 == 0 and (ffn * dtype.itemsize) % 16 == 0


def is_slot_major(value: Any, num_slots: int) -> bool:
    """Whether ``value`` (an expert weight's optimizer state) holds one row per slot: a tensor whose
    first dimension is ``num_slots`` (Adam's moments, Adafactor's factored rows and columns). Such a
    state moves and is checkpointed with its slot's expert; anything else (a step count) belongs to
    the whole slot table. The one rule for moves (:mod:`moelayers.layers.moves`) and checkpoints
    (:mod:`moelayers.checkpoint`)."""
    return torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == num_slots


@dataclass(frozen=True)
class ReplicaTie:
    """Which of this rank's slots hold a replicated expert, for :class:`_TiedReplicas`.

    Attributes:
        slots: ``[n]`` int64 local slots holding an expert with more than one replica.
        rows: ``[n]`` int64 that expert's row among the replicated experts.
        num_rows: replicated experts in the whole placement (every rank's buffer has this many rows).
        group: the expert-parallel group (``None``: one process).
    """

    slots: torch.Tensor
    rows: torch.Tensor
    num_rows: int
    group: Any


def replica_tie(placement: ExpertPlacement, rank: int, group, device) -> ReplicaTie | None:
    """The :class:`ReplicaTie` of ``rank`` under ``placement``; ``None`` when no expert is replicated."""
    replicated = placement.logcnt > 1
    if not bool(replicated.any()):
        return None
    row_of_expert = torch.cumsum(replicated, 0) - 1
    local = placement.phy2log[rank]
    held = (local >= 0) & replicated[local.clamp(min=0)]
    slots = held.nonzero().squeeze(1)
    return ReplicaTie(slots.to(device), row_of_expert[local[slots]].to(device), int(replicated.sum()), group)


class _TiedReplicas(torch.autograd.Function):
    """Identity on the slot weights ``(w13, w2)``; the backward gives every replica of an expert
    the sum of its replicas' gradients (:class:`_SumReplicas`). Each replica then holds its
    expert's whole gradient, so an optimizer step moves every replica alike and they stay equal."""

    @staticmethod
    def forward(ctx, tie: ReplicaTie, w13: torch.Tensor, w2: torch.Tensor):
        ctx.tie = tie
        return w13.view_as(w13), w2.view_as(w2)

    @staticmethod
    def backward(ctx, g13: torch.Tensor, g2: torch.Tensor):
        return (None, *_SumReplicas.apply(ctx.tie, g13, g2))


class _SumReplicas(torch.autograd.Function):
    """``(g13 [S, ...], g2 [S, ...])`` -> the same with each replicated expert's slots replaced by
    the sum over all its replicas (one all-reduce over the expert-parallel group of a buffer with a
    row per replicated expert). The map is its own adjoint, so its backward is itself: second-order
    gradients through tied replicas work."""

    @staticmethod
    def forward(ctx, tie: ReplicaTie, g13: torch.Tensor, g2: torch.Tensor):
        ctx.tie = tie
        slots, rows = tie.slots.to(g13.device), tie.rows.to(g13.device)  # the layer may have moved devices
        bufs = [g.new_zeros((tie.num_rows,) + tuple(g.shape[1:])).index_add_(0, rows, g.index_select(0, slots))
                for g in (g13, g2)]
        flat = torch.cat([b.reshape(-1) for b in bufs])
        if tie.group is not None:
            dist.all_reduce(flat, group=tie.group)
        b13, b2 = flat.split([bufs[0].numel(), bufs[1].numel()])
        return (g13.index_copy(0, slots, b13.view_as(bufs[0]).index_select(0, rows)),
                g2.index_copy(0, slots, b2.view_as(bufs[1]).index_select(0, rows)))

    @staticmethod
    def backward(ctx, gg13: torch.Tensor, gg2: torch.Tensor):
        return (None, *_SumReplicas.apply(ctx.tie, gg13, gg2))


class GroupedExperts(nn.Module):
    """Weights of ``S`` physical slots and their grouped SwiGLU matmul.

    With :meth:`tie_replicas` (the layers call it for their placement), the replicas of an expert
    get the same gradient: the sum over the replicas, i.e. the expert's whole gradient.

    Attributes:
        w13: ``[S, 2F, H]`` gate (first ``F`` rows) and up projections, fused.
        w2: ``[S, H, F]`` down projection.

    Args:
        num_slots: physical slots on this rank ``S``.
        hidden_size: ``H``; ffn_hidden_size: ``F``.
        dtype, device: of the weights (``device=None``: torch's default; ``'meta'``: no storage).
        backend: ``'auto'`` (``torch._grouped_mm`` where supported, else the loop),
            ``'grouped_mm'`` or ``'loop'`` (the readable reference: one matmul per slot).
        init_std, seed: built on its own, every weight starts at ``N(0, init_std)`` from a generator
            seeded with ``seed`` (torch's global generator is left alone); the layers draw their own
            weights per logical expert (``init=False`` here).
        init: draw the weights now; ``False`` leaves them uninitialised.
    """

    def __init__(
        self,
        num_slots: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        backend: str = "auto",
        init_std: float = 0.02,
        seed: int = 0,
        init: bool = True,
    ):
        super().__init__()
        if backend not in ("auto", "grouped_mm", "loop"):
            raise ValueError(f"backend must be 'auto', 'grouped_mm' or 'loop', got {backend!r}")
        self.num_slots, self.hidden_size, self.ffn_hidden_size = num_slots, hidden_size, ffn_hidden_size
        self.backend = backend
        self.check_dtype(dtype)  # asked for grouped_mm explicitly: refuse here what it cannot run, not in the forward
        self.w13 = nn.Parameter(torch.empty(num_slots, 2 * ffn_hidden_size, hidden_size, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(num_slots, hidden_size, ffn_hidden_size, dtype=dtype, device=device))
        for p in (self.w13, self.w2):
            p.allreduce = False  # expert-parallel parameters: not reduced over data parallel ranks
        self._tie: ReplicaTie | None = None
        if init and self.w13.device.type != "meta":
            gen = torch.Generator(device=self.w13.device).manual_seed(seed)
            with torch.no_grad():
                self.w13.normal_(0.0, init_std, generator=gen)
                self.w2.normal_(0.0, init_std, generator=gen)

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ``ValueError`` if ``backend='grouped_mm'`` cannot compute in ``dtype`` (no
        ``torch._grouped_mm``, a dtype outside ``GROUPED_MM_DTYPES`` or rows not 16-byte aligned):
        at construction and before a cast (``.double()``), not in the forward."""
        if self.backend != "grouped_mm":
            return
        if not hasattr(torch, "_grouped_mm") or not _grouped_mm_fits(dtype, self.hidden_size, self.ffn_hidden_size):
            raise ValueError(f"backend='grouped_mm' needs torch._grouped_mm, a dtype in "
                             f"{[str(d) for d in GROUPED_MM_DTYPES]} and 16-byte aligned rows (H={self.hidden_size}, "
                             f"F={self.ffn_hidden_size} in {dtype}): use backend='auto' or 'loop'")

    def _apply(self, fn, recurse: bool = True):
        """A cast (``.double()``) to a dtype the ``grouped_mm`` backend cannot run is refused."""
        self.check_dtype(fn(torch.empty(0, dtype=self.w13.dtype, device=self.w13.device)).dtype)
        return super()._apply(fn, recurse)

    def tie_replicas(self, placement: ExpertPlacement, rank: int, group=None) -> None:
        """Sum the gradients of each expert's replicas in the backward (a collective over ``group``
        then, on every rank alike); a no-op for placements without replicas."""
        self._tie = replica_tie(placement, rank, group, self.w13.device)

    def sums_replica_grads(self) -> bool:
        """Whether a forward now records the replica tie (a replicated placement whose weights want a
        gradient, grad enabled): its backward then sums the replicas' gradients across the ranks."""
        return self._tie is not None and torch.is_grad_enabled() and (self.w13.requires_grad or self.w2.requires_grad)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13, w2)``, through the replica tie when autograd records a replicated placement."""
        if self.sums_replica_grads():
            return _TiedReplicas.apply(self._tie, self.w13, self.w2)
        return self.w13, self.w2

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether a forward on ``x [P, H]`` runs ``torch._grouped_mm`` (``backend="grouped_mm"``, or
        ``"auto"`` where the device, dtype and shapes allow it) rather than the per-expert loop."""
        return self.backend == "grouped_mm" or (
            self.backend == "auto" and _grouped_mm_supported(x, self.hidden_size, self.ffn_hidden_size)
        )

    def sync_free(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` on inputs like ``x`` runs without a host sync (CUDA-graph capturable):
        ``torch._grouped_mm`` on its fast path (the loop reads the slot counts on the host, and so
        does ``_grouped_mm``'s fallback for other dtypes or GPUs, even with ``backend='grouped_mm'``)."""
        return self.backend != "loop" and _grouped_mm_supported(x, self.hidden_size, self.ffn_hidden_size,
                                                                fast_path=True)

    def forward(self, x: torch.Tensor, slot_counts: torch.Tensor) -> torch.Tensor:
        """Apply slot ``s``'s expert to its contiguous block of rows.

        Args:
            x: ``[N, H]`` rows sorted by slot; the first ``slot_counts.sum()`` are counted (capacity
                mode pads ``x`` past them).
            slot_counts: ``[S]`` int rows per slot (on ``x.device``).

        Returns:
            The counted rows' outputs first: ``[slot_counts.sum(), H]`` from the loop, ``[N, H]``
            from the grouped GEMM (whose rows past the counted ones are not defined).
        """
        if self.uses_grouped_mm(x):
            return self._forward_grouped_mm(x, slot_counts)
        return self._forward_loop(x, slot_counts)

    def _forward_grouped_mm(self, x: torch.Tensor, slot_counts: torch.Tensor) -> torch.Tensor:
        w13, w2 = self._weights()
        dtype = _autocast_dtype(x)
        if dtype is not None:  # torch.autocast does not cover _grouped_mm: follow it as the loop's matmuls do
            if not _grouped_mm_fits(dtype, self.hidden_size, self.ffn_hidden_size):
                return self._forward_loop(x, slot_counts)
            x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
        offs = torch.cumsum(slot_counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)

    def _forward_loop(self, x: torch.Tensor, slot_counts: torch.Tensor) -> torch.Tensor:
        w13, w2 = self._weights()
        counts = slot_counts.tolist()
        # one unbind / split each: their backward stacks the slots' gradients once (indexing w13[s]
        # slot by slot would make a zeroed weight-sized gradient per slot)
        w13s, w2s, xs = w13.unbind(0), w2.unbind(0), x[: sum(counts)].split(counts)
        outs = [swiglu(xs[s], w13s[s], w2s[s]) for s, n in enumerate(counts) if n]
        if not outs:  # keep the weights in the graph: every rank's backward reaches them (and the tie)
            return x.new_zeros(0, self.hidden_size) + 0 * (w13.sum() + w2.sum())
        return torch.cat(outs)

    @torch.no_grad()
    def load_full(self, w13_all: torch.Tensor, w2_all: torch.Tensor, placement: ExpertPlacement, rank: int) -> None:
        """Copy this rank's experts out of logical ``[E, 2F, H]`` / ``[E, H, F]`` tensors.

        Empty slots are zeroed. Shapes, dtype and device are checked by the caller.
        """
        experts = placement.phy2log[rank].to(w13_all.device)
        filled = experts >= 0
        src = experts.clamp(min=0)
        self.w13.copy_(torch.where(filled[:, None, None], w13_all[src], 0).to(self.w13.device))
        self.w2.copy_(torch.where(filled[:, None, None], w2_all[src], 0).to(self.w2.device))



def gather_logical(
    w13: torch.Tensor, w2: torch.Tensor, placement: ExpertPlacement, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather per-slot tensors ``[S, ...]`` over ``group`` and pick each logical expert's
    first replica: ``-> ([E, ...], [E, ...])`` (weights, and the gradients of tied replicas).

    Raises:
        ValueError: on every rank, where the ranks hold them in different dtypes (a layer cast on
            some ranks only: the gather would exchange rows of other sizes, and gloo aborts).
    """
    agree_on_dtypes((w13, w2), group)
    full13, full2 = _all_slots(w13, group), _all_slots(w2, group)
    first = placement.log2phy[:, 0].to(w13.device)
    return full13[first], full2[first]


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)


def agree_on_dtypes(tensors: tuple[torch.Tensor, ...], *groups) -> None:
    """A small all-reduce (MAX of each dtype's index and of its negation) over each of ``groups``
    in turn (those of more than one rank; every rank takes part in all before any decides); a
    ``ValueError`` on every rank where the ranks' dtypes differ."""
    groups = tuple(g for g in groups if g is not None and dist.get_world_size(g) > 1)
    if not groups:
        return
    codes = torch.tensor([_DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES) for t in tensors],
                         dtype=torch.int64)
    vec = torch.cat([codes, -codes])
    for group in groups:
        vec = vec.to(collective_device(group))
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    high, low = vec[:len(tensors)].tolist(), (-vec[len(tensors):]).tolist()
    if high != low:
        names = [str(_DTYPES[i]) if i < len(_DTYPES) else "another dtype" for i in sorted({*high, *low})]
        raise ValueError(f"the ranks holding the layer's experts (its expert-parallel group, or their copies in the "
                         f"other groups) hold the expert weights (or gradients) in different dtypes (among them "
                         f"{' and '.join(names)}): cast the layer alike on every rank")


def _all_slots(t: torch.Tensor, group) -> torch.Tensor:
    """``[S, ...]`` on each rank -> ``[R * S, ...]`` in rank order."""
    t = t.detach().contiguous()
    if group is None:
        return t
    size = dist.get_world_size(group)
    out = t.new_empty((size * t.shape[0],) + tuple(t.shape[1:]))
    all_gather_flat(out, t, group=group)
    return out
