"""`pagedchat` refuses bad flags and bad models before the screen opens: one line, exit 2, no traceback."""

import json
import subprocess
import sys

import pytest

from pagedchat import cli
from pagedchat.engine.llm import DEFAULT_NUM_KV_BLOCKS


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


def test_help_names_the_engines_default_pool():
    assert cli.DEFAULT_POOL_BLOCKS == DEFAULT_NUM_KV_BLOCKS


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
    (["--num-blocks", "100000000000"], "use fewer --num-blocks"),
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
