"""Routing traces: their npz format (below), its I/O, and recording from a running model.

A trace holds, for ``T`` tokens grouped into ``S`` sequences, the ``K`` experts each of ``L`` MoE
layers chose::

    topk_ids      [T, L, K]  integer   expert ids chosen per token, per MoE layer
    token_ids     [T]        int64     token key (vocabulary id)
    seq_offsets   [S+1]      int64     sequence s is tokens seq_offsets[s]:seq_offsets[s+1]
    num_experts   scalar     int       experts per layer
    topk_weights  [T, L, K]  float     router weights (optional)
    vocab_size    scalar     int       token ids lie in [0, vocab_size) (optional; default max id + 1)
    format_version scalar    int       the layout's version, 1 (optional: files without it are of format 1;
                                       a newer one is refused as such, other entries ignored with a warning)

``synthetic_trace`` and ``trace_statistics`` live in :mod:`moelayers.trace_synthetic` and are
re-exported here.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import numbers
import os
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from moelayers._autograd import in_backward
from moelayers.files import atomic_write, check_format_version, read_npz, warn_unknown_entries

__all__ = [
    "RoutingTrace", "TraceRecorder", "load_trace", "save_trace", "synthetic_trace", "trace_statistics",
    "REQUIRED_KEYS", "OPTIONAL_KEYS", "train_sequences",
]

REQUIRED_KEYS = ("topk_ids", "token_ids", "seq_offsets", "num_experts")
OPTIONAL_KEYS = ("topk_weights", "vocab_size")
#: the layout of trace files (:func:`save_trace` writes it as ``format_version``; files without the entry are of format 1)
FILE_FORMAT = 1


def _fail(source: str, field: str, problem: str, exc: type[Exception] = ValueError) -> Exception:
    return exc(f"{source}: field '{field}' {problem}")


def _check_int_scalar(value: Any, source: str, field: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):  # any size: np.asarray(2**70) has dtype object
        number = value
    else:
        arr = np.asarray(value)
        if arr.ndim != 0:
            raise _fail(source, field, f"must be a scalar, got shape {list(arr.shape)}")
        if arr.dtype.kind not in "iu" or isinstance(value, bool):
            raise _fail(source, field, f"must be an integer, got dtype {arr.dtype}", TypeError)
        number = int(arr)
    if number < 1:
        raise _fail(source, field, f"must be >= 1, got {number}")
    if number > np.iinfo(np.int64).max:  # e.g. a uint64 scalar: to_arrays / save_trace store it as int64
        raise _fail(source, field, f"must be <= {np.iinfo(np.int64).max} (stored as int64), got {number}")
    return number


def _check_int_array(arr: np.ndarray, source: str, field: str, ndim: int) -> None:
    if not isinstance(arr, np.ndarray):
        raise _fail(source, field, f"must be a numpy array, got {type(arr).__name__}", TypeError)
    if arr.dtype.kind not in "iu":
        raise _fail(source, field, f"must have an integer dtype, got {arr.dtype}", TypeError)
    if arr.ndim != ndim:
        raise _fail(source, field, f"must have {ndim} dimension(s), got shape {list(arr.shape)}")


def _check_range(arr: np.ndarray, hi: int, source: str, field: str, what: str) -> None:
    if arr.size == 0:
        return
    lo_found, hi_found = int(arr.min()), int(arr.max())
    if lo_found < 0 or hi_found >= hi:
        bad = lo_found if lo_found < 0 else hi_found
        raise _fail(source, field, f"has {what} out of range [0, {hi}): found {bad}")


def _check_distinct(ids: np.ndarray, source: str) -> None:
    """Each token's ``K`` experts at a layer are distinct (top-k routing never repeats one; a repeat
    is a damaged trace, e.g. padding written as expert 0)."""
    if ids.shape[-1] < 2:
        return
    first, count = None, 0
    for start in range(0, ids.shape[0], _CHECK_CHUNK):  # by chunks of tokens: a sorted copy of the whole
        srt = np.sort(ids[start:start + _CHECK_CHUNK], axis=-1)  # trace took 1.5 times its size
        repeated = (srt[..., 1:] == srt[..., :-1]).any(-1)  # [chunk, L]
        if repeated.any():
            count += int(repeated.sum())
            if first is None:
                t, layer = (int(i) for i in np.argwhere(repeated)[0])
                first = (start + t, layer)
    if first is not None:
        t, layer = first
        raise _fail(source, "topk_ids", f"repeats an expert within a token's top-k at {count} (token, "
                                        f"layer) pair(s), first token {t} at layer {layer}: {ids[t, layer].tolist()} "
                                        f"(top-k routing picks K distinct experts)")


_CHECK_CHUNK = 65536  # tokens per chunk of _check_distinct


def train_sequences(train_fraction: float, num_sequences: int) -> int:
    """``floor(train_fraction * num_sequences)``, the training part of :meth:`RoutingTrace.split`, with
    a relative tolerance of 1e-12 for float rounding (``0.29 * 100`` is 28.999999999999996: 29), so
    that a fraction just below a boundary (``0.37499999995 * 8``: 2) is not rounded up.

    Raises:
        ValueError: ``train_fraction`` outside ``[0, 1]`` or ``num_sequences`` negative."""
    if not 0.0 <= train_fraction <= 1.0 or num_sequences < 0:  # (1.5 gave more train sequences than there are)
        raise ValueError(f"train_sequences: need a train_fraction in [0, 1] and num_sequences >= 0, got "
                         f"{train_fraction!r}, {num_sequences!r}")
    return math.floor(train_fraction * num_sequences * (1 + 1e-12))


@dataclass(eq=False)
class RoutingTrace:
    """Routing of ``T`` tokens in ``S`` sequences through ``L`` MoE layers (the npz format: this module's docstring).

    Validated on construction; ``token_ids`` and ``seq_offsets`` are stored as int64, ``topk_ids``
    as int16 (int32 beyond 32,768 experts; a narrower integer type is kept), and ``vocab_size`` is
    resolved to ``max(token_ids) + 1`` when not given.

    Attributes:
        topk_ids: ``[T, L, K]`` integer logical expert ids, in ``[0, num_experts)``.
        token_ids: ``[T]`` int64 vocabulary ids, in ``[0, vocab_size)``.
        seq_offsets: ``[S+1]`` int64; sequence ``s`` is tokens ``seq_offsets[s]:seq_offsets[s+1]``.
        num_experts: experts per layer ``E`` (``K <= E``).
        topk_weights: optional ``[T, L, K]`` finite float router weights.
        vocab_size: optional vocabulary size; ``None`` means ``max(token_ids) + 1``.
        source: init-only; names the trace (e.g. its file) in validation errors.
        format_version: init-only; a saved trace's ``format_version`` entry (checked: one of a newer
            moelayers is refused as such), so that ``RoutingTrace(**np.load(path))`` takes a file.
    """

    topk_ids: np.ndarray
    token_ids: np.ndarray
    seq_offsets: np.ndarray
    num_experts: int
    topk_weights: np.ndarray | None = None
    vocab_size: int | None = None
    source: InitVar[str] = "<memory>"
    format_version: InitVar[Any] = None

    def __post_init__(self, source: str, format_version: Any = None) -> None:
        if format_version is not None:  # RoutingTrace(**np.load(path)) of a saved trace
            check_format_version({"format_version": np.asarray(format_version)}, source, "routing trace", FILE_FORMAT)
        self.validate(source)
        self._source = source  # (not a field: traces compare by content)
        # expert ids in the narrowest of int16/int32 that holds them: int64 ids take 4x the memory, and
        # planning copies them (a 4M-token trace of 26 layers x top-6: 5 GB of ids instead of 1.2 GB)
        compact = np.int16 if int(self.num_experts) <= np.iinfo(np.int16).max + 1 else np.int32
        if self.topk_ids.dtype.itemsize > np.dtype(compact).itemsize or self.topk_ids.dtype == np.uint16:
            self.topk_ids = self.topk_ids.astype(compact)
        self.token_ids = self.token_ids.astype(np.int64, copy=False)
        self.seq_offsets = self.seq_offsets.astype(np.int64, copy=False)
        self.num_experts = int(self.num_experts)
        self.vocab_size = int(self.token_ids.max()) + 1 if self.vocab_size is None else int(self.vocab_size)

    def __eq__(self, other: object) -> bool:
        """Equal contents (the values of every field, whatever the integer widths; ``source`` aside)."""
        if not isinstance(other, RoutingTrace):
            return NotImplemented
        return (int(self.num_experts) == int(other.num_experts) and self.vocab_size == other.vocab_size
                and all(np.array_equal(a, b) for a, b in ((self.topk_ids, other.topk_ids),
                                                          (self.token_ids, other.token_ids),
                                                          (self.seq_offsets, other.seq_offsets)))
                and (self.topk_weights is None) == (other.topk_weights is None)
                and (self.topk_weights is None or np.array_equal(self.topk_weights, other.topk_weights)))

    __hash__ = None  # type: ignore[assignment]  # (mutable arrays)

    def __repr__(self) -> str:
        """Sizes, not arrays (the dataclass's repr printed millions of ids)."""
        source = getattr(self, "_source", "<memory>")
        return (f"RoutingTrace(tokens={self.num_tokens}, sequences={self.num_sequences}, layers={self.num_layers}, "
                f"top_k={self.top_k}, num_experts={self.num_experts}, vocab_size={self.vocab_size}, "
                f"weights={self.topk_weights is not None}{'' if source == '<memory>' else f', source={source!r}'})")

    def validate(self, source: str = "<memory>") -> None:
        """Check every field; raise naming ``source`` and the field.

        Raises:
            TypeError: a field has the wrong type or dtype kind (e.g. float expert ids).
            ValueError: wrong shapes, empty trace, ids out of range, bad ``seq_offsets``,
                non-finite weights.
        """
        num_experts = _check_int_scalar(self.num_experts, source, "num_experts")
        ids = self.topk_ids
        _check_int_array(ids, source, "topk_ids", 3)
        num_tokens, num_layers, top_k = ids.shape
        if num_tokens < 1:
            raise _fail(source, "topk_ids", "has no tokens (T = 0): a trace needs at least one token")
        if num_layers < 1 or top_k < 1:
            raise _fail(source, "topk_ids", f"must have L >= 1 layers and K >= 1 experts, got shape {list(ids.shape)}")
        if top_k > num_experts:
            raise _fail(source, "topk_ids", f"has K = {top_k} experts per token, more than num_experts = {num_experts}")
        _check_range(ids, num_experts, source, "topk_ids", "expert ids")
        _check_distinct(ids, source)
        self._validate_tokens(source, num_tokens)
        self._validate_offsets(source, num_tokens)
        if self.topk_weights is not None:
            w = self.topk_weights
            if not isinstance(w, np.ndarray) or w.dtype.kind != "f":
                kind = w.dtype if isinstance(w, np.ndarray) else type(w).__name__
                raise _fail(source, "topk_weights", f"must be a float numpy array, got {kind}", TypeError)
            if w.shape != ids.shape:
                raise _fail(source, "topk_weights", f"has shape {list(w.shape)}, expected {list(ids.shape)} like topk_ids")
            if not np.isfinite(w).all():
                raise _fail(source, "topk_weights", "has non-finite values")

    def _validate_tokens(self, source: str, num_tokens: int) -> None:
        tok = self.token_ids
        _check_int_array(tok, source, "token_ids", 1)
        if tok.shape[0] != num_tokens:
            raise _fail(source, "token_ids", f"has {tok.shape[0]} tokens, topk_ids has T = {num_tokens}")
        if self.vocab_size is None:
            _check_range(tok, np.iinfo(np.int64).max, source, "token_ids", "token ids")
        else:
            vocab = _check_int_scalar(self.vocab_size, source, "vocab_size")
            _check_range(tok, vocab, source, "token_ids", "token ids (vocab_size)")

    def _validate_offsets(self, source: str, num_tokens: int) -> None:
        off = self.seq_offsets
        _check_int_array(off, source, "seq_offsets", 1)
        if off.shape[0] < 2:
            raise _fail(source, "seq_offsets", f"must have S+1 >= 2 entries, got {off.shape[0]}")
        if off[0] != 0:
            raise _fail(source, "seq_offsets", f"must start at 0, got {int(off[0])}")
        if off[-1] != num_tokens:
            raise _fail(source, "seq_offsets", f"must end at T = {num_tokens}, got {int(off[-1])}")
        decreasing = off[1:] < off[:-1]  # compared in off's own dtype: no cast, no unsigned wrap-around
        if decreasing.any():
            first = int(np.flatnonzero(decreasing)[0])
            raise _fail(source, "seq_offsets", f"must be non-decreasing: entry {first + 1} ({int(off[first + 1])}) < entry {first} ({int(off[first])})")

    # ---- shape -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """``T``."""
        return int(self.topk_ids.shape[0])

    @property
    def num_layers(self) -> int:
        """``L``."""
        return int(self.topk_ids.shape[1])

    @property
    def top_k(self) -> int:
        """``K``."""
        return int(self.topk_ids.shape[2])

    @property
    def num_sequences(self) -> int:
        """``S``."""
        return int(self.seq_offsets.shape[0] - 1)

    @property
    def seq_lengths(self) -> np.ndarray:
        """``[S]`` int64 tokens per sequence."""
        return np.diff(self.seq_offsets)

    def sequence_digests(self) -> np.ndarray:
        """``[S]`` uint64: a content digest of each sequence (its token ids and routing, BLAKE2b),
        equal for equal sequences in any trace (whatever its expert-id dtype). What a plan records
        of the sequences it was trained on, to tell in-sample sequences of another split or file."""
        ids = self.token_ids.astype("<i8", copy=False)
        out = np.empty(self.num_sequences, dtype=np.uint64)
        for s, (a, b) in enumerate(zip(self.seq_offsets[:-1].tolist(), self.seq_offsets[1:].tolist())):
            h = hashlib.blake2b(ids[a:b].tobytes(), digest_size=8)
            h.update(self.topk_ids[a:b].astype("<i4").tobytes())  # (per sequence: no int32 copy of the whole trace)
            out[s] = int.from_bytes(h.digest(), "little")
        return out

    # ---- selection ---------------------------------------------------------------------------
    def sequence_slice(self, s: int) -> slice:
        """Token slice of sequence ``s`` (negative ``s`` counts from the end)."""
        num = self.num_sequences
        if not -num <= s < num:
            raise IndexError(f"sequence {s} out of range for a trace of {num} sequences")
        s = s % num
        return slice(int(self.seq_offsets[s]), int(self.seq_offsets[s + 1]))

    def sequence(self, s: int) -> RoutingTrace:
        """Sequence ``s`` as a one-sequence trace (same ``num_experts`` and ``vocab_size``)."""
        self.sequence_slice(s)  # range check
        return self.select_sequences([s % self.num_sequences])

    def select_sequences(self, idx: Sequence[int] | np.ndarray) -> RoutingTrace:
        """A trace of the sequences ``idx``, in that order (repeats allowed).

        Args:
            idx: ``[S']`` sequence indices in ``[0, S)``.

        Returns:
            RoutingTrace with ``S'`` sequences; ``num_experts`` and ``vocab_size`` are kept.
        """
        idx = np.asarray(idx)
        if idx.ndim != 1 or idx.size == 0:
            raise ValueError(f"select_sequences needs a non-empty 1-D list of indices, got shape {list(idx.shape)}")
        if idx.dtype.kind not in "iu":
            raise TypeError(f"select_sequences needs integer indices, got dtype {idx.dtype}")
        if idx.min() < 0 or idx.max() >= self.num_sequences:
            raise IndexError(f"sequence index out of range [0, {self.num_sequences}): found {int(idx.min() if idx.min() < 0 else idx.max())}")
        starts, lengths = self.seq_offsets[idx], self.seq_lengths[idx]
        new_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        if new_offsets[-1] == 0:
            raise ValueError("select_sequences selected only empty sequences: the result would have no tokens")
        # token index = start of its sequence + position within it
        rows = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
        return RoutingTrace._of_valid_parts(
            topk_ids=self.topk_ids[rows],
            token_ids=self.token_ids[rows],
            seq_offsets=new_offsets,
            num_experts=self.num_experts,
            topk_weights=None if self.topk_weights is None else self.topk_weights[rows],
            vocab_size=self.vocab_size,
        )

    @classmethod
    def _of_valid_parts(cls, **fields) -> RoutingTrace:
        """A trace of whole sequences of a validated one: valid by construction, so not checked again
        (a pass of the checks takes seconds on a 3M-token trace, and ``split`` would make two)."""
        trace = object.__new__(cls)
        for name, value in fields.items():
            setattr(trace, name, value)
        return trace

    def _name(self) -> str:
        """The file this trace was loaded from (``<memory>`` for one built here or cut from another)."""
        return getattr(self, "_source", "<memory>")

    def split(self, train_fraction: float) -> tuple[RoutingTrace, RoutingTrace]:
        """Split by sequence: the first ``floor(train_fraction * S)`` sequences, and the rest (their
        token arrays are views of this trace's: change neither in place).

        Raises:
            ValueError: the fraction is not in (0, 1) or either part would have no sequences.
        """
        if not 0.0 < train_fraction < 1.0:
            raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
        num = self.num_sequences
        n_train = train_sequences(train_fraction, num)
        if n_train == 0 or n_train == num:
            need = ("at least two sequences" if num < 2 else
                    f"a train_fraction of at least 1/{num} for its {num} sequences (the train part is "
                    f"floor(train_fraction x {num}) of them)")
            raise ValueError(f"{self._name()}: split({train_fraction}) of {num} sequences leaves an empty part ({n_train} "
                             f"train, {num - n_train} held out): the split is by sequence (seq_offsets), so it needs "
                             f"{need}")
        cut = int(self.seq_offsets[n_train])
        if cut == 0 or cut == self.num_tokens:
            part = "train" if cut == 0 else "held-out"
            raise ValueError(f"{self._name()}: split({train_fraction}): the {part} sequences ({n_train if cut == 0 else num - n_train}) "
                             f"hold no tokens (all of length 0); choose another train_fraction")
        return self._sequences_view(0, n_train), self._sequences_view(n_train, num)

    def _sequences_view(self, lo: int, hi: int) -> RoutingTrace:
        """Sequences ``lo:hi`` as a trace whose token arrays are views of this one's (no copy: a
        planner's split of a large trace held it twice, a memory journey)."""
        a, b = int(self.seq_offsets[lo]), int(self.seq_offsets[hi])
        return RoutingTrace._of_valid_parts(
            topk_ids=self.topk_ids[a:b],
            token_ids=self.token_ids[a:b],
            seq_offsets=self.seq_offsets[lo:hi + 1] - a,
            num_experts=self.num_experts,
            topk_weights=None if self.topk_weights is None else self.topk_weights[a:b],
            vocab_size=self.vocab_size,
        )

    # ---- aggregates --------------------------------------------------------------------------
    def expert_counts(self) -> np.ndarray:
        """``[L, E]`` int64: how many (token, k) assignments each expert got, per layer."""
        return np.stack([
            np.bincount(self.topk_ids[:, layer, :].ravel().astype(np.int64, copy=False), minlength=self.num_experts)
            for layer in range(self.num_layers)
        ]).astype(np.int64)

    def steps(self, tokens_per_step: int) -> list[slice]:
        """Consecutive token slices of ``tokens_per_step`` in file order (the last may be shorter)."""
        if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, (int, np.integer)) or tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be a positive int, got {tokens_per_step!r}")
        n, t = int(tokens_per_step), self.num_tokens
        return [slice(i, min(i + n, t)) for i in range(0, t, n)]

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The npz payload: a dict of arrays keyed as in this module's docstring."""
        out = {
            "topk_ids": self.topk_ids,
            "token_ids": self.token_ids,
            "seq_offsets": self.seq_offsets,
            "num_experts": np.asarray(self.num_experts, dtype=np.int64),
            "vocab_size": np.asarray(self.vocab_size, dtype=np.int64),
        }
        if self.topk_weights is not None:
            out["topk_weights"] = self.topk_weights
        return out


# ---- files -----------------------------------------------------------------------------------
def load_trace(path: str | os.PathLike) -> RoutingTrace:
    """Read a trace npz (``numpy.load(path, allow_pickle=False)``) and validate it.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not an npz file, missing required keys or a key that looks like a misspelt
            one of them, or invalid contents; the message names ``path`` (and the field). Other
            unknown keys (a recorder's metadata) are ignored with a warning.
        TypeError: a field has the wrong dtype kind.
    """
    path = Path(path)
    arrays = read_npz(path, "routing trace file")
    check_format_version(arrays, path, "routing trace file", FILE_FORMAT, ("trace",))
    arrays.pop("format_version", None)
    keys = set(arrays)
    missing = [k for k in REQUIRED_KEYS if k not in keys]
    unknown = sorted(keys - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    # a key that looks like one of ours that the file lacks is a typo that would drop that field: refused;
    # others (a recorder's metadata: model name, layer ids) are ignored with a warning (on rank 0)
    absent = [k for k in REQUIRED_KEYS + OPTIONAL_KEYS if k not in keys]  # a typo can only stand for one of these
    typos = {k: close for k in unknown if (close := difflib.get_close_matches(k, absent, n=1, cutoff=0.75))}
    if missing or typos:
        hint = "".join(f"; '{k}': did you mean '{close[0]}'?" for k, close in typos.items())
        raise ValueError(f"{path}: missing key(s) {missing}, unknown key(s) {sorted(typos)}{hint}; expected "
                         f"{list(REQUIRED_KEYS)} and optionally {list(OPTIONAL_KEYS)}")
    warn_unknown_entries(arrays, f"{list(REQUIRED_KEYS)} and optionally {list(OPTIONAL_KEYS)}",
                         REQUIRED_KEYS + OPTIONAL_KEYS, path, "routing traces")
    return RoutingTrace(**{k: v for k, v in arrays.items() if k not in unknown}, source=str(path))


def save_trace(trace: RoutingTrace, path: str | os.PathLike, *, compress: bool = False) -> None:
    """Validate ``trace`` and write it to ``path`` atomically.

    The npz is written to a temporary file in the same directory and moved into place with
    ``os.replace``; on any failure the temporary file is removed and ``path`` is untouched. The
    file is written exactly at ``path`` (no ``.npz`` suffix is added).

    Args:
        trace: the trace to write.
        path: destination file; its directory must exist.
        compress: zlib-compress the arrays (``numpy.savez_compressed``).
    """
    path = Path(path)
    trace.validate(source=str(path))
    arrays = {**trace.to_arrays(), "format_version": np.asarray(FILE_FORMAT, dtype=np.int64)}
    atomic_write(path, lambda f: (np.savez_compressed if compress else np.savez)(f, **arrays))


# ---- recording -------------------------------------------------------------------------------
#: the recorder joins the arrays of this many forwards into one, so that a decode step of a few
#: tokens costs its tokens' bytes and not three small arrays' overhead (about 0.7 KB) each
_JOIN_FORWARDS = 256


def _batch_of(module: nn.Module, x: Any) -> np.ndarray | tuple[int, int] | None:
    """What tells the sequences of a model input (see :class:`TraceRecorder`): integer ``[B, S]``
    token ids (a CPU copy), or ``(S, B)`` for the ``[S, B, H]`` input of a MoE layer recorded as the
    model itself (it flattens them sequence position first); else ``None``."""
    if not isinstance(x, torch.Tensor):
        return None
    if x.ndim == 2 and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool:
        return x.detach().to("cpu", torch.int64).numpy()
    if x.ndim == 3 and x.is_floating_point() and getattr(module, "moe_layer_marker", False) is True:
        return int(x.shape[0]), int(x.shape[1])
    return None


def _continues_cache(kwargs: dict) -> bool:
    """Whether a model forward's keyword arguments say it continues cached sequences (a Hugging
    Face-style decode step): a ``cache_position`` starting after 0, or a ``past_key_values`` (or,
    as transformers 5 passes it, ``cache``) holding tokens already."""
    position = kwargs.get("cache_position")
    if isinstance(position, torch.Tensor) and position.numel():
        return int(position.reshape(-1)[0]) > 0
    cache = kwargs.get("past_key_values")
    cache = kwargs.get("cache") if cache is None else cache  # (transformers 5's generate passes cache=)
    if cache is None:
        return False
    try:
        length = getattr(cache, "get_seq_length", None)
        if callable(length):
            return bool(length() > 0)
        # the legacy format: per layer a (key [B, heads, S, D], value) pair
        first = cache[0] if isinstance(cache, (list, tuple)) and cache else None
        key = first[0] if isinstance(first, (list, tuple)) and first else None
        return isinstance(key, torch.Tensor) and key.dim() >= 2 and key.shape[-2] > 0
    except Exception:  # a cache of another kind (a list of None: nothing cached yet): not a decode step
        return False


def _rows_of_batch(batch: np.ndarray | tuple[int, int] | None, token_ids: np.ndarray,
                   rows: np.ndarray | None) -> np.ndarray | None:
    """``rows`` (the layers' ``last_input_rows``: which of the ``B * S`` positions of an ``[B, S]``
    batch they computed, padding left out) where the batch's ids there are ``token_ids``, else ``None``."""
    if rows is None or not isinstance(batch, np.ndarray) or rows.shape != token_ids.shape:
        return None
    flat = batch.reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= flat.size):
        return None
    return rows if np.array_equal(flat[rows], token_ids) else None


def _real_tokens(batch: np.ndarray | tuple[int, int] | None, mask: torch.Tensor | None, token_ids: np.ndarray,
                 pad_token_id: np.ndarray | None, rows: np.ndarray | None = None) -> np.ndarray | None:
    """``[T]`` bool, the tokens that are not padding, or ``None`` (all are): where ``mask`` (an
    ``attention_mask [B, S_total]``, its last ``S`` columns this forward's) is 0 for ``[B, S]`` ids the
    layers saw row by row (all, or the ``rows`` of :func:`_rows_of_batch`) or column by column, and
    where the id is one of ``pad_token_id``."""
    t = token_ids.shape[0]
    keep = np.ones(t, dtype=bool)
    if mask is not None and isinstance(batch, np.ndarray) and mask.shape[0] == batch.shape[0] \
            and mask.shape[1] >= batch.shape[1]:
        m = mask[:, mask.shape[1] - batch.shape[1]:].numpy() != 0
        if rows is not None:
            keep &= m.reshape(-1)[rows]
        elif batch.size != t:
            pass
        elif np.array_equal(batch.reshape(-1), token_ids):
            keep &= m.reshape(-1)
        elif np.array_equal(batch.T.reshape(-1), token_ids):
            keep &= m.T.reshape(-1)
    if pad_token_id is not None:
        keep &= ~np.isin(token_ids, pad_token_id)
    return None if keep.all() else keep


def _untagged_sequences(batch: np.ndarray | tuple[int, int] | None, token_ids: np.ndarray,
                        rows: np.ndarray | None = None) -> np.ndarray:
    """``[T]`` the sequence (0, 1, ...) of each token of an untagged forward: the rows of ``[B, S]``
    ids when the layers saw them row by row (all, or the ``rows`` of :func:`_rows_of_batch`), their
    columns when column by column (a model that runs sequence position first), a MoE layer's
    ``[S, B, H]`` input by column; else all one."""
    t = token_ids.shape[0]
    if rows is not None:
        return rows // batch.shape[1]
    if isinstance(batch, tuple) and batch[0] * batch[1] == t:
        return np.arange(t) % batch[1]
    if isinstance(batch, np.ndarray) and batch.size == t and batch.shape[0] > 1:
        b, s = batch.shape
        if np.array_equal(batch.reshape(-1), token_ids):
            return np.arange(t) // s
        if np.array_equal(batch.T.reshape(-1), token_ids):
            return np.arange(t) % b
    return np.zeros(t, dtype=np.int64)


def _shared_layer_paths(model: nn.Module) -> list[str]:
    """The paths under which the first MoE module reachable more than once in ``model`` is registered
    (``[]`` when each MoE module has one path)."""
    paths: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if getattr(module, "moe_layer_marker", False) is True:
            paths.setdefault(id(module), []).append(name or "<model>")
    return next((p for p in paths.values() if len(p) > 1), [])


def _narrow(ids: np.ndarray) -> np.ndarray:
    """``ids`` in the narrowest of int16 / int32 / int64 that holds its values exactly (a recording keeps
    every token's ``[L, K]`` expert ids until the trace is built: int16 takes a quarter of int64's memory)."""
    if ids.size == 0:
        return ids.astype(np.int16)
    lo, hi = int(ids.min()), int(ids.max())
    for dtype in (np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return ids.astype(dtype)
    return ids


class TraceRecorder:
    """Record routing from a running model as a :class:`RoutingTrace`.

    MoE layers are the modules of ``model.modules()`` with ``moe_layer_marker = True``, in that
    order (= layer order). After each of their forwards the recorder copies ``last_topk_ids``
    (``[T, K]``, kept as int16 where the ids fit) and ``last_token_ids`` (``[T]`` int64) to CPU, and
    keeps sequence keys as int64 codes: about ``2 L K + 16`` bytes a token until the trace is built
    (the forwards' arrays are joined every 256 forwards, so decode steps of one token cost the same). A
    *model forward* is one run of all MoE layers in order; every layer must see the same ``T``.

    Incomplete forwards: a model forward that *raises* part-way (some MoE layers recorded, later
    ones not, the exception caught by the caller) is dropped with its tag; at the end of the
    with-block a ``RuntimeWarning`` says how many forwards were dropped. A model forward that
    *returns* without running every MoE layer (a skipped or conditional layer) cannot be stored in
    a ``[T, L, K]`` trace: rather than losing its tokens silently, ``model(...)`` raises
    ``RuntimeError`` naming the layers that did not run (that forward is dropped; recording can go
    on). Both are detected by hooks on ``model`` itself, so call ``model``, not a submodule; a
    decoding step that runs the layers without ``model.forward`` (``TinyDecoder.step``) and raised
    part-way is dropped when the next forward or ``tag()`` comes. Forwards that autograd re-runs
    during a backward (activation checkpointing) are not recorded again.
    Attention-TP layers (``SemanticMoE(mode='tp')``, run through ``forward_tp``) are refused: each
    rank routes a shuffled chunk of the tokens; record the model with ``mode='dp'`` layers instead.
    So is one MoE module used as several layers (one instance under two names): its uses in a
    forward could not be told apart.

    Sequences: ``tag(seq_ids)`` before a forward gives each of its ``T`` tokens a sequence key
    (any hashable). An untagged forward is new sequences, read from the model's first positional
    argument or its ``input_ids=`` keyword: integer ``[B, S]`` token ids (``TinyDecoder(input_ids)``,
    a Hugging Face-style model) are ``B`` sequences, one per row, when the MoE layers saw the ids row
    by row (or some of them: the rows their ``last_input_rows`` name, where
    ``swap_moe_blocks(skip_padding=True)`` left padding out) (one per column when they saw them column by column, as in a model that runs sequence
    position first); a MoE layer recorded as the model itself takes ``[S, B, H]`` input as ``B``
    sequences, one per column; anything else (``[T, H]``, other keyword inputs, ids the layers saw
    in another order, ``TinyDecoder.step``) is one sequence (a forward of no tokens: none). An
    untagged forward given a cache of earlier tokens (a ``cache_position`` starting after 0, or a
    ``past_key_values`` / ``cache`` holding tokens: the decode steps of Hugging Face's ``generate``) continues
    the sequences of the forward just before it, row by row, when that forward was untagged and had
    as many rows (else its rows are new sequences). Padding is left out of the trace (counted in
    ``padding_dropped``): positions an ``attention_mask=`` keyword of the model call marks 0 (left
    or right padding of ``[B, S]`` ids; those ``swap_moe_blocks(skip_padding=True)`` kept from the
    layers count too), and tokens equal to ``pad_token_id`` (Hugging Face's
    ``generate`` feeds the pad token to rows that have finished, with a mask of 1: pass
    ``model.generation_config.pad_token_id``, or its EOS token where it has none, as ``generate``
    does; where the pad token is the EOS token, the EOS tokens go too); a sequence left with no
    token is no sequence. Beam search and ``num_return_sequences`` repeat and reorder rows: tag
    such forwards. Tokens of a sequence keep the order they were seen in; sequences are ordered
    by first appearance.

    Example::

        with TraceRecorder(model) as rec:
            for batch in batches:
                rec.tag(batch.request_ids)      # [T] one key per token
                model(batch.input_ids)
        trace = rec.result

    Args:
        model: module containing the MoE layers (or a MoE layer itself).
        vocab_size: stored in the trace; default ``model.config.vocab_size`` where the model has one
            (a Hugging Face model, ``TinyDecoder``), else ``max(token_ids) + 1`` (a plan of such a
            trace refuses ids above the ones recorded).
        num_experts: experts per layer; default the layers' ``config.num_experts``.
        pad_token_id: a token id (or a list of them) left out of the trace as padding (see above).

    Raises:
        TypeError: ``vocab_size``, ``num_experts`` or ``pad_token_id`` is given but is not an integer
            (``pad_token_id``: or a list of them).
        ValueError: ``vocab_size`` or ``num_experts`` is given but is not in ``[1, 2**63)``, or a
            ``pad_token_id`` is negative.
    """

    def __init__(self, model: nn.Module, vocab_size: int | None = None, *, num_experts: int | None = None,
                 pad_token_id: int | Sequence[int] | None = None) -> None:
        # checked now, not when the trace is built after (maybe hours of) recording
        if vocab_size is None:  # the model's own (a Hugging Face config, TinyConfig): max id + 1 left its
            config = getattr(model, "config", None)  # last ids out of the plans
            text = getattr(config, "get_text_config", None)  # (a multimodal HF config: its text model's)
            own = getattr(config, "vocab_size", None)
            if own is None and callable(text):
                own = getattr(text(), "vocab_size", None)
            vocab_size = own if isinstance(own, int) and not isinstance(own, bool) and own > 0 else None
        if vocab_size is not None:
            vocab_size = _check_int_scalar(vocab_size, "TraceRecorder", "vocab_size")
        if num_experts is not None:
            num_experts = _check_int_scalar(num_experts, "TraceRecorder", "num_experts")
        if isinstance(pad_token_id, (np.ndarray, torch.Tensor)):
            pad_token_id = pad_token_id.tolist()
        pads = [] if pad_token_id is None else list(pad_token_id) if isinstance(pad_token_id, (list, tuple)) \
            else [pad_token_id]
        for pad in pads:
            if isinstance(pad, bool) or not isinstance(pad, numbers.Integral) or pad < 0:
                raise (ValueError if isinstance(pad, numbers.Integral) and not isinstance(pad, bool) else TypeError)(
                    f"TraceRecorder: pad_token_id must be a token id (an int >= 0) or a list of them, got "
                    f"{pad_token_id!r}")
        pad_token_id = np.asarray([int(p) for p in pads], dtype=np.int64) if pads else None
        self.model, self.vocab_size, self.num_experts = model, vocab_size, num_experts
        self.pad_token_id = pad_token_id
        #: tokens left out as padding (``attention_mask`` 0, or ``pad_token_id``)
        self.padding_dropped = 0
        self._mask: torch.Tensor | None = None  # the forward's attention_mask [B, S_total]
        self.layers: list[nn.Module] = []
        self._names: list[str] = []
        self._handles: list[Any] = []
        self._active = False
        self._finished = False
        self._result: RoutingTrace | None = None
        self._pending_tag: list[Hashable] | None = None
        self._continues = False  # this forward continues the last one's sequences (a cache passed: a decode step)
        self._rows: np.ndarray | None = None  # the last untagged forward's sequence codes, row by row
        self._in_forward = False  # a model forward started and has not recorded all its MoE layers yet
        self._batch: Any = None  # what tells the model input's sequences, for an untagged forward
        self._dropped = 0  # forwards dropped after some (not all) of their MoE layers were recorded
        self._current: list[tuple[np.ndarray, np.ndarray | None]] = []
        # complete forwards in recording order, the last _unjoined one by one and the earlier ones joined
        # (_JOIN_FORWARDS at a time): expert ids [T, L, K] (narrowed, see _narrow), token ids [T], sequence codes [T]
        self._forwards: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._unjoined = 0
        self._num_forwards = 0  # complete forwards recorded
        # sequence codes in order of first appearance: a tagged key's in _codes; an untagged forward's
        # sequences take fresh codes (never equal to a key's)
        self._codes: dict[Hashable, int] = {}
        self._next_code = 0

    def __enter__(self) -> TraceRecorder:
        if self._active or self._finished:
            raise RuntimeError("a TraceRecorder records once: create a new one")
        named = [(n, m) for n, m in self.model.named_modules() if getattr(m, "moe_layer_marker", False) is True]
        if not named:
            raise ValueError(f"no MoE layers (modules with moe_layer_marker = True) found in {type(self.model).__name__}")
        shared = _shared_layer_paths(self.model)
        if shared:  # its hook would fire once per use: the second use would look like a new forward
            raise ValueError(f"TraceRecorder needs one MoE module per layer; one module is registered as "
                             f"{' and '.join(map(repr, shared))}: as layers sharing it, its second run in a forward "
                             "would be recorded as a new sequence. Give each layer its own module (the weights "
                             "may be copies); an alias of a layer belongs outside the module tree (a plain list)")
        tp = [n for n, m in named if getattr(m, "mode", None) == "tp"]
        if tp:  # forward_tp runs each rank's shuffled chunk: no forward hook sees the layer's tokens in order
            raise ValueError(f"TraceRecorder cannot record attention-TP layers ({tp[0]!r}: SemanticMoE mode='tp', "
                             "run through forward_tp); record the same model with attention-DP layers "
                             "(mode='dp'): the same weights and inputs route the same (up to rounding)")
        self._names, self.layers = [n for n, _ in named], [m for _, m in named]
        try:
            self._handles.append(self.model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True))
            for index, layer in enumerate(self.layers):
                self._handles.append(layer.register_forward_hook(self._make_hook(index)))
            # after the layer hooks: when the model is itself a MoE layer, its forward hooks run in
            # registration order, and the layer must be recorded (with the pending tag) before the
            # model-return hook checks the forward and clears the tag
            self._handles.append(self.model.register_forward_hook(self._on_model_return))
        except BaseException:
            self._remove_hooks()
            raise
        self._active = True
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._remove_hooks()
        self._active, self._finished = False, True
        if self._in_forward or self._current:  # the last model forward raised part-way
            self._drop_broken_forward()
        if self._dropped and exc_info[0] is None:  # leaving on an exception: that says enough
            warnings.warn(
                f"TraceRecorder: dropped {self._dropped} incomplete model forward(s) (not all {len(self.layers)} "
                f"MoE layers ran); the trace holds the {self._num_forwards} complete one(s)",
                RuntimeWarning, stacklevel=2,
            )

    def __deepcopy__(self, memo: dict) -> "TraceRecorder":
        """Itself: a deep copy of the recorded model copies the recorder's hooks (bound methods) with
        it, and they must reach this recorder, which ignores the copy, not a copy of it recording on."""
        return self

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def tag(self, seq_ids: Sequence[Hashable] | torch.Tensor | np.ndarray) -> None:
        """Give each token of the next model forward a sequence key.

        Args:
            seq_ids: ``[T]`` one hashable key per token (list, 1-D tensor or 1-D array): per token the
                layers compute, so without the padding ``swap_moe_blocks(skip_padding=True)`` leaves out.

        A model forward that raised part-way is dropped here (not recorded). Call it before the
        model forward, not from inside it: the recorder cannot tell a forward still running from
        one that raised, so a call between its MoE layers drops the part already recorded, and the
        next MoE layer then raises as out of order.

        Raises:
            RuntimeError: outside the with-block, or twice without a forward.
            ValueError: ``seq_ids`` is a tensor or array that is not 1-D.
            TypeError: a key of ``seq_ids`` is not hashable.
        """
        if not self._active:
            raise RuntimeError("tag() is only valid inside the TraceRecorder's with-block")
        if self._in_forward or self._current:  # the last forward raised part-way: it is not recorded
            self._drop_broken_forward()
        if self._pending_tag is not None:
            raise RuntimeError("tag() called twice without a model forward in between")
        if isinstance(seq_ids, (torch.Tensor, np.ndarray)):
            if seq_ids.ndim != 1:
                raise ValueError(f"tag() needs a 1-D tensor of sequence keys, got shape {list(seq_ids.shape)}")
            seq_ids = seq_ids.tolist()
        keys = list(seq_ids)
        for position, key in enumerate(keys):  # refused now, not when the trace is built after recording
            try:
                hash(key)
            except TypeError:
                raise TypeError(f"tag(): seq_ids[{position}] = {key!r} is not hashable ({type(key).__name__}); "
                                "each token's sequence key must be hashable (e.g. an int, str or tuple)") from None
        self._pending_tag = keys

    def _on_model_forward(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        # a deep copy of the model carries these hooks (and the layers' closures): not ours to record;
        # activation checkpointing re-runs the forward: recorded once already
        if not self._active or module is not self.model or in_backward():
            return
        if self._in_forward:  # the last model forward raised part-way (and nothing was tagged since)
            self._drop_broken_forward()
        self._in_forward = True
        self._batch = _batch_of(module, args[0] if args else kwargs.get("input_ids"))
        self._continues = _continues_cache(kwargs)
        mask = kwargs.get("attention_mask")
        self._mask = mask.detach().to("cpu") if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _on_model_return(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._active or module is not self.model or in_backward():
            return
        if not self._current:  # every MoE layer recorded (or none ran: nothing to record)
            self._pending_tag, self._in_forward = None, False
            return
        ran = len(self._current)
        self._drop_broken_forward()
        raise RuntimeError(
            f"TraceRecorder: the model forward returned after only {ran} of {len(self.layers)} MoE layers ran "
            f"({', '.join(self._where(i) for i in range(ran, len(self.layers)))} did not): a trace needs every "
            "MoE layer once per forward; this forward is not recorded"
        )

    def _drop_broken_forward(self) -> None:
        """Forget a model forward that raised before all MoE layers ran (its routing and its tag)."""
        self._dropped += bool(self._current)
        self._current, self._pending_tag, self._in_forward, self._batch = [], None, False, None
        self._continues = False

    def _make_hook(self, index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._on_layer(index, module)
        return hook

    def _where(self, index: int) -> str:
        return f"MoE layer {index} ('{self._names[index]}')"

    def _on_layer(self, index: int, module: nn.Module) -> None:
        if not self._active or module is not self.layers[index] or in_backward():  # (a copy's layer: see above)
            return
        try:
            self._record_layer(index, module)
        except BaseException:
            self._drop_broken_forward()
            raise

    def _record_layer(self, index: int, module: nn.Module) -> None:
        if index == 0 and self._current:  # a step that ran the layers itself raised part-way: dropped (warned at the end)
            self._drop_broken_forward()
        if index != len(self._current):
            raise RuntimeError(
                f"TraceRecorder: {self._where(index)} ran when layer {len(self._current)} was expected; "
                "MoE layers must run once per forward in model.modules() order"
            )
        ids = getattr(module, "last_topk_ids", None)
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            raise ValueError(f"TraceRecorder: {self._where(index)} set no [T, K] tensor last_topk_ids (got {type(ids).__name__})")
        if self._current and ids.shape != self._current[0][0].shape:
            raise ValueError(
                f"TraceRecorder: {self._where(index)} routed [T, K] = {list(ids.shape)} but layer 0 routed "
                f"{list(self._current[0][0].shape)} in the same forward: all layers must see the same tokens and top-k"
            )
        tok = getattr(module, "last_token_ids", None)
        if tok is not None and (not isinstance(tok, torch.Tensor) or tuple(tok.shape) != (ids.shape[0],)):
            raise ValueError(f"TraceRecorder: {self._where(index)} last_token_ids must be None or a [{ids.shape[0]}] tensor, got {getattr(tok, 'shape', type(tok).__name__)}")
        rows = getattr(module, "last_input_rows", None)  # swap_moe_blocks(skip_padding=True): the rows it kept
        if rows is not None and (not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (ids.shape[0],)):
            raise ValueError(f"TraceRecorder: {self._where(index)} last_input_rows must be None or a [{ids.shape[0]}] tensor, got {getattr(rows, 'shape', type(rows).__name__)}")
        self._current.append((  # copies: for CPU int64 tensors .to() alone is a view of the caller's buffer
            _narrow(ids.detach().to("cpu", torch.int64, copy=True).numpy()),
            None if tok is None else tok.detach().to("cpu", torch.int64, copy=True).numpy(),
            None if rows is None else rows.detach().to("cpu", torch.int64, copy=True).numpy(),
        ))
        if len(self._current) == len(self.layers):
            self._finish_forward()

    def _finish_forward(self) -> None:
        layers, self._current, self._in_forward = self._current, [], False
        num_tokens, index = layers[0][0].shape[0], self._num_forwards
        given = [(i, t) for i, (_, t, _) in enumerate(layers) if t is not None]
        if not given:
            raise ValueError(f"TraceRecorder: forward {index} has no token ids: no MoE layer set last_token_ids (pass "
                             "token_ids= to the layers, or hook the model's ids to them: "
                             "moelayers.integrations.hf.pass_token_ids(model), or swap_moe_blocks(..., "
                             "token_ids=True) for a Hugging Face model)")
        for i, t in given[1:]:
            if not np.array_equal(t, given[0][1]):
                raise ValueError(f"TraceRecorder: {self._where(i)} saw different token ids than {self._where(given[0][0])} in forward {index}")
        keys, self._pending_tag = self._pending_tag, None
        batch, self._batch = self._batch, None
        continues, self._continues = self._continues, False
        previous, self._rows = self._rows, None
        mask, self._mask = self._mask, None
        rows = _rows_of_batch(batch, given[0][1], layers[0][2])  # (every layer saw the same ids: the same rows)
        if keys is None:  # untagged: the model input's sequences where the layers' token order shows them
            seq = _untagged_sequences(batch, given[0][1], rows)
            # the batch's rows (a row whose every token was left out as padding still counts: the next steps
            # continue it)
            count = batch.shape[0] if rows is not None else int(seq.max(initial=-1)) + 1
            if continues and previous is not None and previous.size == count:  # a decode step: the same rows go on
                row_codes = previous
            else:
                row_codes = self._next_code + np.arange(count, dtype=np.int64)
                self._next_code += count
            codes = row_codes[seq]
            self._rows = row_codes if count else None
        elif len(keys) != num_tokens:
            raise ValueError(f"TraceRecorder: tag() gave {len(keys)} sequence keys but forward {index} had T = {num_tokens} tokens")
        else:
            codes = np.fromiter((self._code(k) for k in keys), dtype=np.int64, count=num_tokens)
        routed, tokens = np.stack([ids for ids, _, _ in layers], axis=1), given[0][1]
        if rows is not None:  # padding the layers left out (swap_moe_blocks(skip_padding=True)) counts too
            self.padding_dropped += int(batch.size - rows.size)
        keep = _real_tokens(batch, mask, tokens, self.pad_token_id, rows)
        if keep is not None:  # padding left out (the rows' sequences stay, for the decode steps after)
            self.padding_dropped += int(keep.size - keep.sum())
            routed, tokens, codes = routed[keep], tokens[keep], codes[keep]
        self._forwards.append((routed, tokens, codes))
        self._num_forwards += 1
        self._unjoined += 1
        if self._unjoined >= _JOIN_FORWARDS:
            self._join_recent()

    def _code(self, key: Hashable) -> int:
        code = self._codes.get(key)
        if code is None:
            code = self._codes[key] = self._next_code
            self._next_code += 1
        return code

    def _join_recent(self) -> None:
        """Join the arrays of the forwards recorded since the last join into one (same order)."""
        recent = self._forwards[-self._unjoined:]
        self._unjoined = 0
        if len({ids.shape[1:] for ids, _, _ in recent}) == 1:  # forwards of another top-k: trace() says so
            del self._forwards[-len(recent):]
            self._forwards.append(tuple(np.concatenate(parts) for parts in zip(*recent)))

    def trace(self) -> RoutingTrace:
        """Build the trace of all forwards recorded so far.

        Returns:
            RoutingTrace with ``topk_ids [T, L, K]`` (int16, int32 beyond 32,768 experts; see :class:`RoutingTrace`) over all recorded tokens.

        Raises:
            ValueError: nothing recorded, ``num_experts`` unknown, or inconsistent ``K``.
            RuntimeError: called in the middle of a model forward.
        """
        if self._current:
            raise RuntimeError(f"TraceRecorder: incomplete forward: only {len(self._current)} of {len(self.layers)} MoE layers ran")
        if not self._forwards:
            raise ValueError("TraceRecorder: no model forward was recorded")
        top_ks = {ids.shape[2] for ids, _, _ in self._forwards}
        if len(top_ks) != 1:
            raise ValueError(f"TraceRecorder: forwards used different top-k values {sorted(top_ks)}")
        # codes ascend in order of first appearance; a sequence whose every token was padding has none left
        present, seq = np.unique(np.concatenate([f[2] for f in self._forwards]), return_inverse=True)
        order = np.argsort(seq, kind="stable")  # by first appearance, then seen order
        ids = np.concatenate([f[0] for f in self._forwards])[order]
        tokens = np.concatenate([f[1] for f in self._forwards])[order]
        offsets = np.concatenate([[0], np.cumsum(np.bincount(seq, minlength=present.size))]).astype(np.int64)
        return RoutingTrace(ids, tokens, offsets, self._resolve_num_experts(), vocab_size=self.vocab_size)

    def _resolve_num_experts(self) -> int:
        if self.num_experts is not None:
            return self.num_experts
        found = {getattr(getattr(layer, "config", None), "num_experts", None) for layer in self.layers}
        if None in found:
            raise ValueError("TraceRecorder: num_experts unknown: a MoE layer has no config.num_experts; pass TraceRecorder(model, num_experts=...)")
        if len(found) != 1:
            raise ValueError(f"TraceRecorder: MoE layers disagree on config.num_experts {sorted(found)}; pass num_experts=")
        return int(found.pop())

    @property
    def result(self) -> RoutingTrace:
        """The recorded trace, available after the with-block (built once, then cached)."""
        if not self._finished:
            raise RuntimeError("TraceRecorder.result is available after the with-block; call trace() inside it")
        if self._result is None:
            self._result = self.trace()
        return self._result


def __getattr__(name: str) -> Any:
    # Lazy re-export: trace_synthetic imports RoutingTrace from this module.
    if name in ("synthetic_trace", "trace_statistics"):
        from moelayers import trace_synthetic

        return getattr(trace_synthetic, name)
    raise AttributeError(f"module 'moelayers.trace' has no attribute '{name}'")
