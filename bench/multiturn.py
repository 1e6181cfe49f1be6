"""Multi-turn chat: time to first token at turns 1, 5 and 10 of a growing conversation.

    python -m bench.multiturn [--turns 10] [--reply 32]

Four ways to hold the history between turns, on the same user messages (greedy replies):
- resident: the conversation stays parked with its blocks (`keep=True`, `continue_request`): a turn
  computes only its new message;
- released, prefix cache on: `release_request` after each reply; the next turn finds the full blocks
  of its history in the prefix cache and recomputes only the partial last block and the message;
- released, prefix cache off: every turn recomputes the whole history;
- HF `generate` recomputing the history (the prompt of each turn, as pagedchat built it).
"""


from bench.common import Section, Table, arg_parser, start, load_hf, load_llm, stopwatch
from bench.hf_peers import hf_single

MESSAGES = [
    "Hi! Can you help me plan a small vegetable garden?", "I have about four square metres of sunny space.",
    "Which vegetables grow fastest?", "How often should I water them?", "What about pests like slugs?",
    "Can I grow tomatoes next to basil?", "When should I plant the seeds?", "Do I need fertiliser?",
    "How do I know when the radishes are ready?", "Thanks! Can you summarise the plan in three lines?",
    "One more: what should I plant in autumn?", "And how do I keep the soil healthy over winter?",
]
MODES = ("resident", "released, prefix cache on", "released, prefix cache off")


def converse(llm, turns: int, reply_tokens: int, mode: str) -> list[dict]:
    """One conversation of `turns` turns; per turn: TTFT, tokens computed, context length, the prompt."""
    from pagedchat import SamplingParams
    from pagedchat.engine.chat import ChatSession

    engine, session = llm.engine, ChatSession(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=reply_tokens)
    rid = f"{mode}-{id(session)}"
    result = []
    for turn in range(turns):
        new_ids = session.user_turn(MESSAGES[turn % len(MESSAGES)])
        with stopwatch() as t:
            if turn == 0:
                engine.add_request(rid, new_ids, params, keep=True)
            else:
                engine.continue_request(rid, new_ids, params)
            first = None
            while first is None:
                first = next((o for o in engine.step() if o.request_id == rid and o.outputs[0].token_ids), None)
        seq = engine.groups[rid][0]
        result.append(dict(ttft=t, context=session.num_tokens, computed=session.num_tokens - seq.num_cached_tokens,
                           prompt=list(session.token_ids)))
        out = first
        while not out.finished:
            out = next(o for o in engine.step() if o.request_id == rid)
        session.add_reply(out.token_ids)
        if mode != "resident":
            engine.release_request(rid)
    engine.release_request(rid)
    return result


def warm_up(llm) -> None:
    """First calls allocate: run unrelated tokens through, so that turn 1 is not charged for it."""
    from pagedchat import SamplingParams

    llm.generate([list(range(1000, 1040))], SamplingParams(temperature=0.0, max_tokens=2))


def multiturn_section(model: str | None, dtype: str, turns: int = 10, reply_tokens: int = 16) -> Section:
    shown = sorted({1, min(5, turns), turns})
    with stopwatch() as t:
        runs = {}
        for mode in MODES:  # a fresh engine each: no mode may find another's blocks in the prefix cache
            llm = load_llm(model, dtype, enable_prefix_caching=mode != MODES[2])
            warm_up(llm)
            runs[mode] = converse(llm, turns, reply_tokens, mode)
        hf = load_hf(llm.model_path, dtype)
        hf_single(hf, runs[MODES[0]][0]["prompt"])  # warm-up
        runs["HF generate, recomputing"] = [
            dict(ttft=hf_single(hf, turn["prompt"]), context=turn["context"], computed=turn["context"])
            for turn in runs[MODES[0]]
        ]
    rows = []
    for name, run in runs.items():
        cells = [f"{run[n - 1]['ttft'].cpu * 1e3:.0f} ms ({run[n - 1]['computed']} of {run[n - 1]['context']})"
                 for n in shown]
        rows.append([name, *cells, run[-1]["ttft"].cpu / run[0]["ttft"].cpu, run[-1]["ttft"].wall / run[0]["ttft"].wall])
    resident, cached = (runs[m][-1]["ttft"].cpu / runs[m][0]["ttft"].cpu for m in MODES[:2])
    met = "met" if max(resident, cached) <= 1.3 else "MISSED"
    return Section(
        f"3. Multi-turn chat: time to first token ({dtype})",
        settings=[f"{turns} turns of one conversation (the model's chat template, its default system prompt), "
                  f"greedy replies of up to {reply_tokens} tokens; cells: TTFT in CPU time (tokens computed of the "
                  "context); the last column is the same ratio in wall time"],
        tables=[Table(["history between turns", *(f"turn {n}" for n in shown), f"turn {turns} / turn 1 (CPU)",
                       "(wall)"], rows)],
        notes=[f"goal turn {turns} within 1.3x of turn 1, resident and cached: {resident:.2f}x and {cached:.2f}x "
               f"-> {met}"],
        seconds=t.wall,
        chart={f"{dtype}: TTFT turn {turns}, HF recomputing / resident":
               (runs["HF generate, recomputing"][-1]["ttft"].cpu / runs[MODES[0]][-1]["ttft"].cpu, None)},
    )


def main() -> None:
    parser = arg_parser(__doc__, ["bfloat16", "float32"])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--reply", type=int, default=16)
    args = start(parser)
    for dtype in args.dtype:
        print(multiturn_section(args.model, dtype, args.turns, args.reply).markdown())


if __name__ == "__main__":
    main()
