//! What a run on a card reports of cuDNN's convolution plans, and the one
//! workspace they share.

/// The one workspace each device keeps for cuDNN, allocated whole on the
/// first convolution: every algorithm is chosen among those that fit it, so
/// the ledger counts exactly this. 64 MiB is under 1% of the lesson's 8 GB
/// card; whether cuDNN's heuristics keep their first choice for every zoo
/// convolution within it is what `conv_algorithms` reports on a GPU.
pub const WORKSPACE_BYTES: u64 = 64 << 20;

/// A convolution plan: the pass, the shapes, the algorithm cuDNN's
/// heuristics gave and the workspace it uses.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ConvAlgorithm {
    pub pass: &'static str,
    pub input: [i32; 4],
    pub filter: [i32; 4],
    pub groups: i32,
    pub element: String,
    pub algorithm: String,
    pub math: String,
    /// Where it stood in the heuristics' order: 0 where it is their first
    /// choice, more where those before it needed more workspace.
    pub rank: usize,
    pub workspace_bytes: u64,
}

/// The convolution plans of a run on CUDA, for `bench train`'s report.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CudnnPlans {
    pub algorithms: Vec<ConvAlgorithm>,
    /// Plans made during the timed steps: none once the warm-up has seen every shape.
    pub made_while_timed: usize,
}
