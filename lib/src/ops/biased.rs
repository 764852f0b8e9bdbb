//! An op of `(x, weight)` with an optional bias as one candle op: `(x,
//! weight)` is a [`CustomOp2`], `(x, weight, bias)` a [`CustomOp3`], and
//! backward makes only the gradients of the operands that need one.

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::checked_gradients;

/// A CPU operand: its storage and layout.
pub(super) type Operand<'a> = (&'a CpuStorage, &'a Layout);

/// What an op with an optional bias computes: its forward on the CPU, and
/// each operand's gradient from the output's (contiguous).
pub(super) trait WithBias: Send + Sync {
    const NAME: &'static str;

    fn forward(&self, x: Operand, weight: Operand, bias: Option<Operand>) -> Result<(CpuStorage, Shape)>;
    /// `x`'s gradient, from the output's, the weight and `x` itself (which
    /// an op that reads its input through an activation needs).
    fn input_gradient(&self, grad: &Tensor, weight: &Tensor, x: &Tensor) -> Result<Tensor>;
    fn weight_gradient(&self, grad: &Tensor, x: &Tensor) -> Result<Tensor>;
    fn bias_gradient(&self, grad: &Tensor) -> Result<Tensor>;

    /// The forward on CUDA, for an op with a device body (the others are
    /// composed of candle's operations there and never reach this).
    #[cfg(feature = "cuda")]
    fn cuda_forward(&self, x: CudaOperand, weight: CudaOperand, bias: Option<CudaOperand>) -> Result<(CudaStorage, Shape)> {
        let _ = (x, weight, bias);
        Err(super::OpError::NotOnCpu { op: Self::NAME, device: "CUDA".to_owned() }.into())
    }
}

/// A CUDA operand: its storage and layout.
#[cfg(feature = "cuda")]
pub(super) type CudaOperand<'a> = (&'a CudaStorage, &'a Layout);

/// `x.apply_op2(&weight, Biased(op))` or `x.apply_op3(&weight, &bias, Biased(op))`.
pub(super) struct Biased<T>(pub T);

impl<T: WithBias> Biased<T> {
    /// The gradients of `x`, `weight` and `bias`, each `None` for an operand that needs none.
    pub(super) fn gradients(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let input = if x.track_op() { Some(self.0.input_gradient(&grad, weight, x)?) } else { None };
        let weight_grad = if weight.track_op() { Some(self.0.weight_gradient(&grad, x)?) } else { None };
        let [input, weight_grad] = checked_gradients(T::NAME, [x, weight], [input, weight_grad])?;
        let bias = match bias {
            Some(bias) if bias.track_op() => {
                let [grad] = checked_gradients(T::NAME, [bias], [Some(self.0.bias_gradient(&grad)?)])?;
                grad
            }
            _ => None,
        };
        Ok((input, weight_grad, bias))
    }
}

impl<T: WithBias> CustomOp2 for Biased<T> {
    fn name(&self) -> &'static str {
        T::NAME
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.0.forward((s1, l1), (s2, l2), None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        self.0.cuda_forward((s1, l1), (s2, l2), None)
    }

    fn bwd(&self, x: &Tensor, weight: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (input, weight, _) = self.gradients(x, weight, None, grad)?;
        Ok((input, weight))
    }
}

impl<T: WithBias> CustomOp3 for Biased<T> {
    fn name(&self) -> &'static str {
        T::NAME
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
        self.0.forward((s1, l1), (s2, l2), Some((s3, l3)))
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
        self.0.cuda_forward((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.gradients(x, weight, Some(bias), grad)
    }
}
