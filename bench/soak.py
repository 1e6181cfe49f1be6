"""Soak (issue 7): random arrivals, lengths, aborts, forks, follow-up messages and tab closes against a
pool small enough to preempt often. The pool's invariants are checked after every step; at the end no
block may be held, and every request that was not aborted must have the tokens a lone run gives.

    python -m bench.soak [--steps 2000] [--model PATH]

The model is a tiny random one (2 layers, hidden size 64) with the default model's architecture and
tokenizer, so that thousands of steps and a lone rerun of every request fit in a few minutes on a CPU;
its weights are drawn wide (std 0.5) so that greedy picks are far from ties and any wrong KV entry
shows up as a different token. `--model` soaks a real model instead (slow on a CPU).
"""

import argparse
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Section, Table, load_llm, random_tokens, start, stopwatch
from pagedchat.engine.core.invariants import assert_invariants


@dataclass(frozen=True)
class Traffic:
    """The random traffic; probabilities are per step."""

    steps: int  # steps with arrivals; the soak then runs until every request is done
    vocab: int
    arrival: float = 0.4  # ~13 tokens of work a step, of the 16 a step computes: busy, yet it drains
    prompt_lens: tuple[int, int] = (1, 30)
    output_lens: tuple[int, int] = (1, 32)
    keep: float = 0.4  # share of arrivals that are conversations (kept, parked when done)
    abort: float = 0.04
    fork: float = 0.04
    follow_up: float = 0.15  # a parked conversation gets its next message
    close: float = 0.2  # a parked conversation's tab is closed


@dataclass(frozen=True)
class Answer:
    """A turn that finished without an abort: a lone run of its whole prompt must give its tokens."""

    request_id: str
    prompt: list[int]
    params: object  # SamplingParams
    token_ids: list[int]


@dataclass
class Soak:
    """What a soak did. `origin` maps each request to the whole prompt and params of its latest turn."""

    origin: dict = field(default_factory=dict)
    answers: list[Answer] = field(default_factory=list)
    replies: dict[str, list[int]] = field(default_factory=dict)  # each request's latest answer, for follow-ups
    aborted: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)  # finish_reason "error": none expected
    steps: int = 0
    arrivals: int = 0
    forks: int = 0
    follow_ups: int = 0
    closes: int = 0
    checks: int = 0
    peak_running: int = 0
    preemptions: int = 0
    cow_copies: int = 0
    leaked_blocks: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0


def soak(engine, traffic: Traffic, seed: int = 0) -> Soak:
    """Drive `engine` with random traffic, check its invariants after every step, release everything."""
    from pagedchat import SamplingParams

    rng, done = random.Random(seed), Soak()
    # a follow-up only goes to a conversation that then still fits half the pool: the other half keeps
    # the rest of the traffic moving, and a conversation never outgrows the context
    room = engine.config.num_kv_blocks * engine.config.block_size // 2 - traffic.prompt_lens[1]
    last_event = -1

    def fits(rid: str) -> bool:
        prompt, params = done.origin[rid]
        return len(prompt) + len(done.replies[rid]) + params.max_tokens <= room

    started = time.perf_counter()
    while done.steps < traffic.steps or engine.has_unfinished_requests():
        step = done.steps
        if step < traffic.steps and rng.random() < traffic.arrival:
            rid = f"q{step}"
            prompt = random_tokens(rng, rng.randint(*traffic.prompt_lens), traffic.vocab)
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(*traffic.output_lens))
            engine.add_request(rid, prompt, params, keep=rng.random() < traffic.keep)
            done.origin[rid] = (prompt, params)
            done.arrivals += 1
        snap = engine.kv_snapshot()
        running = [r.request_id for r in snap.requests if r.status == "running"]
        parked = [r.request_id for r in snap.requests if r.status == "parked"]
        if running and rng.random() < traffic.abort:
            victim = running.pop(rng.randrange(len(running)))
            engine.abort_request(victim)
            done.aborted.add(victim)
        if running and rng.random() < traffic.fork:
            src = rng.choice(running)
            twin = f"{src}/fork{step}"
            engine.fork_request(src, twin)  # greedy: the twin goes on exactly as its source would
            done.origin[twin] = done.origin[src]
            done.forks += 1
        answered = [rid for rid in parked if rid in done.replies and fits(rid)]
        if answered and rng.random() < traffic.follow_up:
            rid = rng.choice(answered)
            prompt, params = done.origin[rid]
            message = random_tokens(rng, rng.randint(*traffic.prompt_lens), traffic.vocab)
            engine.continue_request(rid, message, params)
            done.origin[rid] = (prompt + done.replies.pop(rid) + message, params)
            done.follow_ups += 1
            parked.remove(rid)
        if parked and rng.random() < traffic.close:
            engine.close_request(rng.choice(parked))
            done.closes += 1
        for out in engine.step():
            done.generated_tokens += len(out.outputs[0].new_token_ids)
            if out.finished and out.finish_reason != "abort":
                done.answers.append(Answer(out.request_id, *done.origin[out.request_id], out.token_ids))
                done.replies[out.request_id] = out.token_ids
            if out.finish_reason == "error":
                done.errors[out.request_id] = out.error
        snap = engine.kv_snapshot()
        assert_invariants(snap)
        done.checks += 1
        # the snapshot keeps only the latest events: count the copies step by step
        done.cow_copies += sum(1 for e in snap.events if e.seq > last_event and e.kind == "cow")
        last_event = snap.events[-1].seq if snap.events else last_event
        done.steps += 1
        done.peak_running = max(done.peak_running, snap.num_running)
    done.seconds = time.perf_counter() - started
    for request_id in {r.request_id for r in engine.kv_snapshot().requests}:  # every tab closes
        engine.close_request(request_id)
    snap = engine.kv_snapshot()
    assert_invariants(snap)
    assert snap.requests == (), "a closed conversation stayed in the engine"
    done.checks += 1
    done.leaked_blocks = snap.num_blocks - snap.num_free_blocks
    done.preemptions = snap.num_preemptions
    return done


def lone_run(engine, prompt: list[int], params) -> list[int]:
    engine.add_request("lone", prompt, params)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    return out.token_ids


def mismatches(reference, done: Soak) -> list[str]:
    """The requests whose answer differs from a lone run of its prompt on `reference`."""
    return [a.request_id for a in done.answers if a.token_ids != lone_run(reference, a.prompt, a.params)]


def tiny_random_model(folder: Path) -> Path:
    """The default model's architecture and tokenizer at 2 layers of width 64, random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from pagedchat.engine.loading import loader

    logging.disable_progress_bar()  # the shard-writing bar would land in the report
    default = loader.metadata_folder(loader.resolve_model(None))
    config = AutoConfig.from_pretrained(default)
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, initializer_range=0.5))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    AutoTokenizer.from_pretrained(default).save_pretrained(folder)
    return folder


POOL = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, max_num_seqs=8)


def soak_section(model: str | None = None, steps: int = 2000, seed: int = 0) -> Section:
    """The soak with arrivals for `steps` steps on `model` (None: a tiny random model), then the lone reruns."""
    with stopwatch() as t:
        with tempfile.TemporaryDirectory() as folder:  # the engines hold everything once loaded
            path = str(tiny_random_model(Path(folder))) if model is None else model
            engine = load_llm(path, "float32", **POOL).engine
            reference = load_llm(path, "float32", block_size=POOL["block_size"],
                                 num_kv_blocks=POOL["num_kv_blocks"]).engine
        traffic = Traffic(steps, engine.runner.model.config.vocab_size)
        done = soak(engine, traffic, seed)
        wrong = mismatches(reference, done)
    rows = [
        ["steps", done.steps],
        ["requests arrived", done.arrivals],
        ["forks", done.forks],
        ["follow-up messages", done.follow_ups],
        ["tab closes", done.closes],
        ["aborted", len(done.aborted)],
        ["finished with an error (goal 0)", len(done.errors)],
        ["answers (turns finished, not aborted), each checked against a lone run", len(done.answers)],
        ["answers differing from their lone run (goal 0)", len(wrong)],
        ["preemptions", done.preemptions],
        ["copy-on-write copies", done.cow_copies],
        ["peak running", done.peak_running],
        ["invariant checks passed", done.checks],
        ["blocks leaked at the end (goal 0)", done.leaked_blocks],
        ["generated tokens / s (soak loop, checks included)", done.generated_tokens / done.seconds],
    ]
    name = "tiny random model (default model's architecture and tokenizer, 2 layers, width 64)" if model is None else model
    return Section(
        "Issue 7: soak (random arrivals, aborts, forks, follow-ups, tab closes)",
        settings=[f"model: {name}, float32, greedy",
                  f"pool: {POOL['num_kv_blocks']} blocks of {POOL['block_size']} tokens, "
                  f"{POOL['max_num_batched_tokens']} tokens and {POOL['max_num_seqs']} sequences a step",
                  f"traffic per step: arrival {traffic.arrival}, prompts {traffic.prompt_lens[0]}..{traffic.prompt_lens[1]} "
                  f"tokens, outputs {traffic.output_lens[0]}..{traffic.output_lens[1]}, {traffic.keep:.0%} kept as "
                  f"conversations; abort {traffic.abort}, fork {traffic.fork}, follow-up {traffic.follow_up}, "
                  f"tab close {traffic.close}; arrivals for {steps} steps, then until all are done"],
        tables=[Table(["", "count"], rows)],
        notes=[f"differing or failed: {', '.join([*wrong, *done.errors][:10])}"] if wrong or done.errors else [],
        seconds=t.wall,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: a tiny random model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: see bench/run.py)")
    parser.add_argument("--steps", type=int, default=2000, help="steps with arrivals")
    parser.add_argument("--seed", type=int, default=0)
    args = start(parser)
    print(soak_section(args.model, args.steps, args.seed).markdown())


if __name__ == "__main__":
    main()
