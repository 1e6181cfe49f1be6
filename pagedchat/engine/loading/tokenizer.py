"""A GGUF's tokenizer without transformers: importing transformers takes most of a second of every start (it
indexes all its models), longer than the rest of a GGUF's loading together.

transformers reads the file's tokenizer once (`gguf._write_config_and_tokenizer`) and saves it in a folder;
`save` then writes the `tokenizers` model that transformers' fast tokenizer of that folder runs, as it stands
after the family's class set it up (Qwen2's NFC normalizer is not in the folder's tokenizer.json), with the
chat template and the special tokens the template sees.
`FileTokenizer` reads that back and offers what the engine, the app and the server call of a tokenizer:
`encode`, `decode`, `apply_chat_template` (rendered as transformers renders it) and `eos_token_id`; the rest
of a tokenizer's API loads transformers' tokenizer of the folder on first use.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MODEL_FILE = "pagedchat-tokenizer.json"
SETTINGS_FILE = "pagedchat-tokenizer-settings.json"


def save(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Write what `FileTokenizer.load` reads, where it can stand in for `tokenizer`: a fast tokenizer whose
    decode does not clean up spaces (transformers' default). Elsewhere write nothing, and the caller keeps
    transformers' tokenizer."""
    model = getattr(tokenizer, "backend_tokenizer", None)
    if model is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return
    try:
        template = tokenizer.get_chat_template()
    except ValueError:  # the file has none
        template = None
    settings = {"chat_template": template, "eos_token_id": tokenizer.eos_token_id,
                "special_tokens": {name: value if isinstance(value, str) else [str(v) for v in value]
                                   for name, value in tokenizer.special_tokens_map.items()}}
    model.save(str(folder / MODEL_FILE))
    (folder / SETTINGS_FILE).write_text(json.dumps(settings))


class FileTokenizer:
    """A `tokenizers` model with its chat template: encodes, decodes and renders chats (plain messages, as text)
    as transformers' fast tokenizer of the same folder does, which is all pagedchat calls. Any other part of
    transformers' tokenizer API (`tokenizer(text)`, a chat as a `BatchEncoding`, `convert_ids_to_tokens`, ...)
    is that tokenizer's own, loaded from the folder on first use."""

    def __init__(self, folder: Path, model: Tokenizer, chat_template: str | None, special_tokens: dict,
                 eos_token_id: int | None):
        self.folder = folder
        self._model = model
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.eos_token_id = eos_token_id

    @classmethod
    def load(cls, folder: Path) -> FileTokenizer | None:
        """The tokenizer `save` wrote in `folder`, None where it wrote none."""
        if not (folder / SETTINGS_FILE).is_file():
            return None
        settings = json.loads((folder / SETTINGS_FILE).read_text())
        model = Tokenizer.from_file(str(folder / MODEL_FILE))
        model.no_truncation()
        model.no_padding()
        return cls(folder, model, settings["chat_template"], settings["special_tokens"], settings["eos_token_id"])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._model.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return self._model.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs):
        """A conversation of plain messages (role and content strings: pagedchat's) rendered as text by the
        file's template, as transformers renders it; any other call is transformers' own."""
        if tokenize or kwargs or self.chat_template is None or not _plain(conversation):
            return self.transformers.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                         tokenize=tokenize, **kwargs)
        return _compiled(self.chat_template).render(messages=list(conversation), tools=None, documents=None,
                                                    add_generation_prompt=add_generation_prompt,
                                                    **self.special_tokens)

    @functools.cached_property
    def transformers(self) -> PreTrainedTokenizerBase:
        return transformers_tokenizer(self.folder)

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "transformers":  # copy's and pickle's probes; a failed load
            raise AttributeError(name)
        return getattr(self.transformers, name)

    def __call__(self, *args, **kwargs):
        return self.transformers(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.transformers)

    def __bool__(self) -> bool:  # else truth would ask __len__, which loads transformers' tokenizer
        return True


def _plain(conversation) -> bool:
    return bool(conversation) and all(
        isinstance(message, dict) and message.keys() <= {"role", "content"}
        and all(isinstance(value, str) for value in message.values()) for message in conversation)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars or advice from transformers while a model or a tokenizer loads (errors still raise)."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def transformers_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer of a cached folder. Given the config, AutoTokenizer loads no family config class,
    which would bring the family's model code with it."""
    from transformers import AutoTokenizer, PretrainedConfig

    return AutoTokenizer.from_pretrained(folder, config=PretrainedConfig.from_json_file(folder / "config.json"))


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which some templates wrap replies in for transformers'
    assistant-token masks: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` as transformers' sandbox has it: no underscore-prefixed attributes."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")


class _Dict:
    """`dict()` and `dict.fromkeys()` without the type itself, as transformers' sandbox has them."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # unlike jinja's own filter, no HTML escaping: what transformers' environment renders
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    """The template in the environment transformers renders chat templates in (chat templates are untrusted
    code: a sandbox)."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, namespace=_Namespace,
                               strftime_now=lambda fmt: datetime.now().strftime(fmt), dict=_Dict())
    return environment.from_string(template)
