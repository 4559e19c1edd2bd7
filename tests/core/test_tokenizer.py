"""core.tokenizer against transformers on Llama 3.x and Qwen2.5 tokenizer folders: chat
templates (the real ones), encode / decode, BOS handling, streaming detokenization, sandbox."""

from __future__ import annotations

import pytest
from fixtures.chat_tokenizers import FAMILIES, build_tokenizer_folder

from core import ZooError
from core.errors import ChatTemplateError
from core.tokenizer import StreamDecoder, Tokenizer

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Why is the sky blue?"}],
    "system-user": [SYSTEM, {"role": "user", "content": "Hello!"}],
    "multi-turn": [
        SYSTEM,
        {"role": "user", "content": "  Why is the sky blue? 天空为什么是蓝色的 😀\n"},
        {"role": "assistant", "content": "Rayleigh scattering: blue light scatters more."},
        {"role": "user", "content": "And sunsets? 🌅 Explain\n\nbriefly."},
    ],
    "ends-with-assistant": [
        {"role": "user", "content": "def f(x):\n    return x * 2"},
        {"role": "assistant", "content": "It doubles x. café naïve 👍🏽"},
    ],
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Paris, 東京"}},
            "required": ["city"],
        },
    },
}
TEXTS = [
    "Hello world",
    "Why is the sky blue? Because of Rayleigh scattering.",
    "  leading and trailing spaces  \n\n",
    "天空为什么是蓝色的？你好，世界！",
    "Emoji 😀🎉🚀 👍🏽 ❤️ 🇫🇷 family 👨‍👩‍👧",
    "Ünïcödé: cafe\u0301 vs café, Ångström",  # a combining accent: Qwen2 normalizes to NFC
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name in FAMILIES:
        out[name] = tmp_path_factory.mktemp(name)
        build_tokenizer_folder(out[name], name)
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, folders):
    """(ours, transformers') tokenizers loaded from the same folder, and the family."""
    from transformers import AutoTokenizer

    folder = folders[request.param]
    return Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder), request.param


def hf_chat_ids(hf, messages, **kw) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    # transformers 5 returns a BatchEncoding; 4.x returned the list itself
    return list(out["input_ids"]) if not isinstance(out, list) else out


# --- chat templates ---------------------------------------------------------------------------
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("gen_prompt", [True, False], ids=["gen-prompt", "no-gen-prompt"])
def test_chat_ids_equal_transformers(pair, conv, gen_prompt):
    ours, hf, _ = pair
    messages = CONVERSATIONS[conv]
    want = hf_chat_ids(hf, messages, add_generation_prompt=gen_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=gen_prompt) == want
    text = hf.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=False)
    assert ours.render_chat(messages, add_generation_prompt=gen_prompt) == text


def test_chat_template_shapes_are_the_families(pair):
    """The rendered text is what the real templates produce, not just whatever matches."""
    ours, _, family = pair
    text = ours.render_chat(CONVERSATIONS["system-user"], add_generation_prompt=True)
    if family.startswith("llama3"):
        assert text.startswith(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: "
        )
        assert text.endswith(
            "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    else:
        assert text == (
            "<|im_start|>system\nYou are a terse assistant. Answer in one line.<|im_end|>\n"
            "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
        )
    # exactly one BOS in the ids, written by the template (Llama), or none at all (Qwen)
    ids = ours.apply_chat_template(CONVERSATIONS["system-user"])
    if family.startswith("llama3"):
        assert ids[0] == ours.bos_token_id and ids.count(ours.bos_token_id) == 1
    else:
        assert ours.bos_token_id is None


def test_qwen_default_system_prompt(folders):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_folder(folders["qwen2"])
    hf = AutoTokenizer.from_pretrained(folders["qwen2"])
    messages = CONVERSATIONS["user"]
    assert ours.render_chat(messages).startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    )
    assert ours.apply_chat_template(messages) == hf_chat_ids(
        hf, messages, add_generation_prompt=True
    )


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_chat_with_tools_equals_transformers(folders, family):
    """Tool schemas go through the templates' `tojson` (with indent=4 for Llama)."""
    from transformers import AutoTokenizer

    ours = Tokenizer.from_folder(folders[family])
    hf = AutoTokenizer.from_pretrained(folders[family])
    messages = CONVERSATIONS["system-user"]
    want = hf_chat_ids(hf, messages, tools=[TOOL], add_generation_prompt=True)
    got = ours.apply_chat_template(messages, add_generation_prompt=True, tools=[TOOL])
    assert got == want
    assert "get_weather" in ours.decode(got)


# A template written without whitespace control, as many older hub templates are: its output
# depends on the environment's trim_blocks / lstrip_blocks, which must be transformers'.
PLAIN_BLOCKS = """{% for message in messages %}
    {% if message['role'] == 'system' %}
<|im_start|>system
{{ message['content'] }}<|im_end|>
    {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


def test_block_whitespace_handling_equals_transformers(folders):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_folder(folders["qwen2"])
    hf = AutoTokenizer.from_pretrained(folders["qwen2"])
    ours.chat_template = PLAIN_BLOCKS
    messages = CONVERSATIONS["multi-turn"]
    text = hf.apply_chat_template(
        messages, chat_template=PLAIN_BLOCKS, add_generation_prompt=True, tokenize=False
    )
    assert ours.render_chat(messages) == text
    assert text.startswith("<|im_start|>system\nYou are a terse")  # blocks left no blank lines


def test_request_variables_override_special_tokens(folders):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_folder(folders["llama3"])
    hf = AutoTokenizer.from_pretrained(folders["llama3"])
    messages = CONVERSATIONS["user"]
    kw = dict(add_generation_prompt=True, bos_token="")  # e.g. a caller that adds BOS itself
    text = hf.apply_chat_template(messages, tokenize=False, **kw)
    assert ours.render_chat(messages, **kw) == text and not text.startswith("<|begin_of_text|>")


def test_llama32_date_string_variable(folders):
    """Llama 3.2's template reads today's date via strftime_now unless date_string is given."""
    from transformers import AutoTokenizer

    ours = Tokenizer.from_folder(folders["llama3.2"])
    hf = AutoTokenizer.from_pretrained(folders["llama3.2"])
    messages = CONVERSATIONS["user"]
    kw = dict(add_generation_prompt=True, date_string="01 Jan 2025")
    assert ours.apply_chat_template(messages, **kw) == hf_chat_ids(hf, messages, **kw)
    assert "Today Date: 01 Jan 2025\n" in ours.render_chat(messages, **kw)


# --- encode / decode --------------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers(pair, text):
    ours, hf, _ = pair
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_exactly_one_bos(pair):
    ours, hf, family = pair
    bos = hf.convert_tokens_to_ids("<|begin_of_text|>") if family != "qwen2" else None
    plain = ours.encode("Hello world")
    if family == "qwen2":
        assert ours.bos_token_id is None
        assert plain == hf.encode("Hello world", add_special_tokens=False)  # nothing added
        return
    assert ours.bos_token_id == bos and plain[0] == bos and plain.count(bos) == 1
    # text that already starts with BOS: transformers doubles it, we keep exactly one
    doubled = hf.encode("<|begin_of_text|>Hello world")
    assert doubled[:2] == [bos, bos]
    assert ours.encode("<|begin_of_text|>Hello world") == doubled[1:] == plain
    assert ours.encode("<|begin_of_text|><|begin_of_text|>Hello world") == plain
    # without special tokens nothing is added, and a BOS written in the text is kept
    assert ours.encode("Hello world", add_special_tokens=False) == plain[1:]
    assert ours.encode("<|begin_of_text|>Hi", add_special_tokens=False)[0] == bos


def test_add_bos_token_flag_without_post_processor(folders, tmp_path):
    """A tokenizer_config with add_bos_token=true whose tokenizer.json adds nothing still gets
    exactly one BOS."""
    import json
    import shutil

    from tokenizers import Tokenizer as RawTokenizer

    folder = tmp_path / "tok"
    shutil.copytree(folders["llama3"], folder)
    raw = RawTokenizer.from_file(str(folder / "tokenizer.json"))
    raw.post_processor = None
    raw.save(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    ours = Tokenizer.from_folder(folder)
    bos = ours.bos_token_id
    body = raw.encode("Hello world").ids
    assert body[0] != bos
    assert ours.encode("Hello world") == [bos, *body]
    assert ours.encode("<|begin_of_text|>Hello world") == [bos, *body]


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
def test_decode_equals_transformers(pair, skip):
    ours, hf, _ = pair
    ids = hf_chat_ids(hf, CONVERSATIONS["multi-turn"], add_generation_prompt=True)
    assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    # arbitrary ids, including byte tokens that are not valid UTF-8 on their own
    import random

    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 30))]
        assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


def test_round_trip(pair):
    ours, _, _ = pair
    for text in TEXTS[:5]:
        assert ours.decode(ours.encode(text)) == text


# --- incremental detokenization ---------------------------------------------------------------
def stream_pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    return [*pieces, dec.flush()]


@pytest.mark.parametrize(
    "text",
    [
        "天空为什么是蓝色的？你好，世界！",
        "Emoji 😀🎉🚀 👍🏽 ❤️ 🇫🇷 family 👨‍👩‍👧 end",
        "Ünïcödé àccents: façade, jalapeño 日本語のテキスト",
        "Why is the sky blue? plain ASCII only",
    ],
)
def test_stream_decoder_never_breaks_a_character(pair, text):
    ours, _, _ = pair
    ids = ours.encode(text, add_special_tokens=False)
    pieces = stream_pieces(ours, ids)
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == ours.decode(ids) == text
    if not text.isascii():
        # the test means something: single tokens here are partial UTF-8 characters
        assert any("\ufffd" in ours.decode([i]) for i in ids)
        assert sum(1 for p in pieces if p) > 1  # and text still comes out as it goes


def test_stream_decoder_with_special_tokens_between(pair):
    ours, hf, _ = pair
    ids = hf_chat_ids(hf, CONVERSATIONS["multi-turn"], add_generation_prompt=False)
    pieces = stream_pieces(ours, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    # with special tokens kept, they appear in the stream too
    dec = StreamDecoder(ours, skip_special_tokens=False)
    kept = "".join(dec.push(i) for i in ids) + dec.flush()
    assert kept == hf.decode(ids, skip_special_tokens=False)


def test_stream_decoder_random_ids_match_decode(pair):
    """Even on invalid byte sequences (a random model's output) the pieces add up to decode(),
    which is transformers' decode."""
    import random

    ours, hf, _ = pair
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))]
        want = hf.decode(ids, skip_special_tokens=True)
        assert "".join(stream_pieces(ours, ids)) == ours.decode(ids) == want


# --- the sandbox ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ raise_exception.__globals__['json'] }}",
        "{{ '{0.__class__.__mro__}'.format(messages) }}",
        "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
        "{% set _ = messages[0].update({'role': 'root'}) %}",
        "{{ messages.pop() }}",
    ],
)
def test_template_cannot_reach_python_internals(folders, template):
    tok = Tokenizer.from_folder(folders["qwen2"])
    tok.chat_template = template
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ZooError):
        tok.render_chat(messages)
    assert messages == [{"role": "user", "content": "hi"}]  # and nothing was changed


def test_unsafe_attribute_renders_nothing(folders):
    tok = Tokenizer.from_folder(folders["qwen2"])
    tok.chat_template = "[{{ messages.__class__ }}][{{ raise_exception.__code__ }}]"
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "[][]"


def test_template_errors_are_zoo_errors(folders):
    tok = Tokenizer.from_folder(folders["llama3"])
    # the real template refuses tools without a first user message
    with pytest.raises(ZooError, match="no first user message"):
        tok.render_chat([SYSTEM], tools=[TOOL])
    tok.chat_template = "{% for m in messages %}{{ m.content }"  # a syntax error
    with pytest.raises(ZooError):
        tok.render_chat([{"role": "user", "content": "hi"}])
    tok.chat_template = None
    with pytest.raises(ZooError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


JOINS = (  # SmolLM2's template: content joined to strings
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}"
    "{% endfor %}"
)
TESTS_NONE = (  # DeepSeek's templates test `content is none`
    "{% for m in messages %}[{{ 'none' if m['content'] is none else m['content'] }}]{% endfor %}"
)
CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}


def test_null_content_renders_as_the_template_expects(folders):
    tok = Tokenizer.from_folder(folders["qwen2"])
    messages = [{"role": "user", "content": "hi"}, CALL, {"role": "tool", "content": "21"}]
    tok.chat_template = JOINS  # fails on None: gets ""
    assert tok.render_chat(messages) == (
        "<|im_start|>user\nhi<|im_end|><|im_start|>assistant\n<|im_end|><|im_start|>tool\n21<|im_end|>"
    )
    assert tok.render_chat([{"role": "tool"}]) == "<|im_start|>tool\n<|im_end|>"  # absent: ""
    tok.chat_template = TESTS_NONE  # DeepSeek's kind: gets None
    assert tok.render_chat(messages) == "[hi][none][21]"
    assert messages[1]["content"] is None  # (the caller's messages unchanged)


@pytest.mark.parametrize(
    ("template", "index", "words"),
    [
        (JOINS, 2, "TypeError: can only concatenate str"),  # content 5: any exception type
        (
            "{% for m in messages %}{% if m.role == 'bogus' %}"
            "{{ raise_exception('unknown role ' + m.role) }}{% endif %}{% endfor %}",
            1,
            "unknown role bogus",
        ),
        ("{% for m in messages %}{{ m.content | int // 0 }}{% endfor %}", 0, "ZeroDivisionError"),
    ],
)
def test_any_template_failure_names_the_message(folders, template, index, words):
    tok = Tokenizer.from_folder(folders["qwen2"])
    tok.chat_template = template
    messages = [
        {"role": "user", "content": "1"},
        {"role": "bogus", "content": "2"},
        {"role": "user", "content": 5},
        {"role": "user", "content": "3"},
    ]
    with pytest.raises(ChatTemplateError) as err:
        tok.render_chat(messages)
    assert err.value.index == index and words in str(err.value)
    assert str(err.value).startswith(f"messages.{index} (role ")


def test_a_failure_no_message_causes_names_none(folders):
    tok = Tokenizer.from_folder(folders["qwen2"])
    tok.chat_template = "{{ bos_token + 'x' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="TypeError") as err:
        tok.render_chat([{"role": "user", "content": "hi"}], bos_token=5)
    assert err.value.index is None and str(err.value).startswith("the chat template failed")
