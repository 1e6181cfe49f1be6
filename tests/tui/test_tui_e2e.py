"""The real app in a real terminal: tmux starts `pagedchat`, send-keys types, capture-pane reads."""

import json
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from support.terminal import STARTUP_S, Terminal, pagedchat, send, tiny_chat

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (apt-get install tmux); .ci/run installs it")


def test_chat_in_a_real_terminal(tiny_model, tmp_path):
    term = tiny_chat(tiny_model, tmp_path)
    try:
        send(term, "Hello, tiny model")
        term.wait_for(r"free (?!64/)\d+/64 blocks", 30)  # the conversation holds blocks
        time.sleep(1.0)
        term.keys("Escape")  # stops the reply, unless the random model ended it first
        reply = term.wait_for(r"reply (\d+) tok", 30)
        assert int(reply[1]) > 0
        term.wait_for(r"chat 1 +\d+ tok · idle", 5)
        assert "Hello, tiny model" in term.screen()
        term.keys("C-q")
        term.wait_for(r"(?m)^exit=0$", 30)
        assert term.screen().strip() == "exit=0"  # the terminal is restored and nothing else printed
    finally:
        term.close()


def test_a_model_that_fails_to_load_exits_1_with_one_line(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] *= 2  # every check passes; loading the weights cannot
    (broken / "config.json").write_text(json.dumps(config))
    term = Terminal(pagedchat("--model", str(broken), "--dtype", "float32", "--device", "cpu", state=tmp_path))
    try:
        term.wait_for(r"(?m)^exit=\d+$", STARTUP_S)
        lines = term.screen().strip().splitlines()
    finally:
        term.close()
    assert lines[-1] == "exit=1"
    log = tmp_path / "pagedchat" / "pagedchat.log"
    assert len(lines) == 2 and lines[0].startswith("pagedchat: error: "), lines
    assert lines[0].endswith(f"(details in {log})")
    assert "Traceback" in log.read_text()


def saved_messages(tmp_path: Path) -> list[tuple[str, str, int]]:
    """(role, content, complete) of every saved message, read beside the running app (WAL mode)."""
    database = sqlite3.connect(tmp_path / "pagedchat" / "history.sqlite3")
    try:
        return database.execute("SELECT role, content, complete FROM messages ORDER BY id").fetchall()
    finally:
        database.close()


# The KV panel's lines 2 and 3 (beside the chat on the same screen lines): one snapshot's running count and step.
STATS = r"run (\d+) · wait \d+ · preempted \d+ \(\d+ total\) · parked \d+[\s▏]+prefix hits .*? · step {step}\b"


def one_step(term: Terminal, step: int) -> bool:
    """f6 on the paused engine: wait for step `step` on screen; whether a request still runs after it.
    Nothing steps but f6, so the frame that shows step `step` shows the engine as it now stays."""
    term.keys("F6")
    return int(term.wait_for(STATS.format(step=step), 10)[1]) > 0


def test_kill_during_a_reply_loses_no_finished_message(tiny_model, tmp_path):
    """SIGKILL mid-reply: the finished messages are in the database, and the reply in progress up to
    its last save. The engine is paused from the start and driven a step at a time (f6), so that the
    screen says for sure whether the reply is still running when the app is killed."""
    term = tiny_chat(tiny_model, tmp_path)
    try:
        term.keys("F5")
        term.wait_for(r"Engine paused", 10)
        step = 0
        send(term, "first message")
        running = True
        while running and step < 12:  # the prompt, then some tokens, unless EOS ends the reply first
            step += 1
            running = one_step(term, step)
        if running:
            term.keys("Escape")  # a stopped reply is a finished message too
            step += 1
            assert not one_step(term, step)  # the step that reports the stop
        first_turn = term.wait_for(r"last turn: prompt (\d+) tok", 10)  # the app has recorded the reply
        send(term, "second message")
        for _ in range(300):  # until a save of the reply in progress is in the database, or it ends
            step += 1
            running = one_step(term, step)
            if not running or saved_messages(tmp_path)[3][1]:
                break
        else:
            raise AssertionError(f"no save of the reply in progress after 300 steps; the screen:\n{term.screen()}")
        if not running:  # EOS ended the reply: wait until the app has recorded it, as the turn line shows
            term.wait_for(rf"last turn: prompt (?!{first_turn[1]} )\d+ tok", 10)
        saved = saved_messages(tmp_path)
        pid = subprocess.run([*term.tmux, "display", "-p", "#{pane_pid}"], capture_output=True,
                             text=True).stdout.strip()
        app = subprocess.run(["pgrep", "-P", pid, "-f", "pagedchat"], capture_output=True, text=True).stdout.split()
        subprocess.run(["kill", "-KILL", *app], check=True)
        term.wait_for(r"exit=137", 10)
    finally:
        term.close()
    rows = saved_messages(tmp_path)
    # cut off (0) while the paused engine still ran it; finished (1) when EOS came first
    assert [(role, complete) for role, _, complete in rows] == [
        ("user", 1), ("assistant", 1), ("user", 1), ("assistant", 0 if running else 1)]
    assert rows[0][1] == "first message" and rows[2][1] == "second message"
    assert rows[1][1] and rows[3][1]  # the stopped reply, and the cut-off one as of its last save
    assert rows == saved  # the kill lost nothing that was saved


def test_ctrl_o_reaches_the_app_and_opens_the_message_in_a_new_tab(tiny_model, tmp_path):
    """Edit and resend (ctrl+o), even while the reply streams: the list, then a new tab with the message
    in its box."""
    term = tiny_chat(tiny_model, tmp_path)
    try:
        send(term, "Hello, tiny model")
        term.keys("C-o")
        term.wait_for(r"Edit and resend a message of chat 1", 10)
        term.keys("Enter")
        term.wait_for(r"chat 1 \(edit\)", 10)
        term.wait_for(r"(?m)^ Hello, tiny model", 10)  # in the new tab's box, not its transcript (▌)
        assert "Edit and resend" not in term.screen()
        term.keys("C-q")
        term.wait_for(r"(?m)^exit=0$", 30)
    finally:
        term.close()
