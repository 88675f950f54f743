"""The ``diloco-ray`` command: ``train CONFIG [--set KEY=VALUE ...]``, ``report OUTPUT_DIR``
and ``scale OUTPUT_DIR N``.

Exit status: 0 done; 2 bad config or input (one line naming the field or file and what
is allowed, no traceback); 1 any other failure.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from diloco_ray.config import field_help, parse_set
from diloco_ray.errors import UserInputError, unwrap

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2


def _fields_epilog() -> str:
    lines = ["config fields (set in the YAML file or with --set KEY=VALUE):"]
    for name, default, help in field_help():
        lines.append(f"  {name} (default {default!r})")
        lines.extend(textwrap.wrap(help, 76, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco-ray", description="DiLoCo training on a Ray cluster.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a DiLoCo job", epilog=_fields_epilog(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", help="YAML config file (e.g. configs/tiny.yaml)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field; VALUE is YAML (e.g. lr=3e-4, target_modules=[q_proj,v_proj])")
    report = sub.add_parser("report", help="plot and summarise a run's metrics.jsonl")
    report.add_argument("output_dir", help="a run's output_dir")
    scale = sub.add_parser("scale", help="ask a running job to change its replica count at the next round")
    scale.add_argument("output_dir", help="the running job's output_dir")
    scale.add_argument("replicas", type=int, help="the new target (clamped to [min_replicas, max_replicas])")
    return parser


def _train(args) -> int:
    from diloco_ray.config import TrainerConfig
    from diloco_ray.trainer import DilocoFSDPTrainer

    config = TrainerConfig.from_yaml(args.config, overrides=parse_set(args.overrides))
    result = DilocoFSDPTrainer(config, callbacks=[_PrintProgress(config.diloco_loops)]).train()
    last = result.rounds[-1] if result.rounds else {}
    print(f"done: {len(result.rounds)} rounds, eval_loss {last.get('eval_loss')}, model in {result.final_path}")
    return EXIT_OK


def _scale(args) -> int:
    from diloco_ray.trainer import request_scale

    print(f"requested {args.replicas} replicas: {request_scale(args.output_dir, args.replicas)}")
    return EXIT_OK


def _report(args) -> int:
    from diloco_ray.report import write_report

    print(write_report(args.output_dir))
    return EXIT_OK


class _PrintProgress:
    """One line per round on stdout."""

    def __init__(self, total: int):
        self.total = total

    def on_round_end(self, trainer, record) -> None:
        ev = record["eval_loss"]
        print(f"round {record['round'] + 1}/{self.total}  replicas {record['replicas']}  "
              f"train_loss {record['train_loss']:.4f}  eval_loss {'-' if ev is None else f'{ev:.4f}'}  "
              f"tokens {record['tokens']}  {record['round_seconds']:.1f}s "
              f"(sync {record['sync_seconds']:.2f}s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"train": _train, "report": _report, "scale": _scale}[args.command](args)
    except KeyboardInterrupt:
        print("diloco-ray: interrupted", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as e:  # one clear line for bad input; a traceback for real failures
        cause = unwrap(e)
        if isinstance(cause, UserInputError):
            print(f"diloco-ray: error: {cause}", file=sys.stderr)
            return EXIT_BAD_INPUT
        raise


if __name__ == "__main__":
    sys.exit(main())
