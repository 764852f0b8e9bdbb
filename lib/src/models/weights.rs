//! Saving and loading a [`Network`]'s parameters and buffers as safetensors,
//! under torchvision's names, so that torchvision's weights load.
//!
//! The ResNets' names are torchvision's already. EfficientNet's MBConv blocks
//! keep readable names for their parts here (`expand`, `depthwise`, `se`,
//! `project`), which the tables show; torchvision numbers them inside each
//! block's `block` (the 1x1 expansion first where the block has one, then
//! the depthwise convolution, the squeeze-excitation and the projection; in
//! a convolution's part, `0` the convolution and `1` its batch-norm), and the
//! files use its names. A vision transformer's tables name each encoder
//! layer's residual blocks (`encoder_layer_0.attention`, `.feedforward`) and
//! the attention's projections as linear layers (`attention.in_proj.weight`);
//! torchvision puts the layers under `encoder.layers`, has no block level,
//! keeps the projections in `self_attention` and calls the in-projection's
//! tensors `in_proj_weight` and `in_proj_bias`; the patch embedding's class
//! token and positions (`conv_proj.class_token`, `conv_proj.pos_embedding`
//! here) are its `class_token` and `encoder.pos_embedding`.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

use candle_core::Tensor;

use super::net::Network;

/// One way a file fails to match the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    Missing { name: String, shape: Vec<usize> },
    Unexpected { name: String, shape: Vec<usize> },
    Shape { name: String, expected: Vec<usize>, found: Vec<usize> },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::Missing { name, shape } => write!(f, "missing `{name}` {shape:?}"),
            Mismatch::Unexpected { name, shape } => {
                write!(f, "unexpected `{name}` {shape:?} (not in the network)")
            }
            Mismatch::Shape { name, expected, found } => write!(f, "`{name}`: the network has {expected:?}, the file {found:?}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("cannot save weights to {path}: {source}")]
    Save { path: PathBuf, source: Box<candle_core::Error> },
    #[error("cannot read weights from {path}: {source}")]
    Read { path: PathBuf, source: Box<candle_core::Error> },
    #[error("{path} does not fit {model}: {}", list(.mismatches))]
    Mismatch { path: PathBuf, model: String, mismatches: Vec<Mismatch> },
    #[error("cannot load `{name}` from {path}: {source}")]
    Load { path: PathBuf, name: String, source: Box<candle_core::Error> },
}

fn list(mismatches: &[Mismatch]) -> String {
    mismatches.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

/// The MBConv parts and where torchvision puts them: the part's index in
/// `block` counted after the expansion's, and the convolution's (0) or the
/// batch-norm's (1) slot in it; `None` for the squeeze-excitation, whose
/// `fc1` and `fc2` follow its index.
const MBCONV_PARTS: [(&str, usize, Option<usize>); 7] = [
    ("expand", 0, Some(0)),
    ("expand_bn", 0, Some(1)),
    ("depthwise", 0, Some(0)),
    ("depthwise_bn", 0, Some(1)),
    ("se", 1, None),
    ("project", 2, Some(0)),
    ("project_bn", 2, Some(1)),
];

/// torchvision's name for each of `names` (a network's own, in order).
pub fn torchvision_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let names: Vec<&str> = names.into_iter().collect();
    // The blocks (`features.I.R`) that begin with an expansion.
    let expanding: HashSet<&str> = names.iter().filter_map(|n| n.find(".expand.").map(|at| &n[..at])).collect();
    names
        .iter()
        .map(|name| {
            if name.ends_with(".class_token") {
                return "class_token".to_owned();
            }
            if name.ends_with(".pos_embedding") {
                return "encoder.pos_embedding".to_owned();
            }
            if name.starts_with("encoder_layer_") {
                let name = name
                    .replace(".attention.in_proj.", ".self_attention.in_proj_")
                    .replace(".attention.out_proj.", ".self_attention.out_proj.")
                    .replace(".attention.", ".")
                    .replace(".feedforward.", ".");
                return format!("encoder.layers.{name}");
            }
            let parts: Vec<&str> = name.split('.').collect();
            let found = parts
                .iter()
                .enumerate()
                .skip(3)
                .find_map(|(i, part)| MBCONV_PARTS.iter().find(|(p, ..)| p == part).map(|&(_, index, slot)| (i, index, slot)));
            let Some((i, index, slot)) = found.filter(|_| parts[0] == "features") else {
                return (*name).to_owned();
            };
            let block = parts[..i].join(".");
            let index = if parts[i].starts_with("expand") { 0 } else { index + usize::from(expanding.contains(block.as_str())) };
            let part = match slot {
                Some(slot) => format!("block.{index}.{slot}"),
                None => format!("block.{index}"),
            };
            [block.as_str(), part.as_str()].into_iter().chain(parts[i + 1..].iter().copied()).collect::<Vec<_>>().join(".")
        })
        .collect()
}

impl Network {
    /// Every parameter and buffer under its torchvision name.
    fn by_torchvision_name(&self) -> Vec<(String, &super::layers::Named)> {
        let slots: Vec<_> = self.params().iter().chain(self.buffers()).collect();
        torchvision_names(slots.iter().map(|s| s.name.as_str())).into_iter().zip(slots).collect()
    }

    /// Writes every parameter and buffer to one safetensors file, under torchvision's names.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), WeightsError> {
        let path = path.as_ref();
        let tensors: HashMap<String, Tensor> =
            self.by_torchvision_name().into_iter().map(|(name, named)| (name, named.var.as_tensor().clone())).collect();
        candle_core::safetensors::save(&tensors, path)
            .map_err(|source| WeightsError::Save { path: path.to_owned(), source: Box::new(source) })
    }

    /// Reads a safetensors file with torchvision's names into the network.
    /// Nothing changes unless every name and shape matches; otherwise the
    /// error lists each mismatch by name.
    pub fn load(&self, path: impl AsRef<Path>) -> Result<(), WeightsError> {
        let path = path.as_ref();
        let mut file = candle_core::safetensors::load(path, self.device())
            .map_err(|source| WeightsError::Read { path: path.to_owned(), source: Box::new(source) })?;
        let mut mismatches = Vec::new();
        let slots = self.by_torchvision_name();
        for (name, slot) in &slots {
            let expected = slot.var.dims().to_vec();
            match file.get(name) {
                None => mismatches.push(Mismatch::Missing { name: name.clone(), shape: expected }),
                Some(found) if found.dims() != expected.as_slice() => {
                    mismatches.push(Mismatch::Shape { name: name.clone(), expected, found: found.dims().to_vec() })
                }
                Some(_) => {}
            }
        }
        let mut unexpected: Vec<_> = file
            .iter()
            .filter(|(name, _)| !slots.iter().any(|(slot, _)| slot == *name))
            .map(|(name, tensor)| Mismatch::Unexpected { name: name.clone(), shape: tensor.dims().to_vec() })
            .collect();
        unexpected.sort_by_cached_key(ToString::to_string);
        mismatches.extend(unexpected);
        if !mismatches.is_empty() {
            return Err(WeightsError::Mismatch { path: path.to_owned(), model: self.spec().name.clone(), mismatches });
        }
        for (name, slot) in slots {
            let load = |source| WeightsError::Load { path: path.to_owned(), name: name.clone(), source: Box::new(source) };
            if let Some(tensor) = file.remove(&name) {
                let tensor = tensor.to_dtype(slot.var.dtype()).map_err(load)?;
                slot.var.set(&tensor).map_err(load)?;
            }
        }
        Ok(())
    }
}
