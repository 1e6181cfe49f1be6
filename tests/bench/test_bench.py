"""Smoke tests of the benchmark suite on the tiny model: each benchmark's core runs at minimal sizes and
its report has the expected shape. Never timings: those belong to bench/RESULTS.md."""

import pytest

from bench import (
    attention_kernel,
    chart,
    closed_conversations,
    concurrency,
    multiturn,
    sharing,
    soak,
    step_overhead,
    throughput,
    ui_overhead,
)
from bench.common import Section, Table, fixed_requests, header, random_requests
from pagedchat.kernels import cpu_attention, native

pytestmark = pytest.mark.filterwarnings("ignore")


def columns(section: Section, index: int = 0) -> list[str]:
    return section.tables[index].headers


def test_table_markdown_has_a_row_per_entry():
    text = Table(["a", "b"], [[1, 2.5], ["x", 0.001]], "t").markdown()
    assert text.splitlines()[2:] == ["| a | b |", "|---|---|", "| 1 | 2.50 |", "| x | 0.001 |"]


def test_header_names_machine_and_versions():
    text = header({"torch threads": 1})
    for word in ("machine:", "flags", "torch", "transformers", "pagedchat", "torch threads: 1"):
        assert word in text


def test_workloads_are_seeded_and_in_range():
    a, b = random_requests(5, (3, 7), (1, 2), seed=3), random_requests(5, (3, 7), (1, 2), seed=3)
    assert a == b and all(3 <= len(r.prompt) <= 7 and 1 <= r.output_len <= 2 for r in a)
    assert {len(r.prompt) for r in fixed_requests(3, 4, 1)} == {4}


def test_throughput_reports_every_peer(tiny_model):
    section = throughput.mix_section(str(tiny_model), "float32", "smoke")
    assert columns(section)[0] == "peer" and "goal" in columns(section)
    assert all(len(row) == len(columns(section)) for row in section.tables[0].rows)
    assert [row[0] for row in section.tables[0].rows] == list(throughput.PEERS)
    assert any("ceiling" in note for note in section.notes)


def test_concurrency_compares_paged_and_contiguous(tiny_model):
    section = concurrency.concurrency_section(str(tiny_model), "float32", num_requests=12, max_model_len=64,
                                              prompt_lens=(4, 24), output_lens=(2, 8))
    rows = section.tables[0].rows
    assert len(rows) == 2 and "peak running" in columns(section)
    assert rows[1][1] <= concurrency.CONTIGUOUS_SESSIONS  # the contiguous side never admits more than 8


def test_multiturn_has_every_mode(tiny_model):
    section = multiturn.multiturn_section(str(tiny_model), "float32", turns=2, reply_tokens=2)
    assert [row[0] for row in section.tables[0].rows] == [*multiturn.MODES, "HF generate, recomputing"]
    assert columns(section)[:3] == ["history between turns", "turn 1", "turn 2"]


def test_step_overhead_splits_the_step(tiny_model):
    section = step_overhead.step_overhead_section(str(tiny_model), "float32", running=(1, 2), steps=2, prompt=8)
    assert [row[0] for row in section.tables[0].rows] == [1, 2]
    assert "model call" in columns(section) and "function" in columns(section, 2)
    parts = {row[0]: row[1:] for row in section.tables[1].rows}  # ms per step at 1 and 2 running
    assert set(step_overhead.PARTS) < set(parts)
    assert all(ms > 0 for ms in parts["attention"] + parts["logits"])
    # a Hugging Face folder's layers run product by product: the two quantized layer calls never happen
    assert parts[step_overhead.PARTS[0]] == parts[step_overhead.PARTS[2]] == [0, 0]


@pytest.mark.skipif(cpu_attention.kernel() is None, reason="cpu_attention.c needs AVX2")
def test_attention_kernel_times_this_build_beside_another(tmp_path, monkeypatch):
    other = tmp_path / "other.c"
    other.write_text((native.HERE / "cpu_attention.c").read_text())
    monkeypatch.setattr(attention_kernel, "CASES", [(2, 40, 9, 3)])
    monkeypatch.setattr(attention_kernel, "POOL_BYTES", 1 << 20)
    section = attention_kernel.attention_kernel_section(other, rounds=2)
    [row] = section.tables[0].rows
    assert columns(section)[3:] == ["this checkout: ms", "GB/s", f"{other}: ms", "GB/s", "speedup"]
    assert row[:3] == [2, 40, "9 / 3"] and all(value > 0 for value in row[3:7]) and row[7].endswith("x")


def test_sharing_uses_fewer_blocks(tiny_model):
    section = sharing.sharing_section(str(tiny_model), "float32", prompt=40, new=4, ks=(2,))
    rows = section.tables[0].rows
    assert len(rows) == len(sharing.SCENARIOS)
    assert all(shared < plain for _, _, shared, plain, _, _ in rows)


def test_ui_overhead_runs_the_app(tiny_model):
    # two rounds: a second app must not trip over the first one's conversations
    section = ui_overhead.ui_overhead_section(str(tiny_model), "float32", tabs=2, reply=3, rounds=2)
    kinds = [row[0].split(",")[0] for row in section.tables[0].rows]
    assert kinds == ["bare engine (step + kv_snapshot)"] * 3 + ["app (Pilot"] * 2
    for *_, over_bare_either_side, ui_share in section.tables[0].rows[3:]:
        assert over_bare_either_side > 0 and 0 < ui_share < 1  # the UI thread's CPU was measured, not zero


def test_soak_reports_its_goals(tiny_model):
    section = soak.soak_section(str(tiny_model), steps=30)
    counts = dict(section.tables[0].rows)
    assert counts["steps"] >= 30 and counts["invariant checks passed"] > counts["steps"]
    assert counts["blocks leaked at the end (goal 0)"] == 0
    assert counts["answers differing from their lone run (goal 0)"] == 0
    assert str(tiny_model) in section.settings[0]


def test_chart_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "c.png"
    assert chart.draw({"a": (2.0, 1.5), "b": (0.5, None)}, path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_closed_conversations_compares_released_with_closed(tiny_model):
    section = closed_conversations.closed_conversations_section(str(tiny_model), "float32", [3, 5])
    rows = section.tables[0].rows
    assert [row[0] for row in rows] == [3, 5]
    assert [(row[1].endswith(f"({n} listed)"), row[2].endswith("(0 listed)")) for row, n in zip(rows, (3, 5))] == [
        (True, True), (True, True)]
