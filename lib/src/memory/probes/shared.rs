//! Values every copy of this crate in the process sees. Each cell library
//! links its own copy, so a plain `static` holds one value per cell: the
//! trainer's record of an out-of-memory step would be invisible to the cell
//! that investigates it. Where the counters have their region (the vramlab
//! kernel's cell process, the vramlab command) the values live there, one
//! JSON object; elsewhere in this copy's own static.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::{counters, region};

static LOCAL: Mutex<BTreeMap<String, Value>> = Mutex::new(BTreeMap::new());

fn region() -> Option<&'static counters::Counters> {
    counters::find().filter(|c| c.region_bytes.load(std::sync::atomic::Ordering::Relaxed) as usize == region::REGION_BYTES)
}

fn read_all() -> BTreeMap<String, Value> {
    match region() {
        Some(c) => region::read_shared(c).and_then(|bytes| serde_json::from_slice(&bytes).ok()).unwrap_or_default(),
        None => LOCAL.lock().unwrap_or_else(|e| e.into_inner()).clone(),
    }
}

fn write_all(values: BTreeMap<String, Value>) {
    let Some(c) = region() else {
        *LOCAL.lock().unwrap_or_else(|e| e.into_inner()) = values;
        return;
    };
    let written =
        serde_json::to_vec(&values).map_err(|e| e.to_string()).and_then(|bytes| region::write_shared(c, &bytes).map_err(|e| e.to_string()));
    if let Err(err) = written {
        eprintln!("vramlab: a record shared between cells was not kept: {err}");
    }
}

/// Sets (or with `None` removes) the value under `key`. Two copies writing
/// at the same moment may lose one write: the values are records of what
/// happened last, written by the thread running cells.
pub(crate) fn store<T: Serialize>(key: &str, value: Option<&T>) {
    let mut values = read_all();
    match value.and_then(|v| serde_json::to_value(v).ok()) {
        Some(value) => values.insert(key.to_owned(), value),
        None => values.remove(key),
    };
    write_all(values);
}

/// The value under `key`, when one of this type is there.
pub(crate) fn load<T: DeserializeOwned>(key: &str) -> Option<T> {
    read_all().remove(key).and_then(|v| serde_json::from_value(v).ok())
}

/// The value under `key` in the region of `counters` (another process's, mapped here).
pub(crate) fn load_in<T: DeserializeOwned>(counters: &counters::Counters, key: &str) -> Option<T> {
    let values: BTreeMap<String, Value> = serde_json::from_slice(&region::read_shared(counters)?).ok()?;
    values.get(key).cloned().and_then(|v| serde_json::from_value(v).ok())
}
