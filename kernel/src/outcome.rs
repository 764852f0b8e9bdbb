//! What running a piece of a cell comes to: its final value, or the error
//! Jupyter shows. The engines produce it, the server and the magics return
//! it, and `display` turns it into messages.

use vramlab::render::Bundle;

/// A cell's error as Jupyter shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct CellError {
    pub ename: String,
    pub evalue: String,
    pub traceback: Vec<String>,
}

impl CellError {
    pub fn new(ename: &str, evalue: impl Into<String>, traceback: Vec<String>) -> Self {
        CellError { ename: ename.to_owned(), evalue: evalue.into(), traceback }
    }
}

/// The result of one piece of Rust code: its final value, if it has one.
pub type Outcome = Result<Option<Bundle>, CellError>;
