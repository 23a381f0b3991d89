"""The flags, digests and header the expert-parallel ranks exchange with every forward (in capacity
mode inside every payload row instead of a header), and the errors every rank raises from them
together.

Before its rows, a forward exchanges one small header per pair of ranks (``HEADER_*`` columns):
split sizes, the sender's routing flag word (error bits such as :data:`NONFINITE_LOGITS` and
:data:`BAD_INPUT`, the autograd bits, the order of its backwards) and the digest of its layer's
settings and payload dtypes (:func:`payload_digest`). :func:`check_exchanged` turns what the ranks
sent into the same error on every rank, so none waits for another forever.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch


#: Bits of the routing flag word (``Routes.nonfinite``: historically named for its first bit).
NONFINITE_LOGITS = 1  # router logits with NaN or inf
FORCED_OUT_OF_RANGE = 2  # forced expert ids outside [0, E)
BAD_INPUT = 4  # the layer refused this rank's input; it takes part in the exchange with no tokens
BAD_REPLICA = 8  # a replica policy picked a slot that does not hold the routed expert
BAD_ROUTE = 16  # a route to a rank or slot outside the expert-parallel group (check_routes)
RECORDS_AUTOGRAD = 32  # not an error: this rank's forward records autograd (its backward runs the reverse exchange)
DISPATCH_AUTOGRAD = 64  # not an error: the dispatched rows want a gradient (the dispatch's backward exchanges too)
REPLICA_AUTOGRAD = 128  # not an error: replicated experts want a gradient (the backward sums them across ranks)
#: Bits ``ORDER_SHIFT`` to ``ORDER_SHIFT + ORDER_BITS`` of the flags: a digest of the order in which
#: this rank back-propagated the layer's forwards since its previous forward (0: none); compared
#: across the ranks (an int32 on the wire in capacity mode: 8 + 22 bits).
ORDER_SHIFT, ORDER_BITS = 8, 22
#: the bits that report an error of the rank that set them (the others are compared across ranks)
ERROR_BITS = NONFINITE_LOGITS | FORCED_OUT_OF_RANGE | BAD_INPUT | BAD_REPLICA | BAD_ROUTE
_AUTOGRAD_BITS = (
    (RECORDS_AUTOGRAD, "record autograd in this forward",
     "torch.no_grad, inference_mode or frozen weights on some ranks only"),
    (DISPATCH_AUTOGRAD, "dispatch rows that want a gradient (their input or router weight requires one)",
     "with the router frozen, an input that requires a gradient on some ranks only, e.g. a plain empty tensor "
     "where a rank has no tokens: make it require one too"),
    (REPLICA_AUTOGRAD, "train replicated experts", "experts frozen on some ranks only"),
)


def merge_flags(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The union of two routing flags (0-dim bool or int device tensors, ``None`` = unset)."""
    if a is None or b is None:
        return b if a is None else a
    return a.to(torch.int32) | b.to(torch.int32)


#: The top 14 of a header digest's 62 bits: what a forward's header holds there. A row without it
#: is no forward's header: its rank is out of step (in a backward's exchange, or another collective on
#: the group, where this one runs a forward).
_HEADER_MARK, _MARK_SHIFT = 0x2A5C, 48


def payload_dtypes(x: torch.Tensor, weights_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype | None]:
    """The dtypes that decide a payload's bytes: tokens ``x``, routing weights, and the dtype
    ``torch.autocast`` has the experts compute ``x`` in where it is on and changes it (``None``
    otherwise). Dispatchers keep them as ``payload`` (named by :func:`settings_differences`)."""
    from moelayers.experts import _autocast_dtype  # (the experts module imports this one)

    return x.dtype, weights_dtype, _autocast_dtype(x)


#: what :func:`payload_dtypes` holds, in its order
PAYLOAD_NAMES = ("dtype of x", "dtype of the routing weights", "autocast dtype")


@functools.lru_cache(maxsize=256)
def payload_digest(digest: int, dtypes: tuple[torch.dtype | None, ...]) -> int:
    """``digest`` (the layer's, :meth:`MoELayerBase._digest`) mixed with the payload's
    :func:`payload_dtypes`: they decide the rows' byte layout, and a rank computing in another dtype
    (its layer cast alone) would read the others' rows wrongly or abort mid-exchange; a rank under
    autocast alone would compute its experts' rows in another precision than the others.
    62 bits: a 48-bit hash under the header's mark (:func:`raise_if_out_of_step`). Cached: the same
    few per layer."""
    h = hashlib.blake2b(repr((digest, *map(str, dtypes))).encode(), digest_size=8)
    return (_HEADER_MARK << _MARK_SHIFT) | (int.from_bytes(h.digest(), "little") >> (64 - _MARK_SHIFT))


def raise_if_out_of_step(digests: list[int]) -> None:
    """Raise ``ValueError`` if a rank's header digest lacks the mark of a forward's header (one per
    expert-parallel rank, in rank order): that rank sent something else in this exchange, e.g. the
    rows of a backward it ran while this rank ran a forward. Checked before the flags, which such
    bytes would fill with meaningless errors."""
    stray = [r for r, d in enumerate(digests) if int(d) >> _MARK_SHIFT != _HEADER_MARK]
    if stray:
        raise ValueError(f"this forward's exchange got no forward header from expert-parallel rank(s) {stray}: "
                         "the ranks are out of step (that rank ran another exchange here, e.g. a backward run on "
                         "some ranks only, or its own collective on the expert-parallel group). They cannot "
                         "recover: restart them, and run every rank's forwards and backwards alike")


#: columns of the ``[R, 4]`` int64 header the ranks exchange before a forward's rows: line ``r`` of the
#: one a rank sends says what it sends to rank ``r`` (rows, (token, expert) pairs, its routing flag
#: word of :data:`BAD_INPUT` and the other bits, its :func:`payload_digest`)
HEADER_ROWS, HEADER_PAIRS, HEADER_FLAGS, HEADER_DIGEST = range(4)


def check_exchanged(flags: list[int], digests: list[int], *, together: bool = False) -> None:
    """Raise on every rank what the ranks' exchanged flag words and digests (one per rank, in rank
    order) say is wrong: a rank out of step (:func:`raise_if_out_of_step`, checked first: its bytes are
    no header), a flagged rank (:func:`raise_if_flagged`), different settings
    (:func:`raise_if_placements_differ`; ``together`` as there). Where the settings differ, only the
    ranks' own errors (:data:`ERROR_BITS`) are read before the settings are named. The order and
    autograd bits of ranks at different settings are not comparable (e.g. two models' layers called
    in different orders). A backward-order error there would be false, and would send the user to a
    checkpoint."""
    raise_if_out_of_step(digests)
    if len(set(digests)) > 1:  # ranks at different settings (or layers): their order and autograd bits
        raise_if_flagged([int(f) & ERROR_BITS for f in flags])  # are not comparable, their own errors are
        raise_if_placements_differ(digests, together=together)
    raise_if_flagged(flags)
    raise_if_placements_differ(digests, together=together)


class SettingsDiffer(ValueError):
    """The expert-parallel ranks serve different placements or layer settings
    (:func:`raise_if_placements_differ`). ``ranks``: the ranks (numbered within the expert-parallel
    group) grouped by their digests. ``together``: every rank of the group raised it in the same
    exchange (the forward's header exchange), so they may run one more collective to name what
    differs (the layer does, :meth:`named`); not so for capacity mode's flags, which some ranks may
    not read."""

    def __init__(self, ranks: list[list[int]], *, together: bool = False, differences: str = ""):
        self.ranks, self.together = ranks, together
        head = ("the expert-parallel ranks serve different placements or layer settings (their ranks within the "
                f"expert-parallel group, grouped by them: {ranks})")
        super().__init__(f"{head}: {differences}" if differences else head + _CAUSES)

    def named(self, differences: str) -> "SettingsDiffer":
        """The same error, saying what differs (:func:`settings_differences`) instead of every cause."""
        return SettingsDiffer(self.ranks, together=self.together, differences=differences)


def raise_if_placements_differ(digests: list[int], *, together: bool = False) -> None:
    """Raise :class:`SettingsDiffer` (a ``ValueError``) on every rank if the expert-parallel ranks
    serve different placements or payload settings (the layer's digest of its placement's
    :meth:`~moelayers.placement.ExpertPlacement.digest` and of its dispatcher, dedup, capacity,
    config, subclass settings and ``layer_number``, and the payload's dtypes, one per rank in rank
    order), e.g. the ranks loaded checkpoints saved at different moments (routing by one table and
    weights laid out by another give wrong outputs silently) or call their layers in different orders.
    ``together``: see :class:`SettingsDiffer`."""
    if len(set(digests)) > 1:
        groups: dict[int, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        raise SettingsDiffer(sorted(groups.values()), together=together)


#: where different digests come from (the message when the ranks cannot compare their settings)
_CAUSES = (": every rank must call its layers in the same order (layers with a layer_number are told apart), "
           "load the same checkpoint moment or apply the same placement, build the layer with the same MoEConfig, "
           "dispatcher, dedup, capacity, check_finite (with a capacity) (and a VariabilityAwareMoE with the same window and re-planning settings), "
           "and compute in the same dtype (a layer cast on some ranks only, torch.autocast on some ranks only, or "
           "the router's logits in another dtype)")

#: what to do when a setting differs, by the start of its name (see settings_differences)
_ADVICE = (
    ("layer_number", "every rank must call its layers in the same order"),
    ("placement", "every rank must load the same checkpoint moment or apply the same placement"),
    ("dtype", "every rank must compute in the same dtype (a layer cast on some ranks only, or "
              "torch.autocast on some ranks only)"),
    ("autocast", "every rank must compute in the same dtype (torch.autocast on every rank or on none)"),
    ("", "every rank must build the layer alike (the same class, MoEConfig, dispatcher and settings)"),
)


def settings_differences(settings: list[dict[str, Any]]) -> str:
    """What differs between the ranks' named settings (one dict per expert-parallel rank, in rank
    order, as the layer gathers them when :class:`SettingsDiffer` is raised together), with what to
    do about it; ``""`` when nothing named differs. A ``placement`` is its ``phy2log`` table as
    nested lists: the first entry that differs is named, not the whole table. Settings only some
    ranks have (those of one layer class, or of the all-to-all dispatcher) are named only when no
    setting every rank has differs: another class or dispatcher is the difference then."""
    names = list(dict.fromkeys(name for s in settings for name in s))
    shared = [name for name in names if all(name in s for s in settings)]
    if any(len({repr(s[name]) for s in settings}) > 1 for name in shared):
        names = shared
    parts, advice = [], []
    for name in names:
        by_value: dict[str, list[int]] = {}
        for r, s in enumerate(settings):
            by_value.setdefault(repr(s[name]) if name in s else "(not set)", []).append(r)
        if len(by_value) == 1:
            continue
        if name == "placement":
            parts.append(_placement_difference([s.get(name) for s in settings]))
        else:
            parts.append(f"{name} is " + ", ".join(f"{_short(v)} on rank(s) {ranks}" for v, ranks in by_value.items()))
        tip = next(tip for start, tip in _ADVICE if name.startswith(start))
        if tip not in advice:
            advice.append(tip)
    if not parts:
        return ""
    return "; ".join(parts) + ". " + "; ".join(a[0].upper() + a[1:] for a in advice)


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _placement_difference(tables: list[Any]) -> str:
    """The first ``phy2log`` entry (rank, slot) whose expert differs between the ranks' tables."""
    shapes = [(len(t), len(t[0]) if t else 0) if isinstance(t, list) else None for t in tables]
    if len(set(shapes)) > 1:
        return "the placement's phy2log shape is " + ", ".join(
            f"{list(s) if s else 'unknown'} on rank {r}" for r, s in enumerate(shapes))
    rows, slots = shapes[0]
    cells = [(i, j) for i in range(rows) for j in range(slots) if len({t[i][j] for t in tables}) > 1]
    i, j = cells[0]
    by_expert: dict[int, list[int]] = {}
    for r, t in enumerate(tables):
        by_expert.setdefault(t[i][j], []).append(r)
    more = f" ({len(cells) - 1} more entries differ)" if len(cells) > 1 else ""
    return (f"the placement differs: phy2log[{i}][{j}] (expert-parallel rank {i}'s slot {j}) is "
            + ", ".join(f"expert {e} on rank(s) {ranks}" for e, ranks in by_expert.items()) + more)


class BackwardOrderError(ValueError):
    """The expert-parallel ranks back-propagated a layer's forwards in different orders (or not the
    same ones) since its previous forward."""


def raise_if_flagged(flags: list[int]) -> None:
    """Raise ``ValueError`` on every rank if any rank's routing flag word (``Routes.nonfinite``, one
    per expert-parallel rank, in rank order) has an error bit set, or one of the autograd bits
    (``RECORDS_AUTOGRAD``, ``DISPATCH_AUTOGRAD``, ``REPLICA_AUTOGRAD``) is set on some ranks and not
    on others; :class:`BackwardOrderError` (a ``ValueError``) if the ranks' orders of backwards
    (bits ``ORDER_SHIFT`` on) differ."""
    refused = [r for r, f in enumerate(flags) if int(f) & BAD_INPUT]
    if refused:
        raise ValueError(f"the layer refused the input of expert-parallel rank(s) {refused} (that rank raised "
                         "the reason); every rank raises this forward so that none waits for the others")
    for bit, what, why in _AUTOGRAD_BITS:
        grad = [r for r, f in enumerate(flags) if int(f) & bit]
        if grad and len(grad) < len(flags):
            raise ValueError(f"expert-parallel rank(s) {grad} {what} and rank(s) "
                             f"{[r for r in range(len(flags)) if r not in grad]} do not ({why}): "
                             "their backward would wait forever in an exchange the others never run. Run every "
                             "rank's forward alike")
    orders = [int(f) >> ORDER_SHIFT for f in flags]
    if len(set(orders)) > 1:
        raise BackwardOrderError(
            "the expert-parallel ranks back-propagated this layer's forwards in different orders (or not the same "
            "ones) since its previous forward: their exchanges pair up by order alone, so where sizes matched, those "
            "gradients mixed micro-batches and are wrong (an optimizer step taken with them is too: resume from a "
            "checkpoint). Every rank must back-propagate each recorded forward once, in the same order. (Or this "
            "exchange paired two different layers: ranks that call the layers of two models over the same group in "
            "different orders, e.g. a policy and its deep copy, whose layer_numbers are alike: then the gradients "
            "are not at fault; call them in one order on every rank, or give the copy's layers other layer_numbers)")
    forced = [r for r, f in enumerate(flags) if int(f) & FORCED_OUT_OF_RANGE]
    if forced:
        raise ValueError(f"forced routing (force_routing) holds expert ids outside [0, num_experts) on "
                         f"expert-parallel rank(s) {forced}: a trace of another model?")
    replica = [r for r, f in enumerate(flags) if int(f) & BAD_REPLICA]
    if replica:
        raise ValueError(f"the replica policy picked physical slots that do not hold the routed expert on "
                         f"expert-parallel rank(s) {replica} (or raised, or returned no [T, K] integer tensor "
                         f"there: that rank's error says which): a policy must return, for every "
                         f"(token, k), one of the slots that placement.log2phy lists for topk_ids[t, k]")
    route = [r for r, f in enumerate(flags) if int(f) & BAD_ROUTE]
    if route:
        raise ValueError(f"the routes of expert-parallel rank(s) {route} hold a dest_rank outside [0, ranks) or a "
                         f"dest_slot outside [0, slots per rank), or, from a plan() override, a slot that does not "
                         f"hold the (token, k)'s expert (or the override raised, or returned no Routes of [T, K] "
                         f"tensors: that rank's error says which). A plan() must send every (token, k) "
                         f"to one of the slots that placement.log2phy lists for topk_ids[t, k] "
                         f"(routes_from_placement builds such routes)")
    bad = [r for r, f in enumerate(flags) if int(f) & NONFINITE_LOGITS]
    if bad:
        raise ValueError(f"router logits contain NaN or inf (on expert-parallel rank(s) {bad}): "
                         "check the input hidden states and router weight")
