"""Our own checkpoint format: an orbax PyTree of HF-named arrays plus the config as JSON.

Layout of a checkpoint directory::

    <dir>/nightjar_config.json   # {"format": "nightjar-orbax", "version": 1, "config": ModelConfig.to_dict()}
    <dir>/params/                # orbax PyTreeCheckpointer: {hf_name: array [out, in]} (HF names and layout)
    <dir>/tokenizer/             # optional: copied tokenizer files (tokenizer.json / tokenizer.model / a folder's)

Storing HF names/layout keeps one validation path (``state_from_hf``) for every format.

Orbax (tensorstore's OCDBT) stores no checksums: a checkpoint whose data bytes were changed (a bad disk, a copy
that flipped bits) loads without a word, with wrong weights; a truncated or missing piece is an error. Keep a
checksum of your own (``sha256sum -r``) beside checkpoints that travel.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np

from nightjar_jax.config import ModelConfig, RopeScaling
from nightjar_jax.models.hf import first_line

logger = logging.getLogger(__name__)

CONFIG_FILE = "nightjar_config.json"
FORMAT_NAME = "nightjar-orbax"
FORMAT_VERSION = 1
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # (transformers' own files for the template)


def is_orbax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).exists()


def state_to_hf(cfg: ModelConfig, state: Any) -> dict[str, np.ndarray]:
    """HF-named ``[out, in]`` numpy arrays from an NNX ``State`` of :class:`Llama` (inverse of ``state_from_hf``)."""
    from flax import nnx

    from nightjar_jax.models.llama import hf_param_map

    flat = dict(nnx.to_flat_state(state))
    out = {}
    for hf_name, (path, transpose) in hf_param_map(cfg).items():
        leaf = flat[path]
        arr = np.asarray(leaf.get_value() if hasattr(leaf, "get_value") else leaf)
        out[hf_name] = arr.T if transpose else arr
    return out


def save_orbax(
    path: str | Path,
    config: ModelConfig,
    weights: Any,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write a checkpoint. ``weights``: an HF-named dict of arrays, an ``nnx.State`` or a ``(graphdef, state)``.

    ``tokenizer_dir``: a tokenizer folder or file to copy into ``<dir>/tokenizer`` (see :func:`_tokenizer_files`).
    Saving into an existing checkpoint replaces all of it: ``params/``, the config, and ``tokenizer/``, which is
    removed when no ``tokenizer_dir`` is given (an old tokenizer is never kept silently).
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    tokenizer_files = _tokenizer_files(tokenizer_dir)  # (checked before anything is written)
    if isinstance(weights, tuple) and len(weights) == 2:
        weights = weights[1]
    if isinstance(weights, dict) and all(isinstance(k, str) for k in weights):
        state_dict = {k: np.asarray(v) for k, v in weights.items()}
    else:
        state_dict = state_to_hf(config, weights)
    path.mkdir(parents=True, exist_ok=True)
    params = path / "params"
    if params.exists():
        shutil.rmtree(params)
    ocp.PyTreeCheckpointer().save(params, state_dict)
    _replace_tokenizer(path / "tokenizer", tokenizer_files)
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "config": config.to_dict()}
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    logger.info("saved %d tensors to %s", len(state_dict), path)
    return path


def _tokenizer_files(tokenizer_dir: str | Path | None) -> dict[Path, str]:
    """What :func:`save_orbax` copies into ``<dir>/tokenizer``: {source file: name there}, under the names
    :func:`load_orbax`'s reader looks for. A folder's ``tokenizer*``, ``special*`` and chat template files
    (:data:`CHAT_TEMPLATE_FILES`) keep their names; a single
    file is copied as ``tokenizer.json`` (a ``.json`` file) or ``tokenizer.model`` (a SentencePiece ``.model``)."""
    if tokenizer_dir is None:
        return {}
    src = Path(tokenizer_dir)
    if src.is_file():
        names = {".json": "tokenizer.json", ".model": "tokenizer.model"}
        if src.suffix not in names:
            raise ValueError(f"tokenizer_dir={src}: unknown tokenizer file type: allowed a folder, a .json "
                             f"(tokenizers) file or a SentencePiece .model file")
        return {src: names[src.suffix]}
    if not src.is_dir():
        raise FileNotFoundError(f"tokenizer_dir={src} does not exist")
    # (and the chat template's own files, which recent transformers writes beside tokenizer_config.json:
    # chat_template.jinja, chat_template.json, additional_chat_templates/ aside)
    files = {f: f.name for f in src.iterdir() if f.is_file() and (f.name.startswith(("tokenizer", "special"))
                                                                  or f.name in CHAT_TEMPLATE_FILES)}
    if not {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"} & set(files.values()):
        raise ValueError(f"tokenizer_dir={src}: no tokenizer.json, tokenizer_config.json or tokenizer.model in folder")
    return files


def _replace_tokenizer(dst: Path, files: dict[Path, str]) -> None:
    """Make ``dst`` hold exactly ``files`` (no folder when there are none), whatever an earlier save left there."""
    staged = dst.with_name(dst.name + ".new")  # (built beside dst: the files may come from the old dst itself)
    if staged.exists():
        shutil.rmtree(staged)
    if files:
        staged.mkdir()
        for f, name in files.items():
            shutil.copy2(f, staged / name)
    if dst.exists():
        shutil.rmtree(dst)
    if staged.exists():
        staged.rename(dst)


def load_orbax(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray], Path | None]:
    """Config, HF-named numpy state dict and the tokenizer folder (None if none was saved).

    Any failure of orbax's restore (an empty, partial or truncated ``params/``, a missing manifest) is one
    ``ValueError``: ``<dir>/params: not a readable orbax checkpoint (<the cause's first line>): ...``. Changed data
    bytes are not detected (no checksums; see the module docstring)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta_path = path / CONFIG_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE} (not a checkpoint written by save_orbax)")
    cfg = read_config(meta_path)
    params = path / "params"
    if not params.exists():
        raise FileNotFoundError(f"{path}: params/ is missing")
    try:
        with _draining_event_loops():
            restored = ocp.PyTreeCheckpointer().restore(params)
    except Exception as e:  # noqa: BLE001 - orbax / tensorstore raise many types, with multi-line JSON specs
        raise ValueError(f"{params}: not a readable orbax checkpoint ({_short_cause(e, params)}): it is incomplete "
                         f"or damaged; write it again with save_orbax (or copy it whole)") from None
    state_dict = {k: np.asarray(v) for k, v in restored.items()}
    tok = path / "tokenizer"
    return cfg, state_dict, tok if tok.exists() and any(tok.iterdir()) else None


def _short_cause(exc: Exception, params: Path, limit: int = 160) -> str:
    """The first line of a restore error, without tensorstore's JSON spec or the folder the message already names:
    ``OUT_OF_RANGE: Error reading "model.norm.weight/0.0" ...: Requested byte range [0, 128) is not valid ...``."""
    text = first_line(exc, 10**6) or type(exc).__name__
    text = text.split(" [tensorstore_spec=")[0].replace(f' in OCDBT database at local file "{params}/"', "")
    return first_line(text.replace(f" at {params}", "").replace(str(params), "params/"), limit)


class _DrainingEventLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``close`` first waits (up to 30 s) for the tasks still pending on it.

    orbax runs each restore step in a fresh loop (``asyncio_utils.run_sync``) and closes it when the step returns.
    When one tensorstore read fails, ``asyncio.gather`` returns at once and the loop closed while the other reads
    were in flight: each then finished on tensorstore's thread, called ``call_soon_threadsafe`` on the closed loop,
    and printed a ``RuntimeError: Event loop is closed`` traceback, however many, after the one-line error (serve's
    start-up showed them; it varied per run)."""

    def close(self) -> None:
        if not self.is_running() and not self.is_closed():
            pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            if pending:
                done, _ = self.run_until_complete(asyncio.wait(pending, timeout=30.0))
                for task in done:
                    if not task.cancelled():
                        task.exception()  # (retrieved: no "Task exception was never retrieved" log at exit)
        super().close()


class _DrainingPolicy(asyncio.AbstractEventLoopPolicy):
    """The policy in place with one change: the loops it makes are :class:`_DrainingEventLoop`. Every thread's loop
    stays the inner policy's (``get_event_loop`` / ``set_event_loop`` go to it), so a thread that reads or sets its
    loop while a restore runs elsewhere sees what it would see without it."""

    def __init__(self, inner: asyncio.AbstractEventLoopPolicy):
        self.inner = inner

    def get_event_loop(self) -> asyncio.AbstractEventLoop:
        return self.inner.get_event_loop()

    def set_event_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.inner.set_event_loop(loop)

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _DrainingEventLoop()

    # (asyncio subprocesses ask the policy for its child watcher on Python 3.11-3.13; the abstract base's raise)
    def get_child_watcher(self) -> Any:
        return self.inner.get_child_watcher()

    def set_child_watcher(self, watcher: Any) -> None:
        self.inner.set_child_watcher(watcher)

    def __getattr__(self, name: str) -> Any:  # (the child-watcher calls of Pythons that have them)
        if name == "inner":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.inner, name)


_POLICY_LOCK = threading.Lock()
_policy_users: list = [0, None]  # restores under way, and the policy to put back when the last one ends


@contextlib.contextmanager
def _draining_event_loops():
    """New event loops made inside are :class:`_DrainingEventLoop` (orbax makes its loops with
    ``asyncio.new_event_loop`` where no loop runs in the restoring thread; where one runs, it makes its own and this
    changes nothing). Restores in several threads share one swap: the first puts the draining policy in, the last
    puts the one before back."""
    with _POLICY_LOCK:
        if _policy_users[0] == 0:
            _policy_users[1] = asyncio.get_event_loop_policy()
            asyncio.set_event_loop_policy(_DrainingPolicy(_policy_users[1]))
        _policy_users[0] += 1
    try:
        yield
    finally:
        with _POLICY_LOCK:
            _policy_users[0] -= 1
            if _policy_users[0] == 0:
                asyncio.set_event_loop_policy(_policy_users[1])
                _policy_users[1] = None


def read_config(meta_path: Path) -> ModelConfig:
    """The :class:`ModelConfig` in ``nightjar_config.json``; anything wrong with the file is a ``ValueError`` that
    starts with its path and names the field at fault (and what is allowed)."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError)
        raise ValueError(f"{meta_path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: must be a JSON object {{format, version, config}}, got {type(meta).__name__}")
    if meta.get("format") != FORMAT_NAME or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: unknown format {meta.get('format')!r} version {meta.get('version')!r}")
    fields = meta.get("config")
    if not isinstance(fields, dict):
        got = "nothing" if "config" not in meta else "null" if fields is None else type(fields).__name__
        raise ValueError(f"{meta_path}: 'config' must be a JSON object of ModelConfig fields, got {got}")
    fields = dict(fields)
    allowed = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        raise ValueError(f"{meta_path}: unknown config field(s) {unknown}: allowed {allowed}")
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in fields
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{meta_path}: config is missing the required field(s) {missing}")
    rope = fields.get("rope_scaling")
    if rope is not None:
        rope_allowed = [f.name for f in dataclasses.fields(RopeScaling)]
        if not isinstance(rope, dict) or set(rope) - set(rope_allowed):
            raise ValueError(f"{meta_path}: config.rope_scaling={rope!r} is invalid: allowed null or an object with "
                             f"the keys {rope_allowed} (Llama 3 scaling)")
    eos = fields.get("eos_token_ids")
    if eos is not None and not isinstance(eos, list):
        raise ValueError(f"{meta_path}: config.eos_token_ids={eos!r} is invalid: allowed a list of token ids")
    fields["eos_token_ids"] = tuple(eos or ())
    try:
        if rope is not None:
            fields["rope_scaling"] = RopeScaling(**rope)
        cfg = ModelConfig(**fields)
    except ValueError as e:  # ModelConfig's and RopeScaling's checks (ConfigError) name the field
        raise type(e)(f"{meta_path}: config.{e}") from None
    except TypeError as e:
        raise ValueError(f"{meta_path}: config holds a value of the wrong type ({e})") from None
    return cfg  # (ModelConfig checks the BOS and EOS ids against vocab_size)
