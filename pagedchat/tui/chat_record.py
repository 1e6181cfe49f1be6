"""One tab's conversation written to the history database as it happens (`pagedchat.history`).

A finished message is written the moment it exists; a reply in progress is rewritten at least once a
second, so a crash or `kill -KILL` loses at most the last second of it.
"""

import time
from dataclasses import replace

from pagedchat.engine.api.params import SamplingParams
from pagedchat.history import History
from pagedchat.tui.conversation import Conversation
from pagedchat.tui.settings_screen import FIELDS

SAVE_EVERY_S = 1.0


# What a tab's settings hold: the f2 dialog's fields, saved with the chat and read back on restore.
SAVED_SETTINGS = tuple(name for row in FIELDS for name, _, _ in row)


def settings_of(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in SAVED_SETTINGS}


def params_of(settings: dict, defaults: SamplingParams) -> SamplingParams:
    """A saved tab's sampling: `defaults` with the settings it saved; a setting it has not saved (an
    older history's penalties) stays the default."""
    try:
        return replace(defaults, **{name: settings[name] for name in SAVED_SETTINGS if name in settings})
    except (TypeError, ValueError):  # settings a user could not have saved: the defaults
        return defaults


class ChatRecord:
    def __init__(self, history: History, conversation: Conversation, title: str) -> None:
        """A new chat in the history, holding the conversation's turns so far (a fork's or a
        restored chat's)."""
        self.history = history
        self.chat_id = history.new_chat(title, conversation.system_prompt, settings_of(conversation.params))
        self._rows = [history.add_message(self.chat_id, turn.role, turn.text) for turn in conversation.turns]
        self._saved_at = 0.0

    def user(self, text: str) -> None:
        self._rows.append(self.history.add_message(self.chat_id, "user", text))

    def reply_started(self, text: str = "") -> None:
        self._rows.append(self.history.add_message(self.chat_id, "assistant", text, complete=False))
        self._saved_at = time.monotonic()

    def reply_progress(self, text: str) -> None:
        if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self._saved_at = time.monotonic()
            self.history.update_message(self._rows[-1], text, complete=False)

    def reply_done(self, text: str) -> None:
        self.history.update_message(self._rows[-1], text, complete=True)

    def drop(self, count: int) -> None:
        """Forget the last `count` messages (a failed turn, a reply being regenerated)."""
        for _ in range(min(count, len(self._rows))):
            self.history.delete_message(self._rows.pop())

    def settings(self, conversation: Conversation) -> None:
        self.history.update_chat(self.chat_id, conversation.system_prompt, settings_of(conversation.params))

    def close(self) -> None:
        self.history.close_chat(self.chat_id)

    def reopen(self) -> None:
        self.history.reopen_chat(self.chat_id)
