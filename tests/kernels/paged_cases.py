"""Random paged-attention inputs for the kernel tests: shuffled page ids, NaN wherever a kernel must not read.

NaN fill: page 0 (the padding target of block-table padding entries), every page no sequence owns, and the slots
of a sequence's last page past its context length. The reference masks by select, so its output stays finite;
any kernel that lets one of those slots into a score or a value produces NaN and fails ``assert_close``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Tolerances per input dtype (kernel vs reference on the same inputs). bf16: the kernel feeds bf16 probabilities
# to the P @ V matmul (the reference keeps them fp32) and both round the output to bf16 (8 bits of mantissa).
TOLERANCES = {
    "float32": {"atol": 1e-5, "rtol": 1e-5},
    "bfloat16": {"atol": 2e-2, "rtol": 2e-2},
}


@dataclasses.dataclass(frozen=True)
class PagedCase:
    q: jax.Array  # [num_seqs, q_len, num_q_heads, head_dim]
    k_pages: jax.Array  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array  # [num_kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array  # [num_seqs, max_pages_per_seq] int32
    context_lens: jax.Array  # [num_seqs] int32
    scale: float

    @property
    def args(self) -> tuple[jax.Array, ...]:
        return self.q, self.k_pages, self.v_pages, self.block_tables, self.context_lens


def make_case(
    context_lens: list[int],
    *,
    q_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int = 16,
    dtype=jnp.float32,
    spare_pages: int = 3,
    seed: int = 0,
) -> PagedCase:
    """One layer's pool holding ``len(context_lens)`` sequences on shuffled pages, NaN where nothing may read."""
    rng = np.random.default_rng(seed)
    pages_needed = [-(-n // page_size) for n in context_lens]
    max_pages_per_seq = max(pages_needed) + 1  # at least one padding entry (page 0) per row
    num_pages = 1 + sum(pages_needed) + spare_pages  # page 0 reserved
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages = rng.standard_normal(shape).astype(np.float32)
    v_pages = rng.standard_normal(shape).astype(np.float32)
    written = np.zeros((num_pages, page_size), dtype=bool)  # slots holding a sequence's token

    page_ids = rng.permutation(np.arange(1, num_pages))
    block_tables = np.zeros((len(context_lens), max_pages_per_seq), dtype=np.int32)
    next_page = 0
    for seq, (context_len, num_seq_pages) in enumerate(zip(context_lens, pages_needed, strict=True)):
        block_tables[seq, :num_seq_pages] = page_ids[next_page : next_page + num_seq_pages]
        next_page += num_seq_pages
        for position in range(context_len):
            written[block_tables[seq, position // page_size], position % page_size] = True
    k_pages[:, ~written] = np.nan
    v_pages[:, ~written] = np.nan

    q = rng.standard_normal((len(context_lens), q_len, num_q_heads, head_dim)).astype(np.float32)
    return PagedCase(
        q=jnp.asarray(q, dtype),
        k_pages=jnp.asarray(k_pages, dtype),
        v_pages=jnp.asarray(v_pages, dtype),
        block_tables=jnp.asarray(block_tables),
        context_lens=jnp.asarray(context_lens, dtype=jnp.int32),
        scale=head_dim**-0.5,
    )


def assert_close(actual: jax.Array, expected: jax.Array) -> None:
    """Kernel output vs reference at the tolerance of the dtype; NaN anywhere fails."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, actual.dtype)
    actual_np = np.asarray(actual.astype(jnp.float32))
    assert np.isfinite(actual_np).all(), f"{np.isnan(actual_np).sum()} NaN outputs: a masked slot was read"
    np.testing.assert_allclose(
        actual_np, np.asarray(expected.astype(jnp.float32)), equal_nan=False, **TOLERANCES[expected.dtype.name]
    )
