//! tests/bench/fallback.sh, which decides what a failed kiln run on CUDA is tried again without (train.sh's
//! rows, gpu_session.sh's parity and train stages): a retry must change something, so where CUDA runs kiln's
//! kernels only when asked (`kiln info`) the "kernels off" variants drop out unless the run turned them on.

mod common;

use std::path::Path;
use std::process::Command;

/// `fallback_runs <variants> <marked> <kernels_on>` with a `kiln` whose `info` says CUDA's kernels default to
/// `cuda_default`: the switch sets it would try, one a line.
fn fallback_runs(dir: &Path, cuda_default: &str, variants: &str, marked: &str, kernels_on: &str) -> Vec<String> {
    let kiln = dir.join(format!("kiln-{cuda_default}"));
    let info = format!("{{\"scan_kernel\": \"unset: {cuda_default} on cuda, on on vulkan\"}}");
    std::fs::write(&kiln, format!("#!/usr/bin/env bash\n[[ $1 == info ]] && echo '{info}'\n")).unwrap();
    Command::new("chmod").arg("+x").arg(&kiln).status().unwrap();
    let script = format!("source tests/bench/fallback.sh && fallback_runs {variants} '{marked}' {kernels_on}");
    let out = Command::new("bash")
        .arg("-c")
        .arg(script)
        .env("KILN", &kiln)
        .current_dir(common::project_dir())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(String::from).collect()
}

const KERNELS_OFF: &str = "KILN_ATTENTION_KERNEL=off KILN_CONV_KERNEL=off KILN_LOSS_KERNEL=off \
                           KILN_NORM_KERNEL=off KILN_OPTIM_KERNEL=off KILN_SCAN_KERNEL=off";

#[test]
fn retries_change_something_and_kernel_switches_only_where_kernels_ran() {
    let dir = tempfile::tempdir().unwrap();
    let unfused = "KILN_CUDA_FUSION=off";
    let both = format!(
        "KILN_ATTENTION_KERNEL=off KILN_CONV_KERNEL=off {unfused} KILN_LOSS_KERNEL=off \
                        KILN_NORM_KERNEL=off KILN_OPTIM_KERNEL=off KILN_SCAN_KERNEL=off"
    );
    // Kernels off on CUDA unless asked, and the run did not ask: only fusion off is a change.
    assert_eq!(fallback_runs(dir.path(), "off", "FALLBACK_VARIANTS", "", "0"), [unfused]);
    // The run turned them on: kernels off, fusion off, both.
    assert_eq!(fallback_runs(dir.path(), "off", "FALLBACK_VARIANTS", "", "1"), [KERNELS_OFF, unfused, &both]);
    // Kernels on by default on CUDA: all three, whatever the run set.
    assert_eq!(fallback_runs(dir.path(), "on", "FALLBACK_VARIANTS", "", "0"), [KERNELS_OFF, unfused, &both]);
    // Fusion already off (marked by an earlier failure) and kernels not running: nothing left to try.
    assert!(fallback_runs(dir.path(), "off", "FALLBACK_VARIANTS", unfused, "0").is_empty());
    // The parity stage's diagnosis: the batched experts and fusion, each once.
    assert_eq!(fallback_runs(dir.path(), "off", "FALLBACK_DIAGNOSIS", "", "0"), ["KILN_EXPERTS_BATCHED=off", unfused]);
}
