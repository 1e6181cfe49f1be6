"""What closed conversations cost: kv_snapshot() after N conversations released (kept known) or closed.

    python -m bench.closed_conversations [--conversations 250 1000] [--threads 1]

Each conversation is what a chat tab does: added with keep=True, answered, then either released (what
the app did before `close_request`: the engine kept every conversation, and the snapshot that the
engine thread publishes after every step walked them all) or closed. The table gives the snapshot's
cost per call (the heap that closed conversations leave is a test: tests/test_closing.py).
"""

import random
import statistics
import time

from bench.common import Section, Table, arg_parser, load_llm, random_tokens, start, stopwatch

SNAPSHOT_CALLS = 50


def snapshot_ms(engine) -> float:
    times = []
    for _ in range(SNAPSHOT_CALLS):
        began = time.perf_counter()
        engine.kv_snapshot()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def run(llm, conversations: int, end: str, seed: int) -> tuple[float, int]:
    """(snapshot ms, requests the snapshot lists) after `conversations` chats ended by `end`."""
    from pagedchat import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    rng = random.Random(seed)
    vocab = llm.get_tokenizer().vocab_size
    for number in range(conversations):
        request_id = f"{end}-{seed}-{number}"
        engine.add_request(request_id, random_tokens(rng, rng.randint(8, 40), vocab), params, keep=True)
        while engine.has_unfinished_requests():
            engine.step()
        getattr(engine, f"{end}_request")(request_id)
    listed = len(engine.kv_snapshot().requests)
    cost = snapshot_ms(engine)
    for info in engine.kv_snapshot().requests:  # leave the engine as the next run expects it: empty
        engine.close_request(info.request_id)
    return cost, listed


def closed_conversations_section(model: str | None, dtype: str, sizes: list[int]) -> Section:
    with stopwatch() as t:
        llm = load_llm(model, dtype, compile=False)
        empty = snapshot_ms(llm.engine)
        rows = []
        for seed, conversations in enumerate(sizes):
            released = run(llm, conversations, "release", seed)
            closed = run(llm, conversations, "close", seed)
            rows.append([conversations, f"{released[0]:.2f} ms ({released[1]} listed)",
                         f"{closed[0]:.2f} ms ({closed[1]} listed)", released[0] / closed[0]])
    return Section(
        f"kv_snapshot() over closed conversations ({dtype})",
        settings=[f"{llm.engine.config.num_kv_blocks} KV blocks of {llm.engine.config.block_size}; each conversation "
                  "8-40 random prompt tokens, 2 greedy tokens, keep=True; snapshot cost = median of "
                  f"{SNAPSHOT_CALLS} calls; an empty engine's snapshot: {empty:.2f} ms"],
        tables=[Table(["conversations", "released: snapshot", "closed: snapshot", "released / closed"], rows)],
        seconds=t.wall,
    )


def main() -> None:
    parser = arg_parser(__doc__, ["float32"])
    parser.add_argument("--conversations", type=int, nargs="+", default=[250, 1000])
    args = start(parser)
    for dtype in args.dtype:
        print(closed_conversations_section(args.model, dtype, args.conversations).markdown())


if __name__ == "__main__":
    main()
