"""Concurrency at a fixed KV budget: the memory a contiguous allocator needs for 8 sessions at
max_model_len serves how many paged sessions at once?

    python -m bench.concurrency [--requests 256] [--max-model-len 2048]

The engine gets exactly that memory (`kv_cache_memory`), and 256 chat-length requests arrive at once,
more than fit. Every step records how many requests run, how many KV slots hold tokens and how many
are allocated. The contiguous reservation is the same engine and workload with at most 8 requests
admitted (each reserves max_model_len slots: `RequestInfo.max_len`, what the panel draws), its
utilisation = tokens held / (running x max_model_len).

The model forward is replaced by a stub (zeros logits; EOS ignored, so each request generates exactly
its output length): these numbers depend only on token counts and the scheduler, block pool and KV
manager, which are the real ones. The real forward would take hours here and change nothing.
"""

from dataclasses import dataclass

from bench.common import (
    DTYPES, Section, Table, arg_parser, describe, goal, start, load_llm, model_config, random_requests,
    stopwatch,
    stub_forward,
)

CONTIGUOUS_SESSIONS = 8


@dataclass
class Run:
    steps: int = 0
    peak_running: int = 0
    held: int = 0  # token-slots holding tokens, summed over steps
    allocated: int = 0  # token-slots allocated, summed over steps
    preemptions: int = 0
    running: int = 0  # requests running, summed over steps

    @property
    def mean_running(self) -> float:
        return self.running / self.steps if self.steps else 0.0

    @property
    def utilisation(self) -> float:
        return self.held / self.allocated if self.allocated else 0.0


def serve(engine, requests, reserve: int | None) -> Run:
    """Run every request to the end. reserve=None: paged accounting (slots of used blocks);
    else each running request is charged `reserve` slots (a contiguous allocation)."""
    from pagedchat import SamplingParams

    for i, r in enumerate(requests):
        engine.add_request(f"c{i}", r.prompt, SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))
    run, pool = Run(), engine.pool
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        run.steps += 1
        run.peak_running = max(run.peak_running, len(running))
        run.running += len(running)
        if reserve is None:
            used = [b for b in pool.blocks if b.ref_count > 0]
            run.held += sum(len(b.token_ids) for b in used)
            run.allocated += len(used) * pool.block_size
        else:
            run.held += sum(seq.num_computed_tokens for seq in running)
            run.allocated += len(running) * reserve
    run.preemptions = engine.scheduler.num_preemptions
    return run


def concurrency_section(model: str | None, dtype: str, num_requests: int = 256, max_model_len: int = 2048,
                        prompt_lens=(16, 512), output_lens=(16, 256)) -> Section:
    from pagedchat.engine.worker.model_runner import KVLayout

    with stopwatch() as t:
        config = model_config(model)
        requests = random_requests(num_requests, prompt_lens, output_lens, seed=1, vocab=config.vocab_size)
        per_token = KVLayout.of(config).bytes_per_block(1, DTYPES[dtype])
        budget = CONTIGUOUS_SESSIONS * max_model_len * per_token
        paged_llm = load_llm(model, dtype, kv_cache_memory=budget, max_model_len=max_model_len,
                             max_num_seqs=num_requests)
        stub_forward(paged_llm.engine)
        paged = serve(paged_llm.engine, requests, reserve=None)
        num_blocks = paged_llm.engine.pool.num_blocks
        del paged_llm
        contiguous_llm = load_llm(model, dtype, kv_cache_memory=budget, max_model_len=max_model_len,
                                  max_num_seqs=CONTIGUOUS_SESSIONS)
        stub_forward(contiguous_llm.engine)
        contiguous = serve(contiguous_llm.engine, requests, reserve=max_model_len)
    rows = [
        [name, run.peak_running, run.mean_running, f"{run.utilisation:.1%}", run.preemptions, run.steps]
        for name, run in (("pagedchat (paged, 16-token blocks)", paged),
                          (f"contiguous reservation ({CONTIGUOUS_SESSIONS} x max_model_len)", contiguous))
    ]
    ratio = paged.peak_running / contiguous.peak_running
    section = Section(
        "2. Concurrency at a fixed KV budget",
        settings=[
            f"KV budget: {CONTIGUOUS_SESSIONS} sessions x max_model_len {max_model_len} x {per_token} B/token "
            f"({dtype}) = {budget / 2**20:.0f} MiB = {num_blocks} blocks of 16",
            f"workload: {describe(requests)}, all arriving at once; max_num_seqs {num_requests}, "
            "max_num_batched_tokens 1024",
            "model forward stubbed (zeros logits): block usage depends only on token counts",
        ],
        tables=[Table(["allocator", "peak running", "mean running", "KV utilisation (held / allocated slots, mean over steps)",
                       "preemptions", "steps to serve all"], rows)],
        notes=[goal("concurrency", ratio, 4.0), goal("KV utilisation", paged.utilisation * 100, 96, unit="%"),
               f"the paged engine serves the same requests in {contiguous.steps / paged.steps:.1f}x fewer steps"],
        seconds=t.wall,
        chart={"concurrency at a fixed KV budget (paged / contiguous)": (ratio, 4.0)},
    )
    return section


def main() -> None:
    parser = arg_parser(__doc__, ["bfloat16"])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = start(parser)
    print(concurrency_section(args.model, args.dtype[0], args.requests, args.max_model_len).markdown())


if __name__ == "__main__":
    main()
