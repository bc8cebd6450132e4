//! Dataset recipes (`datasets/*.toml`): which sources, from the Hub or a local path, in which format, with
//! which schema mapping, capped and weighted how.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::DataError;
use super::readers::Format;
use super::schema::SchemaMapping;
use crate::hub::{RepoKind, RepoSpec};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Seed of the fractional-weight selection, so a mix is reproducible.
    #[serde(default)]
    pub seed: u64,
    #[serde(rename = "source")]
    pub sources: Vec<SourceSpec>,
    /// The file the recipe was read from; local paths in it are relative to its folder.
    #[serde(skip)]
    pub path: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceSpec {
    pub name: String,
    pub format: Format,
    #[serde(default)]
    pub hub: Option<HubSource>,
    /// A local file, folder or glob, relative to the recipe's folder unless absolute.
    #[serde(default)]
    pub path: Option<String>,
    /// Keep at most this many conversations (after dropping bad and contaminated rows).
    #[serde(default)]
    pub max_rows: Option<u64>,
    /// Mixing weight: each kept conversation is emitted `weight` times on average (2.0 doubles a source,
    /// 0.25 keeps a deterministic quarter of it).
    #[serde(default = "one")]
    pub weight: f64,
    #[serde(default)]
    pub license: Option<String>,
    #[serde(default)]
    pub schema: SchemaMapping,
    /// Trained assistant turns with a call off the schema its conversation offers (a function not offered,
    /// arguments that do not read as an object, an undeclared or null argument, a required one left out):
    /// `keep` (the default), keep as `history` (in the context, not trained on), or `drop` the conversation.
    #[serde(default, skip_serializing_if = "OffSchemaCalls::is_keep")]
    pub off_schema_calls: OffSchemaCalls,
}

fn one() -> f64 {
    1.0
}

/// What ingest does with trained turns whose calls leave their offered schema (`data::calls`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffSchemaCalls {
    #[default]
    Keep,
    History,
    Drop,
}

impl OffSchemaCalls {
    fn is_keep(&self) -> bool {
        *self == OffSchemaCalls::Keep
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HubSource {
    pub repo: String,
    #[serde(default = "main")]
    pub revision: String,
    /// Globs over repo paths; `*` stays within a folder.
    pub files: Vec<String>,
}

fn main() -> String {
    "main".into()
}

impl HubSource {
    pub fn spec(&self) -> RepoSpec {
        RepoSpec {
            kind: RepoKind::Dataset,
            repo: self.repo.clone(),
            revision: self.revision.clone(),
            files: self.files.clone(),
            optional_files: vec![],
        }
    }
}

impl Recipe {
    /// Reads a recipe by path (`x.toml`) or by name (`terminal` → `<datasets_dir>/terminal.toml`).
    pub fn find(name_or_path: &str, datasets_dir: &Path) -> Result<Recipe, DataError> {
        let direct = Path::new(name_or_path);
        let path = if direct.extension().is_some_and(|e| e == "toml") || direct.is_file() {
            direct.to_path_buf()
        } else {
            datasets_dir.join(format!("{name_or_path}.toml"))
        };
        if !path.is_file() {
            let known = Recipe::available(datasets_dir);
            return Err(DataError::Recipe {
                path,
                message: format!(
                    "no such recipe '{name_or_path}'; known recipes in {}: {}",
                    datasets_dir.display(),
                    if known.is_empty() { "none".to_string() } else { known.join(", ") }
                ),
            });
        }
        Recipe::load(&path)
    }

    /// Names of the recipes in `datasets_dir`.
    pub fn available(datasets_dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(datasets_dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let p = e.path();
                if p.extension()? != "toml" {
                    return None;
                }
                Some(p.file_stem()?.to_string_lossy().into_owned())
            })
            .collect();
        names.sort();
        names
    }

    pub fn load(path: &Path) -> Result<Recipe, DataError> {
        let text = std::fs::read_to_string(path).map_err(|e| DataError::Io { path: path.to_path_buf(), source: e })?;
        let mut recipe: Recipe = toml::from_str(&text)
            .map_err(|e| DataError::Recipe { path: path.to_path_buf(), message: e.to_string() })?;
        recipe.path = path.to_path_buf();
        recipe.validate()?;
        Ok(recipe)
    }

    fn validate(&self) -> Result<(), DataError> {
        let fail = |message: String| Err(DataError::Recipe { path: self.path.clone(), message });
        if self.sources.is_empty() {
            return fail("has no [[source]]".into());
        }
        let mut seen = std::collections::HashSet::new();
        for s in &self.sources {
            if !seen.insert(&s.name) {
                return fail(format!("source name '{}' is used twice", s.name));
            }
            match (&s.hub, &s.path) {
                (Some(_), Some(_)) => return fail(format!("source '{}' sets both `hub` and `path`; keep one", s.name)),
                (None, None) => return fail(format!("source '{}' needs `hub` or `path`", s.name)),
                (Some(h), None) if h.files.is_empty() => {
                    return fail(format!("source '{}': hub.files is empty; name the files (globs) to pull", s.name));
                }
                _ => {}
            }
            if !(s.weight.is_finite() && s.weight >= 0.0) {
                return fail(format!("source '{}': weight must be a finite number ≥ 0, got {}", s.name, s.weight));
            }
        }
        Ok(())
    }

    pub fn base_dir(&self) -> PathBuf {
        self.path.parent().map(Path::to_path_buf).unwrap_or_default()
    }

    /// Sources whose name is in `names` (all when empty); an unknown name is an error listing the known.
    pub fn select(&self, names: &[String]) -> Result<Vec<&SourceSpec>, DataError> {
        if names.is_empty() {
            return Ok(self.sources.iter().collect());
        }
        names
            .iter()
            .map(|n| {
                self.sources.iter().find(|s| &s.name == n).ok_or_else(|| DataError::Recipe {
                    path: self.path.clone(),
                    message: format!(
                        "has no source '{n}'; its sources are: {}",
                        self.sources.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ")
                    ),
                })
            })
            .collect()
    }
}

impl SourceSpec {
    /// The local path spec resolved against the recipe's folder.
    pub fn local_path(&self, base: &Path) -> Option<PathBuf> {
        let p = Path::new(self.path.as_ref()?);
        Some(if p.is_absolute() { p.to_path_buf() } else { base.join(p) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Recipe, DataError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.toml");
        std::fs::write(&path, text).unwrap();
        Recipe::load(&path)
    }

    #[test]
    fn parses_hub_and_local_sources() {
        let r = parse(
            r#"
name = "mix"
[[source]]
name = "terminal"
format = "parquet"
hub = { repo = "o/t", files = ["data/*.parquet"] }
max_rows = 10
[source.schema]
task = "task"
[[source]]
name = "tools"
format = "json"
path = "samples/tools.json"
weight = 0.5
[source.schema]
role = "from"
content = "value"
"#,
        )
        .unwrap();
        assert_eq!(r.sources[0].hub.as_ref().unwrap().revision, "main");
        assert_eq!(r.sources[0].schema.messages, "conversations");
        assert_eq!(r.sources[1].schema.role, "from");
        assert_eq!(r.sources[1].weight, 0.5);
        assert_eq!(r.sources[1].off_schema_calls, OffSchemaCalls::Keep);
        assert!(r.select(&["nope".into()]).unwrap_err().to_string().contains("terminal, tools"));
    }

    #[test]
    fn rejects_ambiguous_or_unknown_fields() {
        let both = parse("name='x'\n[[source]]\nname='a'\nformat='jsonl'\npath='a'\nhub={repo='o/r', files=['a']}\n");
        assert!(both.unwrap_err().to_string().contains("both `hub` and `path`"));
        let typo = parse("name='x'\n[[source]]\nname='a'\nformat='jsonl'\npath='a'\nmax_row=3\n");
        assert!(typo.unwrap_err().to_string().contains("max_row"));
        let weight = parse("name='x'\n[[source]]\nname='a'\nformat='jsonl'\npath='a'\nweight=-1.0\n");
        assert!(weight.unwrap_err().to_string().contains("weight"));
        let policy = |value: &str| {
            parse(&format!("name='x'\n[[source]]\nname='a'\nformat='jsonl'\npath='a'\noff_schema_calls='{value}'\n"))
        };
        assert_eq!(policy("history").unwrap().sources[0].off_schema_calls, OffSchemaCalls::History);
        let err = policy("skip").unwrap_err().to_string();
        assert!(err.contains("skip") && err.contains("`keep`, `history`, `drop`"), "{err}");
    }
}
