"""bench/loops.py's loop counter (issue 16, item 9): a reply loops when some 8-token n-gram occurs 3 or
more times in it, occurrences counted without overlap."""

from bench.loops import distinct_2, loop_ngram, loops, requests

SENTENCE = list(range(100, 110))  # ten distinct tokens


def test_a_sentence_said_three_times_loops():
    reply = [1, 2, 3] + SENTENCE * 3 + [4]
    assert loops(reply)
    assert loop_ngram(reply) == tuple(SENTENCE[:8])


def test_twice_is_not_a_loop_nor_are_shorter_repeats():
    assert not loops([1, 2] + SENTENCE * 2 + [3])
    assert not loops([5, 6, 7, 8, 9, 10, 11] * 3)  # 21 tokens: each 8-gram at most twice
    assert not loops(list(range(1000)))
    assert not loops(SENTENCE[:7])
    assert not loops([])


def test_a_short_phrase_said_over_and_over_loops_too():
    assert loops([5, 6, 7, 8, 9, 10, 11] * 6)  # its 8-grams wrap around the phrase (0, 14, 28)
    assert not loops([5, 6, 7, 8, 9, 10, 11] * 5)  # (0, 14: the next would start at 28 of 35)


def test_repeats_apart_count_and_a_few_tokens_between_do_not_hide_them():
    gram = list(range(200, 208))
    reply = gram + [1, 2, 3] + gram + list(range(300, 340)) + gram
    assert loop_ngram(reply) == tuple(gram)


def test_overlapping_occurrences_count_once():
    assert not loops([7] * 23)  # a run of one token holds 16 overlapping 8-grams, two without overlap
    assert loops([7] * 24)
    assert not loops([1, 2] * 11)  # "1 2 1 2 1 2 1 2" at 0, 8 (16 would need 24 tokens)
    assert loops([1, 2] * 12)


def test_the_counter_takes_any_n_and_count():
    assert loops([1, 2, 3, 1, 2, 3], n=3, times=2)
    assert not loops([1, 2, 3, 1, 2, 4], n=3, times=2)


def test_distinct_2():
    assert distinct_2([[1, 2, 3]]) == 1.0
    assert distinct_2([[1, 2, 1, 2, 1]]) == 0.5
    assert distinct_2([]) == 0.0


def test_each_setting_gets_the_apps_sampling_and_a_fixed_seed_per_prompt(tiny_model):
    from transformers import AutoTokenizer

    prompts, params = requests(AutoTokenizer.from_pretrained(tiny_model), ["none", "rep1.2"], [0, 1])
    assert len(prompts) == len(params) == 2 * 2 * 20
    assert prompts[:20] == prompts[20:40] == prompts[40:60]
    assert [p.seed for p in params[:40]] == [p.seed for p in params[40:]] == \
        list(range(20)) + list(range(1000, 1020))
    assert {(p.temperature, p.top_p, p.max_tokens) for p in params} == {(0.7, 0.95, 512)}
    assert {p.repetition_penalty for p in params[:40]} == {1.0} and {p.repetition_penalty for p in params[40:]} == {1.2}
