"""Random sequences of coordinator calls, with failures injected, on tiny dense and hybrid specs.

Besides check_integrity() after every step, the machine keeps an oracle of
what each page and state slot holds (the tokens its KV or state was computed
for) and checks every cache hit against it: a hit must serve exactly the
tokens of the new request, and be the longest one the rules allow.
"""

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hkv.cache import CacheCoordinator, CacheSpec, CapacityError, RestoreCheckpoint, SaveCheckpoint, TransactionError
from tests.cache.snapshot import canonical

TOKENS = st.integers(0, 2)  # a tiny alphabet, so prompts share prefixes often
FAULT_POINTS = (None, None, None, None, "publish.inserted", "publish.checkpointed")
MAX_REQUESTS = 4  # more would mostly hold every page and make each reserve fail


class InjectedFault(Exception):
    pass


class RequestModel:
    """What the test believes about one request."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = tokens  # prompt, then tokens "generated" as it runs
        self.cursor: int = 0
        self.paused: bool = True  # True until its first commit: its next transaction may match
        self.rolling: tuple[int, tuple] | None = None  # (slot, tokens) of its rolling checkpoint, if any


class CoordinatorMachine(RuleBasedStateMachine):
    spec: CacheSpec

    def __init__(self):
        super().__init__()
        self.armed: set[str] = set()
        self.coord = CacheCoordinator(self.spec, fault=self._fault)
        self.P = self.spec.page_size
        self.models: dict[int, RequestModel] = {}
        self.next_rid = 0
        self.txn = None
        self.txn_new = False  # the open transaction created its request
        self.txn_before = None  # canonical picture when it began
        self.txn_cursor = 0  # its request's cursor when it began
        self.may_match = False
        self.pending_pages: dict[int, tuple] = {}  # page writes of the open transaction's step
        self.page_tokens: dict[int, tuple] = {}  # page id -> tokens whose KV it holds
        self.slot_tokens: dict[int, tuple] = {}  # state slot -> tokens its state covers
        self.restoring: dict[int, tuple[int, tuple]] = {}  # request -> (slot, tokens) its commit restores from
        self.history: list[tuple] = []  # sequences published so far, to continue as new turns

    def _fault(self, name: str) -> None:
        if name in self.armed:
            raise InjectedFault(name)

    def _model(self) -> RequestModel:
        return self.models[self.txn.req_id]

    def _close(self, committed: bool) -> None:
        if not committed and self.txn_new:
            del self.models[self.txn.req_id]
        elif not committed:
            self.models[self.txn.req_id].cursor = self.txn_cursor
        self.txn, self.pending_pages = None, {}

    def _draw_prompt(self, data) -> list[int]:
        """Half the time a new turn of a sequence seen before (so hits happen), else random."""
        if self.history and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(self.history))
            cut = len(base) if data.draw(st.booleans()) else data.draw(st.integers(0, len(base)))
            return list(base[:cut]) + data.draw(st.lists(TOKENS, min_size=1, max_size=4))
        return data.draw(st.lists(TOKENS, min_size=1, max_size=8))

    @precondition(lambda self: self.txn is None and len(self.models) < MAX_REQUESTS)
    @rule(data=st.data())
    def begin_new(self, data):
        self._begin_new(self._draw_prompt(data))

    def _begin_new(self, prompt: list[int]) -> None:
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.models[rid] = RequestModel(prompt)
        self._begin(rid, new=True)

    @precondition(lambda self: self.txn is None and self.models)
    @rule(data=st.data())
    def begin_existing(self, data):
        self._begin(data.draw(st.sampled_from(sorted(self.models))), new=False)

    def _begin(self, rid: int, new: bool) -> None:
        self.txn_before, self.txn_cursor = canonical(self.coord), self.models[rid].cursor
        self.txn, self.txn_new = self.coord.begin(rid), new
        self.may_match = self.models[rid].paused

    @precondition(lambda self: self.txn is not None and self.may_match)
    @rule()
    def match(self):
        model, P = self._model(), self.P
        tokens = model.tokens
        expected = self._longest_allowed_hit(tokens)
        hit = self.txn.match(tokens)
        self.may_match = False
        assert hit.length == expected, f"hit {hit.length}, but {expected} tokens are reusable"
        assert len(hit.pages) == hit.length // P
        for i, page in enumerate(hit.pages):
            assert self.page_tokens[page] == tuple(tokens[i * P : (i + 1) * P]), f"page {page} holds other tokens"
        if self.spec.hybrid and hit.length:
            assert self.slot_tokens[hit.checkpoint.slot] == tuple(tokens[: hit.length])
        else:
            assert hit.checkpoint is None
        model.cursor = hit.length
        event("match: hit" if hit.length else "match: miss")

    def _longest_allowed_hit(self, tokens: list[int]) -> int:
        if not self.spec.prefix_cache:
            return 0
        _, pages, checkpoints, _, _ = canonical(self.coord)
        usable = {c[0] for c in checkpoints} if self.spec.hybrid else {p[0] for p in pages}
        ends = [k for k in range(self.P, len(tokens), self.P) if tuple(tokens[:k]) in usable]
        return max(ends, default=0)

    @precondition(lambda self: self.txn is not None)
    @rule(tokens=st.integers(0, 5), pages=st.integers(0, 1), slots=st.integers(0, 1), windows=st.integers(0, 1),
          data=st.data())  # fmt: skip
    def reserve(self, tokens, pages, slots, windows, data):
        self._reserve(tokens, pages, slots, windows, data, fault=False)

    @precondition(lambda self: self.txn is not None)
    @rule(tokens=st.integers(1, 8), data=st.data())
    def reserve_then_fail(self, tokens, data):
        self._reserve(tokens, 0, 0, 0, data, fault=True)

    def _reserve(self, tokens, pages, slots, windows, data, fault: bool) -> bool:
        model, req = self._model(), self.coord.requests[self.txn.req_id]
        self.may_match = False
        if self.spec.hybrid and not req.state_slots:
            slots = 1  # a hybrid request computes into a live state from its first step
        windows = min(windows, self.spec.num_window_slots)
        short = model.cursor + tokens - len(model.tokens)
        if short > 0:  # decode: the step "generates" these tokens
            model.tokens += data.draw(st.lists(TOKENS, min_size=short, max_size=short))
        before = canonical(self.coord)
        if fault:
            self.armed.add("reserve.evicted")
        try:
            self.txn.reserve(tokens=tokens, pages=pages, state_slots=slots, window_slots=windows)
        except (CapacityError, InjectedFault) as err:
            assert canonical(self.coord) == before, "a failed reserve changed something"
            event(f"reserve: {type(err).__name__}")
            return False
        finally:
            self.armed.clear()
        assert not fault, "the armed fault did not fire"
        if canonical(self.coord)[1] != before[1]:
            event("reserve: evicted")
        start, model.cursor = model.cursor, model.cursor + tokens
        P = self.P
        for i in range(start // P, -(-model.cursor // P)):
            self.pending_pages[req.pages[i]] = tuple(model.tokens[i * P : min((i + 1) * P, model.cursor)])
        return True

    @precondition(lambda self: self.txn is not None)
    @rule()
    def commit(self):
        model, rid = self._model(), self.txn.req_id
        try:
            grant = self.txn.commit()
        except TransactionError:
            event("commit: refused")
            assert canonical(self.coord) == self.txn_before, "a refused commit did not roll back"
            self._close(committed=False)
            return
        req = self.coord.requests[rid]
        assert grant.pages == tuple(req.pages) and grant.cursor == model.cursor
        assert len(grant.pages) >= -(-model.cursor // self.P)
        for op in grant.ops:
            assert isinstance(op, RestoreCheckpoint) and op.dst_slot == grant.state_slots[0]
            assert self.slot_tokens[op.src_slot] == tuple(model.tokens[: op.length])
            self.restoring[rid] = (op.src_slot, tuple(model.tokens[: op.length]))
            event("commit: restore checkpoint")
        self.page_tokens.update(self.pending_pages)
        if grant.state_slots:
            self.slot_tokens[grant.state_slots[0]] = tuple(model.tokens[: model.cursor])
        model.paused = False
        self._close(committed=True)

    @precondition(lambda self: self.txn is not None)
    @rule()
    def rollback(self):
        self.txn.rollback()
        assert canonical(self.coord) == self.txn_before, "rollback did not restore the coordinator"
        self._close(committed=False)

    @precondition(lambda self: self.txn is not None)
    @rule()
    def fail_inside_with_block(self):
        with pytest.raises(InjectedFault):
            with self.txn:
                raise InjectedFault("the step could not be planned")
        assert canonical(self.coord) == self.txn_before
        self._close(committed=False)

    @precondition(lambda self: self.txn is None and len(self.models) < MAX_REQUESTS)
    @rule(publish=st.booleans(), data=st.data())
    def admit(self, publish, data):
        """begin + match + reserve the whole prompt + commit, then maybe publish it."""
        rid, prompt = self.next_rid, self._draw_prompt(data)
        self._begin_new(prompt)
        self.match()
        model = self._model()
        if self._reserve(len(prompt) - model.cursor, 0, 1 if self.spec.hybrid else 0, 0, data, fault=False):
            self.commit()
        else:
            self.rollback()
        if publish and rid in self.models and not model.paused and model.cursor:
            self._publish(rid, model.cursor, data)

    @precondition(lambda self: self.txn is None and self._running())
    @rule(tokens=st.integers(1, 3), data=st.data())
    def decode(self, tokens, data):
        """A running request's next step in its own transaction, then publish what it computed."""
        rid = data.draw(st.sampled_from(self._running()))
        self._begin(rid, new=False)
        if self._reserve(tokens, 0, 0, 0, data, fault=False):
            self.commit()
            self._publish(rid, self.models[rid].cursor, data)
        else:
            self.rollback()

    @precondition(lambda self: self.txn is None and self.spec.hybrid and self._running())
    @rule(pages=st.integers(1, 3), data=st.data())
    def decode_to_page_boundaries(self, pages, data):
        """The scheduler's hybrid decode: step to each next page boundary and checkpoint there."""
        rid = data.draw(st.sampled_from(self._running()))
        model = self.models[rid]
        for _ in range(pages):
            self._begin(rid, new=False)
            if not self._reserve(self.P - model.cursor % self.P, 0, 0, 0, data, fault=False):
                self.rollback()
                return
            self.commit()
            self._publish(rid, model.cursor, data, checkpoint=True)
            self.books_balance()

    def _without_windows(self) -> list[int]:
        if not (self.spec.hybrid and self.spec.prefix_cache):
            return []
        return [rid for rid in self._running() if not self.coord.requests[rid].window_slots]

    @precondition(lambda self: self.txn is None and self._without_windows())
    @rule(pages=st.integers(1, 3), data=st.data())
    def prefill_keeping_checkpoints(self, pages, data):
        """A prefill chunk across `pages` page boundaries keeping the state at some of them (pending
        until a publish reaches them), reserved all or nothing; then maybe publish it all."""
        rid = data.draw(st.sampled_from(self._without_windows()))
        model, req, P = self.models[rid], self.coord.requests[rid], self.P
        start = model.cursor
        end = (start // P + pages) * P + data.draw(st.integers(0, P - 1))
        depths = tuple(d for d in range(start // P * P + P, end, P) if d > start and data.draw(st.booleans()))
        self._begin(rid, new=False)
        if not self._reserve(end - start, 0, 0, 0, data, fault=False):
            self.rollback()
            return
        before = canonical(self.coord)
        try:
            self.txn.reserve(checkpoints=depths)
        except CapacityError:
            assert canonical(self.coord) == before, "a failed checkpoint reservation changed something"
            event("reserve: checkpoint slots short")
        self.commit()
        for depth, slot in req.pending.items():  # the forward writes them
            self.slot_tokens[slot] = tuple(model.tokens[:depth])
        if req.pending:
            event("prefill: checkpoints pending")
        if data.draw(st.booleans()):
            self._publish(rid, model.cursor, data)
            assert all(d > req.published for d in req.pending), "a publish passed a pending checkpoint"

    @precondition(lambda self: self.txn is None and self._running())
    @rule(data=st.data())
    def finish(self, data):
        """A finished request: publish everything it computed, then release it."""
        rid = data.draw(st.sampled_from(self._running()))
        self._publish(rid, self.models[rid].cursor, data)
        self.coord.release(rid)
        del self.models[rid]

    def _running(self) -> list[int]:
        return sorted(rid for rid, m in self.models.items() if not m.paused)

    @precondition(lambda self: self.txn is None and any(not m.paused and m.cursor for m in self.models.values()))
    @rule(data=st.data())
    def publish(self, data):
        rid = data.draw(st.sampled_from([r for r in self._running() if self.models[r].cursor]))
        self._publish(rid, data.draw(st.integers(0, self.models[rid].cursor)), data)

    def _publish(self, rid: int, upto: int, data, checkpoint: bool | None = None) -> None:
        """Publish [0, upto); with a checkpoint where one is allowed, when `checkpoint` or a draw says so."""
        model, req = self.models[rid], self.coord.requests[rid]
        checkpoint = (
            self.spec.hybrid and upto == model.cursor and upto % self.P == 0 and bool(req.state_slots)
            and (checkpoint or data.draw(st.booleans()))
        )  # fmt: skip
        rolling = checkpoint and data.draw(st.booleans())
        point = data.draw(st.sampled_from(FAULT_POINTS))
        published_before, before = req.published, canonical(self.coord)
        own_pin = None if req.held is None else req.held.slot  # publishing deeper lets go of it
        if point is not None:
            self.armed.add(point)
        try:
            result = self.coord.publish(rid, model.tokens, upto, checkpoint=checkpoint, rolling=rolling)
        except InjectedFault:
            assert canonical(self.coord) == before, "a failed publish changed something"
            event("publish: failed mid-way")
            return
        finally:
            self.armed.clear()
        aligned = upto - upto % self.P
        expected = max(aligned, published_before) if self.spec.prefix_cache else 0
        assert result.cached_tokens == expected
        if result.inserted_tokens:
            event("publish: inserted")
            self.history.append(tuple(model.tokens[:upto]))
        if result.inserted_tokens < expected - published_before:
            event("publish: duplicate pages")
        for op in result.ops:
            assert isinstance(op, SaveCheckpoint) and checkpoint and op.src_slot == req.state_slots[0]
            assert op.length == upto and self.slot_tokens[op.src_slot] == tuple(model.tokens[:upto])
            self.slot_tokens[op.dst_slot] = tuple(model.tokens[:upto])
            event("publish: save checkpoint")
        if checkpoint:
            pins = {slot: holds - (slot == own_pin) for _, slot, _, holds in before[2]}
            self._follow_rolling(model, req, before[2], pins, tuple(model.tokens[:upto]), rolling, result.ops)

    def _follow_rolling(self, model: RequestModel, req, before: list, pins: dict, target: tuple, rolling: bool,
                        ops) -> None:  # fmt: skip
        """Check a checkpointed publish against the rolling rules; track the request's rolling checkpoint.

        Its rolling checkpoint moves (same slot, new tokens) when it is unpinned and
        shaped like the request's state; a slot taken from any other checkpoint (an
        eviction) must have been unpinned too. pins: slot -> readers other than this
        publish's request, whose own pin the publish drops (its restore ran before it got here).
        """
        attached = {slot: (tokens, window) for tokens, slot, window, _ in before}
        movable = None
        if model.rolling is not None and model.rolling[0] in attached and target not in {c[0] for c in before}:
            tokens, window = attached[model.rolling[0]]
            shaped = (window is not None) == bool(req.window_slots)
            if tokens == model.rolling[1] and pins[model.rolling[0]] == 0 and shaped:
                movable = model.rolling[0]
        for op in ops:
            if op.dst_slot in attached:
                assert pins[op.dst_slot] == 0, f"took slot {op.dst_slot} from a pinned checkpoint"
                event("publish: rolling checkpoint moved" if op.dst_slot == movable else "publish: slot evicted")
        if movable is not None:
            assert [op.dst_slot for op in ops] == [movable], f"the rolling checkpoint in slot {movable} did not move"
        already_here = not ops and model.rolling is not None and model.rolling[1] == target
        if rolling and ops:
            model.rolling = (ops[0].dst_slot, target)
        elif not rolling and (movable is not None or already_here):
            model.rolling = None  # published for good: moved here, or it was here already

    @precondition(lambda self: self.txn is None and self.models)
    @rule(data=st.data())
    def pause(self, data):
        rid = data.draw(st.sampled_from(sorted(self.models)))
        self.coord.pause(rid)
        self.models[rid].paused, self.models[rid].cursor = True, 0

    @precondition(lambda self: self.txn is None and self.models)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.models)))
        self.coord.release(rid)
        del self.models[rid]

    @precondition(lambda self: self.txn is None)
    @rule(pages=st.integers(0, 4), checkpoints=st.integers(0, 2))
    def evict(self, pages, checkpoints):
        self.coord.evict(pages=pages, checkpoints=checkpoints)

    @precondition(lambda self: self.txn is None)
    @rule()
    def flush(self):
        self.coord.flush()
        assert self.coord.tree.evictable_pages == 0 and self.coord.tree.evictable_checkpoints == 0

    @invariant()
    def books_balance(self):
        self.coord.check_integrity(allow_open_transaction=self.txn is not None)

    @invariant()
    def rolling_checkpoints_followed(self):
        """Forget a rolling checkpoint once evicted, so a new one at its tokens is not taken for it."""
        checkpoints = {(c[0], c[1]) for c in canonical(self.coord)[2]}
        for model in self.models.values():
            if model.rolling is not None and (model.rolling[1], model.rolling[0]) not in checkpoints:
                model.rolling = None

    @invariant()
    def pinned_checkpoints_keep_their_state(self):
        """A checkpoint a commit restores from is not overwritten (moved, reused) while it is pinned."""
        for rid, (slot, tokens) in list(self.restoring.items()):
            req = self.coord.requests.get(rid)
            if req is None or req.held is None:
                del self.restoring[rid]  # unpinned: its copy ran before the request moved on
                continue
            assert self.slot_tokens[slot] == tokens, f"request {rid} restores from slot {slot}, since overwritten"

    @invariant()
    def running_requests_keep_their_kv(self):
        P = self.P
        for rid in self._running():
            if self.txn is not None and self.txn.req_id == rid:
                continue
            model, req = self.models[rid], self.coord.requests[rid]
            for i in range(-(-model.cursor // P)):
                want = tuple(model.tokens[i * P : min((i + 1) * P, model.cursor)])
                assert self.page_tokens[req.pages[i]] == want, f"request {rid} page {i} was overwritten"

    def teardown(self):
        if self.txn is not None and self.txn.open:  # (closed when a failing rule left it half-done)
            self.txn.rollback()
            self._close(committed=False)
        for rid in list(self.models):
            self.coord.release(rid)
        self.coord.flush()
        self.coord.check_integrity()
        coord = self.coord
        for pool in (coord.pages, coord.state_slots, coord.window_slots):
            assert pool.free_count == pool.size, f"{pool.name}: {pool.size - pool.free_count} never came back"
        assert coord.tree.num_nodes == 0 and coord.requests == {}


FAST = settings(
    max_examples=80, stateful_step_count=50, deadline=None, report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


def machine(name: str, spec: CacheSpec):
    cls = type(name, (CoordinatorMachine,), {"spec": spec})
    cls.TestCase.settings = FAST
    return cls.TestCase


TestDensePage1 = machine("DensePage1", CacheSpec(1, 16, 0, 0, False, None, True))
TestDensePage2 = machine("DensePage2", CacheSpec(2, 10, 0, 0, False, None, True))
TestHybridPage1 = machine("HybridPage1", CacheSpec(1, 16, 5, 0, True, None, True))
TestHybridPage2Windows = machine("HybridPage2Windows", CacheSpec(2, 12, 5, 3, True, 2, True))
TestNoPrefixCache = machine("NoPrefixCache", CacheSpec(2, 6, 2, 1, True, None, False))
