"""The host side of device-checked index arrays (cuflash/_guard.py), without a GPU: error records
and their messages, and the raise-before-work rule of every entry point.  The GPU side:
tests/test_gpu_index_safety.py; the FlashParams mirror: tests/test_compile.py."""

import ctypes

import numpy as np
import pytest

import cuflash
from cuflash import _guard


@pytest.fixture
def fake_word(monkeypatch):
    """An error word in ordinary host memory, registered as device 0's."""
    word = ctypes.c_uint64(_guard._NONE)
    monkeypatch.setattr(_guard, "_WORDS", {0: (ctypes.addressof(word), word)})
    return word


def _record(call, arg, index):
    return call << 40 | arg << 36 | index


def test_invalid_index_error_is_a_value_error():
    assert issubclass(cuflash.InvalidIndexError, ValueError)
    assert cuflash.synchronize.__module__ == "cuflash._guard"


@pytest.mark.parametrize("arg, extents, words", [
    (0, dict(total_q=100), ["cu_seqlens_q[2]", "q's 100 rows", "from that entry on"]),
    (1, dict(total_k=7), ["cu_seqlens_k[2]", "k's 7 rows"]),
    (3, dict(kv_rows=4, table_stride=5), ["block_table[0, 2]", "0..3"]),
    (4, dict(kv_rows=3), ["cache_batch_idx[2]", "0..2"]),
    (5, dict(max_seqlen_q=50), ["sequence 2 of cu_seqlens_q", "max_seqlen_q = 50"]),
    (6, dict(max_seqlen_k=9), ["max_seqlen_k = 9"]),
    (7, dict(), ["sequence 2's new tokens", "overwrite"]),
])
def test_messages_name_function_argument_and_entry(arg, extents, words):
    call = _guard.call_code("attention_varlen", **extents)
    text = _guard.describe(_record(call, arg, 2), device=1)
    assert text.startswith("attention_varlen (an earlier call, on GPU 1)")
    for w in words:
        assert w in text, (w, text)
    assert "NaN" in text and "cuflash.synchronize()" in text


def test_cache_seqlens_named_for_kvcache_calls():
    call = _guard.call_code("attention_with_kvcache", seqlen_k=64, seqlen_new=1)
    text = _guard.describe(_record(call, 2, 1), device=0)
    assert "cache_seqlens[1]" in text and "capacity 64" in text and "1 new tokens" in text
    call = _guard.call_code("attention", seqlen_k=200)
    assert "seqlens_k[3] lies outside [0, 200]" in _guard.describe(_record(call, 2, 3), device=0)


def test_call_codes_are_shared_by_equal_descriptions():
    a = _guard.call_code("attention", seqlen_k=11, total_q=0)
    assert _guard.call_code("attention", total_q=0, seqlen_k=11) == a
    assert _guard.call_code("attention", seqlen_k=12, total_q=0) != a


def test_a_pending_record_is_raised_by_the_next_call_once(fake_word):
    q = np.ones((1, 2, 1, 8), np.float32)
    fake_word.value = _record(_guard.call_code("attention", seqlen_k=5), 2, 0)
    with pytest.raises(cuflash.InvalidIndexError, match=r"seqlens_k\[0\]"):
        cuflash.attention(q, q, q)  # raised before any work, even on the CPU path
    assert fake_word.value == _guard._NONE  # cleared
    cuflash.attention(q, q, q)


def test_every_public_function_checks_first(fake_word):
    fake_word.value = _record(_guard.call_code("attention", seqlen_k=5), 2, 0)
    for name in ("attention", "attention_backward", "attention_vjp", "attention_varlen",
                 "attention_varlen_backward", "attention_with_kvcache", "merge_states", "softmax"):
        fn = getattr(cuflash, name)
        with pytest.raises(cuflash.InvalidIndexError):
            fn()  # no arguments: the pending error comes before argument checks
        fake_word.value = _record(0, 2, 0)


def test_release_graph_memory_counts():
    _guard._KEPT.extend([object(), object()])
    assert cuflash.release_graph_memory() >= 2
    assert cuflash.release_graph_memory() == 0


def test_call_descriptions_are_bounded(monkeypatch):
    import collections

    monkeypatch.setattr(_guard, "_MAX_CALLS", 8)
    monkeypatch.setattr(_guard, "_CALLS", {})
    monkeypatch.setattr(_guard, "_CALL_NUMBERS", collections.OrderedDict())
    first = _guard.call_code("attention_varlen", total_q=10**9)
    for n in range(20):
        _guard.call_code("attention_varlen", total_q=n)
    assert len(_guard._CALLS) == 8 and len(_guard._CALL_NUMBERS) == 8
    text = _guard.describe(_record(first, 0, 3), device=0)  # dropped: still names the entry
    assert "cu_seqlens_q[3]" in text


def test_a_pending_record_stops_an_append_before_it_writes(fake_word):
    """The call after a faulty one raises its error and does no work: an append it was given is
    not made (the cache is unchanged); the call after that appends."""
    q = np.ones((1, 1, 2, 8), np.float32)
    kc, vc = np.zeros((1, 4, 2, 8), np.float32), np.zeros((1, 4, 2, 8), np.float32)
    k = np.ones((1, 1, 2, 8), np.float32)
    fake_word.value = _record(_guard.call_code("attention_with_kvcache", seqlen_k=4, seqlen_new=1), 2, 0)
    with pytest.raises(cuflash.InvalidIndexError, match=r"cache_seqlens\[0\]"):
        cuflash.attention_with_kvcache(q, kc, vc, k, k, cache_seqlens=1)
    assert not (kc.any() or vc.any())
    cuflash.attention_with_kvcache(q, kc, vc, k, k, cache_seqlens=1)
    assert kc[0, 1].all() and not kc[0, [0, 2, 3]].any()

