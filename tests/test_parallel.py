"""Ring attention and sharding (cuflash.parallel) with in-process communicators: every world size
from 1 to 8, both shard schemes, causal and not, GQA, against cuflash.attention on the whole
sequence.  Multi-GPU runs over NCCL need a machine with several GPUs (issue 25)."""

import threading

import numpy as np
import pytest

import cuflash
from cuflash import parallel
from cuflash import reference as R


def _whole(rng, total, dtype=np.float64, hq=4, hk=2, d=8):
    return tuple((rng.standard_normal((2, total, h, d)) * s).astype(dtype) for h, s in ((hq, 2.0), (hk, 1.0), (hk, 1.0)))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("scheme", parallel.SCHEMES)
@pytest.mark.parametrize("causal", [False, True])
def test_ring_equals_whole_sequence_attention(rng, world, scheme, causal):
    total = 2 * world * 5  # 5 positions per zig-zag piece
    q, k, v = _whole(rng, total)
    dout = rng.standard_normal(q.shape)

    def step(comm):
        shards = [parallel.shard(x, comm.rank, world, scheme=scheme) for x in (q, k, v, dout)]
        out, lse = parallel.ring_attention(*shards[:3], comm, causal=causal, scheme=scheme, return_lse=True)
        grads = parallel.ring_attention_backward(shards[3], *shards[:3], out, lse, comm, causal=causal, scheme=scheme)
        return out, lse, grads

    results = parallel.run_local(world, step)
    out = parallel.unshard([r[0] for r in results], scheme=scheme)
    lse = parallel.unshard([r[1] for r in results], scheme=scheme, axis=2)
    ref, ref_lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    assert np.allclose(out, ref, atol=1e-12) and np.allclose(lse, ref_lse, atol=1e-12)
    refs = cuflash.attention_backward(dout, q, k, v, ref, ref_lse, causal=causal)
    for i, r in enumerate(refs):
        g = parallel.unshard([res[2][i] for res in results], scheme=scheme)
        assert np.allclose(g, r, atol=1e-11), i


def test_ring_float16_meets_the_exactness_rule(rng):
    world, scheme = 4, "zigzag"
    q, k, v = _whole(rng, 2 * world * 16, np.float16, hq=2, hk=2, d=16)

    def step(comm):
        return parallel.ring_attention(*(parallel.shard(x, comm.rank, world) for x in (q, k, v)), comm, causal=True)

    out = parallel.unshard(parallel.run_local(world, step), scheme=scheme)
    R.assert_exact(out, R.attention_ref(q, k, v, causal=True)[0], R.naive_attention(q, k, v, causal=True), "out")


def test_shard_unshard_roundtrip_and_errors(rng):
    x = rng.standard_normal((1, 24, 2, 4))
    for scheme in parallel.SCHEMES:
        for world in (1, 2, 3, 4, 6):
            assert np.array_equal(parallel.unshard([parallel.shard(x, r, world, scheme=scheme) for r in range(world)],
                                                   scheme=scheme), x)
    assert np.array_equal(parallel.shard(x, 1, 3)[:, :4], x[:, 4:8])  # zig-zag: pieces 1 and 4 of 6
    assert np.array_equal(parallel.shard(x, 1, 3)[:, 4:], x[:, 16:20])
    with pytest.raises(ValueError, match="does not cut into 10 equal pieces"):
        parallel.shard(x, 0, 5)
    with pytest.raises(ValueError, match="scheme"):
        parallel.shard(x, 0, 2, scheme="striped")
    with pytest.raises(ValueError, match="rank must lie"):
        parallel.shard(x, 2, 2)


def test_ranks_with_different_options_or_silent_peers(rng):
    q, k, v = _whole(rng, 8)

    def step(comm):
        return parallel.ring_attention(q[:, :4], k[:, :4], v[:, :4], comm, causal=comm.rank == 0)

    with pytest.raises(ValueError, match="called with other shapes or options"):
        parallel.run_local(2, step)

    def silent(comm):
        if comm.rank == 1:
            return None  # never joins the ring
        return parallel.ring_attention(q[:, :4], k[:, :4], v[:, :4], comm)

    with pytest.raises(parallel.CollectiveTimeout, match="rank 0: nothing from rank 1 within 0.3 s"):
        parallel.run_local(2, silent, timeout=0.3)
    with pytest.raises(TypeError, match="comm must be a cuflash.parallel communicator"):
        parallel.ring_attention(q, k, v, object())


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_cache_decode_equals_one_cache(rng, world):
    """Each rank holds a piece of every sequence's cache (unequal pieces); appends go to the owner."""
    caps = [7 * (r + 1) for r in range(world)]
    total = sum(caps)
    batch, hk = 3, 2
    kc, vc = (rng.standard_normal((batch, total, hk, 8)) for _ in range(2))
    lengths = np.array([0, total // 2, total - 2])
    q = rng.standard_normal((batch, 1, 4, 8))
    kn, vn = rng.standard_normal((batch, 2, hk, 8)), rng.standard_normal((batch, 2, hk, 8))
    edges = np.cumsum([0] + caps)

    def step(comm):
        r = comm.rank
        k_local, v_local = kc[:, edges[r]:edges[r + 1]].copy(), vc[:, edges[r]:edges[r + 1]].copy()
        out, lse = parallel.decode_with_sharded_cache(q, k_local, v_local, lengths, comm, kn, vn, return_lse=True)
        return out, lse, k_local

    results = parallel.run_local(world, step)
    whole_k, whole_v = kc.copy(), vc.copy()
    ref, ref_lse = cuflash.attention_with_kvcache(q, whole_k, whole_v, kn, vn, cache_seqlens=lengths, return_lse=True)
    for out, lse, _ in results:
        assert np.allclose(out, ref, atol=1e-12) and np.allclose(lse, ref_lse, atol=1e-12)
    assert np.array_equal(np.concatenate([r[2] for r in results], axis=1), whole_k)  # appended by the owners
    with pytest.raises(ValueError, match="exceed the whole cache capacity"):
        parallel.run_local(world, lambda comm: parallel.decode_with_sharded_cache(
            q, kc[:, edges[comm.rank]:edges[comm.rank + 1]].copy(), vc[:, edges[comm.rank]:edges[comm.rank + 1]].copy(),
            np.array([total - 1] * batch), comm, kn, vn))
    for bad in (total + 1, -1):  # without new tokens too: the single-cache call's rule, not a clipped answer
        with pytest.raises(ValueError, match=rf"cache_seqlens values must lie in \[0, {total}\]"):
            parallel.run_local(world, lambda comm: parallel.decode_with_sharded_cache(
                q, kc[:, edges[comm.rank]:edges[comm.rank + 1]], vc[:, edges[comm.rank]:edges[comm.rank + 1]],
                np.array([bad] * batch), comm))


def test_shard_and_unshard_name_bad_arguments():
    x = np.zeros((1, 8, 2, 4))
    cases = [
        (lambda: parallel.shard(x, 0, 2, axis=5), ValueError, "axis 5 is out of range for x of shape"),
        (lambda: parallel.shard(x, 0, 2, axis=1.0), TypeError, "axis must be an int"),
        (lambda: parallel.shard(x, 0.0, 2), TypeError, "rank must be an int"),
        (lambda: parallel.shard(x, 0, 0), ValueError, "world must be >= 1"),
        (lambda: parallel.shard(x.tolist(), 0, 2), TypeError, "x must be a NumPy or CuPy array"),
        (lambda: parallel.unshard([]), ValueError, "shards is empty"),
        (lambda: parallel.unshard(None), TypeError, "shards must be a list or tuple of arrays"),
        (lambda: parallel.unshard([x, x], axis=7), ValueError, "axis 7 is out of range for shards"),
        (lambda: parallel.unshard([x, None]), ValueError, r"shards\[1\] must be an array"),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind, match=message):
            call()
    assert np.array_equal(parallel.unshard([parallel.shard(x, r, 2, axis=-3) for r in range(2)], axis=-3), x)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("cuflash")._arrays.gpu_available(), reason="needs a CUDA GPU (CuPy arrays)")
@pytest.mark.parametrize("causal", [False, True])
def test_ring_on_one_gpu_with_a_stream_per_rank(rng, causal):
    """The in-process ring over CuPy arrays, each rank on its own stream; bf16, against the
    whole-sequence GPU call with the exactness rule."""
    import ml_dtypes

    from cuflash import _arrays

    cp = _arrays.cupy_module()
    world = 4
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in _whole(rng, 2 * world * 64, np.float32, hq=8, hk=2, d=64))

    def step(comm):
        with cp.cuda.Stream(non_blocking=True) as stream:
            shards = [cp.asarray(parallel.shard(x, comm.rank, world)) for x in (q, k, v)]
            out = parallel.ring_attention(*shards, comm, causal=causal)
            stream.synchronize()
            return out.get()

    out = parallel.unshard(parallel.run_local(world, step))
    R.assert_exact(out, R.attention_ref(q, k, v, causal=causal)[0], R.naive_attention(q, k, v, causal=causal), "out")


def test_run_local_and_unshard_bad_arguments(rng):
    for world in (0, parallel.MAX_LOCAL_WORLD + 1, 10**12):  # (one thread per rank: no billion threads)
        with pytest.raises(ValueError, match=r"world must be an integer in \[1, 256\]"):
            parallel.run_local(world, lambda comm: None)
    with pytest.raises(ValueError, match="shards must all have 4 positions"):
        parallel.unshard([np.zeros((1, 4, 1, 1)), np.zeros((1, 6, 1, 1))])
    q, k, v = _whole(rng, 6)
    with pytest.raises(ValueError, match="zig-zag shards hold two equal pieces"):
        parallel.run_local(1, lambda comm: parallel.ring_attention(q[:, :3], k[:, :3], v[:, :3], comm))
    with pytest.raises(ValueError, match="same local length"):
        parallel.run_local(1, lambda comm: parallel.ring_attention(q[:, :4], k[:, :2], v[:, :2], comm))
    with pytest.raises(ValueError, match="k and v must be given together"):
        parallel.run_local(1, lambda comm: parallel.decode_with_sharded_cache(
            q[:, :1], k, v, np.array([2, 2]), comm, k[:, :1]))  # k without v


def test_ring_transfers_run_while_the_step_attends(rng, monkeypatch):
    """Each step's transfer starts before that step's attention and is waited for after it, in
    the forward (the K/V shard) and the backward (K/V, and the dK/dV sums one step behind)."""
    log = []

    class Logged:
        def __init__(self, comm):
            self.comm, self.rank, self.size = comm, comm.rank, comm.size

        def allgather(self, obj):
            return self.comm.allgather(obj)

        def sendrecv(self, arrays, dest, source):
            return self.start_sendrecv(arrays, dest, source).wait()

        def start_sendrecv(self, arrays, dest, source):
            if self.rank == 0:
                log.append("start")
            pending = self.comm.start_sendrecv(arrays, dest, source)

            class Wait:
                def wait(_):
                    if self.rank == 0:
                        log.append("wait")
                    return pending.wait()
            return Wait()

    for name in ("attention", "_block_backward"):
        real = getattr(parallel, name)

        def logged(*a, _real=real, _name=name, **kw):
            if threading.current_thread().name == "rank0":
                log.append(_name)
            return _real(*a, **kw)
        monkeypatch.setattr(parallel, name, logged)
    q, k, v = (rng.standard_normal((1, 12, 2, 8)) for _ in range(3))

    def step(comm):
        threading.current_thread().name = f"rank{comm.rank}"
        comm = Logged(comm)
        shards = [parallel.shard(x, comm.rank, 3, scheme="contiguous") for x in (q, k, v)]
        out, lse = parallel.ring_attention(*shards, comm, scheme="contiguous", return_lse=True)
        log.append("--") if comm.rank == 0 else None
        return parallel.ring_attention_backward(out, *shards, out, lse, comm, scheme="contiguous")

    parallel.run_local(3, step)
    forward, backward = " ".join(log).split(" -- ")
    assert forward == "start attention wait start attention wait attention"
    assert backward == ("start _block_backward start wait "        # step 0: K/V out; sums out
                        "start _block_backward wait start wait "   # step 1: K/V out; sums in, out
                        "_block_backward wait start wait")         # step 2: sums in, out; own sums home


def test_ring_scaling_script_dry_run(tmp_path):
    """scripts/ring_scaling.py (issue 25's multi-GPU measurement) runs its whole schedule on
    threads over NumPy: exactness within the rule, the weak/strong/transfer table written."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "ring_scaling.py"
    spec = importlib.util.spec_from_file_location("ring_scaling", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "ring.md"
    rows = script.main(["--dry-run", "--gpus", "3", "--markdown", str(out)])
    assert len(rows) == 3 and all(ratio <= 1 for ratio in rows[0]["exact"].values())
    text = out.read_text()
    assert "| weak |" in text and "| strong |" in text and "K/V transfers alone (2 exchanges" in text


def test_ring_with_a_communicator_that_has_only_sendrecv(rng):
    """The interface _check_ring asks for (rank, size, sendrecv, allgather) still runs the ring,
    exchanging after each step instead of during it."""
    q, k, v = (rng.standard_normal((1, 16, 2, 8)) for _ in range(3))
    dout = rng.standard_normal(q.shape)

    class Plain:
        def __init__(self, comm):
            self.rank, self.size, self.sendrecv, self.allgather = comm.rank, comm.size, comm.sendrecv, comm.allgather

    def step(comm):
        comm = Plain(comm)
        qs, ks, vs, ds = (parallel.shard(x, comm.rank, comm.size) for x in (q, k, v, dout))
        out, lse = parallel.ring_attention(qs, ks, vs, comm, causal=True, return_lse=True)
        return (out, *parallel.ring_attention_backward(ds, qs, ks, vs, out, lse, comm, causal=True))

    results = parallel.run_local(2, step)
    got = [parallel.unshard([r[i] for r in results]) for i in range(4)]
    ref_out = cuflash.attention(q, k, v, causal=True)
    refs = (ref_out, *cuflash.attention_backward(dout, q, k, v, *cuflash.attention(q, k, v, causal=True, return_lse=True),
                                                 causal=True))
    for g, r in zip(got, refs):
        assert np.allclose(g, r, atol=1e-12)


def test_hostile_arguments_refused_before_any_write(rng):
    """From a hostile-input review (session 36): the ring's and the sharded cache's arguments get
    the checks cuflash.attention, attention_backward and attention_with_kvcache give them, named,
    before a token is written (a refused call leaves every cache as it was); timeouts that would
    wait forever are refused."""
    q, k, v = _whole(rng, 8, np.float32)
    call = lambda fn: parallel.run_local(1, fn)  # noqa: E731

    def ring(**kw):
        args = dict(q=q, k=k, v=v, causal=False)
        args.update(kw)
        return lambda comm: parallel.ring_attention(args["q"], args["k"], args["v"], comm, causal=args["causal"],
                                                    scheme="contiguous", **{n: kw[n] for n in kw if n == "return_lse"})

    for causal in ("False", 1, None, np.array([0, 1])):
        with pytest.raises(TypeError, match="causal must be a bool"):
            call(ring(causal=causal))
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        call(ring(return_lse="False"))
    with pytest.raises(ValueError, match="v must have k's seqlen and heads"):
        call(ring(v=_whole(rng, 12, np.float32)[2]))
    out, lse = call(lambda comm: parallel.ring_attention(q, k, v, comm, scheme="contiguous", return_lse=True))[0]
    backward = dict(dout=out, out=out, lse=lse)
    for name, bad, kind in (("lse", lse[0], ValueError), ("lse", lse.astype(np.float16), TypeError),
                            ("out", out[:, :4], ValueError), ("dout", out[..., :4], ValueError),
                            ("out", out.astype(np.float16), TypeError)):
        args = dict(backward, **{name: bad})
        with pytest.raises(kind, match=name):
            call(lambda comm: parallel.ring_attention_backward(args["dout"], q, k, v, args["out"], args["lse"], comm,
                                                               scheme="contiguous"))
    # the sharded cache: each bad call leaves the caches unchanged
    q1 = q[:, :1]
    kc, vc = (rng.standard_normal((2, 8, 2, 8)).astype(np.float32) for _ in range(2))
    kn, vn = (rng.standard_normal((2, 1, 2, 8)).astype(np.float32) for _ in range(2))
    before = (kc.copy(), vc.copy())
    bad_calls = [
        (dict(v=kc[:, 3:4]), ValueError, "v shares memory with the cache"),
        (dict(v_cache=kc), ValueError, "k_cache and v_cache share memory"),
        (dict(k_cache=kc.tolist()), TypeError, "k_cache"),
        (dict(k=kn.astype(np.float16)), TypeError, "dtype"),
        (dict(v=vn[..., :4]), ValueError, "k and v must have shapes"),
        (dict(k=kn[:1], v=vn[:1]), ValueError, "k and v must have shapes"),
        (dict(k_cache=kc[:1], v_cache=vc[:1]), ValueError, "k_cache has 1 sequences; q has 2"),
        (dict(k_cache=kc[0], v_cache=vc[0]), ValueError, "k_cache"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(return_lse="no"), TypeError, "return_lse must be a bool"),
    ]
    for change, kind, message in bad_calls:
        args = dict(q=q1, k_cache=kc, v_cache=vc, k=kn, v=vn, softcap=0.0, return_lse=False)
        args.update(change)
        with pytest.raises(kind, match=message):
            call(lambda comm: parallel.decode_with_sharded_cache(
                args["q"], args["k_cache"], args["v_cache"], np.array([3, 4]), comm, args["k"], args["v"],
                softcap=args["softcap"], return_lse=args["return_lse"]))
        assert np.array_equal(kc, before[0]) and np.array_equal(vc, before[1]), change
    ro = kc.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        call(lambda comm: parallel.decode_with_sharded_cache(q1, ro, vc, np.array([3, 4]), comm, kn, vn))

    def disagree(comm):  # the ranks' lengths differ
        return parallel.decode_with_sharded_cache(q1, kc.copy(), vc.copy(), np.array([3, 3 + comm.rank]), comm)

    with pytest.raises(ValueError, match="called with other shapes, lengths or options"):
        parallel.run_local(2, disagree)
    for timeout, kind in ((float("nan"), ValueError), (0, ValueError), (-1, ValueError), (None, TypeError),
                          ("x", TypeError), (float("inf"), ValueError)):
        with pytest.raises(kind, match="timeout"):
            parallel.run_local(2, lambda comm: None, timeout=timeout)
    with pytest.raises(TypeError, match="world must be an integer"):
        parallel.run_local(True, lambda comm: None)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("cuflash")._arrays.gpu_available(), reason="needs a CUDA GPU (CuPy arrays)")
def test_nccl_comm_allgather_returns_the_objects(monkeypatch):
    """NcclComm.allgather of Python values (the checks' option tuples and capacities) gives back the
    values, as the in-process communicator does (it gave their reprs: every NCCL ring call would have
    seen "other options" on every rank).  One rank, over a stand-in for NCCL's all-gather (a copy;
    CuPy without the NCCL library lacks even its dtype constants)."""
    from cupy.cuda import nccl

    from cuflash import _arrays

    cp = _arrays.cupy_module()
    monkeypatch.setattr(nccl, "NCCL_UINT8", getattr(nccl, "NCCL_UINT8", 0), raising=False)

    class OneRank:
        def allGather(self, send, recv, count, dtype, stream):  # noqa: N802 (NCCL's name)
            cp.cuda.runtime.memcpyAsync(recv, send, count, cp.cuda.runtime.memcpyDeviceToDevice, stream)

    comm = parallel.NcclComm(OneRank(), 0, 1)
    for obj in (8, "a 'quoted' string", (8, "(1, 2)", None, 0.5)):
        assert comm.allgather(obj) == [obj]
