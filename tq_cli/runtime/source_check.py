"""Does a checkpoint hold the model its config.json describes?

transformers fills a parameter the checkpoint lacks with random values (a warning in its
log), drops a tensor that lands on no parameter, and refuses a shape that differs only
when asked to. A converted checkpoint of such a source loads and runs, wrongly. So before
any compute `tq convert` builds the model config.json describes on the meta device
(`tq_cli.runtime.module_map.build_in_folder`) and maps every source tensor onto it the
way transformers' loader will (its renamings and converters, `rename_source_key`): every
parameter must be filled, every tensor must land on a parameter (or on what the model
declares it ignores), shapes must agree, and the per-expert tensors a converter stacks
into one parameter must be exactly its experts. The loader's side of the same promise is
`refuse_incomplete`: what transformers reports missing, unexpected or mismatched is
refused by name, never initialised at random.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from torch import nn

from tq_cli.io.safetensors_reader import TensorInfo


@dataclass(frozen=True)
class Mismatch:
    """The first disagreement between a source and its model, in one line; `tensor`: the
    source tensor it names (its file is the one to name), None for a missing parameter."""

    message: str
    tensor: str | None
    count: int  # disagreements of this kind


def _not_ignored(model: nn.Module, kind: str, keys: list[str]) -> list[str]:
    """`keys` less those the model's own rules let go of (old checkpoints' position_ids
    and rotary inv_freq, `_keys_to_ignore_on_load_*`): transformers' own
    `_adjust_missing_and_unexpected_keys`, applied as its loader applies it."""
    if not keys:
        return keys
    info = SimpleNamespace(missing_keys=set(keys) if kind == "missing" else set(),
                           unexpected_keys=set(keys) if kind == "unexpected" else set())
    adjust = getattr(model, "_adjust_missing_and_unexpected_keys", None)
    if adjust is not None:
        adjust(info)
    else:  # an older transformers: its class-level patterns only
        attr = f"_keys_to_ignore_on_load_{kind}"
        patterns = [re.compile(p) for p in (getattr(model, attr, None) or [])]
        setattr(info, f"{kind}_keys", {k for k in keys
                                       if not any(p.search(k) for p in patterns)})
    left = getattr(info, f"{kind}_keys")
    return [k for k in keys if k in left]


def _more(n: int) -> str:
    return f" (and {n - 1} more)" if n > 1 else ""


def source_mismatch(model: nn.Module, tensors: dict[str, TensorInfo]) -> Mismatch | None:
    """The first way `tensors` (a checkpoint's, by name) fail to be exactly `model`'s
    parameters as transformers will load them, or None. Checked in this order: a tensor
    with another shape than its parameter, a tensor that lands on nothing, experts stacked
    into one parameter that are not exactly its experts, a parameter nothing fills."""
    from transformers.core_model_loading import rename_source_key

    from tq_cli.runtime.module_map import _conversions

    renamings, converters = _conversions(model)
    params = dict(model.state_dict(keep_vars=True))
    prefix = getattr(model, "base_model_prefix", "") or ""
    cls = type(model).__name__
    filled: set[str] = set()
    wrong: list[tuple[str, str]] = []
    experts: dict[tuple[str, str], tuple[str, set[int]]] = {}
    keys_of: dict[str, str] = {}
    for name, info in tensors.items():
        key, pattern = rename_source_key(name, renamings, converters, prefix, params)
        if key not in params and name in params:  # as the loader: a rename that lands
            key, pattern = name, None  # nowhere is not applied
        if key not in params:
            keys_of[key] = name
            continue
        filled.add(key)
        filled.update(_other_targets(key, pattern, converters, params))
        if pattern is None:
            if tuple(params[key].shape) != tuple(info.shape):
                wrong.append((name, key))
            continue
        index = _expert_index(name, key, renamings, prefix, params)
        if index is not None:
            experts.setdefault((key, pattern), (name, set()))[1].add(index)
    if wrong:
        name, key = wrong[0]
        return Mismatch(f"tensor '{name}'{_more(len(wrong))} has shape "
                        f"{list(tensors[name].shape)}, but the {cls} config.json describes "
                        f"needs {list(params[key].shape)} for '{key}'; fix config.json or "
                        "convert the original folder", name, len(wrong))
    left = set(_not_ignored(model, "unexpected", list(keys_of)))  # the renamed keys, as
    unexpected = [n for k, n in keys_of.items() if k in left]  # transformers matches them
    if unexpected:
        return Mismatch(f"tensor '{unexpected[0]}'{_more(len(unexpected))} is no parameter "
                        f"of the {cls} config.json describes, and would be dropped on load; "
                        "fix config.json or remove the tensor", unexpected[0], len(unexpected))
    for (key, _), (name, seen) in experts.items():
        count = int(params[key].shape[0])
        if seen != set(range(count)):
            extra = sorted(seen - set(range(count)))
            lack = sorted(set(range(count)) - seen)
            what = (f"expert {extra[0]} beyond the {count} it declares" if extra
                    else f"no expert {lack[0]} of its {count}")
            return Mismatch(f"tensor '{name}': the checkpoint has {what} for '{key}' of "
                            f"the {cls} config.json describes; fix config.json or convert "
                            "the original folder", name, 1)
    # A parameter tied to another is filled by either (transformers ties them whichever
    # way the checkpoint allows).
    tied: dict[str, set[str]] = {}
    for a, b in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        tied.setdefault(a, set()).add(b)
        tied.setdefault(b, set()).add(a)
    missing = _not_ignored(model, "missing", [
        k for k, _ in model.named_parameters()
        if k not in filled and not tied.get(k, set()) & filled])
    if missing:
        return Mismatch(f"the {cls} config.json describes has parameter '{missing[0]}'"
                        f"{_more(len(missing))}, which no tensor of the checkpoint holds "
                        "(transformers would initialise it at random); convert the complete "
                        "original folder, or fix config.json", None, len(missing))
    return None


def _other_targets(key: str, pattern: str | None, converters: list[Any],
                   params: dict[str, Any]) -> list[str]:
    """A converter that splits one tensor into several parameters (NomicBert's Wqkv into
    q, k and v) renames it to its first target: the others are filled too."""
    if pattern is None:
        return []
    conv = next((c for c in converters if pattern in c.source_patterns), None)
    targets = list(getattr(conv, "target_patterns", None) or [])
    if len(targets) < 2 or targets[0] not in key:
        return []
    keys = (key.replace(targets[0], t, 1) for t in targets[1:])
    return [k for k in keys if k in params]


def _expert_index(name: str, key: str, renamings: list[Any], prefix: str,
                  params: dict[str, Any]) -> int | None:
    """The expert number of a per-expert tensor a converter stacks into `key` (what
    follows the experts module's name in the key renamed without the converter)."""
    from transformers.core_model_loading import rename_source_key

    from tq_cli.runtime.module_map import expert_tail

    plain, _ = rename_source_key(name, renamings, [], prefix, params)
    number, _ = expert_tail(plain, key.rpartition(".")[0])
    return int(number) if number.isdigit() else None


def refuse_incomplete(where: str, cls: str, info: Any, wanted: set[str] | None = None,
                      own_class: bool = True) -> str | None:
    """One line naming what transformers' `LoadStateDictInfo` reports missing, unexpected
    or mismatched (which it would initialise at random, or drop), or None. `wanted`: the
    keys whose absence counts (parameters and tq's stored buffers; None: all);
    `own_class`: the class config.json names, so that a tensor it does not use is wrong."""
    missing = sorted(k for k in info.missing_keys if wanted is None or k in wanted)
    unexpected = sorted(info.unexpected_keys) if own_class else []
    mismatched = sorted(info.mismatched_keys)
    if mismatched:
        key, got, want = mismatched[0]
        return (f"{where}: tensor '{key}'{_more(len(mismatched))} has shape {list(got)}, "
                f"but {cls} needs {list(want)}; the checkpoint does not match its "
                "config.json: convert the original folder again")
    if missing:
        return (f"{where}: {cls} has parameter '{missing[0]}'{_more(len(missing))} that the "
                "checkpoint does not hold (transformers would initialise it at random); "
                "convert the complete original folder again")
    if unexpected:
        return (f"{where}: tensor '{unexpected[0]}'{_more(len(unexpected))} of the checkpoint "
                f"is no parameter of {cls} (it would be dropped); the checkpoint does not "
                "match its config.json: convert the original folder again")
    return None
