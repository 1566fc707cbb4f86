"""Where each source tensor ends up in the model transformers builds, and whether tq can
run it there quantized.

transformers 5 loads a checkpoint through conversion mappings: keys are renamed (a VLM's
`language_model.model.layers.*` become `model.language_model.layers.*`) and some tensors
are merged or reshaped on the way in (a MoE's per-expert `w1`/`w3` fused into one 3-D
parameter). tq converts by source tensor name and runs a converted weight as the
`nn.Linear` it belongs to, so before anything is written the plan asks the same
machinery: the model is built from config.json on the meta device, its conversion
mapping collected (`get_model_conversion_mapping`) and every converted name renamed as
the loader will rename it (`rename_source_key`). No table of renames per family is kept
here. A MoE's per-expert tensors, which a converter fuses, are placed as the experts of
a TQExperts (tq_cli.runtime.experts) where the fusion is a plain stack of gate, up and
down projections. A tensor tq could not load back or run (merged by any other converter,
owned by a module that is not an `nn.Linear`, or read as a raw tensor by its parent, as
`nn.MultiheadAttention` reads `out_proj.weight`) gets the reason why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from tq_cli.errors import SourceError, UnsupportedError
from tq_cli.io.format import Expert

# Parents that read a child linear's weight as a raw tensor (F.multi_head_attention_forward).
RAW_READERS = (nn.MultiheadAttention,)


@dataclass(frozen=True)
class Placement:
    """A source tensor in the built model: its module path, or why tq cannot run it."""

    source: str  # the checkpoint's name, "X.weight"
    module: str | None  # the module path in the model, when it is an nn.Linear tq can run
    reason: str | None = None  # why not, when `module` is None
    # In an image-text-to-text model (a VLM: it generates, and its text config is not its
    # own): "text" inside the language model, "vision" inside the vision tower, "other"
    # elsewhere (the projector); None in any other model.
    part: str | None = None
    # One expert's projection of a mixture-of-experts layer (transformers fuses them;
    # tq runs them per expert, tq_cli.runtime.experts); `module` is then its path inside
    # the experts module, named as the checkpoint names it.
    expert: Expert | None = None


def _conversions(model: Any) -> tuple[list[Any], list[Any]]:
    """The model's renamings and converters, as from_pretrained applies them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    return renamings, converters


def place(model: nn.Module, names: list[str]) -> dict[str, Placement]:
    """Each converted source tensor's placement in `model` (parameters may be on meta)."""
    from transformers.core_model_loading import rename_source_key

    renamings, converters = _conversions(model)
    params = dict(model.state_dict(keep_vars=True))
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "") or ""
    towers = _towers(model, modules)
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    tied |= {v: k for k, v in tied.items()}
    out: dict[str, Placement] = {}
    for name in names:
        key, converter = rename_source_key(name, renamings, converters, prefix, params)
        if converter is not None:
            plain, _ = rename_source_key(name, renamings, [], prefix, params)
            p = _expert_placement(name, key, plain, converter, converters, modules)
        else:
            p = _placement(name, key, modules, params)
        if p.module is not None and key in tied:
            p = Placement(name, None, f"transformers ties it to '{tied[key]}', which tq "
                                      "keeps in full precision")
        if towers is not None:
            part = next((kind for path, kind in towers if key.startswith(path + ".")), "other")
            p = Placement(p.source, p.module, p.reason, part, p.expert)
        out[name] = p
    return _whole_expert_layers(out, modules)


def _whole_expert_layers(out: dict[str, Placement],
                         modules: dict[str, nn.Module]) -> dict[str, Placement]:
    """An experts module runs all its experts quantized or none: where the converted
    tensors do not cover every expert's gate, up and down, all of them are kept."""
    groups: dict[str, set[tuple[int, str]]] = {}
    for p in out.values():
        if p.expert is not None:
            groups.setdefault(p.expert.of, set()).add((p.expert.index, p.expert.role))
    for of, seen in groups.items():
        owner: Any = modules[of]
        count = int(owner.gate_up_proj.shape[0])
        if seen == {(i, r) for i in range(count) for r in ("gate", "up", "down")}:
            continue
        why = (f"the recipe converts only some of the {count} experts of '{of}', and tq runs "
               "a layer's experts all quantized or all in full precision")
        for name, p in out.items():
            if p.expert is not None and p.expert.of == of:
                out[name] = Placement(name, None, why, p.part)
    return out


@dataclass
class ParamSources:
    """Where each parameter of the built model comes from in the checkpoint: one source
    tensor renamed (`direct`), or per-expert tensors stacked into a fused 3-D parameter
    (`fused`: parameter -> per expert, the source names concatenated along dim 0)."""

    direct: dict[str, str]
    fused: dict[str, list[list[str]]]


def param_sources(model: nn.Module, names: list[str]) -> ParamSources:
    """How transformers' loader maps the checkpoint's `names` onto `model`'s parameters,
    for the runs that read a model's weights themselves (calibration)."""
    from transformers.core_model_loading import rename_source_key

    from tq_cli.io.format import ROLES

    renamings, converters = _conversions(model)
    params = dict(model.state_dict(keep_vars=True))
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "") or ""
    direct: dict[str, str] = {}
    parts: dict[str, dict[tuple[int, str], str]] = {}
    for name in names:
        key, converter = rename_source_key(name, renamings, converters, prefix, params)
        if converter is None:
            direct[key] = name
            continue
        plain, _ = rename_source_key(name, renamings, [], prefix, params)
        p = _expert_placement(name, key, plain, converter, converters, modules)
        if p.expert is not None:
            parts.setdefault(key, {})[(p.expert.index, p.expert.role)] = name
    fused = {}
    for key, got in parts.items():
        count = int(params[key].shape[0])
        roles = [r for r in ROLES if any(role == r for _, role in got)]
        if all((i, r) in got for i in range(count) for r in roles):
            fused[key] = [[got[(i, r)] for r in roles] for i in range(count)]
    return ParamSources(direct, fused)


def _towers(model: Any, modules: dict[str, nn.Module]) -> list[tuple[str, str]] | None:
    """The module paths of a VLM's language model ("text") and vision tower ("vision"):
    the sub-models whose config is the model's text or vision config. None for a model
    that does not generate from images (an LLM, an encoder, CLIP)."""
    config = getattr(model, "config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    vision = getattr(config, "vision_config", None)
    if config is None or vision is None or not can_generate():
        return None
    text = config.get_text_config()
    if text is config:
        return None
    found = []
    for path, m in modules.items():
        sub = getattr(m, "config", None)
        if not path or sub is None or not hasattr(m, "can_generate"):
            continue  # the root, or not a transformers sub-model
        # The very config objects: a vision config may be of a text config's class.
        if sub is vision:
            found.append((path, "vision"))
        elif sub is text:
            found.append((path, "text"))
    return found


# The converters tq runs per expert: the fused parameter, the operations that build it
# from the per-expert tensors, and the role of each source pattern, in order.
EXPERT_FUSIONS = {"gate_up_proj": (["MergeModulelist", "Concatenate"], ("gate", "up")),
                  "down_proj": (["MergeModulelist"], ("down",))}


def _expert_placement(name: str, key: str, plain: str, pattern: str, converters: list[Any],
                      modules: dict[str, nn.Module]) -> Placement:
    """A tensor a converter merges: one expert's projection that TQExperts runs, when the
    fusion is a plain stack of experts into a module TQExperts can stand in for."""
    from tq_cli.runtime.experts import unsupported_because

    merged = Placement(name, None, "transformers merges it with other tensors when loading, "
                                   "in a way tq does not run quantized")
    converter = next((c for c in converters if pattern in c.source_patterns), None)
    path, _, param = key.rpartition(".")
    owner = modules.get(path)
    fusion = EXPERT_FUSIONS.get(param)
    if converter is None or owner is None or fusion is None:
        return merged
    ops, roles = fusion
    if ([type(op).__name__ for op in converter.operations] != ops
            or len(converter.source_patterns) != len(roles)):
        return merged
    why = unsupported_because(owner)
    if why is not None:
        return Placement(name, None, why)
    # The expert's number and own name: what follows the experts module's name in the
    # checkpoint's key as renamed without the converter ("3.w1.weight").
    number, own = expert_tail(plain, path)
    if not number.isdigit() or not own.endswith("weight") or own == "weight":
        return merged
    role = roles[converter.source_patterns.index(pattern)]
    child = f"{number}.{own.removesuffix('.weight')}"
    return Placement(name, f"{path}.{child}", expert=Expert(path, int(number), role))


def expert_tail(plain: str, path: str) -> tuple[str, str]:
    """(expert number, its own name) of a per-expert key renamed without converters
    ("...experts.3.w1.weight" -> ("3", "w1.weight")), given the experts module's path:
    what follows that module's last name in the key."""
    leaf = "." + path.rpartition(".")[2] + "."
    at = ("." + plain).rfind(leaf)
    tail = ("." + plain)[at + len(leaf):] if at >= 0 else ""
    number, _, own = tail.partition(".")
    return number, own


def _placement(name: str, key: str, modules: dict[str, nn.Module],
               params: dict[str, Any]) -> Placement:
    path, _, attr = key.rpartition(".")
    owner = modules.get(path)
    if key not in params or owner is None:
        return Placement(name, None, "the model transformers builds from config.json has "
                                     "no parameter for it")
    if not isinstance(owner, nn.Linear) or attr != "weight":
        return Placement(name, None, f"it is '{attr}' of {type(owner).__name__}, not the "
                                     "weight of an nn.Linear")
    if type(owner).forward is not nn.Linear.forward:  # Llama 4's router returns two things
        return Placement(name, None, f"{type(owner).__name__} is an nn.Linear with a forward "
                                     "of its own, which a TQLinear would not run")
    parent = modules.get(path.rpartition(".")[0]) if "." in path else None
    if isinstance(parent, RAW_READERS):
        return Placement(name, None, f"{type(parent).__name__} reads it as a raw tensor, not "
                                     "through its nn.Linear")
    return Placement(name, path)


def unchecked_because(config: dict) -> str | None:
    """Why this transformers cannot check where tensors land (then convert warns and
    writes without the check), or None: a transformers without conversion mappings (4.x),
    a model type it does not know (newer than it), or a model with its own code."""
    import importlib.util

    import transformers

    if importlib.util.find_spec("transformers.conversion_mapping") is None:
        return (f"transformers {transformers.__version__} has no conversion mappings; "
                "transformers 5 does the check")
    return unknown_model(config)


def unknown_model(config: dict) -> str | None:
    """Why this transformers cannot build the model config.json describes without running
    foreign code (a model type newer than it, or a model with its own code), or None."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if config.get("auto_map"):
        return "the model brings its own code (auto_map), which tq never runs"
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        return (f"transformers {transformers.__version__} does not know model_type "
                f"'{model_type}'; upgrade it for the check")
    return None


NO_HEAD = " has no linear lm_head"  # what head_placement says of an encoder, CLIP, ...


@dataclass(frozen=True)
class HeadPlacement:
    """The model's lm_head: the checkpoint tensor it loads from, its module path, and the
    input embedding tied to it (None: untied)."""

    source: str
    module: str
    embedding: str | None


def head_placement(model: nn.Module, names: list[str]) -> HeadPlacement | str:
    """Where `model`'s lm_head comes from among the checkpoint's tensors `names`, or why tq
    cannot store it quantized (tq_cli.quant.head)."""
    from transformers.core_model_loading import rename_source_key

    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    kind = type(model).__name__
    if not isinstance(head, nn.Linear):
        return f"{kind}{NO_HEAD}"
    modules = dict(model.named_modules())
    path = next(n for n, m in modules.items() if m is head)
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    emb_path = next((n for n, m in modules.items() if m is emb), None)
    raw = dict(getattr(model, "all_tied_weights_keys", None) or {})  # target -> source
    tied = raw | {v: k for k, v in raw.items()}
    renamings, converters = _conversions(model)
    params = dict(model.state_dict(keep_vars=True))
    prefix = getattr(model, "base_model_prefix", "") or ""
    by_key = {rename_source_key(n, renamings, converters, prefix, params)[0]: n for n in names}
    head_key = f"{path}.weight"
    other = tied.get(head_key)
    if other is None:
        source = by_key.get(head_key)
        return (HeadPlacement(source, path, None) if source is not None
                else f"the checkpoint has no tensor for {kind}'s '{head_key}'")
    if emb_path is None or other != f"{emb_path}.weight":
        return f"{kind}'s lm_head is tied to '{other}', which is not its input embedding"
    if type(emb) is not nn.Embedding or getattr(emb, "max_norm", None) is not None:
        # Gemma's embedding multiplies lookups by sqrt(hidden), others renormalise them
        return (f"{kind}'s lm_head is tied to its input embedding, a {type(emb).__name__}, "
                "which tq runs quantized only as a plain nn.Embedding")
    if head.bias is not None:  # a masked-LM head: its bias is a tied parameter of its own
        return f"{kind}'s lm_head, tied to its input embedding, has a bias"
    if sum(other in (k, v) for k, v in raw.items()) > 1:  # T5: encoder, decoder and head
        return (f"{kind}'s input embedding '{other}' is tied to more than lm_head, and tq "
                "stores it quantized only as the head's")
    if head_key in by_key:  # stored under the head's name (and maybe the embedding's too)
        where = (f"as two tensors ('{by_key[head_key]}', '{by_key[other]}')" if other in by_key
                 else f"under lm_head's name ('{by_key[head_key]}')")
        return f"the checkpoint stores {kind}'s tied lm_head and input embedding {where}"
    source = by_key.get(other)
    if source is None:
        return f"the checkpoint has no tensor for {kind}'s '{head_key}'"
    return HeadPlacement(source, path, emb_path)


def build_in_folder(folder: Path, config: dict) -> nn.Module:
    """The model config.json describes in `folder`, built on meta, for `place`."""
    from tq_cli.runtime.hf_models import build_skeleton

    try:
        model = build_skeleton(folder, config, real_buffers=False)
    except ImportError as e:  # a package the model's code needs: not the config's fault
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise UnsupportedError(f"{folder}: transformers needs a package it cannot import to "
                               f"build this model ({e.name or first}); install it and "
                               "convert again") from None
    except Exception as e:  # transformers raises anything on a config it cannot use
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise SourceError(f"{folder / 'config.json'}: transformers cannot build the model it "
                          f"describes ({type(e).__name__}: {first}), so a checkpoint of it "
                          "could not be loaded; fix config.json or convert the original "
                          "folder") from None
    return model

