"""Issue 15 on one CPU host: prefill, decode and pd-master instances started by hkv-launch, end to end.

1. Greedy output through the master equals transformers' for prompts of 9 to
   650 tokens sent at once, on qwen3_5_text (tiny-hybrid-random) and qwen3;
   a second turn of a conversation moves only the pages the decode side lacks.
2. kill -9 of the prefill instance mid-transfer (its transporter stalls the
   pull, HKV_PD_STALL_PULL_S): the decode side rolls its reservation back
   within --pd-timeout (hkv-inspect: the CPU tier's in_use back to 0), the
   client gets a clean error, and after the prefill instance restarts on the
   same port the next request succeeds.
3. Pickle payloads, garbage, frames signed with another secret and a replayed
   frame sent to the prefill transporter's port are rejected and counted in
   /metrics; the instance keeps serving; every socket the instances listen on
   is bound to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import msgspec
import pytest
import torch
import zmq

from hkv.ipc.auth import Signer
from hkv.ipc.peer_messages import PeerDone
from hkv.models.tiny import ensure_builtin
from tests.e2e.harness import assert_clean, bound_addresses, free_port, launch
from tests.e2e.test_prefix_cache import inspect_json
from tests.reference import assert_greedy_parity

pytestmark = pytest.mark.e2e
VOCAB = 1536
PAGE = 16
OUT = 8
TIMEOUT_S = 3.0  # --pd-timeout of every instance here
LENGTHS = [9, 17, 64, 200, 333, 650]


def _secret(folder: Path) -> Path:
    path = folder / "pd.secret"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return path


def _launch_all(specs: list[tuple[list[str], dict | None, int | None]], tmp_path: Path):
    """Start instances side by side (a CPU instance takes seconds to load): their Servers, in order."""
    out: list = [None] * len(specs)
    errors: list[BaseException] = []

    def start(i, args, env, port):
        try:
            out[i] = launch(args, tmp_path, env=env, port=port)
        except BaseException as exc:  # noqa: BLE001 (re-raised below, after the others started)
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i, *spec)) for i, spec in enumerate(specs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for server in out:
            if server is not None:
                server.stop(signal.SIGKILL)
        raise errors[0]
    return out


class Pd:
    """A prefill, a decode and a master instance, and the pids to check clean at the end."""

    def __init__(self, model: list[str], tmp_path: Path, prefill_env: dict | None = None, transfer: str = "auto"):
        self.secret = _secret(tmp_path)
        self.model = model
        self.tmp_path = tmp_path
        self.pair = transfer == "pair"  # the ranks move the pages over a gloo pair group, not the CPU tier
        common = [*model, "--secret-file", str(self.secret), "--pd-timeout", str(TIMEOUT_S),
                  "--max-total-tokens", "4096", "--cpu-cache-gb", "0.05", "--pd-transfer", transfer]
        self.common = common
        self.prefill_port = free_port()
        self.prefill, self.decode = _launch_all([([*common, "--mode", "prefill"], prefill_env, self.prefill_port),
                                                 ([*common, "--mode", "decode"], None, None)], tmp_path)
        self.master = launch(["--mode", "pd-master", "--secret-file", str(self.secret), "--prefill-url",
                              self.prefill.url, "--decode-url", self.decode.url], tmp_path)
        self.pids = self.prefill.actor_pids() + self.decode.actor_pids() + self.master.actor_pids()

    def servers(self):
        return [self.master, self.prefill, self.decode]

    def stop(self) -> None:
        stop_all(self.servers(), self.pids)


def stop_all(servers, pids: list[int]) -> None:
    """SIGTERM every server (a failing one does not leave the others running), then check each exited 0 and clean."""
    codes = []
    for server in servers:
        try:
            codes.append((server, server.stop(signal.SIGTERM)))
        except AssertionError as exc:  # it did not exit in time (and was killed): still stop the rest
            codes.append((server, exc))
    for server, code in codes:
        assert code == 0, f"{code}\n{server.log()}"
    for server in servers:
        assert_clean(server, pids)


async def _post_all(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    async with aiohttp.ClientSession() as session:
        async def one(body):
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                return resp.status, await resp.json()
        return await asyncio.gather(*(one(b) for b in bodies))


def _body(prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": OUT, "temperature": 0, "return_token_ids": True, "ignore_eos": True}


def _complete(url: str, prompt: list[int]) -> dict:
    status, answer = asyncio.run(_post_all(url, [_body(prompt)]))[0]
    assert status == 200, answer
    return answer


def _metric(url: str, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _settled_metric(url: str, name: str, labels: str = "") -> float:
    """A transporter figure once its stats block caught up (written within 0.25 s of a change): two reads
    0.5 s apart that agree, for at most 15 s (a loaded CI machine may lag)."""
    value, deadline = _metric(url, name, labels), time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = _metric(url, name, labels)
        if again == value:
            return value
        value = again
    return value


def _wait_in_use_zero(name: str, pool: str) -> None:
    """The pool's reservation is rolled back: at once on the CPU-tier path; on the pair path once the router's
    next result reports the failed receive (its rank gives the rendezvous up within the timeout)."""
    deadline = time.monotonic() + TIMEOUT_S + 5
    while inspect_json(name)["pools"][pool]["in_use"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert inspect_json(name)["pools"][pool]["in_use"] == 0, inspect_json(name)["pools"]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _received(pd: Pd) -> tuple[float, float]:
    """Pages the decode instance received (settled): over the CPU-tier path, over the pair group."""
    return (_settled_metric(pd.decode.url, "hkv_pd_pages_total", '{direction="received"}'),
            _settled_metric(pd.decode.url, "hkv_pd_pair_pages_total"))


def _parity_and_second_turn(pd: Pd, reference) -> None:
    peer_label = '{tier="peer"}'
    peer_before = _metric(pd.decode.url, "hkv_cache_hit_tokens_total", peer_label)
    tier_before, pair_before = _received(pd)
    prompts = _prompts(15, LENGTHS)
    answers = asyncio.run(_post_all(pd.master.url, [_body(p) for p in prompts]))
    for prompt, (status, answer) in zip(prompts, answers):
        assert status == 200, answer
        choice = answer["choices"][0]
        assert len(choice["token_ids"]) == OUT
        assert_greedy_parity(reference, prompt, choice["token_ids"])
        usage = answer["usage"]
        pages = (len(prompt) - 1) // PAGE
        # every page wholly inside prompt[:-1] came from the prefill instance (nothing else was on the decode side)
        assert usage["cache"] == {"gpu": 0, "cpu": 0, "disk": 0, "peer": pages * PAGE}, (len(prompt), usage)
        assert usage["prompt_tokens_details"]["cached_tokens"] == pages * PAGE
    # every page moved by the path asked for (the pair path: the five prompts with a full page, one transfer each)
    tier_after, pair_after = _received(pd)
    pages = sum((len(p) - 1) // PAGE for p in prompts)
    assert (tier_after - tier_before, pair_after - pair_before) == ((0, pages) if pd.pair else (pages, 0))
    if pd.pair:
        assert _metric(pd.decode.url, "hkv_pd_pair_transfers_total", '{outcome="ok"}') >= 5
        assert _metric(pd.prefill.url, "hkv_pd_pair_pages_total") >= pages
    # a second turn: the decode side holds the first turn, so only the new pages move
    first, extra = _prompts(16, [300, 60])
    one = _complete(pd.master.url, first)
    received = _received(pd)[pd.pair]
    turn = first + one["choices"][0]["token_ids"] + extra
    two = _complete(pd.master.url, turn)
    assert_greedy_parity(reference, turn, two["choices"][0]["token_ids"])
    cache = two["usage"]["cache"]
    moved = _received(pd)[pd.pair] - received
    new_pages = (len(turn) - 1) // PAGE - (len(first) + OUT) // PAGE
    assert cache["gpu"] >= (len(first) + OUT) // PAGE * PAGE - 256, cache  # the first turn, from the device
    assert 0 < moved <= new_pages + 1, (moved, new_pages, cache)
    assert cache["peer"] == moved * PAGE, (moved, cache)
    # the decode instance counts what came from the peer, in /metrics and hkv-inspect
    served = sum(a["usage"]["cache"]["peer"] for _, a in answers) + one["usage"]["cache"]["peer"] + cache["peer"]
    assert _metric(pd.decode.url, "hkv_cache_hit_tokens_total", peer_label) - peer_before == served
    report = inspect_json(pd.decode.name)
    assert report["pd"]["mode"] == "decode", report["pd"]
    assert (report["pd"]["pair"]["pages"] if pd.pair else report["pd"]["pages_received"]) >= moved, report["pd"]
    asked = inspect_json(pd.prefill.name)["pd"] if pd.pair else report["pd"]  # the side that read peer frames
    assert asked["frames"]["accepted"] > 0 and report["tiers"]["peer"]["cached_tokens_served"] >= served
    assert not pd.pair or asked["pair_asks_received"] >= 6, asked


@pytest.fixture(scope="module")
def hybrid_reference(builtin_dir):
    from transformers import Qwen3_5ForCausalLM

    folder = ensure_builtin("tiny-hybrid-random", builtin_dir)
    return Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hybrid_pd(tmp_path_factory):
    pd = Pd(["--model", "tiny-hybrid-random"], tmp_path_factory.mktemp("pd-hybrid"))
    yield pd
    pd.stop()


def test_hybrid_output_through_the_master_equals_transformers(hybrid_pd, hybrid_reference):
    _parity_and_second_turn(hybrid_pd, hybrid_reference)


@pytest.fixture(scope="module")
def hybrid_pair_pd(tmp_path_factory):
    pd = Pd(["--model", "tiny-hybrid-random"], tmp_path_factory.mktemp("pd-pair"), transfer="pair")
    yield pd
    pd.stop()


def test_hybrid_output_over_a_pair_group_equals_transformers_and_binds_only_loopback(hybrid_pair_pd,
                                                                                     hybrid_reference):
    """The NCCL path's code over gloo: the ranks move the held pages and checkpoints (DESIGN.md section 4)."""
    pd = hybrid_pair_pd
    _parity_and_second_turn(pd, hybrid_reference)
    # the decode rank's rendezvous store and both ranks' gloo sockets listen on --host only
    addresses = bound_addresses(pd.prefill.actor_pids() + pd.decode.actor_pids())
    assert addresses and all(a.split(":")[0] == "0100007F" for a in addresses), addresses


@pytest.mark.parametrize("transfer", ["auto", "pair"])
def test_dense_output_through_the_master_equals_transformers(qwen3_dir, qwen3_reference, tmp_path, transfer):
    pd = Pd(["--model", str(qwen3_dir)], tmp_path, transfer=transfer)
    try:
        _parity_and_second_turn(pd, qwen3_reference)
    finally:
        pd.stop()


def test_bad_frames_are_rejected_and_counted_and_only_loopback_is_bound(hybrid_pd, tmp_path):
    pd = hybrid_pd
    address = urllib.request.urlopen(f"{pd.prefill.url}/pd/info", timeout=10).read().decode()
    transporter = msgspec.json.decode(address)["transporter"]
    before = {r: _metric(pd.prefill.url, "hkv_pd_frames_rejected_total", f'{{reason="{r}"}}')
              for r in ("magic", "short", "tag", "replay", "parts")}
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    signer = Signer(pd.secret.read_bytes().strip(), b"a-test-peer")
    forged = Signer(os.urandom(32), b"a-test-peer").seal(msgspec.msgpack.encode(PeerDone(1)))
    valid = signer.seal(msgspec.msgpack.encode(PeerDone(1)))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(transporter)
    try:
        for frame in (pickle.dumps(Exploit()), pickle.dumps({"keys": list(range(10**5))}), os.urandom(4096),
                      b"x", forged, valid, valid):
            sock.send(frame)
        sock.send_multipart([b"two", b"parts"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            now = {r: _metric(pd.prefill.url, "hkv_pd_frames_rejected_total", f'{{reason="{r}"}}') for r in before}
            if (now["replay"] > before["replay"] and now["parts"] > before["parts"]
                    and now["magic"] + now["short"] >= before["magic"] + before["short"] + 4):
                break
            time.sleep(0.3)
    finally:
        sock.close()
        ctx.term()
    delta = {r: now[r] - before[r] for r in before}
    # three frames that are not ours at all (two pickles, random bytes) and one too short to be one
    assert delta["magic"] + delta["short"] == 4 and delta["short"] >= 1, delta
    assert (delta["tag"], delta["replay"], delta["parts"]) == (1, 1, 1), delta
    assert not marker.exists()
    assert _complete(pd.master.url, _prompts(17, [100])[0])["usage"]["cache"]["peer"] == 96  # still serving
    pids = pd.prefill.actor_pids() + pd.decode.actor_pids() + pd.master.actor_pids()
    addresses = bound_addresses(pids)
    ports = {s.port for s in pd.servers()} | {int(transporter.rsplit(":", 1)[1])}
    assert {int(a.split(":")[1], 16) for a in addresses} >= ports, addresses
    assert all(a.split(":")[0] == "0100007F" for a in addresses), addresses  # 127.0.0.1, nothing else
    if shutil.which("ss"):  # the same, as an operator would check it
        listed = subprocess.run(["ss", "-ltn"], capture_output=True, text=True, check=True).stdout
        for port in ports:
            assert re.search(rf"127\.0\.0\.1:{port}\s", listed), (port, listed)
            assert not re.search(rf"(0\.0\.0\.0|\*|\[::\]):{port}\s", listed), (port, listed)


@pytest.mark.parametrize("path", ["tier", "pair"])
def test_a_prefill_instance_killed_mid_transfer_rolls_back_and_is_replaced(path, request, tmp_path):
    """CPU-tier path: the prefill transporter stalls the pull, the decode side holds CPU-tier entries. Pair path:
    it stalls the ask for the send, the decode side holds device pages and its rank waits in the rendezvous."""
    pd = request.getfixturevalue("hybrid_pair_pd" if path == "pair" else "hybrid_pd")
    pool = "gpu_pages" if path == "pair" else "cpu_pages"
    port = free_port()
    common = pd.common
    stalled = launch([*common, "--mode", "prefill"], tmp_path, env={"HKV_PD_STALL_PULL_S": "60"}, port=port)
    master = launch(["--mode", "pd-master", "--secret-file", str(pd.secret), "--prefill-url", stalled.url,
                     "--decode-url", pd.decode.url], tmp_path)
    pids = stalled.actor_pids() + master.actor_pids()
    prompt = _prompts(18, [500])[0]
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(answer=asyncio.run(_post_all(master.url, [_body(prompt)]))))
    try:
        thread.start()
        deadline = time.monotonic() + 30  # the decode side reserves, then waits on the stalled peer
        while time.monotonic() < deadline and inspect_json(pd.decode.name)["pools"][pool]["in_use"] == 0:
            time.sleep(0.05)
        assert inspect_json(pd.decode.name)["pools"][pool]["in_use"] > 0, "no reservation seen"
        killed_at = time.monotonic()
        for pid in [stalled.proc.pid, *stalled.actor_pids()]:
            os.kill(pid, signal.SIGKILL)
        thread.join(TIMEOUT_S + 20)
        assert not thread.is_alive()
        status, answer = result["answer"][0]
        assert time.monotonic() - killed_at < TIMEOUT_S + 10
        assert status in (200, 502), answer
        text = str(answer)
        assert "timed out" in text or "error" in text, answer  # a clean error, never a silent truncation
        if status == 200:
            assert answer["choices"][0]["finish_reason"] == "error", answer
        _wait_in_use_zero(pd.decode.name, pool)
        stalled.proc.wait(10)
        # the replacement on the same port: the master finds its new transporter and the request succeeds
        replacement = launch([*common, "--mode", "prefill"], tmp_path, port=port)
        pids += replacement.actor_pids()
        try:
            again = _complete(master.url, prompt)
            assert again["usage"]["cache"]["peer"] == (len(prompt) - 1) // PAGE * PAGE
        finally:
            assert replacement.stop(signal.SIGTERM) == 0, replacement.log()
    finally:
        assert master.stop(signal.SIGTERM) == 0, master.log()
        stalled.stop(signal.SIGKILL)
    for server in (master, replacement):
        assert_clean(server, pids)
