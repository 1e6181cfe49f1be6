"""`kv_cache_dtype`: the pool's blocks and bytes follow from it, bad values are one line, and an 8-bit cache runs
the engine's whole life of a block (prefix sharing, copy-on-write, preemption) as a 16-bit one does."""

import pytest
import torch
from support.engine import make_llm, random_prompts, run_to_end

from pagedchat import SamplingParams, cli
from pagedchat.engine.config import ConfigError, EngineArgs
from pagedchat.engine.core.invariants import assert_invariants
from pagedchat.kernels import native

has_avx2 = native.AVX2_CPU_FLAGS <= native.cpu_flags()

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def resolve(kv_cache_dtype: str, **kwargs):
    return EngineArgs(kv_cache_memory="64MiB", device="cpu", kv_cache_dtype=kv_cache_dtype, **kwargs).resolve(
        progress=False)


def test_an_8_bit_pool_holds_at_least_1_85x_the_bf16_blocks_in_the_same_memory():
    """The default model (30 layers, 3 KV heads of 64): a bf16 row is 128 bytes, an 8-bit one 64 + a 4-byte
    scale; its GGUF computes in fp32, and `auto` caches it in fp16, as llama.cpp does."""
    rows = {"bfloat16": 128, "float32": 256, "int8": 68, "fp8": 68, "auto": 128}
    configs = {name: resolve(name) for name in rows}
    for name, row in rows.items():
        assert configs[name].bytes_per_block == 2 * 30 * 16 * 3 * row, name
        assert configs[name].engine.num_kv_blocks == 64 * 2**20 // configs[name].bytes_per_block, name
    assert configs["int8"].engine.num_kv_blocks >= 1.85 * configs["bfloat16"].engine.num_kv_blocks
    assert configs["int8"].engine.kv_cache_dtype == torch.int8 and configs["fp8"].engine.kv_cache_dtype == torch.uint8


def test_an_unknown_kv_cache_dtype_is_one_line_before_anything_loads(tiny_model, capsys):
    with pytest.raises(ConfigError) as refused:
        EngineArgs(model=tiny_model, kv_cache_dtype="int4").resolve()
    assert str(refused.value) == ("unknown kv_cache_dtype 'int4' (--kv-cache-dtype): choose one of auto, bfloat16, "
                                  "float32, int8, fp8")
    with pytest.raises(SystemExit) as exited:
        cli.main(["--model", str(tiny_model), "--kv-cache-dtype", "int4"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--kv-cache-dtype" in err and "Traceback" not in err, err


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_an_8_bit_cache_shares_copies_and_recomputes_blocks_as_a_16_bit_one_does(tiny_model, kv_cache_dtype):
    """The same requests through a pool with room and through one too small for them (preemptions, prefixes
    shared, a fork that writes into a shared block): the same tokens, since each stored row and its scale depend
    only on that token's K/V, wherever and whenever it is stored or copied."""
    prompts = random_prompts(seed=3, lengths=[40, 7, 33, 50, 21])
    prompts.append(prompts[0][:32] + [5, 6])  # shares two full blocks of the first
    params = SamplingParams(max_tokens=20, min_tokens=20, **GREEDY)

    def run(num_kv_blocks: int) -> tuple[dict, object]:
        llm = make_llm(tiny_model, block_size=8, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=24,
                       max_model_len=128, kv_cache_dtype=kv_cache_dtype)
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        engine.step()
        engine.step()
        engine.fork_request("r1", "fork")  # r1's 7-token prompt sits in one partial block: the fork copies it
        finished = run_to_end(engine)
        assert engine.runner.plan.describe().endswith(f"decode attention cpu_attention ({kv_cache_dtype} cache)") \
            or not has_avx2
        return {rid: out.token_ids for rid, out in finished.items()}, engine.kv_snapshot()

    roomy, roomy_snap = run(200)
    tight, tight_snap = run(26)
    assert tight_snap.num_preemptions > 0 and roomy_snap.num_preemptions == 0
    assert any(e.kind == "cow" for e in tight_snap.events + roomy_snap.events)
    assert tight_snap.prefix_cache_hits >= 32
    assert tight == roomy
    assert tight["fork"] == tight["r1"]  # greedy: the copy holds what the original held, scales included
    assert_invariants(tight_snap)
    assert tight_snap.kv_cache_dtype == kv_cache_dtype
    assert tight_snap.bytes_per_block == 2 * 2 * 8 * 2 * (16 + 4)  # 2 layers, 8 slots, 2 KV heads of 16 + scale


def test_a_16_bit_cache_under_an_fp32_model_stores_and_reads_bf16(tiny_model):
    """kv_cache_dtype bfloat16 on an fp32 model: the pool is bf16 (half the bytes), the model still fp32."""
    llm = make_llm(tiny_model, kv_cache_dtype="bfloat16")
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in llm.engine.runner.kv_caches)
    out = llm.generate([list(range(3, 40))], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert len(out.token_ids) == 8
    assert llm.engine.kv_snapshot().kv_cache_dtype == "bfloat16"


def test_the_snapshot_and_metrics_say_the_cache_its_bytes_the_other_width_and_the_weights(tiny_model):
    from prometheus_client.parser import text_string_to_metric_families

    from pagedchat.serve import metrics

    llm = make_llm(tiny_model, num_kv_blocks=50, kv_cache_dtype="int8")
    snap = llm.engine.kv_snapshot()
    int8_block, bf16_block = 2 * 2 * 16 * 2 * (16 + 4), 2 * 2 * 16 * 2 * 16 * 2
    assert (snap.kv_cache_dtype, snap.bytes_per_block) == ("int8", int8_block)
    assert (snap.other_kv_cache_dtype, snap.other_num_blocks) == ("bfloat16", 50 * int8_block // bf16_block)
    assert snap.weights_format == "fp32" and snap.weights_bytes == llm.config.weights_bytes > 0
    text = metrics.render(snap, metrics.Counters(), "tiny")
    labels = {f.name: f for f in text_string_to_metric_families(text)}["vllm:cache_config_info"].samples[0].labels
    assert labels["cache_dtype"] == "int8" and labels["kv_cache_memory_bytes"] == str(50 * int8_block)
    plain = make_llm(tiny_model, num_kv_blocks=50).engine.kv_snapshot()  # fp32 by default: 8 bits would hold more
    assert (plain.kv_cache_dtype, plain.other_kv_cache_dtype) == ("float32", "int8")
    assert plain.other_num_blocks == 50 * plain.bytes_per_block // int8_block


def test_an_8_bit_blocks_scales_are_those_its_rows_hold(tiny_model):
    from pagedchat.kernels import kv_quant

    llm = make_llm(tiny_model, kv_cache_dtype="fp8")
    llm.generate([list(range(3, 30))], SamplingParams(max_tokens=4, **GREEDY))
    block = next(b for b in llm.engine.kv_snapshot().blocks if b.num_tokens)
    (k_low, k_high), (v_low, v_high) = llm.engine.block_scales(block.block_id, block.num_tokens)
    rows = [cache[block.block_id, :block.num_tokens] for cache, _ in llm.engine.runner.kv_caches]
    # each row's scale is its absmax over 448, read here from the dequantized values
    absmax = torch.stack([kv_quant.dequantize(r, torch.float64).abs().amax(-1) for r in rows])
    assert k_low == pytest.approx(absmax.min().item() / 448) and k_high == pytest.approx(absmax.max().item() / 448)
    assert 0 < v_low <= v_high
    assert make_llm(tiny_model).engine.block_scales(block.block_id, block.num_tokens) is None  # no scales at 32 bits


@pytest.mark.parametrize("kv_cache_dtype, blocks", [("auto", 40), ("int8", 40 * 32 // 20)])
def test_the_pressure_scene_gets_its_bytes_so_an_8_bit_cache_gets_more_blocks(tiny_model, monkeypatch, tmp_path,
                                                                                kv_cache_dtype, blocks):
    """40 bf16 blocks' bytes: the tiny model's rows are 16 values, 32 bytes in bf16 and 20 in int8."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    configs, real = [], cli.checked_config
    monkeypatch.setattr(cli, "checked_config", lambda args: configs.append(real(args)) or configs[-1])
    monkeypatch.setattr(cli, "run_app", lambda *args, **kwargs: 0)  # the config is all this needs
    assert cli.main(["--model", str(tiny_model), "--device", "cpu", "--demo", "pressure", "--no-history",
                     "--kv-cache-dtype", kv_cache_dtype]) == 0
    assert configs[-1].engine.num_kv_blocks == blocks
