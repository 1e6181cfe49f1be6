"""The vLLM CPU worker of bench/peer_bench.py: run with the python of vLLM's venv (bench/peers.py), on a
job file; prints its results as one JSON line. vLLM spawns processes, hence the __main__ guard."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peer_timing  # noqa: E402  (beside this file; vLLM's venv has no pagedchat)


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = peer_timing.read_job()
    # the rounds repeat their prompts: none may come from a cache, as llama-server is asked (cache_prompt false)
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              enable_prefix_caching=False)

    def generate(prompts: list[list[int]], new_tokens: list[int]) -> list[int]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in new_tokens]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    results = peer_timing.run_job(job, generate)
    peer_timing.write_result(results)


if __name__ == "__main__":
    main()
