"""Replies that loop (issue 16, item 9): how many of 20 fixed chat prompts x fixed seeds the default
model answers with a loop, under the app's sampling (temperature 0.7, top_p 0.95, 512 tokens) with no
penalty (the app's default before issue 16) and with candidate penalties (`freq0.5`: its default since).

    python -m bench.loops [--seeds 1] [--threads 2] [--settings none rep1.1 ...] [--show]

A loop: some 8-token n-gram occurs 3 or more times in the reply's tokens (occurrences counted without
overlap, so that a run of one token needs 24 of them, not 10). Each prompt is rendered with the chat
template as the app sends it (`ChatSession`, the template's default system prompt); each (prompt, seed)
pair is one request with its own seed and penalties; one `LLM.generate` call holds every setting's
requests (another batch moves the logits by rounding: a count can move by a reply or two). Besides the
loops: the mean reply length (of all replies, and of those that do not loop), how many replies ran to
the token limit, and distinct-2 (unique token bigrams / bigrams, over all replies) -- a penalty that
cuts loops by making replies ramble on shows there as long replies at the limit.
"""

import time
from dataclasses import dataclass

from bench.common import Section, Table, arg_parser, load_average, load_llm, start

NGRAM, TIMES = 8, 3
TEMPERATURE, TOP_P, MAX_TOKENS = 0.7, 0.95, 512  # the app's sampling (pagedchat.tui.conversation)

PROMPTS = [
    "How do I make a good cup of coffee at home?",
    "What should I pack for a weekend camping trip?",
    "Why is the sky blue?",
    "Can you suggest a healthy breakfast?",
    "How do I get better at remembering names?",
    "What is the difference between a virus and bacteria?",
    "Give me some tips for a job interview.",
    "How often should I water a cactus?",
    "What are some fun things to do on a rainy day?",
    "How do I write a polite email asking for a deadline extension?",
    "Explain how a credit card works.",
    "What is a good way to start running?",
    "How can I save money on groceries?",
    "Why do cats purr?",
    "What should I cook for dinner tonight?",
    "How do I fix a squeaky door?",
    "Tell me about the history of the bicycle.",
    "How can I sleep better at night?",
    "What are the planets in our solar system?",
    "How do I teach a child to tie their shoes?",
]

# name -> penalties (repetition_penalty, presence_penalty, frequency_penalty)
SETTINGS = {
    "none": (1.0, 0.0, 0.0),
    "rep1.1": (1.1, 0.0, 0.0),
    "rep1.2": (1.2, 0.0, 0.0),
    "rep1.3": (1.3, 0.0, 0.0),
    "freq0.3": (1.0, 0.0, 0.3),
    "freq0.5": (1.0, 0.0, 0.5),
    "pres0.5": (1.0, 0.5, 0.0),
    "rep1.1+freq0.3": (1.1, 0.0, 0.3),
}


def loop_ngram(tokens, n: int = NGRAM, times: int = TIMES) -> tuple[int, ...] | None:
    """The first n-gram (in order of its first occurrence's end) that occurs `times` or more times
    without overlapping itself, or None: the reply does not loop."""
    last_end: dict[tuple[int, ...], int] = {}  # where the last counted occurrence ends
    count: dict[tuple[int, ...], int] = {}
    for start_at in range(len(tokens) - n + 1):
        gram = tuple(tokens[start_at:start_at + n])
        if start_at >= last_end.get(gram, 0):
            last_end[gram] = start_at + n
            count[gram] = count.get(gram, 0) + 1
            if count[gram] >= times:
                return gram
    return None


def loops(tokens, n: int = NGRAM, times: int = TIMES) -> bool:
    return loop_ngram(tokens, n, times) is not None


def distinct_2(replies) -> float:
    bigrams = [tuple(r[i:i + 2]) for r in replies for i in range(len(r) - 1)]
    return len(set(bigrams)) / len(bigrams) if bigrams else 0.0


@dataclass
class Result:
    name: str
    penalties: tuple[float, float, float]
    replies: list[list[int]]
    finish: list[str]

    @property
    def looped(self) -> int:
        return sum(loops(r) for r in self.replies)

    @property
    def mean_len(self) -> float:
        return sum(map(len, self.replies)) / len(self.replies)

    @property
    def mean_len_unlooped(self) -> float | None:
        lengths = [len(r) for r in self.replies if not loops(r)]
        return sum(lengths) / len(lengths) if lengths else None

    @property
    def at_limit(self) -> int:
        return sum(f == "length" for f in self.finish)


def requests(tokenizer, names: list[str], seeds: list[int]) -> tuple[list[list[int]], list]:
    """Every (setting, seed, prompt): its prompt ids and its SamplingParams, settings in order."""
    from pagedchat import SamplingParams
    from pagedchat.engine.chat import ChatSession

    prompts, params = [], []
    for name in names:
        repetition, presence, frequency = SETTINGS[name]
        for seed in seeds:
            for i, text in enumerate(PROMPTS):
                prompts.append(ChatSession(tokenizer).user_turn(text))
                params.append(SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=MAX_TOKENS,
                                             seed=seed * 1000 + i, repetition_penalty=repetition,
                                             presence_penalty=presence, frequency_penalty=frequency))
    return prompts, params


def run_settings(model: str | None, dtype: str, names: list[str], seeds: list[int]) -> tuple[list[Result], object]:
    """All settings' requests in one `LLM.generate` call: on 2 cores a step of 140 rows costs little more
    than one of 20. Each request has its own seed and penalties; its logits still move with the batch by
    rounding (bf16), so a sampled reply can part from the same request's in another batch after a while.
    The pool holds them all at once: nothing is preempted."""
    from pagedchat.engine.loading.loader import metadata_folder, resolve_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(metadata_folder(resolve_model(model)))
    prompts, params = requests(tokenizer, names, seeds)
    block = 16
    blocks = sum(-(-(len(p) + MAX_TOKENS) // block) for p in prompts) + 16
    llm = load_llm(model, dtype, compile=False, block_size=block, num_kv_blocks=blocks,
                   max_num_seqs=len(prompts), max_num_batched_tokens=4096)
    outs = llm.generate(prompts, params)
    per = len(seeds) * len(PROMPTS)
    results = [Result(name, SETTINGS[name], [list(o.outputs[0].token_ids) for o in outs[k * per:(k + 1) * per]],
                      [o.outputs[0].finish_reason for o in outs[k * per:(k + 1) * per]])
               for k, name in enumerate(names)]
    return results, llm


def loops_section(model: str | None, dtype: str, names: list[str], seeds: list[int], show: bool = False) -> Section:
    began, load_before = time.perf_counter(), load_average()
    results, llm = run_settings(model, dtype, names, seeds)
    tokenizer = llm.get_tokenizer()
    for result in results:
        print(f"{result.name}: {result.looped} loops / {len(result.replies)}, mean {result.mean_len:.0f} tokens, "
              f"{result.at_limit} at the limit", flush=True)
        if show:
            for i, reply in enumerate(result.replies):
                gram = loop_ngram(reply)
                mark = f"LOOP {tokenizer.decode(list(gram))!r}" if gram else "ok"
                print(f"--- {result.name} [{i}] {mark}\n{tokenizer.decode(reply, skip_special_tokens=True)}\n",
                      flush=True)
    n = len(results[0].replies)
    rows = [[r.name, f"{r.penalties[0]:g}", f"{r.penalties[1]:g}", f"{r.penalties[2]:g}", f"{r.looped} / {n}",
             f"{r.mean_len:.0f}", "-" if r.mean_len_unlooped is None else f"{r.mean_len_unlooped:.0f}",
             f"{r.at_limit} / {n}", f"{distinct_2(r.replies):.3f}"] for r in results]
    section = Section(
        f"Issue 16: replies that loop, {len(PROMPTS)} chat prompts x {len(seeds)} seed(s) ({dtype}; "
        f"`python -m bench.loops`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        settings=[f"model: {llm.model_path.name}; sampling: temperature {TEMPERATURE}, top_p {TOP_P}, "
                  f"max_tokens {MAX_TOKENS} (the app's), seed = 1000 x seed index + prompt index; "
                  f"{len(results) * n} requests in one `LLM.generate` call, {torch_threads()} torch threads",
                  f"loop: an {NGRAM}-token n-gram occurring {TIMES} or more times (without overlap) in the reply",
                  f"load average (1/5/15 min) at start: {load_before}; at end: {load_average()}"],
        tables=[Table(["setting", "repetition", "presence", "frequency", "replies that loop", "mean tokens",
                       "mean tokens, no loop", "at the limit (512)", "distinct-2"], rows)])
    section.seconds = time.perf_counter() - began
    return section


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> None:
    parser = arg_parser(__doc__, ["bfloat16"])
    parser.set_defaults(threads=2)
    parser.add_argument("--seeds", type=int, default=1, help="seeds per prompt")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--show", action="store_true", help="print every reply")
    args = start(parser)
    for dtype in args.dtype:
        print(loops_section(args.model, dtype, args.settings, list(range(args.seeds)), args.show).markdown())


if __name__ == "__main__":
    main()
