"""transformers cache layers that keep keys and values as TurboQuant codes.

A layer holds, per stream: the first `sinks` tokens and the most recent `window` tokens in
full precision, and every other token as codes (`kvcache.codec`) in a `TokenStore`.
A token is encoded exactly once, when it leaves the window (in blocks of up to 16 tokens,
`encode_block`: one encode per block of decode steps), and its codes are never
re-quantized (transformers' own `QuantizedLayer` re-quantizes its whole cache each time
its residual fills, which compounds error). Tokens given to an `update` are returned at
full precision in that forward (they are in memory anyway); from the next forward on, a
token older than the window is read back from its codes.

`TurboQuantLayer` serves full attention. `TurboQuantSlidingLayer` serves sliding-window
layers (Gemma 2/3 style) when the cache is asked to quantize them: it keeps the same
`sliding_window - 1` tokens as transformers' `DynamicSlidingWindowLayer`, the recent
`window` of them in full precision, and drops codes from the front as tokens slide out.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import BaseQuantizedLayer, DynamicSlidingWindowLayer

from tq_cli.kvcache.attend import CodedKV, CodedStream, KeysProbe, withdraw
from tq_cli.kvcache.codec import Encoded, StreamCodec
from tq_cli.kvcache.rope import RotaryAngles
from tq_cli.kvcache.spec import KVSpec
from tq_cli.kvcache.store import TokenStore


def _norm_name(enc: Encoded) -> str:
    return "norm" if "norm" in enc else "norm_hi"


class FullCodec:
    """A stream kept in full precision (bits None): tokens are stored as they are."""

    def encode(self, x: torch.Tensor, order: torch.Tensor | None) -> Encoded:
        return {"x": x}

    def decode(self, enc: Encoded, order: torch.Tensor | None) -> torch.Tensor:
        return enc["x"]

    def choose_channels(self, x: torch.Tensor) -> torch.Tensor | None:
        return None

    def material_bytes(self) -> int:
        return 0


Codec = StreamCodec | FullCodec


class CodecBank:
    """The codecs of one cache, shared by its layers: one per (stream, head_dim, device)."""

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec
        self.codecs: dict[tuple[str, int, str], Codec] = {}

    def get(self, stream: str, d: int, device: torch.device) -> Codec:
        key = (stream, d, str(device))
        if key not in self.codecs:
            bits = self.spec.key_bits if stream == "key" else self.spec.value_bits
            if bits is None:
                self.codecs[key] = FullCodec()
            else:
                qjl = self.spec.qjl and stream == "key"
                self.codecs[key] = StreamCodec(d, bits, self.spec.rotation, self.spec.seed,
                                               stream, qjl=qjl,
                                               rescale=self.spec.rescale).to(device)
        return self.codecs[key]

    def material_bytes(self) -> int:
        return sum(c.material_bytes() for c in self.codecs.values())


def encode_block(window: int) -> int:
    """Tokens leave the window in blocks of this many (an eighth of the window, at most
    16): the window holds window..window + block - 1 full-precision tokens, and a decode
    step encodes a block every block steps instead of one token each step. Each token is
    still encoded once; a token waits at most block - 1 steps longer in full precision."""
    return max(1, min(16, window // 8))


def _listed(n: int, length: int) -> bool:
    """Whether code attention gets the n keys of `length` coded ones that were coded
    uncentered as a list to correct (few: a real model's first tokens) rather than
    checking every token's norm (random keys take about half uncentered)."""
    return n <= max(16, length // 16)


class _Stream:
    """One stream (keys or values) of one layer: sinks, codes, recent window."""

    def __init__(self, codec: Codec, empty: torch.Tensor,
                 rope: RotaryAngles | None = None) -> None:
        self.codec = codec
        self.rope = rope  # keys: center before RoPE (`kvcache.rope`)
        self.next_pos = 0  # position of the next token admitted
        self.store_pos = 0  # position of the oldest coded token
        self.sinks = empty
        self.store = TokenStore()
        self.recent = empty
        self.order: torch.Tensor | None = None  # channel order of a fractional-bit split
        self.mean: torch.Tensor | None = None  # per-head offset coded vectors are taken from
        self.fitted = False  # order and mean chosen (once, at the first tokens coded)
        # positions (ascending) of coded keys some row took as they were (their norms
        # stored negative): usually none past the sinks, and then code attention skips
        # the per-token correction
        self.uncentered: list[int] = []
        self.err = 0.0  # sum of squared reconstruction errors of encoded tokens
        self.energy = 0.0  # and of their squared norms

    def _offset(self, start: int, n: int) -> torch.Tensor | None:
        """What coded tokens at positions start..start+n were taken from: the mean, turned
        to each position by RoPE for keys centered before it."""
        if self.mean is None:
            return None
        if self.rope is None:
            return self.mean.float()
        return self.rope.offsets(self.mean, start, n)

    def decoded(self, enc: Encoded, start: int) -> torch.Tensor:
        if self.rope is None:
            x = self.codec.decode(enc, self.order)
            off = self._offset(start, x.shape[-2])
            return x if off is None else x + off
        # Keys centered before RoPE: the sign of the stored norm says whether the token was
        # coded centered (+) or as it was (-), see _encode.
        name = _norm_name(enc)
        centered = ~torch.signbit(enc[name])
        x = self.codec.decode({**enc, name: enc[name].abs()}, self.order)
        off = self._offset(start, x.shape[-2])
        # The offset is finite for any keys the codec stores: each mean entry is at most a
        # key's norm, and norms are stored in fp16 too.
        return x if off is None else x.addcmul_(off, centered[..., None].to(off.dtype))

    def full_visible(self, new: torch.Tensor) -> torch.Tensor:
        """The tokens held in full precision, in order: sinks, window, then the new ones
        (the coded tokens go between the sinks and the window: `coded`)."""
        return torch.cat([self.sinks, self.recent, new], dim=-2)

    def coded(self) -> CodedStream:
        """The coded tokens as they are stored, for attention on the codes."""
        assert isinstance(self.codec, StreamCodec)
        lo = bisect.bisect_left(self.uncentered, self.store_pos)
        hi = bisect.bisect_left(self.uncentered, self.store_pos + self.store.length)
        cols = None  # many (random keys): every token is checked
        if _listed(hi - lo, self.store.length):
            cols = torch.tensor(self.uncentered[lo:hi], dtype=torch.long,
                                device=self.recent.device) - self.store_pos
        return CodedStream(self.codec, self.store.view(), self.store_pos, self.order,
                           self.mean, self.rope, cols)

    def visible(self, new: torch.Tensor) -> torch.Tensor:
        """Every cached token in order (codes decoded), then the new ones."""
        parts = [self.sinks]
        if self.store.length:
            parts.append(self.decoded(self.store.view(), self.store_pos).to(new.dtype))
        return torch.cat([*parts, self.recent, new], dim=-2)

    def admit(self, new: torch.Tensor, sinks: int, window: int, center: bool,
              measure: bool) -> None:
        """Append new tokens to the window; fill the sinks; encode what leaves the window
        (the paper's online setting, Section 4.3: each token is quantized once)."""
        x = torch.cat([self.recent, new], dim=-2)
        pos = self.next_pos - self.recent.shape[-2]  # of x[0]
        self.next_pos += new.shape[-2]
        free = sinks - self.sinks.shape[-2]
        if free > 0:
            self.sinks = torch.cat([self.sinks, x[..., :free, :]], dim=-2)
            pos += min(free, x.shape[-2])
            x = x[..., free:, :]
        overflow = x.shape[-2] - window
        if overflow >= encode_block(window):
            self._encode(x[..., :overflow, :], x, pos, center, measure)
            x = x[..., overflow:, :]
        self.recent = x.contiguous()

    def _encode(self, old: torch.Tensor, sample: torch.Tensor, pos: int, center: bool,
                measure: bool) -> None:
        """Code `old` (positions pos..), the front of `sample` (the tokens visible now)."""
        coded = not isinstance(self.codec, FullCodec)
        if not self.fitted and coded:
            self.fitted = True
            # The channel split and the mean are fixed on first use from every token
            # visible then (the window and the tokens leaving it) and kept, so codes stay
            # decodable as stored. Coding x - mean spends the bits on what differs between
            # tokens; the mean is added back exactly. Keys take it before RoPE.
            if center or self.rope is not None:
                pre = sample if self.rope is None else self.rope.unrotate(sample, pos)
                self.mean = pre.float().mean(dim=(0, 2), keepdim=True).to(torch.float16)
            self.order = self.codec.choose_channels(self._centered(sample, pos))
        if not self.store.length:
            self.store_pos = pos
        if self.rope is not None and self.mean is not None:
            # A key far from the mean (the first token's, an attention sink's) is coded as
            # it is: each token takes the smaller of its two residuals, so centering never
            # raises a token's error bound. The choice is the sign of its stored norm (the
            # norm is never negative), so it costs no bytes.
            res = self._centered(old, pos)
            use = res.norm(dim=-1) < old.float().norm(dim=-1)
            enc = self.codec.encode(torch.where(use[..., None], res, old.float()), self.order)
            name = _norm_name(enc)
            enc[name] = torch.where(use, enc[name], -enc[name])
            taken = (~use).flatten(0, 1).any(0)  # [tokens]: some row took it as it was
            if bool(taken.any()):
                self.uncentered += (taken.nonzero().flatten() + pos).tolist()
        else:
            enc = self.codec.encode(self._centered(old, pos), self.order)
        self.store.append(enc)
        if measure and coded:
            rec = self.decoded(enc, pos)
            self.err += float((rec - old.float()).pow(2).sum())
            self.energy += float(old.float().pow(2).sum())

    def _centered(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        off = self._offset(pos, x.shape[-2])
        return x if off is None else x.float() - off

    def drop_back(self, n: int) -> None:
        self.next_pos -= n
        take = min(n, self.recent.shape[-2])
        self.recent = self.recent[..., :self.recent.shape[-2] - take, :]
        coded = min(n - take, self.store.length)
        self.store.drop_back(coded)
        del self.uncentered[bisect.bisect_left(self.uncentered,
                                               self.store_pos + self.store.length):]
        self.sinks = self.sinks[..., :self.sinks.shape[-2] - (n - take - coded), :]

    def drop_front(self, n: int) -> None:
        """Drop the n oldest tokens after the sinks (a sliding window moving on)."""
        coded = min(n, self.store.length)
        self.store.drop_front(coded)
        self.store_pos += coded
        del self.uncentered[:bisect.bisect_left(self.uncentered, self.store_pos)]
        self.recent = self.recent[..., n - coded:, :]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor],
                  fn_store: Callable[[TokenStore], None]) -> None:
        self.sinks, self.recent = fn(self.sinks), fn(self.recent)
        fn_store(self.store)

    @property
    def tokens(self) -> int:
        return self.sinks.shape[-2] + self.store.length + self.recent.shape[-2]

    def memory(self) -> tuple[int, int, int]:
        """(bytes of codes, elements held in full precision, bytes of the channel order)."""
        side = sum(t.numel() * t.element_size() for t in (self.order, self.mean)
                   if t is not None)
        full = self.sinks.numel() + self.recent.numel()
        if isinstance(self.codec, FullCodec):
            return 0, full + self.store.nbytes() // self.recent.element_size(), side
        return self.store.nbytes(), full, side


class TurboQuantLayer(BaseQuantizedLayer):
    """A full-attention layer whose tokens outside sinks and window are TurboQuant codes.

    `keys`/`values` mirror the full-precision window, for code that looks at them.
    """

    is_croppable = True
    # A forward of at most this many new tokens attends on the codes when the model runs
    # tq's attention (`code_attention`, `kvcache.attend`); longer ones (a prefill, a long
    # chunk) get every token decoded as before.
    CODE_MAX_NEW = 8

    def __init__(self, spec: KVSpec, bank: CodecBank, measure_error: bool = False,
                 rope: RotaryAngles | None = None, code_attention: bool = False,
                 index: int | None = None) -> None:
        super().__init__()
        self.spec, self.bank, self.measure_error = spec, bank, measure_error
        self.code_attention = code_attention
        # Whether this model's attention module hands the returned keys to tq's attention
        # function as they are (`kvcache.attend.KeysProbe`): until one forward shows it,
        # the layer returns every token decoded, with a probe on the keys.
        self.probe = KeysProbe(index)
        self.rope = rope  # the layer's RoPE angles, when keys are centered before RoPE
        self.n_sinks = spec.sinks
        self.streams: tuple[_Stream, _Stream] | None = None

    # BaseQuantizedLayer's abstract hooks: this layer encodes per token through _Stream.
    def _quantize(self, tensor: torch.Tensor) -> Any:
        raise NotImplementedError

    def _dequantize(self, q_tensor: Any) -> torch.Tensor:
        raise NotImplementedError

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        dev = key_states.device
        # Angles wider than the keys (a config tq misread) mean keys are coded uncentered.
        rope = self.rope if self.rope is not None and \
            2 * self.rope.inv_freq.numel() <= key_states.shape[-1] else None
        k = _Stream(self.bank.get("key", key_states.shape[-1], dev), key_states[..., :0, :],
                    rope)
        v = _Stream(self.bank.get("value", value_states.shape[-1], dev),
                    value_states[..., :0, :])
        self.streams = (k, v)
        self._quantized_keys, self._quantized_values = k.store, v.store
        self._mirror()

    def _mirror(self) -> None:
        if self.streams is not None:
            self.keys, self.values = self.streams[0].recent, self.streams[1].recent

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.streams is not None
        k, v = self.streams
        self.cumulative_length += key_states.shape[-2]
        coded = None
        if (self.code_attention and self.probe.state == "seen" and not self.is_sliding
                and k.store.length and key_states.shape[-2] <= self.CODE_MAX_NEW
                and isinstance(k.codec, StreamCodec) and isinstance(v.codec, StreamCodec)):
            # Attention on the codes (`kvcache.attend`): the coded tokens stay codes; the
            # attention function finds them on the returned keys.
            coded = CodedKV(k.coded(), v.coded(), k.sinks.shape[-2])
            keys, values = k.full_visible(key_states), v.full_visible(value_states)
        else:
            keys, values = k.visible(key_states), v.visible(value_states)
        # Keys are centered before RoPE when the layer has its angles (`kvcache.rope`);
        # values around a fixed mean only when asked (measured worse on SmolLM2).
        for s, new, center in ((k, key_states, False), (v, value_states, self.spec.center)):
            s.admit(new, self.n_sinks, self.spec.window, center, self.measure_error)
        self._after_admit()
        self._mirror()
        if coded is not None:
            keys.tq_coded = coded  # type: ignore[attr-defined]
            withdraw()
        elif self.code_attention and self.probe.offer():
            keys.tq_probe = self.probe  # type: ignore[attr-defined]
        else:
            withdraw()
        return keys, values

    def _after_admit(self) -> None:
        """Hook for the sliding layer."""

    def reset(self) -> None:
        super().reset()
        self.streams = None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens: from the window, then the codes (which
        are dropped whole, never re-quantized), then the sinks."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or self.streams is None:
            return
        n = min(-tokens_to_remove, self.cumulative_length)
        self.cumulative_length -= n
        for s in self.streams:
            s.drop_back(n)
        self._mirror()

    def _each_batch(self, fn: Callable[[torch.Tensor], torch.Tensor],
                    fn_store: Callable[[TokenStore], None]) -> None:
        if self.streams is not None:
            for s in self.streams:
                s.map_batch(fn, fn_store)
            self._mirror()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._each_batch(lambda t: t.index_select(0, beam_idx.to(t.device)),
                         lambda st: st.select_batch(beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        idx = indices if indices.dtype != torch.bool else indices.nonzero().flatten()
        self._each_batch(lambda t: t.index_select(0, idx.to(t.device)),
                         lambda st: st.select_batch(idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._each_batch(lambda t: t.repeat_interleave(repeats, dim=0),
                         lambda st: st.repeat_batch(repeats))

    def memory(self) -> dict[str, int]:
        """Bytes of codes (with norms and sketches), elements held in full precision
        (sinks, window, streams kept whole) and their bytes, side data (channel orders),
        cached elements (keys and values) and tokens."""
        out = {"code_bytes": 0, "full_elements": 0, "full_bytes": 0, "side_bytes": 0,
               "elements": 0, "tokens": 0}
        if self.streams is None:
            return out
        for s in self.streams:
            code, full, side = s.memory()
            out["code_bytes"] += code
            out["side_bytes"] += side
            out["full_elements"] += full
            out["full_bytes"] += full * s.recent.element_size()
            shape = s.recent.shape
            out["elements"] += shape[0] * shape[1] * shape[3] * s.tokens
        out["tokens"] = self.streams[0].tokens
        return out


class TurboQuantSlidingLayer(TurboQuantLayer):
    """A sliding-window layer quantized inside its window (no sinks: they slide out)."""

    is_sliding = True
    is_croppable = False

    def __init__(self, spec: KVSpec, bank: CodecBank, sliding_window: int,
                 measure_error: bool = False, rope: RotaryAngles | None = None) -> None:
        super().__init__(spec, bank, measure_error, rope)  # decodes: no code attention
        self.n_sinks = 0
        self.sliding_window = sliding_window
        self._sliding_window_tensor = torch.tensor(sliding_window, dtype=torch.long)

    # Same visible span and mask offsets as transformers' dynamic sliding layer.
    get_mask_sizes = DynamicSlidingWindowLayer.get_mask_sizes

    def get_max_length(self) -> int:
        return self.sliding_window

    def _after_admit(self) -> None:
        # Keep the sliding_window - 1 most recent tokens, as DynamicSlidingWindowLayer does.
        assert self.streams is not None
        for s in self.streams:
            s.drop_front(max(0, s.tokens - (self.sliding_window - 1)))

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a quantized sliding-window layer cannot be cropped")
