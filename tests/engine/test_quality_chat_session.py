"""ChatSession's suffix contract: its token ids are always the chat template's render of the whole
conversation, though it only ever encodes what each new message adds."""

import pytest
from support.models import byte_tokenizer

from pagedchat.engine.chat import ChatSession, RequestKey, chat_prompt, replay

TOKENIZER = byte_tokenizer()
END_OF_TURN = TOKENIZER.convert_tokens_to_ids("<|im_end|>")


def full_render(session: ChatSession) -> str:
    return TOKENIZER.apply_chat_template(session.messages, tokenize=False, add_generation_prompt=True)


def assert_matches_the_template(session: ChatSession) -> None:
    render = full_render(session)
    assert TOKENIZER.decode(session.token_ids, skip_special_tokens=False) == render
    # The byte-level tokenizer spells any text one way, so the ids themselves must agree too.
    assert session.token_ids == TOKENIZER.encode(render, add_special_tokens=False)


def reply(text: str, end_of_turn: bool) -> list[int]:
    """A reply's ids as the model would generate them: ending at EOS, or cut off (stopped, max_tokens)."""
    return TOKENIZER.encode(text, add_special_tokens=False) + ([END_OF_TURN] if end_of_turn else [])


@pytest.mark.parametrize("system_prompt", [None, "Answer in French."])
def test_the_session_is_the_template_render_after_every_turn(system_prompt):
    session = ChatSession(TOKENIZER, system_prompt)
    turns = [
        ("Hello there!", "Hi! How can I help?", True),
        ("Tell me a story.", "Once upon a time, a tiny mod", False),  # stopped mid-reply: no end of turn
        ("Go on — and ünïcödé, please ✓", "There was a model.", True),
        ("And then?", "It stopped", False),
        ("Thanks.", "You're welcome.", True),
    ]
    sent: list[int] = []
    for user, answer, ends in turns:
        sent += session.user_turn(user)
        assert session.token_ids == sent  # each turn sends only what it adds
        assert_matches_the_template(session)
        reply_ids = reply(answer, ends)
        assert (reply_ids[-1] == END_OF_TURN) if ends else (END_OF_TURN not in reply_ids)
        session.add_reply(reply_ids)
        sent += reply_ids
        assert session.token_ids == sent  # the reply's ids are kept exactly as generated
    assert [m["content"] for m in session.messages if m["role"] == "assistant"] == [t[1] for t in turns]
    assert full_render(session).count("<|im_start|>system") == 1


def test_a_reply_known_only_by_its_text_is_tokenized_once_where_the_model_would_end_it():
    known = ChatSession(TOKENIZER, "Be brief.")
    known.user_turn("Hi")
    known.add_reply(reply("Hello!", end_of_turn=False), "Hello!")
    by_text = replay(ChatSession(TOKENIZER, "Be brief."), [("user", "Hi", None), ("assistant", "Hello!", None)])
    assert by_text.token_ids == known.token_ids
    assert by_text.user_turn("And?") == known.user_turn("And?")
    assert_matches_the_template(by_text)


def test_a_whole_conversation_in_one_go_is_the_template_render():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat_prompt(TOKENIZER, messages) == ChatSession(TOKENIZER, "Be brief.").user_turn("Hi")
    without = chat_prompt(TOKENIZER, messages, add_generation_prompt=False)
    assert TOKENIZER.decode(without, skip_special_tokens=False).endswith("Hi<|im_end|>\n")


@pytest.mark.parametrize("key, text", [(RequestKey("chat-1"), "chat-1.1"), (RequestKey("chat-12", 3), "chat-12.3"),
                                       (RequestKey("chat-2", 1, 2), "chat-2.1#2"), (RequestKey("a.b", 4), "a.b.4")])
def test_a_request_key_reads_back_from_its_string(key, text):
    assert str(key) == text and RequestKey.parse(text) == key


@pytest.mark.parametrize("request_id", ["chatcmpl-0a1b", "generate-3", ".1", "chat-1.x", "chat-1.1#x", "chat-1"])
def test_ids_no_conversation_made_are_no_request_key(request_id):
    assert RequestKey.parse(request_id) is None
