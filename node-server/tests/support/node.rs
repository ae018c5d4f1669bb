//! The `glmflash-node` binary as the integration tests run it.
#![allow(dead_code)] // each test crate uses what it needs

use std::process::{Command, Output};

/// `glmflash-node` with `args` (more can be added to the returned command).
pub fn node<I: IntoIterator<Item = S>, S: AsRef<std::ffi::OsStr>>(args: I) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_glmflash-node"));
    cmd.args(args);
    cmd
}

/// Runs `cmd`, which must succeed (its stderr is the failure's message).
pub fn succeeds(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `cmd`, which must succeed, and parses its stdout as JSON.
pub fn json(cmd: &mut Command) -> serde_json::Value {
    serde_json::from_slice(&succeeds(cmd).stdout).unwrap()
}
