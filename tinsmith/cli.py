"""``tinsmith`` command line: ``serve`` runs the server; ``status`` prints a running server's
summary; ``export`` writes a LoRA checkpoint in formats other tools load; ``make-tiny-model``
writes a test model; ``demo`` trains a small model with RL through the SDK.

Built with click. ``serve`` gets one flag per ``ServerConfig`` field; the values themselves are
read and checked by ``load_config`` (pydantic-settings), so a flag, its ``TINSMITH_*`` variable
and its YAML key behave alike. Every error is one line on stderr with a non-zero exit: 2 for a
mistake in what was asked (an option, a model id), 1 for a failure while starting.
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from typing import Any

import click

from tinsmith.server.config import ENV_PREFIX, ServerConfig, env_name, flag_name, option_help, option_kind

DEBUG_HINT = "run with --log-level debug for the full traceback"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
             no_args_is_help=True)
@click.version_option(package_name="tinsmith", prog_name="tinsmith", message="%(prog)s %(version)s")
def cli() -> None:
    """Self-hosted server for the Tinker API."""


# ----------------------------------------------------------------------------------------- serve
def _default_text(option: str) -> str | None:
    """The default as ``--help`` shows it; None where the help text already says it."""
    default = ServerConfig.model_fields[option].default
    if default is None:
        return None if "(default" in option_help(option) else "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, list):
        return ", ".join(default) or "none"
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def _server_option(option: str) -> click.Option:
    """The flag of one ServerConfig field. It carries the raw text: pydantic checks it, so the
    same rules and one-line errors apply to flags, environment and YAML."""
    default = _default_text(option)
    extra = f"env {env_name(option)}" + (f"; default: {default}" if default is not None else "")
    kind = option_kind(option)
    help_text = f"{option_help(option)}{' (repeatable)' if kind is list else ''}  [{extra}]"
    if kind is bool:
        name = option.replace("_", "-")
        return click.Option([f"--{name}/--no-{name}", option], default=None, help=help_text)
    metavar = {int: "INT", float: "NUMBER", list: "TEXT"}.get(kind, "TEXT")
    if option == "log_level":
        metavar = "[debug|info|warning|error]"
    return click.Option([flag_name(option), option], default=None, multiple=kind is list, metavar=metavar,
                        help=help_text)


def _serve_command() -> click.Command:
    params = [click.Option(["--config", "config"], default=None, metavar="FILE",
                           help=f"YAML file with any of the options below (underscored names)  "
                                f"[env {ENV_PREFIX}CONFIG]")]
    params += [_server_option(option) for option in ServerConfig.model_fields]
    return click.Command(
        "serve", params=params, callback=_serve,
        help="Run the server. Options come from, in rising precedence: defaults, the --config YAML file, "
             "TINSMITH_* environment variables, flags.",
        short_help="run the server")


def _serve(**flags: Any) -> int:
    from tinsmith.host_malloc import tune_for_serving as tune_malloc

    malloc_left_alone = tune_malloc()  # first: before the process starts threads or makes tensors
    from tinsmith.server.config import ConfigError, load_config
    from tinsmith.server.startup import (StartupError, bind_listening_socket, check_models, check_parallel,
                                         check_precision)

    try:
        config = load_config(flags)
    except ConfigError as e:
        return _fail(e.message, 2)
    from tinsmith.server.logs import configure_logging

    configure_logging(config.log_level, config.log_format)
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # import-time chatter
    if malloc_left_alone is not None:
        logging.getLogger("tinsmith.host_malloc").info("glibc's allocator left as it is: %s", malloc_left_alone)
    try:  # cheap checks first: a minute into loading a model is too late to hear of a typo
        sock = bind_listening_socket(config.host, config.port)
    except StartupError as e:
        return _fail(str(e), 2)
    try:
        check_models(config.base_model, config.aliases())
        check_parallel(config.tensor_parallel_size, config.ray_address, config.data_parallel_size)
        check_precision(config.resolved_device, config.dtype)
    except (StartupError, ValueError) as e:
        sock.close()
        return _fail(str(e), 2)
    return _start(config, sock)


def _start(config: ServerConfig, sock) -> int:
    """Build the server, claim the data dir, load the models, then serve on ``sock``."""
    import uvicorn

    from tinsmith.api.app import create_app
    from tinsmith.gc_tuning import release_at_exit, tune_for_serving
    from tinsmith.server.exclusive import AlreadyServing
    from tinsmith.server.private import set_private_umask
    from tinsmith.server.state import ServerState

    set_private_umask()  # before anything is written: the database, checkpoints, the secret
    debug = config.log_level == "debug"
    state = None
    try:
        state = ServerState.build(config)
        # SIGHUP would end the process while models load; reload the keys file instead.
        signal.signal(signal.SIGHUP, lambda *_: state.auth.reload() if state.auth.multi_tenant else None)
        state.prepare()  # claims first: a second server is refused before recovery or models
    except AlreadyServing as e:
        sock.close()
        return _fail(str(e), 1)
    except KeyboardInterrupt:
        sock.close()
        if state is not None:
            state.release()
        return _fail("interrupted during start-up", 130)
    except Exception as e:  # one line, whatever broke: the traceback is for --log-level debug
        sock.close()
        if state is not None:
            state.release()
        if debug:
            traceback.print_exception(e)
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _fail(cause if debug else f"{cause}; {DEBUG_HINT}", 1)
    try:
        if not state.auth.multi_tenant:
            logging.getLogger("tinsmith").warning(
                "no --api-keys-file: local single-user mode, any 'tml-' API key is accepted"
            )
        # log_config=None: uvicorn keeps the handler configure_logging set, so its lines share the
        # format; no access log, since every request already gets its own line.
        server = uvicorn.Server(uvicorn.Config(create_app(state), host=config.host, port=config.port,
                                               log_level=config.log_level, log_config=None, access_log=False))
        tune_for_serving()  # the models, modules and app live as long as the process
        server.run(sockets=[sock])
    finally:
        state.release()
        release_at_exit()
    return 0 if server.started else 1


def _fail(message: str, code: int) -> int:
    print(f"tinsmith: {message}", file=sys.stderr)
    return code


cli.add_command(_serve_command())


# ---------------------------------------------------------------------------------------- status
@cli.command("status", short_help="print a running server's runs, queue and health (as the dashboard shows)")
@click.option("--base-url", default=None, help="the server  [default: $TINKER_BASE_URL, else http://127.0.0.1:8000]")
@click.option("--api-key", default=None, help="API key  [default: $TINKER_API_KEY]")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON instead")
def status(base_url: str | None, api_key: str | None, as_json: bool) -> int:
    """Print what the dashboard's summary shows: runs, queue, snapshots and server health."""
    from tinsmith import status as status_view

    return status_view.run(base_url, api_key, as_json)


# ---------------------------------------------------------------------------------------- export
@cli.command("export", short_help="export a LoRA checkpoint: merged HF model, or PEFT adapter (for vLLM too)")
@click.argument("checkpoint")
@click.option("--out", required=True, help="new (or empty) directory to write the export to")
@click.option("--format", "fmt", type=click.Choice(["merged", "peft", "peft-vllm"]), default="merged",
              show_default=True,
              help="merged: full model in the base dtype, sharded; peft: the adapter as trained; "
                   "peft-vllm: the adapter without modules vLLM cannot serve (lm_head)")
@click.option("--max-shard-size", default="5GB", show_default=True, help="largest safetensors shard of a merged export")
@click.option("--push-to-hub", metavar="REPO", default=None,
              help="also upload to this Hugging Face repo (token: HF_TOKEN; hub: HF_ENDPOINT)")
@click.option("--private", is_flag=True, help="create the --push-to-hub repo private")
@click.option("--quiet", is_flag=True, help="no progress bars, no summary (warnings still show)")
@click.option("--base-model", default=None,
              help="base model dir or HF id  [default: the one the checkpoint names]")
@click.option("--data-dir", default="./data", show_default=True, help="the server's data dir (for tinker:// paths)")
@click.option("--database-url", default=None,
              help="the server's database URL (for tinker:// paths)  [default: SQLite in --data-dir]")
def export(checkpoint: str, out: str, fmt: str, max_shard_size: str, push_to_hub: str | None, private: bool,
           quiet: bool, base_model: str | None, data_dir: str, database_url: str | None) -> int:
    """Export a LoRA checkpoint (a checkpoint directory, or tinker://RUN/KIND/NAME of this server's
    database): merged into its base model as a Hugging Face model, or as a PEFT adapter."""
    from pathlib import Path

    from tinsmith.checkpoints.export import run_export
    from tinsmith.progress import progress_wanted
    from tinsmith.errors import TinsmithError

    source = checkpoint
    try:
        if source.startswith("tinker://"):
            from tinsmith.checkpoints.paths import parse_tinker_path
            from tinsmith.store import Store

            cfg = ServerConfig(data_dir=data_dir, database_url=database_url)
            tp = parse_tinker_path(source, "checkpoint")
            store = Store(cfg.resolved_database_url)
            ck = store.get_checkpoint(tp.run_id, tp.kind, tp.name)
            store.close()
            if ck is None:
                print(f"tinsmith export: no checkpoint {source} in {cfg.resolved_database_url}", file=sys.stderr)
                return 1
            source = ck.storage_path
        result = run_export(Path(source), Path(out), fmt, base_model, max_shard_size, push_to_hub, private,
                            progress_wanted(quiet))
    except TinsmithError as e:
        print(f"tinsmith export: {e.message}", file=sys.stderr)
        return 1
    if not quiet:
        print(f"tinsmith export: {result.summary}", file=sys.stderr)
    for w in result.warnings:
        print(f"tinsmith export: warning: {w}", file=sys.stderr)
    print(result.path)
    return 0


# ------------------------------------------------------------ commands that keep their own parser
_PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@cli.command("make-tiny-model", context_settings=_PASS_THROUGH, add_help_option=False,
             short_help="write a tiny random HF checkpoint with a BPE tokenizer")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def make_tiny_model(args: tuple[str, ...]) -> int:
    """Write a tiny random HF checkpoint (see ``tinsmith make-tiny-model --help``)."""
    from tinsmith.devtools.tiny_model import main as tiny_main

    tiny_main(list(args), prog="tinsmith make-tiny-model")
    return 0


@cli.command("demo", context_settings=_PASS_THROUGH, add_help_option=False,
             short_help="pre-train a small model offline, then improve it with RL through the SDK")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def demo(args: tuple[str, ...]) -> int:
    """Pre-train a small model offline, then improve it with RL (see ``tinsmith demo --help``)."""
    from tinsmith.demo.run import main as demo_main

    return demo_main(list(args))


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (click's own errors as one line, status 2).

    ``make-tiny-model`` and ``demo`` keep their argparse parsers, whose ``--help`` and errors
    raise ``SystemExit`` as usual.
    """
    try:
        result = cli.main(args=argv, prog_name="tinsmith", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help() if e.ctx else "", err=True)
        return 2
    except click.UsageError as e:
        command = e.ctx.command_path if e.ctx else "tinsmith"
        return _fail_as(command, f"{e.format_message().rstrip('.')}; see `{command} --help`", 2)
    except click.ClickException as e:
        return _fail_as("tinsmith", e.format_message(), e.exit_code)
    except click.Abort:
        return _fail_as("tinsmith", "aborted", 130)
    return result if isinstance(result, int) else 0


def _fail_as(command: str, message: str, code: int) -> int:
    print(f"{command}: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
