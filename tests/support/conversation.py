"""Shared by the tests of several modules."""

from support.models import byte_tokenizer

from pagedchat.engine.chat import ChatSession
from pagedchat.tui.conversation import Conversation

TOKENIZER = byte_tokenizer()


EOS = TOKENIZER.eos_token_id


def conversation(key: str = "chat-1", system: str | None = None) -> Conversation:
    return Conversation(lambda prompt: ChatSession(TOKENIZER, prompt), key, system)


def reply(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False) + [EOS]
