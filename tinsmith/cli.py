"""``tinsmith`` command line: ``serve`` runs the server; ``make-tiny-model`` writes a test model."""

from __future__ import annotations

import argparse
import logging
import sys


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tinsmith.api.app import create_app
    from tinsmith.server.config import load_config
    from tinsmith.server.state import ServerState

    config = load_config(args)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        state = ServerState.build(config)
    except ValueError as e:
        print(f"tinsmith: {e}", file=sys.stderr)
        return 2
    if not state.auth.multi_tenant:
        logging.getLogger("tinsmith").warning(
            "no --api-keys-file: local single-user mode, any 'tml-' API key is accepted"
        )
    uvicorn.run(create_app(state), host=config.host, port=config.port, log_level=config.log_level.lower(),
                access_log=config.log_level.lower() == "debug")
    return 0


def main(argv: list[str] | None = None) -> int:
    from tinsmith.server.config import add_arguments

    p = argparse.ArgumentParser(prog="tinsmith", description="Self-hosted server for the Tinker API")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server")
    add_arguments(serve)
    serve.set_defaults(func=_serve)
    tiny = sub.add_parser("make-tiny-model", help="write a tiny random HF checkpoint with a BPE tokenizer")
    tiny.add_argument("rest", nargs=argparse.REMAINDER)
    tiny.set_defaults(func=lambda a: __import__("tinsmith.devtools.tiny_model", fromlist=["main"]).main(a.rest) or 0)
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
