"""Built-in conversations for `pagedchat --demo`: tabs that chat by themselves.

Every demo tab starts with the same system prompt, long enough to fill a few blocks, so the prefix
cache shares those blocks between the tabs and the grid shows them with a ref count above 1.
"""

import itertools

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


def demo_scripts():
    """An endless supply of scripts: each an endless cycle of one conversation's questions."""
    for questions in itertools.cycle(CONVERSATIONS):
        yield itertools.cycle(questions)
