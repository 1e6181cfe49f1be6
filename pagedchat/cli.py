"""`pagedchat`: check everything that can be checked, then open the app.

A bad flag or model is refused before the screen opens: one line on stderr, exit 2. A failure while
the model loads inside the app restores the terminal, prints one line and exits 1. Tracebacks go to
a log file in the user's state directory, which the line names.
"""

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import platformdirs

from pagedchat import __version__
from pagedchat.engine.config import DEFAULT_NUM_KV_BLOCKS, KV_CACHE_DTYPES, EngineArgs
from pagedchat.tui.demo import SCENES
from pagedchat.tui.themes import DEFAULT_THEME, load_themes



class UsageError(Exception):
    """A flag value that cannot work; the message is the line shown."""


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; a user gets one line that says what to fix."""

    def error(self, message: str):
        self.exit(2, f"pagedchat: error: {message} (see pagedchat --help)\n")


POOL_EPILOG = (f"The KV pool defaults to {DEFAULT_NUM_KV_BLOCKS} blocks (of --block-size tokens) when neither "
               "--num-blocks nor --kv-memory is given: --model says what that holds for the default model.")


class MemoryHelpFormatter(argparse.HelpFormatter):
    """--model's line says what the default model holds in memory, read from its GGUF's header when the help is
    shown (which imports torch: a second or two that no other run pays)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return f"{action.help} (default: {default_model_memory()})" if action.dest == "model" else action.help


def default_model_memory() -> str:
    from pagedchat.engine.loading import loader

    path = loader.installed_default_model()
    if path is None:
        return "SmolLM2-135M-Instruct, installed on first use"
    from pagedchat.engine.describe import gguf_memory

    return f"SmolLM2-135M-Instruct: {gguf_memory(path, EngineArgs().block_size, DEFAULT_NUM_KV_BLOCKS)}"


class VersionAction(argparse.Action):
    """--version: the version, then which kernels multiply each kind of weights on this CPU (which imports torch
    and builds the C kernels where they are not built yet, as a model's load would)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from pagedchat.engine.describe import kernels_here

        print(f"pagedchat {__version__}\n{kernels_here()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="pagedchat",
        description="Chat with a local LLM in several tabs at once and watch its paged KV cache live. "
                    "`pagedchat serve --help`: the same engine as an OpenAI-compatible server.",
        epilog=POOL_EPILOG + " Keys: f1 in the app.", formatter_class=MemoryHelpFormatter,
    )
    add_engine_flags(parser)
    attach = parser.add_argument_group("attach to a server", "the app as a client of a vLLM server (or of "
                                       "`pagedchat serve`): no model is loaded here, and the engine flags above do not apply")
    attach.add_argument("--attach", metavar="URL", help="the server's address, like http://127.0.0.1:8000")
    attach.add_argument("--kv-events", metavar="tcp://HOST:PORT[,replay=PORT]",
                        help="vLLM's KV event publisher (its --kv-events-config endpoint), for the resident blocks; "
                             "rank r publishes on PORT + r")
    attach.add_argument("--dp-size", type=int, metavar="N",
                        help="the server's data-parallel ranks (default: as many as its /metrics name)")
    attach.add_argument("--api-key", metavar="KEY", help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--theme", default=DEFAULT_THEME, metavar="NAME",
                        help=f"one of {', '.join(load_themes())} ({DEFAULT_THEME}); switch in the app with ctrl+p")
    parser.add_argument("--demo", nargs="?", const="chat", choices=tuple(SCENES), metavar="SCENE",
                        help="open tabs that chat by themselves: chat (the default), pressure (a small pool that "
                             "preempts and evicts) or sharing (one system prompt, forks)")
    parser.add_argument("--no-history", action="store_true", help="do not save conversations")
    parser.add_argument("--version", action=VersionAction,
                        help="the version, and which kernels multiply each kind of weights on this CPU")
    return parser


def build_serve_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="pagedchat serve",
        description="Serve the engine over OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models), "
                    "with /health, /metrics, /tokenize, /detokenize, /v1/kv/snapshot and /v1/kv/events.",
        epilog=POOL_EPILOG, formatter_class=MemoryHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="the port (8000)")
    parser.add_argument("--api-key", metavar="KEY", help="/v1/* requests must carry `Authorization: Bearer KEY`")
    parser.add_argument("--served-model-name", metavar="NAME", help="the model id (default: the model folder's name)")
    parser.add_argument("--session-idle", type=float, default=600.0, metavar="SECONDS",
                        help="close a session idle this long (600)")
    parser.add_argument("--max-sessions", type=int, default=64, metavar="N",
                        help="sessions kept at once; the least recently used closes first (64)")
    parser.add_argument("--tui", action="store_true",
                        help="open the app too: its tabs and the API's requests share one engine, drawn in its KV panel")
    add_engine_flags(parser)
    parser.set_defaults(theme=DEFAULT_THEME)
    return parser


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH", help="a Hugging Face model folder or a .gguf file")
    parser.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV block (16)")
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=int, metavar="N",
                      help=f"KV blocks in the pool (default {DEFAULT_NUM_KV_BLOCKS})")
    pool.add_argument("--kv-memory", metavar="SIZE", help="size the pool by memory instead, like 256MiB or 2GB")
    parser.add_argument("--max-model-len", type=int, metavar="N",
                        help="the longest conversation in tokens (default: the model's context, "
                             "capped at the pool)")
    parser.add_argument("--max-num-seqs", type=int, default=64, metavar="N",
                        help="sequences per engine step (64)")
    parser.add_argument("--max-batched-tokens", type=int, default=1024, metavar="N",
                        help="tokens per engine step; longer prompts are prefilled in chunks (1024)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="do not share blocks of equal prefixes")
    parser.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                        help="attention: triton on a GPU, torch on the CPU (auto)")
    parser.add_argument("--device", default="auto", metavar="auto|cpu|cuda", help="where the model runs (auto)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="model and KV dtype (auto: bfloat16, float16 on a GPU without it)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="KV cache dtype: auto (the model's), or an 8-bit cache with a scale per slot and head, "
                             "about twice the blocks in the same --kv-memory (auto)")
    parser.add_argument("--no-compile", action="store_true",
                        help="do not compile the decode step in the background (CPU; also PAGEDCHAT_COMPILE=0)")


def check_flags(args: argparse.Namespace) -> None:
    """The flag values alone, before anything heavy is imported."""
    for flag in ("block_size", "num_blocks", "max_model_len", "max_num_seqs", "max_batched_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.theme not in load_themes():
        raise UsageError(f"unknown theme {args.theme!r}: choose one of {', '.join(load_themes())}")
    if args.model is not None and not Path(args.model).expanduser().exists():
        raise UsageError(f"model not found: {args.model}")


ATTACH_ONLY = ("kv_events", "dp_size", "api_key")


def attach_target(args: argparse.Namespace, argv: list[str]):
    """The server to attach to, once its flags are known to make sense; None without --attach."""
    if args.attach is None:
        given = [flag for flag in ATTACH_ONLY if getattr(args, flag) is not None]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} needs --attach URL")
        return None
    # The flags the engine's own parser takes from the command line (given, even at their default value).
    engine = OneLineParser(add_help=False)
    add_engine_flags(engine)
    _, others = engine.parse_known_args(argv)
    given = [arg.split("=")[0] for arg in argv if arg.startswith("--") and arg not in others]
    if given:
        raise UsageError(f"{given[0]} sets up the local engine, which --attach does not load: "
                         "drop it (the server's own flags size its engine)")
    if not args.attach.startswith(("http://", "https://")):
        raise UsageError(f"--attach needs an http:// or https:// URL, got {args.attach!r}")
    if args.dp_size is not None and args.dp_size < 1:
        raise UsageError(f"--dp-size must be at least 1, got {args.dp_size}")
    try:
        from pagedchat.attach.kv_events import parse_kv_events
        from pagedchat.tui.attached import AttachTarget
    except ImportError as exc:
        raise UsageError(f"--attach needs its extra: pip install 'pagedchat[attach]' ({exc.name} is missing)") from exc
    try:
        kv_events = parse_kv_events(args.kv_events) if args.kv_events is not None else None
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return AttachTarget(args.attach, args.api_key, kv_events, args.dp_size)


def engine_args(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(model=args.model, block_size=args.block_size, num_kv_blocks=args.num_blocks,
                      kv_cache_memory=args.kv_memory, max_model_len=args.max_model_len,
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                      enable_prefix_caching=not args.no_prefix_caching, attention_backend=args.backend,
                      dtype=args.dtype, device=args.device, compile=False if args.no_compile else None,
                      kv_cache_dtype=args.kv_cache_dtype)


def open_history():
    """The chat history database; one that cannot be used is refused with a way around it."""
    import sqlite3

    from pagedchat.history import History, default_path

    try:
        return History(default_path())
    except (sqlite3.Error, OSError, RuntimeError) as exc:
        raise UsageError(f"cannot open the chat history {default_path()}: {exc} "
                         "(move it away, or run with --no-history)") from exc


def state_dir() -> Path:
    return platformdirs.user_state_path("pagedchat", appauthor=False)  # honours XDG_STATE_HOME


def log_to_file() -> Path:
    """Send logging (and so every traceback) to the state dir, never to the screen the app draws."""
    path = state_dir() / "pagedchat.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    return path


def checked_config(args: argparse.Namespace):
    """The engine's config resolved from the flags, every check done (it may install the default model, with
    progress); a problem is a UsageError of one line."""
    check_flags(args)
    from pagedchat.engine.api.errors import one_line
    from pagedchat.engine.loading.loader import ModelError

    try:
        return engine_args(args).resolve()
    except (ModelError, ValueError) as exc:
        raise UsageError(one_line(exc)) from exc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        try:
            return serve_main(argv[1:])
        except KeyboardInterrupt:  # ctrl+c or SIGTERM before the server runs (it takes the signals itself then)
            print("pagedchat: stopped", file=sys.stderr)
            return 130
    args = build_parser().parse_args(argv)
    log_path = log_to_file()
    try:
        target = attach_target(args, argv)
        if target is not None:
            check_flags(args)
            return run_app(None, target.url, log_path, attach=target, theme=args.theme, demo=args.demo)
        scene = SCENES[args.demo] if args.demo else None
        scene_pool = scene and scene.num_blocks and args.num_blocks is None and args.kv_memory is None
        if scene_pool:
            args.num_blocks = scene.num_blocks  # the scene's pool, unless the user sized one
        config = checked_config(args)
        if scene_pool and args.kv_cache_dtype in ("int8", "fp8"):  # the scene's bytes, which hold more 8-bit blocks
            args.num_blocks, args.kv_memory = None, scene.num_blocks * sixteen_bit_block(config)
            config = checked_config(args)
        history = None if args.no_history else open_history()
    except UsageError as exc:
        print(f"pagedchat: error: {exc}", file=sys.stderr)
        return 2

    from pagedchat.engine.llm import LLM

    code = run_app(lambda: LLM.from_config(config), config.model_path.name, log_path,
                   theme=args.theme, demo=args.demo, history=history)
    leave_any_compile_or_load_behind(code)
    return code


def sixteen_bit_block(config) -> int:
    """The bytes of one block of a bf16 cache for this config's model: the unit a scene's pool is made of."""
    import torch

    from pagedchat.engine.worker.model_runner import KVLayout

    return KVLayout.of(config.model_config).bytes_per_block(config.engine.block_size, torch.bfloat16)


def leave_any_compile_or_load_behind(code: int) -> None:
    """A compile still running when the app quits is a daemon thread inside inductor's C++, as is a model still
    loading when the app or the server stops: the interpreter's teardown pulls the runtime from under it and
    the process aborts ("terminate called without an active exception", exit 134). The app is done and the
    terminal restored, the history committed as it went: leave at once instead. The compile starts again,
    from its cache, next time."""
    from pagedchat.engine.runtime import own_thread
    from pagedchat.engine.worker import compiled_decode

    if compiled_decode.compiling() or any(thread.name == own_thread.THREAD_NAME for thread in threading.enumerate()):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_app(load_llm, model_name: str, log_path: Path, **options) -> int:
    from pagedchat.tui.app import PagedChatApp

    app = PagedChatApp(load_llm, model_name=model_name, **options)
    app.run()
    if app.load_error is not None:
        print(f"pagedchat: error: {app.load_error} (details in {log_path})", file=sys.stderr)
        return 1
    return app.return_code or 0


def serve_main(argv: list[str]) -> int:
    args = build_serve_parser().parse_args(argv)
    if not args.tui:  # the app takes its own keys; a headless server's SIGTERM stops it as ctrl+c does
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    log_path = log_to_file()
    try:
        if not 0 < args.port < 65536:
            raise UsageError(f"--port must be in 1..65535, got {args.port}")
        engine_config = checked_config(args)
        from pagedchat.serve.run import ServeConfig, serve
    except ImportError as exc:
        print(f"pagedchat: error: the server needs its extra: pip install 'pagedchat[serve]' ({exc.name} is missing)",
              file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"pagedchat: error: {exc}", file=sys.stderr)
        return 2

    from pagedchat.engine.api.errors import one_line
    from pagedchat.engine.llm import LLM

    config = ServeConfig(args.host, args.port, args.api_key, args.served_model_name or model_id(args.model),
                         args.session_idle, args.max_sessions)
    if args.tui:
        return serve_with_app(engine_config, config, log_path)
    print(f"pagedchat: loading {engine_config.model_path.name}; /health answers 503 until it is ready", file=sys.stderr)
    try:
        stopped_by = serve(lambda: LLM.from_config(engine_config), config,
                           on_ready=lambda url: print(f"pagedchat: serving {config.model_name} on {url}/v1",
                                                      file=sys.stderr))
    except Exception as exc:
        logging.getLogger(__name__).exception("the server failed")
        print(f"pagedchat: error: {one_line(exc)} (details in {log_path})", file=sys.stderr)
        return 1
    if stopped_by is not None:
        print(f"pagedchat: stopped by {stopped_by.name}", file=sys.stderr)
    leave_any_compile_or_load_behind(0)
    return 0


def model_id(model: str | None) -> str:
    """The served model's name: the folder's, or the GGUF file's stem (the default model is a GGUF)."""
    from pagedchat.engine.loading.loader import DEFAULT_MODEL_FILE

    path = Path(model or DEFAULT_MODEL_FILE).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


def serve_with_app(engine_config, config, log_path: Path) -> int:
    from pagedchat.engine.llm import LLM
    from pagedchat.serve.run import BackgroundServer
    from pagedchat.tui.app import PagedChatApp

    server = BackgroundServer(config)
    server.start()
    app = PagedChatApp(lambda: LLM.from_config(engine_config), model_name=config.model_name, on_engine=server.attach)
    try:
        app.run()
    finally:
        server.stop()
    if app.load_error is not None:
        print(f"pagedchat: error: {app.load_error} (details in {log_path})", file=sys.stderr)
        return 1
    leave_any_compile_or_load_behind(app.return_code or 0)
    return app.return_code or 0
