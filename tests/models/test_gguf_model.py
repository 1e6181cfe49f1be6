"""A GGUF run in place: a tiny Llama whose tensors are of every type the kernels take (and one they do not),
against transformers' own dequantized load of the same file in fp32."""

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from transformers import AutoModelForCausalLM

from pagedchat import LLM, SamplingParams
from pagedchat.engine.layers.quantized import ColumnProduct, QuantizedLayer, QuantizedStack, QuantizedWeight
from pagedchat.engine.loading import gguf as gguf_loading
from pagedchat.engine.loading import loader
from pagedchat.kernels import AttentionMetadata, quant, torch_ops
from support.models import add_gguf_tokenizer, byte_tokenizer

pytestmark = pytest.mark.skipif(quant.isa() is None, reason="cpu_quant.c could not be built here")

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 512, 4, 2, 64, 2
# a Q4_K_M-like mix, an F16 matrix, and Q5_0, which the kernels do not take (dequantized at load)
TYPES = {
    "token_embd": T.Q8_0, "output": T.Q4_K,
    "attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_output": T.Q8_0,
    "ffn_gate": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.Q6_K,
}
LAST_LAYER_TYPES = {"attn_output": T.F16, "ffn_down": T.Q5_0}
# The logits' error against fp32 activations, relative to their norm at the worst position: what the 8-bit
# rounding makes of two layers and the head (measured 0.02-0.06), and no more than the reference that rounds
# its activations as the kernels do is from fp32 itself (measured equal to three digits). The engine and that
# reference are not closer to each other than ~1e-6 to ~3e-2: where fp32 sums in another order put an
# activation on the other side of a rounding boundary it moves by a whole step, and Qwen3's normed q and k
# sharpen attention enough to carry such a step to the logits.
EXACT_RELATIVE = 0.1
ROUNDING_EXPLAINS = 1.25
FP32_RELATIVE = 1e-4  # the same weights in fp32 throughout: sums in another order
EXACT_RELATIVE = 0.1
# where the engine's greedy token is not the reference's top one, the reference holds it this close (logits)
NEAR_TIE = 0.5


def random_blocks(rng: np.random.Generator, ggml_type: T, rows: int, depth: int) -> np.ndarray:
    """uint8 [rows, row bytes] of valid K-quant blocks: random bytes for the values and sub-block scales, fp16
    d small enough that the weights are of a real model's size, and dmin such that they centre on zero as a
    real model's do (else every product sums coherently and the model's attention is a saturated softmax
    that any rounding flips)."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows, depth // block, size), dtype=np.uint8)
    d = rng.uniform(5e-5, 2e-4, size=raw.shape[:2])

    def put(offset: int, values: np.ndarray) -> None:
        raw[..., offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)

    if ggml_type == T.Q6_K:  # d * scale * (q - 32): centred already
        put(size - 2, d / 10)
    else:  # d * scale * q - dmin * m, q up to 15 (Q4_K) or 31 (Q5_K), scale and m alike
        put(0, d)
        put(2, d * (7.5 if ggml_type == T.Q4_K else 15.5))
    return raw.reshape(rows, -1)


def tensor_for(rng: np.random.Generator, ggml_type: T, rows: int, depth: int) -> np.ndarray:
    if GGML_QUANT_SIZES[ggml_type][0] == 256:
        return random_blocks(rng, ggml_type, rows, depth)
    values = rng.normal(0, 0.08, size=(rows, depth)).astype(np.float32)
    return gguf.quants.quantize(values, ggml_type)


def write_tiny_gguf(out: Path, seed: int, arch: str = "llama", last_layer_types: dict = LAST_LAYER_TYPES,
                    rope_freqs: np.ndarray | None = None) -> Path:
    """A llama.cpp-style file of `arch` (llama, qwen2 with q/k/v biases, qwen3 with q/k norms). A Llama's q/k
    rows are simply the file's (random) bytes, which transformers un-permutes on its load as it does any
    llama.cpp Llama's. `rope_freqs`: the factors that divide the rotary frequencies, as llama.cpp's converter
    writes a Llama 3's rope scaling."""
    rng = np.random.default_rng(seed)
    tokenizer = byte_tokenizer()
    vocab = len(tokenizer)
    # Qwen3's heads are wider than hidden / heads (transformers reads no head size from a Qwen3 file: its 128)
    head_dim = 128 if arch == "qwen3" else HEAD_DIM
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    add_gguf_tokenizer(writer, tokenizer)

    def add(name: str, ggml_type: T, rows: int, depth: int) -> None:
        data = tensor_for(rng, ggml_type, rows, depth)
        writer.add_tensor(name, data, raw_dtype=None if ggml_type in (T.F32, T.F16) else ggml_type)

    def norm(name: str, size: int = HIDDEN) -> None:
        writer.add_tensor(name, rng.uniform(0.8, 1.2, size=size).astype(np.float32))

    add("token_embd.weight", TYPES["token_embd"], vocab, HIDDEN)
    add("output.weight", TYPES["output"], vocab, HIDDEN)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    norm("output_norm.weight")
    shapes = {"attn_q": (HEADS * head_dim, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HEADS * head_dim),
              "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN), "ffn_down": (HIDDEN, INTERMEDIATE)}
    for i in range(LAYERS):
        types = TYPES | (last_layer_types if i == LAYERS - 1 else {})
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for name, (rows, depth) in shapes.items():
            add(f"blk.{i}.{name}.weight", types[name], rows, depth)
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{i}.{name}.bias", rng.normal(0, 0.5, size=rows).astype(np.float32))
        if arch == "qwen3":
            norm(f"blk.{i}.attn_q_norm.weight", head_dim)
            norm(f"blk.{i}.attn_k_norm.weight", head_dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(params=[("llama", 0), ("llama", 1), ("qwen2", 2), ("qwen3", 3)], ids=lambda p: f"{p[0]}-{p[1]}")
def tiny_gguf(request, tmp_path) -> Path:
    arch, seed = request.param
    return write_tiny_gguf(tmp_path / "tiny.Q4_K_M.gguf", seed, arch)


def reference(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def engine_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The engine's logits at every position of `ids`, teacher-forced in one prefill."""
    runner = llm.engine.runner
    block_size = runner.block_size
    table = list(range(-(-len(ids) // block_size)))
    metadata = AttentionMetadata.build([table], [len(ids)], [len(ids)], list(range(len(ids))))
    positions = torch.arange(len(ids))
    return runner.lean.forward(torch.tensor(ids), positions, positions, runner.kv_caches, metadata, torch_ops)


def make_llm(path: Path) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", attention_backend="torch", num_kv_blocks=32)


def with_8bit_activations(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    """The reference with llama.cpp's rounding of activations simulated: the input of each product rounded per
    block (of its weight type's block: 32, or 256 for K-quants) to amax / 127 steps, and the matrix the
    engine holds as a bf16 copy rounded to bf16; everything else stays transformers' fp32."""
    header = gguf_loading.read_header(path)
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        kind = header.tensors[gguf_name(module_name, header.tensors)].ggml_type
        if kind not in quant.TYPES:
            if kind not in (T.F32, T.F16):
                module.weight.data = module.weight.data.bfloat16().float()
            continue
        block = GGML_QUANT_SIZES[T(kind)][0]

        def round_input(_, args, block=block):
            x = args[0]
            blocks = x.reshape(*x.shape[:-1], -1, block)
            step = blocks.abs().amax(-1, keepdim=True) / 127
            rounded = torch.where(step > 0, torch.round(blocks / torch.where(step > 0, step, 1)) * step, 0)
            return (rounded.reshape(x.shape),)

        module.register_forward_pre_hook(round_input)
    return model


def gguf_name(module_name: str, tensors: dict) -> str:
    if module_name == "lm_head":
        return "output.weight" if "output.weight" in tensors else "token_embd.weight"
    _, _, layer, _, linear = module_name.split(".")
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    return f"blk.{layer}.{names[linear]}.weight"


def test_logits_match_the_dequantized_model(tiny_gguf):
    llm = make_llm(tiny_gguf)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    got = engine_logits(llm, ids)
    with torch.no_grad():
        exact = reference(tiny_gguf)(torch.tensor([ids])).logits[0]
        rounded = with_8bit_activations(reference(tiny_gguf), tiny_gguf)(torch.tensor([ids])).logits[0]

    def error(want: torch.Tensor) -> float:
        return ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()

    rounding = ((rounded - exact).norm(dim=-1) / exact.norm(dim=-1)).max().item()
    cosine = torch.nn.functional.cosine_similarity(got, exact, dim=-1)
    top1 = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
    print(f"against fp32 activations: relative error {error(exact):.4f} (the rounded reference's own "
          f"{rounding:.4f}), cosine min {cosine.min():.6f}, top-1 agreement {top1:.3f}; against rounded "
          f"activations: {error(rounded):.2e}")
    assert error(exact) < EXACT_RELATIVE
    assert error(exact) <= ROUNDING_EXPLAINS * rounding
    assert cosine.min() > 0.998 and top1 >= 0.85


@pytest.mark.parametrize("arch, kv_cache_dtype", [("llama", "auto"), ("qwen2", "auto"), ("qwen3", "auto"),
                                                 ("llama", "int8")])
def test_a_decode_step_of_quantized_layers_runs_as_the_layer_by_layer_path(arch, kv_cache_dtype, tmp_path,
                                                                             monkeypatch):
    """Where every layer is quantized, a step of decodes only runs as three C calls a layer on buffers made once
    (QuantizedStack): the same logits and the same K/V stored as the layer-by-layer path (itself checked against
    transformers above), for sequences of different lengths in one step, over an fp16 or an 8-bit cache."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", 5, arch, last_layer_types={})
    llm = LLM(model=str(path), dtype="float32", device="cpu", attention_backend="torch", num_kv_blocks=32,
              kv_cache_dtype=kv_cache_dtype)
    runner, model = llm.engine.runner, llm.engine.runner.lean
    assert model.stack is not None
    assert runner.kv_caches[0][0].dtype == (torch.int8 if kv_cache_dtype == "int8" else torch.float16)
    rng = torch.Generator().manual_seed(13)
    lengths, bs = [5, 17, 40], runner.block_size
    tables = [[s * 4 + b for b in range(4)] for s in range(len(lengths))]
    for table, length in zip(tables, lengths):  # each context's K/V, by a prefill of its own
        ids = torch.randint(0, 256, (length,), generator=rng)
        positions = torch.arange(length)
        metadata = AttentionMetadata.build([table], [length], [length], [table[p // bs] * bs + p % bs
                                                                         for p in positions.tolist()])
        model.forward(ids, positions, positions[-1:], runner.kv_caches, metadata, torch_ops)
    new = torch.randint(0, 256, (len(lengths),), generator=rng)
    positions = torch.tensor(lengths)
    slots = [table[p // bs] * bs + p % bs for table, p in zip(tables, lengths)]
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    stacked = []
    monkeypatch.setattr(QuantizedStack, "decode", lambda self, *a, run=QuantizedStack.decode: stacked.append(
        run(self, *a)) or stacked[-1])

    def decode_step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        for (k, v), (k0, v0) in zip(runner.kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        metadata = AttentionMetadata.build(tables, [n + 1 for n in lengths], [1] * len(lengths), slots)
        logits = model.forward(new, positions, torch.arange(len(lengths)), runner.kv_caches, metadata, torch_ops)
        return logits, [c.clone() for pair in runner.kv_caches for c in pair]

    logits, caches = decode_step()
    assert stacked == [True]
    monkeypatch.setattr(model, "stack", None)
    want_logits, want_caches = decode_step()
    assert torch.equal(logits, want_logits)
    assert all(torch.equal(got, want) for got, want in zip(caches, want_caches))
    assert not all(torch.equal(got, k0) for got, (k0, _) in zip(caches[::2], before))  # the step stored its keys


def test_dequantized_everywhere_where_the_kernels_cannot_run(tiny_gguf, monkeypatch):
    """On a GPU, or a CPU without a C compiler, every tensor is dequantized to the dtype asked for: then the
    model is transformers' own to fp32's rounding."""
    monkeypatch.setattr(gguf_loading, "runs_in_place", lambda device: False)
    llm = make_llm(tiny_gguf)
    assert not llm.engine.runner.plan.weight_formats
    assert not isinstance(llm.engine.runner.lean.layers[0].qkv, ColumnProduct)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(11)).tolist()
    got = engine_logits(llm, ids)
    with torch.no_grad():
        want = reference(tiny_gguf)(torch.tensor([ids])).logits[0]
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < FP32_RELATIVE


def test_greedy_tokens_are_the_reference_choices(tiny_gguf):
    """Each greedy token the engine picks is the reference's top one on the same prefix, or within a near
    tie of it (8-bit activations may break a tie the other way)."""
    llm = make_llm(tiny_gguf)
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    tokens = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        logits = reference(tiny_gguf)(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    best = logits.max(dim=-1).values
    chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert (best - chosen <= NEAR_TIE).all(), (best - chosen).tolist()
    assert (best == chosen).float().mean() >= 0.75


def test_weights_stay_in_the_file(tiny_gguf):
    """Loading adds no copy of the quantized tensors: each lies in the file's own mapping."""
    model, _ = loader.load_model(tiny_gguf, torch.float32, torch.device("cpu"))
    mapped = [tuple(int(a, 16) for a in line.split()[0].split("-"))
              for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(tiny_gguf))]
    assert mapped
    quantized = [t for t in model.tensors.values() if isinstance(t, QuantizedWeight)]
    assert len(quantized) == 2 + LAYERS * 7 - 2  # all but the F16 and the Q5_0 matrix
    for tensor in quantized + [model.tensors[f"blk.{LAYERS - 1}.attn_output.weight"]]:
        data = tensor.data if isinstance(tensor, QuantizedWeight) else tensor
        start, end = data.data_ptr(), data.data_ptr() + data.numel() * data.element_size()
        assert any(low <= start and end <= high for low, high in mapped)


def test_the_types_the_kernels_do_not_take_are_dequantized_and_said(tiny_gguf, caplog):
    model, _ = loader.load_model(tiny_gguf, torch.float32, torch.device("cpu"))
    assert "1 tensors of types the kernels do not take (Q5_0) dequantized to bf16: +0 MiB" in caplog.text
    name = f"blk.{LAYERS - 1}.ffn_down.weight"
    [entry] = model.dequantized
    assert (entry.name, entry.ggml_type) == (name, "Q5_0")
    assert entry.bytes == HIDDEN * INTERMEDIATE * 2  # bf16
    assert model.tensors[name].dtype == torch.bfloat16
    header = gguf.GGUFReader(tiny_gguf)
    assert gguf_loading.gguf_weights_bytes(tiny_gguf) == sum(int(t.n_bytes) for t in header.tensors) + entry.bytes
    line = make_llm(tiny_gguf).engine.runner.plan.describe()
    quantized, rest = line.split(f" on {quant.isa()}: quant kernels (8-bit activations), ")
    assert set(quantized.split("/")) == {"Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1"}
    assert set(rest.split(" ")[0].split("/")) == {"BF16", "F16"} and "; decode attention " in rest


def test_sibling_products_are_not_concatenated(tiny_gguf):
    llm = make_llm(tiny_gguf)
    layer = llm.engine.runner.lean.layers[0]
    assert isinstance(layer.qkv, ColumnProduct) and len(layer.qkv.parts) == 3
    assert isinstance(layer.gate_up, ColumnProduct) and len(layer.gate_up.parts) == 2
    # all but the attention in two C calls where every matrix is quantized; the last layer has an F16 and a
    # dequantized matrix, and runs product by product (the logits' tests above cover both)
    assert isinstance(layer.quantized, QuantizedLayer) and llm.engine.runner.lean.layers[-1].quantized is None


def test_the_kv_cache_is_fp16_as_llama_cpps(tiny_gguf):
    """A GGUF run in place computes in fp32 but caches K/V in fp16 (llama.cpp's cache type), so the same tokens
    take half an fp32 cache's bytes. The logits' and greedy tests above run on this cache (a prompt attends over
    its K/V as the cache rounds them)."""
    llm = make_llm(tiny_gguf)
    runner = llm.engine.runner
    assert all(cache.dtype == torch.float16 for layer in runner.kv_caches for cache in layer)
    head_dim = runner.layout.head_dim
    assert llm.config.bytes_per_block == 2 * LAYERS * 16 * KV_HEADS * head_dim * 2
    assert llm.config.pool_bytes == 32 * llm.config.bytes_per_block
    assert runner.lean.dtype == torch.float32
    fp32 = LLM(model=str(tiny_gguf), dtype="float32", device="cpu", num_kv_blocks=32, kv_cache_dtype="float32")
    assert fp32.config.bytes_per_block == 2 * llm.config.bytes_per_block


def test_a_llama_3_files_rope_factors_give_transformers_llama3_rotary(tmp_path):
    """A llama.cpp file of Llama 3 (3.1, 3.2) carries its rope scaling as `rope_freqs`, the factors its converter
    computes from the config's llama3 parameters, not as metadata: the engine's rotary tables are those of
    transformers' rotary module with those parameters, which differ from the default frequencies'."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    original, factor, low, high = 16, 8.0, 1.0, 4.0
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}
    # llama.cpp's convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors
    wavelength = 2 * np.pi * 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    smooth = (original / wavelength - low) / (high - low)
    factors = np.where(wavelength < original / high, 1.0,
                       np.where(wavelength > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    lean = make_llm(write_tiny_gguf(tmp_path / "tiny.Q4_K_M.gguf", 5, rope_freqs=factors)).engine.runner.lean
    positions = torch.arange(256)[None]

    def tables(parameters: dict) -> tuple[torch.Tensor, torch.Tensor]:
        config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                             max_position_embeddings=256, rope_parameters=parameters)
        cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, 1, dtype=torch.float32), positions)
        return cos[0], sin[0]

    cos, sin = tables(rope)
    default_cos, _ = tables({"rope_type": "default", "rope_theta": 10000.0})
    assert (cos - default_cos).abs().max() > 0.5  # the factors matter at these positions
    half = HEAD_DIM // 2
    torch.testing.assert_close(lean.cos[:256], cos, atol=2e-5, rtol=0)
    torch.testing.assert_close(lean.sin_signed[:256], torch.cat([-sin[:, :half], sin[:, half:]], -1), atol=2e-5, rtol=0)


def test_the_header_is_read_as_gguf_reads_it(tiny_gguf):
    header = gguf_loading.read_header(tiny_gguf)
    reference_reader = gguf.GGUFReader(tiny_gguf)
    assert list(header.tensors) == [t.name for t in reference_reader.tensors]
    for tensor in reference_reader.tensors:
        info = header.tensors[tensor.name]
        assert (info.offset, info.nbytes, info.ggml_type) == (tensor.data_offset, tensor.n_bytes, tensor.tensor_type)
        assert info.shape == tuple(reversed(tensor.shape.tolist()))
    assert header.metadata[f"{header.architecture}.attention.head_count"] == HEADS
    assert header.metadata["tokenizer.ggml.tokens"] == len(byte_tokenizer())  # an array is its length


@pytest.mark.parametrize("tiny_gguf", [("llama", 0), ("qwen3", 3)], indirect=True, ids=["llama", "qwen3"])
def test_a_gguf_runs_without_transformers_model_code(tiny_gguf):
    """transformers' model code (~170 MB resident, seconds to import) stays out of a process that runs a GGUF:
    its config, tokenizer and rotary frequencies need none of it."""
    code = (f"import sys; from pagedchat import LLM; LLM(model={str(tiny_gguf)!r}, device='cpu', num_kv_blocks=32)"
            ".generate([[5, 6, 7]]); print([m for m in sys.modules if m == 'transformers.modeling_utils' "
            "or m.startswith('transformers.models.') and '.modeling_' in m and not m.endswith('_auto')])")
    # run outside the checkout, whose kernels/ would hide the `kernels` package transformers imports
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tiny_gguf.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("tiny_gguf", [("llama", 0), ("qwen3", 3)], indirect=True, ids=["llama", "qwen3"])
def test_a_second_start_imports_no_config_class_of_the_family(tiny_gguf):
    """Once a GGUF's config and tokenizer are cached, starting on it imports neither the family's config class nor
    what that brings along (transformers' model-loading code: torch.distributed's tensors, sympy; ~55 MB
    resident), and the config still says what the family's class said."""
    from transformers import AutoConfig

    folder = gguf_loading.metadata_folder(tiny_gguf, gguf_loading.read_header(tiny_gguf))  # the first start's
    unwanted = ["sympy", "torch.distributed.tensor",
                *(f"transformers.models.{family}.configuration_{family}" for family in ("llama", "qwen2", "qwen3"))]
    code = (f"import sys; from pagedchat import LLM; LLM(model={str(tiny_gguf)!r}, device='cpu', num_kv_blocks=32)"
            f".generate([[5, 6, 7]]); print([m for m in {unwanted!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300,
                          cwd=tiny_gguf.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    family = AutoConfig.from_pretrained(folder)
    config = loader.check_model(tiny_gguf)
    assert config.model_type == family.model_type
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
                 "vocab_size", "tie_word_embeddings", "eos_token_id", "bos_token_id", "sliding_window",
                 "layer_types", "attention_bias"):
        assert getattr(config, name, None) == getattr(family, name, None), name
