"""`hf-ccl`: run a continual stream from a shipped recipe or a YAML config, or list what is available.

A mistake in the command or the config, or a run that fails for a reason outside hf_ccl (a file, the network, a
diverging loss), is reported in one line, `hf-ccl: error: <message>` on stderr; `--debug` (or `HF_CCL_DEBUG=1`)
adds the traceback. Any other exception is a bug and keeps its traceback. Nothing that looks like a Hub token is
ever printed. SIGTERM stops a run as Ctrl-C does, with where to resume from.
"""

from __future__ import annotations

import argparse
import errno
import os
import shlex
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .catalog import method_names, stream_names
from .config import (
    available_recipes,
    config_keys_help,
    load_config,
    recipe_description,
    resolve_config,
    where_given,
)
from .validation import ConfigError, check_no_tokens, redact_secrets
from .version import __version__

if TYPE_CHECKING:
    from .config import RunConfig
    from .run import CheckedRun

EXIT_FAILED = 1  # the run failed; the message says why
EXIT_REFUSED = 2  # the command or the config was refused before anything was built or written (argparse's code)
EXIT_SIGNAL_BASE = 128  # + the signal number: 130 for SIGINT (Ctrl-C), 143 for SIGTERM
DEBUG_ENV = "HF_CCL_DEBUG"
#: After a failure, less free space than this on the output disk is reported as a full disk.
LOW_DISK_BYTES = 16 * 2**20
#: Errors that come from what was asked or from the environment (files, network, data, a diverging loss): one line.
#: Any other exception is a bug in hf_ccl or a library and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, ImportError, FloatingPointError, yaml.YAMLError)
EXIT_CODES = """exit codes:
  0    the run finished (or the listing was printed)
  1    the run failed (the message says why)
  2    the command or the config was refused before anything was built or written
  130  interrupted by Ctrl-C (SIGINT); 143: by SIGTERM. Resume with resume_from_checkpoint=true"""


class Interrupted(KeyboardInterrupt):
    """A stop signal, raised in the main thread so that a run stops as it does on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-ccl", description="Continual learning for CLIP models.", epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    debug_help = f"show the traceback of an error (or set {DEBUG_ENV}=1)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train", help="Run a continual stream and print the results matrix.",
        epilog=f"{config_keys_help()}\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", help="a shipped recipe by name (see `hf-ccl list`) or a YAML file; default: the "
                       "built-in defaults")
    train.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    train.add_argument("overrides", nargs="*", help="config overrides key=value (the keys below), e.g. "
                       "training.num_train_epochs=1")
    commands.add_parser("list", help="List the shipped recipes, the named streams and the methods.")
    push = commands.add_parser(
        "push", help="Push a run's task checkpoints to the Hub (e.g. those a run could not push).", epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    push.add_argument("run_dir", help="the run's output_dir (its task-<k>/ folders are pushed, each verified first)")
    push.add_argument("--repo", required=True, help="the Hub repository id (token from HF_TOKEN or `hf auth login`)")
    push.add_argument("--retries", type=int, default=3, help="retries of a failing request (default 3)")
    push.add_argument("--timeout", type=float, default=60.0, help="seconds before a request is abandoned")
    push.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    return parser


def main(argv: list[str] | None = None, started_at: float | None = None) -> int:
    """The `hf-ccl` command. `started_at` (`time.time()`): when the run's start-up cost begins (`hf_ccl.compute`);
    by default the process's start when the arguments are the command line's (`argv` None), else now."""
    if started_at is None:
        started_at = process_start_time() if argv is None else time.time()
    args = _parser().parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
    if args.command == "list":
        return list_main()
    if args.command == "push":
        return _push_command(args.run_dir, args.repo, args.retries, args.timeout, debug)
    return _train_command(args.config, args.overrides, debug, started_at)


def _push_command(run_dir: str, repo: str, retries: int, timeout: float, debug: bool) -> int:
    from .hub import push_run

    try:
        check_no_tokens(repo, "--repo")
    except ConfigError as error:
        _report_error(error, debug)
        return EXIT_REFUSED
    try:
        report = push_run(run_dir, repo, retries=retries, timeout=timeout)
    except USER_ERRORS as error:
        _report_error(error, debug)
        return EXIT_FAILED
    print(report.summary(), flush=True)
    return EXIT_FAILED if report.failed else 0


def list_main() -> int:
    """Print the shipped recipes, the named streams and the methods (names read from the source: no torch)."""
    recipes = available_recipes()
    width = max(map(len, recipes), default=0)
    print("recipes (hf-ccl train --config NAME):")
    for name, path in recipes.items():
        print(f"  {name:<{width}}  {recipe_description(path)}")
    print("streams:", ", ".join(stream_names()))
    print("methods:", ", ".join(method_names()))
    return 0


def prepare(config_path: str | None, overrides: list[str]) -> CheckedRun:
    """The run's config, every value and choice checked once, with the loop's arguments and the methods that the
    checks built (no data is read, nothing is written)."""
    from .run import check_config

    config = load_config(config_path, overrides)
    try:
        return check_config(config)
    except ValueError as error:  # name where the value was given
        source = resolve_config(config_path) if config_path else None
        key = getattr(error, "key", None)
        raise ConfigError(f"{error} ({where_given(key, source, overrides)})", key) from error


def execute(checked: CheckedRun) -> int:
    """Run a checked config (as it was checked) and print the results matrix."""
    from .distributed import is_main_process
    from .run import run

    results = run(checked)
    if is_main_process():
        print(results.to_markdown())
        print(f"\nCheckpoints and results: {checked.config.output_dir}")
    return 0


def train_main(config_path: str | None, overrides: list[str]) -> int:
    """Load, check and run a config, print the results matrix (errors propagate; `main` reports them)."""
    return execute(prepare(config_path, overrides))


def _process_group_initialised() -> bool:
    """Whether a torch process group exists (without importing torch when nothing has)."""
    distributed = sys.modules.get("torch.distributed")
    return bool(distributed is not None and distributed.is_available() and distributed.is_initialized())


def _train_command(config_path: str | None, overrides: list[str], debug: bool, started_at: float) -> int:
    """`hf-ccl train`; a process group the run created (`accelerate launch`) is ended before returning."""
    created_here = not _process_group_initialised()
    try:
        return _run_train_command(config_path, overrides, debug, started_at)
    finally:
        if created_here and _process_group_initialised():
            from .distributed import end_process_group

            end_process_group()


def _run_train_command(config_path: str | None, overrides: list[str], debug: bool, started_at: float) -> int:
    checked = None
    with stop_signals_interrupt():
        try:
            checked = prepare(config_path, overrides)
            checked.started_at = started_at  # the run's start-up cost counts from here
            return execute(checked)
        except KeyboardInterrupt as error:
            _report_interrupt(error, None if checked is None else checked.config, config_path, overrides, debug)
            return EXIT_SIGNAL_BASE + getattr(error, "signum", signal.SIGINT)
        except Exception as error:
            full = None if checked is None else disk_full(error, checked.config.output_dir)
            if full is not None:  # a full disk surfaces as whatever the writer raised (torch: "unexpected pos")
                _report_error(OSError(f"{full}; the write failed with: {error}"), debug, error)
                return EXIT_FAILED
            if isinstance(error, USER_ERRORS):
                _report_error(error, debug)
                return EXIT_REFUSED if checked is None else EXIT_FAILED
            _print(_traceback(error))  # a bug: its traceback, always (with tokens redacted)
            return EXIT_FAILED


def process_start_time() -> float:
    """When this process started, in `time.time()` seconds (from /proc on Linux; elsewhere: now)."""
    try:
        ticks = int(Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc (macOS), no os.sysconf (Windows)
        return time.time()
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """While in the block, SIGTERM raises `Interrupted` in the main thread, as SIGINT raises KeyboardInterrupt.

    Python swallows an exception raised while a finalizer or weakref callback runs, and a signal can land there
    (e.g. in the `gc.collect()` of accelerate's `free_memory`): a watcher thread then sends the signal again, so
    that it reaches the code that was running. The previous handler and hook are restored after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_handler, previous_hook = signal.getsignal(signal.SIGTERM), sys.unraisablehook
    swallowed: list[int] = []  # signals whose exception a finalizer swallowed
    lost, done = threading.Event(), threading.Event()

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    def note_swallowed(unraisable: Any) -> None:  # nothing here may wait: a signal could land in it
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            swallowed.append(getattr(unraisable.exc_value, "signum", signal.SIGINT))
            lost.set()
        else:
            previous_hook(unraisable)

    def send_again() -> None:
        while not done.is_set():
            if lost.wait(0.2) and not done.is_set():
                lost.clear()
                time.sleep(0.05)  # out of the callback that swallowed it
                os.kill(os.getpid(), swallowed.pop())

    watcher = threading.Thread(target=send_again, name="hf-ccl-signals", daemon=True)
    signal.signal(signal.SIGTERM, interrupt)
    sys.unraisablehook = note_swallowed
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.signal(signal.SIGTERM, previous_handler)
        sys.unraisablehook = previous_hook


def _report_interrupt(
    error: KeyboardInterrupt, config: RunConfig | None, config_path: str | None, overrides: list[str], debug: bool
) -> None:
    from .checkpointing import latest_task_checkpoint, newest_complete_trainer_checkpoint
    from .distributed import is_main_process

    if debug:
        _print(_traceback(error))
    if not is_main_process():
        return
    name = signal.Signals(getattr(error, "signum", signal.SIGINT)).name
    how = "Ctrl-C (SIGINT)" if name == "SIGINT" else name
    if config is None:
        _print(f"hf-ccl: interrupted by {how} before the run started: nothing was written")
        return
    last: Path | str | None = latest_task_checkpoint(config.output_dir, warn=False)
    if last is not None:
        where = f"The last complete task checkpoint is {last}"
    else:  # the first task's own Trainer checkpoints (`save_strategy`) resume it too
        last = newest_complete_trainer_checkpoint(Path(config.output_dir) / "trainer" / "task-0")
        where = f"No task had completed; task 0 resumes from its Trainer checkpoint {last}"
    if last is None:
        _print(f"hf-ccl: interrupted by {how}: no task had completed in {config.output_dir} and task 0 had no "
               "Trainer checkpoint (training.save_strategy), nothing to resume")
        return
    kept = [o for o in overrides if not o.split("=", 1)[0].strip().lstrip("-") == "resume_from_checkpoint"]
    command = ["hf-ccl", "train", *(["--config", config_path] if config_path else []), *kept,
               "resume_from_checkpoint=true"]
    _print(f"hf-ccl: interrupted by {how}. {where}; resume with:\n  {shlex.join(command)}")


def disk_full(error: BaseException, output_dir: str) -> str | None:
    """What to say when `error` came from a full disk under `output_dir` (an ENOSPC anywhere in its chain, or less
    than `LOW_DISK_BYTES` left there after the failure); None otherwise."""
    errors = _os_errors(error)
    if any(code in (errno.EROFS, errno.EACCES, errno.EPERM) for code in errors) and errno.ENOSPC not in errors:
        return None  # a read-only disk or a permission: its own message says so (statvfs reports no free space)
    enospc = errno.ENOSPC in errors
    folder = Path(output_dir).resolve()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if not enospc and free >= LOW_DISK_BYTES:
        return None
    return (f"no space left on the disk of {output_dir} ({free / 2**20:.1f} MiB free): make room, then resume "
            "with resume_from_checkpoint=true (complete task checkpoints are kept)")


def _os_errors(error: BaseException) -> set[int]:
    """The errno of every OSError in `error`'s chain of causes and contexts."""
    chain: BaseException | None = error
    seen: set[int] = set()
    codes: set[int] = set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, OSError) and chain.errno is not None:
            codes.add(chain.errno)
        chain = chain.__cause__ or chain.__context__
    return codes


def _report_error(error: BaseException, debug: bool, cause: BaseException | None = None) -> None:
    if debug:
        _print(_traceback(cause or error))
    message = " ".join(str(error).split()) or type(error).__name__
    _print(f"hf-ccl: error: {message}")


def _traceback(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()


def _print(text: str) -> None:
    print(redact_secrets(text), file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
