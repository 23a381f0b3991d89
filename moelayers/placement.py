"""`ExpertPlacement`: where each logical expert lives, in DeepSeek EPLB's format.

A placement maps the ``R * S`` physical slots (``R`` ranks, ``S`` slots per rank) to logical
experts. Physical slot ``p`` is local slot ``p % S`` of rank ``p // S``. It is the single source
of truth for "where is expert e"; routers stay in logical order.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from moelayers._compile import F, cached_tensor
from moelayers.files import atomic_write, check_format_version, read_npz, warn_unknown_entries

#: the layout of placement files (:meth:`ExpertPlacement.save`; files without the entry are of format 1)
FILE_FORMAT = 1


def on_host(fn: F) -> F:
    """Build a placement's tables on the CPU whatever the default device (a model built under
    ``with torch.device("meta")`` or ``torch.set_default_device("cuda")``): they are host tables;
    :meth:`ExpertPlacement.device_tables` copies them where the routing needs them."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.device("cpu"):
            return fn(*args, **kwargs)
    return cast(F, wrapper)


@dataclass(frozen=True)
class SlotMove:
    """One slot that must receive an expert's weights when changing placement."""

    dst_rank: int
    dst_slot: int
    expert: int
    src_rank: int
    src_slot: int


def _routing_tables(phy2log: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logcnt [E], log2phy [E, max_replicas])`` of a valid ``phy2log``: each expert's replica
    count and its slots in slot order, padded with ``-1``."""
    flat = phy2log.flatten()
    logcnt = torch.bincount(flat[flat >= 0], minlength=num_experts)
    log2phy = torch.full((num_experts, int(logcnt.max())), -1, dtype=torch.int64)
    slots = torch.nonzero(flat >= 0).flatten()
    experts = flat[slots]
    order = torch.argsort(experts * flat.numel() + slots)  # by expert, then slot
    slots, experts = slots[order], experts[order]
    start = torch.cumsum(logcnt, 0) - logcnt
    log2phy[experts, torch.arange(slots.numel()) - start[experts]] = slots
    return logcnt, log2phy


class ExpertPlacement:
    """Expert-to-slot map of one layer.

    Args:
        phy2log: ``[R, S]`` integer table: the logical expert in each of rank ``r``'s ``S`` slots,
            ``-1`` for an empty slot (copied to int64 on the host).
        num_experts: logical experts ``E``.

    Attributes:
        phy2log: ``[R, S]`` int64, logical expert in each slot, ``-1`` for an empty slot.
        log2phy: ``[E, max_replicas]`` int64, physical slot ids of each expert's replicas
            (ascending), ``-1`` padded.
        logcnt: ``[E]`` int64, replicas per expert.

    Raises:
        TypeError: ``phy2log`` is not of an integer dtype.
        ValueError: ``phy2log`` is not a non-empty 2-D table; ``num_experts`` is not a positive int
            or exceeds the slots; ids outside ``[-1, E)``, an expert without a replica, or two
            replicas of one expert on one rank.
    """

    @on_host
    def __init__(self, phy2log: torch.Tensor | np.ndarray, num_experts: int):
        if isinstance(phy2log, torch.Tensor) and phy2log.is_meta:  # (e.g. built under `with torch.device("meta")`)
            raise ValueError("phy2log is a meta tensor (a shape without values): a placement needs its expert ids; "
                             "build the table on the CPU")
        p = torch.as_tensor(phy2log)
        if p.dtype.is_floating_point or p.dtype == torch.bool or p.dtype.is_complex:
            raise TypeError(f"phy2log must be an integer tensor, got {p.dtype}")
        if p.dim() != 2 or p.numel() == 0:
            raise ValueError(f"phy2log must be a non-empty [num_ranks, slots_per_rank] table, got shape {tuple(p.shape)}")
        if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if num_experts > p.numel():  # before anything of size E is allocated (a damaged file may claim 2**40)
            raise ValueError(f"a placement of {tuple(p.shape)} = {p.numel()} slots cannot hold num_experts={num_experts} "
                             "experts: every expert needs a slot")
        if p.dtype in (torch.uint32, torch.uint64):  # int64 would wrap 2**64 - 1 to -1, an empty slot
            top = int(p.cpu().numpy().max())
            if top >= num_experts:
                raise ValueError(f"placement has expert ids outside [-1, {num_experts}): {top}")
        self.phy2log = p.to(torch.int64).cpu().clone()
        self.num_experts = int(num_experts)
        self.validate()
        self.logcnt, self.log2phy = _routing_tables(self.phy2log, self.num_experts)
        self._device_cache: dict = {}

    # ---------------------------------------------------------------- constructors
    @classmethod
    @on_host
    def linear(cls, num_experts: int, num_ranks: int, slots_per_rank: int | None = None) -> "ExpertPlacement":
        """Experts ``r*E/R .. (r+1)*E/R - 1`` on rank ``r``; extra slots (if any) empty.

        Raises:
            ValueError: if ``num_experts`` is not divisible by ``num_ranks``.
        """
        _check_positive(num_ranks=num_ranks, num_experts=num_experts)
        if slots_per_rank is not None:
            _check_positive(slots_per_rank=slots_per_rank)
        if num_experts % num_ranks:
            raise ValueError(
                f"linear placement needs num_experts ({num_experts}) divisible by num_ranks ({num_ranks})"
            )
        per = num_experts // num_ranks
        slots = per if slots_per_rank is None else slots_per_rank
        if slots < per:
            raise ValueError(f"slots_per_rank ({slots}) < experts per rank ({per})")
        table = torch.full((num_ranks, slots), -1, dtype=torch.int64)
        table[:, :per] = torch.arange(num_experts).view(num_ranks, per)
        return cls(table, num_experts)

    @classmethod
    @on_host
    def from_expert_rank(
        cls, expert_rank: torch.Tensor | np.ndarray, num_ranks: int | None = None, slots_per_rank: int | None = None
    ) -> "ExpertPlacement":
        """One replica per expert; ``expert_rank [E]`` gives each expert's rank.

        Experts on a rank fill its slots in ascending id order; ranks with fewer experts than
        ``slots_per_rank`` (default: the most any rank holds) keep empty slots. ``num_ranks``
        defaults to the highest rank given + 1: pass it when the last ranks may hold no expert.

        Raises:
            TypeError: non-integer ranks. ValueError: ``expert_rank`` is not 1-D (a plan's ``[L, E]``
            table gives one placement per layer: pass ``expert_rank[l]``), ranks out of range, or
            ``num_ranks`` / ``slots_per_rank`` not positive ints.
        """
        er = torch.as_tensor(expert_rank)
        if er.is_floating_point() or er.is_complex() or er.dtype == torch.bool:
            raise TypeError(f"expert_rank must hold integer ranks, got dtype {er.dtype}")
        if er.dim() != 1:
            raise ValueError(f"expert_rank must be [E] (one layer), got shape {list(er.shape)}: for a per-layer "
                             f"[L, E] table build one placement per layer from expert_rank[l]")
        for name, v in (("num_ranks", num_ranks), ("slots_per_rank", slots_per_rank)):
            if v is not None:
                _check_positive(**{name: v})
        er = er.to(torch.int64).cpu()
        if er.numel() == 0:
            raise ValueError("expert_rank is empty")
        ranks = int(er.max()) + 1 if num_ranks is None else num_ranks
        if int(er.min()) < 0 or int(er.max()) >= ranks:
            raise ValueError(f"expert_rank has ranks outside [0, {ranks}): min {int(er.min())}, max {int(er.max())}")
        counts = torch.bincount(er, minlength=ranks)
        slots = int(counts.max()) if slots_per_rank is None else slots_per_rank
        if slots < int(counts.max()):
            raise ValueError(f"slots_per_rank ({slots}) is less than the {int(counts.max())} experts on one rank")
        table = torch.full((ranks, slots), -1, dtype=torch.int64)
        for r in range(ranks):
            mine = torch.nonzero(er == r).flatten()
            table[r, : mine.numel()] = mine
        return cls(table, er.numel())

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor | np.ndarray, num_experts: int) -> "ExpertPlacement":
        """From an EPLB-style ``[R, S]`` table (``-1`` = empty slot)."""
        return cls(phy2log, num_experts)

    # ---------------------------------------------------------------- properties
    @property
    def num_ranks(self) -> int:
        """``R``, the expert-parallel ranks (rows of ``phy2log``)."""
        return self.phy2log.shape[0]

    @property
    def slots_per_rank(self) -> int:
        """``S``, the slots of each rank (columns of ``phy2log``)."""
        return self.phy2log.shape[1]

    @property
    def max_replicas(self) -> int:
        """The most copies any expert has (columns of ``log2phy``)."""
        return self.log2phy.shape[1]

    def experts_on(self, rank: int) -> list[int]:
        """Logical experts in ``rank``'s slots (``-1`` for empty), slot order."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be an int in [0, {self.num_ranks}), got {rank!r}")
        return self.phy2log[rank].tolist()

    @on_host
    def expert_rank(self) -> torch.Tensor:
        """``[E]`` rank of each expert's first replica."""
        return self.log2phy[:, 0] // self.slots_per_rank

    def device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(phy2log, log2phy, logcnt)`` on ``device``, cached."""
        device = torch.device(device)
        return cached_tensor(self._device_cache, device,
                             lambda: (self.phy2log.to(device), self.log2phy.to(device), self.logcnt.to(device)))

    def first_replica(self, device: torch.device) -> torch.Tensor:
        """``[E]`` physical slot of each expert's first replica on ``device``, cached."""
        return cached_tensor(self._device_cache, ("first", torch.device(device)),
                             lambda: self.log2phy[:, 0].contiguous().to(device))

    def first_replica_location(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``([E] rank, [E] local slot)`` of each expert's first replica on ``device``, cached."""
        def make() -> tuple[torch.Tensor, torch.Tensor]:
            phys = self.log2phy[:, 0]
            return (phys // self.slots_per_rank).to(device), (phys % self.slots_per_rank).to(device)

        return cached_tensor(self._device_cache, ("first_location", torch.device(device)), make)

    # ---------------------------------------------------------------- checks and moves
    @on_host
    def validate(self) -> None:
        """Raise ``ValueError`` unless every expert has a replica, ids are in range and no rank
        holds two replicas of one expert."""
        p, e = self.phy2log, self.num_experts
        bad = (p < -1) | (p >= e)
        if bad.any():
            raise ValueError(f"placement has expert ids outside [-1, {e}): {sorted(set(p[bad].tolist()))[:8]}")
        present = torch.zeros(e, dtype=torch.bool)
        present[p[p >= 0]] = True
        if not present.all():
            missing = torch.nonzero(~present).flatten()[:16].tolist()
            raise ValueError(f"placement is missing expert(s) {missing[:16]}: every expert needs at least one replica")
        for r in range(p.shape[0]):
            row = p[r][p[r] >= 0]
            if row.unique().numel() != row.numel():
                dup = [x for x in row.unique().tolist() if int((row == x).sum()) > 1]
                raise ValueError(f"placement has duplicate replicas of expert(s) {dup} on rank {r}")
        if hasattr(self, "log2phy") and not self._tables_agree():
            raise ValueError("placement tables disagree: phy2log, log2phy or logcnt was changed in place after the "
                             "placement was built (log2phy and logcnt, which route tokens, must describe phy2log); "
                             "build a new ExpertPlacement(phy2log, num_experts) from the edited table")

    @on_host
    def _tables_agree(self) -> bool:
        """Whether ``log2phy`` / ``logcnt`` (derived once) still describe ``phy2log`` (either
        edited in place: each row of ``log2phy`` holds exactly its expert's ``logcnt`` slots, in
        slot order, then ``-1``)."""
        logcnt, log2phy = _routing_tables(self.phy2log, self.num_experts)
        return (self.logcnt.shape == logcnt.shape and self.log2phy.shape == log2phy.shape
                and torch.equal(self.logcnt, logcnt) and torch.equal(self.log2phy, log2phy))

    def digest(self) -> int:
        """A 62-bit fingerprint of the tables (equal placements, equal digests; cached)."""
        if getattr(self, "_digest", None) is None:
            h = hashlib.blake2b(str((self.num_experts, *self.phy2log.shape)).encode(), digest_size=8)
            h.update(self.phy2log.contiguous().numpy().tobytes())
            self._digest = int.from_bytes(h.digest(), "little") >> 2
        return self._digest

    def copy(self) -> "ExpertPlacement":
        """An independent placement with the same tables (layers keep their own copy)."""
        return ExpertPlacement(self.phy2log, self.num_experts)

    @on_host
    def moves_to(self, other: "ExpertPlacement") -> list[SlotMove]:
        """The slots of ``other`` whose expert differs from this placement's, with a source.

        The source is a slot holding that expert now: on the destination rank itself if
        possible, else spread round-robin over the current replicas.
        """
        if not isinstance(other, ExpertPlacement):
            raise TypeError(f"moves_to needs an ExpertPlacement, got {type(other).__name__}")
        if (other.num_experts, other.num_ranks, other.slots_per_rank) != (
            self.num_experts, self.num_ranks, self.slots_per_rank
        ):
            raise ValueError(
                "placements differ in shape: "
                f"(E, R, S) = {(self.num_experts, self.num_ranks, self.slots_per_rank)} vs "
                f"{(other.num_experts, other.num_ranks, other.slots_per_rank)}"
            )
        moves, turn = [], {}
        s = self.slots_per_rank
        for r in range(other.num_ranks):
            for slot in range(s):
                e = int(other.phy2log[r, slot])
                if e < 0 or int(self.phy2log[r, slot]) == e:
                    continue
                srcs = self.log2phy[e, : int(self.logcnt[e])].tolist()
                local = [p for p in srcs if p // s == r]
                if local:
                    src = local[0]
                else:
                    k = turn.get(e, 0)
                    turn[e] = k + 1
                    src = srcs[k % len(srcs)]
                moves.append(SlotMove(r, slot, e, src // s, src % s))
        return moves

    # ---------------------------------------------------------------- persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write ``phy2log``, ``num_experts`` and ``format_version`` to an ``.npz`` file atomically."""
        phy2log, num_experts = self.phy2log.numpy(), np.int64(self.num_experts)
        atomic_write(path, lambda f: np.savez(f, phy2log=phy2log, num_experts=num_experts,
                                              format_version=np.int64(FILE_FORMAT)))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ExpertPlacement":
        """Read a placement written by :meth:`save` (other entries are ignored with a warning).

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a placement file, one of a newer format, or an invalid placement; the
                message names the file.
        """
        data = read_npz(path, "placement file")
        check_format_version(data, path, "placement file", FILE_FORMAT, ("placement",))
        missing = {"phy2log", "num_experts"} - set(data)
        if missing:
            raise ValueError(f"{path}: not a placement file, missing key(s) {sorted(missing)}")
        warn_unknown_entries(data, "phy2log [R, S] and num_experts", ("phy2log", "num_experts"), path, "placement files")
        num_experts = data["num_experts"]
        if num_experts.ndim or num_experts.dtype.kind not in "iu":
            raise ValueError(f"{path}: 'num_experts' must be an integer scalar, got {num_experts!r}")
        try:
            return cls(data["phy2log"], int(num_experts))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: invalid placement ({exc})") from exc

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ExpertPlacement)
            and self.num_experts == other.num_experts
            and torch.equal(self.phy2log, other.phy2log)
        )

    def __repr__(self) -> str:
        return (
            f"ExpertPlacement(E={self.num_experts}, ranks={self.num_ranks}, slots_per_rank={self.slots_per_rank}, "
            f"max_replicas={self.max_replicas})"
        )


def indivisible_experts(num_experts: int, num_ranks: int, ranks: str = "num_ranks") -> ValueError:
    """The error of a planner that places every expert once on ``num_ranks`` ranks holding the same
    number each, for ``num_experts`` they do not divide (``ranks``: the argument's name), with the
    way out: replicas of hot experts fill the ranks (``plan_eplb(..., num_replicas=)``)."""
    fill = -num_experts % num_ranks
    return ValueError(f"num_experts ({num_experts}) must be divisible by {ranks} ({num_ranks}): this planner places "
                      f"each expert once, the same number on every rank; for {num_ranks} ranks, replicate hot experts "
                      f"into the free slots with moelayers.planning.eplb.plan_eplb(loads, {num_ranks}, num_replicas={fill}) "
                      f"(or a multiple of {num_ranks} more)")


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
