"""Step overhead: the share of a decode step spent outside the model's forward, at 1 and 32 running
requests, and a profile of the engine's own code.

    python -m bench.step_overhead [--running 1 32] [--steps 10] [--prompt 128]

Requests are prefilled first; then every measured step is a pure decode step of all of them. Each
step is followed by `kv_snapshot()`, as the app's engine thread does. Times are split into: the model
call (the lean forward, `LeanModel.forward`, eager: the step is built with compiling off), batch preparation (the rest of
`runner.forward`: building input tensors), the rest of `step()` (scheduling, KV bookkeeping,
sampling, detokenising, outputs) and the snapshot; and the model call into its parts: the attention, the
logits (final norm and vocabulary projection) and, on a GGUF's quantized layers, each layer's two C calls
(norm, q/k/v and rotary before the attention; o_proj and the MLP after it).

    python -m bench.step_overhead --model ~/.cache/pagedchat/bench-models/llama-1b-shape.Q4_K_M.gguf \
        --dtype float32 --running 1 16     # a profile of a 1B Q4_K_M decode step
"""

import cProfile
import pstats
from pathlib import Path

from bench.common import Accumulator, Section, Table, arg_parser, start, load_llm, random_requests, stopwatch
from pagedchat.engine.config import DEFAULT_NUM_KV_BLOCKS, EngineArgs
from pagedchat.kernels import cpu_attention, quant

PARTS = ("before attention (norm, q/k/v, rotary)", "attention", "after attention (o_proj, MLP)", "logits")

OWN_CODE = (f"{Path('pagedchat', 'engine')}", "kernels")


def reply_tokens(running: int, steps: int, prompt: int) -> int:
    """Tokens each request generates: the measured steps and the profiled ones, and those the first requests
    decode while the last prompts are still prefilled, a chunk of them a step."""
    return steps + 8 + -(-running * prompt // EngineArgs().max_num_batched_tokens)


def decode_steps(llm, running: int, steps: int, prompt: int, profile: cProfile.Profile | None = None) -> dict:
    from pagedchat import SamplingParams

    engine = llm.engine
    reply = reply_tokens(running, steps, prompt)
    for i, r in enumerate(random_requests(running, (prompt, prompt), (1, 1), seed=running,
                                                  vocab=engine.runner.model.config.vocab_size)):
        engine.add_request(f"d{running}-{i}", r.prompt, SamplingParams(temperature=0.0, max_tokens=reply,
                                                                      ignore_eos=True))
    while any(item.num_uncomputed > 1 for item in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (the first decode step may come along; it is not measured)
    if len(engine.scheduler.running) != running:
        raise SystemExit(f"{len(engine.scheduler.running)} of {running} requests running: the KV pool is too small")
    model = engine.runner.lean
    runner_forward, model_forward = Accumulator(engine.runner.forward), Accumulator(model.forward)
    engine.runner.forward, model.forward = runner_forward, model_forward
    # the C calls of a GGUF's quantized layers, whichever path makes them (a decode step of an all-quantized
    # model: QuantizedStack, its attention a bound cpu_attention.DecodeStep; else layer by layer)
    attention_call = ((cpu_attention.DecodeStep, "__call__") if model.stack
                      else (engine.runner.attention_ops, "attention"))
    patched = [(quant.AttentionInputs, "run"), attention_call, (quant.Mlp, "run"), (model, "logits")]
    originals = [getattr(owner, name) for owner, name in patched]
    parts = dict(zip(PARTS, map(Accumulator, originals)))
    for (owner, name), part in zip(patched, PARTS):
        setattr(owner, name, (lambda timer: lambda *args: timer(*args))(parts[part]))
    step_time = snapshot_time = 0.0
    try:
        for _ in range(steps):
            with stopwatch() as t:
                engine.step()
            step_time += t.wall
            with stopwatch() as t:
                engine.kv_snapshot()
            snapshot_time += t.wall
    finally:
        del engine.runner.forward, model.forward  # back to the class methods
        for (owner, name), original in zip(patched, originals):
            if owner is model:
                del model.logits
            else:
                setattr(owner, name, original)
    if profile:  # separate steps: the profiler's own cost must not count in the times above
        profile.enable()
        for _ in range(min(steps, 4)):
            engine.step()
            engine.kv_snapshot()
        profile.disable()
    while engine.has_unfinished_requests():
        engine.step()
    total = step_time + snapshot_time
    return dict(
        running=running, step=total / steps, model=model_forward.seconds / steps,
        prep=(runner_forward.seconds - model_forward.seconds) / steps,
        rest=(step_time - runner_forward.seconds) / steps, snapshot=snapshot_time / steps,
        outside_runner=1 - runner_forward.seconds / total, outside_model=1 - model_forward.seconds / total,
        parts={name: timer.seconds / steps for name, timer in parts.items()},
    )


def own_code_profile(profile: cProfile.Profile, top: int = 8) -> tuple[Table, float]:
    """The engine's own functions (pagedchat/engine, kernels) by time spent in their own lines."""
    stats = pstats.Stats(profile).stats
    total = sum(tt for (_, _, tt, _, _) in stats.values())
    own = [(key, tt, ct, nc) for key, (_, nc, tt, ct, _) in stats.items() if any(p in key[0] for p in OWN_CODE)]
    own.sort(key=lambda item: item[1], reverse=True)
    rows = [[f"{Path(file).parent.name}/{Path(file).name}:{line} {name}", calls, f"{tt / total:.1%}", f"{ct / total:.1%}"]
            for (file, line, name), tt, ct, calls in own[:top]]
    share = sum(tt for _, tt, _, _ in own) / total
    return Table(["function", "calls", "own time", "with callees"], rows, "cProfile of the measured steps"), share


def step_overhead_section(model: str | None, dtype: str, running=(1, 32), steps: int = 10, prompt: int = 128) -> Section:
    with stopwatch() as t:
        # a pool for every request's prompt and reply (and the warm-up's), so that all of them run each step
        each = -(-(prompt + reply_tokens(max(running), steps, prompt)) // EngineArgs().block_size)
        llm = load_llm(model, dtype, compile=False, num_kv_blocks=max(DEFAULT_NUM_KV_BLOCKS, max(running) * each + 8))
        decode_steps(llm, 1, 2, 16)  # warm-up: first calls allocate
        profile = cProfile.Profile()
        results = [decode_steps(llm, n, steps, prompt, profile if n == max(running) else None) for n in running]
    rows = [[r["running"], r["step"] * 1e3, r["model"] * 1e3, r["prep"] * 1e3, r["rest"] * 1e3, r["snapshot"] * 1e3,
             f"{r['outside_runner']:.1%}", f"{r['outside_model']:.1%}"] for r in results]
    profile_table, own_share = own_code_profile(profile)
    part_rows = [[name] + [r["parts"][name] * 1e3 for r in results] for name in PARTS]
    part_rows.append(["rest of the model call (embedding, rotary tables, Python)"]
                     + [(r["model"] - sum(r["parts"].values())) * 1e3 for r in results])
    parts_table = Table(["part of the model call, ms per step"] + [f"{r['running']} running" for r in results],
                        part_rows, f"the model call by part ({llm.engine.runner.plan.describe()})")
    last = results[-1]
    met = "met" if last["outside_model"] <= 0.10 else "MISSED"
    return Section(
        f"5. Step overhead ({dtype})",
        settings=[f"decode steps of N running requests with {prompt}-token prompts, {steps} steps each, every "
                  "step followed by kv_snapshot() as in the app; milliseconds per step"],
        tables=[Table(["running", "step + snapshot", "model call", "batch preparation", "rest of step()",
                       "kv_snapshot()", "outside runner.forward", "outside the model call"], rows), parts_table,
                profile_table],
        notes=[f"goal <= 10% outside the model forward at {last['running']} running: {last['outside_model']:.1%} "
               f"(batch preparation counted as overhead) -> {met}",
               f"the engine's own Python (pagedchat/engine and kernels/, own lines) is {own_share:.1%} of the "
               f"profiled time at {last['running']} running; the rest is torch and transformers"],
        seconds=t.wall,
    )


def main() -> None:
    parser = arg_parser(__doc__, ["bfloat16", "float32"])
    parser.add_argument("--running", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompt", type=int, default=128, help="each request's prompt, tokens (its context)")
    args = start(parser)
    for dtype in args.dtype:
        print(step_overhead_section(args.model, dtype, tuple(args.running), args.steps, args.prompt).markdown())


if __name__ == "__main__":
    main()
