//! The linear layer, `y = x W^T + b`, as one op.
//!
//! candle's `x.matmul(&w.t())` followed by `broadcast_add(b)` makes two
//! tensors of the output's size, and its autograd keeps both until the loss
//! is dropped. This op makes one, and the graph keeps only that output (the
//! input is the layer before's output, kept anyway). On the CPU one gemm,
//! reading the weight transposed through its strides, accumulates the
//! product into rows pre-filled with the bias, or, for a few rows, writes
//! `y^T`, added transposed to the bias rows. Its backward makes each
//! gradient only for an operand that needs it: `dx = g W` and `dW = g^T x`
//! (g read transposed in place) by gemm, `db` as the column sums of `g`.
//!
//! The same op reads its input through a GELU ([`gelu_linear`]) and adds a
//! residual to its output ([`linear_residual`]), so that the lean
//! transformer block keeps neither the GELU's output nor the layer's output
//! beside the sum.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, CustomOp4, DType, Layout, Result, Shape, Tensor};
use multiversion::multiversion;
use rayon::prelude::*;

#[cfg(feature = "cuda")]
use super::biased::CudaOperand;
use super::biased::{Biased, Operand, WithBias};
use super::cpu::floats::{f32_view, round_to, rows_of, storage_from_f32, zeros};
use super::cpu::gemm::{matmul, parallelism, row_major, transposed};
use super::cpu::gemm_packing::{packing_bytes, Strides};
use super::cpu::CHUNK;
use super::cuda::{self, Reference};
use super::gelu::{gelu_backward, gelu_in_place, gelu_into};
use super::{checked_gradients, uses_own_kernels, OpError};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

const OP: &str = "linear";

/// `x` is `rows x in` or `batch x tokens x in` (any leading dimensions, one
/// matrix of their product's rows), `weight` is `out x in` (PyTorch's
/// layout), `bias` is `out` or `None`. Returns `... x out` in `x`'s dtype.
///
/// In f32, f16 and bf16 it is one op (computed in f32, stored in `x`'s
/// dtype; weight and bias must have `x`'s dtype) whose autograd keeps only
/// its output, on the CPU and on CUDA (cuBLAS's product, cuDNN's bias add
/// and bias gradient). Elsewhere and in other dtypes it is candle's `matmul`
/// and `broadcast_add`, whose autograd keeps both their outputs.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    fused_linear(false, x, weight, bias, None)
}

/// `linear(gelu(x), weight, bias)` as one op that keeps `x` (the layer
/// before's output, kept anyway) where the two ops one after the other keep
/// `gelu(x)` as well: the transformer MLP's second layer reading its GELU.
/// Backward computes `gelu(x)` again for the weight gradient, and the input
/// gradient is `(g W) * gelu'(x)`. Where [`linear`] is candle's operations,
/// this is candle's `gelu_erf` and [`linear`].
pub fn gelu_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    fused_linear(true, x, weight, bias, None)
}

/// `linear(x, weight, bias) + residual` as one op: a residual block's last
/// layer adding the block's input, where the add after the layer would
/// keep the layer's output until backward. `residual` has the output's
/// shape and its gradient is the output's. Without a bias the op takes a
/// zero one, which needs no gradient.
pub fn linear_residual(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, residual: &Tensor) -> Result<Tensor> {
    fused_linear(false, x, weight, bias, Some(residual))
}

/// [`gelu_linear`] with a residual added to its output, as [`linear_residual`].
pub fn gelu_linear_residual(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, residual: &Tensor) -> Result<Tensor> {
    fused_linear(true, x, weight, bias, Some(residual))
}

fn fused_linear(gelu: bool, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, residual: Option<&Tensor>) -> Result<Tensor> {
    let geometry = Geometry::of_dims(x.dims(), weight.dims(), bias.map(Tensor::dims))?;
    if let Some(residual) = residual {
        let out = with_last(x.dims(), geometry.outputs);
        if residual.shape() != &out {
            Err(OpError::ResidualShape { body: out.dims().to_vec(), residual: residual.dims().to_vec() })?
        }
    }
    if !uses_own_kernels(x) {
        let y = if gelu { composed(&x.gelu_erf()?, weight, bias, &geometry)? } else { composed(x, weight, bias, &geometry)? };
        return match residual {
            Some(residual) => y + residual,
            None => Ok(y),
        };
    }
    for other in std::iter::once(weight).chain(bias).chain(residual) {
        if other.dtype() != x.dtype() {
            Err(OpError::DTypeMismatch { op: OP, input: x.dtype(), other: other.dtype() })?
        }
    }
    let (x, weight, op) = (x.contiguous()?, weight.contiguous()?, Biased(Linear { geometry, gelu }));
    match (bias, residual) {
        (Some(bias), None) => x.apply_op3(&weight, &bias.contiguous()?, op),
        (None, None) => x.apply_op2(&weight, op),
        (bias, Some(residual)) => {
            let bias = match bias {
                Some(bias) => bias.contiguous()?,
                None => Tensor::zeros(geometry.outputs, x.dtype(), x.device())?,
            };
            x.apply_op4(&weight, &bias, &residual.contiguous()?, op)
        }
    }
}

/// Bytes the CPU op allocates while each of its passes runs, beyond its
/// operands and result, with rayon's thread pool as it is now. The backward
/// runs the gradient passes one after the other (input, weight, bias), each
/// only for an operand that needs it: it holds at most the largest of them
/// beyond the gradients it returns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinearScratch {
    pub forward: u64,
    pub input_gradient: u64,
    pub weight_gradient: u64,
    pub bias_gradient: u64,
}

impl LinearScratch {
    /// The largest of the passes.
    pub fn most(&self) -> u64 {
        self.forward.max(self.input_gradient).max(self.weight_gradient).max(self.bias_gradient)
    }
}

/// [`LinearScratch`] of a linear layer of `in_features -> out_features` on
/// `rows` rows in `dtype` (f32, f16 or bf16), with or without a bias (the
/// bias adds none). In f32: each gemm's packing, in a forward that writes
/// `y^T` first that buffer beside the larger of the packing and the result,
/// and nothing for the bias gradient. A half-precision pass also widens its
/// operands to f32 (the forward x and W, the input gradient the output
/// gradient and W, the weight gradient the output gradient and x, the bias
/// gradient the output gradient) and computes an f32 result; it then drops
/// the copies and narrows the result into its own dtype, so that the f32
/// result beside the narrowed one counts where it outweighs the rest:
/// `max(copies + f32 result + the f32 scratch - result, f32 result)`.
pub fn linear_scratch(rows: usize, in_features: usize, out_features: usize, dtype: DType) -> std::result::Result<LinearScratch, OpError> {
    fused_linear_scratch(Fused::default(), rows, in_features, out_features, dtype)
}

/// [`linear_scratch`] of a linear op that reads and adds what `fused` says.
/// One that reads its input through a GELU or a layer-norm makes the
/// input's f32 copy wherever it computes one from it: in f32 a buffer more
/// in the forward (and for the GELU in the weight gradient; a layer-norm's
/// backward runs the plain ops, whose rules count them), where the half
/// passes transform the copy they make anyway; for the GELU in half
/// precision an f32 copy of the input more in the input gradient, which
/// reads GELU's derivative from it. A residual added to the output is read
/// in place in f32, and through an f32 copy beside the result, before the
/// product, in half precision.
pub fn fused_linear_scratch(
    fused: Fused,
    rows: usize,
    in_features: usize,
    out_features: usize,
    dtype: DType,
) -> std::result::Result<LinearScratch, OpError> {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(OpError::UnsupportedDType { op: OP, dtype });
    }
    let g = Geometry { rows, inputs: in_features, outputs: out_features };
    let (m, i, o) = (rows, in_features, out_features);
    let parallelism = parallelism();
    let packing = |dims, dst, lhs, rhs| packing_bytes(dims, dst, lhs, rhs, parallelism);
    let floats = |count: usize| (count * size_of::<f32>()) as u64;
    let (x_rows, w_t) = (Strides::row_major(i), Strides::column_major(i));
    // What a pass holds beside its operands and the f32 result at its peak.
    let forward = if g.transposes() {
        packing((m, o, i), Strides::column_major(m), x_rows, w_t).max(floats(m * o))
    } else {
        packing((m, o, i), Strides::row_major(o), x_rows, w_t)
    };
    let input_gradient = packing((m, i, o), Strides::row_major(i), Strides::row_major(o), Strides::row_major(i));
    let weight_gradient = packing((o, i, m), Strides::row_major(i), Strides::column_major(o), Strides::row_major(i));
    let transformed = if fused.reads == Reads::Input { 0 } else { m * i };
    let gelu = if fused.reads == Reads::Gelu { m * i } else { 0 };
    if dtype == DType::F32 {
        let (forward, weight_gradient) = (forward + floats(transformed), weight_gradient + floats(gelu));
        return Ok(LinearScratch { forward, input_gradient, weight_gradient, bias_gradient: 0 });
    }
    let half = |count: usize| (count * dtype.size_in_bytes()) as u64;
    let pass =
        |copies: usize, result: usize, beside: u64| (floats(copies + result) + beside).saturating_sub(half(result)).max(floats(result));
    // The residual's f32 copy is made beside the result (and beside `y^T`, which is added to it after).
    let forward = match (fused.adds_residual, g.transposes()) {
        (false, _) => forward,
        (true, false) => forward.max(floats(m * o)),
        (true, true) => forward.max(floats(2 * m * o)),
    };
    Ok(LinearScratch {
        forward: pass(m * i + o * i, m * o, forward),
        input_gradient: pass(m * o + o * i + gelu, m * i, input_gradient),
        weight_gradient: pass(m * o + m * i, o * i, weight_gradient),
        bias_gradient: pass(m * o, o, 0),
    })
}

/// The same from candle's operations, differentiable by candle's autograd:
/// the product and the sum are two tensors of the output's size, both kept.
pub(super) fn composed(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, g: &Geometry) -> Result<Tensor> {
    let product = x.reshape((g.rows, g.inputs))?.matmul(&weight.t()?)?;
    let y = match bias {
        Some(bias) => product.broadcast_add(bias)?,
        None => product,
    };
    y.reshape(with_last(x.dims(), g.outputs))
}

/// The shapes of one linear layer: `rows x inputs` in (the input's leading
/// dimensions flattened), `rows x outputs` out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Geometry {
    pub rows: usize,
    pub inputs: usize,
    pub outputs: usize,
}

impl Geometry {
    pub fn of_dims(x: &[usize], weight: &[usize], bias: Option<&[usize]>) -> std::result::Result<Self, OpError> {
        let [leading @ .., inputs] = x else {
            return Err(OpError::LinearInput { dims: x.to_vec() });
        };
        if leading.is_empty() {
            return Err(OpError::LinearInput { dims: x.to_vec() });
        }
        let &[outputs, weight_inputs] = weight else {
            return Err(OpError::LinearWeight { input: x.to_vec(), weight: weight.to_vec(), features: *inputs });
        };
        if weight_inputs != *inputs {
            return Err(OpError::LinearWeight { input: x.to_vec(), weight: weight.to_vec(), features: *inputs });
        }
        if let Some(bias) = bias.filter(|&bias| bias != [outputs]) {
            return Err(OpError::LinearBias { weight: weight.to_vec(), bias: bias.to_vec() });
        }
        Ok(Self { rows: leading.iter().product(), inputs: *inputs, outputs })
    }

    /// Whether the forward has gemm write `y^T` and adds it, transposed, to
    /// the bias rows. Writing a row-major `y`, gemm packs the whole weight,
    /// read across its rows, however few the rows; writing `y^T` it packs `x`
    /// instead, and the transposition costs `rows x out`. The first costs
    /// about `in x out`, the second `rows x (in + out)`, and the ratio
    /// `in x out / (in + out)` is within a factor 2 of the smaller of `in`
    /// and `out`: a quarter of that is where the two met or the transposed
    /// one still won, measured from 192 -> 768 to 768 -> 3072 (32 rows of
    /// 512 -> 1000: 0.25 ms instead of 0.95 ms, and 128 KB of scratch
    /// instead of gemm's 2 MB).
    fn transposes(&self) -> bool {
        self.rows * 4 <= self.inputs.min(self.outputs)
    }
}

/// `dims` with its last dimension set to `last`.
pub(super) fn with_last(dims: &[usize], last: usize) -> Shape {
    let mut dims = dims.to_vec();
    if let Some(d) = dims.last_mut() {
        *d = last;
    }
    dims.into()
}

/// What a linear layer's product reads: its input, or what an op before it
/// makes of it inside the same op (the lean layers' transformer MLP and
/// norms: the op keeps the input and makes the rest again in backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reads {
    #[default]
    Input,
    /// Its GELU ([`gelu_linear`]).
    Gelu,
    /// Its layer-norm (the op `norm_linear`).
    Norm,
}

/// What a linear op reads, and whether it adds a residual to its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Fused {
    pub reads: Reads,
    pub adds_residual: bool,
}

/// The operand the product reads, in f32: `x` itself, or its GELU in a
/// buffer of its own, rounded to `x`'s dtype as the GELU's output would be.
fn product_operand<'a>(op: &'static str, x: Operand<'a>, gelu: bool) -> Result<Cow<'a, [f32]>> {
    let values = f32_view(op, x.0, x.1)?;
    if !gelu {
        return Ok(values);
    }
    let mut activated = match values {
        Cow::Borrowed(x) => {
            let mut out = vec![0f32; x.len()];
            out.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(out, x)| gelu_into(x, out));
            out
        }
        Cow::Owned(mut copy) => {
            copy.par_chunks_mut(CHUNK).for_each(gelu_in_place);
            copy
        }
    };
    round_to(x.0.dtype(), &mut activated);
    Ok(activated.into())
}

/// The linear layer, a candle op through [`Biased`].
struct Linear {
    geometry: Geometry,
    /// Whether the product reads the input's GELU.
    gelu: bool,
}

impl Geometry {
    pub(super) fn on_device(&self) -> cuda::Linear {
        cuda::Linear { rows: self.rows, inputs: self.inputs, outputs: self.outputs }
    }
}

impl Linear {
    /// The forward on a device body, with or without a bias.
    fn device_forward<P: cuda::Primitives>(
        &self,
        x: (&P::Storage, &Layout),
        weight: (&P::Storage, &Layout),
        bias: Option<(&P::Storage, &Layout)>,
    ) -> Result<(P::Storage, Shape)> {
        let (l, gelu) = (self.geometry.on_device(), self.gelu);
        cuda::forward_with_bias::<P>(OP, x, weight, bias, |p, x, w, b| cuda::linear_forward_fused(p, l, gelu, x, w, b, None))
    }

    /// The forward on a device body with a bias and a residual added to the output.
    fn device_forward_adding<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 4]) -> Result<(P::Storage, Shape)> {
        let (l, gelu) = (self.geometry.on_device(), self.gelu);
        cuda::forward::<P, 4>(OP, operands, |p, [x, w, b, residual]| cuda::linear_forward_fused(p, l, gelu, x, w, Some(b), Some(residual)))
    }

    /// `x W^T + b + residual` on the CPU, `residual` in the output's shape.
    fn forward_adding(&self, x: Operand, weight: Operand, bias: Option<Operand>, residual: Option<Operand>) -> Result<(CpuStorage, Shape)> {
        let g = &self.geometry;
        let y = {
            // Scoped, so that the f32 copies of half-precision operands are
            // freed before the result is narrowed.
            let (xs, w) = (product_operand(OP, x, self.gelu)?, f32_view(OP, weight.0, weight.1)?);
            g.product(&xs, &w, bias, residual)?
        };
        Ok((storage_from_f32(OP, y, x.0.dtype())?, with_last(x.1.dims(), g.outputs)))
    }
}

impl Geometry {
    /// `x W^T (+ b) (+ residual)` in f32: gemm reads the weight transposed
    /// through its strides and accumulates into rows pre-filled with the
    /// bias and the residual, or, for a few rows, writes `y^T`, added
    /// transposed to them.
    pub(super) fn product(&self, x: &[f32], w: &[f32], bias: Option<Operand>, residual: Option<Operand>) -> Result<Vec<f32>> {
        let (x_rows, w_t) = (row_major(x, self.inputs), transposed(w, self.inputs));
        let start_rows = || -> Result<Vec<f32>> {
            let mut rows = match bias {
                Some((storage, layout)) => rows_of(OP, storage, layout, self.rows)?,
                None => zeros(self.rows * self.outputs),
            };
            if let Some((storage, layout)) = residual {
                let residual = f32_view(OP, storage, layout)?;
                rows.par_chunks_mut(CHUNK).zip(residual.par_chunks(CHUNK)).for_each(|(rows, residual)| add(rows, residual));
            }
            Ok(rows)
        };
        let dims = (self.rows, self.outputs, self.inputs);
        Ok(if self.transposes() {
            let mut y_t = zeros(self.rows * self.outputs);
            matmul(&mut y_t, Strides::column_major(self.rows), dims, x_rows, w_t, false, parallelism());
            let mut y = start_rows()?;
            add_transposed(&y_t, self.rows, &mut y, self.outputs, self.outputs, self.rows);
            y
        } else {
            let mut y = start_rows()?;
            let accumulates = bias.is_some() || residual.is_some();
            matmul(&mut y, Strides::row_major(self.outputs), dims, x_rows, w_t, accumulates, parallelism());
            y
        })
    }
}

impl WithBias for Linear {
    const NAME: &'static str = OP;

    fn forward(&self, x: Operand, weight: Operand, bias: Option<Operand>) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.device_forward::<Reference>(x, weight, bias);
        }
        self.forward_adding(x, weight, bias, None)
    }

    fn input_gradient(&self, grad: &Tensor, weight: &Tensor, x: &Tensor) -> Result<Tensor> {
        if self.gelu {
            grad.apply_op3_no_bwd(weight, x, &GeluInputGradient(self.geometry))
        } else {
            grad.apply_op2_no_bwd(weight, &InputGradient(self.geometry))
        }
    }

    fn weight_gradient(&self, grad: &Tensor, x: &Tensor) -> Result<Tensor> {
        grad.apply_op2_no_bwd(x, &WeightGradient { geometry: self.geometry, gelu: self.gelu })
    }

    fn bias_gradient(&self, grad: &Tensor) -> Result<Tensor> {
        grad.apply_op1_no_bwd(&BiasGradient(self.geometry))
    }

    #[cfg(feature = "cuda")]
    fn cuda_forward(&self, x: CudaOperand, weight: CudaOperand, bias: Option<CudaOperand>) -> Result<(CudaStorage, Shape)> {
        self.device_forward::<cuda::Cudnn>(x, weight, bias)
    }
}

impl CustomOp4 for Biased<Linear> {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
        s4: &CpuStorage,
        l4: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.0.device_forward_adding::<Reference>([(s1, l1), (s2, l2), (s3, l3), (s4, l4)]);
        }
        self.0.forward_adding((s1, l1), (s2, l2), Some((s3, l3)), Some((s4, l4)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
        s4: &CudaStorage,
        l4: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.0.device_forward_adding::<cuda::Cudnn>([(s1, l1), (s2, l2), (s3, l3), (s4, l4)])
    }

    /// The residual's gradient is the output's, as it came.
    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        residual: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (input, weight, bias) = self.gradients(x, weight, Some(bias), grad)?;
        let [residual] = checked_gradients(OP, [residual], [residual.track_op().then(|| grad.clone())])?;
        Ok((input, weight, bias, residual))
    }
}

impl Geometry {
    /// `grad_out W`, in the input's shape and the gradient's dtype, on the gradient's body.
    pub(super) fn input_gradient_of(&self, grad: &Tensor, weight: &Tensor) -> Result<Tensor> {
        grad.apply_op2_no_bwd(weight, &InputGradient(*self))
    }

    /// `grad_out^T x`, `out x in`.
    pub(super) fn weight_gradient_of(&self, grad: &Tensor, x: &Tensor) -> Result<Tensor> {
        grad.apply_op2_no_bwd(x, &WeightGradient { geometry: *self, gelu: false })
    }

    /// The sum of `grad_out`'s rows.
    pub(super) fn bias_gradient_of(&self, grad: &Tensor) -> Result<Tensor> {
        grad.apply_op1_no_bwd(&BiasGradient(*self))
    }
}

/// `(grad_out, weight) -> grad_x = grad_out W`, in `x`'s shape.
struct InputGradient(Geometry);

impl CustomOp2 for InputGradient {
    fn name(&self) -> &'static str {
        "linear-grad-input"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.on_device::<Reference>([(s1, l1), (s2, l2)]);
        }
        let dx = self.0.input_gradient(self.name(), (s1, l1), (s2, l2), None)?;
        Ok((storage_from_f32(self.name(), dx, s1.dtype())?, with_last(l1.dims(), self.0.inputs)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(s1, l1), (s2, l2)])
    }
}

impl InputGradient {
    fn on_device<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 2]) -> Result<(P::Storage, Shape)> {
        let l = self.0.on_device();
        cuda::forward::<P, 2>("linear-grad-input", operands, |p, [dy, w]| cuda::linear_input_gradient(p, l, dy, w))
    }
}

impl Geometry {
    /// `dy W`, in f32; with `x`, times GELU's derivative at `x`, in place.
    fn input_gradient(&self, op: &'static str, dy: Operand, w: Operand, x: Option<Operand>) -> Result<Vec<f32>> {
        // Viewed first, so that the f32 copies of half operands are alive at once, as the scratch says.
        let (dy, w, x) = (f32_view(op, dy.0, dy.1)?, f32_view(op, w.0, w.1)?, x.map(|x| f32_view(op, x.0, x.1)).transpose()?);
        let mut dx = zeros(self.rows * self.inputs);
        let dims = (self.rows, self.inputs, self.outputs);
        matmul(
            &mut dx,
            Strides::row_major(self.inputs),
            dims,
            row_major(&dy, self.outputs),
            row_major(&w, self.inputs),
            false,
            parallelism(),
        );
        if let Some(x) = x {
            dx.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(dx, x)| gelu_backward(dx, x));
        }
        Ok(dx)
    }
}

/// `(grad_out, weight, x) -> grad_x = (grad_out W) * gelu'(x)`, in `x`'s
/// shape: [`gelu_linear`]'s input gradient.
struct GeluInputGradient(Geometry);

impl CustomOp3 for GeluInputGradient {
    fn name(&self) -> &'static str {
        "gelu-linear-grad-input"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.on_device::<Reference>([(s1, l1), (s2, l2), (s3, l3)]);
        }
        if s3.dtype() != s1.dtype() {
            Err(OpError::DTypeMismatch { op: self.name(), input: s3.dtype(), other: s1.dtype() })?
        }
        let dx = self.0.input_gradient(self.name(), (s1, l1), (s2, l2), Some((s3, l3)))?;
        Ok((storage_from_f32(self.name(), dx, s1.dtype())?, with_last(l1.dims(), self.0.inputs)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(s1, l1), (s2, l2), (s3, l3)])
    }
}

impl GeluInputGradient {
    /// The product's gradient, then GELU's backward from `x`: two buffers of `x`'s size.
    fn on_device<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 3]) -> Result<(P::Storage, Shape)> {
        let l = self.0.on_device();
        cuda::forward::<P, 3>(self.name(), operands, |p, [dy, w, x]| cuda::gelu_linear_input_gradient(p, l, dy, w, x))
    }
}

/// `(grad_out, x) -> grad_weight = grad_out^T x`, `out x in`, or `grad_out^T gelu(x)`.
struct WeightGradient {
    geometry: Geometry,
    gelu: bool,
}

impl CustomOp2 for WeightGradient {
    fn name(&self) -> &'static str {
        "linear-grad-weight"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.on_device::<Reference>([(s1, l1), (s2, l2)]);
        }
        let g = &self.geometry;
        let dw = {
            let (dy, x) = (f32_view(self.name(), s1, l1)?, product_operand(self.name(), (s2, l2), self.gelu)?);
            let mut dw = zeros(g.outputs * g.inputs);
            let dims = (g.outputs, g.inputs, g.rows);
            matmul(&mut dw, Strides::row_major(g.inputs), dims, transposed(&dy, g.outputs), row_major(&x, g.inputs), false, parallelism());
            dw
        };
        Ok((storage_from_f32(self.name(), dw, s1.dtype())?, (g.outputs, g.inputs).into()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(s1, l1), (s2, l2)])
    }
}

impl WeightGradient {
    fn on_device<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 2]) -> Result<(P::Storage, Shape)> {
        let l = self.geometry.on_device();
        let gelu = self.gelu;
        cuda::forward::<P, 2>("linear-grad-weight", operands, |p, [dy, x]| cuda::linear_weight_gradient_fused(p, l, gelu, dy, x))
    }
}

/// `grad_out -> grad_bias`, the sum of its rows.
struct BiasGradient(Geometry);

impl CustomOp1 for BiasGradient {
    fn name(&self) -> &'static str {
        "linear-grad-bias"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.on_device::<Reference>([(storage, layout)]);
        }
        let g = &self.0;
        let db = column_sums(&f32_view(self.name(), storage, layout)?, g.outputs);
        Ok((storage_from_f32(self.name(), db, storage.dtype())?, g.outputs.into()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(storage, layout)])
    }
}

impl BiasGradient {
    fn on_device<P: cuda::Primitives>(&self, operands: [(&P::Storage, &Layout); 1]) -> Result<(P::Storage, Shape)> {
        let l = self.0.on_device();
        cuda::forward::<P, 1>("linear-grad-bias", operands, |p, [dy]| cuda::linear_bias_gradient(p, l, dy))
    }
}

/// The runs of columns the threads sum are a multiple of this long, 64
/// bytes of sums, so that two threads seldom write one cache line.
const COLUMN_RUN: usize = 16;

/// The sum of the rows of `m` (rows `width` long). Each thread sums a run of
/// columns down all the rows, so that there are no partial sums to allocate
/// and add.
fn column_sums(m: &[f32], width: usize) -> Vec<f32> {
    let mut sums = vec![0f32; width];
    if width == 0 {
        return sums;
    }
    let run = width.div_ceil(rayon::current_num_threads().max(1)).next_multiple_of(COLUMN_RUN);
    sums.par_chunks_mut(run).enumerate().for_each(|(i, sums)| {
        for row in m.chunks_exact(width) {
            add(sums, &row[i * run..]);
        }
    });
    sums
}

/// `sums[j] += values[j]`.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn add(sums: &mut [f32], values: &[f32]) {
    for (s, v) in sums.iter_mut().zip(values) {
        *s += v;
    }
}

/// `dst[c * dst_stride + r] += src[r * src_stride + c]` for the `rows x
/// cols` matrix in `src`, in tiles that stay in the L1 cache.
fn add_transposed(src: &[f32], src_stride: usize, dst: &mut [f32], dst_stride: usize, rows: usize, cols: usize) {
    const TILE: usize = 32;
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for c in c0..(c0 + TILE).min(cols) {
                for r in r0..(r0 + TILE).min(rows) {
                    dst[c * dst_stride + r] += src[r * src_stride + c];
                }
            }
        }
    }
}
