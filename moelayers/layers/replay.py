"""Forced routing (``force_routing``, e.g. routing replayed from a rollout) that activation
checkpointing can recompute.

A checkpointed forward runs again inside the backward, where the forced ids it used are gone (each
``force_routing`` call serves one forward). :class:`ForcedForRecompute` keeps them beside a weak
reference to the forward's input, and the recomputation, which gets that input again (the same
tensor, or a detached view of its storage under ``use_reentrant=True``), finds them by it. An
entry goes with its input, so nothing accumulates over serving steps.
"""

from __future__ import annotations

import weakref

import torch


class ForcedForRecompute:
    """The forced ids of recent forwards, by their input tensor (held weakly)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}
        self._count = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, x: torch.Tensor, forced: torch.Tensor) -> None:
        """Remember that the forward of input ``x`` was routed by ``forced`` (until ``x`` is freed)."""
        self._count += 1
        key, entries = self._count, self._entries
        entries[key] = (weakref.ref(x, lambda _ref, key=key: entries.pop(key, None)), forced, forced._version)

    def find(self, x: torch.Tensor) -> torch.Tensor | None:
        """The forced ids of the forward whose input had ``x``'s storage, shape and strides, or ``None``.

        Raises:
            ValueError: several live forwards had that input with different forced ids (the same
                tensor routed twice): which one is being recomputed cannot be told; or the forced ids
                were modified in place since their forward.
        """
        found = []
        for ref, forced, version in list(self._entries.values()):
            y = ref()
            if (y is not None and y.device == x.device and y.data_ptr() == x.data_ptr() and y.shape == x.shape
                    and y.stride() == x.stride()):
                if forced._version != version:  # a buffer of ids reused for the next forward, say
                    raise ValueError("the forced ids (force_routing) of a forward that activation checkpointing "
                                     "recomputes were modified in place since: pass each forward its own tensor")
                found.append(forced)
        if len(found) > 1 and any(f is not found[0] and not torch.equal(f, found[0]) for f in found[1:]):
            raise ValueError("activation checkpointing recomputes a forward whose input was routed twice with "
                             "different forced ids (force_routing): which of them it recomputes cannot be told; "
                             "give each forward its own input tensor")
        return found[0] if found else None
