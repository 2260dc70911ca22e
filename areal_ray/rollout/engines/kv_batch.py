"""The running batch of a continuous-batching engine: one KV cache, rows left-padded.

transformers' `DynamicCache` holds keys/values as [batch, heads, seq, dim] per layer
and grows every row by one column per decode step, so rows of different lengths share
it by left padding, with an attention mask marking the real tokens and explicit
position ids (a row's position is its count of real tokens, so padding never shifts
RoPE). Requests join by merging their freshly prefilled cache in (the shorter side is
padded on the left) and leave by row selection, after which columns that are padding
in every remaining row are cut off, so a finished long request stops costing
attention for the rest.

Every row appends at the same column each step, so a layer can grow in place into
spare capacity (`GrowingLayer`) instead of `DynamicLayer`'s torch.cat of the whole
cache per step, which at 64 rows x 400 columns dominated the step time on CPU.

A decode step that raises can be undone (`truncate` back to the width before it) and
its rows stepped one by one (`split`), so one failing row does not end its cohort's.

Only full-attention layers are supported: a sliding-window layer keeps a rolling
window whose columns do not line up across rows after a merge.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [extra, 0]  # F.pad lists dims last-first
    return F.pad(t, pad)


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are a prefix view of a larger buffer, so a decode
    step writes one column in place. Whoever replaces `keys`/`values` (a merge, a row
    selection) just assigns compact tensors; the next update re-buffers them."""

    HEADROOM = 64  # spare columns allocated when re-buffering

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys = key_states[..., :0, :]
            self.values = value_states[..., :0, :]
        old, new = self.keys.shape[-2], key_states.shape[-2]
        buf = getattr(self, "_kbuf", None)
        fits = (buf is not None and self.keys.data_ptr() == buf.data_ptr()
                and buf.shape[0] == self.keys.shape[0] and old + new <= buf.shape[-2])
        if not fits:
            shape = list(key_states.shape)
            shape[-2] = old + new + max(self.HEADROOM, (old + new) // 2)
            self._kbuf, self._vbuf = key_states.new_empty(shape), value_states.new_empty(shape)
            self._kbuf[..., :old, :] = self.keys
            self._vbuf[..., :old, :] = self.values
        self._kbuf[..., old:old + new, :] = key_states
        self._vbuf[..., old:old + new, :] = value_states
        self.keys = self._kbuf[..., :old + new, :]
        self.values = self._vbuf[..., :old + new, :]
        return self.keys, self.values


def new_cache(num_layers: int) -> DynamicCache:
    """An empty cache of GrowingLayers for a prefill."""
    cache = DynamicCache()
    cache.layers = [GrowingLayer() for _ in range(num_layers)]
    return cache


class KVBatch:
    """Rows (any payload, in cache order) with their shared cache and attention mask."""

    def __init__(self, cache: DynamicCache | None = None, mask: torch.Tensor | None = None,
                 rows: list | None = None):
        if cache is not None and any(not isinstance(layer, GrowingLayer) for layer in cache.layers):
            raise NotImplementedError("continuous batching needs full-attention GrowingLayer caches")
        self.cache = cache
        self.mask = mask if mask is not None else torch.zeros((0, 0), dtype=torch.long)
        self.rows = list(rows or [])

    @property
    def size(self) -> int:
        return self.mask.shape[0]

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def positions(self) -> torch.Tensor:
        """[B, 1] position id of each row's next token (its count of real tokens)."""
        return self.mask.sum(-1, keepdim=True)

    def step_mask(self) -> torch.Tensor:
        """The attention mask of a decode step (every row adds one real token); it becomes
        the batch's mask once the step's forward has appended to the cache."""
        self.mask = torch.cat([self.mask, torch.ones((self.size, 1), dtype=torch.long,
                                                     device=self.mask.device)], dim=1)
        return self.mask

    def merge(self, other: KVBatch) -> None:
        """Append `other`'s rows; the narrower of the two is padded on the left."""
        if self.cache is None or self.size == 0:
            self.cache, self.mask, self.rows = other.cache, other.mask, list(other.rows)
            return
        width = max(self.width, other.width)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])
            mine.values = torch.cat([_left_pad(mine.values, width, 2),
                                     _left_pad(theirs.values, width, 2)])
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(other.mask, width, 1)])
        self.rows += other.rows

    def keep(self, idx: list[int]) -> None:
        """Keep only rows `idx` (in that order), then drop the all-padding columns on the left."""
        if not idx:
            self.cache, self.mask, self.rows = None, self.mask[:0, :0], []
            return
        if len(idx) == self.size:
            return
        sel = torch.tensor(idx, device=self.mask.device)
        mask = self.mask[sel]
        start = int((mask.sum(0) > 0).long().argmax())  # first column some row uses
        self.mask = mask[:, start:]
        self.rows = [self.rows[i] for i in idx]
        for layer in self.cache.layers:
            layer.keys = layer.keys[sel, :, start:]
            layer.values = layer.values[sel, :, start:]

    def truncate(self, width: int) -> None:
        """Cut the mask and every layer's keys/values back to `width` columns: undoes a
        decode step that failed after `step_mask` or after some layers had appended.
        The layers stay prefix views of their buffers, so the next step writes in place."""
        self.mask = self.mask[:, :width]
        for layer in self.cache.layers if self.cache is not None else ():
            if layer.is_initialized and layer.keys.shape[-2] > width:
                layer.keys = layer.keys[..., :width, :]
                layer.values = layer.values[..., :width, :]

    def split(self) -> list[KVBatch]:
        """One batch per row that is not None, holding that row's cache without the
        columns that are padding in it; this batch is left as it was (the new layers
        are views of its tensors until their first update copies them into a buffer)."""
        parts = []
        for i, row in enumerate(self.rows):
            if row is None:
                continue
            start = int(self.mask[i].argmax())  # the row's first real token
            cache = new_cache(len(self.cache.layers))
            for mine, theirs in zip(cache.layers, self.cache.layers):
                mine.lazy_initialization(theirs.keys, theirs.values)
                mine.keys = theirs.keys[i:i + 1, :, start:]
                mine.values = theirs.values[i:i + 1, :, start:]
            parts.append(KVBatch(cache, self.mask[i:i + 1, start:], [row]))
        return parts
