import itertools
import os
from collections.abc import Sequence as SequenceABC

from pagedchat.engine.chat import chat_prompt
from pagedchat.engine.config import EngineArgs, ResolvedConfig
from pagedchat.engine.llm_engine import LLMEngine
from pagedchat.engine.loading import loader
from pagedchat.engine.api.outputs import RequestOutput
from pagedchat.engine.api.params import SamplingParams


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
        kv_cache_dtype: str = "auto",  # "auto" (the model's dtype) | "bfloat16" | "float32" | "int8" | "fp8"
    ):
        self._start(EngineArgs(model, block_size, num_kv_blocks, kv_cache_memory, max_model_len, max_num_seqs,
                               max_num_batched_tokens, enable_prefix_caching, attention_backend, dtype, device,
                               num_threads, compile, kv_cache_dtype).resolve())

    @classmethod
    def from_config(cls, config: ResolvedConfig) -> "LLM":
        """The LLM of a config already resolved (and so checked), as the CLI hands it over."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: ResolvedConfig) -> None:
        self.config = config
        self.model_path = config.model_path
        model, self.tokenizer = loader.load_model(config.model_path, config.dtype, config.device)
        self.engine = LLMEngine(model, self.tokenizer, config.engine, config.attention_ops)
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
        return self.generate([chat_prompt(self.tokenizer, conv) for conv in conversations], sampling_params)

