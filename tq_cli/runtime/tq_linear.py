"""TQLinear: a linear layer that computes from packed TurboQuant weights.

forward(x) = grouped_matmul((x * t) @ R, codes, scales, codebook) + outliers + bias
(t: the stored column scales, where the weight has them), dispatched
by tq_kernels.dispatch: Triton on CUDA, one call of tq's native kernel on CPU (rotation,
packed matmul, outliers and bias fused), the torch reference where neither is available
or TQ_FORCE_REFERENCE is set. State-dict keys match the checkpoint format (tq_cli.io.format): the
packed tensors live in a child module named `weight` (`X.weight.codes`, ...), one buffer
per stored suffix, and the rotation material in a shared `model.tq.rotation[<id>]` module
that layers only reference.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import nn

from tq_kernels import dispatch
from tq_kernels.reference import dequantize_codes

_warned_fallback = False
# TQLinear -> (its packed tensors' identities when registered, the finalizer that
# unregisters it): outside the module, so a copy of it carries only the plain settings
_registrations: weakref.WeakKeyDictionary[nn.Module, tuple[Any, weakref.finalize]] = (
    weakref.WeakKeyDictionary())


class PackedWeight(nn.Module):
    """Holds a converted weight's packed buffers; named `weight` inside TQLinear."""

    codes: torch.Tensor
    scales: torch.Tensor
    codebook: torch.Tensor
    outlier_idx: torch.Tensor
    outlier_val: torch.Tensor
    col_scale: torch.Tensor  # only where the weight stores column scales

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 shape: tuple[int, int] = (0, 0)) -> None:
        super().__init__()
        for name, (size, dtype) in specs.items():
            self.register_buffer(name, torch.empty(size, dtype=dtype, device="meta"))
        self.__dict__["logical"] = (torch.Size(shape), torch.float32)

    # What a family's own code reads of a layer's weight (`lm_head.weight.dtype` to cast
    # its input, `.shape`, `.device`) answers as the weight it stands for: its logical
    # [out, in] shape, the dtype the model runs in (set on loading) and where the codes
    # are. Arithmetic on it (`F.linear(x, w)`) is not supported: the layer runs it.
    @property
    def shape(self) -> torch.Size:
        return self.__dict__["logical"][0]

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    @property
    def ndim(self) -> int:
        return 2

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.__dict__["logical"][1]

    def set_dtype(self, dtype: torch.dtype) -> None:
        self.__dict__["logical"] = (self.shape, dtype)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


class RotationMaterial(nn.Module):
    """A rotation's stored material (signs, or matrix and tail) as buffers."""

    signs: torch.Tensor
    matrix: torch.Tensor

    def __init__(self, kind: str, block: int,
                 specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        super().__init__()
        self.kind, self.block = kind, block
        for name, (shape, dtype) in specs.items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device="meta"))

    def material(self) -> torch.Tensor | tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.kind == "hadamard":
            return self.signs
        return getattr(self, "matrix", None), getattr(self, "tail", None)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.rotate(x, self.material(), self.block)


class TQLinear(nn.Module):
    """y = x W^T + b with W stored as TurboQuant codes (docs/format.md)."""

    tq_rotation_id: str | None = None  # the shared rotation material's id, set on loading

    def __init__(self, in_features: int, out_features: int, *, bits: int, group_size: int,
                 specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 bias: tuple[tuple[int, ...], torch.dtype] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        self.weight = PackedWeight(specs, (out_features, in_features))
        if bias is not None:
            self.bias = nn.Parameter(torch.empty(bias[0], dtype=bias[1], device="meta"),
                                     requires_grad=False)
        else:
            self.register_parameter("bias", None)
        # Set after loading; kept out of _modules so its buffers are not duplicated.
        self.__dict__["rotation"] = None

    @property
    def rotation(self) -> RotationMaterial | None:
        return self.__dict__["rotation"]

    def set_rotation(self, rotation: RotationMaterial | None) -> None:
        self.__dict__["rotation"] = rotation

    @property
    def col_scale(self) -> torch.Tensor | None:
        """The stored column scales t [in], or None."""
        return getattr(self.weight, "col_scale", None)

    @property
    def backend(self) -> str:
        """'triton', 'cpu-avx512', 'cpu-avx2', 'cpu-scalar' or 'torch' (the reference)."""
        return dispatch.backend_for(self.weight.codes.device, self.bits, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global _warned_fallback
        native = self.__dict__.get("native_call")
        if native is not None and x.device.type == "cpu" and torch.compiler.is_compiling():
            return self._native_forward(x, native)
        if x.is_cuda and self.backend != "triton" and not _warned_fallback:
            _warned_fallback = True
            warnings.warn("tq: Triton is unavailable, TQLinear runs the torch reference on "
                          "CUDA (much slower than expected)", RuntimeWarning, stacklevel=2)
        w, rot = self.weight, self.rotation
        t, dtype = self.col_scale, x.dtype
        if t is not None:  # W = W' diag(t): x W^T = (x t) W'^T (tq_cli.quant.colscale)
            x = dispatch.scale_columns(x, t)
        y = dispatch.linear(x, rot.material() if rot is not None else None,
                               rot.block if rot is not None else 0, w.codes, w.scales,
                               w.codebook, w.outlier_idx, w.outlier_val, self.bias,
                               bits=self.bits, group_size=self.group_size,
                               out_features=self.out_features, in_features=self.in_features)
        return y if y.dtype == dtype else y.to(dtype)

    def _native_forward(self, x: torch.Tensor, native: tuple[int, int]) -> torch.Tensor:
        """The CPU kernel called directly on this layer as registered (`prepare_native`):
        what a compiled decode step records, one operator per layer with the activations
        and the layer's handle only, none of the dispatch's checks (which tracing would
        have to guard on) and none of the packed tensors (which the step would take as
        inputs, about 1,000 on SmolLM2, handed over before every step)."""
        t, dtype = self.col_scale, x.dtype
        if t is not None:
            x = dispatch.scale_columns(x, t)
        y = torch.ops.tq_cpu.linear_registered.default(x, *native)
        return y if y.dtype == dtype else y.to(dtype)

    def _native_tensors(self) -> tuple[torch.Tensor | None, ...]:
        w, rot = self.weight, self.rotation
        return (rot.signs if rot is not None else None, w.codes, w.scales, w.codebook,
                w.outlier_idx, w.outlier_val, self.bias)

    def prepare_native(self, native: tuple[int, int, bool, bool] | None) -> None:
        """Register this layer with the CPU kernel under the settings `native`
        (`tq_kernels.cpu.native_args`) for compiled forwards to call by its handle; None:
        unregister it (compiled forwards take the dispatch path). Only for a layer on the
        CPU with a Hadamard rotation or none. The registration holds references to the
        packed tensors: `refresh_native` registers them again if they were replaced."""
        from tq_kernels import cpu

        held = _registrations.pop(self, None)
        if held is not None:
            held[1]()  # the finalizer: unregisters now
        for key in ("native_call", "native_settings"):
            self.__dict__.pop(key, None)
        if native is None:
            return
        rot = self.rotation
        if self.weight.codes.device.type != "cpu" or (rot is not None and rot.kind != "hadamard"):
            raise ValueError("the native CPU kernel serves CPU layers with a Hadamard "
                             "rotation (or none)")
        handle = self._register(native, -1)
        # at exit too: the registry's references go while Python still runs
        done = weakref.finalize(self, cpu.unregister, handle)
        _registrations[self] = (self._native_key(), done)
        self.__dict__["native_settings"] = native
        self.__dict__["native_call"] = (handle, self.out_features)

    def refresh_native(self) -> bool:
        """Register the packed tensors again (same handle) where one was replaced or
        written in place since `prepare_native` (`_native_key`); a copy of a registered
        layer (`copy.deepcopy`) gets a registration of its own. Returns whether it
        registered."""
        native = self.__dict__.get("native_settings")
        if native is None:
            return False
        held = _registrations.get(self)
        if held is None:  # a copy: the handle it carries is the original's
            self.prepare_native(native)
            return True
        if held[0] == self._native_key():
            return False
        self._register(native, self.__dict__["native_call"][0])
        _registrations[self] = (self._native_key(), held[1])
        return True

    def _native_key(self) -> tuple[tuple[int, int, int] | None, ...]:
        """Each packed tensor's identity, storage and version: a write in place (as
        load_state_dict's) registers the layer again, which re-checks it (the outliers'
        order) and converts again what the kernel holds as a copy (a bf16 bias)."""
        def version(t: torch.Tensor) -> int:
            return -1 if t.is_inference() else t._version

        return tuple(None if t is None else (id(t), t.data_ptr(), version(t))
                     for t in self._native_tensors())

    def _register(self, native: tuple[int, int, bool, bool], handle: int) -> int:
        from tq_kernels import cpu

        w, rot = self.weight, self.rotation
        return cpu.register(rot.signs if rot is not None else None,
                            rot.block if rot is not None else 0, w.codes, w.scales,
                            w.codebook, w.outlier_idx, w.outlier_val, self.bias, bits=self.bits,
                            group_size=self.group_size, in_features=self.in_features,
                            out_features=self.out_features, native=native, handle=handle)

    def dequantize(self) -> torch.Tensor:
        """The weight in the original basis, float32 [out, in] (for export or debugging)."""
        w = self.weight
        rot_space = dequantize_codes(w.codes, w.scales, w.codebook, bits=self.bits,
                                     group_size=self.group_size, in_features=self.in_features)
        if w.outlier_idx.numel():
            rot_space.view(-1).index_add_(0, w.outlier_idx.long(), w.outlier_val.float())
        if self.rotation is None:
            w_full = rot_space
        else:
            # W = W_rot R^T: rotate the rows of I to get R, then multiply.
            eye = torch.eye(self.in_features, device=rot_space.device)
            w_full = rot_space @ self.rotation.rotate(eye).float().T
        t = self.col_scale
        return w_full * t.float() if t is not None else w_full

    def memory_bytes(self) -> int:
        """Bytes of this layer's own buffers (packed weight and bias; rotation is shared)."""
        total = sum(b.numel() * b.element_size() for b in self.weight.buffers())
        if self.bias is not None:
            total += self.bias.numel() * self.bias.element_size()
        return total

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, bias={self.bias is not None}")
