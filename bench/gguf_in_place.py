"""One chat's decode speed on a GGUF run in place against the same shapes in bf16 (the path a GGUF took before:
converted to a bf16 folder), without llama.cpp's tools: the Q4_K_M file is written here with random valid
blocks (the type mix `llama-quantize` gives a Q4_K_M: Q6_K for the tied embedding and for attn_v and ffn_down
in llama.cpp's `use_more_bits` layers, Q4_K elsewhere), the default model's tokenizer.

    python -m bench.gguf_in_place 1b --tokens 128 --threads 2

Each engine runs in its own process, one after the other; the files are kept in ~/.cache/pagedchat/bench-models.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from bench import models

# d ranges that give weights of std ~0.02, centred (see tests/test_gguf_model.py's random_blocks)
_D = {T.Q4_K: 2e-5, T.Q6_K: 1.5e-6}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down a Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def random_blocks(rng: np.random.Generator, ggml_type: T, rows: int, depth: int) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows, depth // block, size), dtype=np.uint8)
    d = rng.uniform(0.5, 1.5, size=raw.shape[:2]) * _D[ggml_type]

    def put(offset: int, values: np.ndarray) -> None:
        raw[..., offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)

    if ggml_type == T.Q6_K:
        put(size - 2, d)
    else:
        put(0, d)
        put(2, d * 7.5)
    return raw.reshape(rows, -1)


def q4_k_m_path(shape: str) -> Path:
    return models.models_dir() / f"llama-{shape}-shape.random-Q4_K_M.gguf"


def write_q4_k_m(shape: str) -> Path:
    from pagedchat.engine.loading import loader

    target = q4_k_m_path(shape)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    layers, hidden, ffn, heads, kv_heads, tied = models.SHAPES[shape]
    head_dim = hidden // heads
    tokenizer = gguf.GGUFReader(loader.default_model_file())
    vocab = int(tokenizer.fields["llama.vocab_size"].contents())
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, "llama")
    writer.add_name(f"random llama {shape} shape")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(models.ROPE_THETA)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for name, field in tokenizer.fields.items():
        if name.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    tensors = {"token_embd.weight": (vocab, hidden, T.Q6_K if tied else T.Q4_K), "output_norm.weight": (hidden,)}
    if not tied:
        tensors["output.weight"] = (vocab, hidden, T.Q6_K)
    for i in range(layers):
        more = T.Q6_K if use_more_bits(i, layers) else T.Q4_K
        tensors |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                    f"blk.{i}.attn_q.weight": (hidden, hidden, T.Q4_K),
                    f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden, T.Q4_K),
                    f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden, more),
                    f"blk.{i}.attn_output.weight": (hidden, hidden, T.Q4_K),
                    f"blk.{i}.ffn_gate.weight": (ffn, hidden, T.Q4_K), f"blk.{i}.ffn_up.weight": (ffn, hidden, T.Q4_K),
                    f"blk.{i}.ffn_down.weight": (hidden, ffn, more)}
    for name, spec in tensors.items():
        if len(spec) == 1:
            writer.add_tensor_info(name, spec, np.dtype(np.float32), spec[0] * 4)
        else:
            rows, depth, kind = spec
            block, size = GGML_QUANT_SIZES[kind]
            writer.add_tensor_info(name, (rows, depth * size // block), np.dtype(np.uint8),
                                   rows * depth // block * size, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for spec in tensors.values():  # one tensor in memory at a time
        if len(spec) == 1:
            writer.write_tensor_data(np.ones(spec, np.float32))
        else:
            writer.write_tensor_data(random_blocks(rng, spec[2], spec[0], spec[1]))
    writer.close()
    partial.rename(target)
    return target


def bf16_folder(shape: str) -> Path:
    """The same shapes as a Hugging Face folder in bf16 (random, std 0.02), with the default tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pagedchat.engine.loading import loader

    target = models.models_dir() / f"llama-{shape}-shape.bf16"
    if target.is_dir():
        return target
    layers, hidden, ffn, heads, kv_heads, tied = models.SHAPES[shape]
    default = loader.default_model_file()
    tokenizer = AutoTokenizer.from_pretrained(str(default.parent), gguf_file=default.name)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=ffn,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=8192, rope_theta=models.ROPE_THETA, tie_word_embeddings=tied,
                         initializer_range=models.STD, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    partial = target.with_suffix(".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)
    return target


def measure(model: str, dtype: str, tokens: int, threads: int) -> dict:
    """Run in a child process: load, one request of `tokens` greedy tokens, EOS ignored; decode tokens/s
    from the steps after the prefill."""
    import torch

    from pagedchat import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, device="cpu", attention_backend="torch", num_kv_blocks=64,
              num_threads=threads, compile=False)
    loaded = time.perf_counter() - started
    engine = llm.engine
    prompt = llm.get_tokenizer().encode("Tell me a long story about a lighthouse keeper.")
    engine.add_request("warm", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("chat", prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    engine.step()  # the prefill and the first token
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return {"model": Path(model).name, "plan": engine.runner.plan.describe(), "load_s": round(loaded, 2),
            "decode_tok_s": round(len(steps) / sum(steps), 2), "median_step_ms": round(1e3 * float(np.median(steps)), 2),
            "threads": torch.get_num_threads(), "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=tuple(models.SHAPES))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--measure", nargs=2, metavar=("MODEL", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure, args.tokens, args.threads)))
        return
    runs = [(write_q4_k_m(args.shape), "float32"), (bf16_folder(args.shape), "bfloat16")]
    for model, dtype in runs:
        done = subprocess.run([sys.executable, "-m", "bench.gguf_in_place", args.shape, "--tokens", str(args.tokens),
                               "--threads", str(args.threads), "--measure", str(model), dtype],
                              capture_output=True, text=True, check=True)
        print(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
