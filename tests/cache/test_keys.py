import hashlib
import struct

import pytest

from hkv.cache import ModelFingerprint, page_key, page_keys


def fingerprint(**change) -> ModelFingerprint:
    fields = dict(
        architecture="qwen3_5_text:cfg0", weights_digest="ab" * 32, dtype="bfloat16",
        page_size=2, tp_layout="tp1", tokenizer="cd" * 32,
    )  # fmt: skip
    fields.update(change)
    return ModelFingerprint(**fields)


def test_keys_follow_the_chain_definition():
    root = fingerprint().root_key()
    assert len(root) == 16
    h1 = hashlib.blake2b(root + struct.pack("<2I", 5, 70000), digest_size=16, person=b"hkv-page-key-v1").digest()
    h2 = hashlib.blake2b(h1 + struct.pack("<2I", 1, 2), digest_size=16, person=b"hkv-page-key-v1").digest()
    assert page_keys(root, [5, 70000, 1, 2, 9], 2) == [h1, h2]  # the partial page [9] has no key
    assert page_key(h1, [1, 2]) == h2


def test_a_key_names_the_whole_prefix():
    root = fingerprint().root_key()
    a = page_keys(root, [1, 2, 3, 4], 2)
    b = page_keys(root, [9, 9, 3, 4], 2)
    assert a[1] != b[1]  # same page tokens, different history
    assert page_keys(root, [1, 2, 3, 4, 5, 6], 2)[:2] == a


@pytest.mark.parametrize(
    "change",
    [{"architecture": "qwen3"}, {"weights_digest": "00"}, {"dtype": "float32"}, {"page_size": 4},
     {"tp_layout": "tp2"}, {"tokenizer": "ef"}],
)  # fmt: skip
def test_any_fingerprint_field_changes_every_key(change):
    tokens = [1, 2, 3, 4]
    assert page_keys(fingerprint(**change).root_key(), tokens, 2)[0] != page_keys(fingerprint().root_key(), tokens, 2)[0]


def test_token_ids_must_fit_in_32_bits():
    with pytest.raises(struct.error):
        page_keys(fingerprint().root_key(), [2**32, 0], 2)


def test_the_any_tp_key_leaves_out_n_only():
    """Pages of --tp 1 and --tp 2 keep distinct roots; the any-TP key is one per model and device."""
    from hkv.cache.keys import tp_layout

    one, two = fingerprint(tp_layout=tp_layout(1, "cpu")), fingerprint(tp_layout=tp_layout(2, "cpu"))
    assert (one.tp_layout, two.tp_layout) == ("tp1:cpu", "tp2:cpu")  # the loader's field, unchanged
    assert one.root_key() != two.root_key()
    assert one.any_tp_key() == two.any_tp_key()
    assert one.any_tp_key() not in (one.root_key(), two.root_key())
    assert fingerprint(tp_layout="tp*:cpu").root_key() == one.any_tp_key()
    assert fingerprint(tp_layout=tp_layout(1, "cuda")).any_tp_key() != one.any_tp_key()
    assert fingerprint(tp_layout=tp_layout(1, "cpu"), page_size=4).any_tp_key() != one.any_tp_key()


@pytest.mark.parametrize("layout", ["tp1", "tp:cpu", "cpu", "tpx:cpu", "tp2:"])
def test_the_any_tp_key_refuses_a_layout_it_cannot_read(layout):
    with pytest.raises(ValueError, match="is not tp<N>:<device>"):
        fingerprint(tp_layout=layout).any_tp_key()
