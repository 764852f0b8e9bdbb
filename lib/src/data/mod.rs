//! From disk to device: datasets, decoding, transforms, the loader, splits and the synthetic leaf-disease data.
