"""The autograd graphs of a layer's forwards that still await their backward.

Such a graph saved the expert weights; moving them in place (``apply_placement``) would break its
backward with a raw autograd error on some ranks while the others wait in the backward's exchange.
Every forward that autograd records hooks a token onto its output's autograd node: the hook marks
the token done when the backward reaches that node, and the token goes with the node when the graph
is dropped without a backward. (A hook, not an identity node around the output: the output stays a
tensor of its own, which the caller may change in place.)

The hooks also keep a digest of the order in which the backwards reached the forwards: every
expert-parallel rank must back-propagate the same forwards in the same order (their exchanges pair
up by order alone), and the next forward compares the digests across the ranks.
"""

from __future__ import annotations

import weakref

import torch

from moelayers.dispatch.flags import ORDER_BITS


class InFlightGraphs:
    """Tokens of the recorded forwards of one layer (weakly held)."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self._prune_at = 16  # length at which watch() drops the finished graphs' references
        self._forwards = 0  # recorded forwards watched so far: a forward's number
        self._order = 0  # digest of the forwards' numbers in the order their backwards ran, since take_order()

    def watch(self, y: torch.Tensor) -> None:
        """Count ``y``'s forward until the backward reaches ``y.grad_fn`` or its graph is freed."""
        token = _GraphToken(self, self._forwards)
        self._forwards += 1
        if len(self._refs) >= self._prune_at:  # training adds one per forward: pruned now and then, O(1) amortised
            self._prune_at = 2 * self.count() + 16
        self._refs.append(weakref.ref(token))
        if y.grad_fn is not None:  # (always, for an output that requires grad)
            y.grad_fn.register_prehook(token.mark_done)  # the node holds the token, the list a weak reference

    def count(self) -> int:
        """Recorded forwards whose graph is alive and whose backward has not reached their output."""
        self._refs = [ref for ref in self._refs if ref() is not None and not ref().done]
        return len(self._refs)

    def clear(self) -> None:
        """Forget every recorded forward (their graphs will never be back-propagated)."""
        self._refs.clear()

    def take_order(self) -> int:
        """The digest (``ORDER_BITS`` bits) of the backwards run since the last call, then reset:
        0 when none ran."""
        order, self._order = self._order, 0
        return order

    def restore_order(self, order: int) -> None:
        """Put back an order :meth:`take_order` returned to a forward that then raised (every rank
        raises alike): the next forward reports those backwards instead. No backward of the layer
        can run inside its forward, so nothing was recorded since."""
        if order and not self._order:
            self._order = order

    def _reached(self, forward: int) -> None:
        self._order = (self._order * 1_000_003 + forward + 1) % (1 << ORDER_BITS)

    def __len__(self) -> int:
        """References held, finished ones included until the next prune."""
        return len(self._refs)


class _GraphToken:
    """Lives as long as the autograd node whose pre-hook it is."""

    __slots__ = ("done", "graphs", "forward", "__weakref__")

    def __init__(self, graphs: InFlightGraphs, forward: int) -> None:
        self.done, self.graphs, self.forward = False, graphs, forward

    def mark_done(self, grad_outputs: tuple) -> None:
        self.done = True
        self.graphs._reached(self.forward)
