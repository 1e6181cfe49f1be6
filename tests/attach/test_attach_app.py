"""`pagedchat --attach URL` against a real `pagedchat serve` on 127.0.0.1 (the tiny model): the tabs chat
through its API and the panel draws the server's own snapshot, the tabs' requests under the tabs' names."""

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from support.serve import KEY, Live, wait_for
from support.tui import async_test, wait_until

from pagedchat import SamplingParams
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.attached import AttachTarget
from pagedchat.tui.kv_panel import KVPanel
from pagedchat.tui.loading_screen import LoadingScreen

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def live(tiny_model):
    server = Live(tiny_model)
    yield server
    server.stop()


def attached_app(live, params: SamplingParams = GREEDY, api_key: str = KEY) -> PagedChatApp:
    return PagedChatApp(None, attach=AttachTarget(live.url, api_key), params=params)


async def ready(pilot) -> PagedChatApp:
    app = pilot.app
    await wait_until(pilot, lambda: app.current_pane is not None and not isinstance(app.screen, LoadingScreen),
                     what="the first tab")
    return app


async def say(pilot, pane, text: str) -> None:
    assert pane.send(text)
    await wait_until(pilot, lambda: not pane.replying, what="the reply", timeout=60)


def servers_replies(live, turns) -> list[dict]:
    """The server's own greedy replies to the user turns of `turns`, in a session of its own (which keeps
    the model's reply tokens, as the tab's does, rather than re-tokenizing their text)."""
    messages, replies = [], []
    for turn in turns:
        if turn.role == "user":
            body = {"messages": messages + [{"role": "user", "content": turn.text}], "temperature": 0,
                    "max_tokens": GREEDY.max_tokens, "return_token_ids": True, "session_id": "reference"}
            replies.append(live.http.post("/v1/chat/completions", json=body).json()["choices"][0])
            messages += [{"role": "user", "content": turn.text},
                         {"role": "assistant", "content": replies[-1]["message"]["content"]}]
    live.state.served.sessions.close("reference")
    return replies


@async_test
async def test_two_tabs_chat_through_the_server_and_the_panel_draws_its_snapshot(live):
    app = attached_app(live)
    async with app.run_test(size=(160, 50)) as pilot:
        first = (await ready(pilot)).current_pane
        await say(pilot, first, "Hello there")
        await say(pilot, first, "And again")
        await app.action_new_chat()
        second = app.current_pane
        await say(pilot, second, "Something else")

        for pane in (first, second):
            turns = pane.conversation.turns
            replies = [turn for turn in turns if turn.role == "assistant"]
            assert len(replies) == len(turns) // 2
            for reply, expected in zip(replies, servers_replies(live, turns), strict=True):
                assert reply.text == expected["message"]["content"]
                assert list(reply.token_ids) == expected["token_ids"]

        # Both conversations stay parked in their sessions (the reference session's close lands a step later).
        wait_for(lambda: len(live.snapshot()["requests"]) == 2, "the reference session to close")
        server = live.snapshot()
        ours = {first.conversation.request_id, second.conversation.request_id}
        await wait_until(pilot, lambda: {(r.request_id, r.status) for r in app.query_one(KVPanel).snapshot.requests}
                         == {(request_id, "parked") for request_id in ours}, what="the panel to name the tabs' requests")
        drawn = app.query_one(KVPanel).snapshot
        assert sorted(r["status"] for r in server["requests"]) == ["parked", "parked"]
        assert (drawn.num_blocks, drawn.block_size) == (server["num_blocks"], server["block_size"])
        names = {info.request_id: info for info in drawn.requests}
        for request in server["requests"]:
            ours_id = app.attached.chat.server_ids[request["request_id"]]
            assert names[ours_id].block_table == tuple(request["block_table"])
            assert names[ours_id].num_tokens == request["num_tokens"]
        # The tab's own count is the server's: prompt (chat template applied there) plus reply.
        info = names[first.conversation.request_id]
        assert len(app.attached.chat.contexts[first.conversation.request_id]) == info.num_tokens
        assert "prompt" in str(first.query_one("#turn-info").render())
    for pane in (first, second):  # the next test starts from a whole pool
        live.state.served.sessions.close(app.attached.chat.session_id(pane.conversation.request_id))
    live.wait_until_idle()


@async_test
async def test_escape_closes_the_stream_and_the_server_aborts_the_reply(live):
    app = attached_app(live, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    async with app.run_test(size=(160, 50)) as pilot:
        pane = (await ready(pilot)).current_pane
        pane.send("Go on and on")
        await wait_until(pilot, lambda: len(pane.reply_text) > 5, what="the reply to start", timeout=60)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not pane.replying, what="the reply to stop")
        assert pane.conversation.last_reply is not None
        assert len(pane.conversation.last_reply.token_ids) < 200
        assert "stopped" in str(pane.query_one("#turn-info").render())
    live.wait_until_idle()
    assert live.snapshot()["requests"] == []


@async_test
async def test_a_refused_key_ends_the_app_with_one_line(live):
    app = attached_app(live, api_key="wrong")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.load_error is not None, what="the refusal")
    assert "\n" not in app.load_error and "401" in app.load_error


def test_attach_mode_never_imports_torch(live):
    script = textwrap.dedent(f"""
        import asyncio, json, sys
        from pagedchat import SamplingParams
        from pagedchat.tui.app import PagedChatApp
        from pagedchat.tui.attached import AttachTarget

        async def main():
            app = PagedChatApp(None, attach=AttachTarget({live.url!r}, {KEY!r}),
                               params=SamplingParams(temperature=0, max_tokens={GREEDY.max_tokens}))
            async with app.run_test() as pilot:
                for _ in range(600):
                    if app.current_pane is not None and app.chat is not None:
                        break
                    await pilot.pause(0.05)
                pane = app.current_pane
                pane.send("Hi")
                for _ in range(600):
                    if not pane.replying:
                        break
                    await pilot.pause(0.05)
                reply = pane.conversation.last_reply
            print(json.dumps({{"reply": reply.text if reply else None,
                               "heavy": [m for m in ("torch", "transformers") if m in sys.modules]}}))

        asyncio.run(main())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    expected = servers_replies(live, [SimpleNamespace(role="user", text="Hi")])[0]["message"]["content"]
    assert result["reply"] == expected
