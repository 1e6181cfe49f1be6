"""README's vLLM server command and `python -m bench...`, run from the checkout, import the `kernels` package
that vLLM and transformers mean, not the checkout's kernels/ (which is pagedchat.kernels once installed).

vLLM is not installed here: stand-ins under vLLM's and that package's names, on PYTHONPATH, show what the
command's interpreter flags make `import kernels` find."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bench import peers

CHECKOUT = Path(__file__).resolve().parents[2]
# what vLLM's server module would meet: where `kernels` comes from, and its own arguments
REPORT = "import kernels, sys; print(kernels.__file__); print(sys.argv[1:])"


def stand_ins(tmp_path: Path) -> Path:
    """A folder with a `kernels` package (the one vLLM and transformers import) and vLLM's server module."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    server = tmp_path / "vllm" / "entrypoints" / "openai" / "api_server.py"
    server.parent.mkdir(parents=True)
    server.write_text(REPORT)
    return tmp_path


def run_from_checkout(command: list[str], path: Path) -> list[str]:
    done = subprocess.run(command, check=False, cwd=CHECKOUT, env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def readme_vllm_server_flags() -> list[str]:
    """The interpreter's arguments in README's vLLM command, e.g. ['-P', '-m', 'vllm.entrypoints.openai.api_server']."""
    line = next(line for line in (CHECKOUT / "README.md").read_text().splitlines()
                if "bench-peers/vllm/bin/python" in line)
    words = shlex.split(line.rstrip("\\"))
    return words[next(i for i, word in enumerate(words) if word.endswith("/bin/python")) + 1:]


def test_readmes_vllm_command_imports_the_kernels_package_not_the_checkouts(tmp_path):
    path = stand_ins(tmp_path)
    flags = readme_vllm_server_flags()
    assert flags[-2:] == ["-m", "vllm.entrypoints.openai.api_server"]
    found, _ = run_from_checkout([sys.executable, *flags], path)
    assert Path(found) == path / "kernels" / "__init__.py"


def test_the_bench_starts_vllm_the_same_way(tmp_path):
    path = stand_ins(tmp_path)
    command = peers.vllm_server_command("--port", "8100")
    assert command[1:] == readme_vllm_server_flags() + ["--port", "8100"]
    found, args = run_from_checkout([sys.executable, *command[1:]], path)
    assert Path(found) == path / "kernels" / "__init__.py" and args == "['--port', '8100']"


@pytest.mark.parametrize("first", ["bench", "pagedchat.__main__"])
def test_bench_and_pagedchat_run_from_the_checkout_leave_kernels_to_the_package(first, tmp_path):
    """`python -m bench.peers folder` (inside README's command) and `python -m pagedchat` load models with
    transformers, which imports `kernels`: once bench or pagedchat's __main__ is imported, the checkout is
    behind the other folders of sys.path."""
    path = stand_ins(tmp_path)
    imports = "import bench" if first == "bench" else \
        "import contextlib, runpy; sys.argv[1:] = ['--version']\nwith contextlib.suppress(SystemExit): " \
        "runpy.run_module('pagedchat', run_name='__main__')"
    *_, found, _ = run_from_checkout([sys.executable, "-c", f"import sys; {imports}\n{REPORT}"], path)
    assert Path(found) == path / "kernels" / "__init__.py"
