"""The CLI flags map 1:1 onto the engine config; no model is loaded here."""

from __future__ import annotations

import argparse
import sys

import pytest

from nightjar_jax.cli import add_engine_args, engine_config_from_args, parse_bytes
from nightjar_jax.config import ConfigError, EngineConfig, engine_config_fields, make_engine_config
from nightjar_jax.serve import build_parser, load_chat_template


def test_every_config_field_has_a_flag():
    parser = add_engine_args(argparse.ArgumentParser())
    dests = {a.dest for a in parser._actions}
    assert set(engine_config_fields()) <= dests
    flags = {s for a in parser._actions for s in a.option_strings}
    for name in engine_config_fields():
        assert "--" + name.replace("_", "-") in flags


def test_unset_flags_keep_defaults():
    args = add_engine_args(argparse.ArgumentParser()).parse_args([])
    assert engine_config_from_args(args) == EngineConfig()


def test_flags_reach_nested_configs():
    args = build_parser().parse_args(
        [
            "--model",
            "stories260k",
            "--draft-model",
            "d",
            "--planner",
            "nightjar",
            "--num-speculative-tokens",
            "3",
            "--max-num-seqs",
            "8",
            "--page-size",
            "32",
            "--kv-cache-bytes",
            "64MiB",
            "--max-model-len",
            "256",
            "--dtype",
            "bfloat16",
            "--port",
            "1234",
            "--api-key",
            "k",
            "--served-model-name",
            "m",
        ]
    )
    cfg = engine_config_from_args(args)
    assert cfg.model == "stories260k" and cfg.dtype == "bfloat16"
    assert cfg.spec.draft_model == "d" and cfg.spec.planner == "nightjar" and cfg.spec.num_speculative_tokens == 3
    assert cfg.scheduler.max_num_seqs == 8 and cfg.scheduler.max_model_len == 256
    assert cfg.cache.page_size == 32 and cfg.cache.kv_cache_bytes == 64 * 2**20
    assert (args.host, args.port, args.api_key, args.served_model_name) == ("127.0.0.1", 1234, "k", ["m"])
    assert build_parser().parse_args(["--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    assert args.warmup == "request" and build_parser().parse_args(["--warmup", "full"]).warmup == "full"


def test_bad_values():
    parser = add_engine_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-seqs", "many"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float8"])
    with pytest.raises(ConfigError, match="--max-num-seqs 0 is invalid"):
        engine_config_from_args(parser.parse_args(["--max-num-seqs", "0"]))


@pytest.mark.parametrize("argv, fields", [
    (["--dtype", "auto"], {"dtype": None}),  # (vLLM's: the checkpoint's own)
    (["--dtype", "float"], {"dtype": "float32"}),
    (["--dtype", "half"], {"dtype": "bfloat16"}),
    (["--dtype", "float16"], {"dtype": "bfloat16"}),
    (["--block-size", "8"], {"page_size": 8}),
    (["--block-size", "8", "--page-size", "8"], {"page_size": 8}),
    (["--max-model-len", "4k"], {"max_model_len": 4000}),
    (["--max-model-len", "4K"], {"max_model_len": 4096}),
    (["--max-model-len", "25.6k"], {"max_model_len": 25600}),
    (["--max-model-len", "1M"], {"max_model_len": 2**20}),
    (["--enforce-eager", "--disable-log-stats", "--enable-chunked-prefill"], {}),
])
def test_vllm_launch_flags_run_here(argv, fields):
    """A vLLM command line's flags: --dtype auto / float / half, --block-size, --max-model-len 4k, and switches with
    nothing to switch here. Each was an argparse error ("unrecognized arguments", "invalid choice: 'auto'")."""
    config = engine_config_from_args(build_parser().parse_args(["--model", "stories260k", *argv]))
    assert config == make_engine_config(model="stories260k", **fields)
    args = build_parser().parse_args(["--disable-log-requests", "--enable-log-requests", "--uvicorn-log-level",
                                      "warning", "--max-logprobs", "5"])
    assert (args.enable_log_requests, args.uvicorn_log_level, args.max_logprobs) == (True, "warning", 5)


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "8", "--page-size", "16"], "--block-size 8 and --page-size 16 are one option"),
    (["--no-enable-chunked-prefill"], "prefill is always chunked here"),
])
def test_vllm_launch_flags_that_cannot_hold(argv, message):
    with pytest.raises(ConfigError, match=message):
        engine_config_from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "0"], "--max-num-seqs 0 is invalid: allowed an integer in [1, 4096]"),
    (["--block-size", "0"], "--block-size 0 is invalid"),
    (["--page-size", "0", "--block-size", "0"], "--page-size 0 is invalid"),
    (["--prompt-lookup-max", "100"], "--prompt-lookup-max 100 is invalid: allowed an integer in [0, 64]"),
])
def test_bad_flag_values_name_the_flag(argv, message):
    """A bad value named the config field ("max_num_seqs=0 is invalid"), and --block-size 0 said page_size."""
    with pytest.raises(ConfigError) as exc:
        engine_config_from_args(build_parser().parse_args(argv))
    assert str(exc.value).startswith(message)


def test_parse_bytes():
    assert parse_bytes("1024") == 1024
    assert parse_bytes("2KiB") == 2048 and parse_bytes("1G") == 10**9 and parse_bytes("3mb") == 3 * 10**6
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


def test_chat_template_string_or_file(tmp_path):
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    path = tmp_path / "t.jinja"
    path.write_text("{{ 1 }}")
    assert load_chat_template(str(path)) == "{{ 1 }}"
    with pytest.raises(ValueError, match="looks like a path, but no such file can be read"):
        load_chat_template(str(tmp_path / "typo.jinja"))  # (it was rendered as the template: every prompt its name)
    # a template that does not parse is refused at start (the server started, and every chat request was a 400)
    with pytest.raises(ValueError, match=r"--chat-template: the chat template does not parse: .*\(line 1\)"):
        load_chat_template("{% if %}")
    path.write_text("{% for m in messages %}{{ m }}")
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template(str(path))
    # what transformers' environment adds parses, as it renders (each was refused: "unknown tag 'generation'")
    for text in ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
                 "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
                 "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}"
                 "{% endfor %}"):
        assert load_chat_template(text) == text


def test_main_help(capsys):
    from nightjar_jax.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    assert "--prompt" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--api-key" in out and "--max-num-seqs" in out


def test_ctrl_c_while_starting_exits_130_without_a_traceback(monkeypatch, capsys):
    """Ctrl-C while the model loads (serve) or while generate runs printed a page of traceback; now one line, exit
    status 130, and serve's bound port is let go."""
    import nightjar_jax.serve as serve
    from nightjar_jax.__main__ import main
    from nightjar_jax.engine import engine as engine_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    closed = []
    real_bind = serve.bind_socket

    def bind(host, port):
        sock = real_bind(host, port)
        closed.append(sock)
        return sock

    monkeypatch.setattr(serve, "load_engine", interrupted)
    monkeypatch.setattr(serve, "bind_socket", bind)
    assert serve.main(["--model", "stories260k", "--port", "0"]) == 130
    assert closed and closed[0].fileno() == -1  # (closed)
    monkeypatch.setattr(engine_module, "LLMEngine", interrupted)
    assert main(["generate", "--model", "stories260k"]) == 130
    captured = capsys.readouterr()
    assert "interrupted" in captured.err and "Traceback" not in captured.err + captured.out


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the one Python drops)
def test_a_ctrl_c_python_drops_inside_a_gc_callback_still_stops_the_start(monkeypatch, caplog):
    """A KeyboardInterrupt raised inside a garbage-collection callback (JAX registers one) is printed and dropped by
    Python: a Ctrl-C 1.5-2 s into serve's start was lost and the server started anyway (QA, 2026-12-07).
    startup_interrupts notes it and raises it at the block's end."""
    import gc
    import signal

    from nightjar_jax.interrupts import startup_interrupts

    def callback(phase, info):
        if phase == "start":
            signal.raise_signal(signal.SIGINT)

    def collect():
        gc.callbacks.append(callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(callback)

    previous = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with startup_interrupts():
            collect()  # (dropped here: the block goes on to its end)
            done = True
    assert done and signal.getsignal(signal.SIGINT) is previous
    with startup_interrupts():  # (no Ctrl-C: nothing raised)
        gc.collect()
    with pytest.raises(KeyboardInterrupt):  # (an error after a dropped Ctrl-C: the Ctrl-C wins, exit 130 not 2)
        with startup_interrupts():
            collect()
            raise ValueError("a bad flag")

    import nightjar_jax.serve as serve

    monkeypatch.setattr(serve, "load_engine", lambda args: collect())  # (a start that loses the Ctrl-C)
    assert serve.main(["--model", "stories260k", "--port", "0"]) == 130
    assert "interrupted while starting" in caplog.text


@pytest.mark.parametrize("argv0, prog", [("/usr/local/bin/nightjar", "nightjar"),
                                         ("/x/nightjar_jax/__main__.py", "python -m nightjar_jax")])
def test_usage_names_the_command_that_ran(monkeypatch, capsys, argv0, prog):
    """The installed ``nightjar serve`` printed usage and errors as ``python -m nightjar_jax.serve``."""
    from nightjar_jax.__main__ import main

    monkeypatch.setattr(sys, "argv", [argv0])
    with pytest.raises(SystemExit):
        main(["serve", "--bogus"])
    assert capsys.readouterr().err.splitlines()[-1] == f"{prog} serve: error: unrecognized arguments: --bogus"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # (help text wraps)
    assert out.startswith(f"usage: {prog} [-h]") and f"(see {prog} serve --help)" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model"], "unknown model preset 'no-such-model'"),
    (["--model", "stories260k", "--draft-model", "no-such-model"],  # (the draft's error named no model)
     "draft_model 'no-such-model': unknown model preset 'no-such-model'"),
    (["--model", "/no/such/dir"], "model path '/no/such/dir' does not exist"),
    (["--max-tokens", "0"], "SamplingParams.max_tokens=0 is invalid"),
    (["--spec-tree-nodes", "8", "--spec-tree-min-gamma", "9"], "--spec-tree-min-gamma 9 is invalid"),
    (["--model", "stories260k", "--draft-model", "none", "--num-pages", "2", "--page-size", "4",
      "--prompt", "Once upon a time there was a dog"], "whole KV pool holds 4"),
    (["--model", "stories260k", "--chat"], "has no chat template: pass --chat-template"),
    (["--model", "stories260k", "--chat-template", "/no/such/template.jinja"], "looks like a path"),
    (["--model", "smollm2-eagle"], "is a feature draft: it reads its target's hidden states and cannot decode alone"),
    (["--model", "stories260k", "--seed", str(2**63)], "--seed 9223372036854775808 is invalid"),
    (["--model", "stories260k", "--max-model-len", "4096"], "is more than stories260k's context of 512 tokens"),
    (["--model", "stories260k", "--compilation-cache-dir", __file__], "it needs a directory"),
    (["--model", "stories260k", "--planner", "static:x"], "must be 'static:K' with an int K"),
    # a template that raises Python's own error while rendering (a traceback), a binary file (a bare UnicodeDecodeError)
    (["--model", "stories260k", "--prompt", "hi", "--chat-template", "{{ 1 + 'a' }}"],
     "the chat template could not render these messages: TypeError"),
    (["--model", "stories260k", "--chat-template", "BINARY"], "is not UTF-8 text"),
])
def test_generate_reports_bad_flags_in_one_line(argv, message, capsys, tmp_path):
    from nightjar_jax.__main__ import main

    if "BINARY" in argv:
        (tmp_path / "t.jinja").write_bytes(b"\x80\x81\x82")
        argv = [str(tmp_path / "t.jinja") if a == "BINARY" else a for a in argv]
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_generate_without_a_tokenizer_points_to_the_flag(tmp_path, capsys):
    """A llama2.c file with no tokenizer beside it: generate's error names --tokenizer (the engine's own message asked
    for prompt token ids, which the command has no flag for); with --tokenizer it generates."""
    import shutil

    from nightjar_jax.__main__ import main
    from nightjar_jax.models.loader import ASSETS_DIR

    model = tmp_path / "model.bin"
    shutil.copy(ASSETS_DIR / "stories260K" / "stories260K.bin", model)
    argv = ["generate", "--model", str(model), "--draft-model", "none", "--prompt", "Once", "--max-tokens", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this model has no tokenizer") and "--tokenizer" in err
    assert main([*argv, "--tokenizer", str(ASSETS_DIR / "stories260K" / "tok512.model")]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_takes_a_chat_template(capsys):
    """--chat-template (as serve's) wraps the prompt for a model without one: before, --chat there pointed to a
    chat_template that generate could not take."""
    from nightjar_jax.__main__ import main

    argv = ["generate", "--model", "stories260k", "--draft-model", "none", "--max-tokens", "4", "--prompt", "Lily"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    # (the template turns the question into the start of a story: the output changes with it)
    template = "{% for m in messages %}Once upon a time, {{ m.content }}{% endfor %}"
    assert main([*argv, "--chat-template", template]) == 0
    wrapped = capsys.readouterr().out
    assert main([*argv, "--chat-template", template, "--no-chat"]) == 0
    assert capsys.readouterr().out == plain and wrapped != plain


def test_serve_reports_a_bad_model_and_exits_2(caplog):
    from nightjar_jax.serve import main as serve_main

    assert serve_main(["--model", "no-such-model", "--warmup", "none"]) == 2
    assert "unknown model preset 'no-such-model'" in caplog.text


def test_serve_takes_the_model_as_vllm_serve_does(caplog, capsys):
    """``serve MODEL`` (vLLM's form) is ``--model MODEL``; both given and different is a usage error."""
    from nightjar_jax.serve import main as serve_main
    from nightjar_jax.serve import parse_args

    args = parse_args(build_parser(), ["stories260k", "--max-model-len", "128"])
    assert engine_config_from_args(args).model == "stories260k" and args.max_model_len == 128
    assert parse_args(build_parser(), ["--port", "1", "stories260k", "--model", "stories260k"]).model == "stories260k"
    assert serve_main(["no-such-model", "--warmup", "none"]) == 2
    assert "unknown model preset 'no-such-model'" in caplog.text
    with pytest.raises(SystemExit) as exc:
        parse_args(build_parser(), ["stories260k", "--model", "other"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "the model is given twice: 'stories260k' (the positional MODEL) and --model" in err


def test_serve_reads_flags_from_a_yaml_config(tmp_path):
    """vLLM's ``--config``: a YAML mapping of long flag names (dashes or underscores) to values, switches as
    true / false (a --no- form too), lists onto flags that take several values, mappings onto JSON flags; the command
    line wins over the file."""
    from nightjar_jax.serve import parse_args

    path = tmp_path / "serve.yaml"
    path.write_text("model: stories260k\nmax_model_len: 512\nport: 9000\nenable-prefix-caching: false\n"
                    "no-enable-chunked-prefill: false\nenforce-eager: true\nserved-model-name: [a, b]\n"
                    "allowed-origins: ['http://x']\nspeculative-config: {method: ngram, num_speculative_tokens: 3}\n")
    args = parse_args(build_parser(), ["--config", str(path), "--port", "9100"])
    assert (args.model, args.max_model_len, args.port, args.enforce_eager) == ("stories260k", 512, 9100, True)
    assert args.enable_prefix_caching is False and args.enable_chunked_prefill is True
    assert args.served_model_name == ["a", "b"] and args.allowed_origins == ["http://x"]
    cfg = engine_config_from_args(args)
    assert cfg.spec.draft_model == "ngram" and cfg.spec.num_speculative_tokens == 3
    assert cfg.cache.enable_prefix_caching is False and cfg.scheduler.max_model_len == 512
    # the positional model and the command line's flags override the file's
    args = parse_args(build_parser(), [f"--config={path}", "other-model", "--enable-prefix-caching"])
    assert args.model == "other-model" and args.enable_prefix_caching is True and args.port == 9000
    (tmp_path / "empty.yaml").write_text("")  # (no flags)
    assert parse_args(build_parser(), ["--config", str(tmp_path / "empty.yaml")]).port == 8000


@pytest.mark.parametrize("text, message", [
    ("bogus: 1\n", "'bogus' is not a flag of this command: keys are the long names of the flags in --help"),
    ("- a\n", "the file must hold a mapping of flag names to values (e.g. 'max-model-len: 2048'), got a list"),
    ("port: [\n", "not valid YAML at line 2, column 1: expected the node content"),
    (b"max-model-len: 1\xff\n", "not UTF-8 text: save the YAML file as UTF-8"),  # (a UnicodeDecodeError traceback)
    ("speculative-config: {method: medusa}\n", "speculative-config method 'medusa' is not supported"),
    ("speculative-config: {method: ngram, num_speculative_tokens: 4}\nnum-speculative-tokens: 2\n",
     "speculative-config sets num_speculative_tokens=4 but num-speculative-tokens is 2: give it once"),
    ("port: true\n", "'port' takes a value, not true"),
    ("enforce-eager: 3\n", "'enforce-eager' is a switch: its value is true or false, got 3"),
    ("port: null\n", "'port' has no value (null): give one, or leave the key out"),
    ("served-model-name: []\n", "'served-model-name' is an empty list"),
    ("max-model-len: abc\n", "argument --max-model-len: 'abc' is not a token count"),
    ("config: other.yaml\n", "'config' is not a flag of this command"),
    (None, "cannot read it (No such file or directory)"),
])
def test_bad_yaml_configs_are_usage_errors_naming_the_file(tmp_path, capsys, text, message):
    from nightjar_jax.serve import parse_args

    path = tmp_path / "serve.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        parse_args(build_parser(), ["--config", str(path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--config {path}: {message}" in err, err


def test_serve_binds_before_the_model_loads(capsys, monkeypatch):
    """A port in use or a host that does not resolve is a usage error before loading (uvicorn bound after: minutes
    of loading, then exit 3); the socket bound is the one served, so --port 0 logs the port it got."""
    import socket

    import nightjar_jax.serve as serve

    monkeypatch.setattr(serve, "load_engine", lambda args: pytest.fail("the model loaded before the bind failed"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        for argv, message in ((["--port", str(taken.getsockname()[1])], "cannot listen there"),
                              (["--host", "999.1.1.1"], "cannot listen there")):
            with pytest.raises(SystemExit) as exc:
                serve.main(["--model", "stories260k", *argv])
            assert exc.value.code == 2 and message in capsys.readouterr().err
    finally:
        taken.close()
    sock = serve.bind_socket("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


@pytest.mark.parametrize("argv, message", [
    (["--port", "99999"], "port must be in [0, 65535], got 99999"),
    (["--port", "http"], "port must be an integer, got 'http'"),
    (["--max-body-bytes", "-5"], "max-body-bytes must be >= 1, got -5"),
    (["--shutdown-timeout", "-1"], "shutdown-timeout must be >= 0.0, got -1"),
    (["--shutdown-timeout", "nan"], "shutdown-timeout must be a finite number, got nan"),  # (NaN passed the bound)
    (["--shutdown-timeout", "inf"], "shutdown-timeout must be a finite number, got inf"),
    (["--allowed-origins", "*"], "allowed-origins must be a JSON list of strings"),
    (["--allowed-headers", '[1]'], "allowed-headers must be a JSON list of strings"),
    (["--ssl-cert-reqs", "3"], "ssl-cert-reqs must be in [0, 2], got 3"),
    (["--root-path", "api"], "root-path must start with '/', e.g. /api, got 'api'"),  # (logged http://h:8000api/v1)
    (["--max-logprobs", "21"], "max-logprobs must be in [0, 20], got 21"),
    (["--max-model-len", "1.5"], "'1.5' is not a token count"),
    (["--max-model-len", "0.0001k"], "'0.0001k' is not a whole number of tokens (0.1000)"),
    (["--dtype", "fp8"], "invalid choice: 'fp8'"),
])
def test_server_flags_out_of_range_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    ([], None),
    (["--enable-auto-tool-choice"], "hermes"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "hermes"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"], "llama3_json"),
])
def test_tool_call_parser_flags(argv, expected):
    from nightjar_jax.serve import tool_call_parser

    parser = build_parser()
    assert tool_call_parser(parser.parse_args(argv), parser) == expected


@pytest.mark.parametrize("argv, message", [
    (["--tool-call-parser", "hermes"], "--tool-call-parser takes effect with --enable-auto-tool-choice"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "mistral"],
     "--tool-call-parser must be one of: hermes, llama3_json, pythonic; got 'mistral'"),
    (["--enable-auto-tool-choice", "--tool-call-parser", ""], "got ''"),
    (["--reasoning-parser", "granite"], "--reasoning-parser must be one of: deepseek_r1, qwen3; got 'granite'"),
    (["--ssl-keyfile", __file__], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", __file__, "--ssl-certfile", "/no/such.pem"], "--ssl-certfile /no/such.pem: no such file"),
    (["--ssl-ca-certs", __file__], "--ssl-ca-certs verifies clients of an HTTPS server"),
    (["--ssl-keyfile", __file__, "--ssl-certfile", __file__], "not a certificate and its private key"),
])
def test_tool_call_parser_usage_errors(argv, message, capsys):
    """A parser without the switch would silently do nothing, an unknown one would fail every request: both are
    usage errors before the model loads (an unknown reasoning parser too)."""
    from nightjar_jax.serve import main as serve_main

    with pytest.raises(SystemExit) as exc:
        serve_main(["--model", "no-such-model", "--warmup", "none", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("spec, expected", [
    ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}',
     dict(draft_model="ngram", num_speculative_tokens=5, prompt_lookup_max=4)),
    ('{"model": "stories260k@skip=2", "num_speculative_tokens": 3}',
     dict(draft_model="stories260k@skip=2", num_speculative_tokens=3)),
    ('{"method": "eagle", "model": "smollm2-eagle"}', dict(draft_model="smollm2-eagle")),
])
def test_vllm_speculative_config_sets_the_speculation_flags(spec, expected):
    cfg = engine_config_from_args(build_parser().parse_args(["--speculative-config", spec]))
    for name, value in expected.items():
        assert getattr(cfg.spec, name) == value, name


@pytest.mark.parametrize("argv, message", [
    (["--speculative-config", "{"], "must be a JSON object"),
    (["--speculative-config", "[1]"], "must be a JSON object, got list"),
    (["--speculative-config", '{"method": "medusa", "model": "x"}'], "method 'medusa' is not supported: allowed"),
    (["--speculative-config", '{"method": "eagle"}'], "needs 'model'"),
    (["--speculative-config", '{"method": "ngram", "model": "x"}'], "takes no 'model'"),
    (["--speculative-config", '{"method": "ngram", "draft_tensor_parallel_size": 1}'],
     "key 'draft_tensor_parallel_size' is not supported: allowed method, model"),
    (["--speculative-config", '{"method": "ngram"}', "--draft-model", "none"], "give it once"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'],
     r"^--speculative-config num_speculative_tokens=99 is invalid: allowed an integer in \[0, 16\]"),
    (["--speculative-config", '{"method": "ngram", "method": "ngram"}'], "gives 'method' twice"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": "3"}'],
     "num_speculative_tokens must be an integer, got \"3\""),
    (["--speculative-config", '{"model": 5}'], "model must name the draft model .* got 5"),
    (["--speculative-config", '{"model": "none"}'], "for n-gram speculation give method 'ngram'"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": ' + "9" * 5000 + "}"],
     "must be a JSON object of keys"),
])
def test_bad_speculative_configs_say_what_is_allowed(argv, message):
    with pytest.raises(ConfigError, match=message):
        engine_config_from_args(build_parser().parse_args(argv))


def test_root_path_drops_a_trailing_slash():
    assert build_parser().parse_args(["--root-path", "/api/"]).root_path == "/api"
    assert build_parser().parse_args(["--root-path", ""]).root_path == ""  # (none)


def test_a_second_bind_of_a_port_fails_at_once():
    """Two servers started together on one port: the second bind fails (it listens at once; two SO_REUSEADDR
    sockets not listening yet both bound, and the loser served nothing), and the socket handed on still serves."""
    import asyncio
    import errno

    from nightjar_jax.serve import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        with pytest.raises(OSError) as exc:
            bind_socket("127.0.0.1", port).close()
        assert exc.value.errno == errno.EADDRINUSE

        async def serve_one():  # (as uvicorn takes the socket: loop.create_server(sock=...))
            server = await asyncio.start_server(lambda r, w: (w.write(b"hi"), w.close()), sock=sock)
            async with server:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                data = await reader.read()
                writer.close()
                return data

        assert asyncio.run(serve_one()) == b"hi"
    finally:
        sock.close()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed certificate, its key, the key encrypted, and a file that holds no certificate."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    files = {"cert": folder / "cert.pem", "key": folder / "key.pem", "enc": folder / "enc.pem",
             "garbage": folder / "garbage.pem"}
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem, pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    files["key"].write_bytes(key.private_bytes(pem, pkcs8, serialization.NoEncryption()))
    files["enc"].write_bytes(key.private_bytes(pem, pkcs8, serialization.BestAvailableEncryption(b"pw")))
    files["garbage"].write_text("not a certificate\n")
    return {k: str(v) for k, v in files.items()}


@pytest.mark.parametrize("flags, message", [
    (["--ssl-ca-certs", "garbage"], "--ssl-ca-certs {garbage}: no CA certificates could be read from it"),
    (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs 2 verifies client certificates: it needs --ssl-ca-certs"),
    (["--ssl-cert-reqs", "1"], "--ssl-cert-reqs 1 verifies client certificates: it needs --ssl-ca-certs"),
    (["--ssl-keyfile", "enc"], "the private key may be encrypted: no passphrase is taken"),
])
def test_bad_tls_setups_are_usage_errors_before_the_model_loads(tls_files, flags, message, capsys, monkeypatch):
    """A CA file that holds no certificate failed after the model loaded, with a traceback; client verification
    without CA certificates refused every client; an encrypted key said only "Invalid argument"."""
    import nightjar_jax.serve as serve

    monkeypatch.setattr(serve, "load_engine", lambda args: pytest.fail("the model loaded before the TLS check"))
    argv = ["--ssl-keyfile", tls_files["key"], "--ssl-certfile", tls_files["cert"]]
    argv += [tls_files.get(f, f) for f in flags]
    with pytest.raises(SystemExit) as exc:
        serve.main(["--model", "stories260k", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message.format(**tls_files) in err and "Traceback" not in err


def test_a_good_tls_setup_passes_the_check(tls_files):
    from nightjar_jax.serve import check_ssl

    parser = build_parser()
    args = parser.parse_args(["--ssl-keyfile", tls_files["key"], "--ssl-certfile", tls_files["cert"],
                              "--ssl-ca-certs", tls_files["cert"], "--ssl-cert-reqs", "2"])
    check_ssl(args, parser)  # (no SystemExit)


def test_an_empty_api_key_is_no_key(caplog, monkeypatch):
    """As vLLM's: --api-key "$KEY" with KEY unset leaves auth off, with a warning (it locked out every client that
    sent no literal 'Bearer ' header)."""
    from nightjar_jax.serve import api_key

    monkeypatch.delenv("VLLM_API_KEY", raising=False)

    assert api_key(build_parser().parse_args(["--api-key", ""])) is None
    assert "--api-key is empty: API-key auth is off" in caplog.text
    assert api_key(build_parser().parse_args(["--api-key", "k"])) == "k"
    assert api_key(build_parser().parse_args([])) is None
    for padded in (" k", "k\n", " "):  # (no request could match it: every one was a 401)
        with pytest.raises(ValueError, match="--api-key has leading or trailing whitespace"):
            api_key(build_parser().parse_args(["--api-key", padded]))


def test_vllm_api_key_is_the_key_without_the_flag(monkeypatch, caplog):
    """vLLM reads $VLLM_API_KEY when --api-key is not given; here it was ignored, and a server its operator had
    keyed served everyone (QA, 2026-12-07). The flag wins; the same checks apply."""
    from nightjar_jax.serve import api_key

    monkeypatch.setenv("VLLM_API_KEY", "sk-env")
    assert api_key(build_parser().parse_args([])) == "sk-env"
    assert api_key(build_parser().parse_args(["--api-key", "k"])) == "k"
    assert api_key(build_parser().parse_args(["--api-key", ""])) == "sk-env"  # (vLLM's `api_key or VLLM_API_KEY`)
    monkeypatch.setenv("VLLM_API_KEY", "sk-env\n")
    with pytest.raises(ValueError, match=r"\$VLLM_API_KEY has leading or trailing whitespace"):
        api_key(build_parser().parse_args([]))
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert api_key(build_parser().parse_args(["--api-key", ""])) is None and "--api-key is empty" in caplog.text
    assert api_key(build_parser().parse_args([])) is None


def test_an_empty_served_model_name_is_refused(capsys):
    from nightjar_jax.serve import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "stories260k", "--served-model-name", "a", ""])
    assert exc.value.code == 2 and "--served-model-name 'a' '': a name must not be empty" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused(capsys, host):
    """``--host "$HOST"`` with HOST unset bound every interface (a socket's "" is INADDR_ANY) without a word."""
    from nightjar_jax.serve import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "stories260k", "--host", host])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--host {host!r} is empty: give an address to bind, e.g. 127.0.0.1" in err


def test_a_forced_quit_closes_the_engine_and_exits_130(monkeypatch):
    """A second SIGINT (uvicorn's force quit) cut the requests, skipped the app's shutdown (the engine's close:
    the planner's decision log) and exited 0; now the engine is closed and the exit status says it was forced."""
    import signal

    import jax.numpy as jnp

    import nightjar_jax.serve as serve
    from nightjar_jax.config import make_engine_config
    from nightjar_jax.engine.engine import LLMEngine
    from nightjar_jax.engine.runner import ModelHandle
    from nightjar_jax.testing import fake_model

    fake = fake_model(97, max_len=64)
    target = ModelHandle(fake.config, None, {"w": jnp.ones(8, jnp.float32)}, fns=fake.fns)
    engine = LLMEngine(make_engine_config(model="fake", page_size=4, num_pages=16, max_num_seqs=2, max_model_len=64,
                                          draft_model="none", compilation_cache_dir=None), target=target)
    closed = []
    monkeypatch.setattr(engine, "close", lambda: closed.append(True))
    monkeypatch.setattr(serve, "load_engine", lambda args: engine)
    make = serve._Server.make

    def forced_server(config):
        server = make(config)

        def run(sockets):  # (the app started, then SIGINT twice)
            config.app.state.async_engine.start()
            server.handle_exit(signal.SIGINT, None)
            server.handle_exit(signal.SIGINT, None)
            for sock in sockets:
                sock.close()

        server.run = run
        return server

    monkeypatch.setattr(serve._Server, "make", staticmethod(forced_server))
    assert serve.main(["--model", "fake", "--port", "0", "--warmup", "none"]) == 130
    assert closed == [True]


def test_the_command_line_wins_over_a_yaml_config_for_flags_that_set_one_thing(tmp_path, capsys):
    """QA, 2026-12-07: a file's speculative-config with a command-line --num-speculative-tokens was a "give it once"
    error, its block-size with --page-size another, and its num-pages silently beat a command-line --kv-cache-bytes.
    The file's speculative-config is read as its fields' own flags (the command line's --num-speculative-tokens keeps
    the file's draft), and a command-line flag drops the file's flags that set the same thing. A value that starts
    with "-" is taken as written; an abbreviated --config (never read) is an error."""
    from nightjar_jax.serve import parse_args

    path = tmp_path / "serve.yaml"
    path.write_text("speculative-config: {method: ngram, num_speculative_tokens: 4}\nblock-size: 32\n"
                    "num-pages: 100\napi-key: '-abc'\nchat-template: '--x'\n")
    cfg = engine_config_from_args(parse_args(build_parser(), ["stories260k", "--config", str(path)]))
    assert (cfg.spec.draft_model, cfg.spec.num_speculative_tokens, cfg.cache.page_size, cfg.cache.num_pages) == (
        "ngram", 4, 32, 100)
    args = parse_args(build_parser(), ["stories260k", "--config", str(path), "--num-speculative-tokens", "2",
                                       "--page-size", "16", "--kv-cache-bytes", "1MiB"])
    cfg = engine_config_from_args(args)
    assert (cfg.spec.draft_model, cfg.spec.num_speculative_tokens, cfg.cache.page_size, cfg.cache.num_pages,
            cfg.cache.kv_cache_bytes) == ("ngram", 2, 16, None, 2**20)
    assert (args.api_key, args.chat_template) == ("-abc", "--x")
    cfg = engine_config_from_args(parse_args(build_parser(), [
        "stories260k", "--config", str(path), "--speculative-config", '{"model": "d", "num_speculative_tokens": 3}']))
    assert (cfg.spec.draft_model, cfg.spec.num_speculative_tokens) == ("d", 3)
    with pytest.raises(SystemExit) as exc:
        parse_args(build_parser(), ["stories260k", "--conf", str(path)])
    assert exc.value.code == 2 and "write --config in full" in capsys.readouterr().err


def test_profiler_dir_must_be_a_folder(tmp_path, capsys, monkeypatch):
    """--profiler-dir (or $NIGHTJAR_PROFILER_DIR) turns on /start_profile and /stop_profile; a file there is a usage
    error before the model loads."""
    from nightjar_jax.serve import main

    (tmp_path / "file").write_text("")
    for argv, env in ((["--profiler-dir", str(tmp_path / "file")], None), ([], str(tmp_path / "file"))):
        if env:
            monkeypatch.setenv("NIGHTJAR_PROFILER_DIR", env)
        with pytest.raises(SystemExit) as exc:
            main(["--model", "stories260k", *argv])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"--profiler-dir {str(tmp_path / 'file')!r}: give a folder" in err


def test_generate_takes_the_model_as_a_word_and_a_config_file(tmp_path, capsys):
    """``generate stories260k`` was "unrecognized arguments" where ``serve stories260k`` works; it also takes serve's
    ``--config YAML`` now, the command line winning."""
    from nightjar_jax.__main__ import main

    argv = ["generate", "stories260k", "--draft-model", "none", "--max-tokens", "4", "--prompt", "Lily", "--no-chat"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert "[stories260k: 4 tokens" in first.err, first.err
    config = tmp_path / "gen.yaml"
    config.write_text("model: stories260k\ndraft-model: none\nmax-tokens: 9\n")
    assert main(["generate", "--config", str(config), "--max-tokens", "4", "--prompt", "Lily", "--no-chat"]) == 0
    second = capsys.readouterr()
    assert "[stories260k: 4 tokens" in second.err and second.out == first.out
    with pytest.raises(SystemExit) as exc:
        main(["generate", "stories260k", "--model", "smollm2-135m-instruct"])
    assert exc.value.code == 2 and "the model is given twice" in capsys.readouterr().err


def test_speculative_tokens_without_a_draft_say_they_do_nothing(caplog):
    """--num-speculative-tokens with no draft (none, or auto for a model without a pair) decoded plainly without a
    word, where --planner static:3 there is an error (QA, 2026-12-07): a warning says so."""
    def config(*argv):
        caplog.clear()
        return engine_config_from_args(build_parser().parse_args(["--model", "stories260k", *argv]))

    config("--num-speculative-tokens", "4", "--draft-model", "none")
    assert "--num-speculative-tokens 4 has no effect: no draft model (--draft-model none)" in caplog.text
    config("--num-speculative-tokens", "4")
    assert "(--draft-model auto, and the model has no paired draft)" in caplog.text
    config("--num-speculative-tokens", "8", "--draft-model", "none")  # (the engine warns of this one, as it loads:
    assert "has no effect" not in caplog.text  # not twice)
    for argv in (["--num-speculative-tokens", "4", "--draft-model", "ngram"],
                 ["--num-speculative-tokens", "3", "--draft-model", "stories260k@skip=2"],
                 ["--num-speculative-tokens", "0", "--draft-model", "none"], ["--draft-model", "none"]):
        config(*argv)
        assert "has no effect" not in caplog.text, argv
