"""Conversations saved as they happen, in SQLite, so that no finished message is ever lost.

Every write commits at once, in WAL mode with `synchronous=NORMAL`: a commit is in the write-ahead log
when the call returns, so a `kill -KILL` loses nothing that was written, and no commit waits for an
fsync (only an OS crash or a power cut can lose the last commits; the file stays whole). A reply in
progress is rewritten every few tokens by the app, from its UI thread.
"""

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE chats (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT,
    settings TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    closed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chats(id),
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    complete INTEGER NOT NULL DEFAULT 1,
    created REAL NOT NULL
);
CREATE INDEX messages_by_chat ON messages(chat_id, id);
"""


def default_path() -> Path:
    return platformdirs.user_data_path("pagedchat", appauthor=False) / "history.sqlite3"  # honours XDG_DATA_HOME


@dataclass(slots=True)
class SavedChat:
    chat_id: int
    title: str
    system_prompt: str | None
    settings: dict
    messages: list[dict[str, str]] = field(default_factory=list)  # {"role", "content"}; a cut-off reply included


class History:
    """The chat store. Safe to call from any thread (one connection behind a lock)."""

    def __init__(self, path: Path | None = None):
        self.path = path or default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        # journal_mode is kept in the file, synchronous is per connection: both are set at every open
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._migrate()

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            self._db.executescript(f"BEGIN; {SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
        elif version > SCHEMA_VERSION:
            raise RuntimeError(f"{self.path} was written by a newer pagedchat (schema {version})")

    def _run(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def new_chat(self, title: str, system_prompt: str | None = None, settings: dict | None = None) -> int:
        cur = self._run("INSERT INTO chats (title, system_prompt, settings, created) VALUES (?, ?, ?, ?)",
                        (title, system_prompt, json.dumps(settings or {}), time.time()))
        return cur.lastrowid

    def update_chat(self, chat_id: int, system_prompt: str | None, settings: dict) -> None:
        self._run("UPDATE chats SET system_prompt = ?, settings = ? WHERE id = ?",
                  (system_prompt, json.dumps(settings), chat_id))

    def add_message(self, chat_id: int, role: str, content: str, complete: bool = True) -> int:
        cur = self._run("INSERT INTO messages (chat_id, role, content, complete, created) VALUES (?, ?, ?, ?, ?)",
                        (chat_id, role, content, int(complete), time.time()))
        return cur.lastrowid

    def update_message(self, message_id: int, content: str, complete: bool) -> None:
        self._run("UPDATE messages SET content = ?, complete = ? WHERE id = ?", (content, int(complete), message_id))

    def delete_message(self, message_id: int) -> None:
        self._run("DELETE FROM messages WHERE id = ?", (message_id,))

    def close_chat(self, chat_id: int) -> None:
        """The tab was closed: keep the chat, but do not offer it back at the next start."""
        self._run("UPDATE chats SET closed = 1 WHERE id = ?", (chat_id,))

    def reopen_chat(self, chat_id: int) -> None:
        self._run("UPDATE chats SET closed = 0 WHERE id = ?", (chat_id,))

    def open_chats(self) -> list[SavedChat]:
        """The chats whose tabs were open when the app last stopped, oldest first."""
        rows = self._run("SELECT id, title, system_prompt, settings FROM chats WHERE closed = 0 ORDER BY id").fetchall()
        return [self.load(chat_id, title, system_prompt, settings) for chat_id, title, system_prompt, settings in rows]

    def load(self, chat_id: int, title: str, system_prompt: str | None, settings: str) -> SavedChat:
        messages = self._run("SELECT role, content FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,)).fetchall()
        chat = SavedChat(chat_id, title, system_prompt, json.loads(settings))
        chat.messages = [{"role": role, "content": content} for role, content in messages if content]
        return chat

    def close(self) -> None:
        with self._lock:
            self._db.close()
