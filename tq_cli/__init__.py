"""tq: convert language models into low-bit TurboQuant checkpoints and run them.

Library API (the CLI is a thin layer over these):
    convert(source, out, spec)        stream a model folder into a tq checkpoint
    quantize(weight, spec, rotation)  -> QuantizedTensor (pure)
    dequantize(q)                     -> Tensor (pure)
    load(path_or_hub_id)              -> a transformers model with TQLinear layers
    kv_cache(model, bits=3.5)         -> a TurboQuant KV cache for generate()

Once tq_cli is imported, `transformers.AutoModel*.from_pretrained(tq_folder)` works too:
the turboquant quantizer registers itself as soon as transformers is imported (at once
if it already is), without making `import tq_cli` pay for importing transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tq_cli._lazy import lazy_face as _lazy_face
from tq_cli.version import __version__

__getattr__ = _lazy_face(__name__, {
    "convert": "conversion.converter",
    "ConvertSpec": "conversion.spec",
    "quantize": "quant.prepare",
    "dequantize": "quant.grouped",
    "QuantizedTensor": "quant.grouped",
    "QuantSpec": "quant.spec",
    "RotationSpec": "quant.spec",
    "TqError": "errors",
    "load": "runtime.loader",
    "kv_cache": "kvcache.cache",
    "KVSpec": "kvcache.spec",
})

if TYPE_CHECKING:
    from tq_cli.conversion.converter import convert
    from tq_cli.conversion.spec import ConvertSpec
    from tq_cli.errors import TqError
    from tq_cli.kvcache.cache import kv_cache
    from tq_cli.kvcache.spec import KVSpec
    from tq_cli.quant.grouped import QuantizedTensor, dequantize
    from tq_cli.quant.prepare import quantize
    from tq_cli.quant.spec import QuantSpec, RotationSpec
    from tq_cli.runtime.loader import load


def _register_with_transformers() -> None:
    import importlib

    try:
        importlib.import_module("tq_cli.runtime.hf_quantizer")
    except Exception as e:  # an incompatible transformers must not break tq itself
        import warnings

        warnings.warn(f"tq: cannot register with transformers ({e})", RuntimeWarning,
                      stacklevel=2)


class _OnTransformersImport:
    """A meta-path hook that registers tq right after `transformers` itself is imported."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != "transformers":
            return None
        import importlib.util
        import sys

        sys.meta_path.remove(self)  # type: ignore[arg-type]
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: object) -> None:
            original(module)
            _register_with_transformers()

        loader.exec_module = exec_module
        return spec


def _install_hook() -> None:
    import sys

    if "transformers" in sys.modules:
        _register_with_transformers()
    elif not any(isinstance(f, _OnTransformersImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnTransformersImport())  # type: ignore[arg-type]


_install_hook()

__all__ = ["ConvertSpec", "KVSpec", "QuantSpec", "QuantizedTensor", "RotationSpec", "TqError",
           "__version__", "convert", "dequantize", "kv_cache", "load", "quantize"]
