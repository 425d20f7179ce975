"""`arlo up | train | demo | status | export | plan`: the local front door.

`up` starts Redis (if none answers) and the services, and stays in the foreground until
SIGINT/SIGTERM; `train` drives a run against running services; `demo` does both on the
built-in config and exits; `status` shows versions, queue depth and health; `export` writes
the policy as a Hugging Face model directory (`train`/`demo --export DIR` do it at the end).
`plan` says, per device, what the run's trainer and inference need, before renting devices.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence

import grpc
from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table

from arlo.app import plan as memory_plan
from arlo.app import stopping
from arlo.app.driver import TrainReport, run_training
from arlo.app.live import LiveRun, errors_text
from arlo.app.local import (
    INFRA_SERVICES,
    LocalCluster,
    arlo_home,
    attach_cluster,
    load_cli_config,
    prepare_cluster,
    resolve_token,
    resolved_config_path,
)
from arlo.app.resilient import DEFAULT_RETRY, RetryPolicy
from arlo.app.run_record import RunRecorder
from arlo.app.serving import NotRunning, require_serving
from arlo.app.status import collect_status
from arlo.app.status_view import print_status
from arlo.app.supervisor import ServiceFailed
from arlo.config import ConfigError, load_config, replace_config
from arlo.data import resource_path
from arlo.report_file import report_path_problem, write_report

console = Console(stderr=True)


DEMO_RUN_ID = "demo"
DEMO_CONFIG = resource_path("demo.yaml")
DEMO_RL_STEPS = 80


def _start_cluster(config: str | None, *, free_ports: bool, with_rollout: bool, demo: bool = False) -> LocalCluster:
    # `up` and `demo` start from the given or built-in config, never from a previous run's.
    # The built-in demo owns its run namespace and starts it afresh; a user's run is never wiped.
    own_run = demo and config is None
    cfg = load_config(DEMO_CONFIG if own_run else config)
    if own_run:
        cfg = replace_config(cfg, {"run_id": DEMO_RUN_ID})
    cluster = prepare_cluster(cfg, home=arlo_home(), free_ports=free_ports, fresh_run=own_run)
    if cluster.redis:
        console.print(f"started redis-server at {cluster.cfg.redis.url}")
    try:
        with console.status("starting services (first start compiles JAX programs)..."):
            cluster.start(INFRA_SERVICES)
            if with_rollout:
                cluster.start(("rollout",))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def cmd_up(args: argparse.Namespace) -> int:
    stopping.stop_on_sigterm()
    cluster = _start_cluster(args.config, free_ports=False, with_rollout=False)
    table = Table(title=f"arlo run '{cluster.cfg.run_id}'")
    for col in ("service", "address", "log"):
        table.add_column(col)
    for spec in cluster.supervisor.specs:
        table.add_row(spec.name, spec.address, str(spec.log_path))
    console.print(table)
    console.print(f"config: {cluster.config_path}\nrun `arlo train` in another terminal; Ctrl-C stops everything")
    try:
        while True:
            for name in cluster.supervisor.check():
                console.print(f"[yellow]{name} died and was restarted")
            time.sleep(1.0)
    except (KeyboardInterrupt, stopping.Stop):
        console.print("stopping...")
    finally:
        cluster.stop()
    return 0


def _train_with_progress(cluster_or_none: LocalCluster | None, cfg, token, steps: int | None, *, evaluate: bool,
                         started: float, retry: RetryPolicy = DEFAULT_RETRY,
                         ) -> tuple[TrainReport, RunRecorder, Exception | None]:
    """Drives the run with the live display. A Ctrl-C or SIGTERM during the drive ends it early
    and is not raised: the report it returns says `interrupted` and holds what the drive saw. An
    error is returned beside the report (its `failed` says it), for the caller to raise once the
    report is written: a run that failed at step 500 keeps the figures of its 499 steps."""
    with stopping.deferred():  # it imports tensorboardX, and torch: native code a raised stop would abort
        recorder = RunRecorder(arlo_home() / "runs" / f"{cfg.run_id}-{time.strftime('%Y%m%d-%H%M%S')}",
                               run_id=cfg.run_id)
    display = LiveRun(console, rl_steps=steps)
    report, error = TrainReport(), None

    def check() -> None:  # every second, whatever the drive waits on (supervisor.supervising)
        for name in cluster_or_none.supervisor.check() if cluster_or_none else ():
            _say(f"[yellow]{name} died and was restarted")

    def on_progress(row: dict) -> None:
        if row.get("phase") == "rl" and report.first_rl_step_s is None:
            report.first_rl_step_s = round(time.monotonic() - started, 3)
        display.update(row)

    try:
        with display:
            stopping.run(run_training(cfg, token, steps=steps, on_progress=on_progress, check_children=check,
                                      recorder=recorder, evaluate=evaluate, retry_policy=retry, report=report))
    except (KeyboardInterrupt, stopping.Stop):
        report.interrupted = True
    except Exception as e:
        report.failed, error = f"{type(e).__name__}: {e}", e
    finally:
        # Closing draws the plot (half a second or more): a second Ctrl-C there lost the report.
        with stopping.shielded() as shield:
            recorder.close()
    report.interrupted |= shield.signalled
    return report, recorder, error


def _write_json(report: TrainReport, json_path: str | None) -> bool:
    """`--json`, first of all a run's output: False when it could not be written (said why)."""
    if not json_path:
        return True
    try:
        write_report(json_path, json.dumps(report.to_json(), indent=2))
        return True
    except OSError as e:  # checked before the run (`report_path_problem`); the disk may still fill up
        _say(f"[red]could not write --json {json_path}: {e}")
        return False


def _say(text: str) -> None:
    """Prints to the terminal unless it is gone (a SIGHUP: writing there fails), which must not
    cost what comes after (the services' stop)."""
    try:
        console.print(text)
    except OSError:
        pass


def _print_report(report: TrainReport, recorder: RunRecorder) -> None:
    if report.failed:
        _say(f"[red]failed after {report.steps} steps ({report.rl_steps} RL) in {report.wall_s:.1f}s")
    elif report.interrupted:
        _say(f"interrupted after {report.steps} steps ({report.rl_steps} RL) in {report.wall_s:.1f}s")
    else:
        _say(f"trained {report.steps} steps ({report.sft_steps} SFT) in {report.wall_s:.1f}s; pointer at "
             f"version {report.pointer_version}; inference serving {report.inference_versions}")
    summary = report.to_json()
    if summary["rl_steps_per_s"] is not None:
        _say(f"RL throughput: {summary['rl_steps_per_s']:.2f} steps/s, {summary['trajectories_per_s']:.1f} "
             f"trajectories/s, {summary['generated_tokens_per_s']:.0f} generated tokens/s over the RL phase's "
             f"{report.rl_wall_s:.1f}s (its first step's wait included)")
    if report.evals:
        line = ", ".join(f"{tag} {summary[f'reward_{tag}']:.3f}" for tag in ("start", "after_sft", "end")
                         if summary.get(f"reward_{tag}") is not None)
        _say(f"held-out reward (sampled): {line}")
        if summary.get("reward_end_by_env"):
            _say("held-out reward (sampled) at the end, by environment: " + ", ".join(
                f"{k} {v:.3f}" for k, v in summary["reward_end_by_env"].items() if v is not None))
        for tag, e in report.evals.items():
            if e.get("errors"):
                _say(f"[red]eval {tag}: {errors_text(e)}")
    elif report.rewards:
        _say(f"training reward: first step {report.rewards[0]:.3f}, last step {report.rewards[-1]:.3f}")
    _say(f"metrics: {recorder.metrics_path}, TensorBoard: {recorder.out_dir / 'tensorboard'}, "
         f"plot: {recorder.plot_path}")


def _drive_then_stop(cluster: LocalCluster, args: argparse.Namespace, *, steps: int | None, retry: RetryPolicy,
                     start: Sequence[str] = (), report_exits: bool = False) -> int:
    """`arlo train` and `arlo demo` after their services are up: starts `start`, drives the run,
    exports, reports, then stops what `cluster` started; the exit status (130: interrupted, 1:
    `--json` could not be written). A failed drive's error is raised once all that is done.

    The report (and `--json`) is written before the services stop, interrupted, failed or not,
    so a Ctrl-C keeps what the run did; a second one while they stop kills them (supervisor.py)."""
    cfg, token = cluster.cfg, cluster.token
    report, recorder, error = TrainReport(), None, None
    try:
        cluster.start(tuple(start))
        report, recorder, error = _train_with_progress(cluster, cfg, token, steps, evaluate=not args.no_eval,
                                                       started=args.started, retry=retry)
        if not report.interrupted and error is None:
            _export_at_end(cfg, token, args.export)  # while the trainer still serves its weights
    except (KeyboardInterrupt, stopping.Stop):
        report.interrupted = True
    finally:
        try:
            with stopping.shielded() as shield:  # a few ms: a stop here must not cost the report or the stop
                args.json_written = _write_json(report, args.json)
                if recorder is not None:
                    _print_report(report, recorder)
                elif report.interrupted:
                    _say("interrupted")
            report.interrupted |= shield.signalled
        finally:
            codes = cluster.stop()
        bad = {k: v for k, v in codes.items() if v not in (0, None)}
        if report_exits and bad:
            _say(f"[yellow]services exited uncleanly: {bad}")
    if error is not None:
        raise error
    return 130 if report.interrupted else 0 if args.json_written else 1


def _no_run_here(args: argparse.Namespace) -> bool:
    """No -c and no run recorded under ARLO_HOME: the built-in config's addresses would be another
    run's services (on the default ports), reported or driven as this one's (issue 33). Says so."""
    home = arlo_home()
    if args.config or resolved_config_path(home).is_file():
        return False
    _say(f"[red]arlo {args.command}: no run under ARLO_HOME {home} (`arlo up` records its run there, in config.yaml). "
         f"Run it with the ARLO_HOME of `arlo up` (default ./.arlo, from where it was started), or give -c")
    return True


def cmd_train(args: argparse.Namespace) -> int:
    # SIGTERM stops like Ctrl-C: the trainer is paused and the rollout worker stopped.
    stopping.stop_on_sigterm()
    if _no_run_here(args):
        _report_no_run(args, failed="no run under ARLO_HOME")
        return 1
    cfg = load_cli_config(args.config)
    token = resolve_token(cfg)
    require_serving(cfg, INFRA_SERVICES, outage_s=args.outage_s, on_wait=lambda down: _say(
        f"[yellow]waiting up to {args.outage_s:.0f}s (--outage-s) for {', '.join(down)}: the rest of the run serves"))
    cluster = attach_cluster(cfg, token, config_path=args.config)
    return _drive_then_stop(cluster, args, steps=args.steps, retry=RetryPolicy(outage_s=args.outage_s),
                            start=("rollout",))


def cmd_demo(args: argparse.Namespace) -> int:
    stopping.stop_on_sigterm()
    cluster = _start_cluster(args.config, free_ports=True, with_rollout=True, demo=True)
    steps = args.steps if args.steps is not None else DEMO_RL_STEPS
    return _drive_then_stop(cluster, args, steps=steps, retry=DEFAULT_RETRY, report_exits=True)


def _export_at_end(cfg, token, out: str | None) -> None:
    if out:
        # JAX and Flax, imported only by a command that exports: native code a raised stop would abort.
        with stopping.deferred(), console.status(f"exporting the policy to {out}..."):
            from arlo.app.export import export_run

            result = export_run(cfg, out, token=token)
        console.print(f"exported the policy to {result.out}")


def cmd_export(args: argparse.Namespace) -> int:
    from arlo.app.export import ExportError, export_run
    if args.version is not None and args.checkpoint:
        console.print("arlo export: give --version or --checkpoint, not both")
        return 2
    if args.version is not None and args.version < 0:
        console.print(f"arlo export: --version must be >= 0 (0: the initial weights), got {args.version}")
        return 2
    if not args.checkpoint and _no_run_here(args):  # its trainer would be another run's
        return 1
    cfg = load_cli_config(args.config)
    token = None if args.checkpoint else resolve_token(cfg)
    try:
        result = export_run(cfg, args.out, token=token, version=args.version, checkpoint=args.checkpoint or "",
                            adapter=args.adapter)
    except ExportError as e:
        console.print(f"[red]arlo export: {e}")
        return 1
    console.print(f"exported to {result.out}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    home = arlo_home()
    source = args.config or resolved_config_path(home)
    if _no_run_here(args):
        return 1
    cfg = load_cli_config(args.config)
    status = {**asyncio.run(collect_status(cfg, resolve_token(cfg))), "arlo_home": str(home), "config": str(source)}
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print_status(status, source)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arlo", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start Redis (if needed) and every service; Ctrl-C stops them")
    up.add_argument("-c", "--config", help="run config YAML (default: built-in)")
    train = sub.add_parser("train", help="run training against running services")
    train.add_argument("-c", "--config", help="run config YAML (default: the one `arlo up` recorded under $ARLO_HOME)")
    train.add_argument("--steps", type=int, help="stop after N RL steps, after any SFT warm start (default: until Ctrl-C)")
    train.add_argument("--json", help="write the run's figures to this file")
    train.add_argument("--no-eval", action="store_true", help="skip the held-out evaluations")
    train.add_argument("--export", metavar="DIR", help="after the last step, write the policy to DIR (Hugging Face format)")
    train.add_argument("--outage-s", type=float, default=DEFAULT_RETRY.outage_s,
                       help="how long a service (trainer, inference, Redis) may stay down or hung before the run "
                            f"gives up; every call retries meanwhile (default {DEFAULT_RETRY.outage_s:.0f})")
    demo = sub.add_parser("demo", help="start everything on the built-in config, train, stop")
    demo.add_argument("-c", "--config", help="run config YAML (default: built-in)")
    demo.add_argument("--steps", type=int, help=f"RL steps after the SFT warm start (default {DEMO_RL_STEPS})")
    demo.add_argument("--json", help="write the run's figures (reward_start, reward_after_sft, reward_end, wall_s, "
                                     "...) to this file")
    demo.add_argument("--no-eval", action="store_true", help="skip the held-out evaluations")
    demo.add_argument("--export", metavar="DIR", help="after the last step, write the policy to DIR (Hugging Face format)")
    export = sub.add_parser("export", help="write a run's policy as a Hugging Face model directory")
    export.add_argument("--out", required=True, help="directory to create (must be empty if it exists)")
    export.add_argument("-c", "--config", help="run config YAML (default: the one `arlo up` recorded under $ARLO_HOME)")
    export.add_argument("--version", type=int, help="a version the running trainer still holds, or its checkpoint; "
                        "0: the initial weights (model.path or the preset); default: the newest")
    export.add_argument("--checkpoint", help="an Orbax checkpoint directory (<trainer.checkpoint_dir>/<version>)")
    export.add_argument("--adapter", action="store_true",
                        help="a LoRA run (trainer.lora): write the adapters alone as a PEFT adapter directory for "
                             "the base at model.path (default: the base with the adapters merged in)")
    status = sub.add_parser("status", help="versions, queue depth and health of a run")
    status.add_argument("-c", "--config", help="run config YAML (default: the one `arlo up` recorded under $ARLO_HOME)")
    status.add_argument("--json", action="store_true", help="print JSON")
    memory_plan.add_parser(sub)
    return parser


COMMANDS = {"up": cmd_up, "train": cmd_train, "demo": cmd_demo, "status": cmd_status, "export": cmd_export,
            "plan": memory_plan.cmd_plan}


MAX_STEPS = 10**12
"""`--steps` above this is a typo, not a run (and past int64 once added to the trainer's step)."""


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()  # the report's `first_rl_step_s` counts from here
    args = build_parser().parse_args(argv)
    args.started = started
    if getattr(args, "steps", None) is not None and not 1 <= args.steps <= MAX_STEPS:
        console.print(f"arlo: --steps must be in [1, {MAX_STEPS:.0e}], got {args.steps}")
        return 2
    if args.command in ("train", "demo") and args.json is not None and (problem := report_path_problem(args.json)):
        console.print(f"[red]arlo {args.command}: {problem}")
        return 2
    args.json_written = False
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        console.print(f"[red]arlo: bad config: {e}")
        return 2
    except (NotRunning, ServiceFailed, RuntimeError, OSError, RedisError, grpc.RpcError) as e:
        _report_no_run(args, failed=f"{type(e).__name__}: {e}")
        _say(f"[red]arlo {args.command}: {_what_failed(e)}")
        return 1
    except (KeyboardInterrupt, stopping.Stop):  # before a command's own handling (services starting)
        _report_no_run(args, failed=None)
        _say("interrupted")
        return 130


def _report_no_run(args: argparse.Namespace, *, failed: str | None) -> None:
    """`--json` when the command ended before its drive wrote one (stopped or failed while the
    services started): a report of no steps that says why, not no file."""
    if args.command in ("train", "demo") and args.json and not args.json_written:
        _write_json(TrainReport(interrupted=failed is None, failed=failed), args.json)


def _what_failed(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):  # what outlasted the retries (`--outage-s`)
        return f"a service call failed past the retries: {e.code().name}: {e.details()}"
    if isinstance(e, RedisError):
        return f"Redis: {e} (is it running where the config's redis.url says?)"
    if isinstance(e, OSError) and e.filename:
        return f"{e.strerror or e}: {e.filename}" + (" (ARLO_HOME, where arlo keeps its runs)" if
                                                     str(e.filename).startswith(str(arlo_home())) else "")
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
