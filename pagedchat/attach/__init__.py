"""The app as a client of a server: vLLM (a logical view of its KV cache) or `pagedchat serve` (the real grid).

Nothing here imports torch or the engine: attach mode runs on machines without the model.
"""
