"""The coordinator's tier additions: Transaction.extend, hold/unhold and peek, plus a random-sequence machine."""

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hkv.cache import CacheCoordinator, CacheSpec, CapacityError, Evicted, Hit, SaveCheckpoint, TransactionError
from tests.cache.snapshot import canonical


def dense(pages=8, page_size=2) -> CacheCoordinator:
    return CacheCoordinator(CacheSpec(page_size, pages, 0, 0, False, None, True))


def hybrid(pages=12, slots=4, page_size=2) -> CacheCoordinator:
    return CacheCoordinator(CacheSpec(page_size, pages, slots, 0, True, 4, True))


def run(coord, rid, tokens, *, state_slots=0, publish=True, checkpoint=False):
    """Admit a request for all of `tokens` in one transaction, then publish all of it."""
    with coord.begin(rid) as txn:
        hit = txn.match(tokens)
        txn.reserve(tokens=len(tokens) - hit.length, state_slots=state_slots)
        grant = txn.commit()
    published = coord.publish(rid, tokens, len(tokens), checkpoint=checkpoint) if publish else None
    coord.check_integrity()
    return hit, grant, published


def cached(coord, rid, tokens, **kw):
    """run + release: `tokens`' full pages stay cached, unreferenced."""
    result = run(coord, rid, tokens, **kw)
    coord.release(rid)
    coord.check_integrity()
    return result


def test_extend_grows_a_dense_hit_with_fresh_pages():
    coord = dense()
    cached(coord, 1, [1, 2, 3, 4, 5, 6])  # pages 0, 1, 2
    txn = coord.begin(2)
    hit = txn.match([1, 2, 3, 4, 7, 8, 9, 10, 11])
    assert hit == Hit(4, (0, 1), None)
    assert txn.extend(4) == (3, 4)  # tokens [4, 8): the CPU tier serves them
    coord.check_integrity(allow_open_transaction=True)
    req = coord.requests[2]
    assert (req.pages, req.cursor, req.published, req.cached_tokens) == ([0, 1, 3, 4], 8, 4, 8)
    txn.reserve(tokens=1)
    grant = txn.commit()
    coord.check_integrity()
    assert grant.pages == (0, 1, 3, 4, 5) and grant.new_pages_from == 0
    assert (grant.cursor, grant.cached_tokens, grant.ops) == (9, 8, ())


def test_extend_on_a_miss_starts_at_page_zero():
    coord = dense()
    txn = coord.begin(1)
    assert txn.match([1, 2, 3, 4, 5]) == Hit(0, (), None)
    assert txn.extend(2) == (0,)
    assert txn.extend(2) == (1,)  # twice in a row: still right after the match
    txn.reserve(tokens=1)
    grant = txn.commit()
    coord.check_integrity()
    assert (grant.pages, grant.cursor, grant.cached_tokens) == ((0, 1, 2), 5, 4)


def test_extend_takes_a_positive_page_multiple():
    coord = dense()
    txn = coord.begin(1)
    txn.match([1, 2, 3, 4, 5])
    for bad in (0, -2, 1, 3):
        with pytest.raises(ValueError, match="positive multiple of the page size 2"):
            txn.extend(bad)
    coord.check_integrity(allow_open_transaction=True)
    assert coord.requests[1].pages == []
    txn.rollback()
    coord.check_integrity()


def test_extend_must_follow_match():
    coord = dense()
    txn = coord.begin(1)
    with pytest.raises(TransactionError, match="extend must follow match"):
        txn.extend(2)  # no match yet
    txn.rollback()
    coord = hybrid()
    txn = coord.begin(1)
    txn.match([1, 2, 3])
    txn.reserve(tokens=2, state_slots=1)
    with pytest.raises(TransactionError, match="extend must follow match"):
        txn.extend(2)
    txn.rollback()
    coord.check_integrity()
    txn = coord.begin(1)
    txn.match([1, 2, 3])
    txn.reserve(tokens=2)  # the cursor moved past the hit
    with pytest.raises(TransactionError, match="extend must follow match"):
        txn.extend(2)
    txn.rollback()
    coord.check_integrity()
    txn.open = True  # a closed transaction is refused whatever its flags say
    with pytest.raises(TransactionError, match="closed"):
        txn.extend(2)


def test_extend_is_refused_in_a_running_requests_transaction():
    coord = dense()
    run(coord, 1, [1, 2, 3, 4])  # cursor == published == 4, no state slots
    txn = coord.begin(1)
    with pytest.raises(TransactionError, match="extend must follow match"):
        txn.extend(2)
    txn.rollback()


def test_extend_is_refused_after_a_look_ahead_reserve():
    coord = dense()
    txn = coord.begin(1)
    txn.match([1, 2, 3])
    txn.reserve(pages=1)  # look-ahead page 0; the cursor stays at 0
    try:
        pages = txn.extend(2)
    except TransactionError:
        txn.rollback()
        return
    index = coord.requests[1].pages.index(pages[0])
    txn.rollback()
    # page i must hold tokens [2i, 2i + 2): the loaded page has to be page 0
    assert index == 0, f"tokens [0, 2) are loaded into page index {index}"


def test_extend_evicts_lru_leaves_in_order():
    coord = dense(pages=6)
    cached(coord, 1, [1, 1, 1, 1])  # pages 0, 1
    cached(coord, 2, [2, 2, 2, 2])  # pages 2, 3
    cached(coord, 3, [3, 3])  # page 4
    txn = coord.begin(4)
    assert txn.match([2, 2, 2, 2, 9]).length == 4  # locks request 2's leaf
    # 1 free page (5) is not enough: the LRU unlocked leaf, request 1's [1, 1, 1, 1], goes;
    # freed ids are handed out before never-used ones
    assert txn.extend(6) == (0, 1, 5)
    coord.check_integrity(allow_open_transaction=True)
    assert coord.tree.cached_pages == 3
    txn.commit()
    coord.check_integrity()
    assert coord.peek([1, 1, 1, 1, 1]) == 0 and coord.peek([3, 3, 3]) == 2


def test_extend_capacity_error_changes_nothing():
    coord = dense(pages=4)
    cached(coord, 1, [1, 1, 1, 1])
    txn = coord.begin(2)
    txn.match([1, 1, 1, 1, 5])
    before = canonical(coord)
    with pytest.raises(CapacityError):
        txn.extend(6)  # 2 free, 0 evictable (the hit is locked)
    assert canonical(coord) == before and txn.open
    coord.check_integrity(allow_open_transaction=True)
    assert txn.extend(4) == (2, 3)
    txn.rollback()
    coord.check_integrity()


def test_rollback_undoes_extend_and_its_evictions():
    coord = dense(pages=4)
    cached(coord, 1, [1, 1, 1, 1])
    cached(coord, 2, [2, 2])
    before = canonical(coord)
    txn = coord.begin(3)
    txn.match([2, 2, 2, 2, 2])
    assert txn.extend(4) == (0, 1)  # evicts [1, 1, 1, 1]'s leaf; page 3 stays free
    txn.reserve(tokens=1)
    txn.rollback()
    coord.check_integrity()
    assert canonical(coord) == before and 3 not in coord.requests


def test_hybrid_hit_then_extend_commits_without_a_restore():
    coord = hybrid()
    _, _, published = cached(coord, 1, [1, 2, 3, 4], state_slots=1, checkpoint=True)
    [save] = published.ops
    txn = coord.begin(2)
    hit = txn.match([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hit.length == 4 and hit.checkpoint.slot == save.dst_slot
    assert txn.extend(4) == (2, 3)
    txn.reserve(tokens=1, state_slots=1)
    grant = txn.commit()
    coord.check_integrity()
    # the tier loads pages and the state; the device checkpoint is not restored
    assert grant.ops == () and grant.cached_tokens == 8 and grant.cursor == 9
    assert grant.pages == (0, 1, 2, 3, 4) and grant.state_slots == (0,)  # request 1's live slot, freed


def test_hybrid_hit_without_extend_still_restores():
    coord = hybrid()
    cached(coord, 1, [1, 2, 3, 4], state_slots=1, checkpoint=True)
    txn = coord.begin(2)
    txn.match([1, 2, 3, 4, 5])
    txn.reserve(tokens=1, state_slots=1)
    grant = txn.commit()
    assert [type(op).__name__ for op in grant.ops] == ["RestoreCheckpoint"] and grant.cached_tokens == 4
    coord.check_integrity()


def test_extend_after_a_miss_in_a_hybrid_model_needs_no_restore_slot():
    coord = hybrid()
    txn = coord.begin(1)
    txn.match([1, 2, 3, 4, 5])
    txn.extend(4)
    grant = txn.commit()  # no checkpoint hit: no live slot needed
    assert grant.ops == () and grant.cached_tokens == 4 and grant.state_slots == ()
    coord.check_integrity()


def test_extend_on_a_checkpoint_hit_still_saves_a_checkpoint_on_publish():
    coord = hybrid()
    cached(coord, 1, [1, 2, 3, 4], state_slots=1, checkpoint=True)
    with coord.begin(2) as txn:
        txn.match([1, 2, 3, 4, 5, 6, 7])
        txn.extend(2)
        txn.reserve(tokens=1, state_slots=1)
        txn.commit()
    published = coord.publish(2, [1, 2, 3, 4, 5, 6, 7], 6, checkpoint=True)
    coord.check_integrity()
    [save] = published.ops
    assert isinstance(save, SaveCheckpoint) and save.length == 6 and published.inserted_tokens == 2


def test_hold_locks_the_published_path_and_outlives_the_request():
    coord = dense(pages=4)
    run(coord, 1, [1, 2, 3, 4, 5])
    hold = coord.hold(1)
    assert (hold.hold_id, hold.length, hold.pages, hold.checkpoint) == (1, 4, (0, 1), None)
    assert coord.holds == {1: hold}
    coord.check_integrity()
    coord.release(1)
    coord.check_integrity()
    assert coord.tree.evictable_pages == 0
    assert coord.flush() == Evicted(0, 0) and coord.evict(pages=10) == Evicted(0, 0)
    coord.check_integrity()
    # reserve cannot take them either
    txn = coord.begin(2)
    txn.match([9, 9, 9, 9, 9, 9, 9])
    with pytest.raises(CapacityError):
        txn.reserve(tokens=7)
    txn.rollback()
    coord.unhold(hold)
    coord.check_integrity()
    assert coord.holds == {} and coord.tree.evictable_pages == 2
    assert coord.flush() == Evicted(2, 0)
    coord.check_integrity()


def test_two_holds_of_one_prefix_need_two_unholds():
    coord = dense()
    run(coord, 1, [1, 2, 3, 4])
    first, second = coord.hold(1), coord.hold(1)
    assert (first.hold_id, second.hold_id) == (1, 2) and first.pages == second.pages == (0, 1)
    coord.release(1)
    coord.unhold(first)
    coord.check_integrity()
    assert coord.flush().pages == 0
    coord.unhold(second)
    coord.check_integrity()
    assert coord.flush().pages == 2


def test_hold_pins_the_checkpoint():
    coord = hybrid(slots=2)
    _, _, published = run(coord, 1, [1, 2, 3, 4], state_slots=1, checkpoint=True)
    [save] = published.ops
    hold = coord.hold(1)
    assert hold.checkpoint is not None and hold.checkpoint.slot == save.dst_slot and hold.checkpoint.holds == 1
    coord.release(1)
    coord.check_integrity()
    assert coord.flush() == Evicted(0, 0)
    assert coord.tree.evictable_checkpoints == 0
    # the live slot can be had (it was freed), the checkpoint's cannot
    txn = coord.begin(2)
    txn.match([7, 7])
    txn.reserve(tokens=2, state_slots=1)
    with pytest.raises(CapacityError):
        txn.reserve(state_slots=1)
    txn.rollback()
    coord.unhold(hold)
    coord.check_integrity()
    assert hold.checkpoint.holds == 0 and coord.flush() == Evicted(2, 1)
    coord.check_integrity()


def test_hold_of_a_hybrid_prefix_published_without_a_checkpoint():
    coord = hybrid()
    run(coord, 1, [1, 2, 3, 4], state_slots=1)
    hold = coord.hold(1)
    assert hold.checkpoint is None and hold.length == 4
    coord.unhold(hold)
    coord.check_integrity()


def test_hold_of_a_hit_inside_an_edge_survives_the_split():
    coord = dense()
    cached(coord, 1, [1, 2, 3, 4, 5, 6, 7, 8])  # one edge of 4 pages
    run(coord, 2, [1, 2, 3, 4, 9, 9, 9], publish=False)  # hit ends inside the edge
    hold = coord.hold(2)
    assert hold.length == 4 and hold.pages == (0, 1) and hold.node.depth == 8
    coord.check_integrity()
    coord.publish(2, [1, 2, 3, 4, 9, 9, 9], 6)  # splits the edge at 4
    coord.check_integrity()
    assert hold.node.in_tree and hold.node.depth == 8
    coord.release(2)
    coord.unhold(hold)
    coord.check_integrity()
    assert coord.flush().pages == 5


def test_hold_returns_none_when_nothing_is_published():
    coord = dense()
    run(coord, 1, [1, 2, 3], publish=False)
    assert coord.hold(1) is None
    run(coord, 2, [5], publish=True)  # a partial page publishes nothing
    assert coord.hold(2) is None
    coord.pause(1)
    assert coord.hold(1) is None
    assert coord.holds == {}
    coord.check_integrity()


def test_hold_and_unhold_refuse_while_a_transaction_is_open_or_twice():
    coord = dense()
    run(coord, 1, [1, 2, 3])
    hold = coord.hold(1)
    txn = coord.begin(2)
    with pytest.raises(TransactionError, match="transaction is open"):
        coord.hold(1)
    with pytest.raises(TransactionError, match="transaction is open"):
        coord.unhold(hold)
    txn.rollback()
    with pytest.raises(TransactionError, match="unknown request"):
        coord.hold(99)
    coord.unhold(hold)
    with pytest.raises(TransactionError, match="is not held"):
        coord.unhold(hold)
    coord.check_integrity()
    assert coord.tree.root.children and all(n.lock_ref == 1 for n in coord.tree.nodes())  # request 1's own lock


def test_check_integrity_counts_holds_as_locks():
    coord = dense()
    run(coord, 1, [1, 2, 3])
    hold = coord.hold(1)
    coord.holds.pop(hold.hold_id)  # a hold forgotten without unlocking
    with pytest.raises(AssertionError, match="lock_ref 2, but 1 requests lock it"):
        coord.check_integrity()


def test_peek_is_the_match_length_without_locking_or_touching():
    coord = dense(pages=4)
    cached(coord, 1, [1, 1, 1, 1])  # older leaf
    cached(coord, 2, [2, 2, 2, 2])
    before = canonical(coord)
    assert coord.peek([1, 1, 1, 1, 5]) == 4
    assert coord.peek([1, 1, 1, 1]) == 2  # one prompt token is always computed
    assert coord.peek([1, 1, 7]) == 2 and coord.peek([7, 1]) == 0 and coord.peek([1]) == 0
    assert canonical(coord) == before and coord.tree.evictable_pages == 4
    # no LRU touch: request 1's leaf is still the first to go
    assert coord.evict(pages=1) == Evicted(2, 0)
    assert coord.peek([1, 1, 1, 1, 5]) == 0 and coord.peek([2, 2, 2, 2, 5]) == 4
    coord.check_integrity()


def test_peek_hybrid_stops_at_the_deepest_checkpoint():
    coord = hybrid()
    run(coord, 1, [1, 2, 3, 4], state_slots=1, checkpoint=True)
    with coord.begin(1) as txn:
        txn.reserve(tokens=4)
        txn.commit()
    coord.publish(1, [1, 2, 3, 4, 5, 6, 7, 8], 8)  # pages past the checkpoint, no checkpoint at 8
    coord.check_integrity()
    before = canonical(coord)
    assert coord.peek([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
    assert coord.peek([1, 2, 3]) == 0 and coord.peek([9, 9, 9]) == 0
    assert canonical(coord) == before


def test_peek_with_the_prefix_cache_off_is_zero():
    coord = CacheCoordinator(CacheSpec(2, 8, 0, 0, False, None, False))
    run(coord, 1, [1, 2, 3, 4])
    assert coord.peek([1, 2, 3, 4, 5]) == 0


TOKENS = st.integers(0, 2)
MAX_REQUESTS = 3


class TierCoordinatorMachine(RuleBasedStateMachine):
    """begin/match/extend/reserve/commit/rollback/publish/hold/unhold/release/flush; integrity after each step."""

    spec: CacheSpec

    def __init__(self):
        super().__init__()
        self.coord = CacheCoordinator(self.spec)
        self.P = self.spec.page_size
        self.tokens: dict[int, list[int]] = {}  # request -> its tokens so far
        self.cursor: dict[int, int] = {}
        self.running: set[int] = set()  # committed at least once, not paused
        self.next_rid = 0
        self.txn = None
        self.txn_new = False
        self.before = None  # canonical picture when the transaction began
        self.may_match = self.may_extend = False
        self.extended = 0
        self.holds = []
        self.history: list[tuple] = []  # published sequences: new prompts continue them, so hits happen

    def _close(self, committed: bool) -> None:
        rid = self.txn.req_id
        if committed:
            self.running.add(rid)
            self.cursor[rid] = self.coord.requests[rid].cursor
        elif self.txn_new:
            del self.tokens[rid], self.cursor[rid]
        self.txn = None

    def _draw_prompt(self, data) -> list[int]:
        if self.history and data.draw(st.booleans()):
            return list(data.draw(st.sampled_from(self.history))) + data.draw(st.lists(TOKENS, min_size=1, max_size=3))
        return data.draw(st.lists(TOKENS, min_size=1, max_size=9))

    @precondition(lambda self: self.txn is None and len(self.tokens) < MAX_REQUESTS)
    @rule(data=st.data())
    def begin_new(self, data):
        self._begin_new(self._draw_prompt(data))

    def _begin_new(self, prompt: list[int]) -> int:
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.tokens[rid], self.cursor[rid] = prompt, 0
        self._begin(rid, new=True)
        return rid

    @precondition(lambda self: self.txn is None and len(self.tokens) < MAX_REQUESTS)
    @rule(extend_pages=st.integers(0, 2), data=st.data())
    def admit(self, extend_pages, data):
        """begin + match + extend (a tier run) + reserve the rest + commit, then publish and maybe hold."""
        rid = self._begin_new(self._draw_prompt(data))
        self.match()
        if extend_pages:
            self.extend(extend_pages)
        self.reserve(len(self.tokens[rid]) - self.coord.requests[rid].cursor, 0, data)
        self.commit()
        if rid in self.running and self.cursor[rid]:
            self._publish(rid, self.cursor[rid], data)
            if data.draw(st.booleans()):
                self._hold(rid)

    @precondition(lambda self: self.txn is None and self.tokens)
    @rule(data=st.data())
    def begin_existing(self, data):
        self._begin(data.draw(st.sampled_from(sorted(self.tokens))), new=False)

    def _begin(self, rid: int, new: bool) -> None:
        self.before = canonical(self.coord)
        self.txn, self.txn_new = self.coord.begin(rid), new
        self.may_match = rid not in self.running
        self.may_extend, self.extended = False, 0

    @precondition(lambda self: self.txn is not None and self.may_match)
    @rule()
    def match(self):
        hit = self.txn.match(self.tokens[self.txn.req_id])
        assert hit.length == self.coord.requests[self.txn.req_id].cursor
        self.may_match, self.may_extend = False, True

    @precondition(lambda self: self.txn is not None and self.may_extend)
    @rule(pages=st.integers(1, 3))
    def extend(self, pages):
        before = canonical(self.coord)
        req = self.coord.requests[self.txn.req_id]
        cursor = req.cursor
        if cursor + pages * self.P > len(self.tokens[self.txn.req_id]) - 1:
            return  # a tier run lies within prompt[:-1]
        try:
            new = self.txn.extend(pages * self.P)
        except CapacityError:
            assert canonical(self.coord) == before, "a failed extend changed something"
            event("extend: CapacityError")
            return
        assert len(new) == pages and req.pages[cursor // self.P :] == list(new)
        assert req.cursor == req.cached_tokens == cursor + pages * self.P
        self.extended += pages * self.P
        event("extend: ok")

    @precondition(lambda self: self.txn is not None)
    @rule(tokens=st.integers(0, 4), pages=st.integers(0, 1), data=st.data())
    def reserve(self, tokens, pages, data):
        rid = self.txn.req_id
        req = self.coord.requests[rid]
        slots = 1 if self.spec.hybrid and not req.state_slots else 0
        short = req.cursor + tokens - len(self.tokens[rid])
        if short > 0:
            self.tokens[rid] += data.draw(st.lists(TOKENS, min_size=short, max_size=short))
        before = canonical(self.coord)
        self.may_match = self.may_extend = False
        try:
            self.txn.reserve(tokens=tokens, pages=pages, state_slots=slots)
        except CapacityError:
            assert canonical(self.coord) == before, "a failed reserve changed something"

    @precondition(lambda self: self.txn is not None)
    @rule()
    def commit(self):
        try:
            grant = self.txn.commit()
        except TransactionError:
            assert canonical(self.coord) == self.before, "a refused commit did not roll back"
            self._close(committed=False)
            return
        if self.extended:
            assert grant.ops == () and grant.cached_tokens >= self.extended
            event("commit: extended")
        self._close(committed=True)

    @precondition(lambda self: self.txn is not None)
    @rule()
    def rollback(self):
        self.txn.rollback()
        assert canonical(self.coord) == self.before, "rollback did not restore the coordinator"
        self._close(committed=False)

    @precondition(lambda self: self.txn is None and any(self.cursor[r] for r in self.running))
    @rule(data=st.data())
    def publish(self, data):
        rid = data.draw(st.sampled_from(sorted(r for r in self.running if self.cursor[r])))
        self._publish(rid, data.draw(st.integers(0, self.cursor[rid])), data)

    def _publish(self, rid: int, upto: int, data) -> None:
        req = self.coord.requests[rid]
        checkpoint = (self.spec.hybrid and upto == req.cursor and upto % self.P == 0 and bool(req.state_slots)
                      and data.draw(st.booleans()))  # fmt: skip
        rolling = checkpoint and data.draw(st.booleans())  # a held rolling checkpoint must stay (see the invariant)
        published = self.coord.publish(rid, self.tokens[rid], upto, checkpoint=checkpoint, rolling=rolling)
        if published.inserted_tokens:
            self.history.append(tuple(self.tokens[rid][:upto]))

    @precondition(lambda self: self.txn is None and self.running)
    @rule(data=st.data())
    def hold(self, data):
        self._hold(data.draw(st.sampled_from(sorted(self.running))))

    def _hold(self, rid: int) -> None:
        req = self.coord.requests[rid]
        hold = self.coord.hold(rid)
        if hold is None:
            assert req.published == 0
            return
        assert hold.length == req.published
        if not req.duplicates:  # (else its own copies stand in for some of the tree's pages)
            assert hold.pages == tuple(req.pages[: req.published // self.P])
        self.holds.append(hold)
        event("hold: with checkpoint" if hold.checkpoint is not None else "hold: pages only")

    @precondition(lambda self: self.txn is None and self.holds)
    @rule(data=st.data())
    def unhold(self, data):
        hold = self.holds.pop(data.draw(st.integers(0, len(self.holds) - 1)))
        self.coord.unhold(hold)
        with pytest.raises(TransactionError):
            self.coord.unhold(hold)

    @precondition(lambda self: self.txn is None and self.tokens)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.coord.release(rid)
        del self.tokens[rid], self.cursor[rid]
        self.running.discard(rid)

    @precondition(lambda self: self.txn is None and self.running)
    @rule(data=st.data())
    def pause(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.coord.pause(rid)
        self.running.discard(rid)
        self.cursor[rid] = 0

    @precondition(lambda self: self.txn is None)
    @rule()
    def flush(self):
        self.coord.flush()
        assert self.coord.tree.evictable_pages == 0 and self.coord.tree.evictable_checkpoints == 0

    @invariant()
    def books_balance(self):
        self.coord.check_integrity(allow_open_transaction=self.txn is not None)

    @invariant()
    def held_prefixes_stay_cached(self):
        assert len(self.coord.holds) == len(self.holds)
        for hold in self.holds:
            assert hold.node.in_tree, f"held node {hold.node.node_id} was evicted"
            assert tuple(self.coord.tree.path_pages(hold.node, hold.length)) == hold.pages, "held pages changed"
            if hold.checkpoint is not None:
                assert hold.node.checkpoint is hold.checkpoint, "a held checkpoint was evicted or moved"

    def teardown(self):
        if self.txn is not None and self.txn.open:
            self.txn.rollback()
            self._close(committed=False)
        for hold in self.holds:
            self.coord.unhold(hold)
        for rid in list(self.tokens):
            self.coord.release(rid)
        self.coord.flush()
        self.coord.check_integrity()
        for pool in (self.coord.pages, self.coord.state_slots, self.coord.window_slots):
            assert pool.free_count == pool.size, f"{pool.name}: {pool.size - pool.free_count} never came back"
        assert self.coord.tree.num_nodes == 0 and self.coord.holds == {}


FAST = settings(
    max_examples=30, stateful_step_count=30, deadline=None, report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


def machine(name: str, spec: CacheSpec):
    cls = type(name, (TierCoordinatorMachine,), {"spec": spec})
    cls.TestCase.settings = FAST
    return cls.TestCase


TestTiersDensePage2 = machine("TiersDensePage2", CacheSpec(2, 10, 0, 0, False, None, True))
TestTiersHybridPage2 = machine("TiersHybridPage2", CacheSpec(2, 12, 4, 0, True, 2, True))

