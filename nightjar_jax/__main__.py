"""``python -m nightjar_jax {generate,serve} ...`` (also installed as the ``nightjar`` script).

- ``generate --prompt TEXT [--max-tokens N --temperature T --chat]``: print one completion.
- ``serve ...``: the OpenAI-compatible server, same flags as ``python -m nightjar_jax.serve``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from nightjar_jax.cli import add_engine_args, engine_config_from_args


def _generate(args: argparse.Namespace) -> int:
    from nightjar_jax.engine.engine import LLMEngine
    from nightjar_jax.engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
    engine.add_request(prompt, params, request_id="cli")
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nightjar_jax", description="nightjar-jax: serve or generate")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print one completion")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    sub.add_parser(
        "serve", help="the OpenAI-compatible server (see python -m nightjar_jax.serve --help)", add_help=False
    )
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "serve":
        from nightjar_jax.serve import main as serve_main

        return serve_main(argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
