"""Structured outputs: constrain a request's tokens to a JSON schema, any JSON object, a regex, one of fixed choices
or an EBNF grammar (vLLM's ``StructuredOutputsParams``; the OpenAI API's ``response_format``).

A grammar backend (xgrammar, optional: ``pip install 'nightjar-jax[structured]'``) compiles the constraint against
the tokenizer's vocabulary once per engine and constraint (its compiler caches them); each request gets its own
matcher, advanced with every token it commits. Before each step the runner asks the matcher which tokens may come
next (:meth:`RequestGrammar.allowed`) and bans the others in that row's dense logit bias
(``ModelRunner._sampling_tensors``), so greedy and sampled rows, prefill and decode, draw only allowed tokens. A
speculative step proposes the row's first draft (a token tree: the root's candidates) under the mask, walks its
drafts through the matcher (:meth:`RequestGrammar.walk`: the mask at each position, a chain's or each tree node's
along its branch, up to the first draft of a branch it refuses, then rolled back) and verifies them under those
masks (``ModelRunner._walk_constraints``, ``SamplingTensors.allowed``). When the grammar is complete only the
end-of-sequence tokens are allowed, and the request ends once the matcher accepts one (``ignore_eos`` included).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from nightjar_jax.engine.sampling_params import InvalidRequestError, StructuredOutputs, clip


class RequestGrammar:
    """One request's matcher, advanced with each token it commits: which tokens may come next."""

    def __init__(self, matcher: Any, vocab_size: int, xgr: Any):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def allowed(self) -> np.ndarray:
        """bool ``[vocab_size]``: the tokens the constraint allows next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bits = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")
        return bits[: self._vocab_size].astype(bool)

    def walk(self, drafts, first: np.ndarray | None = None, children: np.ndarray | None = None) -> np.ndarray:
        """bool ``[k + 1, vocab_size]``: the tokens the constraint allows at each position of a speculative step.

        ``drafts`` [k]: a chain's drafts, or a token tree's node tokens in tree order (node ``i`` is ``drafts[i -
        1]``; ``children`` [k + 1, c]: ``SpecTree.children``, each node's children, -1 padded; None: a chain, node
        ``i``'s one child is ``i + 1``). Row 0 is the mask for the token after the last committed one (the root);
        row ``i`` the mask after node ``i``'s branch, for its children, when the constraint accepts every token of
        that branch. A node whose token the constraint refuses is banned in its parent's row, so a verify rejects
        it (greedy or by rejection sampling, into the residual), and neither it nor its descendants are reached:
        their rows allow every token, as do those after a node that completes the constraint (an end-of-sequence
        token: the engine drops what follows). The matcher ends where it began (each accepted token rolled back).
        ``first``: :meth:`allowed` now, when the caller has it already (it is copied)."""
        tokens = [int(t) for t in drafts]
        masks = np.ones((len(tokens) + 1, self._vocab_size), bool)
        masks[0] = self.allowed() if first is None else first
        matcher = self._matcher

        def visit(node: int) -> None:  # the matcher has accepted the branch root .. node
            kids = ([node + 1] if node < len(tokens) else []) if children is None else children[node]
            for child in kids:
                if child < 0:
                    break
                token = tokens[child - 1]
                if not masks[node, token] or not matcher.accept_token(token):
                    masks[node, token] = False  # (the mask says so already; the verify's rejection relies on it)
                    continue
                if not matcher.is_terminated():
                    masks[child] = self.allowed()
                    visit(child)
                matcher.rollback(1)

        visit(0)
        return masks

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False (state unchanged) when the constraint does not allow it."""
        return bool(self._matcher.accept_token(int(token)))

    @property
    def is_terminated(self) -> bool:
        """The constraint is complete and an end-of-sequence token was accepted."""
        return bool(self._matcher.is_terminated())


class GrammarBackend:
    """Compiles constraints against one tokenizer's vocabulary (xgrammar); built on the first structured request."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        try:
            import xgrammar as xgr
        except ImportError as e:  # (optional dependency)
            raise InvalidRequestError("structured outputs need the xgrammar package: pip install "
                                      f"'nightjar-jax[structured]' ({e})", "structured_outputs") from None
        self._xgr = xgr
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(_tokenizer_info(xgr, tokenizer, vocab_size))

    def compile(self, spec: StructuredOutputs) -> Any:
        c = self._compiler
        try:
            if spec.json_object or spec.json is not None:  # (compact JSON: a small model may loop on whitespace)
                schema = {"type": "object"} if spec.json_object else spec.json
                schema = schema if isinstance(schema, str) else json.dumps(schema)
                return c.compile_json_schema(schema, any_whitespace=False)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                rule = " | ".join(json.dumps(choice) for choice in spec.choice)  # (GBNF string literals: JSON escapes)
                return c.compile_grammar(f"root ::= {rule}")
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:  # (xgrammar's parse errors)
            why = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", str(e).strip())  # (xgrammar's time and C++ source line)
            raise InvalidRequestError(f"structured outputs: the {spec.kind} constraint does not compile: "
                                      f"{clip(why, 300)}", "structured_outputs") from None

    def matcher(self, spec: StructuredOutputs) -> RequestGrammar:
        return RequestGrammar(self._xgr.GrammarMatcher(self.compile(spec)), self.vocab_size, self._xgr)


def _tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int) -> Any:
    """xgrammar's view of the vocabulary: every token's bytes, from the transformers tokenizer (or one wrapping the
    ``tokenizers`` backend), and the end-of-sequence ids that end a complete output."""
    from transformers import PreTrainedTokenizerFast

    hf = tokenizer.hf_tokenizer
    if hf is None:
        backend = tokenizer.backend
        if not hasattr(backend, "get_vocab_size"):
            raise InvalidRequestError("structured outputs need a HF tokenizer (tokenizer.json); this model's "
                                      f"tokenizer is {type(backend).__name__}", "structured_outputs")
        hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    stop = list(tokenizer.eos_token_ids)
    if not stop:
        raise InvalidRequestError("structured outputs need an end-of-sequence token: this tokenizer has none",
                                  "structured_outputs")
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop)
