"""Shared by the tests of several modules."""

import re
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

STARTUP_S = 120  # importing torch and transformers on a busy 2-core machine can take a minute


class Terminal:
    """A detached tmux session, 160x50, running a shell command, on a tmux server of its own (-L)
    so that the test never touches the user's sessions."""

    def __init__(self, command: str) -> None:
        self.tmux = ["tmux", "-L", f"pagedchat-test-{uuid.uuid4().hex[:8]}"]
        subprocess.run([*self.tmux, "new-session", "-d", "-x", "160", "-y", "50", command], check=True)

    def screen(self) -> str:
        return subprocess.run([*self.tmux, "capture-pane", "-p", "-J"], capture_output=True, text=True).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", *keys], check=True)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if match := re.search(pattern, self.screen()):
                return match
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} did not appear in {timeout} s; the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


def pagedchat(*args: str, state: Path) -> str:
    """The shell command: the app, then its exit status, then a pause so capture-pane can read what
    it printed after the screen closed (the app draws on stderr, so stderr cannot go to a file)."""
    # COLUMNS and LINES from the test process would override the pane's real size.
    command = shlex.join(["env", "-u", "COLUMNS", "-u", "LINES", f"XDG_STATE_HOME={state}",
                          f"XDG_DATA_HOME={state}", sys.executable, "-m", "pagedchat", *args])
    return f"{command}; echo exit=$?; sleep 600"


def tiny_chat(tiny_model: Path, state: Path) -> Terminal:
    """The app on the tiny model with a 64-block pool, loaded and waiting for a message."""
    term = Terminal(pagedchat("--model", str(tiny_model), "--dtype", "float32", "--device", "cpu",
                              "--num-blocks", "64", state=state))
    term.wait_for(r"free 64/64 blocks", STARTUP_S)
    return term


def send(term: Terminal, text: str) -> None:
    """Type a message and wait until it is in the conversation (the tiny model may have answered it
    whole between two frames, so "generating" need not ever show)."""
    term.keys(text, "Enter")
    term.wait_for(rf"(?m)^ *▌ {re.escape(text)}", 30)
