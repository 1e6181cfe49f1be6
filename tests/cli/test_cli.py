"""`pagedchat` refuses bad flags and bad models before the screen opens: one line, exit 2, no traceback."""

import json
import subprocess
import sys

import pytest

from pagedchat import cli
from pagedchat.engine import config as engine_config
from pagedchat.engine.config import DEFAULT_NUM_KV_BLOCKS


def run(*args: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedchat", *args], capture_output=True, text=True,
                          env={"XDG_STATE_HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path),
                               "PATH": "/usr/bin:/bin"}, timeout=120)


@pytest.mark.parametrize("args, says", [
    (["--block-size", "0"], "--block-size must be at least 1, got 0"),
    (["--num-blocks", "4", "--kv-memory", "1GB"], "not allowed with argument"),
    (["--model", "/no/such/model"], "model not found: /no/such/model"),
    (["--theme", "nope"], "unknown theme 'nope'"),
    (["--max-num-seqs", "-3"], "--max-num-seqs must be at least 1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--backend", "cuda"], "invalid choice: 'cuda'"),
    (["--demo", "bogus"], "invalid choice: 'bogus'"),
    # attach mode: the local engine's flags, even at their default value, and the attach flags alone
    (["--attach", "http://127.0.0.1:9", "--block-size", "16"], "--block-size sets up the local engine"),
    (["--attach", "http://127.0.0.1:9", "--model=/x"], "--model sets up the local engine"),
    (["--kv-events", "tcp://127.0.0.1:5557"], "--kv-events needs --attach URL"),
    (["--api-key", "k"], "--api-key needs --attach URL"),
    (["--attach", "127.0.0.1:8000"], "--attach needs an http:// or https:// URL"),
    (["--attach", "http://127.0.0.1:9", "--dp-size", "0"], "--dp-size must be at least 1, got 0"),
    (["--attach", "http://127.0.0.1:9", "--kv-events", "tcp://h"], "--kv-events"),
])
def test_bad_flags_exit_2_with_one_line(args, says, tmp_path):
    done = run(*args, tmp_path=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedchat: error: ") and says in lines[0], lines


def test_help_and_version(tmp_path):
    done = run("--help", tmp_path=tmp_path)
    assert done.returncode == 0
    assert f"defaults to {DEFAULT_NUM_KV_BLOCKS} blocks" in " ".join(done.stdout.split())
    for flag in ("--model", "--block-size", "--num-blocks", "--kv-memory", "--max-model-len", "--max-num-seqs",
                 "--max-batched-tokens", "--no-prefix-caching", "--backend", "--device", "--dtype", "--theme",
                 "--demo", "--no-history", "--version"):
        assert flag in done.stdout
    assert run("--version", tmp_path=tmp_path).stdout.startswith("pagedchat 0.")


def broken_copy(tiny_model, tmp_path, breaks: str):
    """A copy of the tiny model with one thing wrong."""
    import shutil

    model = tmp_path / breaks
    shutil.copytree(tiny_model, model)
    if breaks == "architecture":
        config = json.loads((model / "config.json").read_text())
        config["model_type"] = "gpt2"
        (model / "config.json").write_text(json.dumps(config))
    elif breaks == "tokenizer":
        (model / "tokenizer.json").unlink()
    elif breaks == "weights":
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif breaks == "config":
        (model / "config.json").unlink()
    return model


@pytest.mark.parametrize("breaks, says", [
    ("architecture", "unsupported architecture 'gpt2'"),
    ("tokenizer", "has no tokenizer"),
    ("weights", "is truncated"),
    ("config", "has no config.json"),
])
def test_bad_models_exit_2_with_one_line(breaks, says, tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "state"))
    assert cli.main(["--model", str(broken_copy(tiny_model, tmp_path, breaks))]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and says in lines[0], lines


@pytest.mark.parametrize("args, says", [
    (["--kv-memory", "1KB"], "less than one KV block"),
    (["--kv-memory", "lots"], "not a size"),
    (["--max-model-len", "5000"], "exceeds the model's context of 1024"),
    (["--num-blocks", "8", "--max-model-len", "512"], "does not fit the pool of 8 blocks"),
    (["--num-blocks", "100000000000"], "ask for fewer num_kv_blocks"),
    (["--device", "tpu"], "unknown device 'tpu'"),
])
def test_pool_and_device_flags_are_checked_against_the_model(args, says, tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert cli.main(["--model", str(tiny_model), *args]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and says in lines[0], lines


def test_an_unusable_history_is_refused_with_a_way_around(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    database = tmp_path / "pagedchat" / "history.sqlite3"
    database.parent.mkdir()
    database.write_bytes(b"this is not a database" * 100)
    assert cli.main(["--model", str(tiny_model)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "cannot open the chat history" in lines[0] and "--no-history" in lines[0]


def test_the_log_goes_to_the_xdg_state_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert cli.state_dir() == tmp_path / "pagedchat"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cli.state_dir() == tmp_path / "home" / ".local" / "state" / "pagedchat"


def test_parse_size_takes_terabytes():
    from pagedchat.engine.config import parse_size

    assert parse_size("1TB") == 10**12
    assert parse_size("2 TiB") == 2 * 2**40
    assert parse_size("1.5tb") == 1_500_000_000_000


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedchat: error: "), lines
    return lines[0]


@pytest.mark.parametrize("flag, value", [("--kv-memory", "1TB"), ("--num-blocks", "100000000000")])
def test_a_pool_too_large_for_the_machine_names_the_flag_given(flag, value, tiny_model, tmp_path, capsys,
                                                                monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(engine_config, "_available_memory", lambda device: 24 * 10**9)
    assert cli.main(["--model", str(tiny_model), "--device", "cpu", flag, value]) == 2
    line = one_error_line(capsys)
    assert f"({flag}) is too large" in line and "not a size" not in line, line
    other = {"--kv-memory": "--num-blocks", "--num-blocks": "--kv-memory"}[flag]
    assert other not in line and "22,888 MiB are free on cpu" in line, line


def needed_for(tiny_model, kv_memory: str) -> tuple[int, int]:
    """The pool's blocks for `kv_memory` in float32, and the memory the pool and the weights need with
    the headroom, counted by hand: the tiny model is stored in float32, so its weights are its tensors' bytes."""
    import torch
    from safetensors import safe_open

    from pagedchat.engine.config import parse_size
    from pagedchat.engine.loading.loader import check_model
    from pagedchat.engine.worker.model_runner import KVLayout

    config = check_model(tiny_model)
    per_block = KVLayout.of(config).bytes_per_block(16, torch.float32)
    num_blocks = parse_size(kv_memory) // per_block
    with safe_open(tiny_model / "model.safetensors", framework="pt") as weights:
        weight_bytes = sum(weights.get_tensor(k).nbytes for k in weights.keys())
    return num_blocks, num_blocks * per_block + weight_bytes + 2 * 2**30


def pool_args(tiny_model, kv_memory: str, dtype: str = "float32"):
    return cli.build_parser().parse_args(["--model", str(tiny_model), "--device", "cpu", "--dtype", dtype,
                                          "--kv-memory", kv_memory])


def test_a_pool_that_fits_only_without_the_weights_and_headroom_is_refused(tiny_model, monkeypatch):
    num_blocks, needed = needed_for(tiny_model, "20GB")
    monkeypatch.setattr(engine_config, "_available_memory", lambda device: needed - 1)
    with pytest.raises(cli.UsageError) as refused:
        cli.checked_config(pool_args(tiny_model, "20GB"))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("kv_cache_memory 20GB (--kv-memory) is too large"), message
    assert f"a pool of {num_blocks} blocks (19,073 MiB)" in message and "+ 2,048 MiB to spare" in message
    assert f"only {(needed - 1) / 2**20:,.0f} MiB are free on cpu: ask for a smaller kv_cache_memory" in message
    from pagedchat.engine.llm import LLM

    with pytest.raises(ValueError) as from_python:  # LLM(...) from Python refuses it with the same line
        LLM(model=str(tiny_model), device="cpu", dtype="float32", kv_cache_memory="20GB")
    assert str(from_python.value) == message


def test_a_pool_that_fits_beside_the_weights_and_headroom_is_taken(tiny_model, monkeypatch):
    num_blocks, needed = needed_for(tiny_model, "1TB")
    monkeypatch.setattr(engine_config, "_available_memory", lambda device: needed)
    assert cli.checked_config(pool_args(tiny_model, "1TB")).engine.num_kv_blocks == num_blocks


def test_the_weights_are_counted_in_the_dtype_they_are_loaded_in(tiny_model, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from pagedchat.engine.loading.loader import weights_bytes

    stored = (tiny_model / "model.safetensors").stat().st_size  # float32, plus a small header
    as_float32 = weights_bytes(tiny_model, torch.float32)
    assert 0.95 * stored < as_float32 < stored
    assert weights_bytes(tiny_model, torch.bfloat16) == as_float32 // 2
    tensors = load_file(tiny_model / "model.safetensors")
    save_file({k: t.to(torch.bfloat16) for k, t in tensors.items()}, tmp_path / "model.safetensors")
    assert weights_bytes(tmp_path, torch.float32) == as_float32  # bf16 weights loaded as float32 double
    assert weights_bytes(tmp_path, torch.bfloat16) == as_float32 // 2


@pytest.fixture
def no_weights_load(monkeypatch):
    """--help and --version read a GGUF's header and build kernels, never load weights."""
    from pagedchat.engine.loading import gguf, loader

    def refused(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loader, "load_model", refused)
    monkeypatch.setattr(gguf, "open_model", refused)


def test_help_says_what_the_default_model_holds_in_memory(no_weights_load):
    import gguf

    from pagedchat.engine.loading import loader

    path = loader.installed_default_model()
    if path is None:
        pytest.skip("the default model is not installed")
    # the reference: gguf's own reader of the file, and the pool the engine would allocate
    reader = gguf.GGUFReader(path)
    sizes: dict[str, int] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) == 2:
            sizes[tensor.tensor_type.name] = sizes.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    mapped = sum(int(tensor.n_bytes) for tensor in reader.tensors)
    resolved = engine_config.EngineArgs().resolve(progress=False)
    assert resolved.weights_bytes == mapped  # every type runs in place: no copies
    cache_dtype = str(resolved.engine.kv_cache_dtype).removeprefix("torch.")
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[cache_dtype]
    says = (f"(default: SmolLM2-135M-Instruct: {'/'.join(sorted(sizes, key=sizes.get, reverse=True))} GGUF, "
            f"{mapped / 1e6:.0f} MB mapped, beside a KV pool of {resolved.pool_bytes / 1e6:,.0f} MB: "
            f"{DEFAULT_NUM_KV_BLOCKS} blocks of 16 tokens in {dtype})")
    assert says.startswith("(default: SmolLM2-135M-Instruct: Q4_1/Q8_0 GGUF, 97 MB mapped")
    for parser in (cli.build_parser(), cli.build_serve_parser()):
        assert says in " ".join(parser.format_help().split())


def test_version_says_which_kernels_multiply_each_kind_of_weights(no_weights_load, capsys):
    from pagedchat.kernels import quant

    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    version, in_place, isas, others, folder = capsys.readouterr().out.splitlines()
    assert version == "pagedchat 0.1.0"
    assert in_place.startswith(f"GGUF: Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K on {quant.isa()}: quant kernels")
    assert "F32/F16/BF16 cpu_gemm" in in_place  # on a CPU with AVX2, where cpu_gemm.c builds
    instruction = {"avx2": "maddubs", "portable": "portable C"}.get(quant.isa(), "vpdpbusd")
    assert isas == (f"  cpu_quant.c on {quant.isa()} ({instruction}); this CPU runs its builds for "
                    f"{', '.join(quant.available_isas())}")
    assert others.startswith("  other GGUF types (IQ*, Q2_K, Q3_K, ...)")
    assert folder.startswith("Hugging Face folder: bf16 on ")
