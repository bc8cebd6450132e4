//! Where CubeCL keeps what it compiles between kiln processes on the CUDA and Vulkan backends. Left to its
//! defaults, CubeCL keeps no compiled kernel at all: every process compiles each kernel it launches afresh
//! (NVRTC, ~1 s a kernel on the H100 machines, hundreds a training step: minutes before the first step of every
//! `kiln train`, `kiln eval` or benchmark), and burn's autotune results land in a `target/` folder beside the
//! nearest Cargo.toml. kiln keeps both in one folder of its own instead: `KILN_KERNEL_CACHE` (a path, or
//! `off` for CubeCL's defaults), else `$XDG_CACHE_HOME/kiln/kernels` or `~/.cache/kiln/kernels`, in a
//! subfolder per dependency lock. A `cubecl.toml` (or a `burn.toml` with a `[cubecl]` table) in the working
//! folder or above it is the user's word on all of CubeCL's settings: kiln then sets nothing.
//!
//! CubeCL files a compiled kernel under its name and compile-time values, not its body, so the cache must not
//! outlive the code it was compiled from: kiln's own kernels carry `kernels::REVISION` (a hash of their
//! sources) among those values, and burn's and cubek's kernels change only with the dependency lock, which
//! names the subfolder. One folder serves one GPU architecture (PTX compiled for an H100 does not load on an
//! A100): machines of several kinds that share a home folder each want their own `KILN_KERNEL_CACHE`.

use std::path::{Path, PathBuf};

/// The environment switch: a folder, or `off`.
pub const ENV: &str = "KILN_KERNEL_CACHE";

/// The files CubeCL reads its settings from (cubecl-common's `RuntimeConfig` lookup), searched in the working
/// folder and each one above it; a `burn.toml` counts only with a `[cubecl]` table.
const CUBECL_FILES: [&str; 2] = ["cubecl.toml", "CubeCL.toml"];
const BURN_FILES: [&str; 2] = ["burn.toml", "Burn.toml"];

/// The dependency lock's hash, naming the subfolder: burn's and cubek's kernels change only with it.
const LOCK_REVISION: u64 = fnv1a(&[include_bytes!("../Cargo.lock")]);

/// Where compiled kernels and autotune results go, as decided at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelCache {
    /// CubeCL's defaults: no compiled-kernel cache (`KILN_KERNEL_CACHE=off`, or no home folder to put one in).
    Off(String),
    /// The user's CubeCL settings file at this path decides.
    ConfigFile(PathBuf),
    /// kiln's folder.
    Folder(PathBuf),
}

impl KernelCache {
    /// For `kiln info`.
    pub fn describe(&self) -> String {
        match self {
            KernelCache::Off(why) => format!("off ({why})"),
            KernelCache::ConfigFile(path) => format!("as {} says", path.display()),
            KernelCache::Folder(path) => path.display().to_string(),
        }
    }
}

/// The decision, from the environment switch's value, the settings file found (if any) and the user's
/// cache home (`$XDG_CACHE_HOME`, else `~/.cache`).
pub fn choose(setting: Option<&str>, config_file: Option<PathBuf>, cache_home: Option<PathBuf>) -> KernelCache {
    if let Some(file) = config_file {
        return KernelCache::ConfigFile(file);
    }
    let base = match setting.map(str::trim) {
        Some("off") => return KernelCache::Off(format!("{ENV}=off")),
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => match cache_home {
            Some(home) => home.join("kiln").join("kernels"),
            None => return KernelCache::Off("no $XDG_CACHE_HOME or $HOME to keep it in".into()),
        },
    };
    KernelCache::Folder(base.join(format!("{LOCK_REVISION:016x}")))
}

/// The first CubeCL settings file in `dir` or a folder above it.
pub fn config_file_above(dir: &Path) -> Option<PathBuf> {
    dir.ancestors().find_map(|dir| {
        let cubecl = CUBECL_FILES.iter().map(|name| dir.join(name)).find(|path| path.is_file());
        cubecl.or_else(|| BURN_FILES.iter().map(|name| dir.join(name)).find(|path| has_cubecl_table(path)))
    })
}

fn has_cubecl_table(path: &Path) -> bool {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| text.parse::<toml::Table>().ok())
        .is_some_and(|table| table.contains_key("cubecl"))
}

/// `$XDG_CACHE_HOME`, else `$HOME/.cache`.
fn cache_home() -> Option<PathBuf> {
    let non_empty = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    non_empty("XDG_CACHE_HOME").or_else(|| non_empty("HOME").map(|home| home.join(".cache")))
}

/// Decides from this process's environment and working folder, and makes kiln's folder; one that cannot be
/// made leaves CubeCL's defaults (and says why), since a cache is never worth a failed run.
pub fn resolve() -> KernelCache {
    let setting = std::env::var(ENV).ok();
    let config_file = std::env::current_dir().ok().and_then(|dir| config_file_above(&dir));
    match choose(setting.as_deref(), config_file, cache_home()) {
        KernelCache::Folder(dir) => match std::fs::create_dir_all(&dir) {
            Ok(()) => KernelCache::Folder(dir),
            Err(e) => KernelCache::Off(format!("cannot make {}: {e}", dir.display())),
        },
        other => other,
    }
}

/// Resolves the cache and hands kiln's folder to CubeCL, once, before any CubeCL runtime starts (its settings
/// are read once, at the first device); returns the decision, for `kiln info`.
pub fn install() -> KernelCache {
    static INSTALLED: std::sync::OnceLock<KernelCache> = std::sync::OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            if cfg!(not(any(feature = "cuda", feature = "vulkan"))) {
                return KernelCache::Off("this build has no CubeCL backend".into());
            }
            let cache = resolve();
            #[cfg(any(feature = "cuda", feature = "vulkan"))]
            if let KernelCache::Folder(dir) = &cache {
                use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};
                // CubeCL's environment overrides (CUBECL_DEBUG_LOG, CUBECL_AUTOTUNE_LEVEL, …) still apply.
                let mut config = CubeClRuntimeConfig::default().override_from_env();
                config.compilation.cache = Some(CacheConfig::File(dir.clone()));
                config.autotune.cache = CacheConfig::File(dir.clone());
                // Already read (a runtime started before this call): its settings stay, as CubeCL allows.
                if CubeClRuntimeConfig::storage().lock().is_none() {
                    CubeClRuntimeConfig::set(config);
                } else {
                    return KernelCache::Off("CubeCL's settings were read before kiln could set them".into());
                }
            }
            cache
        })
        .clone()
}

/// FNV-1a (64-bit) over the parts in order, at compile time.
pub(crate) const fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    let mut part = 0;
    while part < parts.len() {
        let bytes = parts[part];
        let mut i = 0;
        while i < bytes.len() {
            hash = (hash ^ bytes[i] as u64).wrapping_mul(0x0000_0100_0000_01b3);
            i += 1;
        }
        part += 1;
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_settings_file_wins_then_the_switch_then_the_cache_home() {
        let home = Some(PathBuf::from("/home/u/.cache"));
        let file = PathBuf::from("/work/cubecl.toml");
        assert_eq!(choose(Some("/x"), Some(file.clone()), home.clone()), KernelCache::ConfigFile(file));
        assert!(matches!(choose(Some("off"), None, home.clone()), KernelCache::Off(why) if why.contains("=off")));
        let lock = format!("{LOCK_REVISION:016x}");
        assert_eq!(choose(Some("/x"), None, home.clone()), KernelCache::Folder(PathBuf::from("/x").join(&lock)));
        let default = KernelCache::Folder(PathBuf::from("/home/u/.cache/kiln/kernels").join(&lock));
        assert_eq!(choose(None, None, home.clone()), default);
        assert_eq!(choose(Some("  "), None, home), default, "an empty switch is no switch");
        assert!(matches!(choose(None, None, None), KernelCache::Off(why) if why.contains("HOME")));
    }

    #[test]
    fn settings_files_are_found_above_the_working_folder() {
        let root = tempfile::tempdir().unwrap();
        let deep = root.path().join("a/b");
        std::fs::create_dir_all(&deep).unwrap();
        assert_eq!(config_file_above(&deep), None);
        // A burn.toml without a [cubecl] table says nothing of CubeCL; with one it does.
        std::fs::write(root.path().join("a/burn.toml"), "[fusion]\nx = 1\n").unwrap();
        assert_eq!(config_file_above(&deep), None);
        std::fs::write(root.path().join("a/burn.toml"), "[cubecl.autotune]\nlevel = \"minimal\"\n").unwrap();
        assert_eq!(config_file_above(&deep), Some(root.path().join("a/burn.toml")));
        // The nearest folder's file first, a cubecl.toml before a burn.toml in the same folder.
        std::fs::write(root.path().join("a/cubecl.toml"), "").unwrap();
        assert_eq!(config_file_above(&deep), Some(root.path().join("a/cubecl.toml")));
        std::fs::write(deep.join("CubeCL.toml"), "").unwrap();
        assert_eq!(config_file_above(&deep), Some(deep.join("CubeCL.toml")));
    }

    #[test]
    fn the_hash_is_fnv1a() {
        // FNV-1a's published test vectors.
        assert_eq!(fnv1a(&[]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(&[b"a"]), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(&[b"foobar"]), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a(&[b"foo", b"", b"bar"]), fnv1a(&[b"foobar"]), "parts hash as one run of bytes");
    }
}
