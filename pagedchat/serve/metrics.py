"""/metrics in Prometheus' text format, with vLLM's metric names, from the engine's snapshot."""

from dataclasses import dataclass

from pagedchat.engine.worker.compiled_decode import compiling
from pagedchat.engine.api.outputs import RequestOutput
from pagedchat.engine.api.snapshot import KVSnapshot


@dataclass
class Counters:
    """What the snapshot does not count: tokens in and out of finished requests."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests: int = 0

    def add(self, output: RequestOutput, prompt_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += sum(len(out.token_ids) for out in output.outputs)
        self.requests += 1


def render(snapshot: KVSnapshot | None, counters: Counters | None, model_name: str) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float, labels: dict[str, str] | None = None) -> None:
        labels = {"model_name": model_name, **(labels or {})}
        label_text = ",".join(f'{key}="{val}"' for key, val in labels.items())
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{label_text}}} {value}"])

    if snapshot is not None and counters is not None:
        used = snapshot.num_blocks - snapshot.num_free_blocks
        metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               used / snapshot.num_blocks)
        metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               snapshot.num_running)
        metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               snapshot.num_waiting)
        metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.", snapshot.num_preemptions)
        metric("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in tokens.",
               snapshot.prefix_cache_queries)
        metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens.", snapshot.prefix_cache_hits)
        metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", counters.prompt_tokens)
        metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
               counters.generation_tokens)
        metric("vllm:request_success_total", "counter", "Count of finished requests.", counters.requests)
        metric("vllm:cache_config_info", "gauge", "Information of the KV cache config.", 1,
               {"block_size": str(snapshot.block_size), "num_gpu_blocks": str(snapshot.num_blocks),
                "cache_dtype": snapshot.kv_cache_dtype,
                "kv_cache_memory_bytes": str(snapshot.num_blocks * snapshot.bytes_per_block)})
    # A compile takes a core and much of the GIL for 15 s to 2 min (compiled_decode.py): what a benchmark
    # waits out before it times the server, as it does for LLM.generate in its own process.
    metric("pagedchat:decode_compiling", "gauge", "1 while the one-chat decode step compiles in the background.",
           int(compiling()))
    return "\n".join(lines) + "\n"
