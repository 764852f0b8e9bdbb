use std::fmt;

use serde::{Deserialize, Serialize};

/// The lesson's five bills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BillKind {
    Parameters,
    OptimizerState,
    Activations,
    InputBatch,
    ContextAndWorkspace,
}

impl BillKind {
    pub const ALL: [BillKind; 5] =
        [BillKind::Parameters, BillKind::OptimizerState, BillKind::Activations, BillKind::InputBatch, BillKind::ContextAndWorkspace];

    pub fn title(self) -> &'static str {
        match self {
            BillKind::Parameters => "1. parameters",
            BillKind::OptimizerState => "2. optimizer state",
            BillKind::Activations => "3. activations",
            BillKind::InputBatch => "4. input batch",
            BillKind::ContextAndWorkspace => "5. context and workspace",
        }
    }
}

impl fmt::Display for BillKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.title())
    }
}

/// One named amount inside a bill.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Line {
    pub label: String,
    pub bytes: u64,
}

/// A bill: its lines and their sum. Each line is resident at some point of
/// the step; they need not all be resident at once (that is the peak's job).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Bill {
    pub kind: BillKind,
    pub bytes: u64,
    pub lines: Vec<Line>,
}

impl Bill {
    pub(crate) fn new(kind: BillKind, lines: Vec<Line>) -> Self {
        let lines: Vec<Line> = lines.into_iter().filter(|l| l.bytes > 0).collect();
        Bill { kind, bytes: lines.iter().map(|l| l.bytes).sum(), lines }
    }
}

pub(crate) fn line(label: impl Into<String>, bytes: u64) -> Line {
    Line { label: label.into(), bytes }
}
