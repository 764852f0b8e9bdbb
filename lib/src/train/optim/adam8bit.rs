use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::adam::AdamStep;
use super::{grad_of, require_beta, require_non_negative, tensor_bytes, DynamicMap};
use super::{OptimError, Optimizer};
use crate::models::SMALL_TENSOR_ELEMS;

const NAME: &str = "8-bit Adam";

/// Values sharing one f32 scale (absmax) in the quantised moments, as in bitsandbytes.
pub const BLOCK_SIZE: usize = 2048;

/// 8-bit Adam's hyperparameters; the defaults are bitsandbytes' `Adam8bit`'s.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Adam8bitConfig {
    /// Learning rate. Default 1e-3.
    pub lr: f64,
    /// Decay of the first moment. Default 0.9.
    pub beta1: f64,
    /// Decay of the second moment. Default 0.999.
    pub beta2: f64,
    /// Added to the bias-corrected `sqrt(v)`. Default 1e-8.
    pub eps: f64,
    /// Decoupled decay `p *= 1 - lr * weight_decay`, as bitsandbytes' 8-bit
    /// kernels apply it. Default 0.
    pub weight_decay: f64,
    /// Parameters with fewer elements keep f32 moments. Default 4096
    /// ([`SMALL_TENSOR_ELEMS`], bitsandbytes' `min_8bit_size`).
    pub min_8bit_size: usize,
}

impl Default for Adam8bitConfig {
    fn default() -> Self {
        Adam8bitConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, min_8bit_size: SMALL_TENSOR_ELEMS as usize }
    }
}

enum Moments {
    /// One u8 code per element and one f32 absmax per block, for m and for v.
    Quantized { m_codes: Tensor, v_codes: Tensor, m_absmax: Tensor, v_absmax: Tensor },
    /// Small tensors: f32 moments.
    Full { m: Tensor, v: Tensor },
}

impl Moments {
    fn bytes(&self) -> usize {
        match self {
            Moments::Quantized { m_codes, v_codes, m_absmax, v_absmax } => {
                [m_codes, v_codes, m_absmax, v_absmax].into_iter().map(tensor_bytes).sum()
            }
            Moments::Full { m, v } => tensor_bytes(m) + tensor_bytes(v),
        }
    }
}

struct State {
    step: u64,
    moments: Moments,
}

/// Adam with bitsandbytes' block-wise 8-bit moments: m and v are stored as codes
/// of the signed and unsigned [`DynamicMap`] scaled by each block's absmax. A
/// step dequantises a block, runs Adam's update in f32 with the fresh moments,
/// and quantises them again. The state lives on the parameter's device; the
/// arithmetic runs on the host, block-parallel.
pub struct Adam8bit {
    vars: Vec<Var>,
    config: Adam8bitConfig,
    states: Vec<Option<State>>,
    signed: DynamicMap,
    unsigned: DynamicMap,
}

impl Adam8bit {
    pub fn new(vars: Vec<Var>, config: Adam8bitConfig) -> Result<Self, OptimError> {
        require_non_negative(NAME, "lr", config.lr)?;
        require_beta(NAME, "beta1", config.beta1)?;
        require_beta(NAME, "beta2", config.beta2)?;
        require_non_negative(NAME, "eps", config.eps)?;
        require_non_negative(NAME, "weight_decay", config.weight_decay)?;
        if let Some((index, var)) = vars.iter().enumerate().find(|(_, v)| v.dtype() != DType::F32) {
            return Err(OptimError::NotF32 { optimizer: NAME, index, shape: var.dims().to_vec(), dtype: var.dtype() });
        }
        Ok(Adam8bit {
            states: (0..vars.len()).map(|_| None).collect(),
            vars,
            config,
            signed: DynamicMap::signed(),
            unsigned: DynamicMap::unsigned(),
        })
    }

    pub fn config(&self) -> &Adam8bitConfig {
        &self.config
    }

    fn new_state(&self, var: &Var) -> candle_core::Result<State> {
        let n = var.elem_count();
        let device = var.device();
        let moments = if n < self.config.min_8bit_size {
            Moments::Full { m: Tensor::zeros(n, DType::F32, device)?, v: Tensor::zeros(n, DType::F32, device)? }
        } else {
            let blocks = n.div_ceil(BLOCK_SIZE);
            Moments::Quantized {
                m_codes: Tensor::from_vec(vec![self.signed.encode(0.0); n], n, device)?,
                v_codes: Tensor::from_vec(vec![self.unsigned.encode(0.0); n], n, device)?,
                m_absmax: Tensor::zeros(blocks, DType::F32, device)?,
                v_absmax: Tensor::zeros(blocks, DType::F32, device)?,
            }
        };
        Ok(State { step: 0, moments })
    }

    fn update(&self, var: &Var, g: &Tensor, state: &mut State) -> candle_core::Result<()> {
        let device = var.device();
        let grad = g.flatten_all()?.to_vec1::<f32>()?;
        let mut param = var.flatten_all()?.to_vec1::<f32>()?;
        let c = &self.config;
        let k = AdamStep::new(c.lr, c.beta1, c.beta2, c.eps, state.step);
        let shrink = (1.0 - c.lr * c.weight_decay) as f32;
        let adam = |p: &mut f32, g: f32, m: &mut f32, v: &mut f32| {
            *m = k.first_moment(*m, g);
            *v = k.second_moment(*v, g);
            *p = *p * shrink + k.delta(*m, *v);
        };
        match &mut state.moments {
            Moments::Full { m, v } => {
                let mut ms = m.to_vec1::<f32>()?;
                let mut vs = v.to_vec1::<f32>()?;
                for (((p, &g), m), v) in param.iter_mut().zip(&grad).zip(&mut ms).zip(&mut vs) {
                    adam(p, g, m, v);
                }
                *m = to_device(ms, device)?;
                *v = to_device(vs, device)?;
            }
            Moments::Quantized { m_codes, v_codes, m_absmax, v_absmax } => {
                let mut mc = m_codes.to_vec1::<u8>()?;
                let mut vc = v_codes.to_vec1::<u8>()?;
                let mut ma = m_absmax.to_vec1::<f32>()?;
                let mut va = v_absmax.to_vec1::<f32>()?;
                param
                    .par_chunks_mut(BLOCK_SIZE)
                    .zip(grad.par_chunks(BLOCK_SIZE))
                    .zip(mc.par_chunks_mut(BLOCK_SIZE))
                    .zip(vc.par_chunks_mut(BLOCK_SIZE))
                    .zip(ma.par_iter_mut())
                    .zip(va.par_iter_mut())
                    .for_each(|(((((p, g), mc), vc), ma), va)| {
                        let mut m = [0f32; BLOCK_SIZE];
                        let mut v = [0f32; BLOCK_SIZE];
                        let len = p.len();
                        for j in 0..len {
                            m[j] = self.signed.decode(mc[j]) * *ma;
                            v[j] = self.unsigned.decode(vc[j]) * *va;
                            adam(&mut p[j], g[j], &mut m[j], &mut v[j]);
                        }
                        *ma = self.signed.quantize_block(&m[..len], mc);
                        *va = self.unsigned.quantize_block(&v[..len], vc);
                    });
                *m_codes = to_device(mc, device)?;
                *v_codes = to_device(vc, device)?;
                *m_absmax = to_device(ma, device)?;
                *v_absmax = to_device(va, device)?;
            }
        }
        var.set(&Tensor::from_vec(param, var.shape(), device)?)
    }
}

fn to_device<T: candle_core::WithDType>(values: Vec<T>, device: &Device) -> candle_core::Result<Tensor> {
    let n = values.len();
    Tensor::from_vec(values, n, device)
}

impl Optimizer for Adam8bit {
    fn name(&self) -> &'static str {
        NAME
    }

    fn vars(&self) -> &[Var] {
        &self.vars
    }

    fn step(&mut self, grads: &GradStore) -> Result<(), OptimError> {
        for (index, var) in self.vars.iter().enumerate() {
            let Some(g) = grad_of(grads, var, index)? else {
                continue;
            };
            let mut state = match self.states[index].take() {
                Some(state) => state,
                None => self.new_state(var)?,
            };
            state.step += 1;
            let result = self.update(var, &g.to_dtype(DType::F32)?, &mut state);
            self.states[index] = Some(state);
            result?;
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn state_bytes(&self) -> usize {
        self.states.iter().flatten().map(|s| s.moments.bytes()).sum()
    }
}
