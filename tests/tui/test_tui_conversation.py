"""A tab's conversation: what it sends the engine on each turn, and how it rebuilds itself."""

import pytest
from support.conversation import TOKENIZER, conversation, reply

from pagedchat.tui.conversation import ContextFull, MessageTooLong


def test_first_turn_adds_a_request_later_turns_continue_it():
    conv = conversation()
    first = conv.send("hi")
    assert first.new_request and first.request_id == "chat-1.1"
    assert first.token_ids == conv._session.token_ids
    conv.add_reply("hello", reply("hello"))
    second = conv.send("again")
    assert not second.new_request and second.request_id == "chat-1.1"
    assert conv._session.token_ids[-len(second.token_ids):] == second.token_ids
    assert [t.role for t in conv.turns] == ["user", "assistant", "user"]


def test_regenerate_resends_everything_before_the_last_reply_as_a_new_request():
    conv = conversation()
    prompt = conv.send("hi").token_ids
    conv.add_reply("hello", reply("hello"))
    old, send = conv.regenerate()
    assert old == "chat-1.1" and send.request_id == "chat-1.2" and send.new_request
    assert send.token_ids == prompt
    with pytest.raises(ValueError):
        conv.regenerate()


def test_a_message_that_does_not_fit_changes_nothing():
    conv = conversation()
    conv.send("hi")
    conv.add_reply("hello", reply("hello"))
    before = list(conv._session.token_ids)
    with pytest.raises(ContextFull):
        conv.send("x" * 200, max_len=len(before) + 50)
    assert conv._session.token_ids == before and len(conv.turns) == 2
    assert not conv.send("ok", max_len=len(before) + 50).new_request


def test_a_message_no_new_chat_could_take_is_too_long_not_a_full_context():
    conv = conversation()
    conv.send("hi")
    conv.add_reply("hello", reply("hello"))
    max_len = conv.num_tokens + 50
    with pytest.raises(ContextFull) as full:
        conv.send("x" * 40, max_len)  # a new chat has room for it
    assert not isinstance(full.value, MessageTooLong)
    with pytest.raises(MessageTooLong, match=f"{max_len:,}"):
        conv.send("x" * max_len, max_len)
    with pytest.raises(MessageTooLong):
        conversation().send("x" * max_len, max_len)  # the first turn of a new chat
    assert len(conv.turns) == 2 and not conv.send("ok", max_len).new_request


def test_fork_has_the_same_tokens_under_a_new_request():
    conv = conversation(system="be brief")
    conv.send("hi")
    conv.add_reply("hello", reply("hello"))
    twin = conv.fork("chat-2")
    assert twin.request_id == "chat-2.1" and twin._session.token_ids == conv._session.token_ids
    assert not twin.send("more").new_request  # continues the forked request


def test_a_failed_turn_and_a_new_system_prompt_start_a_new_request():
    conv = conversation()
    conv.send("hi")
    assert conv.fail_turn() == "chat-1.1" and conv.turns == [] and conv.num_tokens == 0
    conv.send("hi")
    conv.add_reply("hello", reply("hello"))
    assert conv.set_system_prompt("be brief") == "chat-1.2"
    send = conv.send("next")
    assert send.new_request and send.token_ids == conv._session.token_ids
    assert TOKENIZER.decode(send.token_ids).startswith("<|im_start|>system\nbe brief")
