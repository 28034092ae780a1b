"""RadixTree on tiny inputs: exact pages, splits, limits and eviction order."""

from hypothesis import given
from hypothesis import strategies as st

from hkv.cache import RadixTree
from hkv.cache.radix import _common_len


def insert(tree: RadixTree, tokens, pages):
    return tree.insert(tuple(tokens), list(pages))


def evict_all(tree: RadixTree) -> list[tuple[int, ...]]:
    order = []
    while (evicted := tree.evict_leaf()) is not None:
        order.append(evicted.node.pages)
    return order


def test_one_insert_is_one_compressed_edge():
    tree = RadixTree(page_size=1)
    done = insert(tree, [5, 6, 7, 8], [10, 11, 12, 13])
    assert done.adopted_from == 0 and done.leaf is done.node and done.node.depth == 4
    assert tree.num_nodes == 1 and tree.cached_pages == 4 and tree.evictable_pages == 4
    found = tree.match((5, 6, 7, 8, 9), 5)
    assert found.length == 4 and found.node is done.node
    assert tree.path_pages(found.node, found.length) == [10, 11, 12, 13]


def test_divergence_splits_the_edge_and_adopts_only_the_new_suffix():
    tree = RadixTree(page_size=1)
    first = insert(tree, [1, 2, 3, 4], [10, 11, 12, 13]).node
    done = insert(tree, [1, 2, 5, 6], [20, 21, 22, 23])
    assert done.adopted_from == 2 and done.node.pages == (22, 23)
    assert tree.num_nodes == 3 and tree.cached_pages == 6
    upper = first.parent
    assert upper.pages == (10, 11) and upper.depth == 2 and first.pages == (12, 13)
    found = tree.match((1, 2, 5, 9), 4)
    assert found.length == 3 and found.node is done.node
    assert tree.path_pages(found.node, found.length) == [10, 11, 22]


def test_matches_are_page_aligned_and_stop_at_the_limit():
    tree = RadixTree(page_size=2)
    leaf = insert(tree, [1, 2, 3, 4, 5, 6], [7, 8, 9]).node
    # the third token differs inside page 1: only page 0 matches
    assert tree.match((1, 2, 3, 9, 5, 6), 6).length == 2
    # a limit inside an edge: the match ends inside the leaf, still page-aligned
    found = tree.match((1, 2, 3, 4, 5, 6), 5)
    assert found.length == 4 and found.node is leaf
    assert tree.path_pages(leaf, 4) == [7, 8]
    assert tree.match((1, 2, 3, 4, 5, 6), 6).length == 6
    assert tree.match((2, 2), 2).length == 0


def test_inserting_a_prefix_of_an_edge_splits_it_there():
    tree = RadixTree(page_size=2)
    long = insert(tree, [1, 2, 3, 4, 5, 6], [7, 8, 9]).node
    done = insert(tree, [1, 2, 3, 4], [30, 31])
    assert done.leaf is None and done.adopted_from == 2 and done.node.depth == 4
    assert done.node.pages == (7, 8) and long.parent is done.node and long.pages == (9,)


def test_insert_from_a_start_node_matches_insert_from_the_root():
    for start in (False, True):
        tree = RadixTree(page_size=1)
        base = insert(tree, [1, 2, 3], [0, 1, 2]).node
        done = tree.insert((1, 2, 3, 4, 5), [0, 1, 2, 3, 4], base if start else None)
        assert done.adopted_from == 3 and done.node.pages == (3, 4) and done.node.parent is base


def test_leaves_are_evicted_least_recently_used_first():
    tree = RadixTree(page_size=1)
    a = insert(tree, [1, 1], [0, 1]).node
    insert(tree, [2, 2], [2, 3])
    insert(tree, [3, 3], [4, 5])
    tree.touch(a)
    assert evict_all(tree) == [(2, 3), (4, 5), (0, 1)]
    assert tree.num_nodes == 0 and tree.evictable_pages == 0 and tree.cached_pages == 0


def test_a_parent_left_childless_is_ranked_by_its_own_last_access():
    tree = RadixTree(page_size=1)
    insert(tree, [1, 2, 3], [0, 1, 2])
    insert(tree, [1, 2, 4], [0, 1, 3])  # splits: [1,2] -> {[3], [4]}
    insert(tree, [9], [4])  # newer than anything under [1, 2]
    # [3] and [4] go first (oldest), then their parent [1, 2], which is older than [9]
    assert evict_all(tree) == [(2,), (3,), (0, 1), (4,)]


def test_locked_paths_are_never_evicted():
    tree = RadixTree(page_size=1)
    a = insert(tree, [1, 2], [0, 1]).node
    b = insert(tree, [1, 3], [0, 2]).node
    tree.lock(a)
    assert tree.evictable_pages == 1  # only b's page; a and the shared [1] are pinned
    assert tree.evict_leaf() == (b, None)
    assert tree.evict_leaf() is None
    tree.unlock(a)
    assert evict_all(tree) == [(1,), (0,)]


def test_reattach_undoes_an_eviction_exactly():
    tree = RadixTree(page_size=1)
    insert(tree, [1, 2], [0, 1])
    insert(tree, [1, 3], [0, 2])
    before = tree.dump()
    node, ckpt = tree.evict_leaf()
    assert tree.dump() != before and ckpt is None
    tree.reattach(node, ckpt)
    assert tree.dump() == before
    assert tree.evict_leaf().node is node  # it keeps its place in the eviction order


def test_hybrid_pages_without_a_checkpoint_go_first():
    tree = RadixTree(page_size=1)
    old = insert(tree, [1, 1], [0, 1]).node
    tree.attach_checkpoint(old, slot=0, window=None)
    insert(tree, [2, 2], [2, 3])  # newer, but useless to a hybrid model
    assert [e.node.pages for e in (tree.evict_leaf(), tree.evict_leaf())] == [(2, 3), (0, 1)]


def test_a_chain_is_shortened_from_its_deep_end_pages_beyond_its_deepest_checkpoint_first():
    """The device follows the lower tiers' rule (DESIGN section 4): chain B is older (one checkpoint at
    its end); chain A has checkpoints after 2 and 4 tokens and pages up to 6, beyond its deepest one."""
    tree = RadixTree(page_size=1)
    b = insert(tree, [9, 9], [10, 11]).node
    tree.attach_checkpoint(b, slot=0, window=None)
    a2 = insert(tree, [1, 2], [0, 1]).node
    tree.attach_checkpoint(a2, slot=1, window=None)
    a4 = insert(tree, [1, 2, 3, 4], [0, 1, 2, 3]).node
    tree.attach_checkpoint(a4, slot=2, window=None)
    insert(tree, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])
    assert (tree.cached_pages, tree.pages_under_checkpoints()) == (8, 6)  # A's tail serves no hybrid hit
    # the newest pages go first (useless), then the least recently used chain, then A from its deep end
    assert evict_all(tree) == [(4, 5), (10, 11), (2, 3), (0, 1)]
    assert tree.num_checkpoints == 0 and tree.pages_under_checkpoints() == 0


def test_match_reports_the_deepest_checkpoint_within_the_limit():
    tree = RadixTree(page_size=2)
    mid = insert(tree, [1, 2, 3, 4], [0, 1]).node
    end = insert(tree, [1, 2, 3, 4, 5, 6], [0, 1, 2]).node
    tree.attach_checkpoint(mid, slot=3, window=None)
    tree.attach_checkpoint(end, slot=4, window=None)
    assert tree.match((1, 2, 3, 4, 5, 6, 7), 7).checkpoint_node is end
    assert tree.match((1, 2, 3, 4, 5, 6), 5).checkpoint_node is mid
    assert tree.match((1, 2, 3, 9), 4).checkpoint_node is None


def test_checkpoints_are_evicted_lru_and_held_ones_are_kept():
    tree = RadixTree(page_size=1)
    nodes = [insert(tree, [k], [k]).node for k in range(3)]
    ckpts = [tree.attach_checkpoint(n, slot=10 + i, window=20 + i if i != 1 else None) for i, n in enumerate(nodes)]
    tree.touch_checkpoint(ckpts[0])
    tree.lock(nodes[1])
    tree.hold(ckpts[1])
    assert (tree.evictable_checkpoints, tree.evictable_windows) == (2, 2)
    assert tree.evict_checkpoint(with_window=False) is ckpts[2]
    assert tree.evict_checkpoint(with_window=False) is ckpts[0]
    assert tree.evict_checkpoint(with_window=False) is None
    tree.unhold(ckpts[1])
    assert tree.evict_checkpoint(with_window=True) is None  # the only one left has no window
    assert tree.evict_checkpoint(with_window=False) is ckpts[1]
    assert tree.num_checkpoints == 0 and nodes[1].checkpoint is None


def test_a_hit_checkpoint_outlives_a_stream_of_never_hit_ones_for_its_horizon():
    """With a horizon of H ticks (checkpoints stored and hits), a checkpoint never hit since it was
    stored ranks as if used H ticks earlier (RadixTree.checkpoint_rank); plain LRU without one."""
    tree = RadixTree(page_size=1, checkpoint_horizon=10)
    shared = tree.attach_checkpoint(insert(tree, [1], [1]).node, slot=1, window=None)  # tick 1
    tree.touch_checkpoint(shared, hit=True)  # tick 2
    assert (shared.hit, shared.last_event, tree.checkpoint_rank(shared)[0]) == (True, 2, 2)
    once = [tree.attach_checkpoint(insert(tree, [k], [k]).node, slot=k, window=None) for k in (2, 3, 4)]  # 3-5
    tree.touch_checkpoint(once[0])  # a publish touch: no tick, its last use is now (tick 5)
    assert [tree.checkpoint_rank(c)[0] for c in once] == [-5, -6, -5] and not once[0].hit
    # plain LRU would give up the shared prefix first (used longest ago); here the never-hit ones go
    assert [tree.evict_checkpoint(with_window=False) for _ in range(3)] == [once[1], once[2], once[0]]
    # a rolling checkpoint's move is no store: no tick
    moved = tree.attach_checkpoint(insert(tree, [5], [5]).node, slot=5, window=None, moved=True)
    assert moved.last_event == 5 and tree.evict_checkpoint(with_window=False) is moved
    # past the horizon: stored ones more than H ticks after the shared prefix's last hit go after it
    later = [tree.attach_checkpoint(insert(tree, [k], [k]).node, slot=k, window=None) for k in range(10, 18)]
    assert [c.last_event for c in later] == list(range(6, 14))
    evicted = [tree.evict_checkpoint(with_window=False) for _ in range(10)]
    assert evicted == later[:6] + [shared] + later[6:] + [None]  # rank 2 ties at tick 12: the older use first
    plain = RadixTree(page_size=1)  # horizon 0: plain LRU, a publish touch counts as much as a hit
    a, b = (plain.attach_checkpoint(insert(plain, [k], [k]).node, slot=k, window=None) for k in (1, 2))
    plain.touch_checkpoint(a)
    assert plain.evict_checkpoint(with_window=False) is b and plain.evict_checkpoint(with_window=False) is a


def test_evicting_a_leaf_takes_its_checkpoint_with_it():
    tree = RadixTree(page_size=1)
    leaf = insert(tree, [4], [0]).node
    ckpt = tree.attach_checkpoint(leaf, slot=2, window=None)
    assert tree.evict_leaf() == (leaf, ckpt)
    # the leaf lets go of it (no cycle outside the tree); the checkpoint still names its node
    assert leaf.checkpoint is None and ckpt.node is leaf
    assert tree.num_checkpoints == 0 and tree.evictable_checkpoints == 0
    assert tree.evict_checkpoint(with_window=False) is None
    tree.reattach(leaf, ckpt)
    assert leaf.checkpoint is ckpt
    assert tree.num_checkpoints == 1 and tree.evict_checkpoint(with_window=False) is ckpt


@given(st.lists(st.integers(0, 2), min_size=1, max_size=20), st.lists(st.integers(0, 2), max_size=20), st.data())
def test_common_len_is_the_naive_common_prefix(key, tokens, data):
    pos = data.draw(st.integers(0, len(tokens)))
    m = data.draw(st.integers(0, min(len(key), len(tokens) - pos)))
    naive = next((i for i in range(m) if key[i] != tokens[pos + i]), m)
    assert _common_len(tuple(key), tuple(tokens), pos, m) == naive
