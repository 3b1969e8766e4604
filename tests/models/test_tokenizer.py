"""Tokenizer wrapper: BOS handling, round trips, chat templates, streaming detokenization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nightjar_jax.models.loader import ASSETS_DIR
from nightjar_jax.models.tokenizer import (
    SMOLLM2_CHAT_TEMPLATE,
    ChatTemplateArgumentError,
    IncrementalDetokenizer,
    Tokenizer,
)

STORIES = ASSETS_DIR / "stories260K"
SMOLLM_TOKENIZER = Path("/work/shared/models/smollm2-135m-instruct/tokenizer.json")  # tests only, when present
needs_smollm = pytest.mark.skipif(not SMOLLM_TOKENIZER.exists(), reason=f"{SMOLLM_TOKENIZER} not present here")
TEXTS = ["Once upon a time", "Héllo 😀 世界, naïve café — ok", "digits 1234567 and  double  spaces\n\tnewline", ""]
SMOLLM_PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                     19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 6330, 30,
                     2, 198, 1, 520, 9531, 198]
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def stories() -> Tokenizer:
    return Tokenizer.from_pretrained(STORIES / "tokenizer.json")


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_pretrained(SMOLLM_TOKENIZER)


def test_stories_bos_and_round_trip(stories):
    assert stories.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert stories.encode("Once upon a time", add_special_tokens=False) == [403, 407, 261, 378]
    assert (stories.bos_token_id, stories.eos_token_ids, stories.vocab_size) == (1, (2,), 512)
    for text in TEXTS:
        assert stories.decode(stories.encode(text)) == text
    assert stories.decode([1, 403, 407, 2]) == "Once upon"


def test_sentencepiece_model_matches_tokenizer_json(stories):
    sp = Tokenizer.from_pretrained(STORIES / "tok512.model")
    assert (sp.bos_token_id, sp.eos_token_ids, sp.vocab_size) == (1, (2,), 512)
    for text in TEXTS:
        assert sp.encode(text) == stories.encode(text)
        assert sp.decode(sp.encode(text)) == text


LLAMA2 = Path("/work/shared/tokenizers/llama2")  # tests only, when present
SPECIAL_TEXTS = ["<s>Once upon a time", "Once<s>upon", "<s> Once</s> x", "<s>[INST] Hi [/INST]</s>", "<unk>x",
                 "<s><s>\nHi", "x <s>  y", " <s>", "</s>", "<S>x"]


@pytest.mark.parametrize("folder", [STORIES, LLAMA2], ids=["stories260K", "llama2"])
def test_sentencepiece_model_reads_special_tokens_in_text_as_tokenizer_json(folder):
    """A ``.model`` read "<s>" in text as the pieces "<", "s", ">" (sp.encode alone); transformers and the same
    vocabulary's tokenizer.json read the tokens, and encode the text after one with its own dummy-prefix space."""
    json_file, model = folder / "tokenizer.json", next(folder.glob("*.model"), None)
    if not json_file.exists() or model is None:
        pytest.skip(f"{folder}: no tokenizer.json and .model pair here")
    reference, sp = Tokenizer.from_pretrained(json_file), Tokenizer.from_pretrained(model)
    for text in SPECIAL_TEXTS:
        for add_special_tokens in (True, False):
            assert sp.encode(text, add_special_tokens) == reference.encode(text, add_special_tokens), text
    assert sp.encode("<s>Once upon a time") == sp.encode("Once upon a time")  # (BOS once)


def test_sentencepiece_bpe_user_defined_pieces_split_text_as_added_tokens(tmp_path):
    """transformers' converter makes a BPE model's user-defined pieces added tokens: the text after one restarts
    with the dummy prefix, as after "<s>"."""
    pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    proto = pb.ModelProto()
    proto.ParseFromString((STORIES / "tok512.model").read_bytes())
    assert proto.pieces[299].piece == "ing"
    proto.pieces[299].type = pb.ModelProto.SentencePiece.USER_DEFINED
    (tmp_path / "user.model").write_bytes(proto.SerializeToString())
    tok = Tokenizer.from_pretrained(tmp_path / "user.model")
    sp = tok.backend.sp
    assert tok.encode("Once ing upon", False) == [*sp.encode("Once "), 299, *sp.encode(" upon")]
    assert tok.encode("ing", False) == [299] and sp.encode("ing") == [410, 299]


def test_decode_out_of_range_ids_alike_in_both_backends(stories):
    """Ids past the vocabulary (a model's padded rows) decode to nothing in both backends (SentencePiece raised
    IndexError); a negative id is a ValueError naming the range (it was an OverflowError from the Rust side)."""
    sp = Tokenizer.from_pretrained(STORIES / "tok512.model")
    for tok in (stories, sp):
        assert tok.decode([403, 512, 2**32, 407]) == tok.decode([403, 407]) == "Once upon"
        with pytest.raises(ValueError, match=r"token id -1 is negative: token ids are 0 \.\. 511"):
            tok.decode([403, -1])


def test_no_chat_template_is_a_clear_error(stories):
    with pytest.raises(ValueError, match="no chat template"):
        stories.apply_chat_template(MESSAGES)


@needs_smollm
def test_smollm2_chat_template_and_round_trip(smollm):
    prompt = smollm.apply_chat_template(MESSAGES)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>assistant\n")
    assert smollm.encode(prompt) == SMOLLM_PROMPT_IDS  # no BOS added: the template carries <|im_start|>
    assert smollm.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("<|im_end|>\n")
    with_system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    assert "SmolLM" not in smollm.apply_chat_template(with_system)
    assert smollm.eos_token_ids == (2,) and not smollm.add_bos
    for text in TEXTS:
        assert smollm.decode(smollm.encode(text)) == text


# SmolLM2's template as it was before tools: every conversation without tools renders exactly as it did.
SMOLLM2_PLAIN = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSATIONS = [
    MESSAGES,
    [{"role": "system", "content": "Be brief."}, *MESSAGES],
    [*MESSAGES, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_smollm2_template_without_tools_renders_as_before(stories, conversation, gen):
    assert stories.apply_chat_template(conversation, gen, chat_template=SMOLLM2_CHAT_TEMPLATE) == \
        stories.apply_chat_template(conversation, gen, chat_template=SMOLLM2_PLAIN)


def test_smollm2_template_renders_tools_calls_and_results(stories):
    """With tools: the system turn lists them (as JSON, not HTML-escaped) and asks for SmolLM2's call form; an
    assistant turn's calls render in that form (arguments sent as a JSON string stay that string), a tool result
    as a user turn in <tool_response> tags."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <today> & more",
                                               "parameters": {"type": "object", "properties": {"city": {}}}}}]
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Nice"}}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "c1"},
    ]
    out = stories.apply_chat_template(conversation, chat_template=SMOLLM2_CHAT_TEMPLATE, tools=tools)
    defs = json.dumps([tools[0]["function"]], ensure_ascii=False)
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n\n"
        f"You can call the functions defined here:\n<tools>{defs}</tools>\n"
        "To call functions, reply with only a JSON list of the calls between tool_call tags, in this form:\n"
        '<tool_call>[{"name": "function_name", "arguments": {"argument": "value"}}]</tool_call>\n'
        "If no function fits the question, say so.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Nice"}}]</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert "Weather <today> & more" in out
    # the calls as rendered are what the hermes parser reads back
    from nightjar_jax.server.tool_parsers import parse

    calls = parse(out.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0])[1]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_weather", {"city": "Nice"})]
    system = [{"role": "system", "content": "Be brief."}, conversation[0]]
    out = stories.apply_chat_template(system, chat_template=SMOLLM2_CHAT_TEMPLATE, tools=tools)
    assert out.startswith("<|im_start|>system\nBe brief.\n\nYou can call") and out.count("Be brief.") == 1


@needs_smollm
def test_folder_with_tokenizer_config_uses_transformers(tmp_path, smollm):
    (tmp_path / "tokenizer.json").write_bytes(SMOLLM_TOKENIZER.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "add_bos_token": False, "chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}",
    }))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.hf_tokenizer is not None and tok.eos_token_ids == (2,)
    assert tok.apply_chat_template(MESSAGES) == f"[{MESSAGES[0]['content']}]"
    for text in TEXTS:
        assert tok.encode(text) == smollm.encode(text)


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids]
    assert detok.text == "".join(deltas)
    return deltas


def test_incremental_detokenizer_byte_fallback(stories):
    text = "Héllo 😀 世界! Once upon a time 🐉🐉 ünïcödé"
    ids = stories.encode(text)
    assert any(3 <= i <= 258 for i in ids)  # byte-fallback tokens <0x..> are in play
    deltas = _stream(stories, ids)
    assert "".join(deltas) == stories.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "😀" in deltas  # the emoji's 4 byte tokens come out as one complete character


def test_incremental_detokenizer_reads_after_the_prompt(stories):
    """Started on the prompt's last ids, the first generated token streams as it reads after the prompt (its
    SentencePiece leading space kept); the prompt's own text is never emitted."""
    ids = stories.encode("Once upon a time")
    assert _stream(stories, ids[2:]) == ["upon", " a", " time"]  # alone: the first token's space is stripped
    detok = IncrementalDetokenizer(stories, prompt_ids=ids[:2])
    assert [detok.add([i]) for i in ids[2:]] == [" upon", " a", " time"]
    assert detok.text == stories.decode(ids)[len("Once"):]
    long_prompt = stories.encode("The cat sat on the mat. Once")  # only the last few prompt ids are kept
    detok = IncrementalDetokenizer(stories, prompt_ids=long_prompt)
    assert len(detok.ids) == IncrementalDetokenizer.PROMPT_CONTEXT
    assert detok.add(ids[2:]) == " upon a time"
    assert IncrementalDetokenizer(stories, prompt_ids=[1]).add(ids[1:]) == "Once upon a time"  # after BOS alone


@pytest.mark.parametrize("name", ["stories", "smollm"])
def test_incremental_detokenizer_flushes_bytes_that_never_complete(request, name):
    """At the output's end, pieces of a character that never completed come out as their bytes decode with
    replacement: "€" and a stray first byte of another is "€" + one U+FFFD (a byte-fallback decode of the window
    read the whole run, the sent "€" included, as one U+FFFD per byte: three more)."""
    tok: Tokenizer = request.getfixturevalue(name)
    euro = tok.encode("a€", add_special_tokens=False)
    stray = [i for i in tok.encode("世", add_special_tokens=False) if "\ufffd" in tok.token_text(i)][:1]
    detok = IncrementalDetokenizer(tok)
    assert detok.add(euro).endswith("€") and detok.add(stray) == ""
    assert detok.flush() == "\ufffd" and detok.text.endswith("€\ufffd") and detok.flush() == ""


@needs_smollm
def test_incremental_detokenizer_byte_level(smollm):
    text = "Paris 🇫🇷 est la capitale — 東京は日本の首都です 🎉"
    ids = smollm.encode(text)
    deltas = _stream(smollm, ids)
    assert "".join(deltas) == smollm.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    # several ids at once, and special tokens skipped
    detok = IncrementalDetokenizer(smollm)
    assert detok.add(ids[:3]) + detok.add(ids[3:]) + detok.add([2]) == text


@pytest.mark.parametrize("name", ["stories", "smollm"])
def test_token_text_spells_the_text_a_token_reads_in(request, name):
    """Per-token text (log-probabilities' ``decoded_token``): the tokens of a text, each rendered alone, spell the
    text back, leading spaces included (a SentencePiece ``▁word`` decodes alone without its space)."""
    tok: Tokenizer = request.getfixturevalue(name)
    text = "Once upon a time, there was a little girl named Lily."
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_text(i) for i in ids]
    assert "".join(pieces) in (text, " " + text)  # (SentencePiece encodes a leading space into the first token)
    assert any(p.startswith(" ") for p in pieces[1:])
    assert tok.token_text(ids[1]) is tok.token_text(ids[1])  # cached
    if tok.eos_token_ids:
        assert tok.token_text(tok.eos_token_ids[0])  # a special token keeps its text


@pytest.mark.parametrize("name", ["stories", "smollm"])
def test_token_bytes_rebuild_characters_split_over_tokens(request, name):
    """``token_bytes`` (log-probabilities' ``bytes``): a token holding part of a UTF-8 character reads U+FFFD as
    text, but its bytes are its own (SentencePiece's ``<0xF0>``, a byte-level piece of 😀), so the tokens' bytes
    joined are the text's UTF-8; whole tokens' bytes are their text's."""
    tok: Tokenizer = request.getfixturevalue(name)
    text = "a 😀 é 東京 🇫🇷 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.token_text(i) for i in ids)  # (split characters are in play)
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") in (text, " " + text)
    word = tok.encode(" upon", add_special_tokens=False)[-1]
    assert tok.token_bytes(word) == tok.token_text(word).encode("utf-8")


@needs_smollm
def test_the_hugging_face_names_vllm_code_calls(stories, smollm):
    """What code written for vLLM's ``get_tokenizer()`` (a transformers tokenizer there) calls: eos_token_id,
    bos_token / eos_token, len(), convert_ids_to_tokens, batch_decode, and apply_chat_template's tokenize= and
    template variables as keyword arguments (each raised TypeError or AttributeError)."""
    assert (stories.eos_token_id, stories.bos_token, stories.eos_token, len(stories)) == (2, "<s>", "</s>", 512)
    assert stories.convert_ids_to_tokens([1, 403]) == ["<s>", "\u2581Once"]
    assert stories.convert_ids_to_tokens(1) == "<s>"
    ids = stories.encode("Once upon a time")
    assert stories.batch_decode([ids, ids[:2]]) == ["Once upon a time", "Once"]
    text = smollm.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and text == smollm.apply_chat_template(MESSAGES)
    assert smollm.apply_chat_template(MESSAGES, tokenize=True) == smollm.encode(text, add_special_tokens=False)
    greeting = "{{ greeting }} {{ messages[0].content }}"
    assert smollm.apply_chat_template(MESSAGES, chat_template=greeting, greeting="Hi") == "Hi " + MESSAGES[0]["content"]
    with pytest.raises(ValueError, match="return_dict"):
        smollm.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)


def test_more_hugging_face_names_answer_as_transformers(stories, tmp_path):
    """``tokenizer(text)``, ``convert_tokens_to_ids``, ``all_special_ids`` / ``all_special_tokens``, ``pad_token_id``
    and ``name_or_path`` (each an AttributeError or "not callable"), compared with transformers' own tokenizer over
    the same tokenizer.json."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(STORIES / "tokenizer.json"), bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    enc = stories("Once upon a time")
    assert enc["input_ids"] == enc.input_ids == stories.encode("Once upon a time")
    assert enc.attention_mask == [1] * len(enc.input_ids)
    both = stories(["Once", "upon a time"], add_special_tokens=False)
    assert both.input_ids == hf(["Once", "upon a time"], add_special_tokens=False).input_ids
    assert both.attention_mask == [[1], [1, 1, 1]]
    pieces = ["\u2581Once", "<s>", "no-such-piece"]
    assert stories.convert_tokens_to_ids(pieces) == hf.convert_tokens_to_ids(pieces)
    assert stories.convert_tokens_to_ids("\u2581Once") == hf.convert_tokens_to_ids("\u2581Once") == 403
    assert sorted(stories.all_special_ids) == sorted(hf.all_special_ids)
    assert sorted(stories.all_special_tokens) == sorted(hf.all_special_tokens)
    assert stories.pad_token_id is None and stories.name_or_path.endswith("tokenizer.json")
    with pytest.raises(TypeError, match="a string or a list of strings"):
        stories(5)


def test_transformers_tokenizer_adds_bos_once_to_text_that_starts_with_it(tmp_path):
    """A chat template renders ``{{ bos_token }}`` and the tokenizer adds BOS again (Llama-3's): the prompt gets one
    BOS, as the tokenizers-backed path already does (``Tokenizer.encode``)."""
    import tokenizers
    from tokenizers.processors import TemplateProcessing

    backend = tokenizers.Tokenizer.from_file(str(STORIES / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.hf_tokenizer is not None and tok.hf_tokenizer.encode("<s>Once") == [1, 1, 403]
    assert tok.encode("<s>Once") == tok.encode("Once") == [1, 403]
    assert tok.encode("<s>Once", add_special_tokens=False) == [1, 403]


def test_continue_final_message_and_template_kwargs(stories):
    """transformers' / vLLM's continue_final_message: the text stops right after the last message's content (as
    written, else stripped where a template trims it); template kwargs are the template's variables and may not
    replace the request's own."""
    conversation = [*MESSAGES, {"role": "assistant", "content": "The capital "}]
    out = stories.apply_chat_template(conversation, False, chat_template=SMOLLM2_CHAT_TEMPLATE,
                                      continue_final_message=True)
    full = stories.apply_chat_template(conversation, False, chat_template=SMOLLM2_CHAT_TEMPLATE)
    assert out == full[:full.rindex("<|im_end|>")] and out.endswith("<|im_start|>assistant\nThe capital ")
    trimming = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}"
    assert stories.apply_chat_template(conversation, False, chat_template=trimming,
                                       continue_final_message=True).endswith("assistant: The capital")
    thinking = "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}"
    assert stories.apply_chat_template(MESSAGES, chat_template=thinking,
                                       template_kwargs={"enable_thinking": True}).startswith("<think>What")
    assert stories.apply_chat_template(MESSAGES, chat_template=thinking).startswith("What")
    errors = [(dict(continue_final_message=True), "set at most one of them", "continue_final_message"),
              (dict(template_kwargs={"tools": [], "messages": []}), "may not set messages, tools",
               "chat_template_kwargs")]
    for kwargs, match, field in errors:
        with pytest.raises(ChatTemplateArgumentError, match=match) as err:
            stories.apply_chat_template(conversation, chat_template=SMOLLM2_CHAT_TEMPLATE, **kwargs)
        assert err.value.field == field
    # content that the template's own text repeats after it ("e", "<" in "<|im_end|>"): cut where the message ends
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    for last in ("e", "<", "m"):
        out = stories.apply_chat_template([*MESSAGES, {"role": "assistant", "content": last}], False,
                                          chat_template=chatml, continue_final_message=True)
        assert out.endswith("<|im_start|>assistant\n" + last), out
    with pytest.raises(ChatTemplateArgumentError, match="may not set self"):
        stories.apply_chat_template(MESSAGES, chat_template=thinking, template_kwargs={"self": 1})
    for last, match in [(None, "a last message with text"), ("  ", "does not render the last message"),
                        ("gone", "does not render the last message")]:  # (transformers: "does not appear")
        with pytest.raises(ChatTemplateArgumentError, match=match):
            stories.apply_chat_template([*MESSAGES, {"role": "assistant", "content": last}], False,
                                        chat_template="{{ messages[0]['content'] }}", continue_final_message=True)


def test_a_corrupt_sentencepiece_model_is_a_value_error_naming_it(tmp_path):
    """sentencepiece's RuntimeError (which names the file) was re-raised as it was: not a ValueError."""
    path = tmp_path / "tokenizer.model"
    for content in (b"junk", b""):
        path.write_bytes(content)
        for arg in (path, tmp_path):  # the file, and a folder holding it
            with pytest.raises(ValueError, match=f"^{path}: not a readable SentencePiece model"):
                Tokenizer.from_pretrained(arg)


TRANSFORMERS_TEMPLATES = [
    "{% for m in messages %}{{ m.content }}{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}",
    "{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>{% endgeneration %}"
    "{% endif %}{% endfor %}",
    "{{ strftime_now('%Y') }}|{{ bos_token }}{{ eos_token }}|{{ unk_token }}|{{ pad_token }}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    "{{ dict(a=1) | tojson }}{{ {'x': '<&>'} | tojson(indent=1) }}",
    "{% for d in documents or [] %}[{{ d.title }}] {{ d.text }}\n{% endfor %}{{ documents is none }}",
]


@pytest.mark.parametrize("template", TRANSFORMERS_TEMPLATES)
def test_chat_template_environment_is_transformers(tmp_path, template):
    """The template renders as transformers' apply_chat_template renders it: loop controls, the {% generation %}
    tag, strftime_now, namespace/dict, tojson, every named special token (a pad token the tokenizer_config names
    rendered empty), documents (refused before). The namespace / dict one checks transformers' hardened globals
    keep jinja's behaviour; each other failed or differed."""
    pytest.importorskip("transformers")
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizers.Tokenizer.from_file(str(STORIES / "tokenizer.json")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "</s>"}))
    ours = Tokenizer.from_pretrained(tmp_path)
    hf = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    conversation = [*MESSAGES, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Why?"}]
    for documents in (None, [{"title": "T", "text": "Paris is in France."}]):
        expected = hf.apply_chat_template(conversation, chat_template=template, documents=documents, tokenize=False)
        assert ours.apply_chat_template(conversation, False, chat_template=template, documents=documents) == expected
    sp = Tokenizer.from_pretrained(STORIES / "tok512.model")  # (a bare vocabulary: BOS, EOS and unknown token)
    assert sp.special_tokens_map == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def test_chat_template_documents_and_namespace_guard(stories):
    """``documents`` reach the template (they were refused as "not transformers' tokenize"); one given twice (also
    as a template kwarg) is an error; a namespace takes no underscore attribute (transformers' guard)."""
    template = "{% for d in documents %}{{ d.text }}|{% endfor %}{{ messages[0].content }}"
    documents = [{"title": "a", "text": "DOC"}]
    assert stories.apply_chat_template(MESSAGES, chat_template=template, documents=documents).startswith("DOC|What")
    assert stories.apply_chat_template(MESSAGES, chat_template=template, template_kwargs={"documents": documents},
                                       ).startswith("DOC|What")  # (as before)
    with pytest.raises(ChatTemplateArgumentError, match="may not set documents"):
        stories.apply_chat_template(MESSAGES, chat_template=template, documents=documents,
                                    template_kwargs={"documents": documents})
    with pytest.raises(ValueError, match="underscore"):
        stories.apply_chat_template(MESSAGES, chat_template="{% set ns = namespace(_x=1) %}")


def test_continue_final_message_with_empty_content_is_transformers():
    """An empty last message continues from its start, as transformers renders it (it was refused)."""
    transformers = pytest.importorskip("transformers")
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(STORIES / "tokenizer.json"), chat_template=chatml)
    ours = Tokenizer.from_pretrained(STORIES / "tokenizer.json")
    for conversation in ([{"role": "user", "content": ""}], [*MESSAGES, {"role": "assistant", "content": ""}]):
        expected = hf.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
        assert expected.endswith("<|im_start|>" + conversation[-1]["role"] + "\n")
        assert ours.apply_chat_template(conversation, False, chat_template=chatml,
                                        continue_final_message=True) == expected


def test_incremental_detokenizer_completes_the_prompts_last_character(stories):
    """The prompt ends after the first byte of "😀" (its text ends in U+FFFD) and the output completes it: the
    emoji streams (the length diff saw "ab\ufffd" -> "ab😀" as nothing new and dropped it); left incomplete, the
    prompt's U+FFFD is not the output's."""
    ids = stories.encode("ab😀cd", add_special_tokens=False)
    cut = next(i for i, t in enumerate(ids) if "\ufffd" in stories.token_text(t)) + 1
    detok = IncrementalDetokenizer(stories, prompt_ids=ids[:cut])
    deltas = [detok.add([t]) for t in ids[cut:]] + [detok.flush()]
    assert deltas == ["", "", "😀", "c", "d", ""] and detok.text == "😀cd"
    detok = IncrementalDetokenizer(stories, prompt_ids=ids[:cut])
    assert detok.add(ids[-2:]) + detok.flush() == "cd"
