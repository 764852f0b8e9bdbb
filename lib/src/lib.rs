//! vramlab: GPU memory in image training, on Candle.
//!
//! Everything a notebook cell can call. This crate knows nothing of Jupyter:
//! it renders to MIME bundles ([`render`]) that any front end can show.

pub use candle_core as candle;
pub use candle_nn;

pub mod checks;
pub mod cli;
pub mod data;
pub mod diagnose;
pub mod dist;
pub mod gpus;
pub mod learn;
pub mod ledger;
pub mod measured;
pub mod memory;
pub mod models;
pub mod oom;
pub mod ops;
pub mod peers;
pub mod render;
pub mod smoke;
pub mod train;
pub mod units;
