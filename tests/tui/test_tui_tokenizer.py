"""Fast tokenizers are not thread-safe: the UI thread tokenizes with its own instance, never the engine's."""

import asyncio

from support.models import byte_tokenizer
from support.app import SIZE, loaded, reply_done
from support.engine import hf_greedy
from support.tui import async_test
from textual.widgets import TabbedContent

from pagedchat import LLM, SamplingParams
from pagedchat.engine.chat import ChatSession
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.message_box import MessageBox

LENGTH = 400
REPLY = SamplingParams(temperature=0.0, max_tokens=LENGTH, min_tokens=LENGTH)  # min_tokens: as HF masks EOS
MESSAGES = [f"Tab {n}: tell me about the number {n * 17}." for n in range(4)]


@async_test
async def test_the_ui_encodes_long_messages_while_four_replies_stream(tiny_model):
    llms: list[LLM] = []

    def load() -> LLM:
        llms.append(LLM(model=tiny_model, dtype="float32", device="cpu", attention_backend="torch", num_kv_blocks=96))
        return llms[-1]

    async with PagedChatApp(load, params=REPLY).run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        engine_tokenizer = llms[0].get_tokenizer()
        assert app.source.tokenizer is not engine_tokenizer
        assert app.source.tokenizer._tokenizer is not engine_tokenizer._tokenizer  # not even the Rust object
        await pilot.press("f5")  # the four replies start together
        panes = []
        for number, text in enumerate(MESSAGES):
            if number:
                await pilot.press("ctrl+n")
                await pilot.pause()
            pane = app.current_pane
            pane.query_one(MessageBox).text = text
            await pilot.press("enter")
            panes.append(pane)
        assert all(pane.replying for pane in panes)
        app.worker.set_paused(False)  # not by key: a key press can take longer than the replies
        long_message = "A long message, pasted while replies stream. " * 400
        encoded = 0
        while any(pane.replying for pane in panes) and encoded < 10_000:
            # What the UI does with a message: encode it plainly, and with truncation, whose settings
            # the Rust tokenizer changes in place (a borrow that another thread's decode would break).
            assert app.source.tokenizer.encode(long_message, add_special_tokens=False)
            assert len(app.source.tokenizer(long_message, truncation=True, max_length=64)["input_ids"]) == 64
            encoded += 1
            await asyncio.sleep(0)
        await reply_done(pilot, *panes)
        assert encoded >= 3, "the replies ended before the UI encoded anything"
        assert app.query_one(TabbedContent).tab_count == 4

        tokenizer = byte_tokenizer()
        for pane, text in zip(panes, MESSAGES):
            prompt = ChatSession(tokenizer).user_turn(text)
            reply = pane.conversation.last_reply
            assert list(reply.token_ids) == hf_greedy(tiny_model, prompt, LENGTH, min_new_tokens=LENGTH), text
