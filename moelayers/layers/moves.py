"""Transactional expert-weight moves between ranks (a placement change while serving).

:func:`move_expert_weights` changes a layer's placement in five steps; every rank runs them::

    1 prepare   validate the new placement locally (type, E/R/S, validate()), work out this rank's
                sends/receives from old.moves_to(new), allocate staging for the slots that change
    2 vote      all_reduce MIN of a per-rank ok flag (+ a digest of both placements, so ranks that
                were handed different placements abort too) -- BEFORE any point-to-point traffic
    3 stage     point-to-point exchange (batch_isend_irecv; gloo and NCCL) straight from the live
                slots into staging buffers; same-rank moves are copied into staging as well
    4 vote      the optional fault hook runs on every rank; a second all_reduce MIN of the ok flags
    5 commit    only if every rank is ok: staging -> live slots, emptied slots zeroed, the layer's
                placement set, its dispatcher rebuilt, its CUDA graph dropped; otherwise staging is
                discarded and every rank raises the same error naming the failing ranks (ending
                with that rank's own reason, also its ``__cause__``)

So a placement is either applied on every rank or on none: never a mix. Memory: staging holds only
the slots that change on this rank, at most one layer's expert weights (``S`` slots), and as much
again per optimizer state that moves with them. Sends read the live slots directly (each slot is
a contiguous ``[2F, H]`` / ``[H, F]`` block), without copies (a row of a tensor laid out otherwise
is copied first).
The death of a process is out of scope (a dead peer makes the collectives fail or time out), and
so is a transport that fails on one rank: the point-to-point operations are built while preparing
(a failure there is voted on before any traffic), and a failure after they are posted (a copy, the
fault hook, an error reported by a transfer) is voted on in step 4, but a rank whose
``batch_isend_irecv`` raises before posting leaves its peers waiting for its transfers, like a
dead peer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from moelayers.experts import is_slot_major
from moelayers.groups import collective_device
from moelayers.placement import ExpertPlacement, SlotMove

_NEUTRAL = torch.iinfo(torch.int64).max  # a failing rank's digest entries: no effect under MIN


class PlacementMoveError(RuntimeError):
    """A placement change was aborted on every rank of the expert-parallel group; the old placement
    keeps serving.

    Attributes:
        failing_ranks: expert-parallel ranks that reported a failure (empty when the ranks were
            handed different placements).
        stage: ``'validate'`` (before any transfer), ``'staging'`` (after the exchange) or
            ``'plan'`` (:meth:`VariabilityAwareMoE.replan`: the planner failed on rank 0, before any
            transfer; ``failing_ranks == [0]``).
    """

    def __init__(self, message: str, failing_ranks: list[int], stage: str):
        super().__init__(message)
        self.failing_ranks, self.stage = failing_ranks, stage


class PlacementRejected(PlacementMoveError, ValueError):
    """The new placement was rejected before any transfer (bad input on some rank)."""


@dataclass
class _Plan:
    """This rank's part of a move.

    Attributes:
        slots: ``[n]`` local slots whose expert changes (staging row ``i`` is for ``slots[i]``).
        local: ``(staging row, source slot)`` copies within this rank.
        recv: ``(staging row, source rank, move index)`` receives.
        send: ``(source slot, destination rank, move index)`` sends.
        emptied: local slots that hold an expert now and none in the new placement.
    """

    slots: list[int] = field(default_factory=list)
    local: list[tuple[int, int]] = field(default_factory=list)
    recv: list[tuple[int, int, int]] = field(default_factory=list)
    send: list[tuple[int, int, int]] = field(default_factory=list)
    emptied: list[int] = field(default_factory=list)


@dataclass
class Staging:
    """Received weights waiting for the commit (what the fault hook sees).

    Attributes:
        rank: this expert-parallel rank.
        slots: local slots to overwrite; w13: ``[n, 2F, H]``; w2: ``[n, H, F]`` (row ``i`` for ``slots[i]``).
        states: the optimizer's slot-major states moving with the weights (:func:`optimizer_states`),
            ``[n, ...]`` each, in the same order.
    """

    rank: int
    slots: list[int]
    w13: torch.Tensor
    w2: torch.Tensor
    states: list[torch.Tensor] = field(default_factory=list)

    def rows(self) -> list[torch.Tensor]:
        return [self.w13, self.w2, *self.states]


def optimizer_states(optimizer: Any, w13: torch.Tensor, w2: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The states of ``optimizer`` that hold one row per slot of ``w13`` / ``w2`` (Adam's moments;
    not a step count), named ``'w13.exp_avg'`` and so on, in a fixed order: what a move carries with
    the weights.

    Raises:
        TypeError: ``optimizer`` has no ``state`` mapping (not a torch optimizer), or does not hold
            ``w13`` and ``w2`` among its parameters (unless it holds neither and both are frozen,
            ``requires_grad=False``: then there is no state, and the list is empty).
    """
    if optimizer is None:
        return []
    state = getattr(optimizer, "state", None)
    if not hasattr(state, "get"):
        raise TypeError(f"optimizer must be a torch optimizer (with a state mapping), got {type(optimizer).__name__}")
    held = {id(p) for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())}
    if id(w13) not in held and id(w2) not in held and not (w13.requires_grad or w2.requires_grad):
        return []  # a frozen layer: no optimizer steps it, so there is no state to move
    if id(w13) not in held or id(w2) not in held:  # nothing of its state would move: refused, not ignored
        raise TypeError(f"the optimizer ({type(optimizer).__name__}) does not hold this layer's expert weights "
                        "(experts.w13 and experts.w2 among its param_groups' params), so none of its state would move "
                        "with them; pass the optimizer over the model's own parameters (megatron's optimizers, which "
                        "step fp32 copies, are not supported here)")
    out = []
    for name, p in (("w13", w13), ("w2", w2)):
        for key, value in sorted(state.get(p, {}).items(), key=lambda kv: str(kv[0])):
            if is_slot_major(value, p.shape[0]):
                out.append((f"{name}.{key}", value))
    return out


def shared_states(optimizer: Any, w13: torch.Tensor, w2: torch.Tensor) -> list[tuple[str, Any]]:
    """The optimizer states of ``w13`` / ``w2`` that belong to the whole slot table (Adam's step
    count), as plain values: moments moved between ranks whose steps differ would be
    bias-corrected for the wrong step, so a move compares these across ranks (one host sync per
    tensor)."""
    if optimizer is None:
        return []
    out = []
    for name, p in (("w13", w13), ("w2", w2)):
        for key, value in sorted(optimizer.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
            if is_slot_major(value, p.shape[0]):
                continue
            if torch.is_tensor(value) and value.numel() == 1:
                out.append((f"{name}.{key}", value.item()))
            elif isinstance(value, (int, float)):
                out.append((f"{name}.{key}", value))
    return out


def check_new_placement(old: ExpertPlacement, new: Any) -> None:
    """Raise unless ``new`` can replace ``old``: an :class:`ExpertPlacement` with the same number of
    experts, ranks and slots per rank that passes ``validate()``.

    Raises:
        TypeError: ``new`` is not an ExpertPlacement.
        ValueError: a shape differs or ``new`` is invalid.
    """
    if not isinstance(new, ExpertPlacement):
        raise TypeError(f"the new placement must be an ExpertPlacement, got {type(new).__name__}")
    for what, a, b in (("experts", old.num_experts, new.num_experts), ("ranks", old.num_ranks, new.num_ranks),
                       ("slots per rank", old.slots_per_rank, new.slots_per_rank)):
        if a != b:
            hint = ""
            if what == "slots per rank" and b > a:  # (a layer's slots are its buffers: fixed when it is built)
                hint = (f" (a layer keeps the slots it was built with: for replicas, build it with spare slots, e.g. "
                        f"placement=ExpertPlacement.from_expert_rank(expert_rank, num_ranks={old.num_ranks}, "
                        f"slots_per_rank={b}))")
            elif what == "slots per rank":
                hint = (f" (a layer keeps the slots it was built with: give the new placement {a} slots per rank, "
                        f"the extra ones empty (-1), e.g. ExpertPlacement.from_expert_rank(expert_rank, "
                        f"num_ranks={old.num_ranks}, slots_per_rank={a}))")
            raise ValueError(f"the new placement has {b} {what}, the layer's has {a}{hint}")
    new.validate()


def holds_gradients(*weights: torch.Tensor) -> bool:
    """Whether these weights hold gradients a move would leave behind in their slots: ``.grad`` set
    (a backward since the last ``zero_grad(set_to_none=True)``) or a nonzero ``main_grad``
    (megatron's DDP accumulates there and clears ``.grad``; one host sync to read it)."""
    if any(w.grad is not None for w in weights):
        return True
    return any(getattr(w, "main_grad", None) is not None and bool(w.main_grad.any()) for w in weights)


def check_own_weights(layer: Any, what: str,
                      names: tuple[str, ...] = ("router.weight", "experts.w13", "experts.w2")) -> None:
    """Raise ``TypeError`` when one of ``layer``'s weights ``names`` is not a parameter of its module
    but computed from others (``torch.nn.utils.parametrize``, ``weight_norm``, ``prune``): ``what``
    writes or reads it in place, and a computed tensor is a temporary (a write into it would be lost,
    its ``.grad`` is never set). The forward itself computes with such weights as they are."""
    computed = [n for n in names if n.split(".")[1] not in getattr(layer, n.split(".")[0])._parameters]
    if computed:
        raise TypeError(f"{what} works on the layer's own weights in place, but {', '.join(computed)} "
                        f"{'is' if len(computed) == 1 else 'are'} computed from other parameters "
                        "(torch.nn.utils.parametrize, weight_norm or prune): what it wrote or read would be a "
                        "temporary tensor's. Call it before parametrizing, or remove the parametrization first "
                        "(parametrize.remove_parametrizations, prune.remove)")


def check_can_move(layer: Any, new: Any, optimizer: Any = None) -> list[tuple[str, torch.Tensor]]:
    """This rank's own checks of a move of ``layer`` to ``new`` (no communication): what
    :func:`move_expert_weights` checks before its first vote, for callers that move several layers
    and must know before the first move that every one can (``load_placement_state_dict``).

    Returns:
        The optimizer's slot-major states that would move with the weights (:func:`optimizer_states`).

    Raises:
        TypeError, ValueError: a bad placement or optimizer (see :func:`check_new_placement`,
            :func:`optimizer_states`).
        TypeError: the expert weights are computed (a parametrization: :func:`check_own_weights`).
        RuntimeError: a recorded forward still awaits its backward, or the expert weights hold gradients.
    """
    check_own_weights(layer, "a placement move", ("experts.w13", "experts.w2"))
    w13, w2 = layer.experts.w13, layer.experts.w2
    states = optimizer_states(optimizer, w13, w2)
    check_new_placement(layer.placement, new)
    in_flight = layer.graphs_in_flight()
    if in_flight:  # moving weights in place would break those graphs' backward (a raw autograd error later)
        raise RuntimeError(f"{in_flight} recorded forward(s) still await their backward, which the move would "
                           f"break: run the backward first, or call forget_graphs() on every rank if they never "
                           f"will be back-propagated")
    if holds_gradients(w13, w2):  # they belong to the experts now in those slots
        raise RuntimeError("the expert weights hold gradients (.grad is set: a backward ran since the last "
                           "zero_grad(set_to_none=True), or zero_grad(set_to_none=False) left zeros): a move would "
                           "leave them with the slots, i.e. with other experts; take the optimizer step and "
                           "zero_grad(set_to_none=True) first (megatron's DDP: zero_grad_buffer()), and pass "
                           "optimizer= to move its per-slot state (Adam's moments) with the weights")
    return states


def placement_digest(old: ExpertPlacement, new: ExpertPlacement) -> int:
    """A 56-bit digest of both placements (equal on every rank iff they were handed the same ones),
    from their :meth:`~moelayers.placement.ExpertPlacement.digest`."""
    h = hashlib.blake2b(f"{old.digest()}:{new.digest()}".encode(), digest_size=7)
    return int.from_bytes(h.digest(), "little")


def local_plan(moves: list[SlotMove], old: ExpertPlacement, new: ExpertPlacement, rank: int) -> _Plan:
    """This rank's staging rows, copies, receives and sends for ``moves`` (``old.moves_to(new)``)."""
    plan = _Plan()
    for i, m in enumerate(moves):
        if m.dst_rank == rank:
            row = len(plan.slots)
            plan.slots.append(m.dst_slot)
            if m.src_rank == rank:
                plan.local.append((row, m.src_slot))
            else:
                plan.recv.append((row, m.src_rank, i))
        elif m.src_rank == rank:
            plan.send.append((m.src_slot, m.dst_rank, i))
    plan.emptied = [s for s in range(new.slots_per_rank)
                    if int(new.phy2log[rank, s]) < 0 and int(old.phy2log[rank, s]) >= 0]
    return plan


def _vote(group, size: int, rank: int, ok: bool, digest: int, device: torch.device) -> tuple[list[int], bool]:
    """All-reduce MIN of ``[ok per rank..., digest, -digest]``: ``(failing ranks, digests agree)``."""
    vec = torch.ones(size + 2, dtype=torch.int64)
    vec[rank] = int(ok)
    vec[size], vec[size + 1] = (digest, -digest) if ok else (_NEUTRAL, _NEUTRAL)
    if group is not None:
        vec = vec.to(device)
        dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=group)
        vec = vec.cpu()
    flags = vec[:size].tolist()
    failing = [r for r, f in enumerate(flags) if not f]
    agree = failing != [] or int(vec[size]) == -int(vec[size + 1])
    return failing, agree


def _p2p_ops(plan: _Plan, staging: Staging, live: list[torch.Tensor], group) -> list:
    """The isend/irecv of this rank's moves, ordered by move index on both sides (tags = move
    index times the tensors per slot plus the tensor's place, so gloo and NCCL match the same
    pairs); built while preparing, before the first vote. ``live``: the slot-major tensors in
    ``staging.rows()``'s order."""
    if group is None:
        if plan.recv or plan.send:
            raise RuntimeError("a single-process layer cannot move weights between ranks")
        return []
    ops = []
    events = [(i, "recv", row, peer) for row, peer, i in plan.recv]
    events += [(i, "send", slot, peer) for slot, peer, i in plan.send]
    rows, n = staging.rows(), len(live)
    for i, kind, idx, peer in sorted(events):
        gpeer = dist.get_global_rank(group, peer)
        for j in range(n):
            if kind == "recv":
                ops.append(dist.P2POp(dist.irecv, rows[j][idx], gpeer, group, tag=n * i + j))
            else:  # (a row of a tensor laid out otherwise, e.g. an optimizer state, is sent from a copy)
                ops.append(dist.P2POp(dist.isend, live[j][idx].contiguous(), gpeer, group, tag=n * i + j))
    return ops


def _exchange(plan: _Plan, staging: Staging, ops: list, live: list[torch.Tensor]) -> None:
    """Fill ``staging``: post the point-to-point batch, make the same-rank copies meanwhile, then
    wait for every transfer, even when a copy failed (a peer must not be left waiting on this rank)."""
    reqs = dist.batch_isend_irecv(ops) if ops else []
    try:
        for row, src in plan.local:
            for staged, tensor in zip(staging.rows(), live):
                staged[row].copy_(tensor[src])
    finally:
        for req in reqs:
            req.wait()


def _fail(stage: str, failing: list[int], old: ExpertPlacement, cause: BaseException | None, group=None) -> None:
    """Raise the abort error: the same text on every rank of the group up to its last clause, this
    rank's own reason (also chained as the cause: a log of ``str(exc)`` alone keeps it). The transaction is the
    expert-parallel group's: other groups (expert data parallelism) vote on their own moves."""
    scope = "every rank of the expert-parallel group" if group is not None else "this rank"
    if failing:
        what = "rejected the new placement" if stage == "validate" else "failed while staging the weights"
        world = f" (global rank(s) {[dist.get_global_rank(group, r) for r in failing]})" if group is not None else ""
        mine = f"this rank's reason: {type(cause).__name__}: {cause}" if cause is not None else "this rank had none"
        msg = (f"placement change aborted on {scope}: expert-parallel rank(s) {failing} {what}{world}; the old "
               f"placement ({old!r}) keeps serving and no weights changed; {mine}")
    else:
        msg = (f"placement change aborted on {scope}: the ranks were handed different placements, or optimizers "
               "with different per-slot states or at different steps, or hold the layer in different dtypes (every "
               "rank must pass the same, and cast the layer alike); the old "
               "placement keeps serving")
    cls = PlacementRejected if stage == "validate" else PlacementMoveError
    raise cls(msg, failing, stage) from cause


@torch.no_grad()
def move_expert_weights(layer: Any, new: Any, *, fault_hook: Callable[[Staging], None] | None = None,
                        optimizer: Any = None) -> list[SlotMove]:
    """Change ``layer``'s placement to ``new``, moving expert weights between ranks transactionally.

    Every rank of the layer's expert-parallel group must call this together (with the same ``new``).

    Args:
        layer: a :class:`~moelayers.layers.base.MoELayerBase` (uses ``placement``, ``experts``,
            ``groups`` and ``_adopt_placement``).
        new: the new placement.
        fault_hook: called on this rank with the :class:`Staging` after the exchange; raising
            aborts the move on every rank (used by tests to inject faults).
        optimizer: a torch optimizer over the expert weights whose slot-major states
            (:func:`optimizer_states`) move with them, transactionally too; every rank must hold
            the same states (names, shapes and dtypes; checked in the first vote).

    Returns:
        The slot moves that were carried out (all ranks').

    Raises:
        PlacementRejected: some rank rejected ``new`` (its own reason chained as ``__cause__``), or the
            ranks passed different placements; raised on every rank before any transfer.
        PlacementMoveError: some rank failed after staging; raised on every rank, nothing committed.
    """
    old, groups = layer.placement, layer.groups
    group, size, rank = groups.ep, groups.ep_size, groups.ep_rank
    w13, w2 = layer.experts.w13, layer.experts.w2
    device = collective_device(group)

    # 1 prepare (everything that can fail locally happens before the first vote)
    cause, plan, staging, moves, digest, ops, states = None, None, None, [], 0, [], []
    try:
        states = check_can_move(layer, new, optimizer)
        # the optimizer's states go in the digest: ranks with other states would pair other transfers,
        # and ranks at other steps would mix moments of different ages
        layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in states]
        layout += shared_states(optimizer, w13, w2) if states else []
        # and the weights' dtype: ranks holding the layer in other dtypes would exchange rows of other sizes
        digest = placement_digest(old, new) ^ (_layout_digest(layout) if layout else 0) ^ _dtype_bits(w13.dtype)
        moves = old.moves_to(new)
        plan = local_plan(moves, old, new, rank)
        n = len(plan.slots)
        staging = Staging(rank, plan.slots, w13.new_empty((n,) + tuple(w13.shape[1:])),
                          w2.new_empty((n,) + tuple(w2.shape[1:])),
                          [t.new_empty((n,) + tuple(t.shape[1:])) for _, t in states])
        ops = _p2p_ops(plan, staging, [w13, w2, *(t for _, t in states)], group)
    except Exception as e:  # noqa: BLE001 - reported through the vote, re-raised below as the cause
        cause = e
    # 2 vote before any point-to-point traffic
    failing, agree = _vote(group, size, rank, cause is None, digest, device)
    if failing or not agree:
        _fail("validate", failing, old, cause, group)
    # 3 stage: every rank takes part; 4 fault hook, second vote
    try:
        _exchange(plan, staging, ops, [w13, w2, *(t for _, t in states)])
        if fault_hook is not None:
            fault_hook(staging)
    except Exception as e:  # noqa: BLE001 - reported through the vote (see the module docstring for what is not)
        cause = e
    failing, _ = _vote(group, size, rank, cause is None, digest, device)
    if failing:
        del staging
        _fail("staging", failing, old, cause, group)
    # 5 commit
    live = [w13, w2, *(t for _, t in states)]
    if plan.slots:
        for tensor, staged in zip(live, staging.rows()):
            tensor.index_copy_(0, torch.tensor(plan.slots, dtype=torch.int64, device=tensor.device), staged)
    for s in plan.emptied:
        for tensor in live:
            tensor[s].zero_()
    layer._adopt_placement(new)
    return moves


def _dtype_bits(dtype: torch.dtype) -> int:
    """A part of the move's digest for the weights' dtype (ranks holding the layer in other dtypes
    disagree): 8 bits of its name's hash at bits 54-61 (over the top of the placements' 56; every
    pair of the float dtypes differs at bit 56 or above; below int64's sign)."""
    return int.from_bytes(hashlib.blake2b(str(dtype).encode(), digest_size=1).digest(), "little") << 54


def _layout_digest(layout: list) -> int:
    return int.from_bytes(hashlib.blake2b(repr(layout).encode(), digest_size=7).digest(), "little")
