//! Streaming readers: parquet (by row group), JSONL (by line) and JSON arrays (by element), each handing
//! one row at a time to a callback so memory stays bounded by the largest row, not the file.

use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ParquetRecordBatchReaderBuilder};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::DataError;
use super::arrow_json::row_to_json;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Parquet,
    Jsonl,
    /// One JSON array of rows (OpenBMB ToolBench); a `.json` file holding JSON lines is read as JSONL.
    Json,
}

impl Format {
    pub fn from_extension(path: &Path) -> Option<Format> {
        match path.extension()?.to_str()? {
            "parquet" => Some(Format::Parquet),
            "jsonl" | "ndjson" => Some(Format::Jsonl),
            "json" => Some(Format::Json),
            _ => None,
        }
    }
}

/// Where a row sits in its file, for error messages and ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    Row { row_group: usize, row: usize },
    Line(usize),
    Element(usize),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Row { row_group, row } => write!(f, "row group {row_group}, row {row}"),
            Location::Line(n) => write!(f, "line {n}"),
            Location::Element(i) => write!(f, "element {i}"),
        }
    }
}

/// Rows per Arrow batch when decoding parquet: conversations are large, so keep batches small.
const PARQUET_BATCH_ROWS: usize = 64;

/// Calls `visit` with every row of `path`; `visit` may stop early with `ControlFlow::Break`.
/// `columns` projects parquet files to those top-level columns (all when `None`). Returns rows visited.
pub fn for_each_row(
    path: &Path,
    format: Format,
    columns: Option<&[String]>,
    mut visit: impl FnMut(Value, Location) -> ControlFlow<()>,
) -> Result<u64, DataError> {
    match format {
        Format::Parquet => read_parquet(path, columns, &mut visit),
        Format::Jsonl => read_jsonl(open(path)?, path, &mut visit),
        Format::Json => {
            let mut reader = open(path)?;
            match first_significant_byte(&mut reader).map_err(|e| io_err(path, e))? {
                Some(b'[') => read_json_array(reader, path, &mut visit),
                _ => read_jsonl(reader, path, &mut visit),
            }
        }
    }
}

fn io_err(path: &Path, source: std::io::Error) -> DataError {
    DataError::Io { path: path.to_path_buf(), source }
}

fn open(path: &Path) -> Result<BufReader<File>, DataError> {
    File::open(path).map(|f| BufReader::with_capacity(1 << 20, f)).map_err(|e| io_err(path, e))
}

fn first_significant_byte(reader: &mut impl BufRead) -> std::io::Result<Option<u8>> {
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            return Ok(None);
        }
        match buf.iter().position(|b| !b.is_ascii_whitespace() && *b != 0xEF && *b != 0xBB && *b != 0xBF) {
            Some(i) => return Ok(Some(buf[i])),
            None => {
                let n = buf.len();
                reader.consume(n);
            }
        }
    }
}

fn read_parquet(
    path: &Path,
    columns: Option<&[String]>,
    visit: &mut impl FnMut(Value, Location) -> ControlFlow<()>,
) -> Result<u64, DataError> {
    let perr = |row_group: Option<usize>, e: &dyn fmt::Display| DataError::Parquet {
        path: path.to_path_buf(),
        row_group,
        message: e.to_string(),
    };
    let file = File::open(path).map_err(|e| io_err(path, e))?;
    let metadata = ArrowReaderMetadata::load(&file, Default::default()).map_err(|e| perr(None, &e))?;
    let schema = metadata.schema().clone();
    let mask = match columns {
        None => ProjectionMask::all(),
        Some(cols) => {
            let mut roots = Vec::with_capacity(cols.len());
            for name in cols {
                // The messages column is required; optional columns (id, meta) may be absent.
                match schema.index_of(name) {
                    Ok(i) => roots.push(i),
                    Err(_) if name == &cols[0] => {
                        return Err(DataError::MissingColumn {
                            path: path.to_path_buf(),
                            column: name.clone(),
                            available: schema.fields().iter().map(|f| f.name().clone()).collect(),
                        });
                    }
                    Err(_) => {}
                }
            }
            ProjectionMask::roots(metadata.metadata().file_metadata().schema_descr(), roots)
        }
    };
    let mut visited = 0u64;
    for row_group in 0..metadata.metadata().num_row_groups() {
        let file = file.try_clone().map_err(|e| io_err(path, e))?;
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(file, metadata.clone())
            .with_row_groups(vec![row_group])
            .with_projection(mask.clone())
            .with_batch_size(PARQUET_BATCH_ROWS)
            .build()
            .map_err(|e| perr(Some(row_group), &e))?;
        let mut row = 0;
        for batch in reader {
            let batch = batch.map_err(|e| perr(Some(row_group), &e))?;
            for i in 0..batch.num_rows() {
                visited += 1;
                if visit(row_to_json(&batch, i), Location::Row { row_group, row }).is_break() {
                    return Ok(visited);
                }
                row += 1;
            }
        }
    }
    Ok(visited)
}

fn read_jsonl(
    mut reader: impl BufRead,
    path: &Path,
    visit: &mut impl FnMut(Value, Location) -> ControlFlow<()>,
) -> Result<u64, DataError> {
    let mut line = String::new();
    let mut number = 0usize;
    let mut visited = 0u64;
    loop {
        line.clear();
        let n = reader.read_line(&mut line).map_err(|e| DataError::Text {
            path: path.to_path_buf(),
            location: format!("line {}", number + 1),
            message: e.to_string(),
        })?;
        if n == 0 {
            return Ok(visited);
        }
        number += 1;
        let text = line.trim_start_matches('\u{feff}').trim();
        if text.is_empty() {
            continue;
        }
        let value = serde_json::from_str(text).map_err(|source| DataError::JsonLine {
            path: path.to_path_buf(),
            line: number,
            source,
        })?;
        visited += 1;
        if visit(value, Location::Line(number)).is_break() {
            return Ok(visited);
        }
    }
}

fn read_json_array(
    reader: impl BufRead,
    path: &Path,
    visit: &mut impl FnMut(Value, Location) -> ControlFlow<()>,
) -> Result<u64, DataError> {
    let mut elements = JsonArrayElements::new(reader);
    let mut buf = Vec::new();
    let mut visited = 0u64;
    loop {
        let index = elements.index;
        let err =
            |offset: u64, message: String| DataError::JsonArray { path: path.to_path_buf(), index, offset, message };
        let start = match elements.next_raw(&mut buf) {
            Ok(Some(start)) => start,
            Ok(None) => return Ok(visited),
            Err(SplitError::Io(e)) => return Err(io_err(path, e)),
            Err(SplitError::Syntax { offset, message }) => return Err(err(offset, message)),
        };
        let value = serde_json::from_slice(&buf).map_err(|e| err(start, e.to_string()))?;
        visited += 1;
        if visit(value, Location::Element(index)).is_break() {
            return Ok(visited);
        }
    }
}

#[derive(Debug)]
enum SplitError {
    Io(std::io::Error),
    Syntax { offset: u64, message: String },
}

impl From<std::io::Error> for SplitError {
    fn from(e: std::io::Error) -> Self {
        SplitError::Io(e)
    }
}

/// Splits a top-level JSON array into its elements' raw bytes without parsing them, tracking only
/// nesting and strings, so a multi-GB array is read one element at a time.
struct JsonArrayElements<R> {
    reader: R,
    offset: u64,
    index: usize,
    state: ArrayState,
}

#[derive(PartialEq)]
enum ArrayState {
    BeforeOpen,
    FirstElement,
    AfterElement,
    Done,
}

impl<R: BufRead> JsonArrayElements<R> {
    fn new(reader: R) -> Self {
        JsonArrayElements { reader, offset: 0, index: 0, state: ArrayState::BeforeOpen }
    }

    fn syntax<T>(&self, message: impl Into<String>) -> Result<T, SplitError> {
        Err(SplitError::Syntax { offset: self.offset, message: message.into() })
    }

    fn peek(&mut self) -> Result<Option<u8>, SplitError> {
        Ok(self.reader.fill_buf()?.first().copied())
    }

    fn bump(&mut self) {
        self.reader.consume(1);
        self.offset += 1;
    }

    fn skip_whitespace(&mut self) -> Result<Option<u8>, SplitError> {
        loop {
            match self.peek()? {
                Some(b) if b.is_ascii_whitespace() || (self.offset < 3 && matches!(b, 0xEF | 0xBB | 0xBF)) => {
                    self.bump()
                }
                other => return Ok(other),
            }
        }
    }

    /// Fills `out` with the next element's bytes and returns its start offset; `None` after `]`.
    fn next_raw(&mut self, out: &mut Vec<u8>) -> Result<Option<u64>, SplitError> {
        out.clear();
        match self.state {
            ArrayState::Done => return Ok(None),
            ArrayState::BeforeOpen => {
                if self.skip_whitespace()? != Some(b'[') {
                    return self.syntax("expected '[' opening a JSON array");
                }
                self.bump();
                self.state = ArrayState::FirstElement;
                if self.skip_whitespace()? == Some(b']') {
                    return self.finish();
                }
            }
            ArrayState::FirstElement => unreachable!("state is advanced before returning"),
            ArrayState::AfterElement => match self.skip_whitespace()? {
                Some(b',') => self.bump(),
                Some(b']') => return self.finish(),
                Some(b) => return self.syntax(format!("expected ',' or ']' after element, found '{}'", b as char)),
                None => return self.syntax("unexpected end of file: the array is not closed"),
            },
        }
        let start = match self.skip_whitespace()? {
            Some(_) => self.offset,
            None => return self.syntax("unexpected end of file: expected an element"),
        };
        self.copy_element(out)?;
        self.state = ArrayState::AfterElement;
        self.index += 1;
        Ok(Some(start))
    }

    fn finish(&mut self) -> Result<Option<u64>, SplitError> {
        self.bump();
        self.state = ArrayState::Done;
        if self.skip_whitespace()?.is_some() {
            return self.syntax("trailing data after the closing ']'");
        }
        Ok(None)
    }

    fn copy_element(&mut self, out: &mut Vec<u8>) -> Result<(), SplitError> {
        let first = self.peek()?.unwrap_or(b' ');
        if !matches!(first, b'{' | b'[' | b'"') {
            // A scalar: runs to the next delimiter, which stays unconsumed.
            while let Some(b) = self.peek()? {
                if b == b',' || b == b']' || b.is_ascii_whitespace() {
                    return Ok(());
                }
                out.push(b);
                self.bump();
            }
            return Ok(());
        }
        let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
        loop {
            let buf = self.reader.fill_buf()?;
            if buf.is_empty() {
                return self.syntax("unexpected end of file inside an element");
            }
            let mut end = None;
            for (i, &b) in buf.iter().enumerate() {
                if in_string {
                    if escaped {
                        escaped = false;
                    } else if b == b'\\' {
                        escaped = true;
                    } else if b == b'"' {
                        in_string = false;
                        if depth == 0 {
                            end = Some(i + 1);
                            break;
                        }
                    }
                    continue;
                }
                match b {
                    b'"' => in_string = true,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            end = Some(i + 1);
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let take = end.unwrap_or(buf.len());
            out.extend_from_slice(&buf[..take]);
            self.reader.consume(take);
            self.offset += take as u64;
            if end.is_some() {
                return Ok(());
            }
        }
    }
}

/// Reads a whole small JSON or JSONL file of objects (eval sets, fixtures).
pub fn read_all(path: &Path) -> Result<Vec<Value>, DataError> {
    let format = Format::from_extension(path).unwrap_or(Format::Jsonl);
    let mut rows = Vec::new();
    for_each_row(path, format, None, |v, _| {
        rows.push(v);
        ControlFlow::Continue(())
    })?;
    Ok(rows)
}

/// Lists the data files of a local source: a file, a directory (its files of `format`, sorted), or a glob.
pub fn local_files(spec: &Path, format: Format) -> Result<Vec<PathBuf>, DataError> {
    let text = spec.to_string_lossy();
    if text.contains(['*', '?', '[']) {
        return glob_files(&text);
    }
    let meta = std::fs::metadata(spec).map_err(|e| io_err(spec, e))?;
    if meta.is_file() {
        return Ok(vec![spec.to_path_buf()]);
    }
    let mut files = Vec::new();
    collect_dir(spec, &mut files).map_err(|e| io_err(spec, e))?;
    files.retain(|p| Format::from_extension(p) == Some(format));
    files.sort();
    Ok(files)
}

fn collect_dir(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_dir(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

fn glob_files(pattern: &str) -> Result<Vec<PathBuf>, DataError> {
    // The literal directory prefix bounds the walk; the rest is matched with globset.
    let literal: PathBuf = Path::new(pattern)
        .components()
        .take_while(|c| !c.as_os_str().to_string_lossy().contains(['*', '?', '[']))
        .collect();
    let root = if literal.as_os_str().is_empty() { PathBuf::from(".") } else { literal };
    let matcher = globset::GlobBuilder::new(pattern)
        .literal_separator(true)
        .build()
        .map_err(|e| DataError::Text { path: pattern.into(), location: "glob".into(), message: e.to_string() })?
        .compile_matcher();
    let mut all = Vec::new();
    collect_dir(&root, &mut all).map_err(|e| io_err(&root, e))?;
    let mut files: Vec<_> = all
        .into_iter()
        .filter(|p| matcher.is_match(p) || matcher.is_match(p.strip_prefix("./").unwrap_or(p)))
        .collect();
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(text: &str) -> Result<Vec<String>, String> {
        let mut it = JsonArrayElements::new(text.as_bytes());
        let mut out = Vec::new();
        let mut buf = Vec::new();
        loop {
            match it.next_raw(&mut buf) {
                Ok(Some(_)) => out.push(String::from_utf8(buf.clone()).unwrap()),
                Ok(None) => return Ok(out),
                Err(SplitError::Syntax { offset, message }) => return Err(format!("{offset}: {message}")),
                Err(SplitError::Io(e)) => return Err(e.to_string()),
            }
        }
    }

    #[test]
    fn splits_nested_elements_with_tricky_strings() {
        let text = r#" [ {"a": "x]}\"{", "b": [1, {"c": []}]} ,
            "s,]", 12.5e3, null, [], {} ] "#;
        assert_eq!(
            split(text).unwrap(),
            [r#"{"a": "x]}\"{", "b": [1, {"c": []}]}"#, r#""s,]""#, "12.5e3", "null", "[]", "{}"]
        );
        assert_eq!(split("[]").unwrap(), Vec::<String>::new());
    }

    #[test]
    fn reports_where_a_broken_array_breaks() {
        assert!(split(r#"{"a": 1}"#).unwrap_err().contains("expected '['"));
        assert!(split(r#"[{"a": 1} {"b": 2}]"#).unwrap_err().starts_with("10: expected ','"));
        assert!(split(r#"[{"a": "unterminated"#).unwrap_err().contains("end of file inside"));
        assert!(split(r#"[{"a": 1},"#).unwrap_err().contains("expected an element"));
        assert!(split(r#"[1] x"#).unwrap_err().contains("trailing data"));
    }
}
