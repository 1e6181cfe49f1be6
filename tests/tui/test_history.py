"""The SQLite chat store: what is written survives a new process, a reply in progress included."""

import sqlite3
import subprocess
import sys

import pytest

from pagedchat.history import SCHEMA_VERSION, History


def test_chats_round_trip_and_closed_tabs_are_not_offered(tmp_path):
    path = tmp_path / "h.sqlite3"
    store = History(path)
    a = store.new_chat("chat 1", "Be brief.", {"temperature": 0.7})
    b = store.new_chat("chat 2")
    store.add_message(a, "user", "Hi")
    reply = store.add_message(a, "assistant", "Hel", complete=False)
    store.update_message(reply, "Hello!", complete=True)
    store.add_message(b, "user", "Bye")
    store.close_chat(b)
    store.close()

    chats = History(path).open_chats()
    assert [c.chat_id for c in chats] == [a]
    assert chats[0].system_prompt == "Be brief." and chats[0].settings == {"temperature": 0.7}
    assert chats[0].messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_killed_writer_loses_nothing_it_wrote(tmp_path):
    """A process killed with SIGKILL right after writing: every message it wrote is there."""
    path = tmp_path / "h.sqlite3"
    script = (
        "import os, signal\n"
        "from pathlib import Path\n"
        "from pagedchat.history import History\n"
        f"h = History(Path({str(path)!r}))\n"
        "c = h.new_chat('t')\n"
        "h.add_message(c, 'user', 'question')\n"
        "m = h.add_message(c, 'assistant', 'partial', complete=False)\n"
        "h.update_message(m, 'partial answer so far', complete=False)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script])
    assert proc.returncode == -9
    (chat,) = History(path).open_chats()
    assert chat.messages == [{"role": "user", "content": "question"},
                             {"role": "assistant", "content": "partial answer so far"}]


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "h.sqlite3"
    sqlite3.connect(path).execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(RuntimeError, match="newer"):
        History(path)


def test_every_open_is_in_wal_mode_without_an_fsync_per_commit(tmp_path):
    """WAL + synchronous=NORMAL: durable when the app is killed, and no fsync on the UI thread per write.
    synchronous is per connection, so a store opened again on the same file must set it again."""
    path = tmp_path / "h.sqlite3"
    for _ in range(2):
        store = History(path)
        assert store._run("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert store._run("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        store.close()


def test_the_default_path_follows_xdg_data_home(tmp_path, monkeypatch):
    from pagedchat.history import default_path

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_path() == tmp_path / "pagedchat" / "history.sqlite3"
