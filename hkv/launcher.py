"""`hkv-launch`: start one instance's actors and supervise them.

    parse flags (exit 2 on a bad one) -> sweep orphaned shm -> create regions
    -> start ranks, router, api -> wait until each reports ready -> supervise

While the actors start, the launcher prints the start-up phases the ranks
report on their status pipes, one line each (hkv/ipc/startup.py), repeats the
current one when it stays silent for TICK_S, and keeps the latest in the
`startup` block, which the api's /ready reads. A signal during start-up stops
every actor (exit 0); an actor that dies stops the rest (exit 1).

If any child dies, the others are stopped in order (api, router, ranks; the
api with SIGUSR1: fail what is in flight, do not drain), shared memory is
unlinked and the launcher exits 1 with a one-line reason.
SIGTERM/SIGINT drain: the api refuses new requests and finishes in-flight
ones, then the rest stop and the launcher exits 0. A second signal stops at
once. Children hold the read end of a lifeline pipe: if the launcher itself
is killed they see EOF and exit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from hkv.config import ConfigError, HkvConfig, parse_cli
from hkv.ipc import request_table, startup, stats, tier_regions
from hkv.ipc.creator import Creator
from hkv.ipc.process import setup_logging
from hkv.ipc.rundir import remove_run_dir, sweep_run_dirs
from hkv.ipc.shm import Registry, ShmRegion, sweep_orphans, unlink_instance

if TYPE_CHECKING:
    from hkv.cache.keys import ModelFingerprint
    from hkv.storage.host_pool import HostLayout

log = logging.getLogger("hkv.launch")
STOP_GRACE_S = 10.0
READY_TIMEOUT_S = 900.0
TICK_S = 15.0  # a start-up phase silent this long is printed again, with its time so far


@dataclass
class Child:
    name: str  # "api", "router", "rank0", ...
    proc: asyncio.subprocess.Process
    status_fd: int  # read end of the child's status pipe
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None  # what the child said before dying, if anything
    partial: bytes = b""  # the start of a status line not read whole yet


def _say(line: str) -> None:
    """One line on stderr in one write: the actors share the stream, and a line printed as text then newline
    (two writes when stderr writes through) can take another process's log line in between."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class Instance:
    """One running instance: its regions, children and the reason it stops."""

    def __init__(self, cfg: HkvConfig):
        self.cfg = cfg
        self.me = Creator.this_process()  # the creator named in every segment and the run directory
        self.children: list[Child] = []
        self.regions: list[ShmRegion] = []
        self.lifeline_r, self.lifeline_w = os.pipe()
        self.draining = asyncio.Event()
        self.halt = asyncio.Event()  # a second signal: stop without draining
        self.serving = False  # every actor reported ready
        self.startup_block: memoryview | None = None  # the `startup` region's payload (not for a pd master)
        self.phase: startup.StartupBlock | None = None  # the latest start-up report
        self.printed_at = time.monotonic()  # when the last start-up line was printed

    def create_regions(self) -> None:
        cfg = self.cfg
        removed = sweep_orphans()
        if removed:
            log.info("swept %d orphaned shared-memory segments", len(removed))
        dirs = sweep_run_dirs()
        if dirs:
            log.info("swept %d run directories of dead launchers", len(dirs))
        registry = Registry.create(cfg.server.name, capacity=16)
        self.regions.append(registry)
        layout = request_table.TableLayout(
            slots=cfg.scheduler.max_running_requests,
            max_pages=(cfg.model.max_context + cfg.cache.page_size - 1) // cfg.cache.page_size + 1,
        )
        table = ShmRegion.create(cfg.server.name, request_table.REGION, layout.nbytes(), writer="router")
        self.regions.append(table)
        registry.add(request_table.REGION, writer="router", version=request_table.VERSION, layout=layout.to_dict())
        self.regions.append(ShmRegion.create(cfg.server.name, stats.REGION, stats.NBYTES, writer="router"))
        registry.add(stats.REGION, writer="router", version=stats.VERSION, layout={"fields": list(stats.FIELDS)})
        radix = ShmRegion.create(cfg.server.name, stats.RADIX_REGION, stats.RADIX_NBYTES, writer="router")
        self.regions.append(radix)
        registry.add(stats.RADIX_REGION, writer="router", version=1, layout={"format": "json_block"})
        block = ShmRegion.create(cfg.server.name, startup.REGION, startup.NBYTES, writer="launcher")
        self.regions.append(block)
        registry.add(startup.REGION, writer="launcher", version=startup.VERSION, layout={"format": "json_block"})
        self.startup_block = block.payload
        if cfg.cache.tiers:
            self.create_tier_regions(registry)
        if cfg.server.mode in ("prefill", "decode"):
            self.regions.append(ShmRegion.create(cfg.server.name, tier_regions.PD_STATS_REGION,
                                                 tier_regions.PD_STATS_NBYTES, writer="transporter"))
            registry.add(tier_regions.PD_STATS_REGION, writer="transporter", version=tier_regions.PD_STATS_VERSION,
                         layout={"format": "json_block"})

    def create_tier_regions(self, registry: Registry) -> None:
        """The CPU tier's page pool (sized from the model's layouts) and the cache worker's stats block."""
        cfg = self.cfg
        layout, model = tier_layout(cfg)
        fingerprint = model.root_key()
        if layout.num_pages == 0:
            need = max(layout.page_bytes, layout.block_bytes)
            raise ConfigError(f"--cpu-cache-gb {cfg.cache.cpu_cache_gb} holds no page and checkpoint ({need} bytes)")
        if cfg.cache.disk_cache_dir:
            claim_disk_tier(cfg.cache.disk_cache_dir, model.any_tp_key(), cfg.model.tp)
        log.info("CPU tier: %d units of %d bytes, %d per checkpoint (at most %d checkpoints), %.1f MiB",
                 layout.num_pages, layout.page_bytes, layout.state_units, layout.num_states, layout.nbytes / 2**20)
        pool, tier_stats = tier_regions.TIER_REGION, tier_regions.TIER_STATS_REGION
        self.regions.append(ShmRegion.create(cfg.server.name, pool, layout.nbytes, writer="cache_worker"))
        registry.add(pool, writer="cache_worker", version=tier_regions.VERSION,
                     layout=tier_regions.registry_layout(layout, fingerprint))
        self.regions.append(ShmRegion.create(cfg.server.name, tier_stats, tier_regions.TIER_STATS_NBYTES,
                                             writer="cache_worker"))
        registry.add(tier_stats, writer="cache_worker", version=tier_regions.VERSION, layout={"format": "json_block"})

    async def spawn(self, name: str, module: str, config_file: str, extra: list[str]) -> Child:
        status_r, status_w = os.pipe()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module,
            "--config-file", config_file,
            "--lifeline-fd", str(self.lifeline_r),
            "--status-fd", str(status_w),
            *extra,
            pass_fds=(self.lifeline_r, status_w),
            start_new_session=True,  # a terminal's Ctrl-C reaches only the launcher
        )
        os.close(status_w)
        child = Child(name, proc, status_r)
        asyncio.get_running_loop().add_reader(status_r, self._on_status, child)
        self.children.append(child)
        return child

    def _on_status(self, child: Child) -> None:
        try:
            data = os.read(child.status_fd, 65536)
        except OSError:
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(child.status_fd)
            return
        *lines, child.partial = (child.partial + data).split(b"\n")
        for line in lines:
            try:
                event = json.loads(line.decode(errors="replace"))
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            if "ready" in event:
                child.ready.set()
            elif "error" in event:
                child.error = str(event["error"])
            elif "progress" in event:
                self._on_progress(child, event["progress"])

    def _on_progress(self, child: Child, report: object) -> None:
        """A start-up phase began, advanced or ended: print it, keep it for /ready (a bad report is dropped)."""
        try:
            progress = msgspec.convert(report, startup.StartupProgress)
        except msgspec.ValidationError:
            return
        progress = msgspec.structs.replace(progress, actor=child.name)
        now = time.monotonic()
        self.phase = startup.StartupBlock(progress, began_at=now - progress.elapsed_s)
        if self.startup_block is not None:
            startup.write(self.startup_block, self.phase)
        self._print_phase(startup.describe(progress))

    def _print_phase(self, text: str) -> None:
        actor = self.phase.progress.actor if self.phase is not None else "launch"
        _say(f"hkv-launch: {actor}: {text}")
        self.printed_at = time.monotonic()

    async def tick(self) -> None:
        """Print the current start-up phase again when it stayed silent for TICK_S (owned by wait_ready)."""
        while True:
            await asyncio.sleep(max(0.0, self.printed_at + TICK_S - time.monotonic()))
            now = time.monotonic()
            if now - self.printed_at < TICK_S:
                continue  # a report came meanwhile
            phase = self.phase
            if phase is not None and not phase.progress.ended:
                self._print_phase(startup.describe(phase.progress, now - phase.began_at))
            else:
                self.printed_at = now  # between phases: nothing to repeat

    async def start_all(self) -> None:
        cfg = self.cfg
        config_file = os.path.join(cfg.run_dir, "config.json")
        fd = os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(cfg.to_json())
        if cfg.server.mode == "pd-master":
            await self.spawn("pd_master", "hkv.actors.pd_master", config_file, [])
            return
        if cfg.cache.tiers:
            await self.spawn("cache_worker", "hkv.actors.cache_worker", config_file, [])
        if cfg.server.mode in ("prefill", "decode"):
            await self.spawn("transporter", "hkv.actors.transporter", config_file, [])
        for r in range(cfg.model.tp):
            await self.spawn(f"rank{r}", "hkv.actors.rank", config_file, ["--rank", str(r)])
        await self.spawn("router", "hkv.actors.router", config_file, [])
        await self.spawn("api", "hkv.actors.api", config_file, [])

    async def wait_ready(self) -> str | None:
        """None once every child is ready, or a signal came (`draining` is set then), else why start-up failed."""
        ready = asyncio.ensure_future(asyncio.gather(*(c.ready.wait() for c in self.children)))
        died = asyncio.ensure_future(self.first_exit())
        signalled = asyncio.ensure_future(self.draining.wait())
        ticker = asyncio.ensure_future(self.tick())
        done, _ = await asyncio.wait({ready, died, signalled}, timeout=READY_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        for task in (ready, died, signalled, ticker):
            task.cancel()
        await asyncio.gather(ready, died, signalled, ticker, return_exceptions=True)
        if died in done:
            return died.result()
        if ready in done or signalled in done:
            return None
        return f"not ready after {READY_TIMEOUT_S:.0f} s"

    async def first_exit(self) -> str:
        waits = {asyncio.ensure_future(c.proc.wait()): c for c in self.children}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()  # (the one that is done ignores it)
        child = waits[next(iter(done))]
        await asyncio.sleep(0.05)  # let its last status line arrive
        self._on_status(child) if _readable(child.status_fd) else None
        detail = f": {child.error}" if child.error else ""
        return f"{child.name} exited with code {child.proc.returncode}{detail}"

    async def stop_children(self, order: list[str], abandon: bool = False) -> None:
        """SIGTERM each child in order, waiting for it; SIGKILL what outlives the grace time.

        abandon: another actor died, so the api gets SIGUSR1 instead (fail what is in flight, no drain).
        """
        by_name = {c.name: c for c in self.children}
        for name in order:
            child = by_name.get(name)
            if child is None or child.proc.returncode is not None:
                continue
            _signal(child, signal.SIGUSR1 if abandon and name == "api" else signal.SIGTERM)
            try:
                await asyncio.wait_for(child.proc.wait(), STOP_GRACE_S)
            except asyncio.TimeoutError:
                log.warning("%s did not stop in %.0f s; killing it", name, STOP_GRACE_S)
                _signal(child, signal.SIGKILL)
                await child.proc.wait()

    def cleanup(self) -> None:
        for region in self.regions:
            region.close()
        unlink_instance(self.cfg.server.name, creator=self.me)
        remove_run_dir(self.cfg.run_dir, self.me)
        for fd in (self.lifeline_r, self.lifeline_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def stop_order(self) -> list[str]:
        if self.cfg.server.mode == "pd-master":
            return ["pd_master"]
        return ["api", "router"] + [f"rank{r}" for r in range(self.cfg.model.tp)] + ["transporter", "cache_worker"]


def tier_layout(cfg: HkvConfig) -> tuple[HostLayout, ModelFingerprint]:
    """The CPU tier's layout for `cfg` and the model fingerprint whose root key roots its entries.

    The model is built on the meta device (layouts, no weights). Pages and
    checkpoints share the whole budget (hkv/storage/host_pool.py). With
    --spec-tokens the layouts are the rank's (hkv/actors/rank.py `_build_runner`):
    a state entry also holds the drafter's state, and with --draft-window 0 a
    page also holds the draft layer's K/V (one more KV layer).
    """
    # imported here: they load torch, which a launch without tiers never needs
    from hkv.engine.spec import draft_spec, with_paged_draft
    from hkv.models.loader import cache_fingerprint, meta_model
    from hkv.storage.host_pool import HostLayout

    c = cfg.cache
    model = meta_model(cfg.model.path, cfg.model.tp)  # one rank's layouts: an entry holds every rank's shard
    draft = draft_spec(model, cfg.spec.draft_window) if cfg.spec.spec_tokens > 0 else None
    kv = model.kv_layout(1, c.page_size, cfg.model.kv_cache_dtype, "cpu")
    kv, _ = with_paged_draft(model, kv, draft)
    state = model.state_layout(1, device="cpu", dtype="float32") if c.hybrid else None
    layout = HostLayout.for_model(kv, state, int(c.cpu_cache_gb * 2**30), draft, tp=cfg.model.tp)
    digests = Path(cfg.builtin_cache_dir) / "weights-digests.json"  # a checkpoint is hashed once, not every start
    # the KV dtype is part of the key (cache_dtype_name): FP8 pages never meet model-dtype pages
    fingerprint = cache_fingerprint(cfg.model.path, cfg.model.cache_dtype_name, c.page_size, cfg.model.tp,
                                    cfg.model.device, digest_cache=digests, quantize=cfg.model.quantize)
    return layout, fingerprint


def claim_disk_tier(directory: str, model_key: bytes, tp: int) -> None:
    """Refuse (ConfigError, exit 2) a disk tier folder holding this model's pages of another --tp N,
    else record N in it (hkv/cache/disk_marker.py), before any actor starts."""
    from hkv.cache.disk_marker import DiskTierTpMismatch, claim

    try:
        if claim(directory, model_key, tp):
            log.info("disk tier: %s now records --tp %d for this model", directory, tp)
    except DiskTierTpMismatch as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"--disk-cache-dir {directory}: cannot record its --tp marker: {exc}") from None


def _readable(fd: int) -> bool:
    import select

    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return False


def _signal(child: Child, sig: int) -> None:
    try:
        child.proc.send_signal(sig)
    except ProcessLookupError:
        pass


async def _supervise(inst: Instance) -> int:
    """Run until a child dies (exit 1) or a signal drains the instance (exit 0)."""
    died = asyncio.ensure_future(inst.first_exit())
    drain = asyncio.ensure_future(inst.draining.wait())
    await asyncio.wait({died, drain}, return_when=asyncio.FIRST_COMPLETED)
    if died.done():
        drain.cancel()
        reason = died.result()
        await inst.stop_children(inst.stop_order(), abandon=True)  # streams get an error event, at once
        _say(f"hkv-launch: stopped: {reason}")
        return 1
    died.cancel()
    await _drain(inst)
    return 0


async def _drain(inst: Instance) -> None:
    front = "pd_master" if inst.cfg.server.mode == "pd-master" else "api"  # the actor that drains HTTP
    api = next(c for c in inst.children if c.name == front)
    _signal(api, signal.SIGTERM)
    api_done = asyncio.ensure_future(api.proc.wait())
    halt = asyncio.ensure_future(inst.halt.wait())
    await asyncio.wait({api_done, halt}, timeout=inst.cfg.server.drain_timeout_s + STOP_GRACE_S,
                       return_when=asyncio.FIRST_COMPLETED)
    halt.cancel()
    await inst.stop_children(inst.stop_order())
    _say("hkv-launch: drained and stopped")


def _on_signal(inst: Instance) -> None:
    if inst.draining.is_set():
        inst.halt.set()
    elif inst.serving:
        log.info("draining: refusing new requests, finishing in-flight ones")
        inst.draining.set()
    else:
        log.info("stopping during start-up")
        inst.draining.set()


async def _run(cfg: HkvConfig) -> int:
    started = time.monotonic()
    inst = Instance(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, inst)
    try:
        try:
            if cfg.server.mode != "pd-master":  # the master holds no cache and no shared memory
                inst.create_regions()
        except ConfigError as exc:
            _say(f"hkv-launch: error: {exc}")
            return 2
        await inst.start_all()
        failure = await inst.wait_ready()
        if failure is not None:
            await inst.stop_children(inst.stop_order())
            _say(f"hkv-launch: failed to start: {failure}")
            return 1
        if inst.draining.is_set():  # a signal during start-up: nothing to drain
            await inst.stop_children(inst.stop_order())
            _say("hkv-launch: stopped during start-up")
            return 0
        inst.serving = True
        url = f"http://{cfg.server.host}:{cfg.server.port}"
        what = (f"the pd master of {len(cfg.server.prefill_urls)} prefill and {len(cfg.server.decode_urls)} decode "
                "instances" if cfg.server.mode == "pd-master" else cfg.model.model)
        role = f" ({cfg.server.mode}, staging transfers in a {cfg.cache.cpu_cache_gb:g} GiB CPU tier)" \
            if cfg.server.mode in ("prefill", "decode") else ""
        print(f"hkv-launch: serving {what}{role} at {url} (ready in {time.monotonic() - started:.1f} s)", flush=True)
        return await _supervise(inst)
    finally:
        await inst.stop_children(inst.stop_order())
        inst.cleanup()


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = parse_cli(argv)
    except ConfigError as exc:
        _say(f"hkv-launch: error: {exc}")
        raise SystemExit(2) from None
    setup_logging(cfg.server.log_level, "launch")
    import uvloop

    raise SystemExit(uvloop.run(_run(cfg)))
