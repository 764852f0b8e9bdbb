//! Reading the connection file Jupyter hands to the kernel.

use std::path::Path;

use anyhow::{bail, Context};
use jupyter_protocol::{ConnectionInfo, Transport};

pub fn read(path: &Path) -> anyhow::Result<ConnectionInfo> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read connection file {}", path.display()))?;
    let info: ConnectionInfo = serde_json::from_str(&text)
        .with_context(|| format!("connection file {} is not a valid Jupyter connection file", path.display()))?;
    if info.transport != Transport::TCP {
        bail!("connection file {}: transport {:?} is not supported (only tcp)", path.display(), info.transport.to_string());
    }
    if !info.signature_scheme.is_empty() && info.signature_scheme != "hmac-sha256" {
        bail!("connection file {}: signature scheme {:?} is not supported (only hmac-sha256)", path.display(), info.signature_scheme);
    }
    Ok(info)
}
