//! Token shards: parquet files of fixed-size rows (`input_ids`, `loss_mask`, `doc_lengths`, `sample_ids`,
//! `sources`). Packed rows hold several documents back to back; bucketed rows hold one document padded to
//! its length bucket. `doc_lengths` lets attention and recurrent state restart at every document start.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, ListBuilder, RecordBatch, StringBuilder, UInt8Builder, UInt32Builder};
use arrow::datatypes::{UInt8Type, UInt32Type};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};

use super::TokenError;
use super::mask::TokenSample;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Layout {
    /// Several documents per row, best fit; the rest of a row is padding.
    Packed,
    /// One document per row, padded to the smallest power-of-two bucket (≥ 256) that holds it.
    Bucketed,
}

/// One fixed-size row of a shard.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Row {
    pub input_ids: Vec<u32>,
    pub loss_mask: Vec<u8>,
    pub doc_lengths: Vec<u32>,
    pub sample_ids: Vec<String>,
    pub sources: Vec<String>,
}

impl Row {
    pub fn used(&self) -> usize {
        self.doc_lengths.iter().map(|&l| l as usize).sum()
    }

    fn push(&mut self, sample: &TokenSample, source: &str) {
        self.input_ids.extend_from_slice(&sample.input_ids);
        self.loss_mask.extend_from_slice(&sample.loss_mask);
        self.doc_lengths.push(sample.input_ids.len() as u32);
        self.sample_ids.push(sample.id.clone());
        self.sources.push(source.to_string());
    }

    fn pad_to(&mut self, len: usize, pad_id: u32) {
        self.input_ids.resize(len, pad_id);
        self.loss_mask.resize(len, 0);
    }
}

/// The bucket length of a document: the smallest power of two ≥ 256 that holds it, capped at `seq_len`.
pub fn bucket_len(len: usize, seq_len: usize) -> usize {
    len.max(256).next_power_of_two().min(seq_len)
}

/// Whether `name` is the name of a shard `ShardWriter` writes: `packed-<len>-<k>.parquet` or
/// `bucket-<len>-<k>.parquet`.
pub fn is_shard_name(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let Some(stem) = name.strip_suffix(".parquet") else { return false };
    let Some(rest) = stem.strip_prefix("packed-").or_else(|| stem.strip_prefix("bucket-")) else { return false };
    rest.split_once('-').is_some_and(|(len, index)| digits(len) && digits(index))
}

/// Rows per shard file and per parquet row group.
const ROWS_PER_SHARD: usize = 8192;
const ROWS_PER_GROUP: usize = 256;

/// Writes rows of one length into numbered shard files `<prefix>-<k>.parquet`.
struct ShardFile {
    dir: PathBuf,
    prefix: String,
    index: usize,
    rows_in_file: usize,
    writer: Option<ArrowWriter<File>>,
    pending: Vec<Row>,
    written: Vec<PathBuf>,
}

impl ShardFile {
    fn new(dir: &Path, prefix: String) -> Self {
        ShardFile {
            dir: dir.to_path_buf(),
            prefix,
            index: 0,
            rows_in_file: 0,
            writer: None,
            pending: Vec::new(),
            written: Vec::new(),
        }
    }

    fn path(&self) -> PathBuf {
        self.dir.join(format!("{}-{:05}.parquet", self.prefix, self.index))
    }

    fn push(&mut self, row: Row) -> Result<(), TokenError> {
        self.pending.push(row);
        if self.pending.len() >= ROWS_PER_GROUP {
            self.flush_group()?;
        }
        Ok(())
    }

    fn flush_group(&mut self) -> Result<(), TokenError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let path = self.path();
        let err = |e: &dyn std::fmt::Display| TokenError::Shard { path: path.clone(), message: e.to_string() };
        let batch = rows_to_batch(&self.pending).map_err(|e| err(&e))?;
        if self.writer.is_none() {
            let props = WriterProperties::builder()
                .set_compression(Compression::ZSTD(ZstdLevel::try_new(3).map_err(|e| err(&e))?))
                .set_max_row_group_row_count(Some(ROWS_PER_GROUP))
                .build();
            let file = File::create(&path).map_err(|e| TokenError::Io { path: path.clone(), source: e })?;
            self.writer = Some(ArrowWriter::try_new(file, batch.schema(), Some(props)).map_err(|e| err(&e))?);
        }
        if let Some(w) = self.writer.as_mut() {
            w.write(&batch).map_err(|e| err(&e))?;
        }
        self.rows_in_file += self.pending.len();
        self.pending.clear();
        if self.rows_in_file >= ROWS_PER_SHARD {
            self.close_file()?;
        }
        Ok(())
    }

    fn close_file(&mut self) -> Result<(), TokenError> {
        if let Some(w) = self.writer.take() {
            let path = self.path();
            w.close().map_err(|e| TokenError::Shard { path: path.clone(), message: e.to_string() })?;
            self.written.push(path);
            self.index += 1;
            self.rows_in_file = 0;
        }
        Ok(())
    }

    fn finish(mut self) -> Result<Vec<PathBuf>, TokenError> {
        self.flush_group()?;
        self.close_file()?;
        Ok(self.written)
    }
}

fn rows_to_batch(rows: &[Row]) -> Result<RecordBatch, arrow::error::ArrowError> {
    let mut ids = ListBuilder::new(UInt32Builder::new());
    let mut mask = ListBuilder::new(UInt8Builder::new());
    let mut docs = ListBuilder::new(UInt32Builder::new());
    let mut sample_ids = ListBuilder::new(StringBuilder::new());
    let mut sources = ListBuilder::new(StringBuilder::new());
    for r in rows {
        ids.values().append_slice(&r.input_ids);
        ids.append(true);
        mask.values().append_slice(&r.loss_mask);
        mask.append(true);
        docs.values().append_slice(&r.doc_lengths);
        docs.append(true);
        for s in &r.sample_ids {
            sample_ids.values().append_value(s);
        }
        sample_ids.append(true);
        for s in &r.sources {
            sources.values().append_value(s);
        }
        sources.append(true);
    }
    let columns: Vec<(&str, ArrayRef)> = vec![
        ("input_ids", Arc::new(ids.finish())),
        ("loss_mask", Arc::new(mask.finish())),
        ("doc_lengths", Arc::new(docs.finish())),
        ("sample_ids", Arc::new(sample_ids.finish())),
        ("sources", Arc::new(sources.finish())),
    ];
    RecordBatch::try_from_iter(columns)
}

/// Reads every row of a shard file.
pub fn read_shard(path: &Path) -> Result<Vec<Row>, TokenError> {
    ShardRows::open(path)?.collect()
}

/// The rows of a shard file, one record batch in memory at a time.
pub struct ShardRows {
    path: PathBuf,
    reader: parquet::arrow::arrow_reader::ParquetRecordBatchReader,
    batch: Option<RecordBatch>,
    next: usize,
}

impl ShardRows {
    pub fn open(path: &Path) -> Result<Self, TokenError> {
        let file = File::open(path).map_err(|e| TokenError::Io { path: path.to_path_buf(), source: e })?;
        let reader = ParquetRecordBatchReaderBuilder::try_new(file)
            .and_then(|b| b.build())
            .map_err(|e| TokenError::Shard { path: path.to_path_buf(), message: e.to_string() })?;
        Ok(ShardRows { path: path.to_path_buf(), reader, batch: None, next: 0 })
    }

    fn err(&self, message: impl std::fmt::Display) -> TokenError {
        TokenError::Shard { path: self.path.clone(), message: message.to_string() }
    }

    fn row(&self, batch: &RecordBatch, i: usize) -> Result<Row, TokenError> {
        let col = |name: &str| batch.column_by_name(name).ok_or_else(|| self.err(format!("no column {name}")));
        let list = |name: &str| -> Result<ArrayRef, TokenError> {
            let c = col(name)?;
            c.as_list_opt::<i32>().map(|l| l.value(i)).ok_or_else(|| self.err(format!("column {name} is not a list")))
        };
        let strings = |name: &str| -> Result<Vec<String>, TokenError> {
            let values = list(name)?;
            let s = values.as_string_opt::<i32>().ok_or_else(|| self.err(format!("column {name} is not strings")))?;
            Ok((0..s.len()).map(|j| s.value(j).to_string()).collect())
        };
        let ids = list("input_ids")?;
        let mask = list("loss_mask")?;
        let docs = list("doc_lengths")?;
        let typed = |name: &str| self.err(format!("column {name} has the wrong element type"));
        Ok(Row {
            input_ids: ids.as_primitive_opt::<UInt32Type>().ok_or_else(|| typed("input_ids"))?.values().to_vec(),
            loss_mask: mask.as_primitive_opt::<UInt8Type>().ok_or_else(|| typed("loss_mask"))?.values().to_vec(),
            doc_lengths: docs.as_primitive_opt::<UInt32Type>().ok_or_else(|| typed("doc_lengths"))?.values().to_vec(),
            sample_ids: strings("sample_ids")?,
            sources: strings("sources")?,
        })
    }
}

impl Iterator for ShardRows {
    type Item = Result<Row, TokenError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(batch) = &self.batch
                && self.next < batch.num_rows()
            {
                self.next += 1;
                return Some(self.row(batch, self.next - 1));
            }
            match self.reader.next()? {
                Ok(batch) => {
                    self.batch = Some(batch);
                    self.next = 0;
                }
                Err(e) => return Some(Err(self.err(e))),
            }
        }
    }
}

/// Counts of what the writer produced.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct ShardStats {
    pub rows: u64,
    pub documents: u64,
    pub tokens: u64,
    pub padding_tokens: u64,
    pub files: Vec<PathBuf>,
}

/// How many rows stay open for best-fit packing before the fullest is written.
const OPEN_ROWS: usize = 64;

/// Turns a stream of samples into shard rows of `seq_len` tokens.
pub struct ShardWriter {
    layout: Layout,
    seq_len: usize,
    pad_id: u32,
    dir: PathBuf,
    open: Vec<Row>,
    files: Vec<(usize, ShardFile)>,
    stats: ShardStats,
}

impl ShardWriter {
    /// A writer into `dir`. The shards an earlier writer left there are removed first: the trainer reads every
    /// shard in a folder, and a prepare that writes fewer files than the last would leave old rows among its
    /// own. Files of other names are left alone.
    pub fn new(dir: &Path, layout: Layout, seq_len: usize, pad_id: u32) -> Result<Self, TokenError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TokenError::Io { path: path.clone(), source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        for entry in std::fs::read_dir(dir).map_err(io(dir))? {
            let path = entry.map_err(io(dir))?.path();
            if path.file_name().and_then(|n| n.to_str()).is_some_and(is_shard_name) && path.is_file() {
                std::fs::remove_file(&path).map_err(io(&path))?;
            }
        }
        Ok(ShardWriter {
            layout,
            seq_len,
            pad_id,
            dir: dir.to_path_buf(),
            open: Vec::new(),
            files: Vec::new(),
            stats: ShardStats::default(),
        })
    }

    /// Adds one sample (already at most `seq_len` tokens).
    pub fn add(&mut self, sample: &TokenSample, source: &str) -> Result<(), TokenError> {
        let len = sample.input_ids.len();
        debug_assert!(len <= self.seq_len);
        self.stats.documents += 1;
        self.stats.tokens += len as u64;
        match self.layout {
            Layout::Bucketed => {
                let mut row = Row::default();
                row.push(sample, source);
                self.emit(row, bucket_len(len, self.seq_len))
            }
            Layout::Packed => {
                let best = (0..self.open.len())
                    .filter(|&i| self.open[i].used() + len <= self.seq_len)
                    .min_by_key(|&i| self.seq_len - self.open[i].used() - len);
                match best {
                    Some(i) => {
                        self.open[i].push(sample, source);
                        if self.open[i].used() == self.seq_len {
                            let row = self.open.swap_remove(i);
                            self.emit(row, self.seq_len)?;
                        }
                    }
                    None => {
                        if self.open.len() >= OPEN_ROWS {
                            let fullest = (0..self.open.len()).max_by_key(|&i| self.open[i].used()).unwrap_or(0);
                            let row = self.open.swap_remove(fullest);
                            self.emit(row, self.seq_len)?;
                        }
                        let mut row = Row::default();
                        row.push(sample, source);
                        self.open.push(row);
                    }
                }
                Ok(())
            }
        }
    }

    fn emit(&mut self, mut row: Row, len: usize) -> Result<(), TokenError> {
        self.stats.padding_tokens += (len - row.used()) as u64;
        self.stats.rows += 1;
        row.pad_to(len, self.pad_id);
        let slot = match self.files.iter().position(|(l, _)| *l == len) {
            Some(i) => i,
            None => {
                let prefix = match self.layout {
                    Layout::Packed => format!("packed-{len}"),
                    Layout::Bucketed => format!("bucket-{len}"),
                };
                self.files.push((len, ShardFile::new(&self.dir, prefix)));
                self.files.len() - 1
            }
        };
        self.files[slot].1.push(row)
    }

    pub fn finish(mut self) -> Result<ShardStats, TokenError> {
        let mut open = std::mem::take(&mut self.open);
        open.sort_by_key(|r| std::cmp::Reverse(r.used()));
        for row in open {
            self.emit(row, self.seq_len)?;
        }
        for (_, file) in std::mem::take(&mut self.files) {
            self.stats.files.extend(file.finish()?);
        }
        self.stats.files.sort();
        Ok(self.stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(id: &str, len: usize) -> TokenSample {
        TokenSample {
            id: id.into(),
            input_ids: vec![7; len],
            loss_mask: (0..len).map(|i| u8::from(i % 2 == 0)).collect(),
        }
    }

    #[test]
    fn packs_best_fit_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::new(dir.path(), Layout::Packed, 16, 0).unwrap();
        for (i, len) in [10, 6, 9, 7, 16, 3].iter().enumerate() {
            w.add(&sample(&format!("s{i}"), *len), "src").unwrap();
        }
        let stats = w.finish().unwrap();
        assert_eq!((stats.documents, stats.tokens), (6, 51));
        let rows: Vec<Row> = stats.files.iter().flat_map(|f| read_shard(f).unwrap()).collect();
        assert_eq!(rows.len() as u64, stats.rows);
        assert_eq!(stats.padding_tokens, rows.len() as u64 * 16 - 51);
        for r in &rows {
            assert_eq!(r.input_ids.len(), 16);
            assert_eq!(r.loss_mask.len(), 16);
            assert!(r.used() <= 16);
            assert_eq!(r.sample_ids.len(), r.doc_lengths.len());
            assert!(r.loss_mask[r.used()..].iter().all(|&m| m == 0));
        }
        // 10+6 and 9+7 fill rows exactly; 16 alone; 3 left open.
        let mut used: Vec<usize> = rows.iter().map(Row::used).collect();
        used.sort();
        assert_eq!(used, [3, 16, 16, 16]);
    }

    #[test]
    fn a_writer_replaces_the_shards_of_the_last_one_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let write = |layout, lens: &[usize]| {
            let mut w = ShardWriter::new(dir.path(), layout, 1024, 0).unwrap();
            for (i, len) in lens.iter().enumerate() {
                w.add(&sample(&format!("s{i}"), *len), "src").unwrap();
            }
            w.finish().unwrap().files
        };
        let names = || {
            let mut names: Vec<String> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        };
        std::fs::write(dir.path().join("conversations.parquet"), b"the user's").unwrap();
        assert_eq!(write(Layout::Bucketed, &[100, 700]).len(), 2);
        let packed = write(Layout::Packed, &[100]);
        assert_eq!(names(), ["conversations.parquet", "packed-1024-00000.parquet"]);
        assert_eq!(packed, [dir.path().join("packed-1024-00000.parquet")]);
        for (name, shard) in [
            ("packed-1024-00000.parquet", true),
            ("bucket-256-00012.parquet", true),
            ("packed-1024.parquet", false),
            ("packed-x-00000.parquet", false),
            ("bucket-256-00012-1.parquet", false),
            ("packed-1024-00000.jsonl", false),
        ] {
            assert_eq!(is_shard_name(name), shard, "{name}");
        }
    }

    #[test]
    fn buckets_pad_to_powers_of_two() {
        assert_eq!(bucket_len(10, 4096), 256);
        assert_eq!(bucket_len(300, 4096), 512);
        assert_eq!(bucket_len(4000, 4096), 4096);
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::new(dir.path(), Layout::Bucketed, 1024, 5).unwrap();
        w.add(&sample("a", 100), "x").unwrap();
        w.add(&sample("b", 700), "y").unwrap();
        let stats = w.finish().unwrap();
        assert_eq!(stats.files.len(), 2);
        let rows = read_shard(&stats.files[0]).unwrap();
        assert_eq!(rows[0].input_ids.len(), 1024);
        assert_eq!(rows[0].input_ids[700], 5);
    }
}
