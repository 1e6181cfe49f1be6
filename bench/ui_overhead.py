"""UI overhead: tokens/s with the app running (headless under Pilot, chat panes streaming, KV panel
polling and redrawing) over tokens/s of the bare engine on the same chats.

    python -m bench.ui_overhead [--tabs 4] [--reply 48]

Both sides get their own freshly loaded engine, the same messages (one per tab, all sent at once) and
greedy replies of exactly `reply` tokens. Bare engine and app alternate (bare, app, bare, ... bare)
and each side's mean is compared, so that a drift in the machine's load hits both sides alike.
"""

import asyncio
import time

from bench.common import Section, Table, arg_parser, start, load_llm, stopwatch

MESSAGES = ["Tell me about the ocean.", "How do bees make honey?", "Describe a busy market.",
            "What is a black hole?", "Write a short poem about rain.", "Explain how a bicycle works.",
            "What do cats dream about?", "Plan a day in Paris."]
SIZE = (160, 50)


def params(reply: int):
    from pagedchat import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True)


def headless(llm, tabs: int, reply: int) -> float:
    """tokens/s of the bare engine: each message as a chat (template rendered by ChatSession), kept."""
    from pagedchat.engine.chat import ChatSession

    engine = llm.engine
    ids = [f"h{time.monotonic_ns()}-{i}" for i in range(tabs)]
    with stopwatch() as t:
        for rid, text in zip(ids, MESSAGES):
            engine.add_request(rid, ChatSession(llm.get_tokenizer()).user_turn(text), params(reply), keep=True)
        while engine.has_unfinished_requests():
            engine.step()
            engine.kv_snapshot()  # the app's engine thread publishes one per step: not UI cost
    for rid in ids:
        engine.release_request(rid)
    return tabs * reply / t[0]


async def in_app(llm, tabs: int, reply: int) -> float:
    """tokens/s of the same chats sent from `tabs` chat tabs of the running app."""
    from pagedchat.tui.app import PagedChatApp

    app = PagedChatApp(lambda: llm, params=params(reply))
    async with app.run_test(size=SIZE) as pilot:
        while app.current_pane is None:  # the app opens its first tab once the engine is in
            await pilot.pause(0.05)
        panes = [app.current_pane]
        for _ in range(tabs - 1):
            await app.action_new_chat()
            panes.append(app.current_pane)
        await pilot.pause(0.2)
        start = time.perf_counter()
        for pane, text in zip(panes, MESSAGES):
            assert pane.send(text), "the app refused a message"
        while any(p.replying or p.conversation.last_reply is None for p in panes):
            await pilot.pause(0.02)
        elapsed = time.perf_counter() - start
        generated = sum(len(p.conversation.last_reply.token_ids) for p in panes)
    assert generated == tabs * reply, f"{generated} tokens, expected {tabs * reply}"
    return generated / elapsed


def ui_overhead_section(model: str | None, dtype: str, tabs: int = 4, reply: int = 48, rounds: int = 2) -> Section:
    with stopwatch() as t:
        bare, app_llm = load_llm(model, dtype), load_llm(model, dtype)
        for llm in (bare, app_llm):  # first calls allocate
            llm.generate([list(range(1000, 1040))], params(2))
        bare_runs, app_runs = [headless(bare, tabs, reply)], []
        for _ in range(rounds):
            app_runs.append(asyncio.run(in_app(app_llm, tabs, reply)))
            bare_runs.append(headless(bare, tabs, reply))
    ratio = (sum(app_runs) / len(app_runs)) / (sum(bare_runs) / len(bare_runs))
    rows = [["bare engine (LLMEngine.step + kv_snapshot)", *bare_runs], ["app (Pilot, headless)", *app_runs, ""]]
    return Section(
        f"4. UI overhead ({dtype})",
        settings=[f"{tabs} chat tabs, one message each sent at once, greedy replies of {reply} tokens; app headless "
                  f"under Textual's Pilot at {SIZE[0]}x{SIZE[1]} cells (panes stream, KV panel polls at 20 Hz); "
                  "runs alternate bare, app, bare, ..."],
        tables=[Table(["tokens/s", *(f"run {i + 1}" for i in range(rounds + 1))], rows)],
        notes=[f"goal app / bare >= 0.95 (means): {ratio:.2f} -> {'met' if ratio >= 0.95 else 'MISSED'}"],
        seconds=t[0],
        chart={"UI: app / bare engine tokens/s": ratio},
    )


def main() -> None:
    parser = arg_parser(__doc__, ["float32"])
    parser.add_argument("--tabs", type=int, default=4)
    parser.add_argument("--reply", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = start(parser)
    print(ui_overhead_section(args.model, args.dtype[0], args.tabs, args.reply, args.rounds).markdown())


if __name__ == "__main__":
    main()
