"""The C++ CPU kernels: paged attention (``cadence/backends/csrc/paged_attention.cpp``) against naive
fp32 attention, through the ``sdpa`` backend that calls it, and the backend's torch-op path it
replaces; the layer ops and the sampler's argmax against the torch ops they replace. (The bf16 GEMM
has its own tests: test_packed_weights.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cadence.backends import cpu_kernels, sdpa_backend
from cadence.backends.cpu_kernels import ATTENTION_PATHS, cpu_ops
from cadence.backends.sdpa_backend import SDPABackend
from cadence.backends.testing import PagedBatch, naive_reference, random_paged_batch, run_backend

CPU = torch.device("cpu")
# Paged attention's bf16 paths (the attention_path fixture): prefill tiles over packed keys on the tile unit
# or by VDPBF16PS, or in fp32.
PATHS = list(ATTENTION_PATHS)
# Where the CPU has AVX-512 or AVX2 the kernels must build, so a broken build fails here rather than skipping.
pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX2"),
                                reason="cadence's CPU kernels need AVX-512 or AVX2")


@pytest.fixture(autouse=True)
def _kernel_on_prefills(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel on prefill rows too, wherever it is built (over SIMDe the backend sends steps with
    prefills to torch's SDPA instead, but the kernel's tiles must stay right there)."""
    monkeypatch.setattr(sdpa_backend, "attention_takes_prefills", lambda: True)


def _naive(batch: PagedBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """fp32 causal attention of every query over its request's context, read slot by slot from the
    canonical caches ``[blocks, block_size, Hkv, D]`` after the step's writes."""
    layout, scale = batch.layout, batch.head_dim ** -0.5
    block_size, group = k_cache.shape[1], batch.num_heads // batch.num_kv_heads
    outs = []
    starts = layout.query_start_loc.tolist()
    for i, seq_len in enumerate(layout.seq_lens.tolist()):
        positions = torch.arange(seq_len)
        slots = layout.block_table[i].long()[positions // block_size] * block_size + positions % block_size
        keys = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1).transpose(0, 1)
        values = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1).transpose(0, 1)
        q = batch.q[starts[i]:starts[i + 1]].float().transpose(0, 1)
        query_pos = torch.arange(seq_len - q.shape[1], seq_len)[:, None]
        scores = (q @ keys.transpose(1, 2) * scale).masked_fill(positions[None, :] > query_pos, float("-inf"))
        outs.append((F.softmax(scores, -1) @ values).transpose(0, 1))
    return torch.cat(outs)


def _check(batch: PagedBatch, atol: float) -> torch.Tensor:
    backend = SDPABackend(batch.num_heads, batch.num_kv_heads, batch.head_dim, batch.head_dim ** -0.5)
    out, k_cache, v_cache = run_backend(backend, batch)
    torch.testing.assert_close(out.float(), _naive(batch, k_cache, v_cache), atol=atol, rtol=0)
    return out


def test_kernel_builds_where_the_cpu_has_avx512() -> None:
    assert cpu_ops() is not None


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# Query heads per KV head 1-4 at head_dim 64 and 1-2 at 128 take the queries and sums held in registers
# (paged_attention.cpp: attend_decode<G, C>), the rest read both through memory.
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [
    (9, 3, 64), (4, 4, 16), (8, 2, 128), (3, 3, 64), (4, 2, 64), (8, 2, 64), (2, 2, 128), (4, 2, 128), (10, 2, 64)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_decodes_match_naive_attention(dtype: torch.dtype, atol: float, heads: int, kv_heads: int,
                                       head_dim: int, block_size: int) -> None:
    """On whichever path the CPU takes; test_bf16_decodes_match_naive_attention runs both bf16 paths."""
    # contexts that end inside, at the end of, and just past a block and a 16-wide vector
    requests = [(0, 1), (14, 1), (15, 1), (16, 1), (31, 1), (99, 1)]
    _check(random_paged_batch(requests, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim), atol)


@pytest.mark.parametrize("attention_path", PATHS, indirect=True)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 256), (34, 2, 32)])
@pytest.mark.parametrize("block_size", [16, 32, 5])
def test_bf16_decodes_match_naive_attention(attention_path: str, heads: int, kv_heads: int, head_dim: int,
                                            block_size: int) -> None:
    """bf16 decodes on the tile unit (blocks of a multiple of 16 keys, at most 16 query heads a KV head;
    the others on the fp32 path), by VDPBF16PS without tiles (decode_dot.cpp: 1-4 query heads a KV head at
    head_dim 64, 1-2 at 128; the others on the fp32 path) and in fp32."""
    requests = [(0, 1), (14, 1), (15, 1), (16, 1), (31, 1), (32, 1), (47, 1), (99, 1), (300, 1)]
    _check(random_paged_batch(requests, heads, kv_heads, head_dim, block_size, torch.bfloat16, seed=head_dim), 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "block_size"), [(32, 16), (128, 5)])
def test_mixed_batch_matches_naive_attention(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    """Decodes between fresh prefills and prefills over cached prefixes, some longer than one
    16-row tile, with keys chunked at block edges."""
    requests = [(40, 1), (0, 9), (7, 1), (20, 6), (3, 1), (16, 16), (0, 37), (5, 17)]
    _check(random_paged_batch(requests, 6, 2, head_dim, block_size, dtype, seed=1),
           atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("threads", [2, 3, 7])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_any_split_between_threads_gives_the_same_bits(threads: int, dtype: torch.dtype, atol: float) -> None:
    """The threads' shares follow the tasks' keys (one long context beside short ones, prefill tiles),
    and each task is one thread's: every split computes the same bits, and matches naive attention (in
    bf16, decodes and tiles take the tile unit where the CPU has it)."""
    requests = [(900, 1), (12, 1), (3, 1), (0, 40), (200, 1), (30, 1), (0, 1), (64, 17), (5, 1)]
    batch = random_paged_batch(requests, 9, 3, 64, 16, dtype, seed=3)
    default = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _check(batch, atol=atol)
        torch.set_num_threads(threads)
        shared = _check(batch, atol=atol)
    finally:
        torch.set_num_threads(default)
    assert torch.equal(alone, shared)


# Decodes past kDecodePartKeys (512) keys: in parts (one of 513 keys: 512 and 1; exactly two; three with a
# short last one), beside a short decode and a prefill.
LONG_DECODES = [(512, 1), (1023, 1), (40, 1), (1100, 1), (0, 20)]


@pytest.mark.parametrize("attention_path", PATHS, indirect=True)
@pytest.mark.parametrize(("window", "cap"), [(None, None), (None, 0.5), (700, None)])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (8, 2, 128, 5)])
def test_long_decodes_read_in_parts_match_naive_attention(attention_path: str, window: int | None, cap: float | None,
                                                         heads: int, kv_heads: int, head_dim: int,
                                                         block_size: int) -> None:
    """A decode's keys past 512 are attended in parts of 512, each a task of its own, and merged by their
    maxima and sums: the definition's output on every path, with a soft cap, and with a window that
    leaves more than 512 keys to read (from key 400 of 1,101)."""
    batch = random_paged_batch(LONG_DECODES, heads, kv_heads, head_dim, block_size, torch.bfloat16, seed=block_size)
    backend = SDPABackend(heads, kv_heads, head_dim, head_dim ** -0.5, sliding_window=window, logits_soft_cap=cap)
    out, _, _ = run_backend(backend, batch)
    expected = naive_reference(batch, head_dim ** -0.5, window, cap)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=0)


@pytest.mark.parametrize("attention_path", PATHS, indirect=True)
def test_a_long_decodes_bits_are_its_own_in_any_batch_and_split(attention_path: str) -> None:
    """A decode's parts follow its own keys only: alone on one thread, and beside other requests on 2
    and 3 threads (which then share out its parts otherwise), it gets the same bits."""
    batch = random_paged_batch([(1300, 1), (700, 1), (0, 9), (30, 1)], 9, 3, 64, 16, torch.bfloat16, seed=4)
    layout, ops = batch.layout, cpu_ops()
    lens, table = layout.seq_lens.long(), layout.block_table.long()

    def attend(rows: list[int]) -> torch.Tensor:
        starts = layout.query_start_loc.tolist()
        picked = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows])
        requests = torch.cat([torch.full((starts[r + 1] - starts[r],), r) for r in rows])
        seq_lens = torch.cat([torch.arange(lens[r] - starts[r + 1] + starts[r] + 1, lens[r] + 1) for r in rows])
        out = torch.empty_like(batch.q[picked])
        k, v = (c.permute(2, 0, 1, 3).contiguous() for c in (batch.k_cache, batch.v_cache))
        ops.paged_attention(out, batch.q[picked], k, v, table, requests, seq_lens, 64 ** -0.5, 0, 0.0)
        return out

    default = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = attend([0])[0]
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(attend([2, 0, 1, 3])[9], alone)
    finally:
        torch.set_num_threads(default)


# Fresh prompts longer than a tile, chunks over cached prefixes that start mid-block and mid-chunk,
# a tile of 4 rows (the fewest the tile unit takes), 3 rows and a decode beside them (the fp32 path).
PREFILLS = [(0, 70), (33, 40), (5, 1), (100, 21), (0, 4), (200, 3)]


@pytest.mark.parametrize("attention_path", PATHS, indirect=True)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 1, 256), (6, 2, 32)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_bf16_prefill_tiles_match_naive_attention(attention_path: str, heads: int, kv_heads: int, head_dim: int,
                                                  block_size: int) -> None:
    """bf16 prefill tiles over packed keys (probabilities rounded to bf16), on the tile unit or by
    VDPBF16PS, and in fp32."""
    _check(random_paged_batch(PREFILLS, heads, kv_heads, head_dim, block_size, torch.bfloat16, seed=head_dim), 2e-2)


@pytest.mark.parametrize("attention_path", PATHS, indirect=True)
@pytest.mark.parametrize("window", [0, 20])
def test_a_rows_bits_do_not_depend_on_its_tile(attention_path: str, window: int) -> None:
    """A prompt's rows attended in one call and as two chunks (so in other tiles: over packed keys rows
    0-31 and 32-35 against 0-5, then 6-35; on the fp32 path 0-15, 16-31, 32-35 against 0-5, then 6-21,
    22-35) give the same bits, with and without a sliding window."""
    kv_heads, group, head_dim, block_size, rows = 2, 3, 64, 16, 36
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(kv_heads, 4, block_size, head_dim, generator=gen).to(torch.bfloat16) for _ in "kv")
    q = torch.randn(rows, kv_heads * group, head_dim, generator=gen).to(torch.bfloat16)
    table, lens, ops = torch.tensor([[2, 0, 3, 1]]), torch.arange(1, rows + 1), cpu_ops()

    def attend(first: int, last: int) -> torch.Tensor:
        out = torch.empty_like(q[first:last])
        ops.paged_attention(out, q[first:last], k, v, table, torch.zeros(last - first, dtype=torch.long),
                            lens[first:last], head_dim ** -0.5, window, 0.0)
        return out

    assert torch.equal(attend(0, rows), torch.cat([attend(0, 6), attend(6, rows)]))


@pytest.mark.parametrize("attention_path", PATHS, indirect=True)
def test_prefill_chunks_sharing_blocks_give_each_ones_bits(attention_path: str) -> None:
    """Prompts' chunks over a cached prefix, in one call: the tile unit keeps the keys it packed for one
    request where the next reads the same blocks (whole 32-key chunks of them). Each chunk's bits are
    those it gets alone, where nothing is kept, and near naive attention's: two share all 8 blocks,
    one 3 (a chunk and a half), one none."""
    kv_heads, group, head_dim, block_size = 2, 3, 64, 16
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(kv_heads, 40, block_size, head_dim, generator=gen).to(torch.bfloat16) for _ in "kv")
    tables = [list(range(1, 9)), [*range(1, 9), 20], [1, 2, 3, 30, 31, 32, 33, 34], list(range(1, 9)),
              [9, 10, 11, 12, 13, 14, 15, 16]]
    lens, chunks = [128, 130, 128, 120, 128], [20, 18, 17, 16, 16]
    table = torch.tensor([row + [0] * (9 - len(row)) for row in tables])
    rows = torch.cat([torch.full((n,), r) for r, n in enumerate(chunks)])
    seq_lens = torch.cat([torch.arange(n - c + 1, n + 1) for n, c in zip(lens, chunks, strict=True)])
    q = torch.randn(len(rows), kv_heads * group, head_dim, generator=gen).to(torch.bfloat16)

    def attend(picked: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q[picked])
        cpu_ops().paged_attention(out, q[picked], k, v, table, rows[picked], seq_lens[picked], head_dim ** -0.5, 0, 0.0)
        return out

    together = attend(torch.arange(len(rows)))
    for r in range(len(chunks)):
        mine = (rows == r).nonzero().flatten()
        assert torch.equal(together[mine], attend(mine))
        for i in mine.tolist():
            n = seq_lens[i].item()
            keys, values = (c[:, table[r][torch.arange(n) // block_size], torch.arange(n) % block_size].float()
                            for c in (k, v))
            scores = q[i].float().view(kv_heads, group, head_dim) @ keys.transpose(1, 2) * head_dim ** -0.5
            expected = (F.softmax(scores, -1) @ values).reshape(kv_heads * group, head_dim)
            torch.testing.assert_close(together[i].float(), expected, atol=2e-2, rtol=0)


def _shared_prefix_decodes(window: int, cap: float, rows: list[int] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decodes whose requests share their first blocks, as a system prompt in the prefix cache leaves
    them: five over 8 blocks (one diverging after 6), three over 5 blocks (too few to share), one alone;
    the kernel's output for ``rows`` of them (default: all) in one call, and naive fp32 attention's."""
    kv_heads, group, head_dim, block_size = 3, 3, 64, 16
    gen = torch.Generator().manual_seed(11)
    k, v = (torch.randn(kv_heads, 80, block_size, head_dim, generator=gen).to(torch.bfloat16) for _ in "kv")
    prefixes = [list(range(1, 9))] * 4 + [[1, 2, 3, 4, 5, 6, 60, 61]] + [list(range(9, 14))] * 3 + [[70, 71]]
    own = [1, 17, 40, 16, 5, 3, 33, 2, 20]  # keys past the shared blocks, the last one the decode's own
    tables, lens, free = [], [], 20
    for prefix, extra in zip(prefixes, own, strict=True):
        blocks = -(-extra // block_size)
        tables.append(prefix + list(range(free, free + blocks)))
        free += blocks
        lens.append(len(prefix) * block_size + extra)
    width = max(map(len, tables))
    table = torch.tensor([row + [0] * (width - len(row)) for row in tables])
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(torch.bfloat16)
    picked = torch.tensor(range(len(lens)) if rows is None else rows)
    out = torch.empty_like(q[picked])
    cpu_ops().paged_attention(out, q[picked], k, v, table, picked, torch.tensor(lens)[picked], head_dim ** -0.5,
                              window, cap)
    expected = []
    for i in picked.tolist():
        seq_len = lens[i]
        positions = torch.arange(max(0, seq_len - window) if window else 0, seq_len)
        keys, values = (c[:, table[i][positions // block_size], positions % block_size].float() for c in (k, v))
        scores = q[i].float().view(kv_heads, group, head_dim) @ keys.transpose(1, 2) * head_dim ** -0.5
        scores = cap * torch.tanh(scores / cap) if cap else scores
        expected.append((F.softmax(scores, -1) @ values).reshape(kv_heads * group, head_dim))
    return out, torch.stack(expected)


@pytest.mark.parametrize("attention_path", PATHS, indirect=True)
@pytest.mark.parametrize(("window", "cap"), [(0, 0.0), (0, 0.5), (40, 0.0)])
def test_decodes_sharing_a_prefix_match_naive_attention(attention_path: str, window: int, cap: float) -> None:
    """Over packed keys (the tile unit, VDPBF16PS), decodes that share a prefix attend to it together,
    then to their own keys, and the two parts merge (cascade attention); in fp32, or with a window, each
    decode reads its context."""
    out, expected = _shared_prefix_decodes(window, cap)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=0)


@pytest.mark.parametrize("attention_path", ["amx", "bf16_dot"], indirect=True)
def test_only_decodes_sharing_enough_take_the_shared_pass(attention_path: str) -> None:
    """The five decodes over 8 shared blocks go through the shared pass (their bits differ from each one
    attended alone, which never shares); the three over 5 blocks, too few, and the lone one do not."""
    together, _ = _shared_prefix_decodes(0, 0.0)
    alone = [_shared_prefix_decodes(0, 0.0, [row])[0][0] for row in range(len(together))]
    assert all(not torch.equal(together[i], alone[i]) for i in range(5))
    assert all(torch.equal(together[i], alone[i]) for i in range(5, len(together)))


def test_torch_path_agrees_with_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel cannot run (no AVX-512, no compiler) the backend's torch ops give the same answer."""
    batch = random_paged_batch([(50, 1), (0, 4), (17, 1)], 9, 3, 64, 16, seed=2)
    with_kernel = _check(batch, atol=1e-5)
    monkeypatch.setattr(sdpa_backend, "cpu_ops", lambda: None)
    torch.testing.assert_close(_check(batch, atol=1e-5), with_kernel, atol=1e-5, rtol=0)


# The layer ops (csrc/layer_ops.cpp) against the torch ops they replace in cadence/models/layers.py
# (RMSNorm, RoPE) and cadence/models/llama.py (SiLU-and-multiply).

def _torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal in fp32 up to summation order; in bf16 at most one unit in the last place apart."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
        return
    ulp = torch.finfo(actual.dtype).eps * expected.float().abs().clamp_min(torch.finfo(actual.dtype).tiny)
    assert bool(((actual.float() - expected.float()).abs() <= ulp * 1.01).all())


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 40])  # SmolLM2's, and one with a 16-wide tail
def test_rms_norm_and_fused_add_match_torch(dtype: torch.dtype, hidden: int) -> None:
    ops = cpu_ops()
    gen = torch.Generator().manual_seed(hidden)
    x, residual = (torch.randn(37, hidden, generator=gen).to(dtype) for _ in "xr")
    weight = torch.randn(hidden, generator=gen).to(dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-5)
    _assert_within_one_ulp(out, _torch_norm(x, weight, 1e-5))
    summed = residual + x
    fused_residual = residual.clone()
    ops.add_rms_norm(out, fused_residual, x, weight, 1e-5)
    assert torch.equal(fused_residual, summed)
    _assert_within_one_ulp(out, _torch_norm(summed, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 24])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, width: int) -> None:
    gate_up = (torch.randn(33, 2 * width, generator=torch.Generator().manual_seed(width)) * 4).to(dtype)
    out = gate_up.new_empty(33, width)
    cpu_ops().silu_and_mul(out, gate_up)
    gate, up = gate_up.split(width, dim=-1)
    _assert_within_one_ulp(out, F.silu(gate) * up)


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 49152])
def test_argmax_rows_is_torch_argmax(vocab: int) -> None:
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[0] = float("-inf")  # every token masked
    logits[1] = 2.5  # all equal: the first
    logits[2, vocab // 2] = float("nan")  # NaN wins, as in torch
    if vocab > 4:
        logits[3, 1] = logits[3, vocab - 1] = 1e9  # a tie between vector lanes and chunks
        logits[4, vocab - 1] = 1e9  # the max in the tail
    for rows in (logits, logits[::2], logits[:, :max(1, vocab - 1)]):  # strided rows, a row tail
        assert torch.equal(cpu_ops().argmax_rows(rows), rows.argmax(dim=-1))


def _race_case() -> tuple[torch.Tensor, torch.Tensor]:
    """48 rows of 1,003 tokens (a tail past both paths' lanes) with probabilities of 1 to 1,000 parts,
    and one key per row spread over the 64 bits (both halves feed the hash)."""
    index = torch.arange(48 * 1003, dtype=torch.long)
    probs = ((index * 2654435761) % 1000 + 1).to(torch.float32).reshape(48, 1003)
    keys = torch.tensor([(r * 0x9E3779B97F4A7C15 + 12345) % 2**64 - 2**63 for r in range(48)], dtype=torch.long)
    return probs, keys


# race_rows' winners of _race_case() on the AVX-512 path; the AVX2 path's must be the same.
_RACE_WINNERS = [499, 136, 8, 469, 691, 718, 204, 611, 714, 923, 372, 740, 1002, 711, 395, 276, 510, 654, 775, 111, 371,
                 290, 62, 534, 930, 642, 533, 921, 801, 123, 117, 20, 563, 270, 338, 106, 775, 909, 919, 974, 165, 611,
                 987, 68, 237, 895, 586, 645]


# With top_p 1, 0.9, 0.5, 0.1 in turn (the probabilities above as parts of their row's sum).
_TOP_P_WINNERS = [499, 136, 923, 217, 691, 718, 204, 611, 714, 923, 372, 193, 1002, 711, 134, 591, 510, 654, 775,
                  102, 371, 290, 759, 906, 930, 642, 533, 396, 801, 123, 530, 20, 563, 270, 338, 372, 775, 325, 724,
                  519, 165, 611, 987, 436, 237, 895, 586, 131]


def test_race_rows_picks_the_same_tokens_on_every_path() -> None:
    """The hash, logarithm and top-p's sums of ``csrc/race.cpp`` run in 16 lanes on AVX-512 and 8 on
    AVX2 with the same operations: the same keys must pick the same tokens (a seeded request samples
    alike anywhere)."""
    probs, keys = _race_case()
    assert cpu_ops().race_rows(probs, keys).tolist() == _RACE_WINNERS
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.1] * 12)
    assert cpu_ops().race_rows(probs / probs.sum(-1, keepdim=True), keys, top_p).tolist() == _TOP_P_WINNERS


def test_race_rows_draws_inside_each_row_s_nucleus() -> None:
    """A token is in a row's top-p nucleus iff the tokens more likely than it hold less than top_p;
    a row whose draws all fall outside within ``max_rounds`` (or with top_p 0) takes its most likely."""
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(64, 1003, generator=gen) * 3, dim=-1)
    top_p = torch.rand(64, generator=gen)
    top_p[:4] = 0.0
    keys = torch.randint(-2**62, 2**62, (64,), generator=gen)
    winners = cpu_ops().race_rows(probs, keys, top_p)
    chosen = probs.gather(1, winners[:, None])
    mass_above = (probs.double() * (probs > chosen)).sum(-1)
    most_likely = probs.argmax(-1)
    inside = (mass_above < top_p.double() + 1e-6) | (winners == most_likely)
    assert inside.all() and torch.equal(winners[:4], most_likely[:4])
    assert len(set(winners.tolist()) - set(most_likely.tolist())) > 20  # not the most likely always
    once = cpu_ops().race_rows(probs, keys, torch.full((64,), 1e-3), max_rounds=1)
    assert torch.equal(once, most_likely)


@pytest.mark.parametrize("vocab", [1, 7, 9, 16, 17, 1003])
def test_race_rows_reaches_every_token_and_no_other(vocab: int) -> None:
    """A row's only nonzero probability wins wherever it lies (first lane, a chunk's edge, the tail),
    and no lane past the row's end ever does, whatever the key."""
    keys = torch.arange(-20, 20, dtype=torch.long) * 0x0123456789ABCDEF
    for at in sorted({0, vocab // 2, max(0, vocab - 8), vocab - 1}):
        probs = torch.zeros(len(keys), vocab)
        probs[:, at] = 0.25
        assert cpu_ops().race_rows(probs, keys).tolist() == [at] * len(keys)
    wide = torch.rand(len(keys), vocab + 64, generator=torch.Generator().manual_seed(vocab))
    assert int(cpu_ops().race_rows(wide[:, :vocab], keys).max()) < vocab  # strided rows, the rest never read


def _filtered_by_definition(x: torch.Tensor, top_k: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """Min-p (logits below max + log(min_p)), then top-k of what is left (below the k-th largest, ties
    kept), each to -inf: token_choice's torch ops, row by row."""
    out = x.clone()
    for row, k, lmp in zip(out, top_k.tolist(), log_min_p.tolist(), strict=True):
        row.masked_fill_(row < row.max() + torch.tensor(lmp), float("-inf"))
        if 0 < k < len(row):
            row.masked_fill_(row < row.topk(k).values[-1], float("-inf"))
    return out


@pytest.mark.parametrize("vocab", [9, 1003, 49157])
def test_filter_rows_keeps_what_min_p_and_top_k_keep(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(10, vocab, generator=gen) * 4
    x[1] = torch.arange(vocab, dtype=torch.float32)  # ascending: every logit passes the rising floor
    x[2] = torch.randint(0, 4, (vocab,), generator=gen).float()  # ties across the k-th
    x[3, ::2] = float("-inf")  # masked already: fewer than k left in small rows
    x[4] = -torch.arange(vocab, dtype=torch.float32)
    top_k = torch.tensor([50, 600, 3, 7, 1, 0, vocab - 1, vocab, 2, 1500]).clamp(max=vocab)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.01, 0.2, 0.5, 1e-4])
    log_min_p = min_p.log()  # -inf where off
    expected = _filtered_by_definition(x, top_k, log_min_p)
    for k, lmp in ((top_k, log_min_p), (top_k, None), (None, log_min_p)):
        wide = torch.full((10, vocab + 5), 7.0)
        wide[:, :vocab] = x
        cpu_ops().filter_rows(wide[:, :vocab], k, lmp)  # strided rows, in place
        want = _filtered_by_definition(x, torch.zeros_like(top_k) if k is None else top_k,
                                       torch.full_like(log_min_p, float("-inf")) if lmp is None else log_min_p)
        assert torch.equal(wide[:, :vocab], want) and bool((wide[:, vocab:] == 7.0).all())
    assert not torch.equal(expected, x)


@pytest.mark.parametrize("vocab", [7, 1003, 49157])
def test_top_k_rows_is_torch_topk_with_ties_to_the_lower_index(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen) * 4
    x[1] = torch.arange(vocab, dtype=torch.float32)  # ascending: every value passes the rising floor
    x[2] = torch.randint(0, 3, (vocab,), generator=gen).float()  # ties everywhere
    x[3, 3:] = float("-inf")  # fewer than k above -inf: its first -inf entries follow
    for k in sorted({1, 5, min(600, vocab), vocab}):
        values, indices = cpu_ops().top_k_rows(x, k)
        expected = x.topk(k, dim=-1).values
        assert torch.equal(values, expected)
        assert torch.equal(x.gather(1, indices), values)
        for row_values, row_indices in zip(values.tolist(), indices.tolist(), strict=True):
            order = sorted(zip(row_values, row_indices, strict=True), key=lambda pair: (-pair[0], pair[1]))
            assert list(zip(row_values, row_indices, strict=True)) == order
            assert len(set(row_indices)) == k
    wide = torch.cat([x, x], dim=1)[:, :vocab]  # strided rows
    assert torch.equal(cpu_ops().top_k_rows(wide, 1)[1], cpu_ops().top_k_rows(x, 1)[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 16), (2, 1, 40)])
def test_rotary_embedding_rotates_q_and_k_in_place_like_transformers(dtype: torch.dtype, heads: int,
                                                                      kv_heads: int, head_dim: int) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(head_dim)
    tokens, width = 21, (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen).to(dtype)
    angles = torch.randn(50, head_dim // 2, generator=gen)
    cos, sin = (torch.cat((f, f), -1).to(dtype) for f in (angles.cos(), angles.sin()))
    positions = torch.randint(0, 50, (tokens,), generator=gen)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim).transpose(0, 1)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim).transpose(0, 1)
    want_q, want_k = apply_rotary_pos_emb(q[None], k[None], cos[positions][None], sin[positions][None])
    rotated = qkv.clone()
    cpu_ops().rotary_embedding(rotated, positions, cos, sin, heads + kv_heads, head_dim)
    got = rotated[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim).transpose(0, 1)
    assert torch.equal(got[:heads], want_q[0]) and torch.equal(got[heads:], want_k[0])
    assert torch.equal(rotated[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])  # v


def test_generation_without_the_kernels_is_the_same(make_tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole model (norms, RoPE, SiLU, attention) on the kernels and on the torch-op fallback."""
    from cadence import LLM, SamplingParams
    from cadence.models import llama

    folder = str(make_tiny_model("llama"))
    prompts = [[5, 9, 60, 17], list(range(3, 44)), [7] * 20]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)

    def run() -> list:
        return [o.outputs[0] for o in LLM(model=folder, dtype="float32").generate(prompts, params, use_tqdm=False)]

    fused = run()
    monkeypatch.setattr(llama, "runs_kernels", lambda device, dtype: False)
    monkeypatch.setattr(sdpa_backend, "cpu_ops", lambda: None)
    plain = run()
    for a, b in zip(fused, plain, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close([p.logprobs[0] for p in a.logprobs], [p.logprobs[0] for p in b.logprobs],
                                   atol=1e-5, rtol=0)


def test_prefill_rows_take_the_kernel_only_where_it_is_the_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_kernels.attention_takes_prefills() == (torch.backends.cpu.get_cpu_capability() == "AVX512")
    rows: list[int] = []
    kernels = cpu_ops()

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(kernels, name)

        def paged_attention(self, out: torch.Tensor, q: torch.Tensor, *args: object) -> None:
            rows.append(q.shape[0])
            kernels.paged_attention(out, q, *args)

    monkeypatch.setattr(sdpa_backend, "cpu_ops", Spy)
    for takes in (False, True):
        monkeypatch.setattr(sdpa_backend, "attention_takes_prefills", lambda takes=takes: takes)
        rows.clear()
        _check(random_paged_batch([(20, 1), (0, 9)], 4, 2, 32, 16, torch.float32, seed=1), 1e-5)
        _check(random_paged_batch([(20, 1), (7, 1)], 4, 2, 32, 16, torch.float32, seed=2), 1e-5)
        assert rows == ([10, 2] if takes else [1, 2])  # else the decode row alone, beside torch's prefill
