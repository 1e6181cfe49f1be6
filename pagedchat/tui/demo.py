"""Built-in scenes for `pagedchat --demo [SCENE]`: tabs that chat by themselves.

- `chat` (the default): four tabs under one system prompt, long enough to fill a few blocks, so the
  prefix cache shares those blocks between the tabs and the grid shows them with a ref count above 1.
- `pressure`: six tabs, each under a system prompt of its own, with long replies, in a pool of 40
  blocks: it runs dry, so the engine preempts a tab (and takes it back later) and evicts cached blocks.
- `sharing`: two tabs under one system prompt; once the first has replied it is forked, and the fork
  goes on with questions of its own: the shared blocks stay shared, each branch adds its own. The second
  tab asks for three samples of each reply (`n = 3`): they share its prompt's blocks, each one's reply
  its own, and each turn goes on in all three.
"""

import itertools
from dataclasses import dataclass

from pagedchat.engine.api.params import SamplingParams

SYSTEM_PROMPT = (
    "You are a patient teacher in a terminal chat app that shows how a language model's key-value "
    "cache is paged into fixed-size blocks. Answer briefly and concretely, in plain words, and use a "
    "short example when it helps. Never use more than a few sentences."
)

CONVERSATIONS = (
    ("What is a key-value cache in a transformer?", "Why does it grow with every token?",
     "What happens when it no longer fits in memory?"),
    ("Write a haiku about memory pages.", "Now one about a cache miss.", "And one about sharing."),
    ("How does an operating system use virtual memory?", "What is a page table?",
     "How is that like a block table?"),
    ("Give me a Python function that reverses a list.", "Now make it work in place.",
     "What is its time complexity?"),
    ("Explain copy-on-write in two sentences.", "Where else is it used?", "Any downsides?"),
)


PROMPTS = (  # one each for the pressure scene's tabs: nothing for the prefix cache to share
    "You are a ship's cook. Answer every question with a recipe, step by step.",
    "You are a travel guide in Lisbon. Answer with places to see and how to get there.",
    "You are a chess coach. Answer with a plan and the moves that carry it out.",
    "You are a gardener. Answer with what to plant, when, and how to care for it.",
    "You are a historian of Rome. Answer with the story, its people and its dates.",
    "You are a music teacher. Answer with exercises, from the simplest to the hardest.",
)


@dataclass(frozen=True, slots=True)
class Scene:
    tabs: int
    shared_prompt: bool  # every tab under SYSTEM_PROMPT, else each under one of PROMPTS
    params: SamplingParams
    # the pool it is made for; an explicit --num-blocks or --kv-memory wins; with an 8-bit cache, the bytes of
    # that many bf16 blocks, which hold about twice as many 8-bit ones
    num_blocks: int | None = None
    forks: int = 0  # tabs forked from the first once it has replied
    samples: int = 1  # n of the last tab: samples of each reply, sharing its prompt's blocks


SCENES = {
    "chat": Scene(4, True, SamplingParams(temperature=0.7, top_p=0.95, max_tokens=160)),
    "pressure": Scene(6, False, SamplingParams(temperature=0.7, top_p=0.95, max_tokens=320, frequency_penalty=0.5),
                      num_blocks=40),
    "sharing": Scene(2, True, SamplingParams(temperature=0.7, top_p=0.95, max_tokens=120), forks=1, samples=3),
}


def demo_scripts():
    """An endless supply of scripts: each an endless cycle of one conversation's questions."""
    for questions in itertools.cycle(CONVERSATIONS):
        yield itertools.cycle(questions)
