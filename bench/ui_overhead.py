"""UI overhead: tokens/s with the app running (headless under Pilot, chat panes streaming, KV panel
polling and redrawing) over tokens/s of the bare engine on the same chats.

    python -m bench.ui_overhead [--workload 4x48 --workload 1x128] [--rounds 5]

Each workload is TABSxREPLY: that many chat tabs, one message each, replies of REPLY tokens (the default
runs both of these, one section each). Every run gets its own freshly loaded engine (one that served
these messages before would find them in its prefix cache), the same messages (one per tab, all sent
at once) and greedy replies of exactly `reply` tokens. Bare engine and app alternate (bare, app, bare, ... bare) and each side's mean is
compared, so that a drift in the machine's load hits both sides alike; on these shared cores one run
moves by 10% or more, hence several rounds.

The app runs also say how current the screen was while the replies streamed: the times the reply on
show changed on screen (its `draw` appended text) and the times its tab's token count changed, and the
intervals between consecutive ones (for the count: from the reply's first redraw to its last, a count
stands that long at most), at their median, 95th percentile and maximum.
"""

import asyncio
import math
import re
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import Section, Table, Times, arg_parser, load_average, load_llm, start, stopwatch

MESSAGES = ["Tell me about the ocean.", "How do bees make honey?", "Describe a busy market.",
            "What is a black hole?", "Write a short poem about rain.", "Explain how a bicycle works.",
            "What do cats dream about?", "Plan a day in Paris."]
SIZE = (160, 50)
TIMEOUT_S = 900
WORKLOADS = [(4, 48), (1, 128)]  # several tabs, short replies; one long reply


def params(reply: int):
    from pagedchat import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True)


def headless(llm, tabs: int, reply: int) -> Times:
    """Times of the bare engine: each message as a chat (template rendered by ChatSession), kept."""
    from pagedchat.engine.chat import ChatSession

    engine = llm.engine
    ids = [f"h{i}" for i in range(tabs)]
    with stopwatch() as t:
        for rid, text in zip(ids, MESSAGES):
            engine.add_request(rid, ChatSession(llm.get_tokenizer()).user_turn(text), params(reply), keep=True)
        while engine.has_unfinished_requests():
            engine.step()
            engine.kv_snapshot()  # the app's engine thread publishes one per step: not UI cost
    return t


class Redraws:
    """When the tab on show changed on screen during one app run: its reply, and its label's count."""

    def __init__(self) -> None:
        self.reply: list[float] = []
        self.count: list[float] = []
        self.count_shown = False  # a tab bar too narrow for the full labels shows no counts

    def watch(self, app, pane) -> None:
        """Time what the app's tick changes of `pane` (the tab on show), by wrapping the two calls that
        change it: the pane's `draw` and the app's `update_labels`."""
        draw, relabel = pane.draw, app.update_labels

        async def timed_draw() -> None:
            before = pane.shown_text
            await draw()
            if pane.shown_text != before:
                self.reply.append(time.perf_counter())

        def shown_count() -> str | None:  # the tab's label as on screen: "■ Chat 4  151 tok · generating"
            found = re.search(r"(\d+) tok", app.tab_labels.shown(pane.id))
            return found and found.group(1)

        def timed_relabel() -> None:
            before = shown_count()
            relabel()
            after = shown_count()
            self.count_shown |= after is not None
            if after != before and before is not None and after is not None:
                self.count.append(time.perf_counter())

        pane.draw, app.update_labels = timed_draw, timed_relabel

    def count_while_streaming(self) -> list[float]:
        """The count's changes between the reply's first redraw and its last, and those two: a count
        that never changed while the reply streamed was as old as the stream."""
        if not self.reply or not self.count_shown:
            return []
        first, last = self.reply[0], self.reply[-1]
        return [first, *(t for t in self.count if first < t < last), last]


def intervals(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def percentile(values: list[float], p: float) -> float:
    """Nearest rank: the smallest value with at least p of them at or under it."""
    ranked = sorted(values)
    return ranked[max(0, min(len(ranked) - 1, math.ceil(p * len(ranked)) - 1))] if ranked else math.nan


def interval_cells(times: list[float]) -> list[object]:
    gaps = [1000 * g for g in intervals(times)]
    return [len(times), *gap_cells(gaps)]


def gap_cells(gaps: list[float]) -> list[object]:
    return [percentile(gaps, 0.5), percentile(gaps, 0.95), max(gaps)] if gaps else ["n/a"] * 3


async def in_app(llm, tabs: int, reply: int) -> tuple[Times, float, Redraws]:
    """Times of the same chats sent from `tabs` chat tabs of the running app, the CPU seconds of
    the UI thread (this one: Pilot runs the app on the caller's event loop) meanwhile, and when the
    tab on show (the last one opened) changed on screen. The app saves its chats as it goes, as it
    does when run."""
    from pagedchat.history import History
    from pagedchat.tui.app import PagedChatApp

    with tempfile.TemporaryDirectory() as folder:
        app = PagedChatApp(lambda: llm, params=params(reply), history=History(Path(folder) / "history.sqlite3"))
        async with app.run_test(size=SIZE) as pilot:
            while app.current_pane is None:  # the app opens its first tab once the engine is in
                await pilot.pause(0.05)
            panes = [app.current_pane]
            for _ in range(tabs - 1):
                await app.action_new_chat()
                panes.append(app.current_pane)
            await pilot.pause(0.5)  # the new tabs' underline animation ends before the clock starts
            redraws = Redraws()
            redraws.watch(app, app.current_pane)
            ui_cpu = time.thread_time()
            with stopwatch() as t:
                for pane, text in zip(panes, MESSAGES):
                    assert pane.send(text), "the app refused a message"
                deadline = time.monotonic() + TIMEOUT_S
                while any(p.replying or p.conversation.last_reply is None for p in panes):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the app's replies did not arrive within {TIMEOUT_S} s")
                    # not pilot.pause: it posts a callback to every widget on screen and waits for them all,
                    # a message storm (~2,000/s here) that the app itself never causes
                    await asyncio.sleep(0.05)
            ui_cpu = time.thread_time() - ui_cpu
            generated = sum(len(p.conversation.last_reply.token_ids) for p in panes)
        assert generated == tabs * reply, f"{generated} tokens, expected {tabs * reply}"
        return t, ui_cpu, redraws


def ui_overhead_section(model: str | None, dtype: str, tabs: int = 4, reply: int = 48, rounds: int = 5) -> Section:
    from pagedchat.tui.frame_budget import MAX_DRAW_GAP_S, POLL_HZ, UI_CPU_SHARE
    from pagedchat.tui.tab_labels import LABEL_COUNT_EVERY_S
    from pagedchat.engine.runtime.engine_thread import GIL_SWITCH_INTERVAL_S

    load = load_average()

    def fresh_llm():  # first calls allocate: a short generate keeps that out of the measured runs
        llm = load_llm(model, dtype)
        llm.generate([list(range(1000, 1040))], params(2))
        return llm

    # A fresh engine for every run, bare ones included: an engine that served these messages before
    # finds their prompts in its prefix cache and skips their prefill.
    with stopwatch() as t:
        bare_runs, app_runs, ui_cpus, redraws = [headless(fresh_llm(), tabs, reply)], [], [], []
        for _ in range(rounds):
            app_run, ui_cpu, shown = asyncio.run(in_app(fresh_llm(), tabs, reply))
            app_runs.append(app_run)
            ui_cpus.append(ui_cpu)
            redraws.append(shown)
            bare_runs.append(headless(fresh_llm(), tabs, reply))
    tokens = tabs * reply
    rows = [[f"bare engine (step + kv_snapshot), run {i + 1}", tokens / r.wall, tokens / r.cpu, "", ""]
            for i, r in enumerate(bare_runs)]
    # each app run against the mean of the bare runs either side of it: a drift that lasts minutes cancels
    pairs = [2 * tokens / r.wall / (tokens / before.wall + tokens / after.wall)
             for r, before, after in zip(app_runs, bare_runs, bare_runs[1:])]
    rows += [[f"app (Pilot, headless), run {i + 1}", tokens / r.wall, tokens / r.cpu, pair, ui / r.wall]
             for i, (r, pair, ui) in enumerate(zip(app_runs, pairs, ui_cpus))]

    def mean_rate(runs: list[Times], key: str) -> float:
        return sum(tokens / getattr(r, key) for r in runs) / len(runs)

    redraw_rows = [[f"app run {i + 1}", *interval_cells(r.reply), len(r.count),
                    *interval_cells(r.count_while_streaming())[1:]] for i, r in enumerate(redraws)]
    reply_gaps = [1000 * g for r in redraws for g in intervals(r.reply)]
    count_gaps = [1000 * g for r in redraws for g in intervals(r.count_while_streaming())]
    redraw_rows.append(["all app runs", sum(len(r.reply) for r in redraws), *gap_cells(reply_gaps),
                        sum(len(r.count) for r in redraws), *gap_cells(count_gaps)])
    reply_p50, reply_p95 = percentile(reply_gaps, 0.5), percentile(reply_gaps, 0.95)
    count_max = max(count_gaps, default=math.nan)

    ratio = mean_rate(app_runs, "wall") / mean_rate(bare_runs, "wall")
    cpu_ratio = mean_rate(app_runs, "cpu") / mean_rate(bare_runs, "cpu")
    return Section(
        f"4. UI overhead ({dtype}, {tabs} tab{'s' if tabs > 1 else ''} x {reply} tokens)",
        settings=[f"{tabs} chat tabs, one message each sent at once, greedy replies of {reply} tokens; app headless "
                  f"under Textual's Pilot at {SIZE[0]}x{SIZE[1]} cells (the shown reply and the KV panel drawn at most "
                  f"{POLL_HZ} times a second, and not before the UI thread's CPU since the last draw is back under "
                  f"{UI_CPU_SHARE:.0%} of a core, but at least every {MAX_DRAW_GAP_S:g} s, i.e. on the first tick "
                  f"after that; a tab's token count "
                  f"relabelled at a draw at least {LABEL_COUNT_EVERY_S:g} s after the last; chats saved to a history "
                  f"file; GIL switch interval {GIL_SWITCH_INTERVAL_S * 1000:g} ms while the engine thread runs); "
                  "runs alternate bare, app, bare, ...", f"load average at the start (1/5/15 min): {load}"],
        tables=[Table(["run", "tokens / wall s", "tokens / CPU s (all threads)", "app / bare either side",
                       "UI thread CPU / wall"], rows),
                Table(["tab on show", "reply redraws", "interval p50 ms", "p95 ms", "max ms",
                       "token count relabels", "interval p50 ms", "p95 ms", "max ms"], redraw_rows,
                      "how often the tab on show changed on screen while its reply streamed")],
        notes=[f"goal app / bare >= 0.95 (mean wall tokens/s): {ratio:.2f} -> {'met' if ratio >= 0.95 else 'MISSED'}",
               f"each app run over the bare runs either side of it: median {statistics.median(pairs):.2f}, "
               f"from {min(pairs):.2f} to {max(pairs):.2f}",
               f"the UI thread was busy {sum(ui_cpus) / sum(r.wall for r in app_runs):.1%} of the app's wall time: "
               "the engine thread loses about that much, since the two take turns on the GIL",
               f"tokens per CPU second, app / bare: {cpu_ratio:.2f} (the UI thread's own CPU counted as overhead, "
               "though it can run on the other core)",
               f"goal the reply on show redraws at least every 250 ms (p95 <= 500 ms) while it streams: p50 "
               f"{reply_p50:.0f} ms, p95 {reply_p95:.0f} ms -> "
               f"{'met' if reply_p50 <= 250 and reply_p95 <= 500 else 'MISSED'}",
               f"goal its tab's token count at most 1 s old while it streams (the longest interval between "
               f"relabels): {count_max:.0f} ms -> {'met' if count_max <= 1000 else 'MISSED'}" if count_gaps else
               "its tab's token count: not shown (the tab bar shows compact labels, without counts, when the full "
               "ones do not fit)"],
        seconds=t.wall,
        chart={f"{dtype}, {tabs}x{reply}: app / bare engine tokens/s": (ratio, 0.95)},
    )


def main() -> None:
    parser = arg_parser(__doc__, ["float32"])
    parser.add_argument("--workload", action="append", type=workload, metavar="TABSxREPLY",
                        help="chat tabs x reply tokens, repeatable (default: 4x48 and 1x128)")
    parser.add_argument("--rounds", type=int, default=5)
    args = start(parser)
    for tabs, reply in args.workload or WORKLOADS:
        print(ui_overhead_section(args.model, args.dtype[0], tabs, reply, args.rounds).markdown(), flush=True)


def workload(text: str) -> tuple[int, int]:
    tabs, _, reply = text.lower().partition("x")
    return int(tabs), int(reply)


if __name__ == "__main__":
    main()
