import itertools
import os
import re
from collections.abc import Sequence as SequenceABC

from pagedchat.engine.loading import loader
from pagedchat.engine.worker.compiled_decode import compiling_by_default
from pagedchat.engine.llm_engine import EngineConfig, LLMEngine
from pagedchat.engine.worker.model_runner import KVLayout
from pagedchat.engine.api.outputs import RequestOutput
from pagedchat.engine.api.params import SamplingParams
from pagedchat.kernels import select_backend

DEFAULT_NUM_KV_BLOCKS = 512
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like '256MiB', '2GB' or '1TiB' (KB, MB, GB, TB are powers of 10)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", size.lower())
    if not match:
        raise ValueError(f"not a size: {size!r} (use e.g. 256MiB or 2GB)")
    return int(float(match[1]) * _UNITS[match[2] or ""])


class LLM:
    """Offline inference on the paged engine, shaped like vLLM's ``LLM``."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        dtype: str = "auto",
        device: str = "auto",
        num_threads: int | None = None,
        compile: bool | None = None,
    ):
        torch_device = loader.resolve_device(device)
        torch_dtype = loader.resolve_dtype(dtype, torch_device)
        attention_ops = select_backend(attention_backend, torch_device.type)
        self.model_path = loader.resolve_model(model)
        config = loader.check_model(self.model_path, max_model_len)
        num_blocks = kv_pool_blocks(config, block_size, num_kv_blocks, kv_cache_memory, torch_dtype)
        context = loader.model_context_len(config, max_model_len)
        if max_model_len is None:
            context = min(context, num_blocks * block_size)
        model_obj, self.tokenizer = loader.load_model(self.model_path, torch_dtype, torch_device)
        engine_config = EngineConfig(
            num_kv_blocks=num_blocks, max_model_len=context, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            num_threads=num_threads, compile=compiling_by_default() if compile is None else compile,
        )
        self.engine = LLMEngine(model_obj, self.tokenizer, engine_config, attention_ops)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: str | list[int] | SequenceABC[str | list[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        request_ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, params in zip(request_ids, prompts, sampling_params):
            self.engine.add_request(request_id, prompt, params)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)


def kv_pool_blocks(config, block_size, num_kv_blocks, kv_cache_memory, dtype) -> int:
    if num_kv_blocks is not None and kv_cache_memory is not None:
        raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if kv_cache_memory is None:
        return DEFAULT_NUM_KV_BLOCKS if num_kv_blocks is None else num_kv_blocks
    per_block = KVLayout.of(config).bytes_per_block(block_size, dtype)
    num_blocks = parse_size(kv_cache_memory) // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {kv_cache_memory} is less than one KV block ({per_block} bytes)")
    return num_blocks
