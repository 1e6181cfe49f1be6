"""A request that needs nearly the whole pool, queued behind a long reply, with short chats arriving
behind it: it must not hold them up (head-of-line blocking), nor wait forever itself, nor make the pool churn."""

from collections import Counter

from support.engine import GREEDY, make_llm, random_prompts

from pagedchat import SamplingParams
from pagedchat.engine.core.invariants import assert_invariants
from pagedchat.engine.core.scheduler import MAX_WAIT_STEPS

BLOCK_SIZE, NUM_BLOCKS = 4, 100  # 400 slots
MEDIUM = (100, 200)  # prompt, reply: runs first, a long reply
LARGE = (340, 40)  # 95 of the 100 blocks: it cannot start beside the medium one
SHORT = (8, 24)
SHORT_TABS = 4


def run(tiny_model, with_shorts: bool) -> tuple[dict[str, list[int]], dict[str, int], list, int]:
    """The medium request, then the large one, then (`with_shorts`) four tabs that each send a short
    request whenever their last has finished, until both are done: the two replies, each request's
    longest stretch of steps spent waiting or preempted, the pool's events and the short replies done."""
    engine = make_llm(tiny_model, block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS).engine
    medium, large, *shorts = random_prompts(7, [MEDIUM[0], LARGE[0]] + [SHORT[0]] * 200)
    engine.add_request("medium", medium, SamplingParams(max_tokens=MEDIUM[1], ignore_eos=True, **GREEDY))
    engine.step()
    engine.add_request("large", large, SamplingParams(max_tokens=LARGE[1], ignore_eos=True, **GREEDY))
    params = SamplingParams(max_tokens=SHORT[1], ignore_eos=True, **GREEDY)
    busy: dict[int, str] = {}  # tab -> its short request in flight
    replies: dict[str, list[int]] = {}
    longest: dict[str, int] = {}
    stretch: dict[str, int] = {}
    events, seen, num_shorts = [], -1, 0
    for _ in range(2000):
        if with_shorts and not {"medium", "large"} <= replies.keys():
            for tab in set(range(SHORT_TABS)) - busy.keys():
                busy[tab] = f"short{num_shorts}"
                engine.add_request(busy[tab], shorts[num_shorts], params)
                num_shorts += 1
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length", out.outputs[0].error
                replies[out.request_id] = out.token_ids
                busy = {tab: rid for tab, rid in busy.items() if rid != out.request_id}
        snap = engine.kv_snapshot()
        assert_invariants(snap)
        events += [e for e in snap.events if e.seq > seen]
        seen = events[-1].seq if events else seen
        for info in snap.requests:
            stretch[info.request_id] = stretch.get(info.request_id, 0) + 1 if info.status in ("waiting", "preempted") else 0
            longest[info.request_id] = max(longest.get(info.request_id, 0), stretch[info.request_id])
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    return replies, longest, events, num_shorts


def test_a_request_as_large_as_the_pool_neither_blocks_the_others_nor_starves(tiny_model):
    alone, _, _, _ = run(tiny_model, with_shorts=False)
    replies, longest, events, num_shorts = run(tiny_model, with_shorts=True)
    for name in ("medium", "large"):
        assert replies[name] == alone[name], f"the {name} request's greedy reply changed with the others beside it"
    assert len(replies) == num_shorts + 2 > 20, "every short request finishes, and many did meanwhile"
    shorts = [steps for rid, steps in longest.items() if rid.startswith("short")]
    # Before: the short ones queued behind the large one until the medium and the large had both
    # finished (~200 steps); they go ahead of it now, while it waits its turn.
    assert max(shorts) <= MAX_WAIT_STEPS, f"a short request waited {max(shorts)} steps"
    # Its turn comes at the end of the medium one's reply: the short ones admitted past it make room.
    assert longest["large"] <= MEDIUM[1] + MAX_WAIT_STEPS
    # No churn: a preemption costs a recompute, so there are few, and none of a request over and over.
    preempted = Counter(e.request_id for e in events if e.kind == "preempt")
    assert preempted["large"] <= 1 and max(preempted.values()) <= 2, preempted
    assert preempted.total() <= len(replies) // 4, preempted
