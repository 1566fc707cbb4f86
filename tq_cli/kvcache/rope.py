"""Rotary position angles of a model's keys, for centering keys before RoPE.

Cached keys are post-RoPE: k_p = R(p) k, with R(p) rotating channel pairs (i, i + r/2) by
p * inv_freq[i] (transformers' `rotate_half` convention, r the rotary dimension). Keys of
Llama-family models carry a large per-channel offset that is fixed before RoPE (KVQuant,
Hooper et al. 2024, arXiv 2401.18079, Section 3.1 "pre-RoPE key quantization"); after RoPE
it turns with position, so no fixed post-RoPE mean fits it. The cache takes the mean m of
R(p)^-1 k_p over the first coded tokens and codes k_p - R(p) m: the same residual as
centering before RoPE, without moving the quantizer in front of RoPE (transformers hands
the cache post-RoPE keys, and no cos/sin). R(p) m is added back exactly at decode, so a
mismatch between these angles and the model's (left padding, an unknown RoPE variant) only
makes the centering less effective, never the keys wrong.

`RotaryAngles` holds inv_freq from the model config, computed the way transformers' own
rotary embeddings compute it (default RoPE, or `ROPE_INIT_FUNCTIONS` for scaled types);
attention scaling factors are left out: they scale the mean and its rotated copy alike.
Where these angles are not the model's, the centering is only weaker: RoPE types whose
frequencies change during a forward ("dynamic", "longrope" past their original length),
configs that keep `rope_scaling` apart from `rope_parameters` (transformers 4.x), and
layouts that rotate other channels than the first r (DeepSeek's MLA puts them last).
"""

from __future__ import annotations

from typing import Any

import torch


def _rope_parameters(text_config: Any, layer_type: str) -> dict[str, Any] | None:
    params = getattr(text_config, "rope_parameters", None)
    if not isinstance(params, dict):
        theta = getattr(text_config, "rope_theta", None)
        return None if theta is None else {"rope_type": "default", "rope_theta": theta}
    if layer_type in params and isinstance(params[layer_type], dict):
        return params[layer_type]  # per layer type (Gemma 3)
    return params if "rope_theta" in params else None


def inv_freq_for(text_config: Any, layer_type: str, head_dim: int) -> torch.Tensor | None:
    """float32 [r/2] inverse frequencies of a layer's RoPE, or None where the config names
    no RoPE tq understands (then keys are coded uncentered)."""
    params = _rope_parameters(text_config, layer_type)
    if params is None:
        return None
    kind = params.get("rope_type", "default")
    try:
        if kind == "default":
            factor = float(params.get("partial_rotary_factor",
                                      getattr(text_config, "partial_rotary_factor", 1.0)))
            dim = int(head_dim * factor)
            base = float(params["rope_theta"])
            inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if kind not in ROPE_INIT_FUNCTIONS:
                return None
            per_type = layer_type in (getattr(text_config, "rope_parameters", None) or {})
            fn = ROPE_INIT_FUNCTIONS[kind]
            inv, _ = fn(text_config, layer_type=layer_type) if per_type else fn(text_config)
            inv = inv.float()
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if inv.ndim != 1 or 2 * inv.numel() > head_dim or inv.numel() == 0:
        return None
    return inv


class RotaryAngles:
    """cos/sin of positions start..start+n for one inv_freq, memoised for the last few
    ranges asked (every layer of a decode step asks for the same two: the coded past and
    the token leaving the window)."""

    KEEP = 4

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq
        self._memo: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, start: int, n: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, r] cos and sin (duplicated halves, as transformers builds them)."""
        key = (start, n, str(device))
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        pos = torch.arange(start, start + n, dtype=torch.float32, device=device)
        freqs = pos[:, None] * self.inv_freq.to(device, torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        out = emb.cos(), emb.sin()
        if len(self._memo) >= self.KEEP:
            self._memo.pop(next(iter(self._memo)))
        self._memo[key] = out
        return out

    def _turn(self, x: torch.Tensor, start: int, sign: float,
              n: int | None = None) -> torch.Tensor:
        """R(p) x (sign 1) or R(p)^-1 x (sign -1) at positions start..start+n, for x
        [..., n, d], or [..., 1, d] broadcast over the n positions (a mean is turned
        once per call, not copied per token first)."""
        n = x.shape[-2] if n is None else n
        cos, sin = self.cos_sin(start, n, x.device)
        r = cos.shape[-1]
        x = x.float()
        rot, rest = x[..., :r], x[..., r:]
        half = torch.cat((-rot[..., r // 2:], rot[..., :r // 2]), dim=-1)
        out = torch.addcmul(rot * cos, half, sin, value=sign)
        if rest.shape[-1] == 0:
            return out
        return torch.cat((out, rest.expand(*out.shape[:-1], rest.shape[-1])), dim=-1)

    def rotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """R(p) x for x [..., n, d] at positions start..start+n (float32)."""
        return self._turn(x, start, 1.0)

    def unrotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """R(p)^-1 x: the inverse of `rotate`."""
        return self._turn(x, start, -1.0)

    def offsets(self, mean: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """R(p) mean for positions start..start+n: [..., n, d] from mean [..., 1, d]."""
        return self._turn(mean, start, 1.0, n)
