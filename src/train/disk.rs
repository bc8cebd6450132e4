//! What a training run will write to disk (an HF export every epoch, a resumable state at every save) and
//! whether the run folder's file system has room for it: checked before the first step, so that a full disk
//! stops a run at its start instead of at an epoch's save hours in.

use std::path::Path;

use burn::tensor::DType;

use super::optim::{AdamWConfig, MomentDtype};
use super::quant8;
use crate::models::hf::ExportDtype;
use crate::models::weights::kept_in_f32;

/// The environment variable that turns the check off (`KILN_DISK_CHECK=off`), for a file system whose free
/// space the operating system misreports, or one that is being made room on while the run starts.
pub const DISK_CHECK_ENV: &str = "KILN_DISK_CHECK";

/// A checkpoint's tensors as the disk plan counts them.
#[derive(Debug, Clone, Default)]
pub struct CheckpointBytes {
    /// Each tensor the model loads: its checkpoint name, number of values, and dtype while training (the
    /// precision's; f32 for `kept_in_f32` tensors).
    pub loaded: Vec<(String, usize, DType)>,
    /// What an export (and a state) copies from the source unchanged: another tower's tensors as stored,
    /// the config, tokenizer and template files.
    pub copied_bytes: u64,
}

/// What the rest of a run writes at its peak, which comes at its last save: every export is written by then,
/// and a state is written beside the one it replaces until it has its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskNeed {
    /// One epoch's export.
    pub export_bytes: u64,
    /// Exports still to be written, less what the epoch folders they replace hold now.
    pub exports_bytes: u64,
    pub exports: usize,
    /// One training state: the weights (bf16 ones as bf16, the rest f32), the carried tensors, AdamW
    /// moments and masters.
    pub state_bytes: u64,
    /// States written beside another at the peak: 0 when no save remains, 2 when none exists yet and
    /// there are two saves or more to come (the first stays until the second has its name), else 1.
    pub states: u64,
}

impl DiskNeed {
    /// `checkpoint` trained with `adamw`'s moments and masters and exported in `export_dtype`, with `exports` epochs and `saves`
    /// saves still to come; `state_exists` when the run folder holds a state the next save replaces;
    /// `replaced_bytes` what the epoch folders still to be exported hold now.
    pub fn of(
        checkpoint: &CheckpointBytes,
        adamw: &AdamWConfig,
        export_dtype: ExportDtype,
        exports: usize,
        saves: usize,
        state_exists: bool,
        replaced_bytes: u64,
    ) -> DiskNeed {
        let export_value = |key: &str| match export_dtype {
            _ if kept_in_f32(key) => 4,
            ExportDtype::F32 => 4,
            ExportDtype::Bf16 => 2,
        };
        let mut export_bytes = checkpoint.copied_bytes;
        let mut state_bytes = checkpoint.copied_bytes;
        for (key, values, dtype) in &checkpoint.loaded {
            let n = *values as u64;
            export_bytes += n * export_value(key);
            // The state keeps bf16 weights as bf16 and others in f32 (`CausalLm::export_exact`), beside f32
            // masters of those below f32 (unless rounded into stochastically).
            let weights = if *dtype == DType::BF16 { 2 } else { 4 };
            let master = if adamw.keeps_master(*dtype) { 4 } else { 0 };
            state_bytes += (weights + master) * n + moments_on_disk(*values, adamw.moments);
        }
        let states = match (saves, state_exists) {
            (0, _) => 0,
            (1, _) | (_, true) => 1,
            _ => 2,
        };
        let exports_bytes = (export_bytes * exports as u64).saturating_sub(replaced_bytes);
        DiskNeed { export_bytes, exports_bytes, exports, state_bytes, states }
    }

    pub fn total(&self) -> u64 {
        self.exports_bytes + self.states * self.state_bytes
    }

    /// What the need is made of, as "2 epoch exports of 16.94 GB and 2 training states of 68.02 GB (a new
    /// one is written beside the last until it has its name): 169.93 GB".
    pub fn summary(&self) -> String {
        let exports = match self.exports {
            0 => "no export".to_string(),
            1 => format!("1 epoch export of {}", size_text(self.export_bytes)),
            n => format!("{n} epoch exports of {}", size_text(self.export_bytes)),
        };
        let states = match self.states {
            0 => String::new(),
            1 => format!(" and 1 training state of {}", size_text(self.state_bytes)),
            n => format!(
                " and {n} training states of {} (a new one is written beside the last until it has its name)",
                size_text(self.state_bytes)
            ),
        };
        format!("{exports}{states}: {}", size_text(self.total()))
    }

    /// None where `free` bytes hold the need, else why the run cannot start (naming `dir`).
    pub fn refusal(&self, dir: &Path, free: u64) -> Option<String> {
        (self.total() > free).then(|| {
            format!(
                "{} has {} free, and the training writes {} there: make room (or use moments = \"q8\", a bf16 \
                 export, fewer epochs, no resumable state: train.save_state = false), or run it on a larger disk",
                dir.display(),
                size_text(free),
                self.summary()
            )
        })
    }

    /// The check's verdict where `free` bytes are free in `dir`: an error when the need does not fit, or,
    /// with the check off (`enabled` false), a warning to show.
    pub fn verdict(&self, dir: &Path, free: u64, enabled: bool) -> Result<Option<String>, String> {
        match self.refusal(dir, free) {
            None => Ok(None),
            Some(why) if enabled => Err(format!("{why}; {DISK_CHECK_ENV}=off skips this check")),
            Some(why) => Ok(Some(format!("{why} ({DISK_CHECK_ENV}=off: going on)"))),
        }
    }
}

/// An AdamW state's moments of a parameter of `values` as the state file stores them: f32 values (bf16
/// moments are saved in f32), or for 8-bit moments a u8 code a value (whole blocks) and an f32 scale a block.
fn moments_on_disk(values: usize, moments: MomentDtype) -> u64 {
    match moments {
        MomentDtype::Q8 if values >= quant8::MIN_ELEMENTS => {
            let blocks = values.div_ceil(quant8::BLOCK) as u64;
            2 * (blocks * quant8::BLOCK as u64 + 4 * blocks)
        }
        _ => 8 * values as u64,
    }
}

/// Bytes for a reader: "16.94 GB", "6.6 MB".
pub fn size_text(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else {
        format!("{:.1} MB", bytes as f64 / 1e6)
    }
}

/// Whether the check is on: `KILN_DISK_CHECK` unset, or anything but off / 0 / false / no.
pub fn check_enabled() -> bool {
    std::env::var(DISK_CHECK_ENV)
        .map(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "off" | "0" | "false" | "no"))
        .unwrap_or(true)
}

/// Bytes an unprivileged writer may still use on the file system holding `dir` (statvfs' `f_bavail`), or
/// None where the system does not say.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: `path` is a NUL-terminated string and `stat` a buffer statvfs fills when it returns 0.
        let stat = unsafe {
            if libc::statvfs(path.as_ptr(), stat.as_mut_ptr()) != 0 {
                return None;
            }
            stat.assume_init()
        };
        #[allow(clippy::useless_conversion)] // the fields' widths differ between platforms
        Some(u64::from(stat.f_bavail).saturating_mul(u64::from(stat.f_frsize)))
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        None
    }
}

/// The bytes of the files directly in `dir` (an HF checkpoint folder); 0 when it does not exist.
pub fn folder_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::optim::Masters;

    fn moments(moments: MomentDtype) -> AdamWConfig {
        AdamWConfig { moments, ..AdamWConfig::default() }
    }

    /// LFM2.5-8B-A1B-like: 8.47 B values in bf16 and a few f32 buffers.
    fn eight_b() -> CheckpointBytes {
        let mut loaded = vec![("model.embed_tokens.weight".to_string(), 128_000 * 2048, DType::BF16)];
        for l in 0..24 {
            loaded.push((format!("model.layers.{l}.feed_forward.experts.w"), 341_994_000, DType::BF16));
            loaded.push((format!("model.layers.{l}.feed_forward.expert_bias"), 32, DType::F32));
        }
        CheckpointBytes { loaded, copied_bytes: 0 }
    }

    #[test]
    fn the_need_counts_exports_states_moments_and_masters() {
        let ckpt = eight_b();
        let values: u64 = ckpt.loaded.iter().map(|(_, n, _)| *n as u64).sum();
        let need = DiskNeed::of(&ckpt, &moments(MomentDtype::Q8), ExportDtype::Bf16, 2, 2, false, 0);
        // bf16 export, f32 expert_bias.
        assert_eq!(need.export_bytes, 2 * values + 2 * 24 * 32);
        // bf16 weights and their f32 masters, the f32 biases, 8-bit moments (the 32-value biases keep f32 ones).
        let q8 = |n: u64| 2 * (n.div_ceil(256) * 256 + 4 * n.div_ceil(256));
        let bf16 = values - 24 * 32;
        let state = 6 * bf16 + 4 * 24 * 32 + q8(128_000 * 2048) + 24 * q8(341_994_000) + 24 * 8 * 32;
        assert_eq!(need.state_bytes, state);
        assert_eq!((need.exports, need.states), (2, 2));
        assert_eq!(need.total(), 2 * need.export_bytes + 2 * state);
        // Without masters (stochastic rounding) the bf16 weights' 4 bytes each are not saved.
        let stochastic = AdamWConfig { masters: Masters::Stochastic, ..moments(MomentDtype::Q8) };
        let need = DiskNeed::of(&ckpt, &stochastic, ExportDtype::Bf16, 2, 2, false, 0);
        assert_eq!(need.state_bytes, state - 4 * bf16);
        // f32 moments on disk: 8 bytes a value; an f32 run has no masters.
        let f32_run = CheckpointBytes {
            loaded: ckpt.loaded.iter().map(|(k, n, _)| (k.clone(), *n, DType::F32)).collect(),
            copied_bytes: 1000,
        };
        let need = DiskNeed::of(&f32_run, &moments(MomentDtype::F32), ExportDtype::F32, 1, 1, false, 0);
        assert_eq!(need.export_bytes, 4 * values + 1000);
        assert_eq!(need.state_bytes, 12 * values + 1000);
        assert_eq!(need.states, 1);
    }

    /// Room for a second state only where none exists and two saves remain; none when no save remains;
    /// epoch folders that will be replaced count against the exports.
    #[test]
    fn states_beside_each_other_and_replaced_exports() {
        let ckpt = CheckpointBytes { loaded: vec![("w".into(), 1000, DType::F32)], copied_bytes: 0 };
        let states = |saves, exists| {
            DiskNeed::of(&ckpt, &moments(MomentDtype::F32), ExportDtype::F32, 1, saves, exists, 0).states
        };
        assert_eq!(
            [states(0, false), states(1, false), states(2, false), states(2, true), states(5, true)],
            [0, 1, 2, 1, 1]
        );
        let replaced = DiskNeed::of(&ckpt, &moments(MomentDtype::F32), ExportDtype::F32, 2, 2, true, 3000);
        assert_eq!(replaced.exports_bytes, 2 * 4000 - 3000);
        let all_there = DiskNeed::of(&ckpt, &moments(MomentDtype::F32), ExportDtype::F32, 2, 0, true, 1 << 20);
        assert_eq!(all_there.total(), 0);
    }

    #[test]
    fn a_run_that_does_not_fit_is_refused_naming_the_folder_and_the_parts() {
        let need = DiskNeed::of(&eight_b(), &moments(MomentDtype::Q8), ExportDtype::Bf16, 2, 2, false, 0);
        let dir = Path::new("runs/x");
        assert_eq!(need.verdict(dir, need.total(), true), Ok(None));
        let why = need.verdict(dir, 64_000_000_000, true).unwrap_err();
        let parts = [
            "runs/x has 64.00 GB free",
            "writes 2 epoch exports of 16.94 GB and 2 training states of 68.02 GB",
            ": 169.93 GB there",
            "; KILN_DISK_CHECK=off skips this check",
        ];
        for part in parts {
            assert!(why.contains(part), "{part}: {why}");
        }
        let warning = need.verdict(dir, 64_000_000_000, false).unwrap().unwrap();
        assert!(
            warning.starts_with("runs/x has 64.00 GB free") && warning.ends_with("(KILN_DISK_CHECK=off: going on)")
        );
    }

    #[test]
    fn the_file_system_says_what_is_free() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        assert!(free > 0);
        assert_eq!(free_bytes(&dir.path().join("missing")), None);
        std::fs::write(dir.path().join("a"), [0u8; 100]).unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        assert_eq!(folder_bytes(dir.path()), 100);
        assert_eq!(folder_bytes(&dir.path().join("missing")), 0);
        assert_eq!([size_text(6_557_291), size_text(16_940_001_536)], ["6.6 MB", "16.94 GB"]);
    }
}
