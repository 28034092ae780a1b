"""Process plumbing shared by every actor: config hand-off, lifeline, status, signals.

The launcher starts each actor as `python -m hkv.actors.<name> --config-file F
--lifeline-fd L --status-fd S [--rank R]`:

- the config file holds the frozen `HkvConfig` as JSON (built once at the CLI);
- the lifeline is the read end of a pipe whose write end only the launcher
  holds: EOF means the launcher died, so the actor stops at once (no drain:
  its peers stop too) and removes the shared memory and run directory the
  launcher created (nobody else is left to do it), and nothing a later
  launcher of the same name created;
- the status pipe carries one JSON line per event to the launcher:
  `{"progress": {...}}` as a start-up phase begins, advances and ends
  (hkv/ipc/startup.py: the launcher prints a line for each), `{"ready": {...}}`
  once the actor serves, `{"error": "..."}` before it dies.

SIGTERM asks the actor to stop (the api drains first); SIGUSR1, sent by the
launcher when another actor died, asks it to stop without draining, since
in-flight work can no longer finish. SIGINT is ignored, because a terminal's
Ctrl-C is the launcher's to handle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from hkv.config import HkvConfig
from hkv.ipc.creator import Creator
from hkv.ipc.startup import StartupProgress

log = logging.getLogger("hkv")


@dataclass
class ActorContext:
    """What an actor body gets besides the config: its identity and stop signals."""

    name: str
    rank: int
    status_fd: int
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # set: leave now (after draining)
    # set with `stop`, for work in a thread that cannot await it (a rank's start-up, hkv/engine/startup.py)
    stopping: threading.Event = field(default_factory=threading.Event)
    launcher_gone: bool = False  # the lifeline broke: nobody else will clean up
    abandoned: str | None = None  # why in-flight work cannot finish (no drain); None: stop normally
    launcher: Creator | None = None  # the process that started this actor, which created the instance

    def progress(self, report: StartupProgress) -> None:
        """Tell the launcher how start-up goes (any thread: one line is one atomic pipe write)."""
        self._status({"progress": msgspec.to_builtins(report)})

    def ready(self, **info) -> None:
        """Tell the launcher this actor serves."""
        self._status({"ready": info})

    def failed(self, reason: str) -> None:
        """Tell the launcher why this actor is about to die."""
        self._status({"error": reason})

    def request_stop(self, reason: str) -> None:
        if not self.stop.is_set():
            log.info("%s: stopping (%s)", self.name, reason)
            self.stop.set()
            self.stopping.set()

    def abandon(self, reason: str) -> None:
        """Stop without draining: the engine behind this actor is gone."""
        if self.abandoned is None:
            self.abandoned = reason
        self.request_stop(reason)

    def _status(self, payload: dict) -> None:
        try:
            os.write(self.status_fd, (json.dumps(payload) + "\n").encode())
        except OSError:
            pass  # the launcher is gone; the lifeline handles that


async def run_until_stopped(work: Awaitable[None], stop: asyncio.Event) -> bool:
    """Run `work` until it ends or `stop` is set (then cancel it); re-raises its failure.

    Returns True if the work ran to completion.
    """
    task = asyncio.ensure_future(work)
    halt = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, halt}, return_when=asyncio.FIRST_COMPLETED)
    halt.cancel()
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False
    if task.exception() is not None:
        raise task.exception()
    return True


ActorBody = Callable[[HkvConfig, ActorContext], Awaitable[None]]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config-file", required=True, help="the instance's frozen config, JSON (written by hkv-launch)")
    p.add_argument("--lifeline-fd", type=int, required=True,
                   help="read end of the launcher's lifeline pipe: EOF means the launcher is gone")
    p.add_argument("--status-fd", type=int, required=True, help="write end of this actor's status pipe")
    p.add_argument("--rank", type=int, default=0, help="this rank's index, ranks only (default: 0)")
    return p.parse_args(argv)


def setup_logging(level: str, who: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"%(asctime)s {who} %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def _watch_lifeline(fd: int, ctx: ActorContext) -> None:
    loop = asyncio.get_running_loop()

    def on_readable() -> None:
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            ctx.launcher_gone = True
            ctx.abandon("the server's launcher is gone")

    loop.add_reader(fd, on_readable)


def run_actor(name: str, body: ActorBody, argv: list[str] | None = None) -> None:
    """Run one actor process to completion; exits non-zero if the body fails."""
    args = _parse_args(argv)
    with open(args.config_file, encoding="utf-8") as f:
        cfg = HkvConfig.from_json(f.read())
    who = name if name != "rank" else f"rank{args.rank}"
    setup_logging(cfg.server.log_level, who)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    import uvloop

    code = uvloop.run(_main(who, body, cfg, args))
    sys.exit(code)


async def _main(who: str, body: ActorBody, cfg: HkvConfig, args: argparse.Namespace) -> int:
    ctx = ActorContext(name=who, rank=args.rank, status_fd=args.status_fd, launcher=Creator.of(os.getppid()))
    _watch_lifeline(args.lifeline_fd, ctx)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, ctx.request_stop, "SIGTERM")
    loop.add_signal_handler(signal.SIGUSR1, ctx.abandon, "an actor of this server exited")
    try:
        await body(cfg, ctx)
    except Exception as exc:  # the one place an actor's failure becomes an exit code
        log.exception("%s failed", who)
        ctx.failed(f"{who}: {type(exc).__name__}: {exc}")
        return 1
    finally:
        if ctx.launcher_gone and ctx.launcher is not None:
            _cleanup_orphaned(cfg, ctx.launcher)
    return 0


def _cleanup_orphaned(cfg: HkvConfig, launcher: Creator) -> None:
    """The launcher died: remove what it created (and only that) ourselves."""
    from hkv.ipc.rundir import remove_run_dir
    from hkv.ipc.shm import unlink_instance

    unlink_instance(cfg.server.name, creator=launcher)
    remove_run_dir(cfg.run_dir, launcher)
