//! The one way the stages write a JSON artifact: pretty-printed, newline-terminated, parent folders made.

use std::path::Path;

pub fn write_json(path: &Path, value: &impl serde::Serialize) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let text = serde_json::to_string_pretty(value).map_err(std::io::Error::other)? + "\n";
    std::fs::write(path, text)
}
