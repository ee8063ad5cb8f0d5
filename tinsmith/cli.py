"""``tinsmith`` command line: ``serve`` runs the server; ``status`` prints a running server's
summary; ``make-tiny-model`` writes a test model; ``demo`` trains a small model with RL through
the SDK against a server it starts."""

from __future__ import annotations

import argparse
import logging
import sys


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tinsmith.api.app import create_app
    from tinsmith.server.config import load_config
    from tinsmith.server.exclusive import AlreadyServing
    from tinsmith.server.logs import configure_logging
    from tinsmith.server.private import set_private_umask
    from tinsmith.server.state import ServerState

    set_private_umask()  # before anything is written: the database, checkpoints, the secret
    try:
        config = load_config(args)
    except ValueError as e:
        print(f"tinsmith: {e}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    try:
        state = ServerState.build(config)
        state.claim()  # refuse now, before recovery touches anything and before models load
    except AlreadyServing as e:
        print(f"tinsmith: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"tinsmith: {e}", file=sys.stderr)
        return 2
    try:
        if not state.auth.multi_tenant:
            logging.getLogger("tinsmith").warning(
                "no --api-keys-file: local single-user mode, any 'tml-' API key is accepted"
            )
        # log_config=None: uvicorn keeps the handler configure_logging set, so its lines share the format.
        uvicorn.run(create_app(state), host=config.host, port=config.port, log_level=config.log_level.lower(),
                    log_config=None, access_log=False)
    finally:
        state.release()
    return 0


def _export(args: argparse.Namespace) -> int:
    """Export a LoRA checkpoint (local directory or tinker:// path): merged HF model or PEFT adapter."""
    from pathlib import Path

    from tinsmith.checkpoints.export import run_export
    from tinsmith.checkpoints.progress import progress_wanted
    from tinsmith.errors import TinsmithError

    source = args.checkpoint
    try:
        if source.startswith("tinker://"):
            from tinsmith.checkpoints.paths import parse_tinker_path
            from tinsmith.server.config import ServerConfig
            from tinsmith.store import Store

            cfg = ServerConfig(data_dir=args.data_dir, database_url=args.database_url)
            tp = parse_tinker_path(source, "checkpoint")
            store = Store(cfg.resolved_database_url)
            ck = store.get_checkpoint(tp.run_id, tp.kind, tp.name)
            store.close()
            if ck is None:
                print(f"tinsmith export: no checkpoint {source} in {cfg.resolved_database_url}", file=sys.stderr)
                return 1
            source = ck.storage_path
        result = run_export(Path(source), Path(args.out), args.format, args.base_model, args.max_shard_size,
                            args.push_to_hub, args.private, progress_wanted(args.quiet))
    except TinsmithError as e:
        print(f"tinsmith export: {e.message}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"tinsmith export: {result.summary}", file=sys.stderr)
    for w in result.warnings:
        print(f"tinsmith export: warning: {w}", file=sys.stderr)
    print(result.path)
    return 0


def main(argv: list[str] | None = None) -> int:
    from tinsmith.server.config import add_arguments

    p = argparse.ArgumentParser(prog="tinsmith", description="Self-hosted server for the Tinker API")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server")
    add_arguments(serve)
    serve.set_defaults(func=_serve)
    from tinsmith import status

    st = sub.add_parser("status", help="print a running server's runs, queue and health (as the dashboard shows)")
    status.add_arguments(st)
    st.set_defaults(func=status.run)
    export = sub.add_parser("export", help="export a LoRA checkpoint: merged HF model, or PEFT adapter (for vLLM too)")
    export.add_argument("checkpoint", help="checkpoint directory, or tinker://RUN/KIND/NAME of this server")
    export.add_argument("--out", required=True, help="new (or empty) directory to write the export to")
    export.add_argument("--format", default="merged", choices=("merged", "peft", "peft-vllm"),
                        help="merged: full model in the base dtype, sharded (default); peft: the adapter as trained; "
                             "peft-vllm: the adapter without modules vLLM cannot serve (lm_head)")
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard of a merged export")
    export.add_argument("--push-to-hub", metavar="REPO",
                        help="also upload to this Hugging Face repo (token: HF_TOKEN; hub: HF_ENDPOINT)")
    export.add_argument("--private", action="store_true", help="create the --push-to-hub repo private")
    export.add_argument("--quiet", action="store_true", help="no progress bars, no summary (warnings still show)")
    export.add_argument("--base-model", help="base model dir or HF id (default: the one the checkpoint names)")
    export.add_argument("--data-dir", default="./data", help="the server's data dir (for tinker:// paths)")
    export.add_argument("--database-url", default=None, help="the server's database URL (for tinker:// paths)")
    export.set_defaults(func=_export)
    tiny = sub.add_parser("make-tiny-model", help="write a tiny random HF checkpoint with a BPE tokenizer")
    tiny.add_argument("rest", nargs=argparse.REMAINDER)
    tiny.set_defaults(func=lambda a: __import__("tinsmith.devtools.tiny_model", fromlist=["main"]).main(a.rest) or 0)
    from tinsmith.demo.run import add_arguments as add_demo_arguments, run_from_args as run_demo

    demo = sub.add_parser("demo", help="pre-train a small model offline, then improve it with RL through the SDK")
    add_demo_arguments(demo)
    demo.set_defaults(func=run_demo)
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
