//! The cards people train on, and the device a ledger is checked against.
//!
//! `usable` is what the driver reports as the card's total (`nvidia-smi`'s
//! "Total", `cuMemGetInfo`'s total): less than the box says, because of ECC
//! and the driver's own reservations. `context` is a typical CUDA context
//! plus Candle's kernels and cuBLAS workspace on that generation with lazy
//! module loading. Hopper's is measured: 689 MiB in use outside the pool on
//! an H200 (driver 580.159.04, CUDA 13.0) once candle's first kernels had
//! run (`scripts/gpu_check.sh`, BENCHMARKS.md); the others are estimates
//! until measured (`%mem` reports the real one).
//!
//! # The room
//!
//! The card catalogue and the `Card` a ledger is checked against (a catalogue card, a size, the
//! host, or a card's budget simulated on the host, whose step runs the CPU's kernels and is costed
//! with their transients).

use std::fmt;

use serde::Serialize;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Context assumed for a card given only by its size (`--gpu 8GiB`).
pub const GENERIC_CONTEXT_BYTES: u64 = 300 * MIB;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    Pascal,
    Volta,
    Turing,
    Ampere,
    Ada,
    Hopper,
    Blackwell,
}

impl Arch {
    fn context_bytes(self) -> u64 {
        MIB * match self {
            Arch::Pascal => 250,
            Arch::Volta | Arch::Turing => 300,
            Arch::Ampere => 350,
            Arch::Ada => 400,
            Arch::Hopper => 690,
            Arch::Blackwell => 550,
        }
    }

    /// bf16 arithmetic in hardware arrived with Ampere.
    pub fn has_bf16(self) -> bool {
        !matches!(self, Arch::Pascal | Arch::Volta | Arch::Turing)
    }

    /// Tensor cores (fast f16 matmul) arrived with Volta.
    pub fn has_tensor_cores(self) -> bool {
        self != Arch::Pascal
    }
}

/// One catalogue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// The canonical `--gpu` spelling.
    pub id: &'static str,
    pub name: &'static str,
    pub arch: Arch,
    /// Memory on the box.
    pub total_bytes: u64,
    /// Memory the driver reports and allocations can use.
    pub usable_bytes: u64,
    pub context_bytes: u64,
    #[serde(skip)]
    aliases: &'static [&'static str],
}

const fn gpu(id: &'static str, name: &'static str, arch: Arch, total_gib: u64, usable_mib: u64, aliases: &'static [&'static str]) -> Gpu {
    Gpu { id, name, arch, total_bytes: total_gib * GIB, usable_bytes: usable_mib * MIB, context_bytes: 0, aliases }
}

const CATALOGUE: [Gpu; 36] = [
    gpu("rtx4060-laptop", "GeForce RTX 4060 Laptop GPU 8 GB", Arch::Ada, 8, 8188, &["4060laptop", "4060m", "4060mobile"]),
    gpu("rtx4050-laptop", "GeForce RTX 4050 Laptop GPU 6 GB", Arch::Ada, 6, 6141, &["4050laptop", "4050m"]),
    gpu("rtx4070-laptop", "GeForce RTX 4070 Laptop GPU 8 GB", Arch::Ada, 8, 8188, &["4070laptop", "4070m"]),
    gpu("rtx4080-laptop", "GeForce RTX 4080 Laptop GPU 12 GB", Arch::Ada, 12, 12282, &["4080laptop", "4080m"]),
    gpu("rtx4090-laptop", "GeForce RTX 4090 Laptop GPU 16 GB", Arch::Ada, 16, 16376, &["4090laptop", "4090m"]),
    gpu("rtx3050-laptop", "GeForce RTX 3050 Laptop GPU 4 GB", Arch::Ampere, 4, 4096, &["3050laptop", "3050m"]),
    gpu("rtx3060-laptop", "GeForce RTX 3060 Laptop GPU 6 GB", Arch::Ampere, 6, 6144, &["3060laptop", "3060m"]),
    gpu("gtx1080ti", "GeForce GTX 1080 Ti 11 GB", Arch::Pascal, 11, 11264, &["1080ti"]),
    gpu("rtx2080ti", "GeForce RTX 2080 Ti 11 GB", Arch::Turing, 11, 11264, &["2080ti"]),
    gpu("rtx3060", "GeForce RTX 3060 12 GB", Arch::Ampere, 12, 12288, &["3060", "306012gb"]),
    gpu("rtx3070", "GeForce RTX 3070 8 GB", Arch::Ampere, 8, 8192, &["3070"]),
    gpu("rtx3080", "GeForce RTX 3080 10 GB", Arch::Ampere, 10, 10240, &["3080", "308010gb"]),
    gpu("rtx3090", "GeForce RTX 3090 24 GB", Arch::Ampere, 24, 24576, &["3090"]),
    gpu("rtx4060", "GeForce RTX 4060 8 GB", Arch::Ada, 8, 8188, &["4060"]),
    gpu("rtx4060ti-16gb", "GeForce RTX 4060 Ti 16 GB", Arch::Ada, 16, 16380, &["4060ti16gb", "4060ti"]),
    gpu("rtx4070", "GeForce RTX 4070 12 GB", Arch::Ada, 12, 12282, &["4070"]),
    gpu("rtx4080", "GeForce RTX 4080 16 GB", Arch::Ada, 16, 16376, &["4080"]),
    gpu("rtx4090", "GeForce RTX 4090 24 GB", Arch::Ada, 24, 24564, &["4090"]),
    gpu("rtx5090", "GeForce RTX 5090 32 GB", Arch::Blackwell, 32, 32607, &["5090"]),
    gpu("rtx-a4000", "RTX A4000 16 GB", Arch::Ampere, 16, 16376, &["a4000"]),
    gpu("rtx-a6000", "RTX A6000 48 GB", Arch::Ampere, 48, 49140, &["a6000"]),
    gpu("rtx6000-ada", "RTX 6000 Ada Generation 48 GB", Arch::Ada, 48, 49140, &["6000ada"]),
    gpu("p100", "Tesla P100 16 GB", Arch::Pascal, 16, 16280, &["teslap100"]),
    gpu("t4", "Tesla T4 16 GB", Arch::Turing, 16, 15360, &["teslat4"]),
    gpu("v100-16gb", "Tesla V100 16 GB", Arch::Volta, 16, 16160, &["v10016"]),
    gpu("v100-32gb", "Tesla V100 32 GB", Arch::Volta, 32, 32510, &["v10032"]),
    gpu("a10", "A10 24 GB", Arch::Ampere, 24, 23028, &[]),
    gpu("a10g", "A10G 24 GB (AWS g5)", Arch::Ampere, 24, 23028, &[]),
    gpu("l4", "L4 24 GB", Arch::Ada, 24, 23034, &[]),
    gpu("l40s", "L40S 48 GB", Arch::Ada, 48, 46068, &[]),
    gpu("a100-40gb", "A100 40 GB", Arch::Ampere, 40, 40960, &["a10040"]),
    gpu("a100-80gb", "A100 80 GB", Arch::Ampere, 80, 81920, &["a10080"]),
    gpu("h100", "H100 80 GB", Arch::Hopper, 80, 81559, &["h10080gb", "h100sxm", "h100pcie"]),
    gpu("h100-nvl", "H100 NVL 94 GB", Arch::Hopper, 94, 95830, &["h100nvl"]),
    gpu("h200", "H200 141 GB", Arch::Hopper, 141, 143771, &["h200141gb"]),
    gpu("b200", "B200 180 GB", Arch::Blackwell, 180, 183359, &[]),
];

/// Names that exist in more than one memory size: asking for them alone is ambiguous.
const AMBIGUOUS: [(&str, &[&str]); 2] = [("a100", &["a100-40gb", "a100-80gb"]), ("v100", &["v100-16gb", "v100-32gb"])];

/// Every card in the catalogue.
pub fn catalogue() -> impl Iterator<Item = Gpu> {
    CATALOGUE.iter().map(|g| Gpu { context_bytes: g.arch.context_bytes(), ..*g })
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    #[error("unknown GPU `{name}`; closest: {closest}; or give a size such as 8GiB, or cpu")]
    Unknown { name: String, closest: String },
    #[error("`{name}` comes in several sizes: {choices}")]
    Ambiguous { name: String, choices: String },
    #[error(transparent)]
    BadSize(#[from] crate::units::SizeError),
    #[error("cannot read the host's memory from /proc/meminfo: {reason}")]
    HostMemory { reason: String },
    #[cfg(feature = "cuda")]
    #[error("cannot read the CUDA device's name and memory: {reason}")]
    Device { reason: String },
}

/// Finds a catalogue card by a forgiving name: case, spaces, dashes, vendor
/// words (`NVIDIA`, `GeForce`, `Tesla`) and a trailing `GB` don't matter.
pub fn lookup(name: &str) -> Result<Gpu, GpuError> {
    let key = normalize(name);
    if let Some((_, choices)) = AMBIGUOUS.iter().find(|(k, _)| *k == key) {
        return Err(GpuError::Ambiguous { name: name.to_owned(), choices: choices.join(", ") });
    }
    catalogue().find(|g| keys(g).any(|k| k == key)).ok_or_else(|| GpuError::Unknown { name: name.to_owned(), closest: closest(&key) })
}

fn keys(gpu: &Gpu) -> impl Iterator<Item = String> + '_ {
    let id = normalize(gpu.id);
    let bare = id.strip_prefix("rtx").or_else(|| id.strip_prefix("gtx")).map(str::to_owned);
    std::iter::once(id).chain(bare).chain(gpu.aliases.iter().map(|a| normalize(a)))
}

fn normalize(name: &str) -> String {
    let mut key: String = name.chars().filter(|c| c.is_ascii_alphanumeric()).map(|c| c.to_ascii_lowercase()).collect();
    for vendor in ["nvidia", "geforce", "tesla", "quadro"] {
        if let Some(rest) = key.strip_prefix(vendor) {
            key = rest.to_owned();
        }
    }
    if let Some(rest) = key.strip_suffix("gb") {
        key = rest.to_owned();
    }
    key.replace("gpu", "")
}

/// The three catalogue ids nearest to `key` by edit distance.
fn closest(key: &str) -> String {
    let mut scored: Vec<(usize, &str)> =
        catalogue().map(|g| (keys(&g).map(|k| strsim::levenshtein(key, &k)).min().unwrap_or(usize::MAX), g.id)).collect();
    scored.sort();
    scored.iter().take(3).map(|(_, id)| *id).collect::<Vec<_>>().join(", ")
}

/// What a ledger is checked against: a catalogue card, a card given by size, or the host.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Card {
    pub name: String,
    pub kind: CardKind,
    pub total_bytes: u64,
    pub usable_bytes: u64,
    pub context_bytes: u64,
    pub bf16: bool,
    pub tensor_cores: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CardKind {
    Catalogue,
    Sized,
    Cpu,
    /// A card's budget simulated on the host (`measure --budget`,
    /// `cpu_with_budget`): its size and context, with the step running our
    /// CPU kernels.
    Simulated,
}

impl Card {
    /// `cpu`, a size (`8GiB`, `12GB`, `7.5 GiB`, `16384MiB`) or a catalogue name.
    pub fn parse(text: &str) -> Result<Card, GpuError> {
        let trimmed = text.trim();
        if trimmed.eq_ignore_ascii_case("cpu") {
            return Card::host();
        }
        if trimmed.starts_with(|c: char| c.is_ascii_digit()) {
            if let Some(bytes) = parse_size(trimmed)? {
                return Ok(Card::sized(bytes));
            }
        }
        lookup(trimmed).map(Card::from)
    }

    /// A generic CUDA card of `bytes`, with a typical context.
    pub fn sized(bytes: u64) -> Card {
        Card {
            name: format!("{} card", crate::units::human(bytes)),
            kind: CardKind::Sized,
            total_bytes: bytes,
            usable_bytes: bytes,
            context_bytes: GENERIC_CONTEXT_BYTES,
            bf16: true,
            tensor_cores: true,
        }
    }

    /// The host: usable is what `/proc/meminfo` calls available now; no CUDA context.
    pub fn host() -> Result<Card, GpuError> {
        let meminfo = std::fs::read_to_string("/proc/meminfo").map_err(|e| GpuError::HostMemory { reason: e.to_string() })?;
        let field = |name: &str| -> Result<u64, GpuError> {
            meminfo
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kib| kib * 1024)
                .ok_or_else(|| GpuError::HostMemory { reason: format!("no `{name}` line") })
        };
        Ok(Card {
            name: "cpu (host memory available now)".to_owned(),
            kind: CardKind::Cpu,
            total_bytes: field("MemTotal:")?,
            usable_bytes: field("MemAvailable:")?,
            context_bytes: 0,
            bf16: false,
            tensor_cores: false,
        })
    }

    /// The card behind `device`: the host for the CPU; for a CUDA GPU its
    /// catalogue entry when the driver's name is in the catalogue, otherwise a
    /// generic card of the driver's total memory.
    pub fn for_device(device: &candle_core::Device) -> Result<Card, GpuError> {
        match device {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(cuda) => {
                let context = cuda.cuda_stream().context().clone();
                let unread = |e: candle_core::cuda_backend::cudarc::driver::DriverError| GpuError::Device { reason: e.to_string() };
                let name = context.name().map_err(unread)?;
                match lookup(&name) {
                    Ok(gpu) => Ok(Card::from(gpu)),
                    Err(_) => {
                        let total = context.total_mem().map_err(unread)? as u64;
                        Ok(Card { name, ..Card::sized(total) })
                    }
                }
            }
            _ => Card::host(),
        }
    }

    pub fn is_cpu(&self) -> bool {
        self.kind == CardKind::Cpu
    }
}

impl From<Gpu> for Card {
    fn from(gpu: Gpu) -> Card {
        Card {
            name: gpu.name.to_owned(),
            kind: CardKind::Catalogue,
            total_bytes: gpu.total_bytes,
            usable_bytes: gpu.usable_bytes,
            context_bytes: gpu.context_bytes,
            bf16: gpu.arch.has_bf16(),
            tensor_cores: gpu.arch.has_tensor_cores(),
        }
    }
}

impl fmt::Display for Card {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({} usable)", self.name, crate::units::human(self.usable_bytes))
    }
}

/// `Some(bytes)` for a size, `None` for what should be a catalogue name
/// (`4090` and `3060laptop` start with digits).
fn parse_size(text: &str) -> Result<Option<u64>, GpuError> {
    match crate::units::parse_bytes(text) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(_) if !crate::units::looks_like_size(text) || lookup(text).is_ok() => Ok(None),
        Err(error) => Err(error.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catalogue_holds_at_least_25_cards_with_sane_memory() {
        let cards: Vec<Gpu> = catalogue().collect();
        assert!(cards.len() >= 25);
        for card in &cards {
            assert!(card.usable_bytes <= card.total_bytes + 2 * GIB, "{}", card.id);
            assert!(card.usable_bytes * 10 >= card.total_bytes * 9, "{}", card.id);
            assert!(card.context_bytes > 0 && card.context_bytes < GIB, "{}", card.id);
            assert_eq!(lookup(card.id).map(|g| g.id), Ok(card.id));
        }
    }

    #[test]
    fn names_are_forgiving() {
        for (name, id) in [
            ("4090", "rtx4090"),
            ("rtx4090", "rtx4090"),
            ("NVIDIA GeForce RTX 4090", "rtx4090"),
            ("A100-80GB", "a100-80gb"),
            ("a100 40GB", "a100-40gb"),
            ("rtx4060-laptop", "rtx4060-laptop"),
            ("RTX 4060 Laptop GPU", "rtx4060-laptop"),
            ("Tesla T4", "t4"),
            ("H200", "h200"),
            ("3060", "rtx3060"),
        ] {
            assert_eq!(lookup(name).map(|g| g.id), Ok(id), "{name}");
        }
    }

    #[test]
    fn unknown_names_list_the_closest_cards() {
        let err = lookup("rtx4091").unwrap_err().to_string();
        assert!(err.starts_with("unknown GPU `rtx4091`; closest: rtx4090"), "{err}");
        let err = lookup("A100").unwrap_err().to_string();
        assert_eq!(err, "`A100` comes in several sizes: a100-40gb, a100-80gb");
    }

    #[test]
    fn sizes_cpu_and_names_parse_into_devices() {
        assert_eq!(Card::parse("8GiB").unwrap().usable_bytes, 8 * GIB);
        assert_eq!(Card::parse("12GB").unwrap().usable_bytes, 12_000_000_000);
        assert_eq!(Card::parse("7.5 GiB").unwrap().usable_bytes, 15 * GIB / 2);
        assert_eq!(Card::parse("4090").unwrap().kind, CardKind::Catalogue);
        assert_eq!(Card::parse("3060laptop").unwrap().usable_bytes, 6144 * MIB);
        assert!(Card::parse("8").unwrap_err().to_string().contains("give a unit"));
        assert!(Card::parse("0GiB").is_err());
        let host = Card::parse("cpu").unwrap();
        assert!(host.is_cpu() && host.context_bytes == 0 && host.usable_bytes > 0);
    }
}
