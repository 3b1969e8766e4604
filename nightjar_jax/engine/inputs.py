"""vLLM's prompt types (``vllm.inputs``): the dicts ``LLM.generate`` and ``LLMEngine.add_request`` take as a prompt,
beside a string or a list of token ids. Typing only: any dict with these keys works."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the model's tokenizer."""

    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache pages shared only with prompts of the same salt


class TokensPrompt(TypedDict):
    """A prompt as token ids (``prompt``: its text, when known, for outputs and echo)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]
