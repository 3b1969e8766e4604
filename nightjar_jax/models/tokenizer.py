"""Tokenizers: one wrapper over HF ``tokenizers`` / ``transformers`` backends, plus streaming detokenization.

Vocabulary
- BOS handling: ``encode(text, add_special_tokens=True)`` prepends BOS when the tokenizer wants it (``add_bos``).
  A bare ``tokenizer.json`` without a post-processor (stories260K) gets BOS prepended by this wrapper; folders with
  ``tokenizer_config.json`` follow transformers' own post-processor.
- chat template: a jinja2 template over ``messages`` (``[{"role", "content"}]``), rendered the way transformers
  does it (sandboxed, ``trim_blocks``/``lstrip_blocks``).
- incremental detokenization: text for a growing list of ids, emitting only complete characters (a UTF-8
  character split across byte-fallback or byte-level tokens is held back until its last byte arrives).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

logger = logging.getLogger(__name__)

# SmolLM2-Instruct's template (ChatML with its default system prompt), used when a tokenizer carries ChatML tokens
# and SmolLM's special-token set but no template of its own (the GGUF tokenizer.json built from metadata). With
# ``tools`` (OpenAI function definitions) the system turn lists them and asks for calls in the form SmolLM2 was
# tuned on, a JSON list between <tool_call> tags (what tool_choice "auto"'s hermes parser reads); an assistant turn's
# ``tool_calls`` render in that form and tool results as a user turn in <tool_response> tags. Without tools (and
# tool turns) it renders exactly as SmolLM2's own template.
_SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
_SMOLLM2_TOOLS = (
    "\n\nYou can call the functions defined here:\n<tools>' + (tools | map(attribute='function') | list | tojson) + "
    "'</tools>\nTo call functions, reply with only a JSON list of the calls between tool_call tags, in this form:\n"
    "<tool_call>[{\"name\": \"function_name\", \"arguments\": {\"argument\": \"value\"}}]</tool_call>\n"
    "If no function fits the question, say so."
)
_SMOLLM2_TURN = (
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' }}{% if message['content'] %}{{ message['content'] + '\n' }}{% endif %}"
    "{{ '<tool_call>[' }}{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{{ '{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' + (fn['arguments'] if fn['arguments'] is string "
    "else (fn['arguments'] or {}) | tojson) + '}' }}{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}"
    "{{ ']</tool_call><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
)
SMOLLM2_CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' + (messages[0]['content'] if messages[0]['role'] == 'system' else "
    f"'{_SMOLLM2_SYSTEM}') + '{_SMOLLM2_TOOLS}<|im_end|>\n' }}}}"
    "{% for message in messages %}{% if not (loop.first and message['role'] == 'system') %}"
    f"{_SMOLLM2_TURN}"
    "{% endif %}{% endfor %}"
    "{% else %}"
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    f"{{{{ '<|im_start|>system\n{_SMOLLM2_SYSTEM}<|im_end|>\n' }}}}"
    "{% endif %}"
    f"{_SMOLLM2_TURN}"
    "{% endfor %}"
    "{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# SmolLM2-Instruct's own template (its tokenizer_config.json's, and its GGUF's): no tools, and an assistant turn
# without content (a tool call) fails on None. SMOLLM2_CHAT_TEMPLATE renders every conversation without tool calls
# or tool results the same, and those in SmolLM2's form (a tool result as a user turn in <tool_response> tags, where
# this one wrote a "tool" turn), so a checkpoint shipping this one is served with that one.
SMOLLM2_SHIPPED_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def model_chat_template(shipped: str | dict | None, vocab: dict[str, int]) -> str | dict | None:
    """The template a tokenizer serves: the one it ships (SmolLM2's own as :data:`SMOLLM2_CHAT_TEMPLATE`, which adds
    tools), or one inferred from its special tokens when it ships none; named templates (transformers' form of a
    ``tokenizer_config.json`` list of ``{"name", "template"}``) as the mapping, each name's template."""
    if isinstance(shipped, dict):
        return {name: model_chat_template(t, vocab) if isinstance(t, str) else t for name, t in shipped.items()}
    if shipped == SMOLLM2_SHIPPED_TEMPLATE:
        return SMOLLM2_CHAT_TEMPLATE
    return shipped or default_chat_template(vocab)


CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's --chat-template-content-format
# a for-loop over a message's content (`{% for part in message['content'] %}`, `... in m.content %}`): such a
# template renders parts, and a string's characters give it nothing
_CONTENT_LOOP = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+\s*(?:\.\s*content\b|\[\s*['\"]content['\"]\s*\])"
                           r"\s*(?:-?%\}|\||if\b)")  # (the content itself: `... .split('\n') %}` loops over a string)


def chat_content_format(template: str, requested: str = "auto") -> str:
    """How a template takes each message's content (vLLM's ``--chat-template-content-format``): "string" (one
    string; text parts joined by newlines) or "openai" (a list of ``{"type": "text", "text": ...}`` parts; a
    string is one part). "auto": "openai" for a template that loops over a message's content (given a string it
    rendered none of the text, and the user's message was lost), else "string"."""
    if requested not in CONTENT_FORMATS:
        raise ChatTemplateArgumentError(f"chat template content format {requested!r} is invalid: allowed "
                                        f"{', '.join(CONTENT_FORMATS)}", "chat_template_content_format")
    if requested != "auto":
        return requested
    return "openai" if _CONTENT_LOOP.search(template) else "string"


def _content_as(fmt: str, content: Any) -> Any:
    """A message's content (a string, a list of text parts, or None) in format ``fmt``; anything else as it is."""
    if content is None:
        texts = []
    elif isinstance(content, str):
        texts = [content]
    elif isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        texts = [p["text"] for p in content]
    else:
        return content
    return "\n".join(texts) if fmt == "string" else [{"type": "text", "text": t} for t in texts]


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as templates take it (vLLM's convention, and transformers' tool templates'): an assistant's
    tool-call ``arguments`` a JSON object, not the API's JSON string (``{}`` for none; a string that is no JSON object
    stays as written)."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    return {**message, "tool_calls": [_template_call(call) for call in calls]}


def _template_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if not arguments:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            decoded = None
        arguments = decoded if isinstance(decoded, dict) else arguments
    return {**call, "function": {**function, "arguments": arguments}}


def default_chat_template(vocab: dict[str, int]) -> str | None:
    """A template inferred from the special tokens, for tokenizers that ship none (None: no chat support)."""
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        smollm = "<repo_name>" in vocab and "<empty_output>" in vocab  # SmolLM's StarCoder-derived special tokens
        return SMOLLM2_CHAT_TEMPLATE if smollm else CHATML_CHAT_TEMPLATE
    return None


class BatchEncoding(dict):
    """transformers' ``BatchEncoding`` as ``tokenizer(text)`` returns it: a dict whose keys read as attributes too
    (``enc["input_ids"]``, ``enc.input_ids``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """Text <-> ids for one model.

    Backed by either a ``tokenizers.Tokenizer`` (``backend``) or a transformers tokenizer (``hf_tokenizer``).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer | _SentencePieceBackend | None = None,
        *,
        hf_tokenizer: Any = None,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos: bool = False,
        chat_template: str | dict[str, str] | None = None,
        source: str = "tokenizer",
        named_ids: dict[str, int] | None = None,
    ):
        if (backend is None) == (hf_tokenizer is None):
            raise ValueError("Tokenizer needs exactly one of backend (tokenizers.Tokenizer) or hf_tokenizer")
        self.backend = backend
        self.hf_tokenizer = hf_tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.add_bos = add_bos
        self.source = source
        # named templates (transformers' dict): "default" serves, "tool_use" where a request gives tools (as
        # transformers picks them), and a chat_template argument may name one
        self.named_chat_templates: dict[str, str] = {}
        if isinstance(chat_template, dict):
            bad = [name for name, t in chat_template.items() if not isinstance(name, str) or not isinstance(t, str)]
            if bad or not chat_template:
                raise ValueError(f"{source}: its named chat templates must map names to template texts, got "
                                 f"{_short(chat_template)}")
            self.named_chat_templates = dict(chat_template)
            chat_template = chat_template.get("default")
        elif chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"{source}: its chat template must be a template's text (or a list of named ones), got "
                             f"{_short(chat_template)}")
        self.chat_template = chat_template
        # more named special tokens a bare vocabulary's metadata gives (a GGUF's padding and unknown ids):
        # {"pad_token": 2, "unk_token": 0}
        self.named_ids = dict(named_ids or {})
        self._token_texts: dict[int, str] = {}  # token_text's cache
        self._text_anchor: tuple | None = None  # token_text's anchor: (id, its text), or () when "a" encodes to nothing
        self._decode_vocab: int | None = None  # decode's vocabulary size, read once

    # ---- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_file: str | Path) -> Tokenizer:
        """Load from a folder (``tokenizer_config.json`` + ``tokenizer.json`` or ``tokenizer.model``), a bare
        ``tokenizer.json`` or a SentencePiece ``.model`` file. A file the tokenizer libraries cannot read is a
        ``ValueError`` naming it (their own errors name no file)."""
        path = Path(path_or_file)
        try:
            return cls._from_path(path)
        except FileNotFoundError:
            raise
        except Exception as exc:
            if isinstance(exc, ValueError) and str(path) in str(exc):  # (ours: names the file already)
                raise
            where = path  # (in a folder without tokenizer_config.json, the file read)
            if path.is_dir() and not (path / "tokenizer_config.json").exists():
                where = next((path / f for f in ("tokenizer.json", "tokenizer.model") if (path / f).exists()), path)
            raise ValueError(f"{where}: not a tokenizer this engine can read ({type(exc).__name__}: "
                             f"{str(exc)[:200]})") from exc

    @classmethod
    def _from_path(cls, path: Path) -> Tokenizer:
        if path.is_dir():
            if (path / "tokenizer_config.json").exists():
                return cls._from_transformers(path)
            if (path / "tokenizer.json").exists():
                return cls.from_tokenizer_json(path / "tokenizer.json")
            if (path / "tokenizer.model").exists():
                return cls.from_sentencepiece(path / "tokenizer.model")
            raise FileNotFoundError(f"{path}: no tokenizer.json, tokenizer_config.json or tokenizer.model in folder")
        if not path.exists():
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        if path.suffix == ".json":
            return cls.from_tokenizer_json(path)
        if path.suffix == ".model":
            return cls.from_sentencepiece(path)
        raise ValueError(f"{path}: unknown tokenizer file type (expected a folder, tokenizer.json or a .model file)")

    @classmethod
    def from_tokenizer_json(cls, path: str | Path, **overrides: Any) -> Tokenizer:
        """A bare ``tokenizers`` file. Without a post-processor, an SPM-style ``<s>`` BOS is prepended by us."""
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path))
        raw = json.loads(path.read_text(encoding="utf-8"))
        kwargs = _special_defaults(backend, has_post_processor=raw.get("post_processor") is not None)
        kwargs.update(overrides)
        return cls(backend, source=str(path), **kwargs)

    @classmethod
    def from_sentencepiece(cls, path: str | Path) -> Tokenizer:
        """A SentencePiece ``.model`` (Llama 2 style: BOS prepended, no chat template). A file sentencepiece cannot
        parse is a ``ValueError`` naming it (sentencepiece raises a ``RuntimeError``)."""
        try:
            backend = _SentencePieceBackend(str(path))
        except RuntimeError as exc:
            raise ValueError(f"{path}: not a readable SentencePiece model ({str(exc)[:200]})") from None
        sp = backend.sp
        bos = sp.bos_id() if sp.bos_id() >= 0 else None
        eos = (sp.eos_id(),) if sp.eos_id() >= 0 else ()
        return cls(backend, bos_token_id=bos, eos_token_ids=eos, add_bos=bos is not None, source=str(path))

    @classmethod
    def _from_transformers(cls, folder: Path) -> Tokenizer:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return cls._wrap_transformers(hf, str(folder), add_bos=False)

    @classmethod
    def _wrap_transformers(cls, hf: Any, source: str, add_bos: bool) -> Tokenizer:
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        template = model_chat_template(getattr(hf, "chat_template", None), hf.get_vocab())
        # transformers adds BOS itself (post-processor / add_bos_token) when add_special_tokens=True
        return cls(
            hf_tokenizer=hf, bos_token_id=hf.bos_token_id, eos_token_ids=eos_ids, add_bos=add_bos,
            chat_template=template, source=source,
        )

    # ---- properties ---------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        if self.backend is not None:
            return self.backend.get_vocab_size(with_added_tokens=True)
        return len(self.hf_tokenizer)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True) if self.backend else self.hf_tokenizer.get_vocab()

    def token_to_id(self, token: str) -> int | None:
        return self.get_vocab().get(token)

    # ---- the Hugging Face names vLLM users call on get_tokenizer() ------------------------------------------------

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (HF's single id; :attr:`eos_token_ids` holds every one the engine stops on)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._piece(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._piece(self.eos_token_id)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """transformers' ``special_tokens_map``: each named special token this tokenizer has (``bos_token``,
        ``eos_token``, ``unk_token``, ``pad_token``, ...), what a chat template sees under those names. A bare
        ``tokenizer.json`` or ``.model`` knows its BOS, EOS and unknown token (its model's ``unk_token``, the
        SentencePiece unknown piece); a transformers tokenizer, those its configuration names."""
        if self.hf_tokenizer is not None:
            return {name: str(token) for name, token in self.hf_tokenizer.special_tokens_map.items()
                    if isinstance(token, str)}
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        if isinstance(self.backend, _SentencePieceBackend):
            named["unk_token"] = self._piece(self.backend.sp.unk_id()) if self.backend.sp.unk_id() >= 0 else None
        else:
            named["unk_token"] = getattr(self.backend.model, "unk_token", None)
        for name, token_id in self.named_ids.items():  # (a GGUF's metadata: its padding and unknown ids)
            named[name] = self._piece(token_id)
        return {name: token for name, token in named.items() if token}

    @property
    def pad_token_id(self) -> int | None:
        """The padding id a transformers tokenizer or a GGUF's metadata names (None for a bare ``tokenizer.json`` or
        ``.model``: they name none; the engine never pads)."""
        if self.hf_tokenizer is not None:
            return self.hf_tokenizer.pad_token_id
        return self.named_ids.get("pad_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens_map.get("unk_token")

    @property
    def unk_token_id(self) -> int | None:
        return None if self.unk_token is None else self.get_vocab().get(self.unk_token)

    @property
    def all_special_tokens(self) -> list[str]:
        """transformers': the named special tokens (:attr:`special_tokens_map`), each once."""
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        """transformers': the ids of :attr:`all_special_tokens`."""
        vocab = self.get_vocab()
        return [vocab[t] for t in self.all_special_tokens if t in vocab]

    @property
    def name_or_path(self) -> str:
        """Where the tokenizer came from (transformers' name)."""
        return self.source

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Ids of vocabulary strings (``▁the``), as HF's; a string not in the vocabulary is the unknown token's id
        (None when there is none)."""
        vocab = self.get_vocab()
        unk = vocab.get(self.special_tokens_map.get("unk_token", ""))
        if isinstance(tokens, str):
            return vocab.get(tokens, unk)
        return [vocab.get(t, unk) for t in tokens]

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> BatchEncoding:
        """transformers' ``tokenizer(text)``: ``input_ids`` and ``attention_mask`` (all ones: nothing is padded) of
        a text, or lists of them for a list of texts; read as a dict or as attributes."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids))
        if not isinstance(text, (list, tuple)) or not all(isinstance(t, str) for t in text):
            raise TypeError(f"tokenizer(text) takes a string or a list of strings, got {type(text).__name__}")
        ids_list = [self.encode(t, add_special_tokens) for t in text]
        return BatchEncoding(input_ids=ids_list, attention_mask=[[1] * len(ids) for ids in ids_list])

    def __len__(self) -> int:
        return self.vocab_size

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        """Vocabulary strings of ids (``▁the``, ``<0xE2>``), as HF's."""
        return self._piece(ids) if isinstance(ids, int) else [self._piece(i) for i in ids]

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    # ---- encode / decode ----------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for ``text``; with ``add_special_tokens`` BOS is prepended when the model wants it."""
        if self.hf_tokenizer is not None:
            ids = list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))
            bos = self.bos_token_id
            if add_special_tokens and bos is not None and ids[:2] == [bos, bos] and not text.startswith(
                    2 * (self.hf_tokenizer.bos_token or "\0")):
                ids = ids[1:]  # text that starts with BOS (a chat template's {{ bos_token }}): BOS once, as below
            return ids
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``. Ids past the tokenizer's vocabulary (a model's padded rows) decode to nothing, in every
        backend (the Rust tokenizers drop them, SentencePiece raised); a negative id is a ``ValueError``."""
        ids = [int(i) for i in ids]
        vocab = self._decode_vocab
        if vocab is None:  # (once: a slow transformers tokenizer's len() builds its whole vocabulary)
            vocab = self._decode_vocab = self.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            if min(ids) < 0:
                raise ValueError(f"token id {min(ids)} is negative: token ids are 0 .. {vocab - 1} for this tokenizer")
            ids = [i for i in ids if i < vocab]
        if self.hf_tokenizer is not None:
            return self.hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as it reads inside a text (special tokens included): a SentencePiece ``▁there`` is
        " there", where decoding it alone strips the space. Decodes ``[anchor, token_id]`` and drops the anchor's
        text (the anchor: the token of "a"); a token with an incomplete UTF-8 character gives U+FFFD, as in vLLM's
        log-probabilities. Cached per id."""
        text = self._token_texts.get(token_id)
        if text is None:
            anchor = self._text_anchor
            if anchor is None:
                ids = self.encode("a", add_special_tokens=False)
                anchor = self._text_anchor = (ids[-1], self.decode(ids[-1:], False)) if ids else ()
            text = self.decode([token_id], skip_special_tokens=False)
            if anchor:
                both = self.decode([anchor[0], token_id], skip_special_tokens=False)
                if anchor[1] and both.startswith(anchor[1]):
                    text = both[len(anchor[1]):]
            self._token_texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (OpenAI's log-probability ``bytes``, from which a client rebuilds characters
        that several tokens share): its :meth:`token_text` in UTF-8, except for a token holding part of a UTF-8
        character, whose text reads U+FFFD: a byte-fallback piece ``<0xE2>`` is that byte, a byte-level BPE piece
        (GPT-2's alphabet, SmolLM2's) the bytes its characters map to."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self._piece(token_id)
        if piece is not None:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            table = _byte_level_decoder()
            if piece and all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return text.encode("utf-8")

    def _piece(self, token_id: int) -> str | None:
        """A token's vocabulary string (``▁the``, ``<0xE2>``, ``Ġthe``), or None past the vocabulary."""
        if self.backend is not None:
            return self.backend.id_to_token(int(token_id))
        piece = self.hf_tokenizer.convert_ids_to_tokens(int(token_id))
        return piece if isinstance(piece, str) else None

    # ---- chat ---------------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            continue_final_message: bool = False, documents: list[dict] | None = None,
                            template_kwargs: dict[str, Any] | None = None, *, tokenize: bool = False,
                            content_format: str | None = None, **kwargs: Any) -> str | list[int]:
        """Render ``messages`` with the model's chat template, or ``chat_template`` when given (jinja2, sandboxed like
        transformers); ``tools`` (OpenAI's function definitions) and ``documents`` (transformers' RAG documents,
        dicts with "title" and "text") for templates that render them.

        The template sees what transformers' gives it: ``messages``, ``tools``, ``documents``,
        ``add_generation_prompt``, each named special token the tokenizer has (``bos_token``, ``eos_token``,
        ``unk_token``, ``pad_token``, ...), the template kwargs; ``raise_exception``, ``strftime_now``, its
        ``tojson`` (HTML left unescaped), ``{% break %}`` / ``{% continue %}`` and ``{% generation %}`` (rendered as
        written). :func:`compile_chat_template` builds that environment.

        As transformers' (what code written for vLLM's ``get_tokenizer()`` calls): ``tokenize=True`` returns the
        text's ids, encoded without adding special tokens (the template writes them); more keyword arguments are
        template variables, as ``template_kwargs``. Unlike transformers, the text is the default (``tokenize``
        false) and so is ``add_generation_prompt``.

        ``continue_final_message`` (transformers' and vLLM's): the text ends right after the last message's content,
        without its end-of-turn, so the model continues that message (a reply's start "prefilled"); not with
        ``add_generation_prompt``. ``template_kwargs``: more variables for the template (e.g. ``enable_thinking``);
        they may not replace the ones set here.

        ``content_format`` (None: each message's content as given, as transformers'): "string", "openai" or "auto"
        (:func:`chat_content_format`): the server and ``LLM.chat`` render with vLLM's default, "auto"."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateArgumentError("continue_final_message continues the last message, add_generation_prompt "
                                            "starts a new one: set at most one of them", "continue_final_message")
        unsupported = sorted(set(kwargs) & {"return_tensors", "return_dict", "padding", "truncation", "max_length",
                                            "return_assistant_tokens_mask", "tokenizer_kwargs"})
        if unsupported:
            raise ValueError(f"apply_chat_template takes transformers' tokenize=True/False, not {unsupported}: it "
                             f"returns the text or a plain list of ids")
        if kwargs:
            if template_kwargs is not None and not isinstance(template_kwargs, dict):
                raise ChatTemplateArgumentError("template kwargs must be a dict of the template's variables",
                                                "chat_template_kwargs")
            template_kwargs = {**(template_kwargs or {}), **kwargs}
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise ChatTemplateArgumentError(f"template kwargs must be a dict of the template's variables, got "
                                            f"{type(template_kwargs).__name__}", "chat_template_kwargs")
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "raise_exception",
                    "self"}  # (jinja's own name for the template)
        clash = sorted((reserved | ({"documents"} if documents is not None else set())) & set(template_kwargs or {}))
        if clash:
            raise ChatTemplateArgumentError(f"template kwargs may not set {', '.join(clash)}: the chat request's own "
                                            f"fields do", "chat_template_kwargs")
        named = self.named_chat_templates
        if chat_template is not None:  # (a template's text, or one of the tokenizer's named templates)
            template = named.get(chat_template, chat_template)
        elif tools and "tool_use" in named and self.chat_template == named.get("default"):
            template = named["tool_use"]  # (as transformers picks it; a template set since, e.g. the server's, wins)
        else:
            template = self.chat_template
        if not template:
            raise ValueError(f"{self.source}: this tokenizer has no chat template; use a plain-text prompt instead "
                             "or pass a chat_template")
        from jinja2.exceptions import TemplateError

        try:
            compiled = compile_chat_template(template)
        except TemplateError as e:  # (a syntax error: jinja's own type would leave the library's errors)
            if chat_template is not None:  # (the caller's template, not the model's: the server's 400 names it)
                raise ChatTemplateArgumentError(f"the chat template does not parse: {e}", "chat_template") from None
            raise ValueError(f"the chat template does not parse: {e}") from None
        if content_format is not None:
            fmt = chat_content_format(template, content_format)
            messages = [{**m, "content": _content_as(fmt, m["content"])} if isinstance(m, dict) and "content" in m
                        else m for m in messages]
        # transformers' variables: its special_tokens_map (each named special token the tokenizer has), the
        # template kwargs (which may replace those, not bos/eos: reserved above), the conversation, tools, documents
        variables = {**self.special_tokens_map, **(template_kwargs or {}), "tools": tools,
                     "add_generation_prompt": add_generation_prompt, "bos_token": self.bos_token or "",
                     "eos_token": self.eos_token or ""}
        if documents is not None or "documents" not in variables:  # (a template kwarg "documents": as before)
            variables["documents"] = documents

        def render(conversation: list) -> str:
            # (variables as one dict: a template kwarg named like render's own parameters, "self", is a variable)
            try:
                return compiled.render({**variables, "messages": conversation})
            except TemplateError as e:  # (raise_exception, an undefined variable's attribute, ...)
                raise ValueError(f"the chat template could not render these messages: {e}") from None
            except RecursionError:  # (a macro that calls itself: it escaped as a bare RecursionError)
                raise ValueError("the chat template could not render these messages: it recursed without end (a "
                                 "macro or include that calls itself)") from None
            except (TypeError, ValueError, ArithmeticError, AttributeError, LookupError) as e:  # (Python's own:
                # {{ 1 + 'a' }}, {{ '{:d}'.format('x') }})
                raise ValueError(f"the chat template could not render these messages: {type(e).__name__}: {e}") \
                    from None

        if continue_final_message:
            text = _render_to_final_message(render, list(messages))
        else:
            text = render(list(messages))
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, " \
               f"eos={self.eos_token_ids}, add_bos={self.add_bos})"


class ChatTemplateArgumentError(ValueError):
    """A chat-template argument that cannot work; ``field`` names it (the server's 400 names it as its ``param``)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def load_chat_template(spec: str, where: str = "--chat-template") -> str:
    """``--chat-template`` (``where``: the option's name; ``LLM.chat``'s ``chat_template`` too): a file's text, or
    the template itself. As in vLLM, a value without jinja's characters (``{``, ``}``, a newline) that is no readable
    file is a path that does not exist: a ``ValueError``, not a template that renders its own name."""
    path = Path(spec)
    try:
        text = path.read_text() if len(spec) < 4096 and path.is_file() else None
    except UnicodeDecodeError:
        raise ValueError(f"{where} {spec}: the file is not UTF-8 text (a jinja chat template)") from None
    except OSError:
        text = None
    if text is not None:
        return check_template_syntax(text, f"{where} {spec}")
    if not any(c in spec for c in "{}\n"):
        raise ValueError(f"{where} {spec!r} looks like a path, but no such file can be read (give a readable file, "
                         "or the template itself)")
    return check_template_syntax(spec, where)


def check_template_syntax(text: str, where: str) -> str:
    """``text`` when it parses as a Jinja template (the chat template's syntax: one that does not fails every chat
    request with a 400 while completions work, so the server refuses it at start instead); else a ``ValueError``."""
    from jinja2.exceptions import TemplateSyntaxError

    try:  # (in the environment it renders in: transformers', with {% break %} and {% generation %})
        compile_chat_template(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"{where}: the chat template does not parse: {exc} (line {exc.lineno})") from None
    return text


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> Any:
    """``template`` compiled in transformers' chat-template environment (``render_jinja_template``'s, read from
    transformers 5): sandboxed, ``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``,
    ``{% continue %}``) and ``{% generation %}...{% endgeneration %}`` (transformers' AssistantTracker marks the
    assistant's text for ``return_assistant_tokens_mask``; here the body renders as written, as there), the globals
    ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` (transformers' hardened ones: no dict
    attributes, no underscore names on a namespace), and ``tojson`` as ``json.dumps`` (jinja's escapes HTML
    characters). A template that does not parse raises jinja's ``TemplateError``."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> list:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.datetime.now().strftime(format)

    class TemplateDict:  # (``dict(...)`` builds a dict; the type itself, and its attributes, stay out of reach)
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # (no underscore attributes: CPython internals stay out)
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                                    f"got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)


_CUT = "\ue000nightjar-continue\ue001"  # (private-use characters: no message holds them)


def _render_to_final_message(render, messages: list[dict[str, Any]]) -> str:
    """The conversation rendered and cut right after its last message's content. The content is rendered with a
    marker after it, and the text cut where the marker landed; a template that rewrites the content (and loses the
    marker) is cut after the last place the content occurs as written, else stripped (templates often trim). An empty
    content continues where the marker lands, as in transformers (which marks it the same way)."""
    if not messages:
        raise ChatTemplateArgumentError("continue_final_message needs a message to continue", "continue_final_message")
    content = parts = messages[-1].get("content")
    if isinstance(content, list):  # (OpenAI's content parts)
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not isinstance(content, str):  # (empty text continues too, as transformers': the reply from its start)
        raise ChatTemplateArgumentError("continue_final_message needs a last message with text to continue",
                                        "continue_final_message")
    if isinstance(parts, list):  # (parts stay parts, the marker after the last one's text: a template that loops
        # over them renders it)
        cut = [*parts[:-1], {**parts[-1], "text": parts[-1].get("text", "") + _CUT}] if parts else [
            {"type": "text", "text": _CUT}]
    else:
        cut = content + _CUT
    marked = render([*messages[:-1], {**messages[-1], "content": cut}])
    if marked.count(_CUT) == 1:
        text = marked[:marked.index(_CUT)]
        trimmed = content != content.rstrip() and content not in render(messages)  # (the template trims it)
        return text.rstrip() if trimmed else text
    text = render(messages)
    for piece in filter(None, (content, content.strip())):  # (empty: found anywhere, so nowhere to cut)
        at = text.rfind(piece)
        if at >= 0:
            return text[:at + len(piece)]
    raise ChatTemplateArgumentError("continue_final_message: the chat template does not render the last message's "
                                    "content as written, so there is no place to continue it from",
                                    "continue_final_message")


def _special_defaults(backend: tokenizers.Tokenizer, *, has_post_processor: bool) -> dict[str, Any]:
    """BOS/EOS/template guesses for a bare tokenizer.json (no tokenizer_config.json next to it)."""
    vocab = backend.get_vocab(with_added_tokens=True)
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:  # ChatML models (SmolLM2): no BOS, stop on <|im_end|>
        return dict(bos_token_id=vocab["<|im_start|>"], eos_token_ids=(vocab["<|im_end|>"],), add_bos=False,
                    chat_template=default_chat_template(vocab))
    if "<s>" in vocab:  # SentencePiece-style (Llama 2, stories260K)
        eos = (vocab["</s>"],) if "</s>" in vocab else ()
        return dict(bos_token_id=vocab["<s>"], eos_token_ids=eos, add_bos=not has_post_processor, chat_template=None)
    if "<|begin_of_text|>" in vocab:  # Llama 3
        eos = tuple(vocab[t] for t in ("<|end_of_text|>", "<|eot_id|>") if t in vocab)
        return dict(bos_token_id=vocab["<|begin_of_text|>"], eos_token_ids=eos, add_bos=not has_post_processor)
    eos = (vocab["<|endoftext|>"],) if "<|endoftext|>" in vocab else ()
    return dict(bos_token_id=None, eos_token_ids=eos, add_bos=False, chat_template=None)


class _SentencePieceBackend:
    """The subset of ``tokenizers.Tokenizer`` that :class:`Tokenizer` uses, over a ``sentencepiece`` model."""

    class _Encoding:
        def __init__(self, ids: list[int]):
            self.ids = ids

    def __init__(self, path: str):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self._special = {i for i in range(self.sp.get_piece_size()) if self.sp.is_control(i) or self.sp.is_unknown(i)}
        # The pieces whose text in a prompt stands for the piece itself (transformers' added tokens): control and
        # unknown pieces ("<s>", "</s>", "<unk>"), and in a BPE model the user-defined ones too (transformers'
        # converter makes those added tokens for BPE only; a Unigram model's stay with SentencePiece, which emits
        # them whole). The longest first, so "<s>" never wins over a longer piece starting with it.
        pieces = {self.sp.id_to_piece(i): i for i in sorted(self._special | _bpe_user_defined_ids(self.sp))}
        pieces = {piece: i for piece, i in pieces.items() if piece}
        self._added = pieces
        self._added_pattern = re.compile("|".join(re.escape(p) for p in sorted(pieces, key=len, reverse=True))) \
            if pieces else None

    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoding:
        """Ids for ``text``, added tokens' text ("<s>", "</s>") read as those tokens, as the vocabulary's
        ``tokenizer.json`` does: the text is split at them and each piece between encoded alone, so the piece after
        one starts with SentencePiece's dummy-prefix space, as the converted ``tokenizer.json`` (legacy, Llama 2's)
        has it (transformers' ``legacy: false`` Llama tokenizer adds no such space there). ``sp.encode`` alone
        spells "<s>" out as the pieces "<", "s", ">"."""
        if self._added_pattern is None:
            return self._Encoding(list(self.sp.encode(text)))
        ids: list[int] = []
        start = 0
        for match in self._added_pattern.finditer(text):
            if match.start() > start:
                ids.extend(self.sp.encode(text[start : match.start()]))
            ids.append(self._added[match.group()])
            start = match.end()
        if start < len(text):
            ids.extend(self.sp.encode(text[start:]))
        return self._Encoding(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if i not in self._special])
        # special tokens written out, as the tokenizer.json backend and transformers write them (sp.decode drops
        # control pieces and reads <unk> as " ⁇ "): runs of other ids decoded between them, a run's leading "▁" a
        # space unless the run starts the text (sp.decode strips it, as the whole text's first space is stripped)
        parts: list[str] = []
        run: list[int] = []

        def end_run() -> None:
            if run:
                text = self.sp.decode(run)
                parts.append(" " + text if parts and self.sp.id_to_piece(run[0]).startswith("\u2581") else text)
                run.clear()

        for i in ids:
            if i in self._special:
                end_run()
                parts.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        end_run()
        return "".join(parts)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.sp.get_piece_size()

    def id_to_token(self, token_id: int) -> str | None:
        return self.sp.id_to_piece(token_id) if 0 <= token_id < self.sp.get_piece_size() else None

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}


def _bpe_user_defined_ids(sp: Any) -> set[int]:
    """A BPE SentencePiece model's user-defined pieces (type 4), read from its model proto. The Python API has no
    ``is_user_defined``, and the proto's classes need protobuf, an optional package here: without it the set is
    empty and SentencePiece reads those pieces whole as before (only the dummy prefix after one differs)."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except Exception as exc:  # noqa: BLE001 (protobuf missing: ImportError; or another protobuf than the one the
        # module was generated by: its VersionError, a TypeError; the pieces then stay SentencePiece's, as documented)
        logger.debug("user-defined SentencePiece pieces are not split out of text (%s: %s)", type(exc).__name__, exc)
        return set()
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    if proto.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        return set()
    user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    return {i for i, piece in enumerate(proto.pieces) if piece.type == user_defined}


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: each of the 256 characters byte-level BPE vocabularies spell bytes
    with, to its byte (printable Latin-1 bytes stand for themselves, the others are shifted past U+00FF)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _continues(piece: bytes) -> bool:
    """Whether a token's bytes begin inside a UTF-8 character (a continuation byte, 10xxxxxx)."""
    return bool(piece) and piece[0] & 0xC0 == 0x80


class IncrementalDetokenizer:
    """Streams text for a growing id sequence; ``add`` returns only the newly completed text.

    Decodes a small window ``ids[prefix_offset:]`` and diffs it against ``ids[prefix_offset:read_offset]`` (the
    vLLM scheme), so leading-space stripping and byte fallback behave as in a full decode. Text ending in U+FFFD
    (an incomplete UTF-8 character) is held back until the character is complete.

    ``prompt_ids``: the window starts on the prompt's last :data:`PROMPT_CONTEXT` ids (read, never emitted), so the
    first generated token reads as it does after the prompt: a SentencePiece ``▁upon`` after "Once" streams
    " upon", where decoded alone its leading space would be stripped. A prompt that ends inside a character (its
    decode ends in U+FFFD) which the output completes: the character is the output's (the text is what a decode of
    prompt + output has past the prompt's complete characters), so the text joined always reads the whole decode.
    """

    PROMPT_CONTEXT = 5  # (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        prompt = [int(t) for t in prompt_ids]
        start = max(0, len(prompt) - self.PROMPT_CONTEXT)
        # not inside a character: a window that starts on a character's continuation bytes decodes them as U+FFFD,
        # and a byte-fallback decoder (Llama 2's, stories260K's) then reads the whole run of byte tokens, the output's
        # first ones (its "\n" is <0x0A>) included, as U+FFFD ("Hello 中文" + "\n\n" came out as four U+FFFD)
        while start > 0 and len(prompt) - start < self.PROMPT_CONTEXT + 8 and _continues(
                tokenizer.token_bytes(prompt[start])):
            start -= 1
        self.ids: list[int] = prompt[start:]
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = len(self.ids)

    def add(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in token_ids)
        prefix_text, new_text = self._window()
        start = len(prefix_text)
        if prefix_text.endswith("\ufffd") and not new_text.startswith(prefix_text):
            # The text read ends inside a character (only the prompt's can: output text is held until its characters
            # complete) and the new ids complete it: U+FFFD became the character, so the text is new from where the
            # two differ. (vLLM's length diff read "ab\ufffd" -> "ab😀" as nothing new and the emoji never came.)
            start = len(os.path.commonprefix([prefix_text, new_text]))
        if len(new_text) <= start or new_text.endswith("\ufffd"):
            return ""
        return self._advance(new_text[start:])

    def flush(self) -> str:
        """The end of the ids: text held back for a character that never completed (a stray or cut UTF-8 byte)
        comes out too, each invalid byte as U+FFFD: pieces of characters as their own bytes decoded with
        replacement (``Tokenizer.token_bytes``), anything else as a decode of the window reads it."""
        if self._read_offset == len(self.ids):
            return ""
        pending = self.ids[self._read_offset :]
        if all("\ufffd" in self.tokenizer.token_text(i) for i in pending):
            # (pieces of characters only, the usual case: their own bytes, each invalid one read as U+FFFD. A
            # byte-fallback decode of the window would turn the whole run of byte tokens, a complete "€" already
            # sent included, into one U+FFFD per byte: "€" + a stray byte came out as "€" + three U+FFFD)
            return self._advance(b"".join(self.tokenizer.token_bytes(i) for i in pending).decode("utf-8", "replace"))
        prefix_text, new_text = self._window()
        if len(new_text) <= len(prefix_text):
            return ""
        return self._advance(new_text[len(prefix_text) :])

    def _window(self) -> tuple[str, str]:
        """The text of the window's ids already read, and of all of them."""
        decode = self.tokenizer.decode
        return (decode(self.ids[self._prefix_offset : self._read_offset], self.skip_special_tokens),
                decode(self.ids[self._prefix_offset :], self.skip_special_tokens))

    def _advance(self, delta: str) -> str:
        """Emit ``delta``: the ids so far are read."""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self.text += delta
        return delta


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
