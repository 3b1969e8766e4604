"""The OpenAI-compatible HTTP API over an :class:`AsyncEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as server-sent
events ending in ``data: [DONE]``), ``POST /v1/responses`` (OpenAI's Responses API, stateless), ``GET /v1/models``
(and ``/v1/models/{name}``), ``GET /health`` (``/ping``),
``GET /version``, ``GET /metrics``, and vLLM's ``POST /tokenize`` and ``POST /detokenize``.

Every error is answered in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
input (malformed JSON, invalid UTF-8 or Unicode, wrong types, unknown fields, bad values, prompts longer than the
context, a prompt plus an explicit ``max_tokens`` past it), with ``param`` naming the field at fault; 401 for a
missing / wrong API key, 404 for an unknown model or route, 413 for a body over the size limit; 500 when the engine
failed while serving the request (a streamed response, already under way, ends with an ``{"error": ...}`` event
before ``[DONE]``).

One HTTP request becomes one **group** of engine requests (``len(prompts) * n`` members); choice ``i`` of the
response is member ``i`` (prompt ``i // n``, sample ``i % n``, seeded ``seed + i % n`` (wrapping past 2**63 - 1 to
0) when a seed is given). When the client goes away the whole group is aborted, which frees its KV pages at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from nightjar_jax.config import ModelConfig
from nightjar_jax.engine.beam_search import BeamSearchOutput, expansion
from nightjar_jax.engine.engine import SLEEP_TAGS
from nightjar_jax.engine.outputs import RequestOutput
from nightjar_jax.engine.sampling_params import (
    MAX_LOGPROBS,
    InvalidRequestError,
    SamplingParams,
    StructuredOutputs,
    child_seed,
    clip,
    short_repr,
)
from nightjar_jax.models.tokenizer import ChatTemplateArgumentError, IncrementalDetokenizer, template_message
from nightjar_jax.server import reasoning_parsers, tool_parsers
from nightjar_jax.server.async_engine import AsyncEngine, EngineShuttingDown, GroupStream
from nightjar_jax.server.metrics import ServerMetrics
from nightjar_jax.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
    UpdateWeightsRequest,
    chat_logprobs,
    completion_logprobs,
    number_range,
    prompt_logprobs_json,
    top_entries,
)
from nightjar_jax.server.reasoning_parsers import REASONING_PARSERS, ReasoningStream

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    served_model_aliases: tuple[str, ...] = ()  # more names requests may use (responses carry served_model_name)
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    disconnect_poll_seconds: float = 0.5  # how often a non-streaming request checks that its client is still there
    tool_call_parser: str | None = None  # tool_choice "auto" reads calls with it (tool_parsers.py); None: a 400
    reasoning_parser: str | None = None  # chat answers' <think> text as reasoning_content (reasoning_parsers.py)
    enable_sleep_mode: bool = False  # POST /sleep, POST /wake_up and GET /is_sleeping (vLLM's)
    enable_weight_updates: bool = False  # POST /update_weights_from_disk (SGLang's)
    # a chat request's own chat_template is rendered (vLLM's --trust-request-chat-template); else it is a 400
    trust_request_chat_template: bool = False
    # how the template gets each message's content (vLLM's --chat-template-content-format): "auto" (parts for a
    # template that loops over them, else a string), "string" or "openai" (tokenizer.chat_content_format)
    chat_template_content_format: str = "auto"
    # vLLM's HTTP front: CORS (browser clients on other origins; vLLM's defaults allow any), an X-Request-Id header on
    # every response (--enable-request-id-headers: the request's own, else a new one), and FastAPI's /docs pages
    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    enable_request_id_headers: bool = False
    disable_fastapi_docs: bool = False
    max_logprobs: int = MAX_LOGPROBS  # vLLM's --max-logprobs: the most log-probabilities per token a request may ask
    log_requests: bool = False  # vLLM's --enable-log-requests: a log line per generation request queued
    profiler_dir: str | None = None  # POST /start_profile and /stop_profile trace into it (vLLM's profiler endpoints)


def _printable_id(value: str) -> bool:
    """Whether a request id (an X-Request-Id header's) is printable ASCII: it names the response and is sent back in
    a header, where control characters and raw bytes were echoed."""
    return all(" " <= c <= "~" for c in value)


class _RequestIdHeaders:
    """ASGI middleware (vLLM's ``--enable-request-id-headers``): every HTTP response carries ``X-Request-Id``, the
    request's own header or a new id. Pure ASGI, so streams and disconnects pass through untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # (the first such header, as the request's own id reads it)
        sent = next((v for k, v in scope.get("headers") or [] if k.lower() == b"x-request-id" and v), None)
        if sent is None or not _printable_id(sent.decode("latin-1")):  # (control bytes are not sent back: a new id)
            sent = uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", sent)]}
            await send(message)

        return await self.app(scope, receive, send_with_id)


class _InternalErrors:
    """ASGI middleware, innermost of the app's own: an unhandled exception becomes the API's 500 here, inside the
    CORS and request-id middlewares, so the answer carries their headers (Starlette's own 500 handler runs outside
    every middleware: a browser saw an opaque CORS failure)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracking(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as exc:
            if started:  # (a response under way cannot become a 500)
                raise
            logger.exception("unhandled error")
            response = JSONResponse(APIError(500, f"internal error: {exc}", type="internal_error").body(),
                                    status_code=500)
            await response(scope, receive, send)


# the routes whose requests run on the engine (vLLM's load-aware calls); /load counts those in flight
LOAD_TRACKED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations")


class _LoadTracking:
    """ASGI middleware: how many requests to :data:`LOAD_TRACKED_PATHS` are in flight, a stream until its last
    frame is sent (vLLM's ``server_load_metrics``, read at ``GET /load``)."""

    def __init__(self, app, counter: list[int]):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in LOAD_TRACKED_PATHS:
            return await self.app(scope, receive, send)
        self.counter[0] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter[0] -= 1


class _ClientGone(Exception):
    pass


# Pydantic's tags for the members of a union field (``prompt``, ``stop``, a message's ``content``), as the error
# message lists what is allowed.
_TYPE_NAMES = {
    "str": "a string",
    "list[str]": "a list of strings",
    "list[int]": "a list of token ids (integers)",
    "list[list[int]]": "a list of token-id lists",
    "list[TextPart]": "a list of text parts ({\"type\": \"text\", \"text\": ...})",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "dict[str,any]": "a JSON object",
    "list[dict[str,any]]": "a list of JSON objects",
}


def _is_type_tag(item: Any) -> bool:
    return isinstance(item, str) and (item in _TYPE_NAMES or "[" in item or item[:1].isupper())


def _field_path(loc: tuple | list) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content``."""
    out = ""
    for item in loc:
        out += f"[{item}]" if isinstance(item, int) else (f".{item}" if out else str(item))
    return out


def _as_sent(value: Any, limit: int = 80) -> str:
    """A value of the request body as JSON (``true``, ``null``), cut to ``limit`` characters."""
    try:
        return clip(json.dumps(value, ensure_ascii=False), limit)
    except (TypeError, ValueError):
        return short_repr(value, limit)


def validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> APIError:
    """The first error of a request body's validation, naming the field; a union field (e.g. ``prompt``) lists the
    types it takes instead of pydantic's error per member type; NaN or Infinity for a number (of ``model``) says
    the range it takes."""
    errors = exc.errors()
    first = errors[0]
    loc = tuple(first["loc"])
    k = next((i for i, item in enumerate(loc) if _is_type_tag(item)), None)
    if k is None:
        path = _field_path(loc)
        got = f" (got {_as_sent(first['input'])})" if path else ""
        msg = first["msg"].removeprefix("Value error, ")  # (a validator's own message reads as it was written)
        if first["type"] == "finite_number" and loc and isinstance(loc[0], str):
            allowed = number_range(model, loc[0])
            msg = "must be a finite number" + (f" in {allowed}" if allowed.startswith(("[", "(")) else
                                               f" {allowed}" if allowed else "")
        return APIError(400, f"'{path}': {msg}{got}" if path else msg, param=path or None)
    prefix = loc[:k]
    tags = list(dict.fromkeys(e["loc"][k] for e in errors if tuple(e["loc"][:k]) == prefix and len(e["loc"]) > k))
    whole = next((e["input"] for e in errors if tuple(e["loc"]) == (*prefix, tags[0])), first["input"])
    path = _field_path(prefix)
    allowed = ", ".join(_TYPE_NAMES.get(t, t) for t in tags)
    return APIError(400, f"'{path}' must be one of: {allowed}; got {_as_sent(whole)}", param=path)


def find_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) in parsed JSON holding a lone UTF-16 surrogate (``"\\ud800"``
    escapes parse into one; no text can be encoded with it), or None."""
    if isinstance(value, str):
        return path if any("\ud800" <= ch <= "\udfff" for ch in value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if find_surrogate(key) is not None:
                return sub
            hit = find_surrogate(item, sub)
            if hit is not None:
                return hit
    if isinstance(value, list):
        for i, item in enumerate(value):
            hit = find_surrogate(item, f"{path}[{i}]")
            if hit is not None:
                return hit
    return None


def check_checkpoint(spec: str, served: ModelConfig, engine_config) -> None:
    """What loading checkpoint ``spec`` in place of a model of config ``served`` would refuse that can be told
    without its weights, raised as the load raises it (``ValueError``, ``OSError``): a path that does not exist, an
    unknown preset, and a checkpoint of another architecture, naming the fields that differ, where its config can
    be read alone (``loader.read_config``). A derived draft (``@skip=``) has its own config: the load checks it."""
    from nightjar_jax.models.loader import PRESET_FIELDS, config_differences, read_config
    from nightjar_jax.spec.drafts import parse_draft_spec

    base, skip, keep_first = parse_draft_spec(spec)
    new, preset = read_config(base, load_format=engine_config.load_format, dtype=engine_config.dtype)
    if new is None or skip is not None or keep_first is not None:
        return
    diff = config_differences(new, served, PRESET_FIELDS if preset else None)
    if diff:
        raise ValueError(f"{spec} is of another architecture than the served {served.name} (the checkpoint's vs the "
                         f"served model's: {', '.join(diff)}); only weights of the served model's config can replace "
                         f"its own")


def build_app(async_engine: AsyncEngine, settings: ServerSettings, metrics: ServerMetrics | None = None) -> FastAPI:
    """The FastAPI app. The engine thread starts with the app (if not yet running) and stops when it shuts down."""
    engine = async_engine.engine
    # the engine's reasoning parser starts structured outputs after the thought (engine/reasoning.py); the server
    # splits answers with it too, unless told another one
    gated = engine.config.reasoning_parser
    if settings.reasoning_parser is not None and settings.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={settings.reasoning_parser!r} is invalid: allowed None or one of "
                         f"{', '.join(REASONING_PARSERS)}")
    if gated is not None and settings.reasoning_parser not in (None, gated):
        raise ValueError(f"the server's reasoning_parser {settings.reasoning_parser!r} is not its engine's {gated!r}: "
                         "structured outputs start after the engine's thought, and the answers would be split by "
                         "another; give the same one (or None: the engine's)")
    if gated is not None and settings.reasoning_parser is None:
        settings = dataclasses.replace(settings, reasoning_parser=gated)
    metrics = metrics or ServerMetrics(engine, settings.served_model_name)
    metrics_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nightjar-metrics")
    if metrics.on_output not in async_engine.hooks.on_output:
        async_engine.hooks.on_output.append(metrics.on_output)
    model_names = {settings.served_model_name, engine.config.model, *settings.served_model_aliases}
    created = int(time.time())

    def splits_thought(spec: StructuredOutputs | None) -> bool:
        """A chat answer's thought is split off (reasoning_content): a reasoning parser is set, and the request has
        no structured output or one that starts after the thought (the engine's parser), or a regex or grammar,
        which may write one; else a JSON schema, JSON object or choice applies from the first token and leaves no
        room for a thought."""
        return settings.reasoning_parser is not None and (spec is None or gated is not None or spec.regex is not None
                                                          or spec.grammar is not None)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not async_engine.is_alive:
            async_engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, async_engine.stop)
        metrics_executor.shutdown(wait=False)

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if settings.disable_fastapi_docs else {}
    app = FastAPI(title="nightjar-jax", lifespan=lifespan, **docs)
    app.add_middleware(_InternalErrors)  # (added first: the innermost, so the ones below add their headers to a 500)
    server_load = [0]
    app.add_middleware(_LoadTracking, counter=server_load)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_credentials=settings.allow_credentials, allow_methods=list(settings.allowed_methods),
                           allow_headers=list(settings.allowed_headers))
    if settings.enable_request_id_headers:
        app.add_middleware(_RequestIdHeaders)
    app.state.async_engine = async_engine
    app.state.metrics = metrics

    # ---- errors -------------------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(APIError(400, str(exc)).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if under_v1(request):  # (no route to authorize: an unknown /v1 path or method is a 401 first, as vLLM's)
            try:
                authorize(request)
            except APIError as denied:
                return JSONResponse(denied.body(), status_code=denied.status)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind).body(), status_code=exc.status_code)

    @app.exception_handler(_ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: Exception):  # nobody reads the answer: no log, no traceback
        return Response(status_code=499)

    # (an unhandled exception is answered by _InternalErrors, inside the CORS and request-id middlewares)

    # ---- helpers ------------------------------------------------------------------------------------------------
    def under_v1(request: Request) -> bool:
        path, root = request.scope.get("path", ""), request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        return path == "/v1" or path.startswith("/v1/")

    def authorize(request: Request) -> None:
        if not settings.api_key:  # (an empty key is none, as vLLM's)
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # (as bytes: a header's raw bytes arrive latin-1 decoded, and compare_digest takes str only when ASCII)
        sent = token.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not secrets.compare_digest(sent, settings.api_key.encode("utf-8")):
            raise APIError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                type="authentication_error",
                code="invalid_api_key",
            )

    async def read_body(request: Request, model: type[BaseModel]) -> Any:
        data = await read_json(request)
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc, model) from None
        except RecursionError:
            raise too_deep() from None

    def too_deep() -> APIError:
        return APIError(400, "the request body is nested too deeply to read: send at most a few hundred levels of "
                             "JSON arrays and objects")

    async def read_json(request: Request) -> dict[str, Any]:
        """The body as a JSON object, within --max-body-bytes (read once: a second read, e.g. by the handler that
        /invocations hands the request to, gets the same bytes)."""
        kind = request.headers.get("content-type")
        if kind:  # (none, or a JSON media type, as FastAPI reads JSON bodies; vLLM asks for application/json itself.
            # A browser sends text/plain or a form cross-site without asking first, and it was read as JSON)
            media = kind.split(";")[0].strip().lower()
            if not (media == "application/json" or (media.startswith("application/") and media.endswith("+json"))):
                raise APIError(415, f"the request body is read as JSON: send it with Content-Type: application/json "
                                    f"(got {clip(kind, 80)!r})", type="invalid_request_error")
        raw = getattr(request, "_body", None)  # (Starlette's own cache of a body read: Request.body() sets it)
        if raw is None:
            raw = await _read_limited(request)
            request._body = raw
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise APIError(400, f"the request body is not valid UTF-8: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise too_deep() from None
        except ValueError as exc:  # (an integer past Python's 4300-digit limit for reading one)
            raise APIError(400, f"the request body holds a number this server cannot read: {exc}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            bad = find_surrogate(data)  # a "\ud800" escape parses into a string no tokenizer can take
        except RecursionError:
            raise too_deep() from None
        if bad is not None:
            raise APIError(400, f"'{bad}' holds a lone UTF-16 surrogate escape (\\ud800-\\udfff): text must "
                                f"be valid Unicode (a surrogate pair, or the character itself)", param=bad)
        return data

    async def _read_limited(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            raise APIError(
                413, f"the request body is over the {settings.max_body_bytes}-byte limit", code="request_too_large"
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > settings.max_body_bytes:
                raise APIError(
                    413, f"the request body is over the {settings.max_body_bytes}-byte limit", code="request_too_large"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(name: str | None) -> str:
        if name is not None and name not in model_names:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{settings.served_model_name}'"
                + "".join(f" (also named '{alias}')" for alias in settings.served_model_aliases),
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        return settings.served_model_name

    def check_max_tokens(max_tokens: int | None, param: str) -> int | None:
        if max_tokens is not None and max_tokens > engine.max_model_len:
            raise APIError(
                400, f"'{param}'={max_tokens} is more than the context length {engine.max_model_len}", param=param
            )
        return max_tokens

    def token_text(token: int) -> str:
        return engine.tokenizer.token_text(token)

    def id_in_use(request_id: str) -> APIError:
        return APIError(400, f"the request id {request_id!r} is in use by a request in flight: give each request its "
                             f"own 'request_id' (or X-Request-Id), or leave it out", param="request_id")

    def response_id(req, request: Request, prefix: str) -> str:
        """The response's id, ``<prefix>-<base>``: the base is the caller's (:func:`caller_id`) or a fresh one. The
        engine's requests are ``<id>-<i>``, so two requests in flight may not share a base (a 400 from
        :func:`add_group`)."""
        return f"{prefix}-{caller_id(req, request) or uuid.uuid4().hex}"

    def caller_id(req, request: Request) -> str | None:
        """The id the caller gave: the X-Request-Id header's (which wins, as in vLLM), else the body's
        ``request_id``; None for neither."""
        header = request.headers.get("x-request-id")
        if header is not None and len(header) > 256:  # (an empty one: as if none was sent)
            raise APIError(400, f"the X-Request-Id header has {len(header)} characters: allowed at most 256",
                           param="request_id")
        if header and not _printable_id(header):  # (it names the response and goes back in a header)
            raise APIError(400, "the X-Request-Id header holds control or non-ASCII characters: allowed printable "
                                "ASCII", param="request_id")
        return header or req.request_id or None

    def make_params(req, max_tokens: int | None, max_tokens_param: str = "max_tokens") -> SamplingParams:
        """The engine's sampling parameters; a bad value is a 400 naming the API's field (``top_logprobs`` for the
        chat API's per-token count, ``logprobs`` for the prompt's, ...)."""
        chat = isinstance(req, ChatCompletionRequest)
        names = {"max_tokens": max_tokens_param, "logprobs": "top_logprobs" if chat else "logprobs",
                 "prompt_logprobs": "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs",
                 "structured_outputs": req.structured_field()}
        try:
            params = req.sampling_params(max_tokens, engine.generation_defaults)
        except InvalidRequestError as exc:
            name = names.get(exc.field, exc.field)
            raise APIError(400, str(exc).replace(f"SamplingParams.{exc.field}", f"'{name}'"), param=name) from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        for field in ("logprobs", "prompt_logprobs"):  # (serve --max-logprobs, vLLM's)
            asked = getattr(params, field)
            if asked is not None and asked > settings.max_logprobs:
                raise APIError(400, f"'{names[field]}' asks for {asked} log-probabilities per token, more than this "
                                    f"server's --max-logprobs {settings.max_logprobs}", param=names[field])
        return params

    def tokenized(prompts: list[Any], params: SamplingParams, max_tokens_param: str | None,
                  chat: bool = False) -> list[Any]:
        """Each prompt as ``{"prompt", "prompt_token_ids"}`` (tokenized here, once, and cut to
        ``truncate_prompt_tokens``); with an explicit ``max_tokens`` (``max_tokens_param`` names it), a prompt whose
        length plus it passes the context length is a 400 (vLLM's rule) instead of a completion cut short. (A prompt
        alone too long is the engine's 400.)"""
        out = []
        max_tokens = params.max_tokens
        for prompt in prompts:
            try:
                text, ids = engine.truncate_prompt(*engine.tokenize_prompt(prompt), params)
            except ValueError as exc:
                raise APIError(400, str(exc), param="prompt") from None
            limit = engine.max_model_len
            if max_tokens_param is not None and max_tokens is not None and len(ids) < limit < len(ids) + max_tokens:
                raise APIError(
                    400,
                    f"the prompt has {len(ids)} tokens and '{max_tokens_param}' asks for {max_tokens} more: "
                    f"{len(ids) + max_tokens} is past the context length {limit}; ask for at most "
                    f"{limit - len(ids)}" + (f", or leave '{max_tokens_param}' out to generate up to the context "
                                             f"length" if chat else ""),  # (a completion's default is 16 tokens)
                    param=max_tokens_param,
                )
            out.append({"prompt": text, "prompt_token_ids": ids})
        return out

    async def add_group(prompts: list[Any], params: SamplingParams, n: int, request_id: str,
                        max_tokens_param: str | None = None, priority: int = 0,
                        structured_param: str = "structured_outputs", prompt_param: str = "prompt",
                        cache_salt: str | None = None) -> GroupStream:
        """Queue ``prompts`` x ``n`` members at ``priority`` (their prefix-cache pages salted with ``cache_salt``,
        vLLM's); ``max_tokens_param``: the field that set
        ``params.max_tokens`` explicitly (None: a default), checked against each prompt's length;
        ``structured_param``: the field that set the output constraint, which its errors name; ``prompt_param``: the
        field the prompt came from (chat: ``messages``), which a prompt's errors name."""
        try:
            prompts = await asyncio.to_thread(tokenized, prompts, params, max_tokens_param, prompt_param == "messages")
        except APIError as exc:
            if exc.param == "prompt":
                exc.param = prompt_param
            raise
        if params.structured_outputs is not None:
            # the backend's first build and a constraint's compile take seconds: here, off the engine's thread (the
            # backend's compiler caches the result, which add_request's matcher then finds)
            try:
                await asyncio.to_thread(lambda: engine.grammar_backend().compile(params.structured_outputs))
            except ValueError as exc:
                raise APIError(400, str(exc), param=structured_param) from None
        members, member_params = [], []
        for prompt in prompts:
            for j in range(n):
                members.append(prompt if cache_salt is None else {**prompt, "cache_salt": cache_salt})
                member_params.append(dataclasses.replace(params, seed=child_seed(params.seed, j)) if n > 1 else params)
        try:
            stream = await async_engine.add(members, member_params, request_id=request_id, priority=priority)
            stream.prompt_token_ids = [list(m["prompt_token_ids"]) for m in members]  # (per member, before output)
            stream.prompt_tokens = [len(ids) for ids in stream.prompt_token_ids]  # (usage before output)
            if settings.log_requests:  # (the prompts' lengths, not their text)
                logger.info("request %s queued: %d prompt(s) of %s tokens, n=%d, priority %d, %s", request_id,
                            len(prompts), [len(p["prompt_token_ids"]) for p in prompts], n, priority, params)
            return stream
        except ValueError as exc:
            field = getattr(exc, "field", None) or "prompt"
            if field == "request_id":
                raise id_in_use(request_id) from None
            names = {"structured_outputs": structured_param, "prompt": prompt_param}
            raise APIError(400, str(exc), param=names.get(field, field)) from None
        except RuntimeError as exc:
            raise APIError(503, str(exc), type="server_error") from None

    async def engine_call(fn, drain=None) -> Any:
        """:meth:`AsyncEngine.call`; too late for a stopping engine: the 503 a request gets then."""
        try:
            return await async_engine.call(fn, drain=drain)
        except EngineShuttingDown as exc:
            raise APIError(503, str(exc), type="server_error") from None

    beam_searches = [0]  # beam searches under way (each runs many engine steps, the engine idle between them)
    # weight updates waiting for the work in flight: a beam search that arrives meanwhile waits for them (it would
    # otherwise start under the old weights, its steps going ahead of the update as those of a search under way do)
    updates_waiting = [0]
    metrics.track_server(server_load, updates_waiting, beam_searches)
    updates_done = asyncio.Event()
    updates_done.set()

    async def beam_search(req, prompts: list[Any], max_tokens: int | None, request: Request,
                          prompt_param: str = "prompt", max_tokens_param: str | None = None,
                          request_id: str | None = None) -> list[BeamSearchOutput]:
        """``use_beam_search``: each prompt's ``n`` best sequences (``nightjar_jax/engine/beam_search.py``), every
        search step one group through the engine thread (one greedy token per live beam, with its top candidates'
        log-probabilities), all prompts' beams together; a client gone aborts the step's group (499).
        ``max_tokens_param``: the field that set ``max_tokens`` explicitly, checked against each prompt's length as
        for any request (:func:`tokenized`). ``request_id``: the response's id, held while the search runs (two
        requests in flight may not share one)."""
        params = req.beam_search_params(max_tokens or engine.generation_defaults.get("max_tokens")
                                        or engine.max_sequence_len)
        if max_tokens_param is not None:
            try:
                prompts = await asyncio.to_thread(tokenized, prompts, SamplingParams(max_tokens=max_tokens),
                                                  max_tokens_param, prompt_param == "messages")
            except APIError as exc:
                if exc.param == "prompt":
                    exc.param = prompt_param
                raise
        try:
            searches = await asyncio.to_thread(lambda: [engine.new_beam_search(p, params) for p in prompts])
        except ValueError as exc:
            raise APIError(400, str(exc), param=prompt_param) from None
        step, width = params.step_params(), 2 * params.beam_width
        while updates_waiting[0]:  # (runs under the new weights, as any request that arrives while an update waits)
            await updates_done.wait()
        if request_id is not None:
            try:
                async_engine.claim(request_id)
            except ValueError:
                raise id_in_use(request_id) from None
        beam_searches[0] += 1  # (in flight between its steps too: /sleep waits for it)
        try:
            return await run_beam_search(searches, step, width, req, request, prompt_param)
        finally:
            beam_searches[0] -= 1
            async_engine.release(request_id)

    async def run_beam_search(searches, step, width, req, request, prompt_param) -> list[BeamSearchOutput]:
        clock = [time.monotonic() + settings.disconnect_poll_seconds]  # (one disconnect check pace for all steps)
        while not all(s.done for s in searches):
            live = [s for s in searches if not s.done]
            asks = [(s, ids) for s in live for ids in s.pending()]
            try:
                salt = {"cache_salt": req.cache_salt} if getattr(req, "cache_salt", None) else {}
                group = await async_engine.add([{"prompt_token_ids": ids, **salt} for _, ids in asks],
                                               [step] * len(asks),
                                               priority=req.priority, bypass_drain=True)  # (one search, one set of
                # weights: its steps go ahead of a weight update that waits for it)
            except ValueError as exc:
                field = getattr(exc, "field", None) or prompt_param
                raise APIError(400, str(exc), param=prompt_param if field == "prompt" else field) from None
            except RuntimeError as exc:
                raise APIError(503, str(exc), type="server_error") from None
            outs = await collect(group, request, len(asks), clock)
            failure = engine_failure(outs)
            if failure is not None:
                raise failure
            if any(o.outputs[0].finish_reason == "abort" for o in outs):  # (a shutdown cut the step)
                raise APIError(503, "the engine is shutting down", type="server_error")
            for s in live:
                s.advance([expansion(o.outputs[0].logprobs[0], width)
                           for (owner, _), o in zip(asks, outs, strict=True) if owner is s])
        tok = engine.tokenizer
        return [s.best(None if tok is None else lambda ids: tok.decode(ids, req.skip_special_tokens))
                for s in searches]

    def beam_usage(results: list[BeamSearchOutput]) -> dict[str, Any]:
        prompt_tokens = sum(len(r.prompt_token_ids) for r in results)
        completion_tokens = sum(len(seq.tokens) for r in results for seq in r.sequences)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def engine_failure(outs: list[RequestOutput], structured_param: str = "structured_outputs") -> APIError | None:
        """When any of ``outs`` ended in an error (finish reason "error"): a 400 naming the field when it was the
        request's own (``RequestOutput.error_field``: a structured output's constraint came to a dead end), else a
        500: the engine failed while serving it."""
        failed = next((o for o in outs if o is not None and o.outputs[0].finish_reason == "error"), None)
        if failed is None:
            return None
        if failed.error_field is not None:
            field = structured_param if failed.error_field == "structured_outputs" else failed.error_field
            return APIError(400, f"this request could not be completed: {failed.error}", param=field)
        return APIError(500, f"the engine failed while serving this request: {failed.error or 'unknown error'}",
                        type="internal_error")

    async def collect(stream: GroupStream, request: Request, size: int,
                      clock: list[float] | None = None) -> list[RequestOutput]:
        """Wait for every member to finish; aborts the group if the client disconnects. ``clock`` ([the next
        disconnect check's time]) is shared by the calls of one request that runs several groups (a beam search's
        steps), each shorter than the poll: their checks keep the request's pace instead of restarting it."""
        finals: list[RequestOutput | None] = [None] * size
        poll = settings.disconnect_poll_seconds
        next_check = clock if clock is not None else [time.monotonic() + poll]
        try:
            while True:
                try:
                    item = await stream.next(timeout=poll)
                except TimeoutError:
                    item = False
                if time.monotonic() >= next_check[0]:  # outputs may arrive faster than the poll: check by the clock
                    next_check[0] = time.monotonic() + poll
                    if await request.is_disconnected():
                        raise _ClientGone()
                if item is False:
                    continue
                if item is None:
                    break
                index, out = item
                if out.finished:
                    finals[index] = out
        finally:
            stream.abort()  # no-op once finished; frees the pages on disconnect or cancellation
        return finals  # type: ignore[return-value]

    def usage(outs: list[RequestOutput], n: int, generated: bool = True) -> dict[str, Any]:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs[::n])
        completion_tokens = sum(len(o.outputs[0].token_ids) for o in outs) if generated else 0
        body: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if engine.config.cache.enable_prefix_caching:  # (OpenAI's field: prompt tokens whose K/V were cached)
            body["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in outs[::n])}
        return body

    def sse(data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def event_stream(body: AsyncIterator[str], stream: GroupStream) -> StreamingResponse:
        """The SSE response of ``body``, a generator that aborts ``stream`` when it is closed early; and, after the
        response, the abort once more (a no-op when it ran): a client gone before the first frame cancels the
        response before the generator ever starts, so its ``finally`` never runs and the request would run on to
        ``max_tokens`` with its pages, its output unread."""
        return StreamingResponse(body, media_type="text/event-stream", background=BackgroundTask(stream.abort))

    async def stream_events(
        stream: GroupStream, size: int, n: int, chunk, include_usage: bool, first: list[dict] | None = None,
        continuous_usage: bool = False, structured_param: str = "structured_outputs", generated: bool = True,
    ) -> AsyncIterator[str]:
        """SSE frames: ``chunk(index, out)`` per output (None = skip; with ``continuous_usage`` each carries its
        request's usage so far), usage when asked, then ``[DONE]``. ``generated`` False: the generated tokens are
        not part of the answer (echo with max_tokens 0), and usage counts none."""
        finals: list[RequestOutput | None] = [None] * size
        try:
            for frame in first or []:
                if continuous_usage:  # (a chat choice's role chunk: its prompt, nothing generated yet, as vLLM)
                    prompt = stream.prompt_tokens[frame["choices"][0]["index"]]
                    frame = {**frame, "usage": {"prompt_tokens": prompt, "completion_tokens": 0,
                                                "total_tokens": prompt}}
                yield sse(frame)
            async for index, out in stream:
                failure = engine_failure([out], structured_param)
                if failure is not None:  # (the response is under way: the error goes as an event)
                    finals[index] = out
                    # the tokens the failing step committed first (a speculative step commits several: they were
                    # counted in usage but never sent), as a frame without a finish reason; then the error
                    body = chunk(index, out)
                    if body is not None:
                        for choice in body.get("choices", []):
                            choice["finish_reason"] = None
                            if "stop_reason" in choice:
                                choice["stop_reason"] = None
                        if continuous_usage:
                            body["usage"] = usage([out], 1, generated)
                        yield sse(body)
                    yield sse(failure.body())
                    continue
                body = chunk(index, out)
                if body is not None:
                    if continuous_usage:
                        body["usage"] = usage([out], 1, generated)
                    yield sse(body)
                if out.finished:
                    finals[index] = out
            if include_usage:
                yield sse({**chunk(None, None), "choices": [], "usage": usage(finals, n, generated)})  # type: ignore[arg-type]
            yield "data: [DONE]\n\n"
        finally:
            stream.abort()  # the client went away (generator cancelled / closed): free the pages now

    # ---- endpoints ----------------------------------------------------------------------------------------------
    @app.get("/health")
    @app.head("/health", operation_id="health_head")  # (one route of two methods: a duplicate id in /openapi.json)
    async def health():
        if not async_engine.is_alive:
            return JSONResponse({"status": "error", "detail": "the engine thread is not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ping")
    @app.post("/ping", operation_id="ping_post")
    async def ping():
        """vLLM's (SageMaker's) liveness probe: /health under another name."""
        return await health()

    @app.get("/load")
    async def load():
        """vLLM's server load: the completion, chat, Responses and /invocations requests in flight (a stream until
        its last frame), for a load balancer's least-loaded choice."""
        return {"server_load": server_load[0]}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        """vLLM's: forget every cached prefix (``LLMEngine.reset_prefix_cache``), e.g. between benchmark runs so
        the next one starts cold. Requests in flight keep their pages and their outputs. A body is ignored, as
        vLLM's (clients send ``{}``)."""
        authorize(request)
        forgotten = await engine_call(lambda e: e.reset_prefix_cache())
        return {"success": True, "pages_forgotten": forgotten}

    if settings.profiler_dir is not None:
        @app.post("/start_profile")
        async def start_profile(request: Request):
            """vLLM's: trace the process with JAX's profiler (``LLMEngine.start_profile``) into --profiler-dir until
            ``POST /stop_profile``; a profile already running is a 409."""
            authorize(request)
            try:
                folder = await engine_call(lambda e: e.start_profile(settings.profiler_dir))
            except RuntimeError as exc:
                raise APIError(409, str(exc), type="conflict_error") from None
            except ValueError as exc:
                raise APIError(500, str(exc), type="server_error") from None
            return {"success": True, "profile_dir": folder}

        @app.post("/stop_profile")
        async def stop_profile(request: Request):
            """vLLM's: end the trace and write it; the answer names the run's folder (``*.trace.json.gz`` opens in
            Perfetto). None running is a 409."""
            authorize(request)
            try:
                run = await engine_call(lambda e: e.stop_profile())
            except RuntimeError as exc:
                raise APIError(409, str(exc), type="conflict_error") from None
            return {"success": True, "trace_dir": run}

    @app.get("/version")
    async def version():
        from nightjar_jax import __version__

        return {"version": __version__}

    if settings.enable_sleep_mode:
        async def only_params(request: Request, allowed: tuple[str, ...]) -> None:
            """Sleep-mode endpoints take query parameters only: an unknown one, or a body other than ``{}``, is a 400 (a
            misspelt ``level`` must not sleep at the default level)."""
            unknown = [k for k in request.query_params if k not in allowed]
            if unknown:
                raise APIError(400, f"unknown query parameter {unknown[0]!r}: allowed {', '.join(allowed)}",
                               param=unknown[0])
            body = (await request.body()).strip()
            if body and b"".join(body.split()) != b"{}":  # ({}: what client wrappers send; vLLM ignores a body)
                raise APIError(400, f"this endpoint takes no body: pass {' and '.join(allowed)} as query parameters "
                                    f"(?{allowed[0]}=...)", param=allowed[0])

        @app.post("/sleep")
        async def sleep(request: Request):
            """vLLM's sleep mode (``LLMEngine.sleep``): ``?level=1`` (default) moves the weights to host memory and
            discards the KV cache; ``?level=2`` discards both. Requests get a 503 until ``POST /wake_up``. Refused
            (409) while requests are in flight, a beam search between its steps included: nothing is dropped."""
            authorize(request)
            await only_params(request, ("level",))
            given = request.query_params.getlist("level") or ["1"]
            if len(given) > 1 or given[0] not in ("1", "2"):
                raise APIError(400, f"level must be given once, as 1 (weights to host memory, KV cache discarded) or "
                                    f"2 (weights and KV cache discarded), got {', '.join(map(repr, given))}",
                               param="level")
            level = int(given[0])

            def go(e):  # (on the engine thread, between two steps)
                if e.is_sleeping:
                    raise APIError(409, f"the engine is already asleep (level {e.sleep_level}): POST /wake_up first",
                                   type="conflict_error")
                # (server_load: requests still being tokenized or compiling a constraint, not yet queued, count too)
                busy = max(len(e.scheduler.running) + len(e.scheduler.waiting) + beam_searches[0], server_load[0])
                if busy:
                    raise APIError(409, f"{busy} request(s) are in flight: sleep needs an idle engine; retry once "
                                        f"they finish (or cancel them)", type="conflict_error")
                try:
                    e._check_not_shared("sleep")
                except RuntimeError as exc:
                    raise APIError(409, str(exc), type="conflict_error") from None
                return e.sleep(level)

            try:
                freed = await engine_call(go)
            except APIError:
                raise
            except ValueError as exc:
                raise APIError(400, str(exc), param="level") from None
            except Exception as exc:  # (moving the weights failed: nothing was released, the engine still serves)
                logger.exception("sleep failed")
                raise APIError(500, f"sleep failed: {exc}; nothing was released and the engine still serves",
                               type="internal_error") from None
            return {"is_sleeping": True, "level": level, "freed_bytes": freed}

        @app.post("/wake_up")
        async def wake_up(request: Request):
            """Undo ``/sleep``: every part, or those named by ``?tags=weights`` / ``?tags=kv_cache`` (repeatable). A
            failure to load the weights again (level 2) is a 500 and leaves the engine asleep: retry."""
            authorize(request)
            await only_params(request, ("tags",))
            tags = request.query_params.getlist("tags") or None
            bad = [t for t in tags or [] if t not in SLEEP_TAGS]
            if bad:
                raise APIError(400, f"tags must be among {', '.join(SLEEP_TAGS)} (repeat the parameter for both), got "
                                    f"{bad[0]!r}", param="tags")
            try:
                await engine_call(lambda e: e.wake_up(tags))
            except APIError:
                raise
            except Exception as exc:  # (the checkpoint of a level-2 sleep gone or unreadable: the server's fault)
                logger.exception("wake_up failed")
                raise APIError(500, f"waking the engine failed: {exc}; it is still asleep "
                                    f"({', '.join(sorted(engine.asleep_parts))}): fix the cause and retry",
                               type="internal_error") from None
            return {"is_sleeping": engine.is_sleeping}

        @app.get("/is_sleeping")
        async def is_sleeping(request: Request):
            authorize(request)
            return {"is_sleeping": engine.is_sleeping}

    if settings.enable_weight_updates:
        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request):
            """SGLang's endpoint (an RL loop's weight sync over HTTP): the target's and/or the draft's weights from a
            checkpoint on the server's disk (``LLMEngine.update_weights``). As SGLang's, it waits for the requests in
            flight (and beam searches under way) to finish under the old weights, and requests that arrive meanwhile
            wait to run under the new ones: no sample mixes the two. A checkpoint that cannot be loaded, or of
            another architecture, is a 400 and changes nothing. While the weights sleep, the update wakes them with
            the new ones."""
            authorize(request)
            req: UpdateWeightsRequest = await read_body(request, UpdateWeightsRequest)
            req.check()
            for spec, handle, param in ((req.model_path, engine.target, "model_path"),
                                        (req.draft_model_path, engine.draft, "draft_model_path")):
                if spec is None:
                    continue
                if handle is None:
                    raise APIError(400, "draft_model_path given, but this engine has no draft", param=param)
                try:  # (before the wait: a typo or another model must not hold every request, nor load in full)
                    await asyncio.to_thread(check_checkpoint, spec, handle.config, engine.config)
                except (ValueError, OSError) as exc:
                    raise APIError(400, f"the new weights could not be loaded: {exc}; the old ones are still "
                                        f"served", param=param) from None

            def go(e):
                try:
                    return e.update_weights(req.model_path, draft_weights=req.draft_model_path)
                except RuntimeError as exc:  # (weights another engine shares, a draft offloaded under load)
                    raise APIError(409, str(exc), type="conflict_error") from None
                except (ValueError, OSError) as exc:
                    reloaded = getattr(exc, "reloaded_field", None)
                    if reloaded is not None:
                        # (the part not given, loaded again from its own checkpoint: the server's state, not the
                        # request's fault)
                        part = "target" if reloaded == "weights" else "draft"
                        raise APIError(500, f"the {part}'s weights could not be loaded again from their checkpoint "
                                            f"for the update: {exc}; the engine still sleeps (give both paths, or "
                                            f"restore that checkpoint and POST /wake_up)", type="internal_error",
                                       ) from None
                    # (the part at fault, as the engine tags it: one of two paths given may be the bad one)
                    param = {"weights": "model_path", "draft_weights": "draft_model_path"}.get(
                        getattr(exc, "update_field", None),
                        "draft_model_path" if req.model_path is None else "model_path")
                    raise APIError(400, f"the new weights could not be loaded: {exc}; the old ones are still "
                                        f"served", param=param) from None

            updates_waiting[0] += 1
            updates_done.clear()
            try:
                aborted = async_engine.abort_all() if req.abort_all_requests else 0  # (SGLang's: no wait for them)
                relayout = await engine_call(go, drain=lambda e: e.has_unfinished_requests() or beam_searches[0])
            finally:
                updates_waiting[0] -= 1
                if not updates_waiting[0]:
                    updates_done.set()
            parts = [p for p, given in (("target", req.model_path), ("draft", req.draft_model_path)) if given]
            answer = {"success": True, "message": f"updated the {' and '.join(parts)} weights", "recompiles": relayout}
            if req.abort_all_requests:
                answer["num_aborted_requests"] = aborted
            if req.weight_version is not None:
                answer["weight_version"] = req.weight_version
            return answer

    @app.get("/metrics")
    @app.head("/metrics", operation_id="metrics_head")
    async def prometheus_metrics():
        # (rendered off the event loop: a scrape during a draft move waits for it, and /health and the streams must
        # not wait with it; in a thread of its own, so waiting scrapes hold none of the default pool's, which
        # prepares chat and completion requests)
        body = await asyncio.get_running_loop().run_in_executor(metrics_executor, metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def need_tokenizer():
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return engine.tokenizer

    def chat_prompt(req: ChatCompletionRequest) -> str | dict[str, Any]:
        """The chat request's prompt: its rendered text, encoded as the completion endpoints encode text, or with
        ``add_special_tokens`` false exactly as the template wrote it (no BOS added)."""
        text = render_chat(req)
        if req.add_special_tokens:
            return text
        return {"prompt": text, "prompt_token_ids": need_tokenizer().encode(text, add_special_tokens=False)}

    def prompt_text(prompt: str | dict[str, Any]) -> str:
        """A chat prompt's rendered text (``chat_prompt`` returns it, or it with its token ids)."""
        return prompt if isinstance(prompt, str) else prompt["prompt"]

    def render_chat(req: ChatCompletionRequest | TokenizeRequest) -> str:
        """A request's chat messages through the model's template (what /v1/chat/completions and /tokenize both
        encode): a template that renders tools (``tools``) or a conversation's tool calls and results gets them;
        ``continue_final_message`` ends the text inside the last message; ``chat_template_kwargs`` are the template's
        own variables."""
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "'continue_final_message' continues the last message and 'add_generation_prompt' "
                                "(true by default) starts a new one: set 'add_generation_prompt': false with it",
                           param="continue_final_message")
        # (an assistant's earlier thought reaches interleaved-thinking templates, as in vLLM)
        extra = ("name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content")
        rendered = [{"role": m.role, "content": m.content if not isinstance(m.content, list) else [
                        {"type": "text", "text": part.text} for part in m.content],  # (as the template takes it:
                     #                                                                 apply_chat_template's format)
                     **{k: v for k in extra if (v := getattr(m, k, None) or (m.model_extra or {}).get(k))}}
                    for m in req.messages]
        rendered = [template_message(m) for m in rendered]
        if req.chat_template is not None and not settings.trust_request_chat_template:
            raise APIError(400, "'chat_template' was sent with the request, but this server renders only its own "
                                "template: leave 'chat_template' out, or start the server with "
                                "--trust-request-chat-template (as vLLM's)", param="chat_template")
        tok = need_tokenizer()
        try:
            return tok.apply_chat_template(rendered, add_generation_prompt=req.add_generation_prompt,
                                           tools=req.tools or None, continue_final_message=req.continue_final_message,
                                           documents=getattr(req, "documents", None),  # (chat's; /tokenize has none)
                                           template_kwargs=req.chat_template_kwargs,
                                           chat_template=req.chat_template or None,  # ("": the server's, as vLLM)
                                           content_format=settings.chat_template_content_format)
        except APIError:
            raise
        except Exception as exc:  # no template, or the template rejected the messages
            param = exc.field if isinstance(exc, ChatTemplateArgumentError) else "messages"
            raise APIError(400, f"could not apply the chat template: {exc}", param=param) from None

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's endpoint: a prompt's (or chat messages') token ids, their count and the context length."""
        authorize(request)
        req: TokenizeRequest = await read_body(request, TokenizeRequest)
        check_model(req.model)
        req.check()
        tok = need_tokenizer()
        text = req.prompt if req.messages is None else await asyncio.to_thread(render_chat, req)

        def encode() -> dict[str, Any]:
            ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
            out = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
            if req.return_token_strs:  # (vLLM's: the tokens as the vocabulary spells them, e.g. "▁upon", "Ġthe")
                vocab = {i: t for t, i in tok.get_vocab().items()}
                out["token_strs"] = [vocab.get(i) for i in ids]
            return out

        # (off the event loop, as a completion's prompt: a megabyte of text held every connection for a second)
        return await asyncio.to_thread(encode)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's endpoint: the text of token ids, special tokens written out (as vLLM's, which decodes them all):
        what /tokenize encoded, ``<s>`` included, comes back."""
        authorize(request)
        req: DetokenizeRequest = await read_body(request, DetokenizeRequest)
        check_model(req.model)
        tok = need_tokenizer()
        vocab = min(engine.target.config.vocab_size, tok.vocab_size)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}): got {bad[:5]}", param="tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    def model_card(name: str | None = None) -> dict[str, Any]:
        return {
            "id": name or settings.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "nightjar-jax",
            "root": engine.config.model,
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorize(request)
        names = dict.fromkeys([settings.served_model_name, *settings.served_model_aliases])
        return {"object": "list", "data": [model_card(name) for name in names]}

    @app.get("/v1/models/{name:path}")
    async def retrieve_model(name: str, request: Request):
        """OpenAI's ``models.retrieve``: the served model's card (by its served name or its --model), else a 404."""
        authorize(request)
        check_model(name)
        return model_card(name if name in settings.served_model_aliases else None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req: CompletionRequest = await read_body(request, CompletionRequest)
        model = check_model(req.model)
        req.check_unsupported()
        prompts = req.prompts()
        if not req.add_special_tokens:  # text encoded as written, without the tokenizer's BOS (token ids as given)
            encode = need_tokenizer().encode
            prompts = await asyncio.to_thread(lambda: [
                {"prompt": p, "prompt_token_ids": encode(p, add_special_tokens=False)} if isinstance(p, str) else p
                for p in prompts])
        rid = response_id(req, request, "cmpl")
        as_ids = bool(req.return_tokens_as_token_ids)
        if req.echo and engine.tokenizer is None:
            raise APIError(400, "'echo' needs the model's tokenizer to render the prompt; this model has none",
                           param="echo")
        if req.use_beam_search:
            explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None
            results = await beam_search(req, prompts, check_max_tokens(req.max_tokens, "max_tokens"), request,
                                        max_tokens_param="max_tokens" if explicit else None, request_id=rid)
            choices = [{"index": i * req.n + j, "text": seq.text or "", "logprobs": None,
                        "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
                        **({"prompt_token_ids": list(r.prompt_token_ids), "token_ids": list(seq.tokens)}
                           if req.return_token_ids else {})}
                       for i, r in enumerate(results) for j, seq in enumerate(r.sequences)]
            return {"id": rid, "object": "text_completion", "created": int(time.time()),
                    "model": model, "choices": choices, "usage": beam_usage(results)}
        params = make_params(req, check_max_tokens(req.engine_max_tokens(), "max_tokens"))
        explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None and not req.prompt_only
        sfield = req.structured_field()
        stream = await add_group(prompts, params, req.n, rid, max_tokens_param="max_tokens" if explicit else None,
                                 priority=req.priority, structured_param=sfield, cache_salt=req.cache_salt)
        size, now = len(prompts) * req.n, int(time.time())
        base = {"id": rid, "object": "text_completion", "created": now, "model": model}

        def echoed(out: RequestOutput) -> tuple[str, list[int], list | None]:
            """echo: the prompt's text, its token ids and their log-probabilities (when asked)."""
            text = out.prompt if out.prompt is not None else engine.tokenizer.decode(out.prompt_token_ids, False)
            ids, lps = list(out.prompt_token_ids), out.prompt_logprobs
            if lps is not None and req.logprobs is not None:  # (prompt_logprobs may have asked for more)
                lps = top_entries(lps, ids, req.logprobs)
            return text, ids, lps

        def prompt_part(out: RequestOutput) -> dict[str, Any]:
            """vLLM's prompt_logprobs for a choice, when asked."""
            if req.prompt_logprobs is None:
                return {}
            lps = out.prompt_logprobs and top_entries(out.prompt_logprobs, list(out.prompt_token_ids),
                                                      req.prompt_logprobs)
            return {"prompt_logprobs": prompt_logprobs_json(lps)}

        def whole_choice(i: int, o: RequestOutput) -> dict[str, Any]:
            """Choice ``i`` of a finished output, whole (a non-streamed answer's; a streamed echo-only one's)."""
            comp = o.outputs[0]
            text, ids, lps, finish = comp.text, comp.token_ids, comp.logprobs, comp.finish_reason
            if req.prompt_only:  # echo with max_tokens 0: the one generated token is not part of the answer
                text, ids, lps, finish = "", [], None if lps is None else [], "length"
            if req.echo:
                prompt_text, prompt_ids, prompt_lps = echoed(o)
                text, ids = prompt_text + text, prompt_ids + ids
                lps = None if lps is None else prompt_lps + lps
            logprobs = None if lps is None else completion_logprobs(ids, lps, 0, token_text, as_ids)[0]
            choice = {"index": i, "text": text, "finish_reason": finish,
                      "stop_reason": None if req.prompt_only else comp.stop_reason, "logprobs": logprobs,
                      **prompt_part(o)}
            if req.return_token_ids:  # (the generated ids only, echo or not, as vLLM's)
                choice.update(prompt_token_ids=list(o.prompt_token_ids),
                              token_ids=[] if req.prompt_only else list(comp.token_ids))
            return choice

        if req.stream:
            sent = [0] * size  # per choice: tokens whose log-probabilities went out
            offsets = [0] * size  # per choice: text_offset of the next token
            started = [False] * size  # per choice: a chunk went out (with echo, the first carries the prompt)
            ids_sent = [0] * size  # per choice: generated token ids that went out (return_token_ids)

            def chunk(index, out):
                if out is None:
                    return dict(base)
                comp = out.outputs[0]
                if req.prompt_only:  # (echo only: one chunk, the prompt, once the token that is not part of it came)
                    return {**base, "choices": [whole_choice(index, out)]} if comp.finished() else None
                if not comp.delta_text and not comp.finished() and (started[index] or not req.echo):
                    return None  # (its tokens' log-probabilities go with the next chunk that is sent)
                text, ids, lps = comp.delta_text, comp.token_ids[sent[index]:], None
                if comp.logprobs is not None:
                    lps = comp.logprobs[sent[index]:]
                    sent[index] = len(comp.token_ids)
                first = not started[index]
                if req.echo and first:
                    prompt_text, prompt_ids, prompt_lps = echoed(out)
                    text, ids = prompt_text + text, prompt_ids + ids
                    lps = None if lps is None else prompt_lps + lps
                started[index] = True
                logprobs = None
                if lps is not None:
                    logprobs, offsets[index] = completion_logprobs(ids, lps, offsets[index], token_text, as_ids)
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": comp.finish_reason,
                    "stop_reason": comp.stop_reason if comp.finished() else None,
                    **(prompt_part(out) if first else {}),  # (the prompt's, with a choice's first chunk)
                }
                if req.return_token_ids:
                    if first:
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"], ids_sent[index] = list(comp.token_ids[ids_sent[index]:]), len(comp.token_ids)
                return {**base, "choices": [choice]}

            return event_stream(
                stream_events(stream, size, req.n, chunk, req.include_usage, continuous_usage=req.continuous_usage,
                              structured_param=sfield, generated=not req.prompt_only), stream)
        outs = await collect(stream, request, size)  # (a client gone: _ClientGone, answered 499 by its handler)
        failure = engine_failure(outs, sfield)
        if failure is not None:
            raise failure
        choices = [whole_choice(i, o) for i, o in enumerate(outs)]
        return {**base, "choices": choices, "usage": usage(outs, req.n, generated=not req.prompt_only)}

    def answer(call: tuple[str, list], text: str, finish: str | None, one_call: bool = False
               ) -> tuple[dict, str | None]:
        """A tool-call answer's message fields and finish reason, from its text: a named function's arguments are
        the (constrained) text (cut short when ``max_tokens`` cut it, as vLLM); ``required`` calls are read from
        the JSON array as they stream (``tool_parsers.required_calls``: each call's raw ``parameters`` text; an
        array cut short holds the calls named so far, finish reason ``length`` / ``stop``, and a text cut before
        any call's name comes back as content); "auto" calls are what the tool-call
        parser finds in the free text (the first only with ``one_call``, i.e. ``parallel_tool_calls`` false), the
        rest of the text their content."""
        mode, tools = call
        if mode == "auto":
            content, found = tool_parsers.parse(text, settings.tool_call_parser)
            found = found[:1] if one_call else found
            if not found:
                return {"content": content}, finish
            return {"content": content or None,  # (as streamed: the text beside the calls, whitespace after a call
                    #                                  only where other text follows it)
                    "tool_calls": tool_parsers.tool_calls_json(found)}, "tool_calls" if finish == "stop" else finish
        if mode == "named":
            if not text:  # (no answer written: a thought cut by max_tokens; as "required" then, no call)
                return {"content": text}, finish
            calls = [(tools[0]["name"], text)]
        else:
            found, complete = tool_parsers.required_calls(text)
            if not found:  # (cut short before a call's name was complete)
                return {"content": text}, finish
            calls = [(c.name, c.arguments) for c in found]
            finish = "tool_calls" if finish == "stop" and complete else finish
        return {"content": None, "tool_calls": [
            {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
             "function": {"name": name, "arguments": arguments}} for name, arguments in calls]}, finish

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        req: ChatCompletionRequest = await read_body(request, ChatCompletionRequest)
        model = check_model(req.model)
        req.check_unsupported()
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        req.allow_auto_tools(settings.tool_call_parser)
        rid = response_id(req, request, "chatcmpl")
        as_ids = bool(req.return_tokens_as_token_ids)
        # echo (vLLM's): an answer to an assistant's last message starts with that message
        last = req.messages[-1]  # (the answer's role: the assistant's, or without a generation prompt the last one's)
        echoed = last.text() if req.echo and last.role == ("assistant" if req.add_generation_prompt else last.role) \
            else ""
        if req.use_beam_search:
            max_tokens = check_max_tokens(req.requested_max_tokens(), param)
            beam_prompt = await asyncio.to_thread(chat_prompt, req)
            (result,) = await beam_search(req, [beam_prompt], max_tokens, request,
                                          prompt_param="messages", request_id=rid,
                                          max_tokens_param=None if max_tokens is None else param)
            choices = []
            for j, seq in enumerate(result.sequences):
                message: dict[str, Any] = {"content": seq.text or ""}
                if settings.reasoning_parser is not None:
                    reasoning, text = reasoning_parsers.split(message["content"], settings.reasoning_parser,
                                                              prompt_text(beam_prompt))
                    message = {"content": text or None, "reasoning_content": reasoning}
                if echoed:
                    message["content"] = echoed + (message["content"] or "")
                choices.append({"index": j, "message": {"role": "assistant", **message}, "logprobs": None,
                                "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
                                **({"token_ids": list(seq.tokens)} if req.return_token_ids else {})})
            ids = {"prompt_token_ids": list(result.prompt_token_ids)} if req.return_token_ids else {}
            return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                    "model": model, **ids, "choices": choices, "usage": beam_usage([result])}
        params = make_params(req, check_max_tokens(req.requested_max_tokens(), param), param)
        call = req.tool_call()  # (validated by make_params: its constraint is the output's)
        prompt = await asyncio.to_thread(chat_prompt, req)  # (a request's own template may take a while)
        explicit = req.requested_max_tokens() is not None
        sfield = req.structured_field()
        stream = await add_group([prompt], params, req.n, rid, max_tokens_param=param if explicit else None,
                                 priority=req.priority, structured_param=sfield, prompt_param="messages",
                                 cache_salt=req.cache_salt)
        size, now = req.n, int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model}

        num_top = req.num_logprobs()
        token_bytes = None if engine.tokenizer is None else engine.tokenizer.token_bytes
        one_call = req.parallel_tool_calls is False

        def chat_prompt_logprobs(out: RequestOutput) -> list | None:
            lps = out.prompt_logprobs
            return prompt_logprobs_json(lps and top_entries(lps, list(out.prompt_token_ids), req.prompt_logprobs))

        constrained = call is not None and call[0] != "auto"  # (a named or required call: the output is JSON)
        # reasoning split from the answer (--reasoning-parser): a named or required tool call's arguments follow it
        spec = params.structured_outputs
        thinks = splits_thought(spec)
        if req.stream:
            sent = [0] * size  # per choice: tokens whose log-probabilities went out
            prompt_sent = [False] * size  # per choice: prompt_logprobs went out
            ids_sent = [0] * size  # per choice: generated token ids that went out (return_token_ids)
            auto = call is not None and call[0] == "auto"
            parsers = [tool_parsers.make_stream(settings.tool_call_parser) for _ in range(size)] if auto else []
            required = [tool_parsers.RequiredCallsStream() for _ in range(size)] if (
                constrained and call[0] == "required") else []
            named_ids = [f"chatcmpl-tool-{uuid.uuid4().hex}" for _ in range(size)] if (
                constrained and call[0] == "named") else []
            named_started = [False] * size
            thoughts = [ReasoningStream(settings.reasoning_parser, prompt_text(prompt)) for _ in range(size)
                        ] if thinks else []

            def text_delta(index, comp) -> tuple[str, str]:
                """This output's new text as (reasoning, content): what the reasoning parser is sure of."""
                if not thinks:
                    return "", comp.delta_text
                return thoughts[index].feed(comp.delta_text, final=comp.finished())

            def auto_delta(index, text: str, comp) -> tuple[dict, str | None]:
                """tool_choice "auto": the content the parser is sure of, and each call once its block closed."""
                parser = parsers[index]
                before = len(parser.calls)
                content, _ = parser.feed(text)
                if comp.finished():
                    content += parser.finish()[0]
                limit = 1 if one_call else len(parser.calls)
                calls = parser.calls[min(before, limit):limit]
                delta: dict[str, Any] = {"content": content} if content else {}
                if calls:
                    delta["tool_calls"] = tool_parsers.tool_calls_json(calls, min(before, limit), streamed=True)
                finish = comp.finish_reason
                return delta, "tool_calls" if finish == "stop" and parser.calls else finish

            def chunk(index, out):
                if out is None:
                    return dict(base)
                comp = out.outputs[0]
                if constrained:  # a tool call's arguments stream as the model writes them (as vLLM's)
                    delta, finish = {}, comp.finish_reason
                    reasoning, text = text_delta(index, comp)  # (the arguments follow a thought)
                    if named_ids:  # (the output is the named function's arguments)
                        if not named_started[index] and text:  # (no text at all: no call, as answered whole)
                            named_started[index] = True
                            delta = {"tool_calls": [{"index": 0, "id": named_ids[index], "type": "function",
                                                     "function": {"name": call[1][0]["name"], "arguments": text}}]}
                        elif text:
                            delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
                    else:  # required: the calls of a JSON array, each once its name is complete
                        calls = required[index].feed(text)
                        if calls:
                            delta = {"tool_calls": calls}
                        if comp.finished():  # (as answered whole: content when no call got a name, else the calls)
                            whole, finish = answer(call, required[index].text, finish)
                            if "tool_calls" not in whole and whole.get("content"):
                                delta = {"content": whole["content"]}
                    if reasoning:
                        delta = {"reasoning_content": reasoning, **delta}
                    if not delta and not comp.finished():
                        return None  # (its tokens' log-probabilities go with the next chunk that is sent)
                else:
                    reasoning, text = text_delta(index, comp)
                    if auto:
                        delta, finish = auto_delta(index, text, comp)
                    else:
                        delta, finish = ({"content": text} if text else {}), comp.finish_reason
                    if reasoning:
                        delta = {"reasoning_content": reasoning, **delta}
                    if not delta and not comp.finished():
                        return None
                logprobs = None
                if comp.logprobs is not None:
                    start, sent[index] = sent[index], len(comp.token_ids)
                    logprobs = chat_logprobs(comp.token_ids[start:], comp.logprobs[start:], num_top, as_ids,
                                             token_bytes)
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                          "stop_reason": comp.stop_reason if comp.finished() else None}
                if req.return_token_ids:
                    choice["token_ids"], ids_sent[index] = list(comp.token_ids[ids_sent[index]:]), len(comp.token_ids)
                prompt = {}
                if req.prompt_logprobs is not None and not prompt_sent[index]:  # (with a choice's first chunk)
                    prompt_sent[index] = True
                    prompt = {"prompt_logprobs": chat_prompt_logprobs(out)}
                return {**base, **prompt, "choices": [choice]}

            first = [
                {
                    **base,
                    "choices": [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
                for i in range(size)
            ]
            if req.return_token_ids:  # (the prompt's ids with the first chunk only, as vLLM's)
                first[0]["prompt_token_ids"] = stream.prompt_token_ids[0]
            if echoed:  # (as vLLM: a chunk of its own after the role's)
                first += [{**base, "choices": [{"index": i, "delta": {"content": echoed}, "logprobs": None,
                                                "finish_reason": None}]} for i in range(size)]
            return event_stream(
                stream_events(stream, size, req.n, chunk, req.include_usage, first=first,
                              continuous_usage=req.continuous_usage, structured_param=sfield), stream)
        outs = await collect(stream, request, size)  # (a client gone: _ClientGone, answered 499 by its handler)
        failure = engine_failure(outs, sfield)
        if failure is not None:
            raise failure
        choices = []
        for i, o in enumerate(outs):
            text, finish = o.outputs[0].text, o.outputs[0].finish_reason
            reasoning = None
            if thinks:
                reasoning, text = reasoning_parsers.split(text, settings.reasoning_parser, prompt_text(prompt))
            message = {"content": text}
            if call is not None:
                message, finish = answer(call, text or "", finish, one_call)
            if thinks:  # (vLLM's field; content None when the output was all reasoning)
                message = {"content": message.pop("content") or None, "reasoning_content": reasoning, **message}
            if echoed:
                message["content"] = echoed + (message["content"] or "")
            choices.append({
                "index": i,
                "message": {"role": "assistant", **message},
                "logprobs": None if o.outputs[0].logprobs is None
                else chat_logprobs(o.outputs[0].token_ids, o.outputs[0].logprobs, num_top, as_ids, token_bytes),
                "finish_reason": finish,
                "stop_reason": o.outputs[0].stop_reason,
                **({"token_ids": list(o.outputs[0].token_ids)} if req.return_token_ids else {}),
            })
        prompt = {} if req.prompt_logprobs is None else {"prompt_logprobs": chat_prompt_logprobs(outs[0])}
        if req.return_token_ids:
            prompt["prompt_token_ids"] = list(outs[0].prompt_token_ids)
        return {**base, "object": "chat.completion", **prompt, "choices": choices, "usage": usage(outs, req.n)}

    @app.post("/invocations")
    async def invocations(request: Request):
        """SageMaker's inference route (vLLM's, beside /ping): a chat request (it has 'messages') or a completion
        request (it has 'prompt'), answered as /v1/chat/completions or /v1/completions answers it."""
        authorize(request)
        data = await read_json(request)  # (read once: the handler reads the same bytes)
        if "messages" in data:
            return await chat_completions(request)
        if "prompt" in data:
            return await completions(request)
        raise APIError(400, "an /invocations body is a chat request (with 'messages') or a completion request (with "
                            "'prompt')", param="messages")

    @app.post("/v1/responses")
    async def responses(request: Request):
        """OpenAI's Responses API, stateless (``ResponsesRequest``): the input through the chat template as one chat
        completion; the answer as one ``message`` output item of ``output_text``, after a ``reasoning`` item holding
        the thought when ``--reasoning-parser`` split one off. Streamed, the events OpenAI sends
        (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``), each with its
        ``sequence_number``."""
        authorize(request)
        req: ResponsesRequest = await read_body(request, ResponsesRequest)
        model = check_model(req.model)
        chat = req.as_chat()
        # max_output_tokens is a cap, as vLLM's Responses API takes it: past the context it ends the answer there
        # (status "incomplete"), not a 400 as chat's max_tokens is
        cap = None if req.max_output_tokens is None else min(req.max_output_tokens, engine.max_model_len)
        params = make_params(chat, cap, "max_output_tokens")
        try:
            prompt = await asyncio.to_thread(render_chat, chat)
        except APIError as exc:  # (render_chat names chat's 'messages': here they came from 'input')
            if exc.param == "messages":
                exc.param = "input"
            raise
        rid = caller_id(req, request) or f"resp_{uuid.uuid4().hex}"  # (as given, as vLLM's; else OpenAI's form)
        mid, rsid = f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}"
        stream = await add_group([prompt], params, 1, rid, structured_param="text", prompt_param="input",
                                 priority=req.priority, cache_salt=req.cache_salt)
        created = int(time.time())
        spec = params.structured_outputs
        thinks = splits_thought(spec)

        def message(text: str, status: str) -> dict[str, Any]:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            return {"type": "message", "id": mid, "status": status, "role": "assistant",
                    "content": [part] if status != "in_progress" else []}

        def thought(text: str, status: str) -> dict[str, Any]:
            return {"type": "reasoning", "id": rsid, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}

        def response(status: str, out: RequestOutput | None = None, reasoning: str = "", text: str = ""
                     ) -> dict[str, Any]:
            # (what the request asked for, as OpenAI echoes it; temperature / top_p: the values the sampling used)
            body: dict[str, Any] = {
                "id": rid, "object": "response", "created_at": created, "completed_at": None, "model": model,
                "status": status, "error": None, "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
                "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": params.temperature,
                "top_p": params.top_p, "tool_choice": req.tool_choice or "auto", "tools": [],
                "text": req.echoed_text(), "truncation": req.truncation or "disabled",
                "user": req.user, "service_tier": "default", "output": [], "usage": None,
                # (the features this server refuses or ignores, at the values it serves: a client reading 'store'
                # learns the response was not stored, whatever it asked)
                "background": False, "store": False, "previous_response_id": None, "max_tool_calls": None,
                "reasoning": {"effort": None, "summary": None}, "top_logprobs": 0,
                "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier,
            }
            if out is not None:
                comp = out.outputs[0]
                body["completed_at"] = int(time.time()) if status == "completed" else None
                done = "completed" if status == "completed" else "incomplete"
                # (a thought cut off by max_output_tokens, no answer begun, is incomplete too)
                thought_done = "completed" if status == "completed" or text else "incomplete"
                body["output"] = [thought(reasoning, thought_done)] * bool(reasoning) + [message(text, done)]
                if status == "incomplete":
                    body["incomplete_details"] = {"reason": "max_output_tokens"}
                if status == "failed":  # (aborted: a shutdown, or the request was cut off)
                    body["error"] = {"code": "server_error", "message": "the request was aborted before it finished "
                                     "(the server is shutting down, or the request was cancelled): its output is cut "
                                     "short"}
                counts = usage([out], 1)
                thinking = thought_tokens(out, len(comp.text) - len(text)) if reasoning else 0
                body["usage"] = {
                    "input_tokens": counts["prompt_tokens"], "output_tokens": len(comp.token_ids),
                    "total_tokens": counts["total_tokens"],
                    "input_tokens_details": {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0},
                    "output_tokens_details": {"reasoning_tokens": thinking},
                }
            return body

        def thought_tokens(out: RequestOutput, boundary: int) -> int:
            """The generated tokens whose text ends within the output's first ``boundary`` characters (the thought
            and its tags, before the answer): counted, not the thought's text encoded again, which a tokenizer may
            split otherwise (a leading space of its own: more tokens than were generated)."""
            detok = IncrementalDetokenizer(need_tokenizer(), prompt_ids=out.prompt_token_ids or ())
            size = count = 0
            for token in out.outputs[0].token_ids:
                size += len(detok.add([token]))
                if size > boundary:
                    break
                count += 1
            return count

        def status_of(out: RequestOutput) -> str:
            """OpenAI's status for a finished output: "incomplete" (max_output_tokens cut it), "failed" (aborted:
            OpenAI has no status for a cut-off foreground response; chat's finish reason there is "abort") or
            "completed"."""
            return {"length": "incomplete", "abort": "failed"}.get(out.outputs[0].finish_reason, "completed")

        if not req.stream:
            (out,) = await collect(stream, request, 1)
            failure = engine_failure([out], "text")
            if failure is not None:
                raise failure
            reasoning, text = (reasoning_parsers.split(out.outputs[0].text, settings.reasoning_parser, prompt)
                               if thinks else (None, out.outputs[0].text))
            return response(status_of(out), out, reasoning or "", text or "")

        async def events() -> AsyncIterator[str]:
            seq = 0

            def event(kind: str, **fields) -> str:
                nonlocal seq
                seq += 1
                data = json.dumps({"type": kind, "sequence_number": seq - 1, **fields}, ensure_ascii=False)
                return f"event: {kind}\ndata: {data}\n\n"

            splitter = ReasoningStream(settings.reasoning_parser, prompt) if thinks else None
            reasoning, text, phase = "", "", "start"  # phase: "start", "thinking", "answering"
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            at = {"item_id": mid, "output_index": 0, "content_index": 0}  # (the message's place; 1 after a thought)
            try:
                yield event("response.created", response=response("in_progress"))
                yield event("response.in_progress", response=response("in_progress"))
                async for _, out in stream:
                    failure = engine_failure([out], "text")
                    if failure is not None:
                        yield event("error", **{k: v for k, v in failure.body()["error"].items() if k != "type"})
                        return
                    comp = out.outputs[0]
                    thinking, answer_text = (splitter.feed(comp.delta_text, final=comp.finished()) if splitter
                                             else ("", comp.delta_text))
                    if thinking:
                        if phase == "start":
                            phase = "thinking"
                            yield event("response.output_item.added", output_index=0, item=thought("", "in_progress"))
                        yield event("response.reasoning_text.delta", item_id=rsid, output_index=0, content_index=0,
                                    delta=thinking)
                        reasoning += thinking
                    if (answer_text or comp.finished()) and phase != "answering":
                        if phase == "thinking":  # the thought is over: its item closes, the message comes next
                            yield event("response.reasoning_text.done", item_id=rsid, output_index=0,
                                        content_index=0, text=reasoning)
                            cut = comp.finished() and not answer_text and status_of(out) != "completed"
                            yield event("response.output_item.done", output_index=0,
                                        item=thought(reasoning, "incomplete" if cut else "completed"))
                            at["output_index"] = 1
                        phase = "answering"
                        yield event("response.output_item.added", output_index=at["output_index"],
                                    item=message("", "in_progress"))
                        yield event("response.content_part.added", **at, part=empty)
                    if answer_text:
                        yield event("response.output_text.delta", **at, delta=answer_text, logprobs=[])
                        text += answer_text
                    if out.finished:
                        status = status_of(out)
                        yield event("response.output_text.done", **at, text=text, logprobs=[])
                        yield event("response.content_part.done", **at, part={**empty, "text": text})
                        yield event("response.output_item.done", output_index=at["output_index"],
                                    item=message(text, "completed" if status == "completed" else "incomplete"))
                        yield event(f"response.{status}", response=response(status, out, reasoning, text))
            finally:
                stream.abort()  # the client went away (generator cancelled / closed): free the pages now

        return event_stream(events(), stream)

    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}", operation_id="delete_response")
    @app.post("/v1/responses/{response_id}/cancel", operation_id="cancel_response")
    @app.get("/v1/responses/{response_id}/input_items", operation_id="response_input_items")
    async def stored_response(request: Request, response_id: str):
        """OpenAI's stored-response endpoints: nothing is stored here (``store`` true is taken, nothing kept), so each
        is a 404 that says so (not a bare "Not Found")."""
        authorize(request)
        raise APIError(404, f"response '{clip(response_id, 80)}' not found: this server does not store responses "
                            f"(stateless: 'store' is false, and a response cannot be read back, listed or cancelled "
                            f"afterwards)", type="invalid_request_error", param="response_id")

    return app
