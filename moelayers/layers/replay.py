"""Forced routing (``force_routing``, e.g. routing replayed from a rollout) that activation
checkpointing can recompute.

A checkpointed forward runs again inside the backward, where the forced ids it used are gone (each
``force_routing`` call serves one forward). Once a layer has forced its routing, every forward it
runs keeps an entry beside a weak reference to its input: the forced ids (a copy), or ``None``
where the router routed. The recomputation, which gets that input again (the same tensor, or a
detached view of its storage under ``use_reentrant=True``), finds the entry by the input's storage,
shape and strides; the latest forward on an input wins. An entry goes with its input, so nothing
accumulates over serving steps, and forwards under ``torch.inference_mode()`` (never recomputed)
keep none.
"""

from __future__ import annotations

import weakref

import torch

Key = tuple[torch.device, int, tuple[int, ...], tuple[int, ...]]


def _key(x: torch.Tensor) -> Key:
    return x.device, x.data_ptr(), tuple(x.shape), x.stride()


class ForcedForRecompute:
    """The routing of a layer's recent forwards, by their input tensor (held weakly).

    Attributes:
        active: a forward has forced its routing: from then on every forward keeps an entry.
    """

    def __init__(self) -> None:
        self._entries: dict[Key, tuple[weakref.ref, torch.Tensor | None]] = {}
        self.active = False

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, x: torch.Tensor, forced: torch.Tensor | None) -> None:
        """Remember how the forward of input ``x`` was routed (``forced`` ids, or ``None``: by the
        router), until ``x`` is freed. Nothing is kept before the first forced forward."""
        if forced is None and not self.active:
            return
        self.active = True
        key, entries = _key(x), self._entries

        def drop(ref: weakref.ref, key: Key = key) -> None:
            if key in entries and entries[key][0] is ref:  # not a later forward's entry on the same storage
                del entries[key]

        entries[key] = (weakref.ref(x, drop), None if forced is None else forced.clone())

    def find(self, x: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
        """``(found, forced)``: the routing of the latest forward whose input had ``x``'s storage,
        shape and strides (``forced`` ids, or ``None`` where the router routed)."""
        entry = self._entries.get(_key(x))
        if entry is None or entry[0]() is None:
            return False, None
        return True, entry[1]
