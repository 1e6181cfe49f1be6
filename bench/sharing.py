"""Memory saved by sharing blocks (issue 5): peak KV blocks in use for k forks of a conversation,
n=k parallel samples, and k tabs that open with one long shared system prompt, against the same work
done without sharing (separate requests, prefix caching off), for k = 2, 4, 8.

    python -m bench.sharing [--prompt 400] [--new 64]

The model forward is replaced by a stub (zeros logits, EOS ignored): block counts depend only on token
counts, and the block pool, KV manager (copy-on-write included) and scheduler are the real ones.
"""

import itertools
import random

from bench.common import Section, Table, arg_parser, start, load_llm, random_tokens, stopwatch, stub_forward

KS = (2, 4, 8)
FOLLOW_UP = 24  # tokens of each fork's or tab's own message


class Tracker:
    """Runs an engine to the end of its work and remembers the most blocks in use at once."""

    def __init__(self, engine):
        self.engine = engine
        self.peak = 0

    def run(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()
            self.peak = max(self.peak, self.engine.pool.num_blocks - self.engine.pool.num_free)


class Tokens:
    """Random token ids of the model's vocabulary, seeded: `tokens(n)`."""

    def __init__(self, seed: int, vocab: int):
        self.rng, self.vocab = random.Random(seed), vocab

    def __call__(self, n: int) -> list[int]:
        return random_tokens(self.rng, n, self.vocab)


def forks(engine, k: int, tokens: Tokens, prompt: int, new: int, ids) -> int:
    from pagedchat import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    root = f"conv{next(ids)}"
    engine.add_request(root, tokens(prompt), params, keep=True)
    tracker = Tracker(engine)
    tracker.run()  # the first reply; the conversation is now parked, holding its blocks
    names = [root] + [f"{root}-fork{i}" for i in range(1, k)]
    for name in names[1:]:
        engine.fork_request(root, name)
    for name in names:  # each branch asks its own follow-up
        engine.continue_request(name, tokens(FOLLOW_UP), params)
    tracker.run()
    for name in names:
        engine.release_request(name)
    return tracker.peak


def forks_unshared(engine, k: int, tokens: Tokens, prompt: int, new: int, ids) -> int:
    from pagedchat import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    history = tokens(prompt + new)  # the same history length as the forked conversation's
    for _ in range(k):
        engine.add_request(f"sep{next(ids)}", history + tokens(FOLLOW_UP), params)
    tracker = Tracker(engine)
    tracker.run()
    return tracker.peak


def samples(engine, k: int, tokens: Tokens, prompt: int, new: int, ids) -> int:
    from pagedchat import SamplingParams

    engine.add_request(f"n{next(ids)}", tokens(prompt),
                       SamplingParams(n=k, temperature=1.0, seed=0, max_tokens=new, ignore_eos=True))
    tracker = Tracker(engine)
    tracker.run()
    return tracker.peak


def samples_unshared(engine, k: int, tokens: Tokens, prompt: int, new: int, ids) -> int:
    from pagedchat import SamplingParams

    text = tokens(prompt)
    for i in range(k):
        engine.add_request(f"s{next(ids)}", text, SamplingParams(temperature=1.0, seed=i, max_tokens=new, ignore_eos=True))
    tracker = Tracker(engine)
    tracker.run()
    return tracker.peak


def tabs(engine, k: int, tokens: Tokens, prompt: int, new: int, ids) -> int:
    """k tabs opened one after another (each once the previous one's prompt is in), same system prompt."""
    from pagedchat import SamplingParams

    system = tokens(prompt)
    tracker = Tracker(engine)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for _ in range(k):
        engine.add_request(f"tab{next(ids)}", system + tokens(FOLLOW_UP), params)
        engine.step()
        tracker.peak = max(tracker.peak, engine.pool.num_blocks - engine.pool.num_free)
    tracker.run()
    return tracker.peak


SCENARIOS = {  # name: (with sharing, without, short name for the chart)
    "k forks of a parked conversation, each asks its own follow-up": (forks, forks_unshared, "forks"),
    "n=k parallel samples of one prompt": (samples, samples_unshared, "n=k samples"),
    # unshared: the same calls, on the engine with prefix caching off
    "k tabs with one long shared system prompt": (tabs, tabs, "tabs sharing a system prompt"),
}


def sharing_section(model: str | None, dtype: str, prompt: int = 400, new: int = 64, ks=KS) -> Section:
    with stopwatch() as t:
        shared_llm = load_llm(model, dtype, enable_prefix_caching=True)
        plain_llm = load_llm(model, dtype, enable_prefix_caching=False)
        for llm in (shared_llm, plain_llm):
            stub_forward(llm.engine)
        vocab = shared_llm.engine.runner.model.config.vocab_size
        ids = itertools.count()
        rows = []
        for name, (with_sharing, without, _) in SCENARIOS.items():
            for k in ks:
                shared = with_sharing(shared_llm.engine, k, Tokens(k, vocab), prompt, new, ids)
                plain = without(plain_llm.engine, k, Tokens(k, vocab), prompt, new, ids)
                rows.append([name, k, shared, plain, f"{1 - shared / plain:.0%}", f"{plain / shared:.2f}x"])
    block_size = shared_llm.engine.pool.block_size
    return Section(
        "Issue 5: memory saved by sharing blocks",
        settings=[f"prompt / history {prompt} tokens, follow-up messages {FOLLOW_UP} tokens, {new} new tokens per "
                  f"sequence, blocks of {block_size}; peak blocks in use (ref count > 0)",
                  "without sharing: the same token counts as separate requests, prefix caching off",
                  "model forward stubbed (zeros logits): block counts depend only on token counts"],
        tables=[Table(["scenario", "k", "blocks, shared", "blocks, not shared", "saved", "ratio"], rows)],
        seconds=t.wall,
        chart={f"blocks saved, {short}, k={ks[-1]} (not shared / shared)": (row[3] / row[2], None)
               for name, (_, _, short) in SCENARIOS.items() for row in rows if row[0] == name and row[1] == ks[-1]},
    )


def main() -> None:
    parser = arg_parser(__doc__, ["float32"])
    parser.add_argument("--prompt", type=int, default=400)
    parser.add_argument("--new", type=int, default=64)
    args = start(parser)
    print(sharing_section(args.model, args.dtype[0], args.prompt, args.new).markdown())


if __name__ == "__main__":
    main()
