from pathlib import Path

import pytest

from tq_cli.errors import RecipeError
from tq_cli.planning.recipe import builtin_recipes, load_recipe, resolve_recipe
from tq_cli.quant.spec import QuantSpec


def test_builtin_recipes_load() -> None:
    found = builtin_recipes()
    assert {"llama", "bert", "generic"} <= set(found)
    for path in found.values():
        load_recipe(path)


def test_auto_selection_by_model_type() -> None:
    assert resolve_recipe(None, {"model_type": "llama"}).name == "llama"
    assert resolve_recipe(None, {"model_type": "bert"}).name == "bert"
    assert resolve_recipe(None, {"model_type": "gpt2"}).name == "generic"
    assert resolve_recipe(None, None).name == "generic"


def test_llama_rules() -> None:
    r = resolve_recipe("llama", None)
    convert = ["model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"]
    keep = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias"]
    assert all(r.rule_for(n) is not None and r.rule_for(n).action == "quantize"  # type: ignore[union-attr]
               for n in convert)
    assert all(r.rule_for(n) is None for n in keep)


def test_unknown_key_is_named(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text('name = "x"\n[[rules]]\npattern = "*"\nbitz = 3\n')
    with pytest.raises(RecipeError,
                       match=r"r.toml: unknown key 'rules.0.bitz'; check the spelling"):
        load_recipe(p)
    p.write_text('name = "x"\ncolour = "red"\nrules = []\n')
    with pytest.raises(RecipeError, match="unknown key 'colour'"):
        load_recipe(p)


def test_bad_values_and_names(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text('name = "x"\n[[rules]]\npattern = "*"\naction = "squash"\n')
    with pytest.raises(RecipeError, match=r"r.toml: invalid value at 'rules.0.action'"):
        load_recipe(p)
    with pytest.raises(RecipeError, match="unknown recipe 'nope'; built-in: bert, generic, llama"):
        resolve_recipe("nope", None)
    with pytest.raises(RecipeError, match="no such recipe file"):
        resolve_recipe(str(tmp_path / "missing.toml"), None)


def test_rule_overrides_apply_on_top_of_cli_spec(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text('name = "x"\n[[rules]]\npattern = "*down_proj*"\nbits = 8\n'
                 '[[rules]]\npattern = "*"\n')
    r = load_recipe(p)
    base = QuantSpec(bits=3, group_size=64)
    assert r.rule_for("a.down_proj.weight").apply(base).bits == 8  # type: ignore[union-attr]
    assert r.rule_for("a.up_proj.weight").apply(base) == base  # type: ignore[union-attr]


def test_a_rule_of_a_users_recipe_that_matches_nothing_is_said(small_folder: Path,
                                                               tmp_path: Path) -> None:
    from tq_cli.conversion.converter import ConvertSpec, convert

    p = tmp_path / "mine.toml"
    p.write_text('name = "mine"\n[[rules]]\npattern = "*.up_proj.weight"\n'
                 '[[rules]]\npattern = "*.up_porj.weight"\nbits = 3\n')
    said: list[str] = []
    r = convert(small_folder, tmp_path / "out",
                ConvertSpec(allow_partial=True, recipe=str(p), fast=True),
                log=said.append)
    assert r.tensors_converted == 1
    assert ("recipe 'mine': rule '*.up_porj.weight' matches no tensor of this model; check "
            "its pattern") in said
    assert not any("'*.up_proj.weight'" in s for s in said)
