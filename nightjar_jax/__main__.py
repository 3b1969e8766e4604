"""``python -m nightjar_jax {generate,serve} ...`` (also installed as the ``nightjar`` script).

- ``generate [MODEL] [--prompt TEXT --max-tokens N --temperature T --chat/--no-chat --chat-template T]``: print one
  completion (with no flags: the default model answers a default question through its chat template); the model
  as a positional word and ``--config YAML`` as serve takes them.
- ``serve ...``: the OpenAI-compatible server, same flags as ``python -m nightjar_jax.serve``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from nightjar_jax.interrupts import interrupted_import, startup_interrupts

logger = logging.getLogger("nightjar_jax")


def _generate(args: argparse.Namespace) -> int:
    import time

    from nightjar_jax.cli import STARTUP_ERRORS, engine_config_from_args

    with startup_interrupts():
        from nightjar_jax.engine.engine import LLMEngine
        from nightjar_jax.engine.sampling_params import SamplingParams
        from nightjar_jax.models.tokenizer import load_chat_template

    given = {name: value for name, value in (("temperature", args.temperature), ("max_tokens", args.max_tokens),
                                             ("seed", args.sampling_seed)) if value is not None}
    try:  # the sampling values and the template first: they fail before minutes of loading
        SamplingParams(**given)
        template = None if args.chat_template is None else load_chat_template(args.chat_template)
        with startup_interrupts():
            engine = LLMEngine(engine_config_from_args(args))
        # unset flags: the model's generation config (--generation-config, --override-generation-config), else
        # greedy and 64 tokens
        params = SamplingParams(**{"temperature": 0.0, "max_tokens": 64, **engine.generation_defaults, **given})
    except STARTUP_ERRORS as exc:
        logger.debug("start-up failed", exc_info=True)
        sys.stderr.write(f"error: {exc}\n")
        return 2
    prompt = args.prompt
    if engine.tokenizer is None:  # (the engine's own message asks for token ids, which this command has no flag for)
        sys.stderr.write("error: this model has no tokenizer to read --prompt with: pass --tokenizer (a "
                         "tokenizer.json or SentencePiece .model file, or a folder with one)\n")
        return 2
    if template is not None:
        engine.tokenizer.chat_template = template
    chat = args.chat
    if chat is None:  # auto: instruct models with a chat template (or --chat-template) get their template
        chat = bool(getattr(engine.tokenizer, "chat_template", None))
    elif chat and not getattr(engine.tokenizer, "chat_template", None):
        sys.stderr.write(f"error: --chat: {engine.target.config.name}'s tokenizer has no chat template: pass "
                         f"--chat-template (a template, or a file holding one), or --no-chat for a plain prompt\n")
        return 2
    start = time.perf_counter()
    try:
        if chat:  # (a bad template: the one-line error below)
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        engine.add_request(prompt, params, request_id="cli")
    except ValueError as exc:  # e.g. a prompt longer than the context or than the whole KV pool
        sys.stderr.write(f"error: {exc}\n")
        return 2
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    seconds = time.perf_counter() - start
    stats = engine.stats
    sys.stderr.write(
        f"[{engine.target.config.name}"
        f"{' + draft ' + engine.draft.config.name if engine.draft is not None else ''}: "
        f"{stats.num_generated_tokens} tokens in {seconds:.2f} s (incl. compile), "
        f"{stats.num_decode_steps} decode steps, accepted {stats.num_accepted_tokens}/{stats.num_drafted_tokens} "
        f"drafts]\n"
    )
    return 0


def _prog() -> str:
    """How the user ran this: ``nightjar`` (the installed script) or ``python -m nightjar_jax``; usage lines say it."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name and name not in ("__main__.py", "-c") and not name.endswith(".py") else "python -m nightjar_jax"


def generate_parser(prog: str = "python -m nightjar_jax generate") -> argparse.ArgumentParser:
    """``generate``'s flags: the engine's, the one prompt's, and serve's launch forms (``generate MODEL``,
    ``--config YAML``)."""
    from nightjar_jax.cli import add_engine_args

    gen = argparse.ArgumentParser(prog=prog, description="print one completion")
    gen.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="the model (the same as --model), as serve takes it")
    gen.add_argument("--config", default=None, metavar="YAML",
                     help="a YAML file of flags, as serve's --config reads it; flags given on the command line win")
    add_engine_args(gen)
    gen.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    gen.add_argument("--max-tokens", type=int, default=None,
                     help="default: the model's generation config's max_new_tokens, else 64")
    gen.add_argument("--temperature", type=float, default=None,
                     help="default: the model's generation config's, else 0 (greedy)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=None,
        help="wrap the prompt in the model's chat template (default: when the tokenizer has one, or with "
        "--chat-template)",
    )
    gen.add_argument("--chat-template", default=None,
                     help="a jinja chat template, or a path to a file holding one (overrides the tokenizer's; as "
                     "serve's)")
    return gen


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except (KeyboardInterrupt, ImportError) as exc:  # (Ctrl-C while importing, loading, compiling or generating: it
        if not isinstance(exc, KeyboardInterrupt) and not interrupted_import(exc):  # was a traceback)
            raise
        sys.stderr.write("\ninterrupted\n")
        return 130


def _main(argv: list[str] | None) -> int:
    prog = _prog()
    parser = argparse.ArgumentParser(prog=prog, description="nightjar-jax: serve or generate")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("generate", help=f"print one completion (see {prog} generate --help)", add_help=False)
    sub.add_parser(
        "serve", help=f"the OpenAI-compatible server (see {prog} serve --help)", add_help=False
    )
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "serve":
        from nightjar_jax.serve import main as serve_main

        return serve_main(argv[1:], prog=f"{prog} serve")
    if not argv or argv[0] != "generate":
        parser.parse_args(argv)  # (no command, an unknown one, or --help: usage, exit 2 or 0)
    from nightjar_jax.serve import parse_args  # (the model as a positional word, --config)

    args = parse_args(generate_parser(f"{prog} generate"), argv[1:])
    logging.basicConfig(level=logging.WARNING)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
