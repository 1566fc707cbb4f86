"""Serve tq checkpoints in vLLM: `vllm serve <tq folder>`, `vllm.LLM(<tq folder>)`.

vLLM loads every `vllm.general_plugins` entry point in each of its processes
(docs.vllm.ai, "Plugin System"; vllm/plugins/__init__.py, `load_general_plugins`);
tq's is `register` below, which registers the quantization method "tq" with
`vllm.model_executor.layers.quantization.register_quantization_config`. vLLM is imported
only here and in `tq_cli.vllm_plugin.config`, never by `import tq_cli`.

The method name is "tq", not the checkpoint's `quant_method` "turboquant": in vLLM
0.32 "turboquant" names vLLM's own KV-cache scheme (`--kv-cache-dtype turboquant_*`,
the package `vllm.model_executor.layers.quantization.turboquant`), though not a weight
method. The config claims tq checkpoints through `override_quantization_method`, so the
checkpoint format is unchanged and a vLLM that one day registers "turboquant" itself is
never shadowed by tq.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Register the "tq" quantization method and its op with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from tq_cli.vllm_plugin.config import METHOD, TQConfig, register_op

    register_op()
    register_quantization_config(METHOD)(TQConfig)
    _registered = True
