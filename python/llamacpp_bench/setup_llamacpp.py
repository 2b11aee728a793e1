"""The cached pieces of scripts/bench-llamacpp: llama.cpp built from the
tree inside the ``llama-cpp-python`` sdist, the random 100 M-parameter
Llama in Hugging Face format (python/testing/make_model.py) and its
GGUF f32 conversion by llama.cpp's own ``convert_hf_to_gguf.py``.

Each lives in a directory under ``${XDG_CACHE_HOME:-$HOME/.cache}/kvtier/``
named after a hash of what makes it, with a ``.kvtier-started`` marker
written first and ``.kvtier-complete`` last: a complete one is reused, an
interrupted one is redone, and a directory without the start marker (not
made here) is never deleted.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAKE_MODEL = REPO / "python" / "testing" / "make_model.py"

#: The llama-cpp-python release whose vendored llama.cpp tree is built.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

#: CPU, Release, static, no web UI (its prebuilt assets would be
#: downloaded), no HTTPS, no tests or examples.
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
]
TARGETS = ["llama-bench", "llama-server"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier"


def short_hash(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b"\0")
    return h.hexdigest()[:12]


def cached(dir: Path, what: str, make: Callable[[Path], None]) -> Path:
    """``dir`` once ``make(dir)`` has filled it, reused when complete."""
    if (dir / ".kvtier-complete").is_file():
        return dir
    if dir.exists() and not (dir / ".kvtier-started").is_file():
        raise SystemExit(f"{dir} exists and was not made by scripts/bench-llamacpp: move it away")
    log(f"making {what} in {dir}")
    shutil.rmtree(dir, ignore_errors=True)
    dir.mkdir(parents=True)
    (dir / ".kvtier-started").touch()
    make(dir)
    (dir / ".kvtier-complete").touch()
    return dir


def run(cmd: list[str | Path], **kw: object) -> None:
    shown = ["<code>" if prev == "-c" else str(c) for prev, c in zip(["", *cmd], cmd, strict=False)]
    log("+ " + " ".join(shown))
    # Their output goes to stderr with the progress: stdout carries only
    # the bench's result (one JSON object with --json).
    kw.setdefault("stdout", sys.stderr)
    subprocess.run([str(c) for c in cmd], check=True, **kw)  # type: ignore[call-overload]


def llamacpp_build() -> Path:
    """The directory holding ``src/`` (the llama.cpp tree) and
    ``build/bin/llama-bench``, ``build/bin/llama-server``."""
    key = short_hash(LLAMA_CPP_PYTHON_VERSION, *CMAKE_FLAGS, *TARGETS)
    dir = cache_root() / f"llamacpp-{LLAMA_CPP_PYTHON_VERSION}-{key}"

    def make(dir: Path) -> None:
        sdist_dir = dir / "sdist"
        # --no-binary for this package only: pip prepares the sdist's
        # metadata with its build backend, which installs from wheels.
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--no-binary",
                "llama-cpp-python",
                "-d",
                sdist_dir,
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
            ]
        )
        (sdist,) = sdist_dir.glob("llama_cpp_python-*.tar.gz")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
        src = dir / "src"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix):
                    m.name = m.name[len(prefix) :]
                    members.append(m)
            tar.extractall(src, members=members, filter="data")
        shutil.rmtree(sdist_dir)
        cmake = Path(sys.executable).parent / "cmake"
        build = dir / "build"
        nice = ["nice", "-n", "10"]
        run([*nice, cmake, "-S", src, "-B", build, *CMAKE_FLAGS])
        jobs = str(os.cpu_count() or 1)
        run([*nice, cmake, "--build", build, "--config", "Release", "-j", jobs, "--target", *TARGETS])
        for t in TARGETS:
            if not (build / "bin" / t).is_file():
                raise SystemExit(f"the llama.cpp build made no {build / 'bin' / t}")

    return cached(dir, f"llama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist, about 5 minutes)", make)


#: Run in a subprocess: llama.cpp's converter, with the BPE pre-tokenizer
#: named. make_model's tokenizer is byte-level BPE with GPT-2's split
#: regex, which the converter does not recognise by its hash (it knows
#: published models only) and would refuse; "gpt-2" is that pre-tokenizer.
CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def model(llamacpp: Path, size: str, seed: int) -> tuple[Path, Path]:
    """(the Hugging Face directory, the GGUF f32 file) of make_model's
    ``size`` model."""
    key = short_hash(MAKE_MODEL.read_bytes(), CONVERT, LLAMA_CPP_PYTHON_VERSION, size, str(seed))
    dir = cache_root() / f"llamacpp-model-{size}-{key}"

    def make(dir: Path) -> None:
        sys.path.insert(0, str(MAKE_MODEL.parent))
        from make_model import make as make_hf

        make_hf(dir / "hf", size, seed)
        run(
            [
                sys.executable,
                "-c",
                CONVERT,
                llamacpp / "src",
                dir / "hf",
                "--outtype",
                "f32",
                "--outfile",
                dir / "model-f32.gguf",
            ]
        )

    cached(dir, f"the {size} model and its GGUF", make)
    return dir / "hf", dir / "model-f32.gguf"


if __name__ == "__main__":
    built = llamacpp_build()
    print(built)
    print(*model(built, "100m", 0))
