"""A server's /metrics (Prometheus text, vLLM's metric names, as vLLM and `pagedchat serve` render them)
as one value, and the rates between two of them."""

from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# The sample names summed over the data-parallel ranks, by field.
SUMMED = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "generation_tokens": "vllm:generation_tokens_total",
}


@dataclass(frozen=True, slots=True)
class ServerMetrics:
    """The pool and the request counts, summed over the server's data-parallel ranks (each has a pool)."""

    num_blocks: int | None  # None until the server has sized its pool
    block_size: int | None
    usage: float  # the share of the pool in use, 0..1: the ranks' mean
    running: int
    waiting: int
    preemptions: int
    prefix_queries: int  # in tokens
    prefix_hits: int
    generation_tokens: int
    ranks: int


@dataclass(frozen=True, slots=True)
class MetricsRate:
    tokens_per_second: float
    hit_rate: float | None  # prefix-cache hits per queried token; None when nothing was queried


def parse_metrics(text: str) -> ServerMetrics:
    totals: dict[str, float] = defaultdict(float)
    usages: list[float] = []
    pools: dict[str, tuple[int | None, int | None]] = {}  # engine -> (num_gpu_blocks, block_size)
    engines: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            engine = sample.labels.get("engine")
            if engine is not None:
                engines.add(engine)
            if sample.name == "vllm:kv_cache_usage_perc":
                usages.append(sample.value)
            elif sample.name == "vllm:cache_config_info":
                pools[engine or ""] = (as_int(sample.labels.get("num_gpu_blocks")),
                                       as_int(sample.labels.get("block_size")))
            else:
                totals[sample.name] += sample.value
    blocks = [num for num, _ in pools.values()]
    sizes = {size for _, size in pools.values()}
    return ServerMetrics(
        num_blocks=sum(blocks) if blocks and None not in blocks else None,
        block_size=sizes.pop() if len(sizes) == 1 else None,
        usage=sum(usages) / len(usages) if usages else 0.0,
        ranks=len(engines) or 1,
        **{field: int(totals[name]) for field, name in SUMMED.items()},
    )


def as_int(label: str | None) -> int | None:
    # vLLM writes its CacheConfig's fields with str(): "None" for a pool not sized yet.
    return int(label) if label is not None and label.isdigit() else None


def rate(before: ServerMetrics, before_time: float, after: ServerMetrics, after_time: float) -> MetricsRate:
    """Between two scrapes at their monotonic times. A counter that went down (the server restarted)
    counts from zero, as Prometheus' rate() does."""
    def grown(field: str) -> int:
        old, new = getattr(before, field), getattr(after, field)
        return new - old if new >= old else new

    elapsed = after_time - before_time
    queries = grown("prefix_queries")
    return MetricsRate(tokens_per_second=grown("generation_tokens") / elapsed if elapsed > 0 else 0.0,
                       hit_rate=grown("prefix_hits") / queries if queries else None)
