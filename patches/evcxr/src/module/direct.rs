// Copyright 2020 The Evcxr Authors.
//
// Licensed under the Apache License, Version 2.0 <LICENSE or
// https://www.apache.org/licenses/LICENSE-2.0> or the MIT license <LICENSE
// or https://opensource.org/licenses/MIT>, at your option. This file may not be
// copied, modified, or distributed except according to those terms.

//! Compiling a cell with rustc alone, the way cargo last compiled the cells' crate, while nothing
//! that cargo's decision depends on has changed.
//!
//! Once the dependencies are built, `cargo build` for a cell checks every unit of the dependency
//! graph (hundreds of them for a crate such as candle) and then runs the one rustc command for the
//! cells' crate that it ran for the previous cell. That command is recorded the first time (the
//! binary, started by cargo as `RUSTC_WORKSPACE_WRAPPER`, which wraps only the cells' crate, writes
//! its arguments, environment and directory, then becomes rustc) and run directly for later cells,
//! as long as:
//!
//! - cargo would be run the same way (its program, arguments and environment, and this
//!   process's environment, which cargo inherits),
//! - the files cargo reads to decide what to build hold what they held (the crate's `Cargo.toml`
//!   and `Cargo.lock`, every `.cargo/config.toml` from the crate's directory up and in
//!   `CARGO_HOME`, `rust-toolchain` files),
//! - no file under a path dependency's folder (`:dep x = { path = ... }`, a `[patch]` with a path)
//!   is newer than the start of the cargo run that recorded the command, and
//! - the libraries named by `--extern` are the files they were.
//!
//! Anything else sends the cell to cargo, which records the command again. A direct compile that
//! fails for a reason other than the cell's code (a dependency that cannot be loaded, the link)
//! goes to cargo too.

use crate::errors::CompilationError;
use crate::errors::Error;
use serde::Deserialize;
use serde::Serialize;
use std::collections::hash_map::DefaultHasher;
use std::ffi::OsStr;
use std::hash::Hash;
use std::hash::Hasher;
use std::path::Path;
use std::path::PathBuf;
use std::process::Command;
use std::time::SystemTime;

/// Set on cargo for a build of the cells' crate: the file where the wrapper writes the command.
pub(crate) const RECORD_ENV: &str = "EVCXR_RECORD_RUSTC";

/// Environment variables of the recorded command that must not be replayed: cargo's jobserver
/// (its file descriptors are gone) and the recording itself.
const NOT_REPLAYED: [&str; 5] = [
    "CARGO_MAKEFLAGS",
    "MAKEFLAGS",
    "MFLAGS",
    "RUSTC_WORKSPACE_WRAPPER",
    RECORD_ENV,
];

/// A path dependency's folder with more entries than this is not walked: such cells go to cargo.
const MAX_WATCHED_ENTRIES: usize = 20_000;

/// The rustc command cargo ran for the cells' crate.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub(crate) struct Invocation {
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    dir: String,
}

impl Invocation {
    /// The command this process was started with (`wrapper rustc args...`), or `None` when an
    /// argument, the directory or a variable is not UTF-8.
    fn of_this_process() -> Option<Invocation> {
        let mut args = std::env::args_os().skip(1);
        let program = args.next()?.into_string().ok()?;
        let args = args
            .map(|arg| arg.into_string().ok())
            .collect::<Option<Vec<_>>>()?;
        let env = std::env::vars_os()
            .filter(|(key, _)| !NOT_REPLAYED.iter().any(|skip| key == OsStr::new(skip)))
            .map(|(key, value)| Some((key.into_string().ok()?, value.into_string().ok()?)))
            .collect::<Option<Vec<_>>>()?;
        let dir = std::env::current_dir()
            .ok()?
            .into_os_string()
            .into_string()
            .ok()?;
        Some(Invocation {
            program,
            args,
            env,
            dir,
        })
    }

    fn value_of(&self, flag: &str) -> Option<&str> {
        let at = self.args.iter().position(|arg| arg == flag)?;
        self.args.get(at + 1).map(String::as_str)
    }

    fn crate_name(&self) -> Option<&str> {
        self.value_of("--crate-name")
    }

    /// The files `--extern name=path` names.
    fn externs(&self) -> Vec<PathBuf> {
        self.args
            .windows(2)
            .filter(|pair| pair[0] == "--extern")
            .filter_map(|pair| pair[1].split_once('=').map(|(_, path)| PathBuf::from(path)))
            .collect()
    }

    /// The shared object rustc writes: `--out-dir` and the crate's name.
    fn output(&self) -> Option<PathBuf> {
        let name = self.crate_name()?;
        Some(
            Path::new(self.value_of("--out-dir")?)
                .join(super::shared_object_name_from_crate_name(name)),
        )
    }

    fn command(&self) -> Command {
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .env_clear()
            .envs(self.env.iter().map(|(key, value)| (key, value)))
            .current_dir(&self.dir);
        command
    }
}

/// In the wrapper process: writes the command to the file `RECORD_ENV` names when it compiles
/// `crate_name`, then runs rustc in its place. Never returns.
pub(crate) fn record_then_run_rustc(crate_name: &str) -> ! {
    let invocation = Invocation::of_this_process();
    if let (Some(invocation), Some(file)) = (&invocation, std::env::var_os(RECORD_ENV))
        && invocation.crate_name() == Some(crate_name)
    {
        // A command that cannot be written is not recorded: the next cell goes to cargo.
        let written = serde_json::to_string(invocation)
            .ok()
            .map(|json| std::fs::write(&file, json));
        if !matches!(written, Some(Ok(()))) {
            let _ = std::fs::remove_file(&file);
        }
    }
    let mut args = std::env::args_os().skip(1);
    let Some(rustc) = args.next() else {
        eprintln!("{RECORD_ENV} is set, but no compiler was given to run");
        std::process::exit(1);
    };
    let mut command = Command::new(rustc);
    command.args(args).env_remove(RECORD_ENV);
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let error = command.exec();
        eprintln!("could not run the compiler: {error}");
        std::process::exit(1);
    }
    #[cfg(not(unix))]
    {
        match command.status() {
            Ok(status) => std::process::exit(status.code().unwrap_or(1)),
            Err(error) => {
                eprintln!("could not run the compiler: {error}");
                std::process::exit(1);
            }
        }
    }
}

/// How cargo is run, as one hash: its program, arguments, environment and directory, and this
/// process's environment, which cargo inherits.
pub(crate) fn command_hash(cargo: &Command) -> u64 {
    let mut hasher = DefaultHasher::new();
    cargo.get_program().hash(&mut hasher);
    for arg in cargo.get_args() {
        arg.hash(&mut hasher);
    }
    let mut envs: Vec<_> = cargo.get_envs().collect();
    envs.sort();
    envs.hash(&mut hasher);
    cargo.get_current_dir().hash(&mut hasher);
    let mut own: Vec<_> = std::env::vars_os().collect();
    own.sort();
    own.hash(&mut hasher);
    hasher.finish()
}

/// What cargo's decision depends on before it looks at any source, as one hash: how it is run
/// (`command_hash`) and the files it reads. Taken after a build, for the files as cargo left them
/// (it writes `Cargo.lock`).
pub(crate) fn cargo_inputs(command_hash: u64, crate_dir: &Path) -> u64 {
    let mut hasher = DefaultHasher::new();
    command_hash.hash(&mut hasher);
    for file in files_cargo_reads(crate_dir) {
        file.hash(&mut hasher);
        std::fs::read(&file).ok().hash(&mut hasher);
    }
    hasher.finish()
}

fn files_cargo_reads(crate_dir: &Path) -> Vec<PathBuf> {
    let mut files = vec![crate_dir.join("Cargo.toml"), crate_dir.join("Cargo.lock")];
    let mut dirs: Vec<PathBuf> = crate_dir.ancestors().map(Path::to_owned).collect();
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| dirs::home_dir().map(|home| home.join(".cargo")));
    for dir in &dirs {
        for name in ["rust-toolchain", "rust-toolchain.toml"] {
            files.push(dir.join(name));
        }
    }
    for dir in dirs.iter_mut() {
        dir.push(".cargo");
    }
    dirs.extend(cargo_home);
    for dir in dirs {
        for name in ["config.toml", "config"] {
            files.push(dir.join(name));
        }
    }
    files
}

/// The folders of the path packages a cargo build used, read from its JSON messages; the cells'
/// own crate is left out.
pub(crate) fn path_packages(cargo_stdout: &[u8], crate_dir: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for line in String::from_utf8_lossy(cargo_stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let is_path = message["package_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("path+"));
        let Some(manifest) = message["manifest_path"].as_str() else {
            continue;
        };
        let Some(dir) = Path::new(manifest).parent() else {
            continue;
        };
        if is_path && dir != crate_dir && !dirs.iter().any(|known| known == dir) {
            dirs.push(dir.to_owned());
        }
    }
    dirs
}

/// The cargo run that made an invocation, and what it depended on.
pub(crate) struct Recorded {
    invocation: Invocation,
    cargo_inputs: u64,
    cargo_started: SystemTime,
    path_packages: Vec<PathBuf>,
    externs: Vec<(PathBuf, Option<(SystemTime, u64)>)>,
    output: PathBuf,
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let metadata = std::fs::metadata(path).ok()?;
    Some((metadata.modified().ok()?, metadata.len()))
}

/// Whether anything under `dir` (its `target` folders and hidden entries aside) was modified at
/// or after `since`; `true` when it cannot be told.
fn changed_since(dir: &Path, since: SystemTime) -> bool {
    let mut pending = vec![dir.to_owned()];
    let mut seen = 0;
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return true;
        };
        for entry in entries {
            seen += 1;
            if seen > MAX_WATCHED_ENTRIES {
                return true;
            }
            let Ok(entry) = entry else { return true };
            let name = entry.file_name();
            if name.to_string_lossy().starts_with('.') || name == "target" {
                continue;
            }
            let Ok(metadata) = entry.metadata() else {
                return true;
            };
            match metadata.modified() {
                Ok(modified) if modified < since => {}
                _ => return true,
            }
            if metadata.is_dir() {
                pending.push(entry.path());
            }
        }
    }
    false
}

impl Recorded {
    /// The invocation the wrapper wrote during the cargo run that started at `cargo_started`;
    /// `None` when it wrote none (cargo did not compile the crate) or it cannot be used.
    pub(crate) fn read(
        file: &Path,
        cargo_inputs: u64,
        cargo_started: SystemTime,
        cargo_stdout: &[u8],
        crate_dir: &Path,
    ) -> Option<Recorded> {
        let json = std::fs::read_to_string(file).ok()?;
        let invocation: Invocation = serde_json::from_str(&json).ok()?;
        let output = invocation.output()?;
        let externs = invocation
            .externs()
            .into_iter()
            .map(|path| {
                let stamp = stamp(&path);
                (path, stamp)
            })
            .collect();
        Some(Recorded {
            path_packages: path_packages(cargo_stdout, crate_dir),
            invocation,
            cargo_inputs,
            cargo_started,
            externs,
            output,
        })
    }

    /// Whether cargo would run this same command now, without building anything else first.
    pub(crate) fn still_valid(&self, cargo_inputs: u64) -> bool {
        self.cargo_inputs == cargo_inputs
            && self
                .externs
                .iter()
                .all(|(path, recorded)| recorded.is_some() && stamp(path) == *recorded)
            && !self
                .path_packages
                .iter()
                .any(|dir| changed_since(dir, self.cargo_started))
    }

    /// Runs the recorded command: the shared object on success. A failure in the cell's code is
    /// its errors; any other failure is `None`, for cargo to run instead.
    pub(crate) fn compile(
        &self,
        code_block: &crate::code_block::CodeBlock,
    ) -> Option<Result<PathBuf, Error>> {
        // A leftover from an earlier cell must not pass for this one's.
        let _ = std::fs::remove_file(&self.output);
        let output = self.invocation.command().output().ok()?;
        if output.status.success() {
            return self.output.exists().then(|| Ok(self.output.clone()));
        }
        let (errors, _) = super::errors_from_cargo_output(&output, code_block);
        if errors.is_empty() || errors.iter().any(not_about_the_code) {
            return None;
        }
        Some(Err(Error::CompilationErrors(errors)))
    }
}

/// An error that says the build itself is broken: a dependency rustc cannot load, or the link.
fn not_about_the_code(error: &CompilationError) -> bool {
    const LOADING_A_CRATE: [&str; 10] = [
        "E0460", "E0461", "E0462", "E0463", "E0464", "E0514", "E0519", "E0523", "E0786", "E0465",
    ];
    let message = error.message();
    error
        .code()
        .is_some_and(|code| LOADING_A_CRATE.contains(&code))
        || message.starts_with("linking with")
        || message.starts_with("extern location")
        || message.contains("could not find native static library")
        || message.contains("couldn't create a temp dir")
        || message.contains("failed to write")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invocation(args: &[&str]) -> Invocation {
        Invocation {
            program: "rustc".to_owned(),
            args: args.iter().map(|arg| arg.to_string()).collect(),
            env: Vec::new(),
            dir: "/".to_owned(),
        }
    }

    #[test]
    fn the_output_and_the_externs_come_from_the_arguments() {
        let recorded = invocation(&[
            "--crate-name",
            "ctx",
            "--out-dir",
            "/t/deps",
            "--extern",
            "vramlab=/t/deps/libvramlab-1.rlib",
            "--extern",
            "noprelude:core=/s/libcore.rlib",
        ]);
        assert_eq!(recorded.crate_name(), Some("ctx"));
        assert_eq!(
            recorded.output().unwrap(),
            Path::new("/t/deps").join(super::super::shared_object_name_from_crate_name("ctx"))
        );
        assert_eq!(
            recorded.externs(),
            [
                PathBuf::from("/t/deps/libvramlab-1.rlib"),
                PathBuf::from("/s/libcore.rlib")
            ]
        );
    }

    #[test]
    fn path_packages_are_read_from_cargo_messages() {
        let stdout = br#"{"reason":"compiler-artifact","package_id":"registry+https://github.com/rust-lang/crates.io-index#half@2.7.1","manifest_path":"/r/half-2.7.1/Cargo.toml"}
{"reason":"compiler-artifact","package_id":"path+file:///w/lib#vramlab@0.1.0","manifest_path":"/w/lib/Cargo.toml"}
{"reason":"build-script-executed","package_id":"path+file:///w/lib#vramlab@0.1.0"}
{"reason":"compiler-artifact","package_id":"path+file:///w/lib#vramlab@0.1.0","manifest_path":"/w/lib/Cargo.toml"}
{"reason":"compiler-artifact","package_id":"path+file:///c#ctx@1.0.0","manifest_path":"/c/Cargo.toml"}
not json
"#;
        assert_eq!(
            path_packages(stdout, Path::new("/c")),
            [PathBuf::from("/w/lib")]
        );
    }

    #[test]
    fn a_file_written_after_the_build_started_is_a_change() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("src")).unwrap();
        std::fs::write(dir.path().join("src/lib.rs"), "").unwrap();
        std::fs::create_dir(dir.path().join("target")).unwrap();
        let after = SystemTime::now() + std::time::Duration::from_secs(5);
        assert!(!changed_since(dir.path(), after));
        let before = SystemTime::now() - std::time::Duration::from_secs(3600);
        assert!(changed_since(dir.path(), before));
        // Build outputs and hidden folders are not sources.
        let later = SystemTime::now() + std::time::Duration::from_secs(3600);
        std::fs::write(dir.path().join("target/out"), "").unwrap();
        let file = std::fs::File::options()
            .write(true)
            .open(dir.path().join("target/out"))
            .unwrap();
        file.set_modified(later).unwrap();
        assert!(!changed_since(dir.path(), after));
        assert!(changed_since(&dir.path().join("target"), after));
    }

    #[test]
    fn the_inputs_change_with_the_manifest_and_the_command() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("Cargo.toml"), "[dependencies]\n").unwrap();
        let cargo = || {
            let mut command = Command::new("cargo");
            command.arg("build").env("RUSTFLAGS", "-Cprefer-dynamic");
            command
        };
        let inputs = |command: &Command| cargo_inputs(command_hash(command), dir.path());
        let first = inputs(&cargo());
        assert_eq!(first, inputs(&cargo()));
        let mut other = cargo();
        other.env("RUSTFLAGS", "");
        assert_ne!(first, inputs(&other));
        std::fs::write(dir.path().join("Cargo.toml"), "[dependencies]\nx = \"1\"\n").unwrap();
        assert_ne!(first, inputs(&cargo()));
    }
}
