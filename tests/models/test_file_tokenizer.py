"""A GGUF's tokenizer without transformers (`loading/tokenizer.py`) against transformers' fast tokenizer read from
the same cached folder: the same ids, texts and rendered chats, on random inputs."""

import copy
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError, TemplateError
from transformers.utils.chat_template_utils import render_jinja_template

from pagedchat.engine.chat import chat_prompt
from pagedchat.engine.loading import gguf as gguf_loading
from pagedchat.engine.loading import loader
from pagedchat.engine.loading.tokenizer import FileTokenizer, _compiled, transformers_tokenizer
from test_gguf_model import write_tiny_gguf

FILES = ["default", "llama", "qwen2", "qwen3"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
# text that tokenizes interestingly: words, spaces and newlines, unicode, characters that a normalizer changes
# (NFC: a compatibility ideograph, a decomposed accent, the Angstrom sign), and the special tokens in the middle
ODD = [" ", "\n", "  x", "é", "e\u0301", "\uf900", "\u212b", "\u0f71\u0f72", "日本", "🙂"]
TEXT = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(ODD + SPECIALS)), max_size=12).map("".join)
ROLES = st.sampled_from(["system", "user", "assistant"])
CONVERSATION = st.lists(st.fixed_dictionaries({"role": ROLES, "content": TEXT}), min_size=1, max_size=5)
CHECKS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", params=FILES)
def folder(request, tmp_path_factory):
    """The cached config-and-tokenizer folder of the default model's file, or of a tiny GGUF of each family."""
    if request.param == "default":
        return loader.metadata_folder(loader.resolve_model(None, progress=False))
    root = tmp_path_factory.mktemp(request.param)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        path = write_tiny_gguf(root / "tiny.gguf", seed=0, arch=request.param)
        return gguf_loading.metadata_folder(path, gguf_loading.read_header(path))


@pytest.fixture(scope="module")
def pair(folder):
    """(pagedchat's tokenizer, transformers' as pagedchat loaded it before: `transformers_tokenizer`)."""
    ours = FileTokenizer.load(folder)
    assert ours is not None, "a fast tokenizer that cleans up no spaces: FileTokenizer stands in for it"
    return ours, transformers_tokenizer(folder)


@CHECKS
@given(text=TEXT, special=st.booleans())
def test_encode_as_transformers(pair, text, special):
    ours, theirs = pair
    assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)


@CHECKS
@given(data=st.data(), skip=st.booleans())
def test_decode_as_transformers(pair, data, skip):
    ours, theirs = pair
    ids = data.draw(st.lists(st.integers(0, len(theirs) - 1), max_size=30))
    assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


@CHECKS
@given(conversation=CONVERSATION, prompt=st.booleans())
def test_chats_render_as_transformers(pair, conversation, prompt):
    ours, theirs = pair
    assert ours.eos_token_id == theirs.eos_token_id
    assert (ours.apply_chat_template(conversation, add_generation_prompt=prompt, tokenize=False)
            == theirs.apply_chat_template(conversation, add_generation_prompt=prompt, tokenize=False))
    assert chat_prompt(ours, conversation, prompt) == chat_prompt(theirs, conversation, prompt)


def test_the_rest_of_the_api_is_transformers_own(pair):
    """What pagedchat does not call is there all the same, as transformers' tokenizer of the folder has it."""
    ours, theirs = pair
    conversation = [{"role": "user", "content": "héllo"}]
    assert ours and "transformers" not in vars(ours)  # nothing above needed it, nor its truth
    assert ours("héllo")["input_ids"] == theirs("héllo")["input_ids"] and len(ours) == len(theirs)
    assert ours.convert_ids_to_tokens([3, 4]) == theirs.convert_ids_to_tokens([3, 4])
    assert (ours.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)
            == theirs.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False))
    unusual = [{"role": "user", "content": "x", "name": None, "reasoning_content": "y"}]
    assert ours.apply_chat_template(unusual, tokenize=False) == theirs.apply_chat_template(unusual, tokenize=False)


def test_a_copy_is_a_tokenizer_of_its_own(pair):
    """The app's and the server's threads each take a deep copy (fast tokenizers are not thread-safe)."""
    ours, _ = pair
    twin = copy.deepcopy(ours)
    assert twin._model is not ours._model
    text = "Hello, world! <|im_end|>"
    assert twin.encode(text) == ours.encode(text) and twin.decode(ours.encode(text)) == ours.decode(ours.encode(text))


# what real templates use of the environment: tojson, namespace, loop controls, generation blocks, raise_exception
TEMPLATE = """{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'tool' %}{% continue %}{% endif %}
{% set ns.n = ns.n + 1 %}{% generation %}[{{ m.role }}]{{ m.content | tojson }}{% endgeneration %}
{% if m.extra is defined %}{{ dict(a=m.extra) | tojson(indent=2) }}{% endif %}{% endfor %}
{{ ns.n }} {{ eos_token }}{% if add_generation_prompt %}>{% endif %}{% if messages[0].role == 'x' %}
{{ raise_exception('no x') }}{% endif %}"""


@given(conversation=st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "tool", "assistant"]),
                                                    "content": TEXT}, optional={"extra": TEXT}), min_size=1,
                             max_size=4), prompt=st.booleans())
@settings(max_examples=60, deadline=None)
def test_the_template_environment_is_transformers(conversation, prompt):
    ours = _compiled(TEMPLATE).render(messages=conversation, tools=None, documents=None,
                                      add_generation_prompt=prompt, eos_token="</s>")
    theirs, _ = render_jinja_template([conversation], chat_template=TEMPLATE, add_generation_prompt=prompt,
                                      eos_token="</s>")
    assert ours == theirs[0]


def test_a_template_cannot_leave_its_sandbox():
    with pytest.raises(TemplateError, match="no x"):
        _compiled(TEMPLATE).render(messages=[{"role": "x", "content": ""}], add_generation_prompt=False)
    with pytest.raises(SecurityError):
        _compiled("{% set ns = namespace(_hidden=1) %}").render()
    with pytest.raises(SecurityError):
        _compiled("{{ messages.__class__.__subclasses__() }}").render(messages=[])


def test_a_second_start_does_not_import_transformers(tmp_path):
    """What the cache holds is enough: the config, the tokenizer and the chat template need no transformers."""
    path = loader.resolve_model(None, progress=False)
    code = (f"import sys; from pagedchat import LLM; llm = LLM(model={str(path)!r}, device='cpu', num_kv_blocks=32); "
            "print(llm.chat([[{'role': 'user', 'content': 'Hi'}]])[0].text != '', 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)  # away from the checkout, whose kernels/ transformers would import
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]
