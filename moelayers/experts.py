"""`GroupedExperts`: the SwiGLU experts in this rank's physical slots."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moelayers.dispatch.comm import all_gather_flat
from moelayers.placement import ExpertPlacement


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One slot's SwiGLU: ``x [N, H]``, ``w13 [2F, H]`` (gate rows, then up), ``w2 [H, F]`` -> ``[N, H]``
    (the loop backend; ``moelayers.reference`` has its own, independent version)."""
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


#: dtypes ``torch._grouped_mm`` takes
GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _grouped_mm_supported(x: torch.Tensor, hidden: int, ffn: int) -> bool:
    """``torch._grouped_mm`` runs bf16 on Hopper-class GPUs; rows must be 16-byte aligned."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and hidden % 8 == 0
        and ffn % 8 == 0
    )


class GroupedExperts(nn.Module):
    """Weights of ``S`` physical slots and their grouped SwiGLU matmul.

    Attributes:
        w13: ``[S, 2F, H]`` gate (first ``F`` rows) and up projections, fused.
        w2: ``[S, H, F]`` down projection.

    Args:
        num_slots: physical slots on this rank ``S``.
        hidden_size: ``H``; ffn_hidden_size: ``F``.
        backend: ``'auto'`` (``torch._grouped_mm`` where supported, else the loop),
            ``'grouped_mm'`` or ``'loop'`` (the readable reference: one matmul per slot).
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
    ):
        super().__init__()
        if backend not in ("auto", "grouped_mm", "loop"):
            raise ValueError(f"backend must be 'auto', 'grouped_mm' or 'loop', got {backend!r}")
        if backend == "grouped_mm":  # asked for explicitly: refuse here what it cannot run, not in the forward
            itemsize = torch.empty((), dtype=dtype).element_size()
            if not hasattr(torch, "_grouped_mm") or dtype not in GROUPED_MM_DTYPES \
                    or (hidden_size * itemsize) % 16 or (ffn_hidden_size * itemsize) % 16:
                raise ValueError(f"backend='grouped_mm' needs torch._grouped_mm, a dtype in "
                                 f"{[str(d) for d in GROUPED_MM_DTYPES]} and 16-byte aligned rows (H={hidden_size}, "
                                 f"F={ffn_hidden_size} in {dtype}): use backend='auto' or 'loop'")
        self.num_slots, self.hidden_size, self.ffn_hidden_size = num_slots, hidden_size, ffn_hidden_size
        self.backend = backend
        self.w13 = nn.Parameter(torch.empty(num_slots, 2 * ffn_hidden_size, hidden_size, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(num_slots, hidden_size, ffn_hidden_size, dtype=dtype, device=device))
        for p in (self.w13, self.w2):
            p.allreduce = False  # expert-parallel parameters: not reduced over data parallel ranks

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        return self.backend == "grouped_mm" or (
            self.backend == "auto" and _grouped_mm_supported(x, self.hidden_size, self.ffn_hidden_size)
        )

    def sync_free(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` on inputs like ``x`` runs without a host sync (CUDA-graph capturable)."""
        return self.uses_grouped_mm(x)

    def forward(self, x: torch.Tensor, slot_counts: torch.Tensor) -> torch.Tensor:
        """Apply slot ``s``'s expert to its contiguous block of rows.

        Args:
            x: ``[N, H]`` rows sorted by slot; ``N == slot_counts.sum()``.
            slot_counts: ``[S]`` int rows per slot (on ``x.device``).

        Returns:
            ``[N, H]``.
        """
        if self.uses_grouped_mm(x):
            return self._forward_grouped_mm(x, slot_counts)
        return self._forward_loop(x, slot_counts)

    def _forward_grouped_mm(self, x: torch.Tensor, slot_counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(slot_counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(x, self.w13.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs=offs)

    def _forward_loop(self, x: torch.Tensor, slot_counts: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for s, n in enumerate(slot_counts.tolist()):
            if n:
                outs.append(swiglu(x[start : start + n], self.w13[s], self.w2[s]))
            start += n
        if not outs:
            return x.new_zeros(0, self.hidden_size) + 0 * (self.w13.sum() + self.w2.sum())
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

    @torch.no_grad()
    def export_full(self, placement: ExpertPlacement, group=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical ``(w13 [E, 2F, H], w2 [E, H, F])`` gathered over the expert-parallel group
        (each expert taken from its first replica)."""
        return gather_logical(self.w13, self.w2, placement, group)


def gather_logical(
    w13: torch.Tensor, w2: torch.Tensor, placement: ExpertPlacement, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather per-slot tensors ``[S, ...]`` over ``group`` and pick each logical expert's
    first replica: ``-> ([E, ...], [E, ...])``. Also used for gradients, where the caller sums
    replicas instead (see :func:`sum_replicas`)."""
    full13, full2 = _all_slots(w13, group), _all_slots(w2, group)
    first = placement.log2phy[:, 0].to(w13.device)
    return full13[first], full2[first]


def sum_replicas(per_slot: torch.Tensor, placement: ExpertPlacement, group=None) -> torch.Tensor:
    """Sum a per-slot tensor ``[S, ...]`` over each logical expert's replicas -> ``[E, ...]``
    (the gradient of a logical expert is the sum over its replicas)."""
    full = _all_slots(per_slot, group)
    experts = placement.phy2log.flatten().to(per_slot.device)
    keep = experts >= 0
    out = full.new_zeros((placement.num_experts,) + tuple(per_slot.shape[1:]))
    return out.index_add_(0, experts[keep], full[keep])


def _all_slots(t: torch.Tensor, group) -> torch.Tensor:
    """``[S, ...]`` on each rank -> ``[R * S, ...]`` in rank order."""
    t = t.detach().contiguous()
    if group is None:
        return t
    size = dist.get_world_size(group)
    out = t.new_empty((size * t.shape[0],) + tuple(t.shape[1:]))
    all_gather_flat(out, t, group=group)
    return out
