//! The device primitives on host memory: each computes what the cuDNN call
//! it stands for is documented to compute, from the same descriptors
//! (dimensions and strides, the filter's `K x C/groups x R x S` layout, the
//! convolution's padding, stride, dilation and group count, the pooling
//! window), reading and writing only the buffers the call reads and writes.
//! So the device passes run here end to end, and only the vendor's
//! arithmetic is left for a card.
//!
//! It is strict where cuDNN is: an element past the end of a buffer, a
//! descriptor whose output does not follow from its input, a batch-norm
//! epsilon under `CUDNN_BN_MIN_EPSILON` and a tensor of 2^31 elements are
//! errors; new buffers hold NaN until written, so a pass that reads memory
//! it never wrote shows it in its result. Values are stored rounded to the
//! buffer's element type; sums are taken in f64.

use std::cell::Cell;
use std::f64::consts::FRAC_1_SQRT_2;
use std::sync::RwLock;

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;

use super::super::cpu::floats::{f32_view, storage_from_f32};
use super::super::OpError;
use super::descriptors::{ConvDims, Element, PoolDims, TensorDims};
use super::passes;
use super::primitives::{
    At, ConvCall, DeltaCall, DeviceActivation, GemmCall, Held, LayerNormGrads, Made, Maps, Matrix, NormCall, NormGrads, NormStatistics,
    PoolGrads, Primitives, RowsCall, SoftmaxCall, MIN_NORM_EPS,
};

thread_local! {
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
    /// Bytes of the buffers the passes made on this thread that are alive
    /// now, and the most alive at once since [`allocations`] last started.
    static DEVICE_BYTES: Cell<(i64, i64)> = const { Cell::new((0, 0)) };
}

/// Runs `f` and returns what the device passes it ran on the reference made
/// at most at once beyond what was alive when it started (as a card's
/// allocator would be asked for it: the buffers the passes make, not the
/// reference's copies of its operands), and what they left alive.
pub fn allocations<R>(f: impl FnOnce() -> R) -> (R, Allocations) {
    let (start, outer_peak) = DEVICE_BYTES.with(Cell::get);
    DEVICE_BYTES.with(|b| b.set((start, start)));
    let result = f();
    let (live, peak) = DEVICE_BYTES.with(Cell::get);
    DEVICE_BYTES.with(|b| b.set((live, outer_peak.max(peak))));
    (result, Allocations { peak: (peak - start).max(0) as u64, left: live - start })
}

/// What [`allocations`] measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocations {
    pub peak: u64,
    pub left: i64,
}

fn count_device_bytes(delta: i64) {
    DEVICE_BYTES.with(|b| {
        let (live, peak) = b.get();
        b.set((live + delta, peak.max(live + delta)));
    });
}

/// Runs `f` with the ops of this thread running their device passes on the
/// reference primitives over CPU tensors, where they would run their CPU
/// kernels: `vramlab check-ops --device reference`.
pub fn on_reference<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ACTIVE.with(|a| a.set(self.0));
        }
    }
    let _restore = Restore(ACTIVE.with(|a| a.replace(true)));
    f()
}

/// Whether this thread's ops run their device passes on the reference.
pub fn active() -> bool {
    ACTIVE.with(Cell::get)
}

/// The reference device.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reference;

/// Host memory holding elements of one type, as f32 values that type can
/// hold: a buffer a pass made (counted as a card would allocate it), or the
/// reference's copy of an operand (which a card reads in place).
pub struct HostBuffer {
    element: Element,
    values: RwLock<Vec<f32>>,
    device_bytes: i64,
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        count_device_bytes(-self.device_bytes);
    }
}

fn dtype_of(e: Element) -> DType {
    match e {
        Element::F32 => DType::F32,
        Element::F16 => DType::F16,
        Element::Bf16 => DType::BF16,
    }
}

fn rounded(e: Element, v: f32) -> f32 {
    match e {
        Element::F32 => v,
        Element::F16 => half::f16::from_f32(v).to_f32(),
        Element::Bf16 => half::bf16::from_f32(v).to_f32(),
    }
}

impl HostBuffer {
    /// A buffer a pass makes on the device.
    fn made(element: Element, values: Vec<f32>) -> Self {
        let device_bytes = (values.len() * element.size()) as i64;
        count_device_bytes(device_bytes);
        HostBuffer { element, values: RwLock::new(values), device_bytes }
    }

    fn filled(element: Element, len: usize, value: f32) -> Self {
        HostBuffer::made(element, vec![value; len])
    }

    /// The reference's copy of an operand a card reads in place.
    fn from_cpu(op: &'static str, storage: &CpuStorage, layout: &Layout) -> Result<Self> {
        passes::contiguous(op, layout)?;
        let element = Element::of(op, storage.dtype())?;
        Ok(HostBuffer { element, values: RwLock::new(f32_view(op, storage, layout)?.into_owned()), device_bytes: 0 })
    }

    /// The elements of `t` at `at`, as an NCHW-contiguous copy.
    fn gather(&self, op: &'static str, at: At<'_, HostBuffer>, t: &TensorDims) -> Result<Vec<f32>> {
        let values = self.values.read().map_err(|_| poisoned(op))?;
        let end = extent(t).map(|e| at.offset + e);
        if end.is_none_or(|end| end > values.len()) {
            Err(OpError::PastBuffer { op, end: end.unwrap_or(usize::MAX), len: values.len() })?
        }
        let mut out = Vec::with_capacity(t.elements());
        out.extend(indices(t).map(|i| values[at.offset + i]));
        Ok(out)
    }

    /// `data` (NCHW-contiguous) written into the elements of `t` at `at`, rounded.
    fn scatter(&self, op: &'static str, at: At<'_, HostBuffer>, t: &TensorDims, data: &[f32]) -> Result<()> {
        let mut values = self.values.write().map_err(|_| poisoned(op))?;
        let end = extent(t).map(|e| at.offset + e);
        if end.is_none_or(|end| end > values.len()) {
            Err(OpError::PastBuffer { op, end: end.unwrap_or(usize::MAX), len: values.len() })?
        }
        for (i, &v) in indices(t).zip(data) {
            values[at.offset + i] = rounded(self.element, v);
        }
        Ok(())
    }

    /// The buffer as a host storage. On a card the storage is the buffer
    /// itself; here it stops being counted as one.
    fn into_cpu(mut self, op: &'static str) -> Result<CpuStorage> {
        let values = std::mem::take(self.values.get_mut().map_err(|_| poisoned(op))?);
        storage_from_f32(op, values, dtype_of(self.element))
    }
}

fn poisoned(op: &'static str) -> candle_core::Error {
    OpError::MissingOperand { op, what: "buffer (a thread panicked while writing it)" }.into()
}

/// One past the last element a descriptor reaches, from its start; `None`
/// for a descriptor with a zero or negative dimension or stride.
fn extent(t: &TensorDims) -> Option<usize> {
    let mut end = 1usize;
    for (&d, &s) in t.dims.iter().zip(&t.strides) {
        let (d, s) = (usize::try_from(d).ok().filter(|&d| d > 0)?, usize::try_from(s).ok()?);
        end = end.checked_add((d - 1).checked_mul(s)?)?;
    }
    Some(end)
}

/// Every element's index from the descriptor's start, in NCHW order.
fn indices(t: &TensorDims) -> impl Iterator<Item = usize> + '_ {
    let [n, c, h, w] = t.dims.map(|d| d.max(0) as usize);
    let [sn, sc, sh, sw] = t.strides.map(|s| s.max(0) as usize);
    (0..n).flat_map(move |a| (0..c).flat_map(move |b| (0..h).flat_map(move |y| (0..w).map(move |x| a * sn + b * sc + y * sh + x * sw))))
}

fn dims(t: &TensorDims) -> [usize; 4] {
    t.dims.map(|d| d.max(0) as usize)
}

fn buffer_element(op: &'static str, at: At<'_, HostBuffer>, e: Element) -> Result<()> {
    if at.buffer.element == e {
        Ok(())
    } else {
        Err(OpError::DTypeMismatch { op, input: dtype_of(e), other: dtype_of(at.buffer.element) }.into())
    }
}

/// The output size cuDNN derives for a window over `size` (its
/// `cudnnGetConvolution2dForwardOutputDim` and pooling rule).
fn out_size(size: usize, window: usize, padding: usize, stride: usize, dilation: usize) -> Option<usize> {
    let reach = dilation * (window - 1) + 1;
    (size + 2 * padding).checked_sub(reach).map(|free| free / stride + 1)
}

/// A convolution's sizes, checked as cuDNN checks its descriptors.
struct ConvShape {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    k: usize,
    r: usize,
    s: usize,
    oh: usize,
    ow: usize,
    per_group: usize,
    out_per_group: usize,
    pad: [usize; 2],
    stride: [usize; 2],
    dilation: [usize; 2],
}

impl ConvShape {
    fn of(d: &ConvDims) -> std::result::Result<Self, OpError> {
        let bad = |why: String| OpError::Descriptor { op: "conv2d", why };
        let [n, c, h, w] = dims(&d.x);
        let [k, per_group, r, s] = d.filter.map(|v| v.max(0) as usize);
        let [yn, yk, oh, ow] = dims(&d.y);
        let groups = usize::try_from(d.groups).ok().filter(|&g| g > 0).ok_or_else(|| bad(format!("group count {}", d.groups)))?;
        let positive = |v: [i32; 2], what: &str| -> std::result::Result<[usize; 2], OpError> {
            match v.map(usize::try_from) {
                [Ok(a), Ok(b)] => Ok([a, b]),
                _ => Err(bad(format!("{what} {v:?}"))),
            }
        };
        let (pad, stride, dilation) = (positive(d.padding, "padding")?, positive(d.stride, "stride")?, positive(d.dilation, "dilation")?);
        if stride.contains(&0) || dilation.contains(&0) {
            return Err(bad(format!("stride {stride:?}, dilation {dilation:?}")));
        }
        if per_group * groups != c || k % groups != 0 || r == 0 || s == 0 {
            return Err(bad(format!("filter {:?} with {groups} groups over {c} input channels", d.filter)));
        }
        let expected = (out_size(h, r, pad[0], stride[0], dilation[0]), out_size(w, s, pad[1], stride[1], dilation[1]));
        if yn != n || yk != k || expected != (Some(oh), Some(ow)) {
            return Err(bad(format!("output {:?} where input {:?} and filter {:?} give {expected:?}", d.y.dims, d.x.dims, d.filter)));
        }
        Ok(ConvShape { n, c, h, w, k, r, s, oh, ow, per_group, out_per_group: k / groups, pad, stride, dilation })
    }

    fn filter(&self) -> TensorDims {
        let (per, r, s) = (self.per_group as i32, self.r as i32, self.s as i32);
        TensorDims { dims: [self.k as i32, per, r, s], strides: [per * r * s, r * s, s, 1] }
    }

    /// The input row and column that output `(oh, ow)` reads at tap `(i, j)`, if inside.
    fn tap(&self, oh: usize, ow: usize, i: usize, j: usize) -> Option<(usize, usize)> {
        let y = (oh * self.stride[0] + i * self.dilation[0]).checked_sub(self.pad[0]).filter(|&y| y < self.h)?;
        let x = (ow * self.stride[1] + j * self.dilation[1]).checked_sub(self.pad[1]).filter(|&x| x < self.w)?;
        Some((y, x))
    }

    /// The first input channel of output channel `k`'s group.
    fn first_input(&self, k: usize) -> usize {
        k / self.out_per_group * self.per_group
    }

    fn forward(&self, x: &[f32], wt: &[f32]) -> Vec<f32> {
        let (plane, out_plane) = (self.h * self.w, self.oh * self.ow);
        let mut y = vec![0.0; self.n * self.k * out_plane];
        y.par_chunks_mut(out_plane).enumerate().for_each(|(i, out)| {
            let (n, k) = (i / self.k, i % self.k);
            let first = self.first_input(k);
            let mut acc = vec![0f64; out_plane];
            for c in 0..self.per_group {
                let input = &x[(n * self.c + first + c) * plane..][..plane];
                for (i, j) in (0..self.r).flat_map(|i| (0..self.s).map(move |j| (i, j))) {
                    let weight = f64::from(wt[((k * self.per_group + c) * self.r + i) * self.s + j]);
                    for (o, a) in acc.iter_mut().enumerate() {
                        if let Some((yy, xx)) = self.tap(o / self.ow, o % self.ow, i, j) {
                            *a += weight * f64::from(input[yy * self.w + xx]);
                        }
                    }
                }
            }
            out.iter_mut().zip(acc).for_each(|(o, a)| *o = a as f32);
        });
        y
    }

    fn input_gradient(&self, dy: &[f32], wt: &[f32]) -> Vec<f32> {
        let (plane, out_plane) = (self.h * self.w, self.oh * self.ow);
        let mut dx = vec![0.0; self.n * self.c * plane];
        dx.par_chunks_mut(plane).enumerate().for_each(|(i, out)| {
            let (n, c) = (i / self.c, i % self.c);
            let group = c / self.per_group;
            let mut acc = vec![0f64; plane];
            for k in group * self.out_per_group..(group + 1) * self.out_per_group {
                let grad = &dy[(n * self.k + k) * out_plane..][..out_plane];
                for (i, j) in (0..self.r).flat_map(|i| (0..self.s).map(move |j| (i, j))) {
                    let weight = f64::from(wt[((k * self.per_group + c % self.per_group) * self.r + i) * self.s + j]);
                    for (o, &g) in grad.iter().enumerate() {
                        if let Some((yy, xx)) = self.tap(o / self.ow, o % self.ow, i, j) {
                            acc[yy * self.w + xx] += weight * f64::from(g);
                        }
                    }
                }
            }
            out.iter_mut().zip(acc).for_each(|(o, a)| *o = a as f32);
        });
        dx
    }

    fn weight_gradient(&self, x: &[f32], dy: &[f32]) -> Vec<f32> {
        let (plane, out_plane, taps) = (self.h * self.w, self.oh * self.ow, self.r * self.s);
        let mut dw = vec![0.0; self.k * self.per_group * taps];
        dw.par_chunks_mut(self.per_group * taps).enumerate().for_each(|(k, out)| {
            let first = self.first_input(k);
            let mut acc = vec![0f64; self.per_group * taps];
            for n in 0..self.n {
                let grad = &dy[(n * self.k + k) * out_plane..][..out_plane];
                for c in 0..self.per_group {
                    let input = &x[(n * self.c + first + c) * plane..][..plane];
                    for t in 0..taps {
                        let (i, j) = (t / self.s, t % self.s);
                        let sum: f64 = grad
                            .iter()
                            .enumerate()
                            .filter_map(|(o, &g)| {
                                self.tap(o / self.ow, o % self.ow, i, j).map(|(yy, xx)| f64::from(g) * f64::from(input[yy * self.w + xx]))
                            })
                            .sum();
                        acc[c * taps + t] += sum;
                    }
                }
            }
            out.iter_mut().zip(acc).for_each(|(o, a)| *o = a as f32);
        });
        dw
    }
}

/// A pooling window's sizes, checked as cuDNN checks its descriptors.
struct PoolShape {
    planes: usize,
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
    window: [usize; 2],
    pad: [usize; 2],
    stride: [usize; 2],
}

impl PoolShape {
    fn of(d: &PoolDims) -> std::result::Result<Self, OpError> {
        let bad = |why: String| OpError::Descriptor { op: "max_pool2d", why };
        let [n, c, h, w] = dims(&d.x);
        let [yn, yc, oh, ow] = dims(&d.y);
        let [window, pad, stride] = [d.window, d.padding, d.stride].map(|v| v.map(|x| x.max(0) as usize));
        if window.contains(&0) || stride.contains(&0) || pad[0] >= window[0] || pad[1] >= window[1] {
            return Err(bad(format!("window {:?}, padding {:?}, stride {:?}", d.window, d.padding, d.stride)));
        }
        let expected = (out_size(h, window[0], pad[0], stride[0], 1), out_size(w, window[1], pad[1], stride[1], 1));
        if (yn, yc) != (n, c) || expected != (Some(oh), Some(ow)) {
            return Err(bad(format!("output {:?} where input {:?} gives {expected:?}", d.y.dims, d.x.dims)));
        }
        Ok(PoolShape { planes: n * c, h, w, oh, ow, window, pad, stride })
    }

    /// The input positions of output `o`'s window, row by row, inside the input.
    fn window(&self, o: usize) -> impl Iterator<Item = usize> + '_ {
        let (oy, ox) = (o / self.ow, o % self.ow);
        (0..self.window[0]).flat_map(move |i| {
            (0..self.window[1]).filter_map(move |j| {
                let y = (oy * self.stride[0] + i).checked_sub(self.pad[0]).filter(|&y| y < self.h)?;
                let x = (ox * self.stride[1] + j).checked_sub(self.pad[1]).filter(|&x| x < self.w)?;
                Some(y * self.w + x)
            })
        })
    }
}

/// The larger of two values, NaN where either is (`CUDNN_PROPAGATE_NAN`).
fn larger_propagating_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b > a || b.is_nan() {
        if a.is_nan() {
            a
        } else {
            b
        }
    } else {
        a
    }
}

/// `len` contiguous elements from `at`, as a 1 x len x 1 x 1 descriptor.
fn flat(len: usize) -> Result<TensorDims> {
    let len = i32::try_from(len).map_err(|_| OpError::TooLargeForCudnn { op: "kernel", dims: vec![len] })?;
    Ok(TensorDims { dims: [1, len, 1, 1], strides: [len, 1, 1, 1] })
}

/// The elements of a batch of `rows x cols` matrices laid out as `m` says
/// (`rows x cols` as stored: the product's operand before any transposition).
fn matrices(rows: usize, cols: usize, m: Matrix, batch: usize) -> Result<TensorDims> {
    let int = |v: usize| i32::try_from(v).map_err(|_| OpError::TooLargeForCudnn { op: "gemm", dims: vec![batch, rows, cols] });
    if m.ld < cols {
        Err(OpError::Descriptor { op: "gemm", why: format!("a row stride of {} for rows of {cols}", m.ld) })?
    }
    Ok(TensorDims { dims: [int(batch)?, int(rows)?, int(cols)?, 1], strides: [int(m.stride)?, int(m.ld)?, 1, 1] })
}

/// A row's mean and `1 / sqrt(var + eps)`, the variance from the centred values.
fn row_statistics(row: &[f32], eps: f32) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = row.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / n;
    (mean, 1.0 / (var + f64::from(eps)).sqrt())
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Per-channel sizes of a spatial batch-norm: `(channels, count, plane)`.
fn norm_sizes(call: &NormCall) -> Result<(usize, usize, usize)> {
    let [n, c, h, w] = dims(&call.dims.x);
    if dims(&call.dims.per_channel) != [1, c, 1, 1] {
        Err(OpError::Descriptor {
            op: "batch_norm_train",
            why: format!("per-channel {:?} for maps {:?}", call.dims.per_channel.dims, call.dims.x.dims),
        })?
    }
    if call.eps < MIN_NORM_EPS {
        Err(OpError::Descriptor { op: "batch_norm_train", why: format!("epsilon {} is under cuDNN's least, {MIN_NORM_EPS}", call.eps) })?
    }
    Ok((c, n * h * w, h * w))
}

/// The per-channel sums `f(value, other)` over the maps `a` and `b` (NCHW-contiguous).
fn channel_sums(a: &[f32], b: &[f32], channels: usize, plane: usize, f: impl Fn(f64, f64) -> f64 + Sync) -> Vec<f64> {
    (0..channels)
        .into_par_iter()
        .map(|c| {
            a.chunks(plane)
                .zip(b.chunks(plane))
                .skip(c)
                .step_by(channels)
                .map(|(pa, pb)| pa.iter().zip(pb).map(|(&u, &v)| f(f64::from(u), f64::from(v))).sum::<f64>())
                .sum()
        })
        .collect()
}

impl Primitives for Reference {
    type Buffer = HostBuffer;
    type Storage = CpuStorage;

    fn of_storage(_: &CpuStorage) -> Self {
        Reference
    }

    fn dtype(buffer: &HostBuffer) -> DType {
        dtype_of(buffer.element)
    }

    fn alloc(&self, element: Element, len: usize) -> Result<HostBuffer> {
        Ok(HostBuffer::filled(element, len, f32::NAN))
    }

    fn zeros_f32(&self, len: usize) -> Result<HostBuffer> {
        Ok(HostBuffer::filled(Element::F32, len, 0.0))
    }

    fn copy(&self, buffer: &HostBuffer) -> Result<HostBuffer> {
        let values = buffer.values.read().map_err(|_| poisoned("copy"))?.clone();
        Ok(HostBuffer::made(buffer.element, values))
    }

    fn convolve(&self, d: ConvDims, e: Element, call: ConvCall<'_, HostBuffer>) -> Result<()> {
        let op = "conv2d";
        let shape = ConvShape::of(&d)?;
        let filter = shape.filter();
        match call {
            ConvCall::Forward { x, w, y } => {
                [x, w, y].iter().try_for_each(|a| buffer_element(op, *a, e))?;
                let out = shape.forward(&x.buffer.gather(op, x, &d.x)?, &w.buffer.gather(op, w, &filter)?);
                y.buffer.scatter(op, y, &d.y, &out)
            }
            ConvCall::InputGradient { dy, w, dx } => {
                [dy, w, dx].iter().try_for_each(|a| buffer_element(op, *a, e))?;
                let out = shape.input_gradient(&dy.buffer.gather(op, dy, &d.y)?, &w.buffer.gather(op, w, &filter)?);
                dx.buffer.scatter(op, dx, &d.x, &out)
            }
            ConvCall::WeightGradient { x, dy, dw } => {
                [x, dy, dw].iter().try_for_each(|a| buffer_element(op, *a, e))?;
                let out = shape.weight_gradient(&x.buffer.gather(op, x, &d.x)?, &dy.buffer.gather(op, dy, &d.y)?);
                dw.buffer.scatter(op, dw, &filter, &out)
            }
        }
    }

    fn max_pool(
        &self,
        d: PoolDims,
        e: Element,
        x: At<'_, HostBuffer>,
        y: At<'_, HostBuffer>,
        grads: Option<PoolGrads<'_, HostBuffer>>,
    ) -> Result<()> {
        let op = "max_pool2d";
        let shape = PoolShape::of(&d)?;
        buffer_element(op, x, e)?;
        buffer_element(op, y, e)?;
        let xs = x.buffer.gather(op, x, &d.x)?;
        let (plane, out_plane) = (shape.h * shape.w, shape.oh * shape.ow);
        match grads {
            None => {
                let out: Vec<f32> = (0..shape.planes * out_plane)
                    .map(|i| {
                        let input = &xs[i / out_plane * plane..][..plane];
                        shape.window(i % out_plane).map(|p| input[p]).fold(f32::NEG_INFINITY, larger_propagating_nan)
                    })
                    .collect();
                y.buffer.scatter(op, y, &d.y, &out)
            }
            Some(PoolGrads { dy, dx }) => {
                buffer_element(op, dy, e)?;
                buffer_element(op, dx, e)?;
                let (ys, dys) = (y.buffer.gather(op, y, &d.y)?, dy.buffer.gather(op, dy, &d.y)?);
                let mut out = vec![0f32; shape.planes * plane];
                for (i, (&max, &g)) in ys.iter().zip(&dys).enumerate() {
                    let base = i / out_plane * plane;
                    if let Some(p) = shape.window(i % out_plane).find(|&p| xs[base + p] == max) {
                        out[base + p] += g;
                    }
                }
                dx.buffer.scatter(op, dx, &d.x, &out)
            }
        }
    }

    fn activate(&self, act: DeviceActivation, maps: Maps, x: At<'_, HostBuffer>, y: At<'_, HostBuffer>) -> Result<()> {
        let op = "activation";
        buffer_element(op, x, maps.element)?;
        buffer_element(op, y, maps.element)?;
        let out: Vec<f32> = x
            .buffer
            .gather(op, x, &maps.dims)?
            .into_iter()
            .map(|v| match act {
                DeviceActivation::Relu => {
                    if v.is_nan() {
                        v
                    } else {
                        v.max(0.0)
                    }
                }
                DeviceActivation::Silu => (f64::from(v) * sigmoid(f64::from(v))) as f32,
            })
            .collect();
        y.buffer.scatter(op, y, &maps.dims, &out)
    }

    fn activate_backward(
        &self,
        act: DeviceActivation,
        maps: Maps,
        x: At<'_, HostBuffer>,
        y: At<'_, HostBuffer>,
        dy: At<'_, HostBuffer>,
        dx: At<'_, HostBuffer>,
    ) -> Result<()> {
        let op = "activation";
        [x, y, dy, dx].iter().try_for_each(|a| buffer_element(op, *a, maps.element))?;
        let (xs, ys, dys) =
            (x.buffer.gather(op, x, &maps.dims)?, y.buffer.gather(op, y, &maps.dims)?, dy.buffer.gather(op, dy, &maps.dims)?);
        let out: Vec<f32> = xs
            .iter()
            .zip(&ys)
            .zip(&dys)
            .map(|((&x, &y), &g)| match act {
                DeviceActivation::Relu => {
                    if y > 0.0 {
                        g
                    } else {
                        0.0
                    }
                }
                DeviceActivation::Silu => {
                    let s = sigmoid(f64::from(x));
                    (f64::from(g) * (s + f64::from(x) * s * (1.0 - s))) as f32
                }
            })
            .collect();
        dx.buffer.scatter(op, dx, &maps.dims, &out)
    }

    fn add_into(&self, maps: Maps, x: At<'_, HostBuffer>, y: At<'_, HostBuffer>) -> Result<()> {
        let op = "add";
        buffer_element(op, x, maps.element)?;
        buffer_element(op, y, maps.element)?;
        let (xs, ys) = (x.buffer.gather(op, x, &maps.dims)?, y.buffer.gather(op, y, &maps.dims)?);
        let out: Vec<f32> = xs.iter().zip(&ys).map(|(&a, &b)| (f64::from(a) + f64::from(b)) as f32).collect();
        y.buffer.scatter(op, y, &maps.dims, &out)
    }

    fn batch_norm(
        &self,
        call: NormCall,
        x: At<'_, HostBuffer>,
        scale: At<'_, HostBuffer>,
        bias: At<'_, HostBuffer>,
        y: At<'_, HostBuffer>,
        keep: bool,
    ) -> Result<Option<NormStatistics<HostBuffer>>> {
        let op = "batch_norm_train";
        let (channels, count, plane) = norm_sizes(&call)?;
        buffer_element(op, x, call.element)?;
        buffer_element(op, y, call.element)?;
        let per_channel = call.dims.per_channel;
        let xs = x.buffer.gather(op, x, &call.dims.x)?;
        let (gamma, beta) = (scale.buffer.gather(op, scale, &per_channel)?, bias.buffer.gather(op, bias, &per_channel)?);
        let m = count as f64;
        let mean: Vec<f64> = channel_sums(&xs, &xs, channels, plane, |v, _| v).iter().map(|s| s / m).collect();
        let squares = (0..channels)
            .map(|c| xs.chunks(plane).skip(c).step_by(channels).flatten().map(|&v| (f64::from(v) - mean[c]).powi(2)).sum::<f64>());
        let var: Vec<f64> = squares.map(|s| s / m).collect();
        let inv_std: Vec<f64> = var.iter().map(|v| 1.0 / (v + call.eps).sqrt()).collect();
        let out: Vec<f32> = xs
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let c = i / plane % channels;
                ((f64::from(v) - mean[c]) * inv_std[c] * f64::from(gamma[c]) + f64::from(beta[c])) as f32
            })
            .collect();
        y.buffer.scatter(op, y, &call.dims.x, &out)?;
        if !keep {
            return Ok(None);
        }
        let values = |v: &[f64]| v.iter().map(|&v| v as f32).collect::<Vec<f32>>();
        let stats = NormStatistics {
            mean: HostBuffer::made(Element::F32, values(&mean)),
            inv_std: HostBuffer::made(Element::F32, values(&inv_std)),
            unbiased_var: self.zeros_f32(channels)?,
        };
        // As cuDNN writes the running variance, `running * (1 - factor) +
        // unbiased * factor` with the passes' factor of 1: the running buffer
        // is read, so it must hold numbers.
        const FACTOR: f64 = 1.0;
        let unbiased: Vec<f32> = {
            let running = stats.unbiased_var.gather(op, At { buffer: &stats.unbiased_var, offset: 0 }, &per_channel)?;
            running.iter().zip(&var).map(|(&r, &v)| (f64::from(r) * (1.0 - FACTOR) + v * m / (m - 1.0) * FACTOR) as f32).collect()
        };
        stats.unbiased_var.scatter(op, At { buffer: &stats.unbiased_var, offset: 0 }, &per_channel, &unbiased)?;
        Ok(Some(stats))
    }

    fn batch_norm_backward(
        &self,
        call: NormCall,
        x: At<'_, HostBuffer>,
        dy: At<'_, HostBuffer>,
        scale: At<'_, HostBuffer>,
        stats: &NormStatistics<HostBuffer>,
        grads: NormGrads<'_, HostBuffer>,
    ) -> Result<()> {
        let op = "batch_norm_train";
        let (channels, count, plane) = norm_sizes(&call)?;
        [x, dy, grads.dx].iter().try_for_each(|a| buffer_element(op, *a, call.element))?;
        [scale, grads.dscale, grads.dbias].iter().try_for_each(|a| buffer_element(op, *a, Element::F32))?;
        let per_channel = call.dims.per_channel;
        let (xs, dys) = (x.buffer.gather(op, x, &call.dims.x)?, dy.buffer.gather(op, dy, &call.dims.x)?);
        let gamma = scale.buffer.gather(op, scale, &per_channel)?;
        let mean = stats.mean.gather(op, At { buffer: &stats.mean, offset: 0 }, &per_channel)?;
        let inv_std = stats.inv_std.gather(op, At { buffer: &stats.inv_std, offset: 0 }, &per_channel)?;
        let xhat = |i: usize, v: f32| {
            let c = i / plane % channels;
            (f64::from(v) - f64::from(mean[c])) * f64::from(inv_std[c])
        };
        let dbias = channel_sums(&dys, &dys, channels, plane, |g, _| g);
        let centred: Vec<f32> = xs.iter().enumerate().map(|(i, &v)| xhat(i, v) as f32).collect();
        let dscale = channel_sums(&dys, &centred, channels, plane, |g, h| g * h);
        let m = count as f64;
        let dx: Vec<f32> = dys
            .iter()
            .zip(&xs)
            .enumerate()
            .map(|(i, (&g, &v))| {
                let c = i / plane % channels;
                let k = f64::from(gamma[c]) * f64::from(inv_std[c]);
                (k * (f64::from(g) - dbias[c] / m - xhat(i, v) * dscale[c] / m)) as f32
            })
            .collect();
        grads.dx.buffer.scatter(op, grads.dx, &call.dims.x, &dx)?;
        let f32s = |v: &[f64]| v.iter().map(|&v| v as f32).collect::<Vec<f32>>();
        grads.dscale.buffer.scatter(op, grads.dscale, &per_channel, &f32s(&dscale))?;
        grads.dbias.buffer.scatter(op, grads.dbias, &per_channel, &f32s(&dbias))
    }

    fn gemm(&self, call: GemmCall, a: At<'_, HostBuffer>, b: At<'_, HostBuffer>, c: At<'_, HostBuffer>) -> Result<()> {
        let op = "gemm";
        let GemmCall { element, c_element, m, n, k, batch, beta, .. } = call;
        [a, b].iter().try_for_each(|x| buffer_element(op, *x, element))?;
        buffer_element(op, c, c_element)?;
        let stored = |rows: usize, cols: usize, t: bool| if t { (cols, rows) } else { (rows, cols) };
        let (ar, ac) = stored(m, k, call.a.transposed);
        let (br, bc) = stored(k, n, call.b.transposed);
        let (ad, bd, cd) = (matrices(ar, ac, call.a, batch)?, matrices(br, bc, call.b, batch)?, matrices(m, n, call.c, batch)?);
        let (av, bv) = (a.buffer.gather(op, a, &ad)?, b.buffer.gather(op, b, &bd)?);
        // With beta 0 cuBLAS does not read `c`: nothing it held may show.
        let cv = if beta == 0.0 { vec![0.0; batch * m * n] } else { c.buffer.gather(op, c, &cd)? };
        let at = |t: bool, cols: usize, i: usize, j: usize| if t { j * cols + i } else { i * cols + j };
        let mut out = vec![0f32; batch * m * n];
        out.par_chunks_mut((m * n).max(1)).enumerate().for_each(|(z, out)| {
            let (am, bm, cm) = (&av[z * ar * ac..][..ar * ac], &bv[z * br * bc..][..br * bc], &cv[z * m * n..][..m * n]);
            for i in 0..m {
                for j in 0..n {
                    let sum: f64 = (0..k)
                        .map(|l| f64::from(am[at(call.a.transposed, ac, i, l)]) * f64::from(bm[at(call.b.transposed, bc, l, j)]))
                        .sum();
                    out[i * n + j] = (sum + f64::from(beta) * f64::from(cm[i * n + j])) as f32;
                }
            }
        });
        c.buffer.scatter(op, c, &cd, &out)
    }

    fn add_bias(&self, maps: Maps, bias: At<'_, HostBuffer>, y: At<'_, HostBuffer>) -> Result<()> {
        let op = "add";
        buffer_element(op, bias, maps.element)?;
        buffer_element(op, y, maps.element)?;
        let [_, channels, h, w] = dims(&maps.dims);
        let per_channel = TensorDims::per_channel(op, channels)?;
        let (bv, yv) = (bias.buffer.gather(op, bias, &per_channel)?, y.buffer.gather(op, y, &maps.dims)?);
        let plane = (h * w).max(1);
        let out: Vec<f32> =
            yv.iter().enumerate().map(|(i, &v)| (f64::from(v) + f64::from(bv[i / plane % channels.max(1)])) as f32).collect();
        y.buffer.scatter(op, y, &maps.dims, &out)
    }

    fn bias_gradient(&self, maps: Maps, dy: At<'_, HostBuffer>, db: At<'_, HostBuffer>) -> Result<()> {
        let op = "bias gradient";
        buffer_element(op, dy, maps.element)?;
        buffer_element(op, db, maps.element)?;
        let [_, channels, h, w] = dims(&maps.dims);
        let dys = dy.buffer.gather(op, dy, &maps.dims)?;
        let sums: Vec<f32> = channel_sums(&dys, &dys, channels, h * w, |g, _| g).iter().map(|&s| s as f32).collect();
        db.buffer.scatter(op, db, &TensorDims::per_channel(op, channels)?, &sums)
    }

    fn softmax_rows(&self, call: SoftmaxCall, s: At<'_, HostBuffer>, p: At<'_, HostBuffer>, lse: At<'_, HostBuffer>) -> Result<()> {
        let op = "attention";
        let SoftmaxCall { element, rows, n, scale } = call;
        buffer_element(op, s, Element::F32)?;
        buffer_element(op, p, element)?;
        buffer_element(op, lse, Element::F32)?;
        let scores = s.buffer.gather(op, s, &flat(rows * n)?)?;
        let (mut out, mut sums) = (vec![0f32; rows * n], vec![0f32; rows]);
        for ((row, o), l) in scores.chunks(n.max(1)).zip(out.chunks_mut(n.max(1))).zip(&mut sums) {
            let shift = row.iter().map(|&v| f64::from(scale) * f64::from(v)).fold(f64::NEG_INFINITY, f64::max);
            let log_sum = shift + row.iter().map(|&v| (f64::from(scale) * f64::from(v) - shift).exp()).sum::<f64>().ln();
            o.iter_mut().zip(row).for_each(|(o, &v)| *o = (f64::from(scale) * f64::from(v) - log_sum).exp() as f32);
            *l = log_sum as f32;
        }
        p.buffer.scatter(op, p, &flat(rows * n)?, &out)?;
        lse.buffer.scatter(op, lse, &flat(rows)?, &sums)
    }

    fn probabilities(&self, call: SoftmaxCall, s: At<'_, HostBuffer>, lse: At<'_, HostBuffer>, p: At<'_, HostBuffer>) -> Result<()> {
        let op = "attention";
        let SoftmaxCall { element, rows, n, scale } = call;
        buffer_element(op, s, Element::F32)?;
        buffer_element(op, lse, Element::F32)?;
        buffer_element(op, p, element)?;
        let (scores, sums) = (s.buffer.gather(op, s, &flat(rows * n)?)?, lse.buffer.gather(op, lse, &flat(rows)?)?);
        let out: Vec<f32> = scores
            .iter()
            .enumerate()
            .map(|(i, &v)| (f64::from(scale) * f64::from(v) - f64::from(sums[i / n.max(1)])).exp() as f32)
            .collect();
        p.buffer.scatter(op, p, &flat(rows * n)?, &out)
    }

    fn attention_delta(&self, call: DeltaCall, dout: At<'_, HostBuffer>, out: At<'_, HostBuffer>, delta: At<'_, HostBuffer>) -> Result<()> {
        let op = "attention";
        let DeltaCall { element, tokens, heads, head_width } = call;
        buffer_element(op, dout, element)?;
        buffer_element(op, out, element)?;
        buffer_element(op, delta, Element::F32)?;
        let maps = flat(tokens * heads * head_width)?;
        let (g, o) = (dout.buffer.gather(op, dout, &maps)?, out.buffer.gather(op, out, &maps)?);
        let d = heads * head_width;
        let sums: Vec<f32> = (0..heads * tokens)
            .map(|r| {
                let (h, i) = (r / tokens, r % tokens);
                let at = i * d + h * head_width;
                (0..head_width).map(|c| f64::from(g[at + c]) * f64::from(o[at + c])).sum::<f64>() as f32
            })
            .collect();
        delta.buffer.scatter(op, delta, &flat(heads * tokens)?, &sums)
    }

    fn softmax_backward(
        &self,
        call: SoftmaxCall,
        p: At<'_, HostBuffer>,
        dp: At<'_, HostBuffer>,
        delta: At<'_, HostBuffer>,
        ds: At<'_, HostBuffer>,
    ) -> Result<()> {
        let op = "attention";
        let SoftmaxCall { element, rows, n, scale } = call;
        buffer_element(op, p, element)?;
        buffer_element(op, ds, element)?;
        buffer_element(op, dp, Element::F32)?;
        buffer_element(op, delta, Element::F32)?;
        let squares = flat(rows * n)?;
        let (pv, dpv, deltas) =
            (p.buffer.gather(op, p, &squares)?, dp.buffer.gather(op, dp, &squares)?, delta.buffer.gather(op, delta, &flat(rows)?)?);
        let out: Vec<f32> = pv
            .iter()
            .zip(&dpv)
            .enumerate()
            .map(|(i, (&p, &g))| (f64::from(p) * (f64::from(g) - f64::from(deltas[i / n.max(1)])) * f64::from(scale)) as f32)
            .collect();
        ds.buffer.scatter(op, ds, &squares, &out)
    }

    fn gelu(&self, e: Element, len: usize, x: At<'_, HostBuffer>, y: At<'_, HostBuffer>) -> Result<()> {
        let op = "gelu";
        buffer_element(op, x, e)?;
        buffer_element(op, y, e)?;
        let t = flat(len)?;
        let out: Vec<f32> = x
            .buffer
            .gather(op, x, &t)?
            .iter()
            .map(|&v| (0.5 * f64::from(v) * (1.0 + libm::erf(f64::from(v) * FRAC_1_SQRT_2))) as f32)
            .collect();
        y.buffer.scatter(op, y, &t, &out)
    }

    fn gelu_backward(&self, e: Element, len: usize, x: At<'_, HostBuffer>, dy: At<'_, HostBuffer>, dx: At<'_, HostBuffer>) -> Result<()> {
        let op = "gelu";
        [x, dy, dx].iter().try_for_each(|a| buffer_element(op, *a, e))?;
        let t = flat(len)?;
        let (xs, dys) = (x.buffer.gather(op, x, &t)?, dy.buffer.gather(op, dy, &t)?);
        let out: Vec<f32> = xs
            .iter()
            .zip(&dys)
            .map(|(&v, &g)| {
                let v = f64::from(v);
                let cdf = 0.5 * (1.0 + libm::erf(v * FRAC_1_SQRT_2));
                let density = (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt();
                (f64::from(g) * (cdf + v * density)) as f32
            })
            .collect();
        dx.buffer.scatter(op, dx, &t, &out)
    }

    fn layer_norm(
        &self,
        call: RowsCall,
        x: At<'_, HostBuffer>,
        w: At<'_, HostBuffer>,
        b: At<'_, HostBuffer>,
        y: At<'_, HostBuffer>,
    ) -> Result<()> {
        let op = "layer_norm";
        let RowsCall { element, rows, features, eps } = call;
        buffer_element(op, x, element)?;
        buffer_element(op, y, element)?;
        buffer_element(op, w, Element::F32)?;
        buffer_element(op, b, Element::F32)?;
        let (maps, per_feature) = (flat(rows * features)?, flat(features)?);
        let (xs, ws, bs) = (x.buffer.gather(op, x, &maps)?, w.buffer.gather(op, w, &per_feature)?, b.buffer.gather(op, b, &per_feature)?);
        let mut out = vec![0f32; xs.len()];
        for (row, o) in xs.chunks(features.max(1)).zip(out.chunks_mut(features.max(1))) {
            let (mean, rstd) = row_statistics(row, eps);
            for (((o, &v), &w), &b) in o.iter_mut().zip(row).zip(&ws).zip(&bs) {
                *o = ((f64::from(v) - mean) * rstd * f64::from(w) + f64::from(b)) as f32;
            }
        }
        y.buffer.scatter(op, y, &maps, &out)
    }

    fn layer_norm_backward(
        &self,
        call: RowsCall,
        x: At<'_, HostBuffer>,
        w: At<'_, HostBuffer>,
        dy: At<'_, HostBuffer>,
        grads: LayerNormGrads<'_, HostBuffer>,
    ) -> Result<()> {
        let op = "layer_norm";
        let RowsCall { element, rows, features, eps } = call;
        [x, dy, grads.dx].iter().try_for_each(|a| buffer_element(op, *a, element))?;
        [w, grads.dweight, grads.dbias].iter().try_for_each(|a| buffer_element(op, *a, Element::F32))?;
        let (maps, per_feature) = (flat(rows * features)?, flat(features)?);
        let (xs, ws, dys) = (x.buffer.gather(op, x, &maps)?, w.buffer.gather(op, w, &per_feature)?, dy.buffer.gather(op, dy, &maps)?);
        let (mut dx, mut dw, mut db) = (vec![0f32; xs.len()], vec![0f64; features], vec![0f64; features]);
        let d = features.max(1);
        for ((row, grad), out) in xs.chunks(d).zip(dys.chunks(d)).zip(dx.chunks_mut(d)) {
            let (mean, rstd) = row_statistics(row, eps);
            let xhat: Vec<f64> = row.iter().map(|&v| (f64::from(v) - mean) * rstd).collect();
            let g: Vec<f64> = grad.iter().zip(&ws).map(|(&g, &w)| f64::from(g) * f64::from(w)).collect();
            let mean_g = g.iter().sum::<f64>() / d as f64;
            let mean_gx = g.iter().zip(&xhat).map(|(g, h)| g * h).sum::<f64>() / d as f64;
            for i in 0..features {
                out[i] = (rstd * (g[i] - mean_g - xhat[i] * mean_gx)) as f32;
                dw[i] += f64::from(grad[i]) * xhat[i];
                db[i] += f64::from(grad[i]);
            }
        }
        let f32s = |v: &[f64]| v.iter().map(|&v| v as f32).collect::<Vec<f32>>();
        grads.dx.buffer.scatter(op, grads.dx, &maps, &dx)?;
        grads.dweight.buffer.scatter(op, grads.dweight, &per_feature, &f32s(&dw))?;
        grads.dbias.buffer.scatter(op, grads.dbias, &per_feature, &f32s(&db))
    }

    fn tensor(&self, buffer: HostBuffer, shape: Shape) -> Result<Tensor> {
        Ok(Tensor::from_storage(Storage::Cpu(buffer.into_cpu("reference")?), shape, BackpropOp::none(), false))
    }

    fn into_storage(buffer: HostBuffer) -> Result<CpuStorage> {
        buffer.into_cpu("reference")
    }

    fn hold<'a>(op: &'static str, storage: &'a CpuStorage, layout: &'a Layout) -> Result<Held<'a, HostBuffer>> {
        Ok(Held::Owned(Made { buffer: HostBuffer::from_cpu(op, storage, layout)?, shape: layout.shape().clone() }))
    }

    fn of_tensor(op: &'static str, t: &Tensor) -> Result<Self> {
        if t.device().is_cpu() {
            Ok(Reference)
        } else {
            Err(OpError::NotOnCpu { op, device: format!("{:?}", t.device().location()) }.into())
        }
    }

    fn with_tensor<R>(op: &'static str, t: &Tensor, f: impl FnOnce(super::primitives::Arg<'_, HostBuffer>) -> Result<R>) -> Result<R> {
        let held = {
            let (storage, layout) = t.storage_and_layout();
            match &*storage {
                Storage::Cpu(cpu) => Made { buffer: HostBuffer::from_cpu(op, cpu, layout)?, shape: layout.shape().clone() },
                other => Err(OpError::NotOnCpu { op, device: format!("{:?}", other.device().location()) })?,
            }
        };
        f(held.arg())
    }
}

#[cfg(test)]
impl HostBuffer {
    pub fn of(element: Element, values: &[f32]) -> Self {
        HostBuffer { element, values: RwLock::new(values.iter().map(|&v| rounded(element, v)).collect()), device_bytes: 0 }
    }

    pub fn values(&self) -> Vec<f32> {
        self.values.read().map(|v| v.clone()).unwrap_or_default()
    }
}
