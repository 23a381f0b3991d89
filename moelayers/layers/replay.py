"""Forced routing (``force_routing``, e.g. routing replayed from a rollout) that activation
checkpointing can recompute.

A checkpointed forward runs again inside the backward, where the forced ids it used are gone (each
``force_routing`` call serves one forward). Each forward that checkpointing may recompute (grad
enabled, or an input that requires grad, as in a reentrant checkpoint's first pass under
``no_grad``; not capacity mode, and not a forward given ``topk_ids=``, which hands its ids to the
recomputation itself) keeps an entry beside a weak reference to its input: the forced ids (a
copy), or ``None`` where the router routed. Serving and rollout forwards keep none. The
recomputation, which gets that input again (the same tensor, or a detached view of its storage
under ``use_reentrant=True``), finds the entry by the input's storage, shape and strides. Entries
of router-routed forwards made before the layer's first forced forward are provisional: a forced
forward on the same input replaces them. Otherwise an input that such forwards routed in
different ways is ambiguous: its recomputation raises rather than guess. An entry goes with its
input, so nothing accumulates over training steps either.
"""

from __future__ import annotations

import weakref

import torch

Key = tuple[torch.device, int, int, tuple[int, ...], tuple[int, ...]]
AMBIGUOUS = object()  # an input routed in different ways by forwards that are all alive


def _key(x: torch.Tensor) -> Key:
    # the storage itself and the offset into it, not data_ptr(): that is 0 for every empty tensor, so
    # two micro-batches without tokens on a rank would share an entry
    return x.device, x.untyped_storage()._cdata, x.storage_offset(), tuple(x.shape), x.stride()


class ForcedForRecompute:
    """The routing of a layer's recent forwards, by their input tensor (held weakly).

    Attributes:
        active: a forward has forced its routing (set by the layer also when it keeps no entry):
            from then on a recomputation whose input has no entry is refused.
    """

    def __init__(self) -> None:
        # key -> (weak reference to the input, routing, provisional: an unforced forward before the first forced one)
        self._entries: dict[Key, tuple[weakref.ref, object, bool]] = {}
        self.active = False

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, x: torch.Tensor, forced: torch.Tensor | None) -> None:
        """Remember how the forward of input ``x`` was routed (``forced`` ids, or ``None``: by the
        router), until ``x`` is freed.

        Unforced forwards before the layer's first forced one are kept provisionally: one may be
        recomputed after it (several micro-batches' forwards before their backwards, as pipeline
        schedules run them), but a forced forward on the same input replaces the entry rather than
        making it ambiguous (an earlier router forward on a tensor that is trained on with forced
        routing, e.g. a reference forward or a finished step, was fine before and stays so)."""
        provisional = forced is None and not self.active
        self.active = self.active or forced is not None
        key, entries = _key(x), self._entries

        def drop(ref: weakref.ref, key: Key = key) -> None:
            if key in entries and entries[key][0] is ref:  # not a later forward's entry on the same storage
                del entries[key]

        routing = None if forced is None else forced.clone()
        old = entries.get(key)
        if old is not None and old[0]() is not None and not old[2] and not _same_routing(old[1], routing):
            routing = AMBIGUOUS  # (the same storage routed again, otherwise: which forward is recomputed?)
        entries[key] = (weakref.ref(x, drop), routing, provisional)

    def find(self, x: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
        """``(found, forced)``: the routing of the forwards whose input had ``x``'s storage, shape
        and strides (``forced`` ids, or ``None`` where the router routed).

        Raises:
            ValueError: forwards routed that input in different ways.
        """
        entry = self._entries.get(_key(x))
        if entry is None or entry[0]() is None:
            return False, None
        if entry[1] is AMBIGUOUS:
            raise ValueError("activation checkpointing is recomputing a forward whose input this layer routed in "
                             "different ways (force_routing with other ids, or none), e.g. under no_grad first: "
                             "which routing the recomputed forward had cannot be told. Give each forward its own "
                             "input tensor, or run the other forwards under torch.inference_mode()")
        return True, entry[1]


def _same_routing(a: object, b: torch.Tensor | None) -> bool:
    if a is AMBIGUOUS:
        return False
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))
