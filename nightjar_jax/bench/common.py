"""Shared pieces of the benchmark scripts (``scripts/bench_engine.py``, ``scripts/bench_spec.py``).

Vocabulary:
- *workload*: ``batch_size`` prompts of exactly ``prompt_len`` tokens, each generating exactly ``output_len``
  tokens greedily (``ignore_eos``), submitted at once so every decode step runs at the full batch.
- *decode step*: one ``LLMEngine.step`` that ran the decode path (not prefill); the engine's ``step_log`` records
  its wall seconds (schedule → device → output bookkeeping) and the tokens it committed (delivered to requests:
  tokens verified past ``max_tokens`` or a stop are not counted).
- *decode tokens/s*: committed tokens over the summed wall seconds of decode steps only (prefill excluded).
- *TPOT*: time per output token of one sequence = mean decode step seconds / mean tokens committed per sequence.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

DEFAULT_DATASET = "/work/shared/datasets/spec_bench/question.jsonl"


# ---- argparse types: a bad flag is a usage error (exit 2, one line naming the flag) before any model loads ---------
# Each is passed as ``type=``; argparse prefixes the message with the flag ("argument --repeats: ...").


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A type for an integer >= ``minimum``."""

    def parse(text: str) -> int:
        return _int_at_least(text, minimum)

    parse.__name__ = f"int_at_least_{minimum}"
    return parse


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
    return value


def float_at_least(minimum: float) -> Callable[[str], float]:
    """A type for a finite float >= ``minimum``."""

    def parse(text: str) -> float:
        return _finite_float(text, f">= {minimum:g}", lambda v: v >= minimum)

    parse.__name__ = f"float_at_least_{minimum:g}"
    return parse


def float_in_range(minimum: float, maximum: float) -> Callable[[str], float]:
    """A type for a finite float from ``minimum`` to ``maximum``."""

    def parse(text: str) -> float:
        return _finite_float(text, f"from {minimum:g} to {maximum:g}", lambda v: minimum <= v <= maximum)

    parse.__name__ = f"float_in_range_{minimum:g}_{maximum:g}"
    return parse


def positive_float(text: str) -> float:
    """A finite float > 0."""
    return _finite_float(text, "> 0", lambda v: v > 0)


def non_negative_float(text: str) -> float:
    """A finite float >= 0."""
    return _finite_float(text, ">= 0", lambda v: v >= 0)


def _finite_float(text: str, allowed: str, ok: Callable[[float], bool]) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number {allowed}, got {text!r}")
    return value


def int_list(minimum: int = 1, *, increasing: bool = False, allow_empty: bool = False,
             as_text: bool = False, maximum: int | None = None) -> Callable[[str], list[int] | str]:
    """A type for a comma list of integers >= ``minimum`` (and <= ``maximum`` when given) without duplicates
    (``increasing``: strictly increasing; ``allow_empty``: "" gives [], for flags whose empty value turns a part off;
    ``as_text``: the text itself once checked, for scripts that split it later and record it as given)."""
    order = "strictly increasing" if increasing else "no duplicates"
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    allowed = f"a comma list of integers {bounds} ({order})"

    def parse(text: str) -> list[int]:
        items = [x.strip() for x in text.split(",")]
        if items == [""]:
            if allow_empty:
                return text if as_text else []
            raise argparse.ArgumentTypeError(f"expected {allowed}, got an empty list")
        try:
            values = [int(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if min(values) < minimum or (maximum is not None and max(values) > maximum):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
        if increasing and any(b <= a for a, b in zip(values, values[1:], strict=False)):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
        if len(set(values)) < len(values):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r} (a value twice)")
        return text if as_text else values

    parse.__name__ = "int_list"
    return parse


def name_list(choices: tuple[str, ...] | list[str] | None = None, *,
              as_text: bool = False) -> Callable[[str], list[str] | str]:
    """A type for a non-empty comma list of names without duplicates, each one of ``choices`` when given
    (``as_text``: the text itself once checked)."""

    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",")]
        if not all(names):
            raise argparse.ArgumentTypeError(f"expected a non-empty comma list of names, got {text!r}")
        if len(set(names)) < len(names):
            raise argparse.ArgumentTypeError(f"{text!r} names one entry twice")
        bad = [n for n in names if choices is not None and n not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}: each must be one of {list(choices)}")
        return text if as_text else names

    parse.__name__ = "name_list"
    return parse


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_spec(text: str) -> str:
    """A model the engine can load: a preset (optionally ``preset@skip=..`` / ``@layers=N``), a checkpoint path that
    exists, or a Hugging Face repo id (``org/name``)."""
    from nightjar_jax.models.presets import PRESETS

    base = text.rpartition("@")[0] if "@" in text else text
    if base.lower() in PRESETS or os.path.exists(os.path.expanduser(base)):
        return text
    if _REPO_ID.fullmatch(base) and not base.startswith((".", "~")):
        return text
    raise argparse.ArgumentTypeError(f"unknown model {text!r}: expected a preset of {sorted(PRESETS)}, a checkpoint "
                                     "path that exists, or a Hugging Face repo id")


def smollm2_model(text: str) -> str:
    """A model whose token ids are SmolLM2's (scripts whose prompts are SmolLM2 token ids): a preset with SmolLM2's
    vocabulary, or a path / repo id (not checkable before loading)."""
    from nightjar_jax.models.presets import PRESETS

    model_spec(text)
    base = (text.rpartition("@")[0] if "@" in text else text).lower()
    want = PRESETS["smollm2-135m-instruct"].config.vocab_size
    preset = PRESETS.get(base)
    if preset is not None and (preset.config.vocab_size != want or not base.startswith("smollm2")):
        smollm = sorted(n for n in PRESETS if n.startswith("smollm2"))
        raise argparse.ArgumentTypeError(f"{text!r} does not use SmolLM2's tokenizer, which the prompts are encoded "
                                         f"with: use one of {smollm} (or a SmolLM2 checkpoint)")
    return text


def context_error(model: str, tokens: int, what: str) -> str | None:
    """Why ``tokens`` (``what`` says which flags add up to them) cannot fit ``model``'s context, or None when they
    fit or the model is no preset (a path's context is known only once it loads)."""
    from nightjar_jax.models.presets import PRESETS

    preset = PRESETS.get((model.rpartition("@")[0] if "@" in model else model).lower())
    limit = None if preset is None else preset.config.max_position_embeddings
    if limit is None or tokens <= limit:
        return None
    return f"{what} is {tokens} tokens, past {model}'s context of {limit}"


def draft_spec(text: str) -> str:
    """A draft: "none" / "" (no draft), "auto" (the target's paired draft), "ngram", or a model (``model_spec``)."""
    if text.lower() in ("", "none", "auto", "ngram"):
        return text
    return model_spec(text)


def draft_model(text: str) -> str:
    """A draft model: "auto" (the target's paired draft; :func:`draft_gap` once the target is known) or a model
    (``model_spec``). Not "none" / "" / "ngram" (n-gram lookup's copies): they draft with no model."""
    if text.lower() in ("", "none", "ngram"):
        raise argparse.ArgumentTypeError(f"{text!r} is no draft model, and one is needed: expected 'auto' (the "
                                         "target's paired draft), a preset, a checkpoint path or a Hugging Face "
                                         "repo id")
    return text if text.lower() == "auto" else model_spec(text)


def smollm2_draft(text: str) -> str:
    """A draft model for SmolLM2 (:func:`draft_model`): a preset must share SmolLM2's vocabulary (a path or repo id is
    checked when it loads)."""
    text = draft_model(text)
    if text.lower() != "auto":
        try:
            smollm2_model(text)
        except argparse.ArgumentTypeError:
            from nightjar_jax.models.presets import PRESETS

            smollm = sorted(n for n in PRESETS if n.startswith("smollm2"))
            raise argparse.ArgumentTypeError(f"{text!r} does not share SmolLM2's vocabulary, as a draft for it must: "
                                             f"use 'auto', a SmolLM2 draft folder or one of {smollm} (a preset may "
                                             f"take @skip= or @layers=)") from None
    return text


def draft_gap(draft: str, model: str, lookup: int = 3) -> str | None:
    """Why ``draft`` (a :func:`draft_spec`) gives target ``model`` nothing to speculate with, or None when it drafts:
    "none" / "", "auto" where ``model`` has no paired draft installed (``LLMEngine.resolve_draft_spec``), "ngram"
    where n-gram lookup is off (``lookup``: ``prompt_lookup_max``; the engine's default is 3)."""
    name = draft.lower()
    if name in ("", "none"):
        return f"{draft!r} is no draft"
    if name == "ngram" and lookup == 0:
        return "'ngram' drafts only by n-gram lookup, which is off here (prompt_lookup_max 0)"
    if name == "auto":
        from nightjar_jax.models.presets import default_draft_for

        if default_draft_for(model) is None:
            return f"'auto' is no draft for {model!r}: it has no paired draft installed (name one)"
    return None


def existing_file(text: str) -> str:
    """A path to a file that exists."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def writable_out(text: str) -> str:
    """An output file path that can be written, checked before the work, not after it: its folder exists or can be
    made (its nearest existing ancestor is a writable folder), or it is a writable file. ``os.access`` reads mode
    bits only (root passes them even on ``/proc``, where nothing can be made), so for a new file the check also makes
    what the writer will make, a file in the folder or a folder in the nearest existing ancestor, and removes it at
    once: nothing is left behind here (argparse
    also runs this on a flag's default, before it reports another flag's error); the writers make the folder
    (:func:`write_json`, :func:`make_parent`)."""
    import tempfile

    if not text:
        raise argparse.ArgumentTypeError("expected an output file path, got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: it is a folder (give a file path inside it)")
    folder = os.path.dirname(os.path.abspath(text))
    probe = folder
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {probe!r} is a file, not a folder")
    if not os.access(probe, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {probe!r} is not a writable folder")
    if os.path.exists(text):  # (rewritten in place: the file must be writable; it is not opened here, which a
        # watcher of close-writes would read as rewritten)
        read_only = bool(os.statvfs(text).f_flag & os.ST_RDONLY)  # (os.access passes root on a read-only mount)
        if not os.path.isfile(text) or read_only or not os.access(text, os.W_OK):
            what = "not a regular file" if not os.path.isfile(text) else "on a read-only file system" if read_only \
                else "not writable"
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: it is {what}")
        return text
    try:
        if probe == folder:
            fd, made = tempfile.mkstemp(prefix=".writable_out-", dir=probe)
            os.close(fd)
            os.unlink(made)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".writable_out-", dir=probe))
    except OSError as exc:
        what = "a file" if probe == folder else "a folder"
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {probe!r} is not a writable folder ({what} cannot "
                                         f"be made in it: {exc.strerror})") from None
    return text


def int_in_range(minimum: int, maximum: int) -> Callable[[str], int]:
    """A type for an integer from ``minimum`` to ``maximum``."""

    def parse(text: str) -> int:
        value = _int_at_least(text, minimum)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"expected an integer from {minimum} to {maximum}, got {value}")
        return value

    parse.__name__ = f"int_in_range_{minimum}_{maximum}"
    return parse


# ---- planners: the names of nightjar_jax.planner's registry, checked before any model loads --------------------------


def planner_spec(text: str) -> str:
    """A planner of ``nightjar_jax.planner``'s registry: a registered name, or ``NAME:ARG`` where that planner takes
    an argument (``static:2``). Its argument's form and range against γ_max: :func:`check_planner`."""
    from nightjar_jax.planner import known_planners  # (registers the planners; never imports JAX)
    from nightjar_jax.planner.base import planner_class

    try:
        planner_class(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"unknown planner {text!r}: expected one of {known_planners()} (NAME:ARG "
                                         "where the planner takes one, e.g. 'static:2')") from None
    return text


def planner_list(*, as_text: bool = False) -> Callable[[str], list[str] | str]:
    """A type for a non-empty comma list of :func:`planner_spec` entries without duplicates."""
    names = name_list()

    def parse(text: str) -> list[str] | str:
        specs = names(text)
        for spec in specs:
            planner_spec(spec)
        return text if as_text else specs

    parse.__name__ = "planner_list"
    return parse


def http_url(text: str) -> str:
    """A running server's address: ``http://`` or ``https://`` (the trailing slash dropped)."""
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:8000)")
    return text.rstrip("/")


def check_planner(spec: str, gamma_max: int) -> None:
    """ArgumentTypeError unless the engine can build planner ``spec`` at ``gamma_max`` (``num_speculative_tokens``)
    as ``LLMEngine._make_planner`` does: a registered name, and an argument of the right form and range ("static:x",
    "static:8" past γ_max 4). Call it once the flags are parsed: γ_max is another flag."""
    from nightjar_jax.planner import make_planner

    planner_spec(spec)
    try:
        if gamma_max == 0:  # (the engine decodes plainly, and checks the spec against the largest γ_max it allows)
            make_planner("static:1" if spec == "static" else spec, 16)
        else:
            make_planner(f"static:{gamma_max}" if spec == "static" else spec, gamma_max)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"planner {spec!r} at γ_max {gamma_max}: {exc}") from None


BUILT_IN_PROMPTS = ("Once upon a time", "The cat sat on the mat and")


def dataset_texts(path: str, limit: int = 256, *, default: str | None = None,
                  fallback: tuple[str, ...] = BUILT_IN_PROMPTS) -> list[str]:
    """``load_prompt_texts`` of a dataset: a ``--dataset`` that was given must be there (else a usage error naming it,
    exit status 2 as argparse's, before any model loads: a silent fallback measured nothing that was asked for).
    The script's ``default`` may be absent (a machine without ../shared): then ``fallback``, saying so on stderr
    (``()``: no texts, for scripts whose :func:`make_prompt_ids` then makes synthetic token ids)."""
    import sys

    if not path or not os.path.isfile(path):
        if default is not None and path == default:
            using = f"{len(fallback)} built-in prompts" if fallback else "synthetic token ids"
            print(f"note: the default dataset {path} is not on this machine: using {using} (give --dataset for real "
                  "ones)", file=sys.stderr)
            return list(fallback)[:limit]
        _dataset_error(f"{path!r}: no such file (a JSONL of {{'turns': [...]}} records is needed)")
    texts = load_prompt_texts(path, limit)
    if not texts:
        _dataset_error(f"{path!r}: no record with a non-empty first turn")
    return texts


def _dataset_error(message: str) -> None:
    """An argparse-style usage error about ``--dataset`` (exit status 2: the flag's value was wrong)."""
    import sys

    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script"
    sys.stderr.write(f"{prog}: error: argument --dataset: {message}\n")
    raise SystemExit(2)


# ---- numbers that may not exist: None in JSON, "n/a" in tables ----------------------------------------------------


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the denominator is 0 (nothing to compare)."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    value = numerator / denominator
    return value if math.isfinite(value) else None


def fmt(value: float | None, spec: str = ".2f", scale: float = 1.0) -> str:
    """``value * scale`` formatted with ``spec``; "n/a" for None or a non-finite value."""
    if value is None or not math.isfinite(value):
        return "n/a"
    return format(value * scale, spec)


def finite_or_none(value):
    """A JSON-able copy of ``value`` with every NaN / infinity replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if isinstance(value, np.generic) and np.issubdtype(value.dtype, np.floating):
        return float(value) if np.isfinite(value) else None
    return value


def load_prompt_texts(path: str | None, limit: int = 256) -> list[str]:
    """First turns of a ``{"turns": [...]}`` JSONL file (MT-Bench / Spec-Bench format); [] when absent."""
    if not path or not os.path.exists(path):
        return []
    texts = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rec = json.loads(line)
                turns = rec.get("turns") or [rec.get("instruction", "")]
                if turns and turns[0]:
                    texts.append(turns[0])
            if len(texts) >= limit:
                break
    return texts


def make_prompt_ids(tokenizer, texts: list[str], num: int, prompt_len: int, vocab_size: int, seed: int = 0,
                    chat: bool = False) -> tuple[list[list[int]], str]:
    """``num`` prompts of exactly ``prompt_len`` token ids: real text (cut / repeated to length) when a tokenizer
    and texts exist, else synthetic ids. With ``chat``: each question whole in the tokenizer's chat template (what
    a chat server sees; the model answers rather than continues prose), the questions whose prompt fits in
    ``prompt_len`` tokens, in turn. Returns (prompts, source description; "built-in" for :data:`BUILT_IN_PROMPTS`,
    a missing default dataset's fallback)."""
    origin = "built-in" if texts and list(texts) == list(BUILT_IN_PROMPTS)[:len(texts)] else "dataset"
    if chat:
        if tokenizer is None or not texts or not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError("chat prompts need a dataset of questions and a tokenizer with a chat template")
        fitting = [ids for ids in (tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]),
                                                    add_special_tokens=False) for t in texts) if len(ids) <= prompt_len]
        if not fitting:
            raise ValueError(f"no question of the dataset fits in {prompt_len} tokens with the chat template: raise "
                             "the prompt length")
        return [fitting[i % len(fitting)] for i in range(num)], f"{origin}-chat"
    if tokenizer is not None and texts:
        out = []
        for i in range(num):
            ids = list(tokenizer.encode(texts[i % len(texts)]))
            j = 1
            while len(ids) < prompt_len:  # short question: append the next one
                ids += list(tokenizer.encode(" " + texts[(i + j) % len(texts)]))
                j += 1
            out.append(ids[:prompt_len])
        return out, origin
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab_size, prompt_len).tolist() for _ in range(num)], "synthetic"


def memory_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Read bandwidth of a float32 sum over ``num_bytes``, ``repeats`` times each with numpy (one core) and jitted
    JAX (all cores). Returns GB/s (1e9 bytes): ``numpy_gbs`` and ``jax_gbs`` (the best of each), ``best_gbs``
    (the best of all: the peak), and ``jax_median_gbs`` (the median JAX read: what a sustained stream sees). On a
    shared VM single reads swing widely (seen here: 41-75 GB/s within a minute; a C++ 2-thread stream read 44-48
    at the same moments), so the peak overstates what a 10 ms decode step can count on; reports give both."""
    a = np.ones(num_bytes // 4, np.float32)
    best_np = min(_timed(lambda: a.sum()) for _ in range(repeats))
    probe = ReadProbe(num_bytes)
    jax_times = [probe.seconds() for _ in range(repeats)]
    res = {"numpy_gbs": num_bytes / best_np / 1e9, "jax_gbs": num_bytes / min(jax_times) / 1e9, "bytes": num_bytes,
           "jax_median_gbs": num_bytes / float(np.median(jax_times)) / 1e9}
    res["best_gbs"] = max(res["numpy_gbs"], res["jax_gbs"])
    return res


class ReadProbe:
    """One timed read of ``num_bytes`` (a jitted float32 sum over a device array of that size): the memory
    bandwidth of one moment. Reads interleaved with decode steps sample the same moments of a shared VM's memory
    system as the steps do (here its bandwidth flips between ~22-30 and ~37-46 GB/s within seconds, 2026-12-03:
    a best read taken minutes apart from a run does not describe the run)."""

    def __init__(self, num_bytes: int):
        import jax
        import jax.numpy as jnp

        self.num_bytes = num_bytes - num_bytes % 4
        self._x = jnp.ones(self.num_bytes // 4, jnp.float32)
        self._sum = jax.jit(jnp.sum)
        self._sum(self._x).block_until_ready()

    def seconds(self) -> float:
        return _timed(lambda: self._sum(self._x).block_until_ready())


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def state_bytes(state, *, as_float32: bool = False, one_row: bool = False) -> int:
    """Total bytes of a model's weights (a pytree of arrays) as held; with ``one_row``, the bytes a one-row step
    reads (a compact weight with float32 beside it counts its compact bytes only); with ``as_float32``, every weight
    as a float32 (compact layouts counted by the float32 elements they hold)."""
    import jax

    from kernels_pallas.linear import cpu

    def nbytes(x) -> int:
        compact = cpu.is_compact(x)
        if as_float32 and compact:
            return 4 * cpu.in_features(x, transposed=cpu.is_q8(x)) * cpu.out_features(x, transposed=cpu.is_q8(x))
        if as_float32:
            return 4 * int(np.prod(x.shape))
        if one_row and compact:
            return cpu.compact_bytes(x)
        return int(np.prod(x.shape)) * x.dtype.itemsize

    return int(sum(nbytes(x) for x in jax.tree_util.tree_leaves(state) if hasattr(x, "shape")))


def pages_needed(batch_size: int, prompt_len: int, output_len: int, gamma_max: int, page_size: int = 16) -> int:
    """KV pages that hold a whole workload with no preemption (+ page 0 reserved, + slack)."""
    per_seq = -(-(prompt_len + output_len + gamma_max + 2) // page_size)
    return batch_size * per_seq + 8


@dataclass
class DecodeRun:
    """One workload through the engine: decode-only numbers from ``step_log``."""

    batch_size: int
    gamma: int
    num_decode_steps: int
    decode_seconds: float  # summed wall seconds of decode steps
    committed_tokens: int
    draft_seconds: float
    verify_seconds: float
    catchup_seconds: float
    total_seconds: float  # whole generate() wall, prefill included
    mean_accepted_length: float  # committed tokens per sequence per decode step
    gamma_steps: dict | None = None  # γ -> decode steps that ran it (the planner's choices when γ was not forced)

    @property
    def tokens_per_second(self) -> float:
        return self.committed_tokens / self.decode_seconds

    @property
    def tpot_ms(self) -> float:
        return 1e3 * self.decode_seconds / self.num_decode_steps / self.mean_accepted_length

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(tokens_per_second=self.tokens_per_second, tpot_ms=self.tpot_ms)
        return d


def run_decode_workload(llm, prompts: list[list[int]], output_len: int, gamma: int | None = 0,
                        logprobs: int | None = None) -> DecodeRun:
    """Generate ``output_len`` greedy tokens for every prompt at a forced γ (None: the engine's planner picks γ
    each step, and keeps what it learned across calls), with ``SamplingParams.logprobs``; time decode steps only."""
    from nightjar_jax import SamplingParams

    engine = llm.engine
    engine.record_steps = True
    engine.stats.step_log.clear()
    if gamma is None:
        engine.__dict__.pop("_select_gamma", None)  # undo an earlier forced γ: the class method asks the planner
    elif engine.draft is not None:
        engine._select_gamma = lambda: gamma if engine.scheduler.num_decoding() else 0
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, logprobs=logprobs)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    total = time.perf_counter() - t0
    log = list(engine.stats.step_log)
    engine.stats.step_log.clear()
    steps = len(log)
    seq_steps = sum(s["batch_size"] for s in log)
    committed = sum(s["committed"] for s in log)
    return DecodeRun(
        batch_size=len(prompts), gamma=gamma, num_decode_steps=steps,
        decode_seconds=sum(s["seconds"] for s in log), committed_tokens=committed,
        draft_seconds=sum(s["draft_seconds"] for s in log), verify_seconds=sum(s["verify_seconds"] for s in log),
        catchup_seconds=sum(s["catchup_seconds"] for s in log), total_seconds=total,
        mean_accepted_length=committed / seq_steps if seq_steps else 0.0,
        gamma_steps=dict(sorted(collections.Counter(s["gamma"] for s in log).items())),
    )


def host_share(llm, prompts: list[list[int]], output_len: int, warm: bool = False) -> dict:
    """Share of decode-step wall time spent outside the jitted forward call (dispatch + device + block).
    ``warm``: run the workload once untimed first, for a batch whose shapes have not run yet (their compiles,
    inside the timed steps and calls, made the share far too low)."""
    import jax

    if warm:
        run_decode_workload(llm, prompts, output_len)
    runner = llm.engine.runner
    inner = runner._forward_sample
    call_seconds: list[float] = []

    def timed(*args):
        t0 = time.perf_counter()
        out = inner(*args)
        jax.block_until_ready(out)
        if args[3].shape[1] == 1:  # tokens [S, 1]: a decode step (prefill chunks are longer)
            call_seconds.append(time.perf_counter() - t0)
        return out

    runner._forward_sample = timed
    try:
        run = run_decode_workload(llm, prompts, output_len)
    finally:
        runner._forward_sample = inner
    step = run.decode_seconds / run.num_decode_steps
    device = sum(call_seconds) / len(call_seconds)
    return {"batch_size": len(prompts), "step_ms": 1e3 * step, "forward_call_ms": 1e3 * device,
            "host_ms": 1e3 * (step - device), "host_fraction": (step - device) / step,
            "num_steps": run.num_decode_steps}


def machine_note() -> dict:
    import jax

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
    }


def make_parent(path: str | os.PathLike) -> str | os.PathLike:
    """Create ``path``'s folder if it is missing (a ``writable_out`` path, just before it is written); returns it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def write_json(path: str, payload: dict) -> None:
    make_parent(path)
    with open(path, "w") as f:
        # (NaN is a last guard here: the scripts write None where a value could not be measured)
        json.dump(finite_or_none(payload), f, indent=2, default=float)
