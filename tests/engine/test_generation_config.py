"""Default sampling parameters from the model's ``generation_config.json`` (vLLM's ``--generation-config``): read
as vLLM reads them, overridable, ignorable, used by ``LLM.generate`` and the server for the fields a request leaves
unset, and a bad file or override is a clear start-up error."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from nightjar_jax import LLM, SamplingParams
from nightjar_jax.cli import add_engine_args, engine_config_from_args
from nightjar_jax.config import ConfigError, ModelConfig, make_engine_config
from nightjar_jax.engine.generation_config import (
    generation_defaults,
    generation_eos_ids,
    parse_override,
    read_eos_ids,
    read_file,
)
from nightjar_jax.models.hf import write_safetensors
from nightjar_jax.models.llama import random_state
from nightjar_jax.models.loader import load_checkpoint
from nightjar_jax.models.orbax_io import save_orbax, state_to_hf
from nightjar_jax.server.app import ServerSettings, build_app
from nightjar_jax.server.async_engine import AsyncEngine

TINY = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                   max_position_embeddings=64, name="tiny")
PROMPT = {"prompt_token_ids": [1, 5, 9, 33]}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def _hf_folder(folder, generation: dict | None):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=TINY.vocab_size,
               hidden_size=TINY.hidden_size, intermediate_size=TINY.intermediate_size, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
               eos_token_id=2, tie_word_embeddings=False, dtype="float32")
    (folder / "config.json").write_text(json.dumps(cfg))
    _, state = random_state(TINY, seed=5)
    write_safetensors(folder / "model.safetensors", state_to_hf(TINY, state))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_read_as_vllm_reads_it(tmp_path):
    path = tmp_path / "generation_config.json"
    # Llama 3's file: do_sample is not read, and transformers' defaults (top_k 50) recommend nothing
    path.write_text(json.dumps({"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128009],
                                "temperature": 0.6, "top_p": 0.9, "top_k": 50, "max_new_tokens": 256,
                                "repetition_penalty": 1.0, "min_p": None}))
    assert read_file(path) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 256}
    assert read_file(tmp_path) == read_file(path)  # (the folder holding it)
    assert read_file(tmp_path / "elsewhere") == {}
    # Qwen's: every key it sets differs from transformers' defaults
    path.write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}))
    assert read_file(path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


@pytest.mark.parametrize("text, fragment", [
    ("{not json", "not readable as JSON"),
    ("[1, 2]", "must hold a JSON object, got list"),
    ('{"temperature": -1}', "temperature"),
    ('{"top_p": 2.0}', "top_p"),
    ('{"max_new_tokens": 0}', "max_tokens"),
    ('{"temperature": true}', "temperature"),  # (true == 1.0, transformers' default: it was skipped, not refused)
    # (a string: "'<=' not supported between instances of 'int' and 'str'", from min_tokens' check)
    ('{"max_new_tokens": "50"}', r"max_tokens='50' is invalid: allowed None or an integer >= 1"),
])
def test_a_bad_file_names_itself_and_the_field(tmp_path, text, fragment):
    path = tmp_path / "generation_config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment) as info:
        read_file(path)
    assert str(path) in str(info.value)


def test_eos_ids_read_from_the_file(tmp_path):
    path = tmp_path / "generation_config.json"
    assert read_eos_ids(path, 128) == ()  # (no file)
    for value, ids in [([2, 9], (2, 9)), (9, (9,)), (None, ())]:
        path.write_text(json.dumps({"temperature": 0.6, "eos_token_id": value}))
        assert read_eos_ids(path, 128) == ids
        assert read_eos_ids(tmp_path, 128) == ids  # (the folder holding it)
    for bad in ([2, 128], -1, "2", [True], 2.0):
        path.write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(ConfigError, match=r"eos_token_id=.* is invalid: allowed a token id or a list of token "
                                              r"ids in \[0, 127\]") as info:
            read_eos_ids(path, 128)
        assert str(path) in str(info.value)


def test_override():
    assert parse_override(None) == {}
    assert parse_override('{"temperature": 0.5, "max_new_tokens": 8}') == {"temperature": 0.5, "max_tokens": 8}
    assert parse_override({"max_tokens": 8, "min_p": 0.1}) == {"max_tokens": 8, "min_p": 0.1}
    for bad, fragment in [("{oops", "is not JSON"), ("[1]", "must be a JSON object"),
                          ({"temprature": 0.5}, r"unknown key\(s\) \['temprature'\]: allowed"),
                          ({"top_k": -5}, "top_k"), ({"seed": 1}, "unknown key"),
                          ({"max_tokens": 4, "max_new_tokens": 8}, "sets both max_tokens and max_new_tokens"),
                          ({"max_tokens": True}, "max_tokens")]:
        with pytest.raises(ConfigError, match=fragment):
            parse_override(bad)


def test_modes_and_the_command_line(tmp_path):
    folder = _hf_folder(tmp_path / "m", {"temperature": 0.3, "top_k": 7})
    assert generation_defaults(make_engine_config(model=str(folder))) == {"temperature": 0.3, "top_k": 7}
    assert generation_defaults(make_engine_config(model=str(folder), generation_config="vllm")) == {}
    other = tmp_path / "other.json"
    other.write_text('{"top_p": 0.5}')
    assert generation_defaults(make_engine_config(model=str(folder), generation_config=str(other))) == {"top_p": 0.5}
    both = make_engine_config(model=str(folder), override_generation_config={"top_k": 3, "max_new_tokens": 9})
    assert generation_defaults(both) == {"temperature": 0.3, "top_k": 3, "max_tokens": 9}
    # one-file checkpoints (GGUF, llama2.c) and presets carry none
    assert generation_defaults(make_engine_config(model="stories260k")) == {}
    with pytest.raises(ConfigError, match="no such file or folder"):
        generation_defaults(make_engine_config(model=str(folder), generation_config=str(tmp_path / "nope")))
    import argparse

    parser = add_engine_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(folder), "--generation-config", "vllm",
                              "--override-generation-config", '{"temperature": 0}'])
    assert generation_defaults(engine_config_from_args(args)) == {"temperature": 0}


def test_generate_command_uses_them_for_unset_flags(tmp_path, capsys):
    """``python -m nightjar_jax generate``: --max-tokens and --temperature left out take the generation config's
    values (they were always 64 and 0); given, they win."""
    from nightjar_jax.__main__ import main

    base = ["generate", "--model", "stories260k", "--draft-model", "none", "--prompt", "Once upon a time",
            "--max-model-len", "128", "--num-pages", "64", "--override-generation-config", '{"max_new_tokens": 3}']
    assert main(base) == 0
    assert "3 tokens in" in capsys.readouterr().err
    assert main([*base, "--max-tokens", "5"]) == 0
    assert "5 tokens in" in capsys.readouterr().err


def test_llm_generates_with_the_models_defaults(tmp_path):
    # stories260K saved as an orbax folder with a generation_config.json beside it (its shapes: the step variants
    # the other in-process tests compile, found in the compilation cache)
    ckpt = load_checkpoint("stories260k")
    folder = save_orbax(tmp_path / "m", ckpt.config, ckpt.state_dict)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3, "top_k": 50,
                                                               "do_sample": True}))
    llm = LLM(str(folder), max_model_len=128, num_pages=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 3, 0)
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
    assert llm.generate([PROMPT])[0].outputs[0].token_ids == greedy  # no parameters: the model's
    assert len(llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids) == 5
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable
    with pytest.raises(ConfigError, match="override_generation_config"):  # (before any weights load)
        LLM(str(folder), override_generation_config={"temperature": "hot"})


def test_its_eos_ids_end_generation_in_every_mode(tmp_path):
    """The file's ``eos_token_id`` list ends generation, as vLLM adds it to every request's stop ids (instruct models'
    end-of-turn tokens live there, e.g. Llama 3's <|eot_id|>), under "auto" and "vllm" alike; ``ignore_eos`` runs
    past it. It was never read: generation ran on to max_tokens."""
    ckpt = load_checkpoint("stories260k")
    folder = save_orbax(tmp_path / "m", ckpt.config, ckpt.state_dict)
    params = SamplingParams(temperature=0, max_tokens=8)
    plain = LLM(str(folder), max_model_len=128, num_pages=64).generate([PROMPT], params)[0].outputs[0].token_ids
    end = plain[3]
    assert end not in plain[:3] and end not in ckpt.config.eos_token_ids
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, end]}))
    assert generation_eos_ids(make_engine_config(model=str(folder)), 512) == (2, end)
    for mode in ("auto", "vllm"):
        llm = LLM(str(folder), max_model_len=128, num_pages=64, generation_config=mode)
        out = llm.generate([PROMPT], params)[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == (plain[:4], "stop")
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == (plain, "length")
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


PROMPT_IDS = [1, 403, 407, 261]


@pytest.fixture(scope="module")
def served():
    llm = LLM("stories260k", draft_model="none", max_model_len=128, num_pages=64,
              override_generation_config={"temperature": 0, "max_new_tokens": 4})
    llm.engine.tokenizer.chat_template = CHAT_TEMPLATE  # (serve --chat-template)
    # the library's outputs, before the server's engine thread owns the engine: the engine is not thread-safe, and
    # a generate from the test's thread while the server's thread stepped raced it ("Buffer has been deleted or
    # donated", then a different text; CI, 2026-12-06)
    refs = {name: llm.generate([{"prompt_token_ids": PROMPT_IDS}], params)[0].outputs[0].text for name, params in (
        ("greedy", SamplingParams(temperature=0, max_tokens=6)),
        ("seeded", SamplingParams(temperature=1.0, seed=7, max_tokens=6)))}
    client = TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s")))
    with client:
        yield llm, client, refs


def test_the_server_fills_unset_fields_from_them(served):
    llm, client, refs = served
    prompt = PROMPT_IDS
    resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6})  # temperature: the model's 0
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == refs["greedy"]
    # the request's own values win: a seeded draw at temperature 1 equals the library's
    resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 7})
    assert resp.json()["choices"][0]["text"] == refs["seeded"]
    # chat without max_tokens: the model's max_new_tokens, not the rest of the context
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Once upon a time"}]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


def test_its_eos_ids_stay_the_engines_own(tmp_path):
    """Engines over one target share its tokenizer (LLM.from_engine): one engine's generation-config eos ids reach
    its own stop ids only. They were added to the shared tokenizer's eos_token_ids, which every engine over it then
    stopped at."""
    from nightjar_jax import LLMEngine

    ckpt = load_checkpoint("stories260k")
    folder = save_orbax(tmp_path / "m", ckpt.config, ckpt.state_dict)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 298]}))
    base = LLM("stories260k", draft_model="none", max_model_len=128, num_pages=64)
    tok = base.engine.tokenizer
    before = tuple(tok.eos_token_ids)
    engine = LLMEngine(make_engine_config(model=str(folder), draft_model="none", max_model_len=128, num_pages=64),
                       target=base.engine.target, tokenizer=tok)
    assert 298 in engine._eos_ids and 298 not in base.engine._eos_ids
    assert tuple(tok.eos_token_ids) == before
