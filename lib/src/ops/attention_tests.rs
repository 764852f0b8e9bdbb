//! Attention against the same computation from candle's operations.

use candle_core::{DType, Tensor, Var};

use super::attention::{composed, Geometry};
use super::tests::{randn, relative_error, values};
use super::*;

/// `(batch, tokens, dim, heads)`.
type Case = (usize, usize, usize, usize);

const CASES: [Case; 8] = [
    (1, 1, 8, 1),    // one token: every probability is 1
    (3, 7, 12, 3),   // three heads of 4
    (2, 13, 128, 2), // heads of 64
    (1, 37, 192, 3), // ViT-Tiny's heads, one image: the products threaded inside gemm
    (3, 50, 24, 1),  // one head
    (2, 19, 30, 5),  // heads of 6, rows not a multiple of a vector
    (4, 65, 64, 1),  // one head of 64, rows one past a multiple of 16
    (3, 1, 36, 3),   // one token, several heads
];

const KEEPS: [AttentionKeeps; 2] = [AttentionKeeps::Probabilities, AttentionKeeps::RowStatistics];

fn qkv(&(batch, tokens, dim, _): &Case) -> Tensor {
    randn(&[batch, tokens, 3 * dim])
}

fn reference(qkv: &Tensor, heads: usize) -> Tensor {
    composed(qkv, &Geometry::of_dims(qkv.dims(), heads).unwrap()).unwrap()
}

/// The output and the gradient of `sum(out * r)` with respect to `qkv`.
fn output_and_gradient(qkv: &Tensor, r: &Tensor, op: impl Fn(&Tensor) -> Tensor) -> (Tensor, Tensor) {
    let v = Var::from_tensor(qkv).unwrap();
    let out = op(v.as_tensor());
    let grads = (&out * r).unwrap().sum_all().unwrap().backward().unwrap();
    (out, grads.get(v.as_tensor()).unwrap().clone())
}

#[test]
fn attention_forward_matches_candle_ops() {
    for case in &CASES {
        let x = qkv(case);
        let ours = attention(&x, case.3, AttentionKeeps::RowStatistics).unwrap();
        let expected = reference(&x, case.3);
        assert_eq!(ours.dims(), expected.dims(), "{case:?}");
        let err = relative_error(&ours, &expected);
        assert!(err < 1e-5, "{case:?}: relative error {err}");
    }
}

#[test]
fn attention_gradients_match_candle_ops_and_are_the_same_whatever_is_kept() {
    for case in &CASES {
        let (x, r) = (qkv(case), randn(&[case.0, case.1, case.2]));
        let (expected_out, expected_grad) = output_and_gradient(&x, &r, |x| reference(x, case.3));
        let runs = KEEPS.map(|keeps| {
            let (out, grad) = output_and_gradient(&x, &r, |x| attention(x, case.3, keeps).unwrap());
            let (out_err, grad_err) = (relative_error(&out, &expected_out), relative_error(&grad, &expected_grad));
            assert!(out_err < 1e-5 && grad_err < 1e-4, "{case:?} {keeps:?}: output off by {out_err}, gradient by {grad_err}");
            (values(&out), values(&grad))
        });
        // The backward recomputes the probabilities the forward made, bit for bit.
        assert!(runs[0] == runs[1], "{case:?}: the two ways of keeping give different values");
    }
}

#[test]
fn attention_in_half_precision_stays_in_its_dtype_close_to_f32() {
    let case = (2, 19, 48, 3);
    for (dtype, tolerance) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
        let x = qkv(&case).to_dtype(dtype).unwrap();
        let r = randn(&[case.0, case.1, case.2]).to_dtype(dtype).unwrap();
        let (x32, r32) = (x.to_dtype(DType::F32).unwrap(), r.to_dtype(DType::F32).unwrap());
        for keeps in KEEPS {
            let (out, grad) = output_and_gradient(&x, &r, |x| attention(x, case.3, keeps).unwrap());
            let (out32, grad32) = output_and_gradient(&x32, &r32, |x| attention(x, case.3, keeps).unwrap());
            assert_eq!((out.dtype(), grad.dtype()), (dtype, dtype));
            let (out_err, grad_err) = (relative_error(&out, &out32), relative_error(&grad, &grad32));
            assert!(out_err < tolerance && grad_err < tolerance, "{dtype:?} {keeps:?}: output off by {out_err}, gradient by {grad_err}");
        }
    }
}

#[test]
fn attention_row_statistics_keep_less_than_probabilities() {
    for (dtype, size) in [(DType::F32, 4), (DType::F16, 2), (DType::BF16, 2)] {
        let (batch, tokens, heads) = (32, 197, 3);
        let rows = (batch * heads * tokens) as u64;
        assert_eq!(AttentionKeeps::Probabilities.bytes(batch, tokens, heads, dtype), rows * tokens as u64 * size);
        assert_eq!(AttentionKeeps::RowStatistics.bytes(batch, tokens, heads, dtype), rows * 4);
    }
    // With one token a row's statistic and its one probability weigh the same in f32.
    assert_eq!(AttentionKeeps::Probabilities.bytes(2, 1, 3, DType::F32), AttentionKeeps::RowStatistics.bytes(2, 1, 3, DType::F32));
}

#[test]
fn attention_in_other_dtypes_and_on_empty_inputs_goes_through_candle_ops() {
    let x = qkv(&(2, 9, 12, 3)).to_dtype(DType::F64).unwrap();
    let ours = attention(&x, 3, AttentionKeeps::RowStatistics).unwrap();
    assert_eq!(ours.dtype(), DType::F64);
    assert!(relative_error(&ours, &reference(&x, 3)) < 1e-12);
    for dims in [[0, 5, 36], [2, 0, 36]] {
        let out = attention(&randn(&dims), 3, AttentionKeeps::Probabilities).unwrap();
        assert_eq!(out.dims(), [dims[0], dims[1], 12]);
    }
    let scratch = attention_scratch(0, 5, 12, 3, DType::F32, AttentionKeeps::Probabilities).unwrap();
    assert_eq!(scratch, AttentionScratch::default());
}

fn error_text<T>(r: std::result::Result<T, impl std::fmt::Display>) -> String {
    r.err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn attention_refuses_bad_shapes_by_name() {
    let keeps = AttentionKeeps::Probabilities;
    for dims in [vec![4, 36], vec![1, 2, 3, 36]] {
        let text = error_text(attention(&randn(&dims), 3, keeps));
        assert!(text.contains("attention: qkv must have 3 dimensions") && text.contains(&format!("{dims:?}")), "{text}");
    }
    let text = error_text(attention(&randn(&[2, 5, 30]), 4, keeps));
    assert!(text.contains("attention: the last dimension of [2, 5, 30] is not a positive multiple of 3 x 4 heads"), "{text}");
    let text = error_text(attention(&randn(&[2, 5, 0]), 1, keeps));
    assert!(text.contains("[2, 5, 0] is not a positive multiple of 3 x 1 heads"), "{text}");
    let text = error_text(attention(&randn(&[2, 5, 30]), 0, keeps));
    assert!(text.contains("attention: heads must be at least 1"), "{text}");
    let text = error_text(attention_scratch(2, 5, 10, 4, DType::F32, keeps));
    assert!(text.contains("[2, 5, 30] is not a positive multiple of 3 x 4 heads"), "{text}");
    let text = error_text(attention_scratch(2, 5, 12, 4, DType::F64, keeps));
    assert!(text.contains("attention: dtype F64 is not supported"), "{text}");
}

/// What the device passes allocate beyond the input, the output (or the
/// input's gradient) and what the forward keeps, measured on the reference
/// primitives, is what the ledger counts for a card.
#[test]
fn the_device_passes_allocate_what_their_scratch_says() {
    use super::cuda::{allocations, on_reference};
    for &(batch, tokens, dim, heads) in &[(2, 13, 24, 3), (3, 7, 12, 1)] {
        for keeps in KEEPS {
            for dtype in [DType::F32, DType::F16] {
                let x = Var::from_tensor(&randn(&[batch, tokens, 3 * dim]).to_dtype(dtype).unwrap()).unwrap();
                let expected = attention_device_scratch(batch, tokens, dim, heads, dtype, keeps).unwrap();
                let bytes = |elements: usize| (elements * dtype.size_in_bytes()) as u64;
                let kept = keeps.bytes(batch, tokens, heads, dtype);
                let (out, forward) = on_reference(|| allocations(|| attention(x.as_tensor(), heads, keeps).unwrap()));
                let case = format!("b{batch} n{tokens} d{dim} h{heads} {keeps:?} {dtype:?}");
                assert_eq!(forward.left, kept as i64, "{case}: what the forward keeps");
                assert_eq!(forward.peak, bytes(out.elem_count()) + kept + expected.forward, "{case}: forward");
                let (_, backward) = on_reference(|| allocations(|| out.sum_all().unwrap().backward().unwrap()));
                assert_eq!(backward.peak, bytes(x.elem_count()) + expected.backward, "{case}: backward");
            }
        }
    }
}
