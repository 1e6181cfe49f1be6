"""Real-size models for the benchmarks, built here (nothing is fetched): random weights (std 0.02) of the
Llama-3.2-1B, -3B and Llama-3.1-8B shapes with the default model's tokenizer and chat template, as the GGUF
files a user has: an F16 GGUF written with `gguf`'s writer, then Q8_0 and Q4_K_M by llama.cpp's
`llama-quantize` (the bench peers' build: `python -m bench.peers setup --only llama`).

    python -m bench.models 1b            # builds what is missing, prints the paths
    python -m bench.models 1b 3b --types Q4_K_M

The files live in ~/.cache/pagedchat/bench-models and are reused once built. The default model's tokenizer
(vocab 49,152) replaces Llama 3's (128,256), so the embedding and the LM head are smaller than the real
models' (1B: 0.10 of 1.1 billion weights against 0.26 of 1.24)."""

import argparse
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

from bench import peers

# name -> (layers, hidden, feed-forward, heads, kv heads, tied embeddings)
SHAPES = {
    "1b": (16, 2048, 8192, 32, 8, True),
    "3b": (28, 3072, 8192, 24, 8, True),
    "8b": (32, 4096, 14336, 32, 8, False),
}
TYPES = ("Q4_K_M", "Q8_0")
ROPE_THETA = 500000.0
STD = 0.02


def models_dir() -> Path:
    return peers.peers_dir().parent / "bench-models"


def model_path(shape: str, file_type: str) -> Path:
    return models_dir() / f"llama-{shape}-shape.{file_type}.gguf"


def build(shape: str, file_type: str) -> Path:
    """The model's GGUF of this type (F16, Q8_0, Q4_K_M), built first if missing."""
    target = model_path(shape, file_type)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if file_type == "F16":
        _write_f16(shape, target)
        return target
    source = build(shape, "F16")
    if not peers.llama_ready():
        raise SystemExit("llama-quantize is not built: python -m bench.peers setup --only llama")
    partial = target.with_suffix(".partial")
    subprocess.run([str(peers.llama_binary("llama-quantize")), str(source), str(partial), file_type], check=True,
                   stdout=subprocess.DEVNULL)
    partial.rename(target)
    return target


def _write_f16(shape: str, target: Path) -> None:
    from pagedchat.engine.loading import loader

    layers, hidden, ffn, heads, kv_heads, tied = SHAPES[shape]
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
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, field in tokenizer.fields.items():
        if name.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    tensors = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        tensors["output.weight"] = (vocab, hidden)
    for i in range(layers):
        tensors |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                    f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                    f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                    f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_gate.weight": (ffn, hidden),
                    f"blk.{i}.ffn_up.weight": (ffn, hidden), f"blk.{i}.ffn_down.weight": (hidden, ffn)}
    for name, tensor_shape in tensors.items():  # norms in F32, as llama.cpp keeps them
        dtype = np.float32 if len(tensor_shape) == 1 else np.float16
        writer.add_tensor_info(name, tensor_shape, np.dtype(dtype), int(np.prod(tensor_shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, tensor_shape in tensors.items():  # one tensor in memory at a time
        if len(tensor_shape) == 1:
            writer.write_tensor_data(np.ones(tensor_shape, np.float32))
        else:
            writer.write_tensor_data((rng.standard_normal(tensor_shape, np.float32) * STD).astype(np.float16))
    writer.close()
    partial.rename(target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="+", choices=tuple(SHAPES))
    parser.add_argument("--types", nargs="+", default=list(TYPES))
    args = parser.parse_args(argv)
    for shape in args.shapes:
        for file_type in args.types:
            path = build(shape, file_type)
            print(f"{path}  {path.stat().st_size / 1e9:.2f} GB", file=sys.stderr)


if __name__ == "__main__":
    main()
