"""Checkpoint loaders: format round trips (orbax, GGUF, llama2.c), dummy weights, and clear errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from nightjar_jax.config import ModelConfig
from nightjar_jax.models.hf import write_safetensors
from nightjar_jax.models.llama import random_state
from nightjar_jax.models.llama2c import rotate_half_to_interleaved
from nightjar_jax.models.loader import ASSETS_DIR, load_checkpoint, load_model
from nightjar_jax.models.orbax_io import save_orbax, state_to_hf

STORIES = ASSETS_DIR / "stories260K"
TINY = ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   max_position_embeddings=128, name="tiny")


def _hf_config(cfg: ModelConfig, **overrides) -> dict:
    d = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=cfg.vocab_size,
             hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
             num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, rms_norm_eps=cfg.rms_norm_eps,
             tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_position_embeddings,
             bos_token_id=1, eos_token_id=[2, 3], dtype="float32")
    d.update(overrides)
    return d


@pytest.fixture(scope="module")
def tiny_weights() -> dict[str, np.ndarray]:
    _, state = random_state(TINY, seed=3)
    return state_to_hf(TINY, state)


def _write_hf(folder: Path, weights: dict, **config_overrides) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(_hf_config(TINY, **config_overrides)))
    write_safetensors(folder / "model.safetensors", weights)
    return folder


def _assert_same(state_dict: dict, expected: dict) -> None:
    assert sorted(state_dict) == sorted(expected)
    for k, v in expected.items():
        np.testing.assert_array_equal(np.asarray(state_dict[k], np.float32), np.asarray(v, np.float32), err_msg=k)


# ---- happy paths ------------------------------------------------------------------------------------------------


def test_hf_folder_round_trip(tmp_path, tiny_weights):
    folder = _write_hf(tmp_path / "m", tiny_weights)
    ckpt = load_checkpoint(str(folder))
    assert ckpt.config.eos_token_ids == (2, 3) and ckpt.load_format == "hf" and ckpt.tokenizer is None
    _assert_same(ckpt.state_dict, tiny_weights)
    assert load_checkpoint(str(folder), dtype="bfloat16").config.dtype == "bfloat16"


def test_orbax_round_trip(tmp_path, tiny_weights):
    graphdef, state = random_state(TINY, seed=3)
    out = save_orbax(tmp_path / "ck", TINY, (graphdef, state), tokenizer_dir=STORIES / "tokenizer.json")
    ckpt, _, state2 = load_model(str(out))
    assert ckpt.config == TINY and ckpt.load_format == "orbax"
    assert ckpt.tokenizer is not None and ckpt.tokenizer.encode("Once upon a time")[0] == 1
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # from an HF-named dict too, and load_format="orbax" forced
    save_orbax(tmp_path / "ck2", TINY, tiny_weights)
    _assert_same(load_checkpoint(str(tmp_path / "ck2"), load_format="orbax").state_dict, tiny_weights)


def test_dummy_format():
    ckpt, graphdef, state = load_model("tiny-gqa", load_format="dummy")
    assert ckpt.state_dict is None and ckpt.load_format == "dummy" and ckpt.tokenizer is not None
    big = load_checkpoint("llama-7b", load_format="dummy")  # config only: no weights, no download
    assert big.state_dict is None and big.config.hidden_size == 4096


def test_llama2c_stories_and_separate_classifier(tmp_path, tiny_weights):
    ckpt = load_checkpoint(str(STORIES / "stories260K.bin"))
    assert ckpt.config.tie_word_embeddings and ckpt.config.num_kv_heads == 4 and ckpt.tokenizer is not None
    assert ckpt.config.eos_token_ids == (2, 1)  # (llama2.c's run.c stops at BOS, written between stories)
    # write our own v0 file with a separate classifier (negative vocab in the header) and read it back
    cfg, w = TINY, tiny_weights
    L = cfg.num_layers
    stack = lambda fmt, f=lambda x: x: np.stack([f(w[fmt.format(i)]) for i in range(L)])  # noqa: E731
    q = lambda x: rotate_half_to_interleaved(x, cfg.num_heads)  # noqa: E731
    k = lambda x: rotate_half_to_interleaved(x, cfg.num_kv_heads)  # noqa: E731
    p = "model.layers.{}."
    parts = [w["model.embed_tokens.weight"], stack(p + "input_layernorm.weight"),
             stack(p + "self_attn.q_proj.weight", q), stack(p + "self_attn.k_proj.weight", k),
             stack(p + "self_attn.v_proj.weight"), stack(p + "self_attn.o_proj.weight"),
             stack(p + "post_attention_layernorm.weight"), stack(p + "mlp.gate_proj.weight"),
             stack(p + "mlp.down_proj.weight"), stack(p + "mlp.up_proj.weight"), w["model.norm.weight"],
             np.zeros((128, 4)), np.zeros((128, 4)), w["lm_head.weight"]]
    header = np.array([32, 48, 2, 4, 2, -512, 128], np.int32)
    path = tmp_path / "m.bin"
    path.write_bytes(header.tobytes() + b"".join(np.asarray(x, np.float32).tobytes() for x in parts))
    loaded = load_checkpoint(str(path))
    assert not loaded.config.tie_word_embeddings
    _assert_same(loaded.state_dict, w)


def _write_stories_gguf(path: Path, meta: dict | None = None, int_tensor: str | None = None,
                        replace: dict | None = None) -> None:
    """stories260K in llama.cpp naming/layout (q/k interleaved, F32) with its SentencePiece vocab.

    ``meta``: metadata keys to change or add (None drops one), written as uint32 / float32 / string / array by their
    Python type; ``int_tensor``: a tensor written as I32 (a GGML type gguf cannot dequantize); ``replace``: tensors
    written in place of the model's (llama.cpp names)."""
    import gguf
    import sentencepiece

    ckpt = load_checkpoint(str(STORIES / "stories260K.bin"))
    cfg, w = ckpt.config, ckpt.state_dict
    sp = sentencepiece.SentencePieceProcessor(model_file=str(STORIES / "tok512.model"))
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    writer = gguf.GGUFWriter(str(path), "llama")
    kv = {
        "llama.block_count": cfg.num_layers, "llama.context_length": cfg.max_position_embeddings,
        "llama.embedding_length": cfg.hidden_size, "llama.feed_forward_length": cfg.intermediate_size,
        "llama.attention.head_count": cfg.num_heads, "llama.attention.head_count_kv": cfg.num_kv_heads,
        "llama.rope.freq_base": cfg.rope_theta, "llama.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)], "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    for key, value in {**kv, **(meta or {})}.items():
        if value is None:
            continue
        add = {str: writer.add_string, float: writer.add_float32, list: writer.add_array}.get(type(value),
                                                                                            writer.add_uint32)
        add(key, value)
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    tensors = {"token_embd.weight": w["model.embed_tokens.weight"], "output_norm.weight": w["model.norm.weight"]}
    for i in range(cfg.num_layers):
        for g, h in names.items():
            arr = np.asarray(w[f"model.layers.{i}.{h}.weight"])
            if g == "attn_q":
                arr = rotate_half_to_interleaved(arr, cfg.num_heads)
            elif g == "attn_k":
                arr = rotate_half_to_interleaved(arr, cfg.num_kv_heads)
            tensors[f"blk.{i}.{g}.weight"] = arr
    tensors.update(replace or {})
    for name, arr in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(arr, np.int32 if name == int_tensor else None))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_round_trip_with_spm_tokenizer(tmp_path):
    path = tmp_path / "stories.gguf"
    _write_stories_gguf(path)
    ref = load_checkpoint(str(STORIES / "stories260K.bin"))
    got = load_checkpoint(str(path))
    assert got.load_format == "gguf" and got.config.tie_word_embeddings
    # (GGUF holds one EOS id; the llama2.c file's config ends at BOS too, as run.c does)
    assert got.config.eos_token_ids == (2,) and ref.config.eos_token_ids == (2, 1)
    assert got.config.replace(name="x") == ref.config.replace(name="x", eos_token_ids=(2,))
    _assert_same(got.state_dict, ref.state_dict)
    texts = ["Once upon a time", "Héllo 😀 世界, 123 dogs!", "  two  spaces\nnewline"]
    for text in texts:
        assert got.tokenizer.encode(text) == ref.tokenizer.encode(text), text
        assert got.tokenizer.decode(ref.tokenizer.encode(text)) == text


def test_a_given_tokenizer_stands_in_for_a_checkpoints_missing_or_unreadable_one(tmp_path, tiny_weights):
    """tokenizer= replaces the checkpoint's own, which is then not read: a GGUF without tokenizer metadata and an HF
    folder whose tokenizer.json is broken loaded only without one (QA, 2026-12-07: both were errors, tokenizer= or
    not)."""
    given = str(STORIES / "tokenizer.json")
    path = tmp_path / "notok.gguf"
    _write_stories_gguf(path, meta={"tokenizer.ggml.model": None, "tokenizer.ggml.tokens": None,
                                    "tokenizer.ggml.scores": None, "tokenizer.ggml.token_type": None})
    with pytest.raises(ValueError, match=r"GGUF file has no tokenizer \(tokenizer.ggml.tokens is missing\): give the "
                                         r"model's tokenizer with tokenizer= \(--tokenizer\)"):
        load_checkpoint(str(path))
    for load_format in ("auto", "dummy"):
        ckpt = load_checkpoint(str(path), tokenizer=given, load_format=load_format)
        assert ckpt.tokenizer.source == given and ckpt.tokenizer.encode("Once upon") == \
            load_checkpoint(str(STORIES / "stories260K.bin")).tokenizer.encode("Once upon")
    folder = _write_hf(tmp_path / "hf", tiny_weights)
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizer this engine can read"):
        load_checkpoint(str(folder))
    assert load_checkpoint(str(folder), tokenizer=given).tokenizer.source == given


def test_a_pytorch_bin_or_a_llama2c_header_with_bad_kv_heads_says_what_is_wrong(tmp_path):
    import torch

    path = tmp_path / "pytorch_model.bin"
    torch.save({"model.embed_tokens.weight": torch.zeros(4, 4)}, path)
    with pytest.raises(ValueError, match=r"a PyTorch checkpoint \(torch.save's zip or pickle\), not a llama2.c export: "
                                         r"PyTorch .bin weights are not read here"):
        load_checkpoint(str(path))
    raw = bytearray((STORIES / "stories260K.bin").read_bytes())
    header = np.frombuffer(bytes(raw[:28]), np.int32).copy()
    header[0] = 128  # (a dim whose first byte is 0x80, as a pickle's: a plausible header is a llama2.c file's)
    (tmp_path / "d128.bin").write_bytes(header.tobytes())
    with pytest.raises(ValueError, match=r"d128.bin: expected \d+ bytes"):  # (read as llama2.c: its size is wrong)
        load_checkpoint(str(tmp_path / "d128.bin"))
    raw[16:20] = np.array([3], np.int32).tobytes()  # n_kv_heads 3 for 8 heads
    (tmp_path / "m.bin").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"n_kv_heads=3 for n_heads=8: allowed a divisor of n_heads"):
        load_checkpoint(str(tmp_path / "m.bin"))


def test_gguf_padding_and_unknown_ids_name_the_tokenizers_special_tokens(tmp_path):
    """tokenizer.ggml.padding_token_id / unknown_token_id are the tokenizer's pad and unk tokens, as transformers
    reads the same GGUF (SmolLM2's pad_token_id was None, pad_token / unk_token AttributeErrors; QA, 2026-12-07)."""
    path = tmp_path / "stories.gguf"
    _write_stories_gguf(path, meta={"tokenizer.ggml.padding_token_id": 2, "tokenizer.ggml.unknown_token_id": 0})
    tok = load_checkpoint(str(path)).tokenizer
    assert (tok.pad_token_id, tok.pad_token, tok.unk_token, tok.unk_token_id) == (2, "</s>", "<unk>", 0)
    assert tok.special_tokens_map == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                      "pad_token": "</s>"}
    assert sorted(tok.all_special_ids) == [0, 1, 2] and tok.convert_tokens_to_ids("no such piece") == 0
    _write_stories_gguf(path)  # (no such keys: none named beyond the vocabulary's own unknown piece)
    tok = load_checkpoint(str(path)).tokenizer
    assert (tok.pad_token_id, tok.pad_token, tok.unk_token) == (None, None, "<unk>")


# ---- errors -----------------------------------------------------------------------------------------------------


def test_a_file_of_an_hf_folder_or_a_folder_as_gguf_says_what_to_give(tmp_path):
    """A model.safetensors given alone was told to "pass load_format" (every format refuses a lone file); a folder
    read as GGUF was "truncated or corrupt GGUF header ... IsADirectoryError" (QA, 2026-12-07)."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(ValueError, match=f"an HF checkpoint is its folder: give {tmp_path}"):
        load_checkpoint(str(weights))
    with pytest.raises(ValueError, match="is a folder, not a GGUF file: give the .gguf file itself"):
        load_checkpoint(str(tmp_path), load_format="gguf")


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'no-such-model'"):
        load_checkpoint("no-such-model")


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_checkpoint(str(tmp_path / "nope"))


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(TINY)))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_checkpoint(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        load_checkpoint(str(tmp_path / ".."))  # neither config.json nor an orbax checkpoint


def test_unsupported_architecture(tmp_path, tiny_weights):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"config\.json: unsupported architecture.*GPT2LMHeadModel"):
        load_checkpoint(str(tmp_path))
    # architectures decides when given: a Qwen2 model with model_type "llama" loaded and ran as a Llama
    _write_hf(tmp_path / "qwen", tiny_weights, architectures=["Qwen2ForCausalLM"])
    with pytest.raises(ValueError, match=r"config\.json: unsupported architecture \['Qwen2ForCausalLM'\] "
                                         r"\(model_type='llama'\)"):
        load_checkpoint(str(tmp_path / "qwen"))
    _write_hf(tmp_path / "type", tiny_weights, model_type="qwen2")  # (a supported class: its type is not read)
    assert load_checkpoint(str(tmp_path / "type")).config.num_layers == TINY.num_layers
    _write_hf(tmp_path / "old", tiny_weights, architectures=["LLaMAForCausalLM"])  # (early conversions' name)
    assert load_checkpoint(str(tmp_path / "old")).config.num_layers == TINY.num_layers


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is unsupported"),
        ({"attention_bias": True}, "attention_bias=true is unsupported"),
        # (a factor with no type ran unscaled RoPE; Mistral's class under model_type "llama" ran full attention)
        ({"rope_scaling": {"factor": 8.0}}, "rope_scaling has a factor but no rope_type"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 16}, "sliding_window=16 is unsupported"),
    ],
)
def test_unsupported_config_fields(tmp_path, tiny_weights, overrides, message):
    _write_hf(tmp_path, tiny_weights, **overrides)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(tmp_path))


def test_mismatched_shape(tmp_path, tiny_weights):
    _write_hf(tmp_path, tiny_weights, intermediate_size=40)
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):
        load_model(str(tmp_path))


def test_missing_tensor(tmp_path, tiny_weights):
    weights = dict(tiny_weights)
    del weights["model.layers.1.self_attn.v_proj.weight"]
    _write_hf(tmp_path, weights)
    with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.1\.self_attn\.v_proj\.weight"):
        load_model(str(tmp_path))


def test_missing_shard(tmp_path, tiny_weights):
    _write_hf(tmp_path, tiny_weights)
    index = {"weight_map": {k: "model.safetensors" for k in tiny_weights}}
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_checkpoint(str(tmp_path))


def test_truncated_safetensors(tmp_path, tiny_weights):
    _write_hf(tmp_path, tiny_weights)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_checkpoint(str(tmp_path))


def test_hf_repo_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="cannot download some-org/some-model: no network / not in local HF cache"):
        load_checkpoint("some-org/some-model")


def test_hf_repo_id_download_error_is_one_line(monkeypatch):
    """huggingface_hub's error text runs over three lines: the CLI printed them all after "error:"."""
    import huggingface_hub

    def no_network(repo_id, **kwargs):
        raise OSError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened while trying to "
                      "locate the files on the Hub, and we cannot find the\nappropriate snapshot folder")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    with pytest.raises(ValueError) as info:
        load_checkpoint("some-org/some-model")
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("cannot download some-org/some-model: no network / not in local HF cache; "
                                      "pass a local folder, run once with network")
    assert str(info.value).endswith("(OSError: Got: ConnectError: [Errno -2] Name or service not known)")


def test_a_compilation_cache_dir_that_is_a_file_names_the_flag(tmp_path):
    """It was "error: [Errno 17] File exists: '...'" when the engine made the folder."""
    import argparse

    from nightjar_jax.cli import add_engine_args, engine_config_from_args
    from nightjar_jax.config import ConfigError

    parser = add_engine_args(argparse.ArgumentParser())
    (tmp_path / "afile").write_text("x")
    for path in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises(ConfigError, match=f"^--compilation-cache-dir {path}: {tmp_path / 'afile'} is a file: it "
                                              f"needs a directory"):
            engine_config_from_args(parser.parse_args(["--compilation-cache-dir", str(path)]))
    new = tmp_path / "new" / "cache"
    assert engine_config_from_args(parser.parse_args(["--compilation-cache-dir", str(new)])).compilation_cache_dir \
        == str(new)


def test_float16_weights_say_they_run_as_bfloat16(tmp_path, tiny_weights, caplog):
    """float16 is no compute dtype here: an HF torch_dtype float16 ran as bfloat16 without a word."""
    half = {k: v.astype(np.float16) for k, v in tiny_weights.items()}
    _write_hf(tmp_path, half, dtype="float16")
    with caplog.at_level("WARNING", logger="nightjar_jax.models.loader"):
        assert load_checkpoint(str(tmp_path)).config.dtype == "bfloat16"
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path}: its float16 weights run as bfloat16 (float16 is not a compute dtype here); pass "
        f"dtype='float32' (--dtype float32) to run them in float32"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="nightjar_jax.models.loader"):
        assert load_checkpoint(str(tmp_path), dtype="float32").config.dtype == "float32"
    assert not caplog.records


def test_preset_without_weights_and_bad_args():
    with pytest.raises(ValueError, match="no real weights; use load_format='dummy'"):
        load_checkpoint("tiny-gqa")
    with pytest.raises(ValueError, match="load_format='pt' is invalid"):
        load_checkpoint("tiny-gqa", load_format="pt")
    with pytest.raises(ValueError, match="dtype='float16' is invalid"):
        load_checkpoint("tiny-gqa", load_format="dummy", dtype="float16")


def test_gguf_caches_weights_config_and_tokenizer(tmp_path, monkeypatch):
    from nightjar_jax.models import gguf_loader

    path = tmp_path / "stories.gguf"
    _write_stories_gguf(path, meta={"tokenizer.ggml.padding_token_id": 2})
    cfg, sd, tok = gguf_loader.load_gguf(path, name="s", dequant_cache=True)
    assert path.with_name(path.name + ".meta.json").exists()

    def no_reader(*args, **kwargs):
        raise AssertionError("the GGUF metadata should come from the cache")

    monkeypatch.setattr(gguf_loader, "_reader", no_reader)
    cfg2, sd2, tok2 = gguf_loader.load_gguf(path, name="s", dequant_cache=True)
    assert cfg2 == cfg
    _assert_same(sd2, sd)
    text = "Once upon a time, 🙂 there was 42."
    assert tok2.encode(text) == tok.encode(text) and tok2.eos_token_ids == tok.eos_token_ids
    assert tok2.chat_template == tok.chat_template and tok2.pad_token_id == tok.pad_token_id == 2


def test_gguf_with_smollm2s_own_template_serves_the_one_with_tools(tmp_path):
    """SmolLM2's GGUF ships its own template, which ignores tools: the tokenizer serves SMOLLM2_CHAT_TEMPLATE
    instead, loaded from the file and from a metadata cache written before (which holds the shipped one)."""
    from nightjar_jax.models import gguf_loader
    from nightjar_jax.models.tokenizer import SMOLLM2_CHAT_TEMPLATE, SMOLLM2_SHIPPED_TEMPLATE

    path = tmp_path / "stories.gguf"
    _write_stories_gguf(path, {"tokenizer.chat_template": SMOLLM2_SHIPPED_TEMPLATE})
    assert gguf_loader.load_gguf(path, name="s", dequant_cache=True)[2].chat_template == SMOLLM2_CHAT_TEMPLATE
    meta_path = path.with_name(path.name + ".meta.json")
    meta = json.loads(meta_path.read_text())
    meta["tokenizer"]["chat_template"] = SMOLLM2_SHIPPED_TEMPLATE
    meta_path.write_text(json.dumps(meta))
    assert gguf_loader.load_gguf(path, name="s", dequant_cache=True)[2].chat_template == SMOLLM2_CHAT_TEMPLATE


@pytest.mark.parametrize("config, message", [
    ([1, 2], "must be a JSON object \\(an HF config\\), got list"),
    ({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1},
     "missing required field 'num_attention_heads'"),
    ({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": None}, "num_attention_heads=None must be an integer"),
])
def test_a_bad_hf_config_is_a_value_error_naming_it(tmp_path, config, message):
    """What the loaders, the CLI (exit 2, one line) and update_weights (a 400) report for a broken config.json."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("overrides, message", [
    ({"vocab_size": 512.7}, "vocab_size=512.7 must be an integer"),  # (int() truncated it to 512)
    ({"rms_norm_eps": "abc"}, "rms_norm_eps='abc' must be a number"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' must be true or false"),  # (bool("false"))
    ({"num_key_value_heads": 3},  # (ModelConfig's check named num_kv_heads, not the file's field)
     r"num_key_value_heads=3 is invalid: allowed a positive divisor of num_attention_heads=4"),
    ({"num_key_value_heads": 0},  # (read as num_attention_heads; the load then failed on k_proj's shape)
     r"num_key_value_heads=0 is invalid: allowed a positive divisor of num_attention_heads=4 \(or null"),
    ({"num_key_value_heads": -2}, "num_key_value_heads=-2 is invalid"),
    ({"bos_token_id": "1"}, "bos_token_id='1' must be an integer"),  # (loaded)
    ({"bos_token_id": 9999},  # (loaded; then every text prompt failed with an out-of-range token id)
     r"bos_token_id=9999 is invalid: allowed null or an id in \[0, 512\)"),
    ({"rope_scaling": "abc"},  # ("dictionary update sequence element #0 has length 1; 2 is required")
     "rope_scaling='abc' is invalid: allowed null or an object with rope_type"),
    ({"rope_scaling": [1]}, r"rope_scaling=\[1\] is invalid: allowed null or an object"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},  # (was "missing required field 'low_freq_factor'")
     r"rope_scaling of rope_type 'llama3' is missing \['low_freq_factor'"),
])
def test_config_values_are_checked_naming_the_file(tmp_path, tiny_weights, overrides, message):
    _write_hf(tmp_path, tiny_weights, **overrides)
    with pytest.raises(ValueError, match=f"^{tmp_path}/config.json: {message}"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{'not': json}")
    with pytest.raises(ValueError, match=f"^{tmp_path}/config.json: not valid JSON"):
        load_checkpoint(str(tmp_path))


def _header_file(path: Path, header: bytes) -> None:
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))


@pytest.mark.parametrize("header, message", [
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]', "its header is not JSON"),
    (b"\xff\xfe{}", "its header is not JSON"),
    (b"[1, 2]", "its header is a JSON list, not an object"),
    (b'{"a": {"shape": [2], "data_offsets": [0, 8]}}', "tensor a's header entry is corrupt"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}', "tensor a's header entry is corrupt"),
    (b'{"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}', "tensor a's header entry is corrupt"),
    # two tensors over the same bytes loaded as one another's (a model silently wrong); a gap likewise
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], '
     b'"data_offsets": [0, 8]}}', r"tensor b's data_offsets \[0, 8\] overlaps the tensor before it"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}',
     r"tensor a's data_offsets \[8, 16\] leaves the bytes 0..8 unused"),
])
def test_a_corrupt_safetensors_header_names_the_file(tmp_path, header, message):
    """These were a JSONDecodeError, UnicodeDecodeError, TypeError, KeyError or numpy's error, naming no file."""
    from nightjar_jax.models.hf import read_safetensors

    _header_file(tmp_path / "model.safetensors", header)
    with pytest.raises(ValueError, match=f"^{tmp_path}/model.safetensors: .*{message}"):
        read_safetensors(tmp_path / "model.safetensors")


def test_a_corrupt_index_or_tokenizer_names_the_file(tmp_path, tiny_weights):
    _write_hf(tmp_path, tiny_weights)
    index = tmp_path / "model.safetensors.index.json"
    for text, message in (("{oops", "not valid JSON"), ('{"weight_map": ["model.safetensors"]}',
                                                        "not a safetensors index")):
        index.write_text(text)
        with pytest.raises(ValueError, match=f"^{index}: {message}"):
            load_checkpoint(str(tmp_path))
    from nightjar_jax.models.tokenizer import Tokenizer

    (tmp_path / "tokenizer.json").write_text('{1: "no"}')
    with pytest.raises(ValueError, match=f"^{tmp_path}/tokenizer.json: not a tokenizer this engine can read"):
        Tokenizer.from_pretrained(tmp_path)


def test_write_safetensors_bfloat16_round_trip(tmp_path):
    """Its docstring promised bfloat16; the write failed ("cannot include dtype 'E' in a buffer")."""
    import ml_dtypes

    from nightjar_jax.models.hf import read_safetensors

    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
              "s": np.array(1.5, dtype=ml_dtypes.bfloat16)}
    write_safetensors(tmp_path / "x.safetensors", arrays)
    back = read_safetensors(tmp_path / "x.safetensors")
    for name, arr in arrays.items():
        assert back[name].dtype == arr.dtype and back[name].shape == arr.shape
        np.testing.assert_array_equal(back[name].astype(np.float32), arr.astype(np.float32))


def test_weights_must_be_finite_floats(tmp_path, tiny_weights):
    """Integer or bool weights were cast to floats, and a NaN loaded in every format: through LLM() the model then
    generated token 0 on every step, without a word."""
    from nightjar_jax.config import make_engine_config
    from nightjar_jax.engine.engine import LLMEngine

    ints = {**tiny_weights, "model.norm.weight": np.ones(TINY.hidden_size, np.int32)}
    _write_hf(tmp_path / "ints", ints)
    with pytest.raises(ValueError, match="tensor model.norm.weight is int32: weights must be floating-point"):
        load_model(str(tmp_path / "ints"))
    down = np.array(tiny_weights["model.layers.1.mlp.down_proj.weight"])
    down[3, 5] = np.nan
    _write_hf(tmp_path / "nan", {**tiny_weights, "model.layers.1.mlp.down_proj.weight": down})
    with pytest.raises(ValueError, match=r"/nan: the weights hold NaN or infinite values \(in layers.*down_proj"):
        LLMEngine(make_engine_config(model=str(tmp_path / "nan"), tokenizer=str(STORIES / "tokenizer.json"),
                                     draft_model="none", num_pages=8, compilation_cache_dir=None))


def test_a_null_tie_word_embeddings_reads_as_untied(tmp_path, tiny_weights):
    _write_hf(tmp_path, tiny_weights, tie_word_embeddings=None)
    assert load_checkpoint(str(tmp_path)).config.tie_word_embeddings is False


# ---- corrupt GGUF metadata and tensors: a ValueError naming the file and the key or tensor -------------------------


@pytest.mark.parametrize("meta, message", [
    ({"llama.attention.head_count_kv": 3},  # (ModelConfig's check, named after neither file nor key)
     "GGUF key llama.attention.head_count_kv: num_kv_heads=3 is invalid: allowed a divisor of num_heads=8"),
    ({"llama.embedding_length": 0}, "GGUF key llama.embedding_length: hidden_size=0 is invalid"),
    ({"llama.attention.key_length": "abc"},  # (int("abc"))
     "GGUF key llama.attention.key_length='abc' is invalid: allowed an integer"),
    ({"tokenizer.ggml.bos_token_id": 9999},  # (loaded; then every prompt failed "token ids must be in [0, 512)")
     r"GGUF key tokenizer.ggml.bos_token_id=9999 is outside the vocabulary: allowed an id in \[0, 512\)"),
    ({"tokenizer.ggml.eos_token_id": 9999},
     r"GGUF key tokenizer.ggml.eos_token_id=9999 is outside the vocabulary: allowed an id in \[0, 512\)"),
    ({"tokenizer.ggml.eot_token_id": 512},
     r"GGUF key tokenizer.ggml.eot_token_id=512 is outside the vocabulary: allowed an id in \[0, 512\)"),
    ({"tokenizer.ggml.token_type": [1] * 100},  # (IndexError)
     r"GGUF key tokenizer.ggml.token_type has 100 entries: allowed one per token of tokenizer.ggml.tokens \(512\)"),
    ({"tokenizer.ggml.scores": [0.0] * 100},  # (IndexError)
     r"GGUF key tokenizer.ggml.scores has 100 entries: allowed one per token of tokenizer.ggml.tokens \(512\)"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["abc", "a b"]},  # (TypeError from tokenizers)
     r"GGUF key tokenizer.ggml.merges\[0\]='abc' is invalid: allowed two tokens separated by a space"),
    ({"tokenizer.ggml.model": "gpt2"},  # (loaded: every word came out as single characters, raw ▁ pieces)
     "GGUF key tokenizer.ggml.merges is missing or empty: a gpt2 \\(byte-level BPE\\) vocabulary needs its merges"),
])
def test_corrupt_gguf_metadata_names_the_file_and_key(tmp_path, meta, message):
    path = tmp_path / "bad.gguf"
    _write_stories_gguf(path, meta)
    with pytest.raises(ValueError, match=f"^{path}: {message}"):
        load_checkpoint(str(path))


@pytest.mark.parametrize("cut", [
    lambda data: data[:500],  # (numpy's "When changing to a larger dtype, its size must be a divisor ...")
    lambda data: data[:8] + (1000).to_bytes(8, "little") + data[16:],  # tensor count past the table (IndexError)
    lambda data: data[:16] + (17).to_bytes(8, "little") + data[24:],  # metadata key count one too many
], ids=["cut-at-500-bytes", "1000-tensors", "17-metadata-keys"])
def test_a_truncated_or_corrupt_gguf_says_so(tmp_path, cut):
    path = tmp_path / "cut.gguf"
    _write_stories_gguf(path)
    path.write_bytes(cut(path.read_bytes()))
    with pytest.raises(ValueError, match=rf"^{path}: truncated or corrupt GGUF header / tensor table \(\w+: .*\): "
                                         "download or convert the file again$"):
        load_checkpoint(str(path))


def test_gguf_tensor_gguf_cannot_dequantize_names_the_file_and_tensor(tmp_path):
    path = tmp_path / "int.gguf"
    _write_stories_gguf(path, int_tensor="blk.1.attn_v.weight")  # (was a NotImplementedError naming neither)
    with pytest.raises(ValueError, match=f"^{path}: tensor 'blk.1.attn_v.weight' has GGML type I32, which the "
                                         "installed gguf package cannot dequantize: allowed F32, F16, .*Q4_1"):
        load_checkpoint(str(path))


@pytest.mark.parametrize("tensor, shape", [("blk.0.attn_q.weight", (60, 64)), ("blk.1.attn_k.weight", (30, 64)),
                                           ("blk.0.attn_q.weight", (2, 32, 64))])
def test_a_misshapen_q_or_k_in_a_gguf_names_the_file_and_tensor(tmp_path, tensor, shape):
    """q and k rows are reordered per head before the shape check: a misshapen one failed in numpy ("cannot reshape
    array of size 3840 into shape (8,3,2,64)", "too many values to unpack"), naming neither the file nor the tensor."""
    path = tmp_path / "bad.gguf"
    _write_stories_gguf(path, replace={tensor: np.zeros(shape, np.float32)})
    with pytest.raises(ValueError, match=re.escape(f"{path}: tensor {tensor!r} has shape {list(shape)}, expected [")):
        load_checkpoint(str(path))


# ---- corrupt orbax checkpoints ----------------------------------------------------------------------------------


def _orbax_meta(**config_changes) -> dict:
    config = {**TINY.to_dict(), **config_changes}
    return {"format": "nightjar-orbax", "version": 1, "config": {k: v for k, v in config.items() if v != "drop"}}


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("", "not valid JSON"),
    ("[1, 2]", r"must be a JSON object \{format, version, config\}, got list"),  # (AttributeError)
    ({"format": "nightjar-orbax", "version": 1}, "'config' must be a JSON object of ModelConfig fields, got nothing"),
    ({"format": "nightjar-orbax", "version": 1, "config": None}, "'config' must be a JSON object .*, got null"),
    (_orbax_meta(foo=1), r"unknown config field\(s\) \['foo'\]: allowed \['vocab_size', 'hidden_size'"),  # TypeError
    (_orbax_meta(hidden_size="drop"), r"config is missing the required field\(s\) \['hidden_size'\]"),
    (_orbax_meta(rope_scaling={"type": "yarn"}),  # (TypeError from RopeScaling)
     r"config.rope_scaling=\{'type': 'yarn'\} is invalid: allowed null or an object with the keys \['factor'"),
    (_orbax_meta(hidden_size="64"), "config.hidden_size='64' is invalid"),
    (_orbax_meta(rope_scaling={"factor": 0.5}), "config.rope_scaling.factor=0.5 is invalid"),
    (_orbax_meta(eos_token_ids=[9999]), r"config.eos_token_ids\[\]=9999 is invalid"),
    (_orbax_meta(bos_token_id=9999),  # (loaded; then every prompt failed "token ids must be in [0, 512)")
     r"config.bos_token_id=9999 is invalid: allowed an integer in \[0, 511\]"),
])
def test_a_corrupt_orbax_config_is_a_value_error_naming_it(tmp_path, content, message):
    folder = tmp_path / "ck"
    folder.mkdir()
    meta_path = folder / "nightjar_config.json"
    meta_path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=f"^{meta_path}: {message}"):
        load_checkpoint(str(folder))


def test_a_corrupt_orbax_params_metadata_names_the_folder(tmp_path, tiny_weights):
    out = save_orbax(tmp_path / "ck", TINY, tiny_weights)
    (out / "params" / "_METADATA").write_text("garbage")  # (a bare JSONDecodeError naming no file)
    with pytest.raises(ValueError, match=f"^{out / 'params'}: not a readable orbax checkpoint"):
        load_checkpoint(str(out))


def _cut_orbax_data(params: Path) -> None:
    for data_file in (params / "ocdbt.process_0" / "d").iterdir():
        data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])


@pytest.mark.parametrize("damage, cause", [
    (lambda params: (shutil.rmtree(params), params.mkdir()), "No structure could be identified for the checkpoint."),
    (lambda params: (shutil.rmtree(params), params.write_text("x")), "Found incomplete checkpoint."),
    (lambda params: (params / "manifest.ocdbt").unlink(),  # (with tensorstore's JSON spec, hundreds of characters)
     'NOT_FOUND: Error opening "zarr" driver: Metadata at "[^"]+" does not exist'),
    (_cut_orbax_data, r'OUT_OF_RANGE: Error reading "[^"]+": Requested byte range'),
], ids=["empty", "a-file", "no-manifest", "data-cut"])
def test_an_unreadable_orbax_params_folder_is_one_line(tmp_path, tiny_weights, damage, cause):
    """Each was orbax's or tensorstore's own text, naming no checkpoint or (a missing manifest) a JSON spec."""
    out = save_orbax(tmp_path / "ck", TINY, tiny_weights)
    damage(out / "params")
    with pytest.raises(ValueError) as info:
        load_checkpoint(str(out))
    assert "\n" not in str(info.value) and "tensorstore_spec" not in str(info.value)
    assert re.match(rf"^{out / 'params'}: not a readable orbax checkpoint \({cause}.*\): it is incomplete or "
                    r"damaged; write it again with save_orbax \(or copy it whole\)$", str(info.value)), str(info.value)


def test_a_failed_orbax_restore_prints_nothing_after_it(tmp_path, tiny_weights, monkeypatch):
    """orbax closed its event loop as soon as one read failed; the reads still in flight then ended on tensorstore's
    threads, each in a "RuntimeError: Event loop is closed" that Python reports as unraisable (a bare traceback on
    stderr, after serve's one-line error)."""
    import sys
    import time

    out = save_orbax(tmp_path / "ck", TINY, tiny_weights)
    _cut_orbax_data(out / "params")
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda report: unraisable.append(repr(report.exc_value)))
    for _ in range(3):
        with pytest.raises(ValueError, match="not a readable orbax checkpoint"):
            load_checkpoint(str(out))
    time.sleep(0.5)  # (time for the reads to end)
    assert unraisable == []


def test_save_orbax_tokenizer_is_what_load_finds(tmp_path, tiny_weights):
    from nightjar_jax.models.tokenizer import Tokenizer

    out = tmp_path / "ck"
    save_orbax(out, TINY, tiny_weights, tokenizer_dir=STORIES / "tok512.model")  # (was copied as tok512.model)
    tok = load_checkpoint(str(out)).tokenizer
    assert tok is not None and tok.source == str(out / "tokenizer" / "tokenizer.model")
    text = "Once upon a time"
    assert tok.encode(text) == Tokenizer.from_pretrained(STORIES / "tok512.model").encode(text)
    # saved again into the same folder from its own tokenizer folder, then with none: no stale tokenizer left
    save_orbax(out, TINY, tiny_weights, tokenizer_dir=out / "tokenizer")
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == ["tokenizer.model"]
    save_orbax(out, TINY, tiny_weights)
    assert not (out / "tokenizer").exists() and load_checkpoint(str(out)).tokenizer is None
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match="vocab.txt: unknown tokenizer file type"):
        save_orbax(out, TINY, tiny_weights, tokenizer_dir=tmp_path / "vocab.txt")


def test_llama2c_sibling_tokenizer_is_unambiguous(tmp_path):
    import shutil

    model = tmp_path / "m.bin"
    shutil.copy(STORIES / "stories260K.bin", model)
    (tmp_path / "a.model").write_bytes(b"junk")
    shutil.copy(STORIES / "tok512.model", tmp_path / "z.model")
    # (was: the first by name, a.model, and sentencepiece's RuntimeError)
    with pytest.raises(ValueError, match=rf"^{model}: several SentencePiece tokenizers beside it \(a.model, z.model\)"):
        load_checkpoint(str(model))
    assert load_checkpoint(str(model), tokenizer=str(tmp_path / "z.model")).tokenizer is not None
    (tmp_path / "z.model").rename(tmp_path / "tokenizer.model")
    assert load_checkpoint(str(model)).tokenizer.source == str(tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer.model").unlink()
    with pytest.raises(ValueError, match=f"^{tmp_path / 'a.model'}: not a readable SentencePiece model"):
        load_checkpoint(str(model))


def test_restores_in_several_threads_share_one_event_loop_policy_swap():
    """The draining policy (``orbax_io._draining_event_loops``) goes in with the first restore under way and out with
    the last: two overlapping restores (A in, B in, A out, B out) used to leave A's draining policy in for good. While
    one runs, another thread's own loop is still its own, and new loops drain."""
    import asyncio
    import threading

    from nightjar_jax.models.orbax_io import _draining_event_loops, _DrainingEventLoop

    before = asyncio.get_event_loop_policy()
    mine = asyncio.new_event_loop()
    asyncio.set_event_loop(mine)
    a_in, b_in, a_out, checked = (threading.Event() for _ in range(4))
    seen = {}

    def restore_a():
        with _draining_event_loops():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def restore_b():
        a_in.wait(10)
        with _draining_event_loops():
            b_in.set()
            a_out.wait(10)
            fresh = asyncio.new_event_loop()
            seen["fresh"] = type(fresh)
            fresh.close()
            checked.wait(10)

    try:
        threads = [threading.Thread(target=restore_a), threading.Thread(target=restore_b)]
        for t in threads:
            t.start()
        a_out.wait(10)  # (A is out, B still in: the swap stays)
        seen["main loop"] = asyncio.get_event_loop()
        seen["during"] = asyncio.get_event_loop_policy() is not before
        checked.set()
        for t in threads:
            t.join(20)
        assert seen["during"] and asyncio.get_event_loop_policy() is before
        assert seen["fresh"] is _DrainingEventLoop
        assert seen["main loop"] is mine and asyncio.get_event_loop() is mine  # (this thread's own loop throughout)
    finally:
        asyncio.set_event_loop(None)
        mine.close()


def test_an_asyncio_subprocess_starts_while_a_restore_runs():
    """Another thread's asyncio subprocess during a restore (the server's loop while /update_weights_from_disk loads
    an orbax checkpoint): the draining policy hands the child-watcher calls to the policy it wraps (its abstract
    base raised NotImplementedError on Python 3.11-3.13)."""
    import asyncio
    import sys
    import threading

    from nightjar_jax.models.orbax_io import _draining_event_loops

    async def run_true():
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        return await proc.wait()

    result = {}

    def other_thread():
        try:
            result["rc"] = asyncio.run(run_true())
        except Exception as exc:  # noqa: BLE001 (reported below)
            result["error"] = repr(exc)

    with _draining_event_loops():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(60)
    assert result == {"rc": 0}, result


def test_model_config_takes_hf_forms_and_checks_its_ids():
    """ModelConfig built directly (library use): one EOS id as a plain int (HF's config.json form) was "'int' object
    is not iterable", an HF rope_scaling dict with its "rope_type" an unexpected keyword; a BOS id outside the
    vocabulary, a string tie_word_embeddings and an infinite rope_theta were taken."""
    base = dict(vocab_size=32, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1)
    assert ModelConfig(**base, eos_token_ids=5).eos_token_ids == (5,)
    scaling = ModelConfig(**base, rope_scaling={"rope_type": "llama3", "factor": 8.0}).rope_scaling
    assert scaling.factor == 8.0 and scaling.original_max_position_embeddings == 8192
    for bad, message in [(dict(bos_token_id=99), r"bos_token_id=99 is invalid: allowed an integer in \[0, 31\]"),
                         (dict(bos_token_id=-1), "bos_token_id=-1 is invalid"),
                         (dict(tie_word_embeddings="yes"), "tie_word_embeddings='yes' is invalid: allowed True or"),
                         (dict(rope_theta=float("inf")), "rope_theta=inf is invalid: allowed a finite positive"),
                         (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_type 'llama3'"),
                         (dict(rope_scaling={"factor": 2.0, "beta": 1}), "rope_scaling=.* is invalid")]:
        with pytest.raises(ValueError, match=message):
            ModelConfig(**base, **bad)


def test_save_orbax_keeps_a_chat_template_file(tmp_path, tiny_weights):
    """A tokenizer folder whose chat template is transformers' chat_template.jinja (recent transformers writes it
    beside tokenizer_config.json) lost it in save_orbax: only tokenizer* / special* files were copied, and the
    checkpoint's chat came back without a template."""
    import json
    import shutil

    from nightjar_jax.models.tokenizer import Tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(STORIES / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    template = Tokenizer.from_pretrained(folder).chat_template
    assert template == "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    out = save_orbax(tmp_path / "ck", TINY, tiny_weights, tokenizer_dir=folder)
    assert load_checkpoint(str(out)).tokenizer.chat_template == template
