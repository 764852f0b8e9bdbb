//! Saving and loading a [`Network`]'s parameters and buffers as safetensors,
//! under torchvision's names.

use std::collections::HashMap;
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

impl Network {
    /// Writes every parameter and buffer to one safetensors file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), WeightsError> {
        let path = path.as_ref();
        let tensors: HashMap<String, Tensor> =
            self.params().iter().chain(self.buffers()).map(|named| (named.name.clone(), named.var.as_tensor().clone())).collect();
        candle_core::safetensors::save(&tensors, path)
            .map_err(|source| WeightsError::Save { path: path.to_owned(), source: Box::new(source) })
    }

    /// Reads a safetensors file into the network. Nothing changes unless every
    /// name and shape matches; otherwise the error lists each mismatch by name.
    pub fn load(&self, path: impl AsRef<Path>) -> Result<(), WeightsError> {
        let path = path.as_ref();
        let mut file = candle_core::safetensors::load(path, self.device())
            .map_err(|source| WeightsError::Read { path: path.to_owned(), source: Box::new(source) })?;
        let mut mismatches = Vec::new();
        let slots: Vec<_> = self.params().iter().chain(self.buffers()).collect();
        for slot in &slots {
            let expected = slot.var.dims().to_vec();
            match file.get(&slot.name) {
                None => mismatches.push(Mismatch::Missing { name: slot.name.clone(), shape: expected }),
                Some(found) if found.dims() != expected.as_slice() => {
                    mismatches.push(Mismatch::Shape { name: slot.name.clone(), expected, found: found.dims().to_vec() })
                }
                Some(_) => {}
            }
        }
        let mut unexpected: Vec<_> = file
            .iter()
            .filter(|(name, _)| !slots.iter().any(|slot| &slot.name == *name))
            .map(|(name, tensor)| Mismatch::Unexpected { name: name.clone(), shape: tensor.dims().to_vec() })
            .collect();
        unexpected.sort_by_cached_key(ToString::to_string);
        mismatches.extend(unexpected);
        if !mismatches.is_empty() {
            return Err(WeightsError::Mismatch { path: path.to_owned(), model: self.spec().name.clone(), mismatches });
        }
        for slot in slots {
            let load = |source| WeightsError::Load { path: path.to_owned(), name: slot.name.clone(), source: Box::new(source) };
            if let Some(tensor) = file.remove(&slot.name) {
                let tensor = tensor.to_dtype(slot.var.dtype()).map_err(load)?;
                slot.var.set(&tensor).map_err(load)?;
            }
        }
        Ok(())
    }
}
