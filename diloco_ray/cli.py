"""The ``diloco-ray`` command: ``train CONFIG [--set KEY=VALUE ...]``, ``report OUTPUT_DIR``
and ``scale OUTPUT_DIR N``.

Exit status: 0 done; 2 bad config or input (one line naming the field or file and what
is allowed, no traceback); 1 any other failure. A full disk is an environment failure:
exit 1, but one line too (which folder, which file, how to go on), since there is
nothing in a traceback the user could act on.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Optional

from diloco_ray import logs
from diloco_ray.config.schema import field_help, parse_set
from diloco_ray.errors import UsageError, UserInputError, disk_full, unwrap

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
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field; VALUE is YAML (e.g. lr=3e-4, target_modules=[q_proj,v_proj])",
    )
    train.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (file, --set, defaults) as YAML and exit without training",
    )
    report = sub.add_parser("report", help="plot and summarise a run's metrics.jsonl")
    report.add_argument("output_dir", help="a run's output_dir")
    scale = sub.add_parser("scale", help="ask a running job to change its replica count at the next round")
    scale.add_argument("output_dir", help="the running job's output_dir")
    scale.add_argument("replicas", type=_replica_count, help="the new target (clamped to [min_replicas, max_replicas])")
    return parser


def _train(args) -> int:
    from diloco_ray.config.schema import TrainerConfig
    from diloco_ray.driver.trainer import DilocoFSDPTrainer

    config = TrainerConfig.from_yaml(args.config, overrides=parse_set(args.overrides))
    if args.print_config:
        print(config.yaml_text(), end="")
        return EXIT_OK
    shown = _ShowProgress(config)
    # SIGTERM (a spot preemption, `ray job stop`) stops the run as Ctrl-C does: cleanly,
    # with a checkpoint of the last completed round when checkpoints are on.
    trainer = DilocoFSDPTrainer(config, callbacks=[shown], stop_on_sigterm=True)
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
    last = result.rounds[-1] if result.rounds else {}
    print(f"done: {len(result.rounds)} rounds, eval_loss {last.get('eval_loss')}, model in {result.final_path}")
    return EXIT_OK


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
    from diloco_ray.observe.report import write_report

    print(write_report(args.output_dir))
    return EXIT_OK


class _ShowProgress:
    """Feeds the trainer's callbacks to a :class:`~diloco_ray.observe.progress.Progress` on
    stdout: bars on a terminal, plain lines otherwise (logs, ``ray job submit``)."""

    def __init__(self, config):
        from diloco_ray.observe.progress import Progress

        # stdout: bars on a terminal, and in a log the round lines users read as results.
        self.progress = Progress(config.diloco_loops, config.max_steps, stream=sys.stdout)

    def on_train_begin(self, trainer) -> None:
        self.progress.start(trainer.round_index)

    def on_round_begin(self, trainer, round_index: int, replicas: int) -> None:
        self.progress.begin_round(round_index, replicas)

    def on_step(self, trainer, event: dict) -> None:
        self.progress.step(event["replica"], event["step"], event["loss"], event["lr"], event["tokens"])

    def on_round_end(self, trainer, record: dict) -> None:
        self.progress.end_round(record)

    def on_train_end(self, trainer) -> None:
        self.progress.close()


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        logs.to_stderr()
        return {"train": _train, "report": _report, "scale": _scale}[args.command](args)
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


def disk_full_line(error: OSError, output_dir: Optional[str], resumable: bool = False) -> str:
    """The one line for a full disk (or quota): the folder, the file, and how to go on.

    Args:
        error: the ENOSPC/EDQUOT error (:func:`~diloco_ray.errors.disk_full`); its
            ``filename`` is None when a write to an open file failed.
        output_dir: the run's folder, when the command has one.
        resumable: whether to point at the last good checkpoint (``train``).
    """
    from diloco_ray.persist import storage

    what = os.strerror(error.errno).lower()  # "no space left on device", "disk quota exceeded"
    path = error.filename if isinstance(error.filename, str) else None
    local = output_dir and not storage.is_remote(output_dir)
    inside = local and (_is_under(path, output_dir) if path else _nearly_full(output_dir))
    if not inside:
        if path:
            return f"{what} writing '{path}'; free space on that disk and run again"
        # A write to an open file names no file; output_dir's disk has room, so it was another one.
        return f"{what} on a disk the run writes to (not output_dir's; Ray's temp folder?); free space and run again"
    line = f"output_dir: {what} writing '{path or output_dir}'; free space under '{output_dir}'"
    if not resumable:
        return line
    from diloco_ray.persist import checkpoint

    try:
        last, _ = checkpoint.latest_valid(os.path.join(output_dir, "checkpoints"))
    except OSError:
        last = None
    if last is None:
        return f"{line}, then run again (no checkpoint was written to resume from)"
    return f"{line}, then resume from its last good checkpoint ({last}) with --set resume_from={output_dir}"


def _is_under(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def _nearly_full(folder: str) -> bool:
    """Whether ``folder``'s filesystem has (almost) nothing left: a write that failed with
    no file name (a write to an open file) most likely failed there."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < max(64 << 20, st.f_blocks * st.f_frsize // 100)


if __name__ == "__main__":
    sys.exit(main())
