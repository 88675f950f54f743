"""The ``diloco-ray`` command: ``train CONFIG [--set KEY=VALUE ...]``, ``sweep CONFIG --grid
FIELD=V1,V2 [...]``, ``report OUTPUT_DIR`` (a run's, or a sweep's ``OUTPUT_DIR/sweep``) and
``scale OUTPUT_DIR N``.

Exit status: 0 done; 2 bad config or input (one line naming the field or file and what
is allowed, no traceback); 1 any other failure. A full disk is an environment failure:
exit 1, but one line too (which folder, which file, how to go on), since there is
nothing in a traceback the user could act on.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Optional

from diloco_ray import logs
from diloco_ray.config.schema import field_help, parse_set
from diloco_ray.errors import UsageError, UserInputError, disk_full, unwrap
from diloco_ray.observe.console import ConsoleProgress
from diloco_ray.persist.disk_full import disk_full_line

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2


def _fields_epilog() -> str:
    lines = ["config fields (set in the YAML file or with --set KEY=VALUE):"]
    for name, default, help in field_help():
        lines.append(f"  {name} (default {default!r})")
        lines.extend(textwrap.wrap(help, 76, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line like any other bad input: argparse's
    usage block plus message (two lines, and a ``SystemExit`` from inside a library call)
    becomes a :class:`UsageError` carrying the message and the usage on one line.
    ``--help`` is untouched. Sub-commands' parsers are of this class too."""

    def error(self, message: str):
        usage = " ".join(self.format_usage().split())  # argparse wraps a long usage over lines
        # "argument replicas: ..." -> "replicas: ...": the field first, as in every other message.
        message = message.removeprefix("argument ")
        raise UsageError(f"{message}; {usage} (see {self.prog} --help)")


def _replica_count(text: str) -> int:
    """``scale``'s replica count: a whole number >= 1, said in the same words as the
    other checks (the driver clamps it to its bounds)."""
    try:
        value, shown = int(text), text
    except ValueError:
        value, shown = None, repr(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(
            f"{shown} is not allowed; give a whole number >= 1 (the driver clamps it to [min_replicas, max_replicas])"
        )
    return value


def _add_set(parser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field; VALUE is YAML (e.g. lr=3e-4, target_modules=[q_proj,v_proj])",
    )


def _add_verbose(parser) -> None:
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show Ray's own output and what the actors print here too "
        "(by default it goes to OUTPUT_DIR/logs/ray.log), and the data preparation's progress bars",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="diloco-ray",
        description="DiLoCo training on a Ray cluster. "
        "`diloco-ray train --help` lists every config field with its default and meaning.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="run a DiLoCo job", epilog=_fields_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    train.add_argument("config", help="YAML config file (e.g. configs/tiny.yaml)")
    _add_set(train)
    _add_verbose(train)
    train.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (file, --set, defaults) as YAML and exit without training",
    )
    sweep = sub.add_parser(
        "sweep",
        help="run a grid of trials through Ray Tune (ASHA stops bad ones early)",
        description="Every combination of the --grid values, each a full run in OUTPUT_DIR/sweep/<trial>; "
        "writes OUTPUT_DIR/sweep/results.jsonl and best.yaml and prints a table.",
    )
    sweep.add_argument("config", help="YAML config file every trial starts from")
    sweep.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="FIELD=V1,V2,...",
        help="a field and its values (YAML, comma-separated); repeat for more fields",
    )
    _add_set(sweep)
    _add_verbose(sweep)
    sweep.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        metavar="N",
        help="at most N trials at once (default: as many as the cluster holds side by side)",
    )
    sweep.add_argument(
        "--grace-rounds",
        type=int,
        default=1,
        metavar="R",
        help="rounds every trial runs before it may be stopped early",
    )
    report = sub.add_parser("report", help="plot and summarise a run's metrics.jsonl, or a sweep's results")
    report.add_argument("output_dir", help="a run's output_dir, or a sweep's OUTPUT_DIR/sweep")
    scale = sub.add_parser("scale", help="ask a running job to change its replica count at the next round")
    scale.add_argument("output_dir", help="the running job's output_dir")
    scale.add_argument("replicas", type=_replica_count, help="the new target (clamped to [min_replicas, max_replicas])")
    _add_region(sub)
    return parser


def _add_region(sub) -> None:
    """``diloco-ray region``: the agent a region runs on its own Ray cluster."""
    region = sub.add_parser(
        "region",
        help="on a region's own Ray cluster: join a run's home over its channel and train this region's replicas",
    )
    region.add_argument("--home", required=True, metavar="HOST:PORT", help="the home's channel address")
    region.add_argument("--name", required=True, help="this region's name, as the home's regions field names it")
    region.add_argument(
        "--ca-cert", required=True, metavar="FILE", help="CA certificate (PEM) the home's is checked against"
    )
    region.add_argument("--server-name", default=None, help="the name on the home's certificate, when it is not HOST")
    region.add_argument("--token-file", default=None, help="a file holding the channel's token (default: --token-env)")
    region.add_argument("--token-env", default="DILOCO_CHANNEL_TOKEN", help="the variable holding the token")
    region.add_argument("--output-dir", default="outputs/region", help="this region's own folder (its logs)")
    region.add_argument(
        "--give-up-after-s",
        type=float,
        default=900.0,
        metavar="S",
        help="leave when the home cannot be reached for this long (a home restarting from its checkpoint "
        "is waited for; default 900)",
    )


def _region(args) -> int:
    from diloco_ray.channel.client import ChannelClient, ChannelDown, ChannelRefused
    from diloco_ray.channel.credentials import read_pem, read_token
    from diloco_ray.regions.agent import RegionAgent

    if args.give_up_after_s <= 0:
        raise UserInputError(f"--give-up-after-s: {args.give_up_after_s:g} is not allowed; give seconds above 0")
    token = read_token(args.token_file, args.token_env)
    ca = read_pem(args.ca_cert, "--ca-cert")
    client = ChannelClient(args.home, args.name, token, ca, server_name=args.server_name, log=logs.log.warning)
    try:
        synced = RegionAgent(client, args.output_dir, give_up_after_s=args.give_up_after_s).run()
    except ChannelRefused as refused:
        print(f"diloco-ray: error: {refused}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ChannelDown as down:
        print(f"diloco-ray: error: {down}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"region {args.name}: done, {synced} syncs", flush=True)
    return EXIT_OK


def _train(args) -> int:
    from diloco_ray.config.schema import TrainerConfig

    config = TrainerConfig.from_yaml(args.config, overrides=parse_set(args.overrides))
    if args.print_config:
        print(config.yaml_text(), end="")
        return EXIT_OK
    # Only now torch and Ray, whose imports take a while: a config that is wrong is one
    # line at once.
    from diloco_ray.driver.trainer import DilocoFSDPTrainer

    s = config.sections()
    shown = ConsoleProgress(s.run, s.membership, s.channel, verbose=args.verbose)
    if not args.verbose:
        _quiet_data_bars()
    # SIGTERM (a spot preemption, `ray job stop`) stops the run as Ctrl-C does: cleanly,
    # with a checkpoint of the last completed round when checkpoints are on.
    trainer = DilocoFSDPTrainer(config, callbacks=[shown], stop_on_sigterm=True, ray_output_to_file=not args.verbose)
    try:
        result = trainer.train()
    except Exception as e:
        full = disk_full(e)
        if full is None:
            raise
        # The checkpoint (or final/) being written when the disk filled is a temp folder that
        # nothing will read: give its space back now (the run has stopped; nothing writes).
        try:
            trainer.run_dir.discard_partial_writes()
        except OSError:
            pass
        return _disk_full_exit(full, config.output_dir, resumable=True)
    except KeyboardInterrupt as e:
        return _stopped_exit(trainer, e, config.output_dir)
    finally:
        shown.progress.close()
    print(shown.done_line(result))
    return EXIT_OK


def _quiet_data_bars() -> None:
    """The data preparation's progress bars (``datasets``' ``map``) stay off the console: it
    takes a second for the default, and its bars are noise between the lines users read."""
    try:
        from datasets.utils.logging import disable_progress_bar
    except ImportError:
        return
    disable_progress_bar()


def _stopped_exit(trainer, interrupt: KeyboardInterrupt, output_dir: str) -> int:
    """Say what stopped the run and what it kept; the exit status of that signal."""
    import signal

    name = trainer.stopped_by or getattr(interrupt, "signal_name", "SIGINT")
    saved = (
        f"checkpoint {trainer.stop_checkpoint} written; resume with --set resume_from={output_dir}"
        if trainer.stop_checkpoint
        else "no checkpoint written (set checkpoint_steps to keep one)"
    )
    print(f"\ndiloco-ray: stopped by {name} at round {trainer.round_index}; {saved}", file=sys.stderr)
    return 128 + getattr(signal, name, signal.SIGINT).value


def _scale(args) -> int:
    from diloco_ray.persist.run_folder import request_scale

    print(f"requested {args.replicas} replicas: {request_scale(args.output_dir, args.replicas)}")
    return EXIT_OK


def _report(args) -> int:
    from diloco_ray.sweep.report import is_sweep, write_sweep_report

    if is_sweep(args.output_dir):
        print(write_sweep_report(args.output_dir))
        return EXIT_OK
    from diloco_ray.observe.report import write_report

    print(write_report(args.output_dir))
    return EXIT_OK


def _sweep(args) -> int:
    from diloco_ray.sweep.results import table
    from diloco_ray.sweep.runner import run_sweep_cli

    if not args.verbose:
        _quiet_data_bars()
    result = run_sweep_cli(
        args.config,
        args.grid,
        parse_set(args.overrides),
        line=lambda text, console=sys.stdout: print(text, file=console, flush=True),
        max_concurrent=args.max_concurrent,
        grace_rounds=args.grace_rounds,
        ray_output_to_file=not args.verbose,
    )
    print(table(result))
    return EXIT_OK if result.best is not None else EXIT_FAILURE


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        logs.to_stderr()
        commands = {"train": _train, "sweep": _sweep, "report": _report, "scale": _scale, "region": _region}
        return commands[args.command](args)
    except KeyboardInterrupt:
        print("diloco-ray: interrupted", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as e:  # one clear line for bad input; a traceback for real failures
        cause = unwrap(e)
        if isinstance(cause, UserInputError):
            # args[0], not str(): an error raised inside an actor arrives as Ray's
            # subclass, whose str() carries the remote traceback.
            message = cause.args[0] if cause.args else str(cause)
            print(f"diloco-ray: error: {message}", file=sys.stderr)
            return EXIT_BAD_INPUT
        full = disk_full(e)
        if full is not None:
            return _disk_full_exit(full, getattr(args, "output_dir", None), resumable=False)
        raise


def _disk_full_exit(error: OSError, output_dir: Optional[str], resumable: bool) -> int:
    """Print a full disk as one line and return exit status 1 (see :func:`disk_full_line`)."""
    print(f"diloco-ray: error: {disk_full_line(error, output_dir, resumable)}", file=sys.stderr)
    return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
