//! The CPU's convolution: each pass by the kernel that suits its shape.
//! 3x3 stride-1 convolutions with enough work go through [`winograd`],
//! which shares the chunking and gemm of [`im2col`]; depthwise ones through
//! [`depthwise`]; the weight gradient of small padded maps through [`taps`];
//! the others through [`im2col`].

use super::super::conv_geometry::Geometry;
use super::super::ConvScratch;
use super::{depthwise, im2col, taps, winograd};

/// What each pass of [`convolve`] allocates beyond its operands and result,
/// for the algorithm it takes. The depthwise loop allocates none.
pub(in crate::ops) fn scratch(g: &Geometry) -> ConvScratch {
    if g.is_depthwise() || g.batch == 0 {
        return ConvScratch::default();
    }
    let passes = if winograd::applies(g) { winograd::scratch(g) } else { im2col::scratch(g) };
    if taps::applies(g) {
        ConvScratch { weight_gradient: taps::weight_gradient_scratch(g), ..passes }
    } else {
        passes
    }
}

/// The convolution of `x` by `w`, dense, grouped or depthwise.
pub(in crate::ops) fn convolve(g: &Geometry, x: &[f32], w: &[f32]) -> Vec<f32> {
    if g.is_depthwise() {
        depthwise::forward(g, x, w)
    } else if winograd::applies(g) {
        winograd::forward(g, x, w)
    } else {
        im2col::forward(g, x, w)
    }
}

/// The input gradient of [`convolve`] for the output gradient `dy`.
pub(in crate::ops) fn convolve_grad_input(g: &Geometry, dy: &[f32], w: &[f32]) -> Vec<f32> {
    if g.is_depthwise() {
        depthwise::grad_input(g, dy, w)
    } else if winograd::applies(g) {
        winograd::grad_input(g, dy, w)
    } else {
        im2col::grad_input(g, dy, w)
    }
}

/// The weight gradient of [`convolve`] for the output gradient `dy`.
pub(in crate::ops) fn convolve_grad_weight(g: &Geometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    if g.is_depthwise() {
        depthwise::grad_weight(g, x, dy)
    } else if taps::applies(g) {
        taps::grad_weight(g, x, dy)
    } else if winograd::applies(g) {
        winograd::grad_weight(g, x, dy)
    } else {
        im2col::grad_weight(g, x, dy)
    }
}
