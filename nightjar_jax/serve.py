"""``python -m nightjar_jax.serve``: load the engine, warm it up, and serve the OpenAI-compatible API.

Shutdown on SIGINT / SIGTERM is graceful: uvicorn stops accepting connections, in-flight requests get
``--shutdown-timeout`` seconds to finish, whatever is left is aborted (pages freed), and the process exits 0. A
second SIGINT during it (uvicorn's force quit) cuts what is still running, closes the engine and exits 130.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from nightjar_jax.cli import STARTUP_ERRORS, add_engine_args, engine_config_from_args
from nightjar_jax.engine.sampling_params import MAX_LOGPROBS
from nightjar_jax.interrupts import interrupted_import, startup_interrupts
from nightjar_jax.models.tokenizer import load_chat_template  # noqa: F401 (serve's --chat-template; tests import it here)

logger = logging.getLogger("nightjar_jax.serve")


def _bounded(kind, name: str, low, high=None):
    """An argparse type: ``kind`` within ``[low, high]``, else a usage error that says what is allowed."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = {"int": "an integer", "float": "a number"}.get(kind.__name__, kind.__name__)
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):  # (NaN passed every bound; inf broke shutdown)
            raise argparse.ArgumentTypeError(f"{name} must be a finite number, got {text}")
        if value < low or (high is not None and value > high):
            allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{name} must be {allowed}, got {text}")
        return value

    return parse


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=_bounded(int, "port", 0, 65535), default=8000,
                       help="port to bind (default: 8000; 0 picks a free one)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer <key>' on /v1/* (an unknown /v1 path too), /invocations, "
                       "/tokenize, /detokenize, /reset_prefix_cache and the sleep and weight-update endpoints; "
                       "/health, /ping, /load, /version, /metrics and the docs stay open (stricter than vLLM, which "
                       "guards /v1 only); an empty key is no key: auth stays off. Default: $VLLM_API_KEY, as vLLM's")
    group.add_argument("--served-model-name", default=None, nargs="+",
                       help="model name in the API (default: --model); several: requests may name any of them, and "
                       "responses carry the first (vLLM's)")
    group.add_argument(
        "--chat-template",
        default=None,
        help="a jinja chat template, or a path to a file holding one (overrides the tokenizer's)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="answer tool_choice 'auto' (OpenAI's default when a request has tools): the model writes freely and "
        "--tool-call-parser finds its calls; without it such requests get a 400, as in vLLM",
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        help="the tool-call format the model writes, for --enable-auto-tool-choice: hermes (the default; "
        "<tool_call>{...}</tool_call> blocks, as Hermes, Qwen and SmolLM2 write them) or llama3_json (an answer "
        "that is only {\"name\", \"parameters\"} objects, as Llama 3.1+ writes them) or pythonic (an answer that "
        "is only a list of calls, [f(a=1)], as Llama 3.2 and 4 write them)",
    )
    group.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="serve vLLM's sleep-mode endpoints: POST /sleep?level=1 moves the weights to host memory and frees the "
        "KV cache (level=2 frees the weights too; they are loaded again from the checkpoint), POST /wake_up brings "
        "them back, GET /is_sleeping says which; requests get a 503 while the engine sleeps",
    )
    group.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="serve SGLang's POST /update_weights_from_disk ({\"model_path\": ..., \"draft_model_path\": ...}): new "
        "weights from a checkpoint on the server's disk, served without a restart (an RL loop's weight sync)",
    )
    group.add_argument(
        "--chat-template-content-format", choices=("auto", "string", "openai"), default="auto",
        help="how the chat template gets each message's content (vLLM's flag): string (text parts joined by "
             "newlines), openai (a list of {'type': 'text', 'text'} parts), or auto (parts for a template that loops "
             "over a message's content, else a string)",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat request's own 'chat_template' (vLLM's flag); without it such a request is a 400",
    )
    group.add_argument("--max-body-bytes", type=_bounded(int, "max-body-bytes", 1), default=1 << 20,
                       help="request body limit (default: 1 MiB)")
    group.add_argument(
        "--shutdown-timeout",
        type=_bounded(float, "shutdown-timeout", 0.0),
        default=30.0,
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM before being aborted (default: 30)",
    )
    group.add_argument(
        "--warmup",
        default="request",
        choices=["none", "request", "full"],
        help="before serving: nothing, one tiny request (default), or also compile every decode variant "
        "(batch bucket x γ x greedy/sampled), the prefill chunks (rows x chunk length, up to 4x the token budget "
        "padded) and the draft's catch-up, so requests do not wait on a compile (the variants of log-probabilities, "
        "logit_bias, penalties and structured outputs still compile on first use, per batch bucket)",
    )
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="the server's and the engine's log level (default: info)")
    # vLLM's HTTP-front flags
    group.add_argument("--allowed-origins", type=_json_strings("allowed-origins"), default=["*"],
                       help='CORS: origins browsers may call from, a JSON list (default ["*"], as vLLM; [] turns '
                       "CORS off)")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    group.add_argument("--allowed-methods", type=_json_strings("allowed-methods"), default=["*"],
                       help='CORS: allowed methods, a JSON list (default ["*"])')
    group.add_argument("--allowed-headers", type=_json_strings("allowed-headers"), default=["*"],
                       help='CORS: allowed headers, a JSON list (default ["*"])')
    group.add_argument("--root-path", type=_root_path, default=None,
                       help="the path prefix a proxy serves this server under (ASGI root_path, as vLLM's): it starts "
                       "with '/', e.g. /api (a trailing '/' is dropped)")
    group.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key file")
    group.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate file")
    group.add_argument("--ssl-ca-certs", default=None, help="HTTPS: CA certificates to verify clients with")
    group.add_argument("--ssl-cert-reqs", type=_bounded(int, "ssl-cert-reqs", 0, 2), default=0,
                       help="HTTPS: whether client certificates are required (Python's ssl: 0 none, 1 optional, "
                       "2 required)")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="every response carries an X-Request-Id header (the request's own, else a new id)")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="do not serve FastAPI's /docs, /redoc and /openapi.json")
    group.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    group.add_argument("--uvicorn-log-level", default=None,
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (default: --log-level)")
    group.add_argument("--max-logprobs", type=_bounded(int, "max-logprobs", 0, MAX_LOGPROBS), default=MAX_LOGPROBS,
                       help=f"the most log-probabilities per token a request may ask for (logprobs, top_logprobs, "
                       f"prompt_logprobs), 0 to {MAX_LOGPROBS} (default: {MAX_LOGPROBS}, as vLLM's)")
    group.add_argument("--profiler-dir", default=None, metavar="DIR",
                       help="serve POST /start_profile and /stop_profile (vLLM's profiler endpoints), which trace the "
                       "process with JAX's profiler into DIR (default: $NIGHTJAR_PROFILER_DIR; neither: no endpoints)")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each generation request as it is queued: its id, prompt lengths and sampling "
                       "parameters (not the prompt's text)")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="vLLM's older flag: requests are not logged unless --enable-log-requests")
    return parser


def _root_path(text: str) -> str:
    """An argparse type: an ASGI root path, "/api" (uvicorn took "api" and the log named http://host:8000api/v1)."""
    if text and not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"root-path must start with '/', e.g. /{text}, got {text!r}")
    return text.rstrip("/")


def _json_strings(name: str):
    """An argparse type: a JSON list of strings (vLLM's form of the CORS flags)."""

    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f'{name} must be a JSON list of strings, e.g. \'["*"]\', got {text!r}')
        return value

    return parse


def build_parser(prog: str = "python -m nightjar_jax.serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as vLLM's `vllm serve MODEL` takes it (the same as --model)")
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="a YAML file of flags, vLLM's form: each key a flag's long name (max-model-len or "
                        "max_model_len), each value its value (true / false for a switch, a list for a flag that "
                        "takes several, a mapping for a JSON flag such as speculative-config); flags given on the "
                        "command line win")
    add_engine_args(parser)
    add_server_args(parser)
    return parser


class _UsageError(Exception):
    pass


def config_file_args(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags ``--config`` ``path`` holds, as command-line words; a usage error (``_UsageError``) for a file that
    cannot be read or a key or value no flag takes."""
    import yaml

    where = f"--config {path}"
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise _UsageError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise _UsageError(f"{where}: not UTF-8 text: save the YAML file as UTF-8") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise _UsageError(f"{where}: not valid YAML{at}: {what}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise _UsageError(f"{where}: the file must hold a mapping of flag names to values (e.g. 'max-model-len: "
                          f"2048'), got a {type(data).__name__}")
    flags = parser._option_string_actions
    words: list[str] = []
    spec = data.get("speculative-config", data.get("speculative_config"))
    if isinstance(spec, dict):  # (its fields as their own flags: one the command line gives then wins alone)
        from nightjar_jax.cli import speculative_config
        from nightjar_jax.config import ConfigError

        try:
            fields = speculative_config(json.dumps(spec), where=f"{where}: speculative-config")
        except ConfigError as exc:
            raise _UsageError(str(exc)) from None
        data = {k: v for k, v in data.items() if k not in ("speculative-config", "speculative_config")}
        for field, value in fields.items():
            own = next((data[k] for k in (field, field.replace("_", "-")) if k in data), None)
            if own is not None and own != value:
                raise _UsageError(f"{where}: speculative-config sets {field}={value!r} but "
                                  f"{field.replace('_', '-')} is {own!r}: give it once")
            data[field.replace("_", "-")] = value
    for key, value in data.items():
        name = str(key).removeprefix("--").replace("_", "-")
        action = flags.get("--" + name)
        if action is None or name in ("config", "help"):
            raise _UsageError(f"{where}: {key!r} is not a flag of this command: keys are the long names of the "
                              f"flags in --help (e.g. max-model-len, port, speculative-config), without '--'")
        flag = "--" + name
        if value is None:
            raise _UsageError(f"{where}: {key!r} has no value (null): give one, or leave the key out")
        if isinstance(value, bool):
            if isinstance(action, argparse.BooleanOptionalAction):  # (the key may be its --no- form)
                yes, no = action.option_strings
                words.append(yes if value == (flag == yes) else no)
            elif action.nargs == 0:  # (a store_true switch)
                if value:
                    words.append(flag)
            else:
                raise _UsageError(f"{where}: {key!r} takes a value, not {str(value).lower()}")
            continue
        if action.nargs == 0:
            raise _UsageError(f"{where}: {key!r} is a switch: its value is true or false, got {value!r}")
        if isinstance(value, list) and action.nargs in ("+", "*"):
            if not value:
                raise _UsageError(f"{where}: {key!r} is an empty list: give at least one value, or leave the key out")
            words += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif isinstance(value, (dict, list)):  # (a flag whose value is JSON text)
            words += [flag, json.dumps(value)]
        else:
            words.append(f"{flag}={value}")  # (one word: a value that starts with "-" is not read as a flag)
    return words


# flags that set one thing between them (vLLM's name and this engine's, a pool's size, the speculation settings): one
# given on the command line drops the file's others, so the command line wins there as everywhere
# (the file's speculative-config is read as its fields' own flags: a command-line --num-speculative-tokens keeps the
# file's draft; a command-line --speculative-config replaces them all)
_FLAG_GROUPS = ({"block_size", "page_size"}, {"num_pages", "kv_cache_bytes", "gpu_memory_utilization"},
                *({"speculative_config", field} for field in ("draft_model", "num_speculative_tokens",
                                                              "prompt_lookup_max", "prompt_lookup_min")))


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args`` with vLLM's two launch forms besides: the model as the first positional word
    (``serve MODEL``) and ``--config YAML`` (its flags the defaults the command line's override)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    if len(paths) > 1:
        parser.error(f"--config is given {len(paths)} times: give one file")
    if paths:
        given = {k for k, v in vars(parser.parse_args(argv)).items() if v != parser.get_default(k)}  # (on the line)
        error = parser.error
        try:
            words = config_file_args(parser, paths[0])

            def raise_usage(message: str):
                raise _UsageError(f"--config {paths[0]}: {message}")

            parser.error = raise_usage  # (a bad value in the file: the same usage error, naming the file)
            from_file = parser.parse_args(words)
        except _UsageError as exc:
            parser.error = error
            parser.error(str(exc))
        parser.error = error
        from_file = {k: v for k, v in vars(from_file).items() if v != parser.get_default(k)}
        overridden = set().union(*(group for group in _FLAG_GROUPS if group & given))
        parser.set_defaults(**{k: v for k, v in from_file.items() if k not in overridden})
    args = parser.parse_args(argv)
    if args.config is not None and not paths:  # (an abbreviation, --conf: the file was never read)
        parser.error(f"write --config in full (--config {args.config}): the file is read before the other flags")
    if args.model_tag is not None:
        given = [a for a in argv if a == "--model" or a.startswith("--model=")]
        if given and args.model != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag!r} (the positional MODEL) and --model "
                         f"{args.model!r}: give one")
        args.model = args.model_tag
    return args


def reasoning_parser(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """The --reasoning-parser, checked before the model loads (None: off)."""
    if args.reasoning_parser is None:
        return None
    from nightjar_jax.config import REASONING_PARSERS

    if args.reasoning_parser not in REASONING_PARSERS:
        parser.error(f"--reasoning-parser must be one of: {', '.join(REASONING_PARSERS)}; "
                     f"got {args.reasoning_parser!r}")
    return args.reasoning_parser


def tool_call_parser(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """The parser for tool_choice "auto" (None: refused); a parser without --enable-auto-tool-choice is a usage
    error rather than a flag that silently does nothing."""
    if not args.enable_auto_tool_choice:
        if args.tool_call_parser is not None:
            parser.error("--tool-call-parser takes effect with --enable-auto-tool-choice: add it, or drop the parser")
        return None
    from nightjar_jax.server.tool_parsers import TOOL_CALL_PARSERS  # (the server package imports fastapi: not
    # before a usage error or --help)

    name = "hermes" if args.tool_call_parser is None else args.tool_call_parser
    if name not in TOOL_CALL_PARSERS:
        parser.error(f"--tool-call-parser must be one of: {', '.join(TOOL_CALL_PARSERS)}; got {name!r}")
    return name


def load_engine(args: argparse.Namespace):
    """Build the engine (progress bar over load → warm-up) and log what was loaded."""
    from tqdm.auto import tqdm

    from nightjar_jax.engine.engine import LLMEngine
    from nightjar_jax.engine.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    steps = ["load models"] + (["warm up"] if args.warmup != "none" else [])
    with tqdm(total=len(steps), desc="starting", unit="step", file=sys.stderr) as bar:
        bar.set_postfix_str(f"loading {config.model}")
        # (a bad --chat-template fails before minutes of loading)
        template = None if args.chat_template is None else load_chat_template(args.chat_template)
        t0 = time.perf_counter()
        engine = LLMEngine(config)
        bar.update(1)
        logger.info(
            "loaded %s (draft %s) in %.1fs; %d KV pages x %d tokens; max_model_len %d",
            engine.target.config.name,
            engine.draft.config.name if engine.draft else None,
            time.perf_counter() - t0,
            engine.num_total_pages,
            config.cache.page_size,
            engine.max_model_len,
        )
        if template is not None:
            engine.tokenizer.chat_template = template
        if args.warmup != "none":
            bar.set_postfix_str("compiling (every step variant, then a warm-up request)" if args.warmup == "full"
                                else "compiling (warm-up request)")
            t0 = time.perf_counter()
            if args.warmup == "full":
                # decode, prefill chunks, the draft's catch-up; with --draft-offload auto, the extended layout's too
                with tqdm(total=engine.warmup_ticks(), desc="compiling step variants", unit="shape",
                          file=sys.stderr) as inner:
                    engine.warmup(progress=lambda: inner.update(1))
            engine.add_request(
                [engine.tokenizer.bos_token_id or 1] if engine.tokenizer else [1],
                SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                request_id="warmup",
            )
            while engine.has_unfinished_requests():
                engine.step()
            engine.reset_stats()  # metrics count from here: the warm-up request is not traffic
            bar.update(1)
            logger.info(
                "warm-up done in %.1fs; compiled variants: %s",
                time.perf_counter() - t0,
                engine.runner.compiled_cache_sizes(),
            )
    return engine


class _Server:
    """Factory for a uvicorn Server whose signal handling exits 0 instead of re-raising the signal."""

    @staticmethod
    def make(config):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame) -> None:
                # uvicorn re-raises captured signals after shutdown (exit status 128+n); we exit 0 instead.
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                else:
                    if not self.should_exit:
                        self._abort_before_the_timeout()
                    self.should_exit = True

            def _abort_before_the_timeout(self) -> None:
                """Past --shutdown-timeout uvicorn cancels the request handlers: a stream cut with no [DONE], a
                bare 500. So the engine stops a little before (its requests end with finish reason "abort"), and
                the handlers answer them in time."""
                async_engine = getattr(getattr(self.config.app, "state", None), "async_engine", None)
                timeout = self.config.timeout_graceful_shutdown
                if async_engine is None or timeout is None:
                    return
                from nightjar_jax.server.async_engine import STOP_GRACE_S

                margin = min(1.0, timeout / 2)  # (a step still running then: its requests answered in half of it)
                timer = threading.Timer(max(0.0, timeout - margin), async_engine.stop,
                                        kwargs={"grace": min(STOP_GRACE_S, margin / 2)})
                timer.daemon = True
                timer.start()

        return Server(config)


def check_ssl(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """HTTPS takes a key and a certificate together, each a readable file, and verifying clients takes CA
    certificates; all are loaded here, before the model loads (uvicorn loads them after it: a traceback, minutes
    later)."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        parser.error("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both): give both, or neither")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None and not Path(path).is_file():
            parser.error(f"{flag} {path}: no such file")
    if args.ssl_ca_certs is not None and args.ssl_keyfile is None:
        parser.error("--ssl-ca-certs verifies clients of an HTTPS server: add --ssl-keyfile and --ssl-certfile")
    if args.ssl_cert_reqs and args.ssl_ca_certs is None:  # (no CA to verify with: every client was refused)
        parser.error(f"--ssl-cert-reqs {args.ssl_cert_reqs} verifies client certificates: it needs --ssl-ca-certs "
                     f"(the CA certificates to verify them with)")
    if args.ssl_keyfile is None:
        return
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    asked = []

    def no_passphrase() -> bytes:  # (without a callback OpenSSL prompts on the terminal for one)
        asked.append(True)
        return b""

    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=no_passphrase)
    except (ssl.SSLError, OSError) as exc:
        try:
            encrypted = bool(asked) or b"ENCRYPTED" in Path(args.ssl_keyfile).read_bytes()
        except OSError:
            encrypted = False
        hint = "; the private key may be encrypted: no passphrase is taken, give an unencrypted key" if encrypted \
            else ""
        parser.error(f"--ssl-certfile {args.ssl_certfile} / --ssl-keyfile {args.ssl_keyfile}: not a certificate "
                     f"and its private key ({exc}){hint}")
    if args.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except (ssl.SSLError, OSError, ValueError) as exc:
            parser.error(f"--ssl-ca-certs {args.ssl_ca_certs}: no CA certificates could be read from it ({exc})")


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The server's listening socket, bound before the model loads (uvicorn binds after: a host that does not
    resolve or a port in use failed only once minutes of loading and warm-up were spent). Port 0: a free one. It
    listens at once: two SO_REUSEADDR sockets that do not listen yet may both bind one port, and the second server
    started together with the first loaded its model, said it served, and never got a connection."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$VLLM_API_KEY`` (as vLLM reads it: a server started with it alone served everyone); an
    empty one is none, as in vLLM (``--api-key "$KEY"`` with KEY unset), with a warning; one with leading or trailing
    whitespace is a ValueError (``main`` makes it a usage error)."""
    key, where = args.api_key, "--api-key"
    if not key and os.environ.get("VLLM_API_KEY"):  # (vLLM's `args.api_key or VLLM_API_KEY`: an empty flag too)
        key, where = os.environ["VLLM_API_KEY"], "$VLLM_API_KEY"
    if key == "":
        logger.warning("%s is empty: API-key auth is off (no endpoint needs a key)", where)
    elif key is not None and key != key.strip():
        # (a key file's trailing newline: no request could match it, every one was a 401)
        raise ValueError(f"{where} has leading or trailing whitespace, which no client's key can match: give the "
                         "key alone")
    return key or None


def run_server(server, sock: socket.socket, async_engine) -> int:
    """Serve until shut down: 0 after a graceful shutdown; 130 after a force quit (a second SIGINT: uvicorn cut
    the requests still running and skipped the app's shutdown, so the engine is closed here)."""
    server.run(sockets=[sock])
    if server.force_exit:
        logger.warning("forced quit: requests still running were cut off")
        async_engine.stop(timeout=10.0)
        return 130
    logger.info("server stopped")
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m nightjar_jax.serve") -> int:
    """``prog``: the command usage lines name (``nightjar serve`` when the installed script runs it)."""
    parser = build_parser(prog)
    args = parse_args(parser, argv)
    tool_parser = tool_call_parser(args, parser)
    thoughts = reasoning_parser(args, parser)
    check_ssl(args, parser)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        key = api_key(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.profiler_dir is None and os.environ.get("NIGHTJAR_PROFILER_DIR"):
        args.profiler_dir = os.environ["NIGHTJAR_PROFILER_DIR"]
    if args.profiler_dir is not None and (not args.profiler_dir or (
            os.path.exists(args.profiler_dir) and not os.path.isdir(args.profiler_dir))):
        parser.error(f"--profiler-dir {args.profiler_dir!r}: give a folder for the traces (it is made if missing)")
    if args.served_model_name and not all(name.strip() for name in args.served_model_name):
        parser.error(f"--served-model-name {' '.join(repr(n) for n in args.served_model_name)}: a name must not be "
                     f"empty (responses would carry \"model\": \"\")")
    try:
        with startup_interrupts():
            import uvicorn

            from nightjar_jax.server.app import ServerSettings, build_app
            from nightjar_jax.server.async_engine import AsyncEngine
    except (KeyboardInterrupt, ImportError) as exc:  # (while importing: it was a traceback)
        if not isinstance(exc, KeyboardInterrupt) and not interrupted_import(exc):
            raise
        logger.warning("interrupted while starting: nothing was served")
        return 130
    if not args.host.strip():  # (`--host "$HOST"` with HOST unset bound every interface, and the log said "http://:8000")
        parser.error(f"--host {args.host!r} is empty: give an address to bind, e.g. 127.0.0.1 (this machine only) or "
                     f"0.0.0.0 / :: (every IPv4 / IPv6 interface)")
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        parser.error(f"--host {args.host} --port {args.port}: cannot listen there ({exc})")
    try:
        with startup_interrupts():
            engine = load_engine(args)
    except STARTUP_ERRORS as exc:  # bad flags: one line, exit code 2
        sock.close()
        logger.debug("start-up failed", exc_info=True)
        logger.error("%s", exc)
        return 2
    except KeyboardInterrupt:  # (Ctrl-C while the model loads or compiles: it was a page of traceback)
        sock.close()
        logger.warning("interrupted while starting: nothing was served")
        return 130
    settings = ServerSettings(
        served_model_name=args.served_model_name[0] if args.served_model_name else engine.config.model,
        served_model_aliases=tuple(args.served_model_name[1:]) if args.served_model_name else (),
        api_key=key,
        max_body_bytes=args.max_body_bytes,
        tool_call_parser=tool_parser,
        reasoning_parser=thoughts,
        enable_sleep_mode=args.enable_sleep_mode,
        enable_weight_updates=args.enable_weight_updates,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_content_format=args.chat_template_content_format,
        allowed_origins=tuple(args.allowed_origins),
        allow_credentials=args.allow_credentials,
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        enable_request_id_headers=args.enable_request_id_headers,
        disable_fastapi_docs=args.disable_fastapi_docs,
        max_logprobs=args.max_logprobs,
        log_requests=args.enable_log_requests,
        profiler_dir=args.profiler_dir,
    )
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, settings)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level or args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        lifespan="on",
        access_log=not args.disable_uvicorn_access_log,
        **({"root_path": args.root_path} if args.root_path else {}),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )
    server = _Server.make(config)
    logger.info("serving %s on %s://%s:%d/v1%s", settings.served_model_name, "https" if args.ssl_certfile else "http",
                args.host, sock.getsockname()[1],
                f" (behind a proxy that serves it under {args.root_path} and strips that prefix)"
                if args.root_path else "")
    return run_server(server, sock, async_engine)


if __name__ == "__main__":
    sys.exit(main())
