"""Attention on the codes: a decode step that never decodes a coded token to a vector.

For a key stored as scale s_t times the rotated codebook vector c_t = L[codes_t] (in the
basis of the codec's rotation R: k_t = s_t R^T c_t, Zandieh et al. 2025, arXiv:2504.19874,
Algorithm 1), the score of a query q is s_t <q R, c_t>: q is rotated once per head and
step, then scored against the packed codes (`tq_kernels.kv.score_codes`, native on CPU,
Triton on CUDA). Values are accumulated the same way in the rotated basis,
sum_t p_t s_t c_t (`accumulate_codes`), and rotated back once per head. What the cache
adds around the codes is handled here exactly as `kvcache.layers` decodes it:

- a fractional-bit stream's channel split: q is permuted by the head's channel order and
  each part scored against its own codes (and values scattered back);
- keys' QJL sketch: <q, |r| sqrt(pi/2)/d S^T z> = |r| <sqrt(pi/2)/d S q, z>, z = +-1 codes;
- keys centered before RoPE: a token coded as k - R(p) m (its stored norm's sign says
  so, `kvcache.layers`) adds <q, R(p) m>, which for the rotate-half RoPE is
  sum_i A_i cos(p w_i) + B_i sin(p w_i) with A, B from q and m: one product with a
  position table of cos and sin shared by every layer and head, so no per-token vector
  is formed (`mean_scores`);
- values centered on a mean m: sum_t p_t (v_t + m) = accumulate + (sum_t p_t) m;
- the sinks and the recent window are full-precision tensors, scored as usual.

`attention` is the function tq registers with transformers' attention interface: a
decode step whose cache layer handed it coded segments (`CodedKV`, set on the key
tensor by `TurboQuantLayer.update`) runs here; anything else goes to sdpa, unchanged
(tq's attention is only set on models that ran sdpa).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch

from tq_cli.kvcache.codec import Encoded, StreamCodec
from tq_cli.kvcache.rope import RotaryAngles
from tq_kernels import kv as ops

NAME = "tq_codes"  # the attention implementation tq registers
# tq_cli.runtime.compiled's: sdpa with grouped heads read in place (sdpa's masks)
COMPILED_SDPA = "tq_compiled_sdpa"
_PM1 = torch.tensor([-1.0, 1.0])


@dataclass
class CodedStream:
    """One stream's coded tokens as a decode step sees them (a view of the store)."""

    codec: StreamCodec
    enc: Encoded
    start: int  # position of the first coded token
    order: torch.Tensor | None  # [H, d] channel order of a fractional-bit split
    mean: torch.Tensor | None  # [1, H, 1, d] what coded tokens were taken from
    rope: RotaryAngles | None  # keys centered before RoPE: the mean turns with position
    # keys centered before RoPE: the tokens (indices in this view) some row coded as it
    # was, its stored norm negative; None: any may be
    uncentered: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return next(iter(self.enc.values())).shape[2]


@dataclass
class CodedKV:
    """What `TurboQuantLayer.update` hands the attention in code mode: the full-precision
    keys/values it returned are [sinks, recent, new] with `sinks` tokens first, and the
    coded tokens belong between the sinks and the rest."""

    keys: CodedStream
    values: CodedStream
    sinks: int


def _index(order: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return order.long()[None, :, None, :].expand_as(like)


def mean_scores(q: torch.Tensor, mean: torch.Tensor, rope: RotaryAngles, start: int,
                n: int) -> torch.Tensor:
    """<q, R(p) m> for positions p = start..start+n: float32 [B, H, M, n] from q
    [B, H, M, d] and m [1, H, 1, d], without forming R(p) m (see the module docstring).

    Pairs (i, i + r/2) turn by p w_i (transformers' rotate_half), so the term is
    sum_i A_i cos(p w_i) + B_i sin(p w_i) with A, B [r/2] from q and m, plus a constant
    from the channels past the rotary dimension r: one product of [A, B] with a table of
    cos and sin by position that every layer and head of a step shares (`_angles`)."""
    h = rope.inv_freq.numel()
    r = 2 * h
    qf, m = q.float(), mean.float()
    a = qf[..., :h] * m[..., :h] + qf[..., h:r] * m[..., h:r]  # [B, H, M, h]
    b = qf[..., h:r] * m[..., :h] - qf[..., :h] * m[..., h:r]
    f = torch.cat((a, b), dim=-1) @ _angles(rope, start, n, q.device)
    if r < q.shape[-1]:
        f += (qf[..., r:] * m[..., r:]).sum(-1, keepdim=True)
    return f


# (id of the angles, device, start) -> (the angles, [cos; sin] [r, capacity] by position
# from start); the angles are held so their id cannot be reused while the entry lives.
_ANGLES: dict[tuple[int, str, int], tuple[RotaryAngles, torch.Tensor]] = {}
_ANGLES_LOCK = threading.Lock()


def _angles(rope: RotaryAngles, start: int, n: int, device: torch.device) -> torch.Tensor:
    """[cos(p w); sin(p w)] for p = start..start+n, float32 [r, n], computed as the decoding
    path computes them (float32 position times frequency) and grown geometrically, so a
    decode step (n one more than the last) costs no new trigonometry."""
    key = (id(rope), str(device), start)
    with _ANGLES_LOCK:
        hit = _ANGLES.get(key)
        if hit is None or hit[0] is not rope or hit[1].shape[1] < n:
            cap = max(n, int(1.5 * (hit[1].shape[1] if hit is not None else 0)) + 1024)
            pos = torch.arange(start, start + cap, dtype=torch.float32, device=device)
            ang = rope.inv_freq.to(device, torch.float32)[:, None] * pos[None, :]
            table = torch.cat((ang.cos(), ang.sin()), dim=0)
            if key not in _ANGLES and len(_ANGLES) >= 4:
                _ANGLES.pop(next(iter(_ANGLES)), None)
            hit = _ANGLES[key] = (rope, table)
        return hit[1][:, :n]


def _uncentered(enc: Encoded, cols: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H, T] True where a key was coded as it was (its norm stored negative); only at
    the token indices `cols`, when given."""
    norm = enc["norm" if "norm" in enc else "norm_hi"]
    return torch.signbit(norm if cols is None else norm.index_select(2, cols))


def coded_scores(q: torch.Tensor, s: CodedStream) -> torch.Tensor:
    """<q, k_t> for every coded key: float32 [B, H, M, T] from q [B, H, M, d] float32."""
    codec, enc = s.codec, s.enc
    if codec.hi is None:
        lo = codec.lo
        out = ops.score_codes(q @ lo.rot, enc["codes"], enc["norm"], lo.levels, lo.bits)
    else:
        assert s.order is not None
        qp = q.gather(-1, _index(s.order, q))
        hi, lo, k = codec.hi, codec.lo, codec.high
        out = ops.score_codes(qp[..., :k] @ hi.rot, enc["codes_hi"], enc["norm_hi"],
                              hi.levels, hi.bits)
        out += ops.score_codes(qp[..., k:] @ lo.rot, enc["codes_lo"], enc["norm_lo"],
                               lo.levels, lo.bits)
    if codec.sketch is not None:
        c = math.sqrt(math.pi / 2) / codec.d
        out += ops.score_codes((q @ codec.sketch.s.T) * c, enc["qjl"], enc["qjl_norm"],
                               _PM1.to(q.device), 1)
    if s.mean is not None:
        if s.rope is not None:
            f = mean_scores(q, s.mean, s.rope, s.start, s.length)
            cols = s.uncentered  # per token: coded centered (norm's sign +) or as it was
            if cols is None:
                f.mul_(_uncentered(enc).logical_not_()[:, :, None, :])
            elif cols.numel():  # only these few: take the term back where it was not added
                taken = _uncentered(enc, cols)[:, :, None, :]
                f.index_add_(-1, cols, f.index_select(-1, cols) * taken, alpha=-1)
            out += f
        else:
            out += (q * s.mean.float()).sum(-1, keepdim=True)
    return out


def coded_values(p: torch.Tensor, s: CodedStream, d: int) -> torch.Tensor:
    """sum_t p_t v_t over the coded values: float32 [B, H, M, d] from p [B, H, M, T]."""
    codec, enc = s.codec, s.enc
    if codec.sketch is not None:
        raise ValueError("values have no QJL sketch")
    if codec.hi is None:
        lo = codec.lo
        out = ops.accumulate_codes(p, enc["codes"], enc["norm"], lo.levels, lo.bits, d) \
            @ lo.rot.T
    else:
        assert s.order is not None
        hi, lo, k = codec.hi, codec.lo, codec.high
        parts = torch.cat((
            ops.accumulate_codes(p, enc["codes_hi"], enc["norm_hi"], hi.levels, hi.bits, k)
            @ hi.rot.T,
            ops.accumulate_codes(p, enc["codes_lo"], enc["norm_lo"], lo.levels, lo.bits,
                                 d - k) @ lo.rot.T), dim=-1)
        out = torch.empty_like(parts).scatter_(-1, _index(s.order, parts), parts)
    if s.mean is not None:
        if s.rope is not None:
            raise ValueError("values are never centered before RoPE")
        out += p.sum(-1, keepdim=True) * s.mean.float()
    return out


def _mask(scores: torch.Tensor, mask: torch.Tensor | None, groups: int,
          length: int) -> torch.Tensor:
    """Add an attention mask [B, 1|H, L, K] (additive or boolean) to scores
    [B, Hkv, G * L, K]; without one, new tokens see what precedes them (causal)."""
    b, hkv, gl, k = scores.shape
    s = scores.view(b, hkv, groups, length, k)
    if mask is None:
        if length > 1:
            i = torch.arange(length, device=s.device)[:, None]
            j = torch.arange(k, device=s.device)[None, :]
            s = s.masked_fill(j > k - length + i, float("-inf"))
        return s.view(b, hkv, gl, k)
    m = mask[..., -k:]  # [B, 1, 1, L, K] broadcast over heads, or one per query head
    m = m[:, :, None] if m.shape[1] == 1 else m.view(m.shape[0], hkv, groups, length, k)
    s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(s.dtype)
    return s.view(b, hkv, gl, k)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, coded: CodedKV,
           mask: torch.Tensor | None, scaling: float,
           softcap: float | None = None) -> torch.Tensor:
    """softmax(q K^T * scaling + mask) V over [sinks, coded, recent + new] for query
    [B, Hq, L, d], the full-precision key/value [B, Hkv, n, d] and the coded segment;
    returns [B, L, Hq, d] in query's dtype (what transformers' attention functions do)."""
    b, hq, length, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    # every score is linear in q: scaled once here instead of over all T scores
    q = (query.float() * scaling).reshape(b, hkv, groups * length, d)
    ns = coded.sinks
    full = q @ key.float().transpose(-1, -2)
    scores = torch.cat((full[..., :ns], coded_scores(q, coded.keys), full[..., ns:]), dim=-1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = _mask(scores, mask, groups, length)
    p = torch.softmax(scores, dim=-1)
    nc = coded.keys.length
    vf = value.float()
    out = p[..., :ns] @ vf[..., :ns, :] + p[..., ns + nc:] @ vf[..., ns:, :]
    out += coded_values(p[..., ns:ns + nc], coded.values, value.shape[-1])
    return out.view(b, hkv, groups, length, -1).reshape(b, hq, length, -1) \
        .transpose(1, 2).to(query.dtype).contiguous()


# What tq's attention reads besides q, k, v, the mask and the scale; a forward that passes
# anything else with a value (sinks as `s_aux`, a sliding window, ...) keeps the decoding
# path.
_READ_KWARGS = frozenset({"softcap", "dropout", "position_ids", "cache_position", "is_causal",
                          "output_attentions", "use_cache"})


_said: set[str] = set()


def _say(message: str) -> None:
    """Log `message` once per process (every layer of a model refuses for one reason)."""
    if message not in _said:
        _said.add(message)
        import logging

        logging.getLogger("tq").info(message)


class KeysProbe:
    """Whether a model's attention module hands the keys the cache returned to the
    attention function unchanged, and passes nothing tq's attention ignores: the condition
    for attending on the codes, whatever the family (a module that copied, cast or
    repeated the keys in between would attend on the window alone).

    A layer not yet "seen" returns every token decoded (a correct forward either way) with
    this probe on the keys (`offer`). tq's attention function marks it "seen" when the
    keys reach it as they were, "refused" when other arguments would be ignored, and also
    "refused" when it is called with keys that lost the probe the layer just offered (the
    module changed them): that layer then decodes first for good, and one log line says
    so. An update outside a forward (a cache filled directly) only offers it again."""

    def __init__(self, layer: int | None = None) -> None:
        self.state = "new"  # new -> offered -> seen | refused
        self.layer = layer  # the model layer (its attention module's layer_idx)

    def offer(self) -> bool:
        """Whether this update's keys carry the probe (not yet settled); the next call of
        tq's attention function on this thread is taken to be this layer's."""
        if self.state in ("new", "offered"):
            self.state = "offered"
            _offered.probe = self
            return True
        withdraw()
        return False

    def met(self, kwargs: dict[str, Any]) -> None:
        if self.state != "offered":
            return
        # None and False are what a family passes for what it does not use (Mixtral's
        # output_router_logits=False)
        extra = sorted(k for k, v in kwargs.items()
                       if k not in _READ_KWARGS and v is not None and v is not False)
        if kwargs.get("output_attentions"):
            extra.append("output_attentions")
        self.state = "refused" if extra else "seen"
        if extra:
            _say(f"tq: KV cache: attention gets {', '.join(extra)}, which attention on the "
                 "codes does not read; it decodes coded tokens first")

    def missed(self) -> None:
        if self.state == "offered":
            self.state = "refused"
            _say("tq: KV cache: this model's attention module changes the cache's keys before "
                 "the attention function; it decodes coded tokens first")


_offered = threading.local()  # the probe the last update on this thread offered


def withdraw() -> None:
    """An update that offers no probe: none is pending for the next attention call."""
    _offered.probe = None


def _fallback(module: Any) -> Any:
    """The model's own attention: sdpa (tq's is only set on sdpa models, whose masks it
    builds with sdpa's mask function)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"]


def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0,
              scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: code-domain attention for a decode step
    the cache prepared, the model's own attention otherwise."""
    probe = getattr(key, "tq_probe", None)
    offered, _offered.probe = getattr(_offered, "probe", None), None
    if isinstance(probe, KeysProbe):
        probe.met(kwargs)
    elif isinstance(offered, KeysProbe) and offered.layer is not None and \
            offered.layer == getattr(module, "layer_idx", None):
        offered.missed()  # this layer's keys lost the probe on the way
    coded = getattr(key, "tq_coded", None)
    if not isinstance(coded, CodedKV):
        return _fallback(module)(module, query, key, value, attention_mask, dropout=dropout,
                                 scaling=scaling, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return attend(query, key, value, coded, attention_mask, scaling,
                  kwargs.get("softcap")), None


def register() -> None:
    """Make NAME a transformers attention implementation (with sdpa's mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


__all__ = ["COMPILED_SDPA", "NAME", "CodedKV", "CodedStream", "KeysProbe", "attend", "attention",
           "coded_scores", "coded_values", "mean_scores", "register", "withdraw"]
