//! What one call of `gemm::gemm` (f32) allocates for itself: the packed
//! right-hand side and the pre-packed left-hand side it keeps for the call.
//! Mirrors the decisions of gemm-common 0.19's `gemm_basic_generic` (and
//! the transposition `gemm::gemm` makes first), so that the ledger can count
//! a convolution's workspace without running it; `lib/tests/memory.rs`
//! checks the two against the counted allocator.

use gemm::Parallelism;
use gemm_common::cache::{kernel_params, KernelParams, CACHE_INFO};

const F32_BYTES: usize = 4;

/// The f32 microkernel gemm picks at run time: its rows (`MR`), columns
/// (`NR`) and SIMD width (`N`).
#[derive(Debug, Clone, Copy)]
struct Microkernel {
    mr: usize,
    nr: usize,
    lanes: usize,
}

fn microkernel() -> Microkernel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Microkernel { mr: 4 * 16, nr: 6, lanes: 16 };
        }
        if std::arch::is_x86_feature_detected!("fma") {
            return Microkernel { mr: 2 * 8, nr: 6, lanes: 8 };
        }
    }
    Microkernel { mr: 2 * 4, nr: 4, lanes: 4 }
}

/// A matrix operand's strides in elements.
#[derive(Debug, Clone, Copy)]
pub(in crate::ops) struct Strides {
    pub row: usize,
    pub col: usize,
}

impl Strides {
    pub fn row_major(row: usize) -> Self {
        Self { row, col: 1 }
    }

    pub fn column_major(col: usize) -> Self {
        Self { row: 1, col }
    }

    fn transposed(self) -> Self {
        Self { row: self.col, col: self.row }
    }
}

/// Bytes `gemm::gemm` of f32 allocates for `dst (m x n) = lhs (m x k) *
/// rhs (k x n)`, with the strides given.
pub(in crate::ops) fn packing_bytes(
    (m, n, k): (usize, usize, usize),
    dst: Strides,
    lhs: Strides,
    rhs: Strides,
    parallelism: Parallelism,
) -> u64 {
    if m == 0 || n == 0 || k <= 2 {
        return 0;
    }
    // gemm makes the destination column-major by transposing the product.
    let transposed = dst.col < dst.row;
    let (m, n, lhs, rhs, dst) =
        if transposed { (n, m, rhs.transposed(), lhs.transposed(), dst.transposed()) } else { (m, n, lhs, rhs, dst) };
    let mk = microkernel();
    let small = m * n <= 16 * 16 && lhs.col == 1 && rhs.row == 1;
    let vector = (n <= 1 && ((lhs.row == 1 && dst.row == 1) || (lhs.col == 1 && rhs.row == 1)))
        || (m <= 1 && ((rhs.col == 1 && dst.col == 1) || (rhs.row == 1 && lhs.col == 1)));
    if small || vector {
        return 0;
    }
    let KernelParams { kc, mc, nc } = if m <= 64 && n <= 64 {
        let kc = k.min(512);
        KernelParams { kc, mc: (CACHE_INFO[1].cache_bytes / F32_BYTES / kc) / mk.mr * mk.mr, nc: n.next_multiple_of(mk.nr) }
    } else {
        kernel_params(m, n, k, mk.mr, mk.nr, F32_BYTES)
    };
    let nc = match (nc, parallelism) {
        (0, Parallelism::None) => 128 * mk.nr,
        (0, _) => n.next_multiple_of(mk.nr),
        (nc, _) => nc,
    };
    let pack_rhs = (rhs.row != 1 && m > 2 * mk.mr) || (rhs.row == 1 && m > gemm::get_rhs_packing_threshold() * mk.mr);
    let prepack_lhs = m <= 2 * mc && (m % mk.lanes != 0 || lhs.row != 1);
    let rhs_elems = if pack_rhs { kc * mk.nr * (nc / mk.nr) } else { 0 };
    let lhs_elems = if prepack_lhs { kc * m.next_multiple_of(mk.mr) } else { 0 };
    if rhs_elems + lhs_elems == 0 {
        return 0;
    }
    let align = gemm_common::gemm::CACHELINE_ALIGN;
    ((rhs_elems * F32_BYTES).next_multiple_of(align) + (lhs_elems * F32_BYTES).next_multiple_of(align)) as u64
}
