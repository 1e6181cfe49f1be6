"""`pagedchat serve`: the engine behind an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra).

Imports the engine, never the TUI. The engine thread stays the engine's only owner: handlers post
commands to it and read each request's outputs from an asyncio queue (async_engine.py).
"""
