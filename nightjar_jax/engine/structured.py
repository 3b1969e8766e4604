"""Structured outputs: constrain a request's tokens to a JSON schema, any JSON object, a regex, one of fixed choices
or an EBNF grammar (vLLM's ``StructuredOutputsParams``; the OpenAI API's ``response_format``).

A grammar backend (xgrammar, optional: ``pip install 'nightjar-jax[structured]'``) compiles the constraint against
the tokenizer's vocabulary once per engine and constraint (its compiler caches them); each request gets its own
matcher, advanced with every token it commits. Before each step the runner asks the matcher which tokens may come
next (:meth:`RequestGrammar.allowed`) and bans the others in that row's dense logit bias
(``ModelRunner._sampling_tensors``), so greedy and sampled rows, prefill and decode, draw only allowed tokens. A
speculative step proposes the row's first draft (a token tree: the root's candidates) under the mask, walks its
drafts through the matcher (:meth:`TokenConstraint.walk`: the mask at each position, a chain's or each tree node's
along its branch, up to the first draft of a branch it refuses, then rolled back) and verifies them under those
masks (``ModelRunner._walk_constraints``, ``SamplingTensors.allowed``). When the grammar is complete only the
end-of-sequence tokens are allowed, and the request ends once the matcher accepts one (``ignore_eos`` included).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from typing import Any

import numpy as np

from nightjar_jax.engine.sampling_params import InvalidRequestError, StructuredOutputs, clip


class TokenConstraint:
    """A request's constraint on the tokens it may generate, advanced with each token it commits (``Request.grammar``):
    a structured output's matcher (:class:`RequestGrammar`), ``bad_words`` (:class:`BadWords`), or both
    (:class:`BothConstraints`). Subclasses give :meth:`allowed`, :meth:`accept`, :meth:`rollback` and
    :attr:`is_terminated`; :meth:`walk` follows a speculative step's drafts through them."""

    vocab_size: int
    field = "structured_outputs"  # the request field a dead end is blamed on (the one that refused, for two)

    def allowed(self) -> np.ndarray:
        """bool ``[vocab_size]``: the tokens the constraint allows next."""
        raise NotImplementedError

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False (state unchanged) when the constraint does not allow it."""
        raise NotImplementedError

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        raise NotImplementedError

    @property
    def is_terminated(self) -> bool:
        """The constraint is complete and an end-of-sequence token was accepted (the request ends)."""
        return False

    def walk(self, drafts, first: np.ndarray | None = None, children: np.ndarray | None = None) -> np.ndarray:
        """bool ``[k + 1, vocab_size]``: the tokens the constraint allows at each position of a speculative step.

        ``drafts`` [k]: a chain's drafts, or a token tree's node tokens in tree order (node ``i`` is ``drafts[i -
        1]``; ``children`` [k + 1, c]: ``SpecTree.children``, each node's children, -1 padded; None: a chain, node
        ``i``'s one child is ``i + 1``). Row 0 is the mask for the token after the last committed one (the root);
        row ``i`` the mask after node ``i``'s branch, for its children, when the constraint accepts every token of
        that branch. A node whose token the constraint refuses is banned in its parent's row, so a verify rejects
        it (greedy or by rejection sampling, into the residual), and neither it nor its descendants are reached:
        their rows allow every token, as do those after a node that completes the constraint (an end-of-sequence
        token: the engine drops what follows). The constraint ends where it began (each accepted token rolled
        back). ``first``: :meth:`allowed` now, when the caller has it already (it is copied)."""
        tokens = [int(t) for t in drafts]
        masks = np.ones((len(tokens) + 1, self.vocab_size), bool)
        masks[0] = self.allowed() if first is None else first

        def visit(node: int) -> None:  # the constraint has accepted the branch root .. node
            kids = ([node + 1] if node < len(tokens) else []) if children is None else children[node]
            for child in kids:
                if child < 0:
                    break
                token = tokens[child - 1]
                if not masks[node, token] or not self.accept(token):
                    masks[node, token] = False  # (the mask says so already; the verify's rejection relies on it)
                    continue
                if not self.is_terminated:
                    masks[child] = self.allowed()
                    visit(child)
                self.rollback(1)

        visit(0)
        return masks


class RequestGrammar(TokenConstraint):
    """One request's structured-output matcher (xgrammar), advanced with each token it commits."""

    def __init__(self, matcher: Any, vocab_size: int, xgr: Any):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def allowed(self) -> np.ndarray:
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bits = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)

    def accept(self, token: int) -> bool:
        return bool(self._matcher.accept_token(int(token)))

    def rollback(self, n: int) -> None:
        self._matcher.rollback(n)

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class BadWords(TokenConstraint):
    """vLLM's ``bad_words``: token sequences the output may not contain. The last token of a sequence is banned
    wherever the output's last tokens are the rest of it (a one-token sequence: everywhere), so a greedy or sampled
    row, and each position of a speculative step (:meth:`walk`), draws from the target's distribution without it.
    As in vLLM only the output's own tokens count (not the prompt's). ``allowed_ids``: the request's
    ``allowed_token_ids``, which :meth:`accept` holds to as well: where the ban leaves none of them the step draws
    from nothing, and the token it returns is refused (the request ends with an error naming ``bad_words``)."""

    field = "bad_words"

    def __init__(self, sequences: list[list[int]], vocab_size: int, allowed_ids: frozenset[int] | None = None):
        self.vocab_size = vocab_size
        self._allowed_ids = allowed_ids
        self._always = sorted({s[0] for s in sequences if len(s) == 1 and s[0] < vocab_size})
        self._longer = [(tuple(s[:-1]), s[-1]) for s in sequences if len(s) > 1 and s[-1] < vocab_size]
        self._tokens: list[int] = []  # the output so far

    def _banned(self) -> set[int]:
        banned = set(self._always)
        tail = self._tokens
        for prefix, last in self._longer:
            if len(tail) >= len(prefix) and tuple(tail[len(tail) - len(prefix):]) == prefix:
                banned.add(last)
        return banned

    def allowed(self) -> np.ndarray:
        mask = np.ones(self.vocab_size, bool)
        mask[list(self._banned())] = False
        return mask

    def accept(self, token: int) -> bool:
        if int(token) in self._banned() or (self._allowed_ids is not None and int(token) not in self._allowed_ids):
            return False
        self._tokens.append(int(token))
        return True

    def rollback(self, n: int) -> None:
        del self._tokens[len(self._tokens) - n:]


class BothConstraints(TokenConstraint):
    """A structured output and ``bad_words`` together: a token must be allowed by both."""

    def __init__(self, first: TokenConstraint, second: TokenConstraint):
        self.first, self.second, self.vocab_size = first, second, first.vocab_size

    def allowed(self) -> np.ndarray:
        return self.first.allowed() & self.second.allowed()

    def accept(self, token: int) -> bool:
        if not self.first.accept(token):
            # (the two together allowing nothing here: bad_words, the second, banned all the constraint allows)
            self.field = self.second.field if not self.allowed().any() else self.first.field
            return False
        if not self.second.accept(token):
            self.first.rollback(1)
            self.field = self.second.field
            return False
        return True

    def rollback(self, n: int) -> None:
        self.first.rollback(n)
        self.second.rollback(n)

    @property
    def is_terminated(self) -> bool:
        return self.first.is_terminated


def bad_word_sequences(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words``: each word as written (its leading spaces dropped) and, where a leading
    space makes a different first token of the same length (a word starting mid-text), with one."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


CACHE_MB_ENV = "NIGHTJAR_XGRAMMAR_CACHE_MB"  # (vLLM's VLLM_XGRAMMAR_CACHE_MB)
DEFAULT_CACHE_MB = 512
MAX_CACHE_BYTES = 2**62  # (larger is unbounded in all but name)


def grammar_cache_bytes() -> int:
    """The compiled-grammar cache's limit in bytes: ``NIGHTJAR_XGRAMMAR_CACHE_MB`` (default 512, as vLLM's), past
    which xgrammar evicts the least recently used. Unbounded, it grew ~70 KB per distinct JSON schema on SmolLM2's
    vocabulary for as long as a server ran (per-user tool schemas: gigabytes)."""
    raw = os.environ.get(CACHE_MB_ENV, "").strip()
    if not raw:
        return DEFAULT_CACHE_MB << 20
    try:
        mb = float(raw)
    except ValueError:
        mb = float("nan")
    if not (math.isfinite(mb) and mb > 0):
        raise ValueError(f"{CACHE_MB_ENV}={raw!r} must be a positive number of megabytes (default {DEFAULT_CACHE_MB})")
    return max(1, min(int(mb * (1 << 20)), MAX_CACHE_BYTES))  # (xgrammar takes an int64)


# keywords xgrammar (0.2) compiles as if absent: an output breaking them still ends with finish reason "stop"
_IGNORED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
                     "dependentSchemas", "dependentRequired", "patternProperties")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # name -> schema
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedItems",
                  "unevaluatedProperties")  # a schema (or a list of them: tuple-form items)
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_REF_ANNOTATIONS = frozenset({"$ref", "$defs", "definitions", "$schema", "$id", "$anchor", "$comment", "title",
                              "description", "examples", "default", "deprecated", "readOnly", "writeOnly"})


def _resolved(root: Any, node: Any) -> dict | None:
    """``node`` with its local ``$ref`` (``#`` or ``#/...``) followed, up to 16 hops; None where it does not resolve to
    a schema object."""
    for _ in range(16):
        if isinstance(node, dict) and isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1 and not (
                set(node) - _REF_ANNOTATIONS - {"allOf"}):  # ({"allOf": [{"$ref": ...}]}: pydantic's, OpenAPI's)
            node = node["allOf"][0]
            continue
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str):
            break
        if ref != "#" and not ref.startswith("#/"):
            return None
        node = root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
    return node if isinstance(node, dict) and not isinstance(node.get("$ref"), str) and not (
        isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1) else None


def _canonical(value: Any) -> str:
    """A JSON value as text that is equal where JSON Schema's equality is (1 and 1.0 are one number)."""
    if isinstance(value, float) and value.is_integer():  # (not float(an int): 10**400 overflows a float)
        value = int(value)
    return json.dumps(value, sort_keys=True)


def _listed_values(node: dict) -> set[str] | None:
    """The values a schema allows when it lists them (``const`` / ``enum``), canonical; None when it does not."""
    if "const" in node:
        return {_canonical(node["const"])}
    if isinstance(node.get("enum"), list):
        return {_canonical(v) for v in node["enum"]}
    return None


def _json_type(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"number", "integer"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    return {{str: "string", list: "array", dict: "object"}.get(type(value), "?")}


def _types(node: dict) -> set[str] | None:
    """The JSON types a schema allows, from its ``type`` or, without one, its listed values; None when unknown."""
    types = node.get("type")
    if types is None and ("const" in node or isinstance(node.get("enum"), list)):
        values = [node["const"]] if "const" in node else node["enum"]
        return set().union(*map(_json_type, values))
    if isinstance(types, str):
        types = [types]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        return None
    return set(types) | ({"integer"} if "number" in types else set())  # (an integer is a number)


def _exclusive(root: Any, a: dict | None, b: dict | None) -> bool:
    """Whether no value can match both schemas (resolved: ``_resolved``), as far as their types, listed values or a
    required property's listed values (a discriminator) show; False when that cannot be told."""
    if a is None or b is None:
        return False
    types_a, types_b = _types(a), _types(b)
    if types_a is not None and types_b is not None and not types_a & types_b:
        return True
    values_a, values_b = _listed_values(a), _listed_values(b)
    if values_a is not None and values_b is not None and not values_a & values_b:
        return True
    props_a, props_b, req_a, req_b = a.get("properties"), b.get("properties"), a.get("required"), b.get("required")
    for props, closed, required in ((props_a, a.get("additionalProperties"), req_b),
                                    (props_b, b.get("additionalProperties"), req_a)):
        # (one allows no property but its own, and the other requires one it does not have)
        if closed is False and isinstance(props, dict) and isinstance(required, list) and any(
                isinstance(r, str) and r not in props for r in required):
            return True
    if not (isinstance(props_a, dict) and isinstance(props_b, dict) and isinstance(req_a, list)
            and isinstance(req_b, list)):
        return False
    for name in props_a:
        if name in props_b and name in req_a and name in req_b:
            sub_a, sub_b = _resolved(root, props_a[name]), _resolved(root, props_b[name])
            if sub_a is None or sub_b is None:
                continue
            values_a, values_b = _listed_values(sub_a), _listed_values(sub_b)
            if values_a is not None and values_b is not None and not values_a & values_b:
                return True
    return False


MAX_ONEOF_PAIRS = 2016  # branch pairs the oneOf check compares one by one (64 branches); past it only fast paths


def _oneof_overlap(root: Any, node: dict) -> tuple[int, int] | None:
    """Two branches of ``node``'s ``oneOf`` that may both match (xgrammar compiles oneOf as anyOf: a value matching
    two came back with finish reason "stop"), or None. An OpenAPI ``discriminator`` beside it picks the branch by
    name, and is taken as such. Branches that all list their values (``const`` / ``enum``, the "enum with
    descriptions" pattern) or all require one property with listed values (a discriminator) are compared as one set
    (linear: thousands of branches compared pairwise took seconds per request); others pairwise up to
    ``MAX_ONEOF_PAIRS`` pairs, past which the oneOf is taken as vLLM takes it."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or len(branches) < 2 or "discriminator" in node:
        return None
    resolved = [_resolved(root, b) for b in branches]

    def first_repeat(value_sets: list[set[str]]) -> tuple[int, int] | None:
        seen: dict[str, int] = {}
        for j, values in enumerate(value_sets):
            for v in values:
                if v in seen and seen[v] != j:
                    return seen[v], j
                seen.setdefault(v, j)
        return None

    listed = [_listed_values(r) if r is not None else None for r in resolved]
    if all(v is not None for v in listed):
        return first_repeat(listed)

    def properties(r: dict) -> dict:
        return r["properties"] if isinstance(r.get("properties"), dict) else {}

    if all(r is not None for r in resolved):
        for name in properties(resolved[0]):
            subs = [_resolved(root, properties(r).get(name)) if isinstance(r.get("required"), list)
                    and name in r["required"] else None for r in resolved]
            tags = [_listed_values(sub) if sub is not None else None for sub in subs]
            if all(t is not None for t in tags) and first_repeat(tags) is None:
                return None
    if len(branches) * (len(branches) - 1) // 2 > MAX_ONEOF_PAIRS:
        return None
    for i, j in itertools.combinations(range(len(branches)), 2):
        if not _exclusive(root, resolved[i], resolved[j]):
            return i, j
    return None


def unenforced_schema_feature(schema: Any) -> str | None:
    """The first place a JSON schema asks for what the grammar backend would compile as if it were absent, as
    "``keyword`` at ``path``" (None: every constraint is enforced). Outputs breaking such a constraint came back
    with finish reason "stop" (``uniqueItems`` gave ``[1, 1, 2]``; an ``allOf`` of two objects let any JSON through);
    vLLM's xgrammar backend refuses these schemas the same way (``has_xgrammar_unsupported_json_features``)."""

    def walk(node: Any, path: str) -> str | None:
        if not isinstance(node, dict):
            return None
        for keyword in _IGNORED_KEYWORDS:
            if keyword in node:
                return f"'{keyword}' at {path}"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"'allOf' of {len(node['allOf'])} schemas at {path} (one is enforced)"
        overlap = _oneof_overlap(schema, node)
        if overlap is not None:
            return (f"'oneOf' at {path} whose branches {overlap[0]} and {overlap[1]} may both match (exactly one "
                    "must: use 'anyOf', or branches told apart by 'type', 'const' / 'enum' values or a required "
                    "property's 'const')")
        ref = node.get("$ref")
        if isinstance(ref, str):
            if not (ref == "#" or ref.startswith("#/")):
                return f"'$ref' to {ref!r} at {path} (only this schema's own '#/...' definitions are read)"
            beside = sorted(set(node) - _REF_ANNOTATIONS)
            if beside:
                return f"'{beside[0]}' beside '$ref' at {path}"
        types = node.get("type")
        types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
        if "multipleOf" in node and (not types or types - {"integer", "null"}):
            return f"'multipleOf' on a non-integer at {path} (type 'integer' only)"
        # (a format is an annotation in JSON Schema: xgrammar writes the ones it knows and any string for others, and
        # lengths beside one go unchecked, which only very long or empty formatted strings could break: pydantic's
        # HttpUrl is format uri, lengths 1 to 2083. Beside a pattern they were broken: "sombrero" for maxLength 3.)
        if "pattern" in node and ("minLength" in node or "maxLength" in node):
            return f"'minLength' / 'maxLength' beside 'pattern' at {path}"
        required, properties = node.get("required"), node.get("properties")
        if node.get("additionalProperties") is False and isinstance(required, list) and isinstance(properties, dict):
            missing = [r for r in required if r not in properties]
            if missing:
                return (f"'required' {clip(json.dumps(missing), 60)} at {path}, which 'properties' lacks and "
                        "'additionalProperties': false forbids (no object satisfies it)")
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                for name, sub in node[key].items():
                    if (found := walk(sub, f"{path}/{key}/{name}")) is not None:
                        return found
        for key in _SCHEMA_VALUES:
            value = node.get(key)
            for i, sub in enumerate(value if isinstance(value, list) else [value]):
                suffix = f"/{i}" if isinstance(value, list) else ""
                if (found := walk(sub, f"{path}/{key}{suffix}")) is not None:
                    return found
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                for i, sub in enumerate(node[key]):
                    if (found := walk(sub, f"{path}/{key}/{i}")) is not None:
                        return found
        return None

    return walk(schema, "#")


MAX_SCHEMA_DEPTH = 128  # JSON schema nesting (objects and lists) a constraint may have


def nesting_depth(value: Any) -> int:
    """How deep dicts and lists nest in ``value`` (a scalar: 0), counted without recursion and no further than
    ``MAX_SCHEMA_DEPTH + 1``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:  # (past it the answer is already "too deep")
                stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


class GrammarBackend:
    """Compiles constraints against one tokenizer's vocabulary (xgrammar); built on the first structured request.
    Compiled grammars are cached up to :func:`grammar_cache_bytes`."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Any = None):
        try:
            import xgrammar as xgr
        except ImportError as e:  # (optional dependency)
            raise InvalidRequestError("structured outputs need the xgrammar package: pip install "
                                      f"'nightjar-jax[structured]' ({e})", "structured_outputs") from None
        self._xgr = xgr
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(_tokenizer_info(xgr, tokenizer, vocab_size, eos_ids),
                                             cache_limit_bytes=grammar_cache_bytes())

    @property
    def cache_bytes(self) -> int:
        """Bytes the compiled-grammar cache holds now."""
        return int(self._compiler.get_cache_size_bytes())

    def compile(self, spec: StructuredOutputs) -> Any:
        c = self._compiler
        if spec.json is not None:
            try:
                parsed = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            except (ValueError, RecursionError):
                parsed = None  # (not JSON: the compile below says so)
            depth = nesting_depth(parsed)
            if depth > MAX_SCHEMA_DEPTH:  # (the compile's time grew past a minute at 1,000 levels)
                raise InvalidRequestError(
                    f"structured outputs: the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep (objects "
                    f"and lists inside one another): allowed up to {MAX_SCHEMA_DEPTH}; use $defs for recursive shapes",
                    "structured_outputs")
            unenforced = unenforced_schema_feature(parsed)
            if unenforced is not None:
                raise InvalidRequestError(
                    f"structured outputs: the JSON schema asks for {unenforced}, which the grammar backend (xgrammar) "
                    "cannot enforce: an output could break it; drop or rewrite that part", "structured_outputs")
        try:
            if spec.json_object or spec.json is not None:  # (compact JSON: a small model may loop on whitespace)
                schema = {"type": "object"} if spec.json_object else spec.json
                schema = schema if isinstance(schema, str) else json.dumps(schema)
                return c.compile_json_schema(schema, any_whitespace=False)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                # (GBNF string literals: JSON escapes, but characters as written: xgrammar reads a \ud83d\ude00
                # surrogate pair as two code points, each written as 3 bytes: an emoji became invalid UTF-8)
                rule = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
                return c.compile_grammar(f"root ::= {rule}")
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:  # (xgrammar's parse errors)
            why = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", str(e).strip())  # (xgrammar's time and C++ source line)
            hint = ""
            lark = spec.grammar is not None and "::=" not in spec.grammar
            if lark and re.search(r"(?m)^\s*\??\w+\s*:", spec.grammar):
                # (vLLM converts a Lark grammar for xgrammar; here it met "start:" as EBNF and blamed the ':')
                hint = ("; a grammar here is xgrammar's EBNF (GBNF), rules as `root ::= ...`: a Lark grammar "
                        "(`start: ...`) is not converted")
            raise InvalidRequestError(f"structured outputs: the {spec.kind} constraint does not compile: "
                                      f"{clip(why, 300)}{hint}", "structured_outputs") from None

    def matcher(self, spec: StructuredOutputs) -> RequestGrammar:
        return RequestGrammar(self._xgr.GrammarMatcher(self.compile(spec)), self.vocab_size, self._xgr)


def _tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int, eos_ids: Any = None) -> Any:
    """xgrammar's view of the vocabulary: every token's bytes, from the transformers tokenizer (or one wrapping the
    ``tokenizers`` backend), and the end-of-sequence ids that end a complete output (``eos_ids``: the engine's,
    which its generation config may add to; None: the tokenizer's)."""
    from transformers import PreTrainedTokenizerFast

    hf = tokenizer.hf_tokenizer
    if hf is None:
        backend = tokenizer.backend
        if not hasattr(backend, "get_vocab_size"):
            raise InvalidRequestError("structured outputs need a HF tokenizer (tokenizer.json); this model's "
                                      f"tokenizer is {type(backend).__name__}", "structured_outputs")
        hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    stop = sorted(eos_ids) if eos_ids is not None else list(tokenizer.eos_token_ids)
    if not stop:
        raise InvalidRequestError("structured outputs need an end-of-sequence token: this tokenizer has none",
                                  "structured_outputs")
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop)
