"""The deferred NaN check (``check_finite='deferred'``), in capacity mode and in one rank's forward.

A capacity-mode forward (the CUDA-graph path) learns what the ranks' exchanged flag words say
(NaN/inf router logits, settings that differ) only by reading them on the host. That is a device
sync per layer, and at decode-sized batches it costs more than the layer's work. A forward on one
expert-parallel rank without a capacity pays the same: reading its flag word is its one host sync.

Deferred, the words are copied to host memory (pinned on an accelerator) behind the forward,
without a sync. They are read when the layer's next forward starts: by then the copy is usually
done, and if not, the read waits for it. That forward raises the error of the one before it, on
every expert-parallel rank alike, before its exchange.

A rank that knows it must raise at once (a refused input, an overflow) still does, and the other
ranks learn it in the same forward (see ``MoELayerBase._defers_check``). Each layer raises only its
own error: after a failed step, the model's other layers may raise errors of the same step at their
next forwards. :func:`check_pending` reads them all at once.
"""

from __future__ import annotations

import torch


class DeferredFlags:
    """One capacity-mode forward's exchanged header ``[R, 4]`` int32 (per rank: its flag word, its
    overflow, its settings digest in two 31-bit halves), or one rank's flag word ``[1, 1]`` (without
    a capacity), on its way to the host."""

    def __init__(self) -> None:
        self._hosts: dict[tuple, torch.Tensor] = {}  # per (shape, dtype): pinned where the header is on an accelerator
        self._host: torch.Tensor | None = None  # the one the pending header is copied into
        self._event: torch.Event | None = None  # recorded behind the copy (None on CPU: the copy is done)
        self._device: torch.device | None = None  # the header's device (the event's and the buffers')
        self.pending = False

    @torch.inference_mode(False)  # a buffer made in a rollout is written outside inference mode later
    def _buffer(self, header: torch.Tensor) -> torch.Tensor:
        """The host buffer for ``header``'s shape and dtype, made on first use. Each shape and dtype
        keeps its own buffer: a layer that alternates capacity-mode and exact forwards on one rank
        records ``[1, 4]`` int32 headers and ``[1, 1]`` bool or int32 words. A new device makes all
        of them anew."""
        if self._device != header.device:  # (a layer moved to another device records its event there)
            self._device, self._hosts = header.device, {}
            self._event = None if header.device.type == "cpu" else torch.Event(device=header.device)
        key = (tuple(header.shape), header.dtype)
        if key not in self._hosts:
            self._hosts[key] = torch.empty(header.shape, dtype=header.dtype, pin_memory=header.device.type != "cpu")
        return self._hosts[key]

    def record(self, header: torch.Tensor) -> None:
        """Start copying ``header`` to the host behind the work queued so far (no sync)."""
        self._host = self._buffer(header)
        self._host.copy_(header, non_blocking=True)
        if self._event is not None:
            self._event.record(torch.accelerator.current_stream(header.device))
        self.pending = True

    def take(self) -> list[list[int]] | None:
        """The recorded header as ``[R][4]`` ints (waits for its copy), or ``None`` when nothing is
        pending; pending no more either way."""
        if not self.pending:
            return None
        self.pending = False
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

    # a copied or pickled layer starts with nothing pending (events and pinned buffers do not copy)
    def __deepcopy__(self, memo: dict) -> "DeferredFlags":
        return DeferredFlags()

    def __reduce__(self):
        return DeferredFlags, ()


def check_pending(module: torch.nn.Module) -> None:
    """Raise what the deferred NaN checks of ``module``'s layers found in their last forwards.

    Layers built with ``check_finite='deferred'`` raise a forward's error at their next forward;
    call this after the last one (the end of a generation, a rollout) so that none goes unread,
    and after catching such an error, so that the model's other layers do not raise the same
    step's at their next forwards. Waits for those forwards (a host sync). Call it on every
    expert-parallel rank, as you call the forward, so that every rank raises alike (it runs no
    collective). A no-op for layers with nothing pending.

    Args:
        module: a model, or a layer; every :class:`~moelayers.layers.base.MoELayerBase` in
            ``module.modules()``, in that order.

    Raises:
        ValueError: the first layer's error, where the last forwards had NaN/inf router logits on
            some rank, another flagged problem, or ranks with different settings (every layer's
            pending flags are read first: none is left to raise later).
    """
    from moelayers.layers.base import MoELayerBase

    first: ValueError | None = None
    for layer in module.modules():
        if isinstance(layer, MoELayerBase):
            try:
                layer.check_pending()
            except ValueError as exc:
                first = first or exc
    if first is not None:
        raise first
