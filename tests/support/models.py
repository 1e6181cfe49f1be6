"""Tiny random models built in place: one per supported architecture, with a byte-level tokenizer."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

ARCHITECTURES = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2", use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", use_sliding_window=False),
}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE without merges: every UTF-8 byte is a token, so any text round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIALS:
        vocab[tok] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
        pad_token="<|endoftext|>", chat_template=CHATML,
    )


def build_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    tokenizer = byte_tokenizer()
    fields = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        initializer_range=0.5, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    fields.update(ARCHITECTURES[arch])
    fields.update(overrides)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def add_gguf_tokenizer(writer, tokenizer) -> None:
    """The tokenizer's vocabulary, special tokens and chat template as llama.cpp's metadata."""
    writer.add_tokenizer_model("gpt2")
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_scores([0.0] * len(vocab))  # gguf drops an empty merges list; scores stand in
    writer.add_token_types([3 if token in tokenizer.all_special_tokens else 1 for token, _ in vocab])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(tokenizer.chat_template)
