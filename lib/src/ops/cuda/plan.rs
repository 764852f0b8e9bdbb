//! How cuDNN runs a convolution, decided on the host: the math type, the
//! choice of an algorithm among cuDNN's heuristics within the workspace and
//! the cache of plans by pass, shapes and element type. The cuda feature's
//! primitives use it; everything here is tested without a GPU.

use std::collections::HashMap;
use std::hash::Hash;

use super::descriptors::{ConvDims, Element};

impl Element {
    /// The convolutions' math: tensor cores for half precision; for f32 the
    /// default, which lets cuDNN use TF32 tensor cores on Ampere and later,
    /// as PyTorch's default (`torch.backends.cudnn.allow_tf32 = True`) does.
    pub fn math(self) -> Math {
        match self {
            Element::F32 => Math::DefaultAllowingTf32,
            Element::F16 | Element::Bf16 => Math::TensorCores,
        }
    }
}

/// cuDNN's math type for a convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Math {
    DefaultAllowingTf32,
    TensorCores,
}

/// One of the algorithms cuDNN's heuristics return for a convolution pass,
/// in their order: whether it can run this problem, and its workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate<A> {
    pub algo: A,
    pub supported: bool,
    pub workspace: u64,
}

/// The algorithm a pass runs with, and the workspace it uses of the device's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice<A> {
    pub algo: A,
    pub workspace: u64,
    /// Where it stood in the heuristics' order (0: their first choice).
    pub rank: usize,
}

/// The first of the heuristics' candidates, in their order, that supports
/// the problem and fits in `cap` bytes of workspace; `None` when none does.
pub fn choose<A: Copy>(candidates: &[Candidate<A>], cap: u64) -> Option<Choice<A>> {
    candidates.iter().enumerate().find(|(_, c)| c.supported && c.workspace <= cap).map(|(rank, c)| Choice {
        algo: c.algo,
        workspace: c.workspace,
        rank,
    })
}

/// The three passes of a convolution, each with its own algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConvPass {
    Forward,
    InputGradient,
    WeightGradient,
}

impl ConvPass {
    #[cfg(feature = "cuda")]
    pub fn name(self) -> &'static str {
        match self {
            ConvPass::Forward => "forward",
            ConvPass::InputGradient => "input gradient",
            ConvPass::WeightGradient => "weight gradient",
        }
    }
}

/// What a plan is cached under: the pass, the shapes and the element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvKey {
    pub pass: ConvPass,
    pub dims: ConvDims,
    pub element: Element,
}

/// Plans made once per key and kept: descriptors are created and algorithms
/// searched only the first time a shape is seen, so a step after the first
/// creates none. `made` counts the plans made, for the tests and the report.
#[derive(Debug)]
pub struct PlanCache<K, P> {
    plans: HashMap<K, P>,
    made: usize,
}

impl<K: Eq + Hash, P> Default for PlanCache<K, P> {
    fn default() -> Self {
        PlanCache { plans: HashMap::new(), made: 0 }
    }
}

impl<K: Eq + Hash + Copy, P> PlanCache<K, P> {
    /// The plan for `key`, made by `make` the first time.
    pub fn get_or_make<E>(&mut self, key: K, make: impl FnOnce(&K) -> Result<P, E>) -> Result<&P, E> {
        if !self.plans.contains_key(&key) {
            let plan = make(&key)?;
            self.made += 1;
            self.plans.insert(key, plan);
        }
        Ok(&self.plans[&key])
    }

    pub fn made(&self) -> usize {
        self.made
    }

    #[cfg(feature = "cuda")]
    pub fn plans(&self) -> impl Iterator<Item = (&K, &P)> {
        self.plans.iter()
    }
}
