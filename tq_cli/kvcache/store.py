"""Append-only storage of encoded tokens for one layer's stream.

Each entry of an encoding is a tensor [batch, heads, tokens, ...]. Tokens are written in
place into buffers that grow geometrically (by at least `STEP` tokens), so appending one
token per decode step copies nothing and already-stored codes are never touched again:
the cache never re-quantizes. Sliding-window layers drop tokens from the front; the
space is reclaimed the next time the buffers grow.
"""

from __future__ import annotations

import torch

from tq_cli.kvcache.codec import Encoded

STEP = 256


class TokenStore:
    """Encoded tokens, appended and read along dim 2."""

    def __init__(self) -> None:
        self.data: Encoded = {}
        self.start = 0
        self.length = 0

    @property
    def capacity(self) -> int:
        return next(iter(self.data.values())).shape[2] if self.data else 0

    def _grow(self, extra: int) -> None:
        need = self.length + extra
        cap = max(need, self.length + max(STEP, self.length // 8))
        cap = -(-cap // STEP) * STEP
        live = self.view()
        new = {}
        for k, v in live.items():
            buf = v.new_empty(*v.shape[:2], cap, *v.shape[3:])
            buf[:, :, :self.length] = v
            new[k] = buf
        self.data, self.start = new, 0

    def append(self, enc: Encoded) -> None:
        t = next(iter(enc.values())).shape[2]
        if not self.data:
            cap = -(-max(t, 1) // STEP) * STEP
            self.data = {k: v.new_empty(*v.shape[:2], cap, *v.shape[3:]) for k, v in enc.items()}
        elif self.start + self.length + t > self.capacity:
            self._grow(t)
        end = self.start + self.length
        for k, v in enc.items():
            self.data[k][:, :, end:end + t] = v
        self.length += t

    def view(self) -> Encoded:
        s, e = self.start, self.start + self.length
        return {k: v[:, :, s:e] for k, v in self.data.items()}

    def drop_front(self, n: int) -> None:
        n = min(n, self.length)
        self.start += n
        self.length -= n

    def drop_back(self, n: int) -> None:
        self.length -= min(n, self.length)

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep (and reorder) batch rows; codes are moved, never re-quantized."""
        self.data = {k: v.index_select(0, index.to(v.device)) for k, v in self.view().items()}
        self.start = 0

    def repeat_batch(self, repeats: int) -> None:
        self.data = {k: v.repeat_interleave(repeats, dim=0) for k, v in self.view().items()}
        self.start = 0

    def nbytes(self) -> int:
        """Bytes of the stored tokens (excluding spare capacity)."""
        return sum(v.element_size() * v[:, :, :1].numel() for v in self.data.values()
                   ) * self.length

    def allocated_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.data.values())
