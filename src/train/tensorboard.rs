//! TensorBoard's view of a training run: `train/events.out.tfevents.*` files hold the scalars of
//! `metrics.jsonl` (tags `train/*`) and `validation.jsonl` (tags `validation/*`), written as each step and
//! measure is, so `tensorboard --logdir runs` draws every run's curves live and side by side. The x axis is
//! steps taken: a step's scalars sit at its `metrics.jsonl` step + 1, a validation point at its own step
//! (0 is the base model).
//!
//! The format is written here by hand (TFRecord framing of `tensorflow.Event` protobufs, a few fields of four
//! messages): the Rust crates for it are unmaintained (protobuf 2). Every file opens with a SessionLog START
//! at the first step it will hold, as TensorFlow's sessions do. TensorBoard takes a run's first START as its
//! beginning and each later one as a restart, dropping what earlier files hold from its step on: so a resumed
//! run, which writes a new file, replaces the steps a killed run took after its last saved state (the resumed
//! run takes them again).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crc_fast::{CrcAlgorithm, checksum};

use super::TrainError;
use super::trainer::StepMetrics;
use super::validation::ValidationPoint;

/// What every TensorBoard event file name contains.
const EVENT_FILE_MARK: &str = "tfevents";
/// The first event of every file: the format version TensorBoard's readers expect.
const FILE_VERSION: &str = "brain.Event:2";

/// One event's payload.
#[derive(Debug, Clone, PartialEq)]
pub enum EventBody {
    FileVersion(String),
    /// Tags and values, stored as f32 (`Summary.Value.simple_value`).
    Scalars(Vec<(String, f32)>),
    /// `SessionLog { status: START }`: the events from this one's step on in earlier files are stale.
    SessionStart,
}

/// One `tensorflow.Event`.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub wall_time: f64,
    pub step: i64,
    pub body: EventBody,
}

/// An event file being written in a run's `train/` (or, for the Scores, `eval/`) folder.
pub struct EventLog {
    path: PathBuf,
    file: File,
}

impl EventLog {
    /// A new event file in `dir`, opened with a SessionLog START at the first step it will hold. A run that
    /// starts afresh (`resumed_at` none) first removes the event files an earlier run left there, and starts
    /// at 0; a run resumed after `resumed_at` steps starts at `resumed_at + 1`, or at 0 when no step was taken
    /// (the base model is measured again).
    pub fn open(dir: &Path, resumed_at: Option<usize>) -> Result<Self, TrainError> {
        if resumed_at.is_none() {
            for path in event_files(dir).map_err(|e| state_error(dir, e))? {
                crate::files::remove_if_present(&path).map_err(|e| state_error(&path, e))?;
            }
        }
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        // Zero-padded, so that TensorBoard, which reads a folder's files in name order, reads them in time order.
        let name = format!("events.out.{EVENT_FILE_MARK}.{:010}.{:06}.kiln", now.as_secs(), now.subsec_micros());
        let path = dir.join(name);
        let file = File::create(&path).map_err(|e| state_error(&path, e))?;
        let mut log = EventLog { file, path };
        log.write(0, EventBody::FileVersion(FILE_VERSION.into()))?;
        let first_step = resumed_at.map_or(0, |step| if step == 0 { 0 } else { step + 1 });
        log.write(first_step, EventBody::SessionStart)?;
        Ok(log)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The scalars of one training step.
    pub fn step(&mut self, metrics: &StepMetrics) -> Result<(), TrainError> {
        self.scalars(metrics.step + 1, step_scalars(metrics))
    }

    /// The scalars of one validation measure.
    pub fn validation(&mut self, point: &ValidationPoint) -> Result<(), TrainError> {
        self.scalars(point.step, validation_scalars(point))
    }

    /// `values` (tag, value) at `step`.
    pub fn scalars(&mut self, step: usize, values: Vec<(String, f32)>) -> Result<(), TrainError> {
        self.write(step, EventBody::Scalars(values))
    }

    /// One event, stamped now, written whole at once (the file is unbuffered), so that TensorBoard sees it
    /// while the run goes on.
    fn write(&mut self, step: usize, body: EventBody) -> Result<(), TrainError> {
        let wall_time = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64();
        let event = Event { wall_time, step: i64::try_from(step).unwrap_or(i64::MAX), body };
        self.file.write_all(&record(&encode_event(&event))).map_err(|e| state_error(&self.path, e))
    }
}

fn state_error(path: &Path, e: std::io::Error) -> TrainError {
    TrainError::State { path: path.into(), message: format!("TensorBoard events: {e}") }
}

/// The event files in `dir` (any writer's: TensorBoard reads them all as one run), in name order.
pub fn event_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry?;
        if entry.file_name().to_string_lossy().contains(EVENT_FILE_MARK) && entry.file_type()?.is_file() {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

/// The scalars TensorBoard's server shows of the run whose event files are in `dir`, by tag, as (step, value)
/// in the order written: the files read in name order, and every SessionLog START after the first dropping
/// what came before it from its step on (its default `purge_orphaned_data`; the first START begins the run).
pub fn scalars_as_shown(dir: &Path) -> Result<BTreeMap<String, Vec<(i64, f32)>>, EventFileError> {
    let files = event_files(dir).map_err(|source| EventFileError::Io { path: dir.into(), source })?;
    let mut shown: BTreeMap<String, Vec<(i64, f32)>> = BTreeMap::new();
    let mut started = false;
    for path in files {
        for event in read_events(&path)? {
            match event.body {
                EventBody::SessionStart if !started => started = true,
                EventBody::SessionStart => shown.values_mut().for_each(|v| v.retain(|&(step, _)| step < event.step)),
                EventBody::Scalars(values) => {
                    for (tag, value) in values {
                        shown.entry(tag).or_default().push((event.step, value));
                    }
                }
                EventBody::FileVersion(_) => {}
            }
        }
    }
    Ok(shown)
}

/// A step's `metrics.jsonl` figures under `train/`; the peak memory in GiB (the value is an f32).
pub fn step_scalars(m: &StepMetrics) -> Vec<(String, f32)> {
    let mut out: Vec<(String, f32)> = vec![
        ("train/loss".into(), m.loss as f32),
        ("train/lr".into(), m.lr as f32),
        ("train/grad_norm".into(), m.grad_norm as f32),
        ("train/tokens".into(), m.tokens as f32),
        ("train/supervised_tokens".into(), m.supervised_tokens as f32),
        ("train/tokens_per_s".into(), m.tokens_per_s as f32),
        ("train/epoch".into(), m.epoch as f32),
    ];
    if let Some(mfu) = m.mfu {
        out.push(("train/mfu".into(), mfu as f32));
    }
    if let Some(bytes) = m.peak_memory_bytes {
        out.push(("train/peak_memory_gib".into(), (bytes as f64 / (1u64 << 30) as f64) as f32));
    }
    if let Some(balance) = &m.experts {
        out.push(("train/expert_max_vio".into(), balance.max_vio as f32));
    }
    out
}

/// A validation point's loss, its loss by source (`validation/loss/<source>`) and an MoE's MaxVio.
pub fn validation_scalars(p: &ValidationPoint) -> Vec<(String, f32)> {
    let mut out: Vec<(String, f32)> = vec![("validation/loss".into(), p.loss as f32)];
    out.extend(p.sources.iter().map(|(source, s)| (format!("validation/loss/{source}"), s.loss as f32)));
    if let Some(balance) = p.expert_tokens.balance() {
        out.push(("validation/expert_max_vio".into(), balance.max_vio as f32));
    }
    out
}

// Protobuf wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LENGTH_DELIMITED: u8 = 2;
const FIXED32: u8 = 5;

/// `event` as protobuf bytes, fields in number order and proto3 defaults (a step of 0) left out, as
/// TensorFlow's and TensorBoard's writers serialize it.
pub fn encode_event(event: &Event) -> Vec<u8> {
    let mut out = Vec::new();
    key(&mut out, 1, FIXED64);
    out.extend_from_slice(&event.wall_time.to_le_bytes());
    if event.step != 0 {
        key(&mut out, 2, VARINT);
        varint(&mut out, event.step as u64);
    }
    match &event.body {
        EventBody::FileVersion(version) => bytes_field(&mut out, 3, version.as_bytes()),
        EventBody::Scalars(values) => {
            let mut summary = Vec::new();
            for (tag, value) in values {
                let mut entry = Vec::new();
                bytes_field(&mut entry, 1, tag.as_bytes());
                key(&mut entry, 2, FIXED32);
                entry.extend_from_slice(&value.to_le_bytes());
                bytes_field(&mut summary, 1, &entry);
            }
            bytes_field(&mut out, 5, &summary);
        }
        EventBody::SessionStart => {
            let mut session_log = Vec::new();
            key(&mut session_log, 1, VARINT);
            varint(&mut session_log, 1);
            bytes_field(&mut out, 7, &session_log);
        }
    }
    out
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, u64::from(field << 3 | u32::from(wire)));
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    key(out, field, LENGTH_DELIMITED);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// TFRecord framing: the length (u64 LE), its masked CRC-32C, the data, the data's masked CRC-32C.
pub fn record(data: &[u8]) -> Vec<u8> {
    let length = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&length);
    out.extend_from_slice(&masked_crc(&length).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// TFRecord's CRC-32C, rotated and offset (so a CRC stored inside checksummed data does not cancel out).
fn masked_crc(data: &[u8]) -> u32 {
    let crc = checksum(CrcAlgorithm::Crc32Iscsi, data) as u32;
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Why an event file does not read back.
#[derive(Debug, thiserror::Error)]
pub enum EventFileError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: byte {offset}: {message}")]
    Corrupt { path: PathBuf, offset: usize, message: String },
}

/// The events of the file at `path`, every record's CRCs checked. A record cut off at the end (a writer
/// killed mid-write) ends the list, as TensorBoard's reader takes it.
pub fn read_events(path: &Path) -> Result<Vec<Event>, EventFileError> {
    let bytes = std::fs::read(path).map_err(|source| EventFileError::Io { path: path.into(), source })?;
    let corrupt = |offset: usize, message: String| EventFileError::Corrupt { path: path.into(), offset, message };
    let mut events = Vec::new();
    let mut at = 0;
    while at + 12 <= bytes.len() {
        let length_bytes = &bytes[at..at + 8];
        if read_u32(&bytes[at + 8..at + 12]) != masked_crc(length_bytes) {
            return Err(corrupt(at, "the record length's CRC does not match".into()));
        }
        let length = usize::try_from(u64::from_le_bytes(length_bytes.try_into().unwrap_or_default()))
            .map_err(|_| corrupt(at, "a record longer than memory".into()))?;
        let data_at = at + 12;
        let Some(end) = data_at.checked_add(length).filter(|end| end + 4 <= bytes.len()) else { break };
        let data = &bytes[data_at..end];
        if read_u32(&bytes[end..end + 4]) != masked_crc(data) {
            return Err(corrupt(data_at, "the record's CRC does not match".into()));
        }
        events.push(decode_event(data).map_err(|message| corrupt(data_at, message))?);
        at = end + 4;
    }
    Ok(events)
}

fn read_u32(bytes: &[u8]) -> u32 {
    u32::from_le_bytes(bytes.try_into().unwrap_or_default())
}

/// The fields `encode_event` writes; others are skipped.
fn decode_event(data: &[u8]) -> Result<Event, String> {
    let mut event = Event { wall_time: 0.0, step: 0, body: EventBody::Scalars(Vec::new()) };
    for (field, value) in fields(data)? {
        match (field, value) {
            (1, Field::Fixed64(bits)) => event.wall_time = f64::from_bits(bits),
            (2, Field::Varint(step)) => event.step = step as i64,
            (3, Field::Bytes(version)) => {
                event.body = EventBody::FileVersion(String::from_utf8_lossy(version).into_owned())
            }
            (5, Field::Bytes(summary)) => {
                let mut values = Vec::new();
                for (field, entry) in fields(summary)? {
                    let (1, Field::Bytes(entry)) = (field, entry) else { continue };
                    let (mut tag, mut value) = (String::new(), None);
                    for (field, part) in fields(entry)? {
                        match (field, part) {
                            (1, Field::Bytes(t)) => tag = String::from_utf8_lossy(t).into_owned(),
                            (2, Field::Fixed32(bits)) => value = Some(f32::from_bits(bits)),
                            _ => {}
                        }
                    }
                    values.extend(value.map(|v| (tag, v)));
                }
                event.body = EventBody::Scalars(values);
            }
            (7, Field::Bytes(session_log))
                if fields(session_log)?.iter().any(|(field, v)| *field == 1 && matches!(v, Field::Varint(1))) =>
            {
                event.body = EventBody::SessionStart
            }
            _ => {}
        }
    }
    Ok(event)
}

enum Field<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32(u32),
}

/// The (field number, value) pairs of a protobuf message.
fn fields(mut data: &[u8]) -> Result<Vec<(u64, Field<'_>)>, String> {
    let mut out = Vec::new();
    while !data.is_empty() {
        let key = read_varint(&mut data)?;
        let value = match (key & 7) as u8 {
            VARINT => Field::Varint(read_varint(&mut data)?),
            FIXED64 => Field::Fixed64(u64::from_le_bytes(take(&mut data, 8)?.try_into().unwrap_or_default())),
            LENGTH_DELIMITED => {
                let length = usize::try_from(read_varint(&mut data)?).map_err(|e| e.to_string())?;
                Field::Bytes(take(&mut data, length)?)
            }
            FIXED32 => Field::Fixed32(read_u32(take(&mut data, 4)?)),
            wire => return Err(format!("protobuf wire type {wire} is not one an event uses")),
        };
        out.push((key >> 3, value));
    }
    Ok(out)
}

fn take<'a>(data: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
    if data.len() < n {
        return Err(format!("a protobuf field wants {n} bytes, {} are left", data.len()));
    }
    let (head, rest) = data.split_at(n);
    *data = rest;
    Ok(head)
}

fn read_varint(data: &mut &[u8]) -> Result<u64, String> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let [byte, rest @ ..] = *data else { return Err("a protobuf varint is cut off".into()) };
        *data = rest;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err("a protobuf varint longer than 10 bytes".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::routing::{ExpertLoad, LoadBalance};

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tensorboard").join(name)
    }

    /// tests/fixtures/tensorboard/events.json as events (make_fixture.py wrote it beside the bytes).
    fn fixture_events() -> Vec<Event> {
        let text = std::fs::read_to_string(fixture("events.json")).expect("the fixture's events");
        let specs: Vec<serde_json::Value> = serde_json::from_str(&text).expect("a JSON list");
        specs
            .iter()
            .map(|spec| {
                let body = if let Some(version) = spec["file_version"].as_str() {
                    EventBody::FileVersion(version.into())
                } else if spec["session_start"].as_bool() == Some(true) {
                    EventBody::SessionStart
                } else {
                    let pairs = spec["scalars"].as_array().expect("scalars");
                    EventBody::Scalars(
                        pairs.iter().map(|p| (p[0].as_str().unwrap().into(), p[1].as_f64().unwrap() as f32)).collect(),
                    )
                };
                Event { wall_time: spec["wall_time"].as_f64().unwrap(), step: spec["step"].as_i64().unwrap(), body }
            })
            .collect()
    }

    #[test]
    fn events_are_the_bytes_tensorboards_own_writer_makes() {
        let events = fixture_events();
        assert_eq!(events.len(), 5);
        let ours: Vec<u8> = events.iter().flat_map(|e| record(&encode_event(e))).collect();
        let theirs = std::fs::read(fixture("events.out.tfevents.fixture")).unwrap();
        assert_eq!(ours, theirs);
        assert_eq!(read_events(&fixture("events.out.tfevents.fixture")).unwrap(), events);
    }

    #[test]
    fn a_record_cut_off_ends_the_events_and_a_changed_byte_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let whole = std::fs::read(fixture("events.out.tfevents.fixture")).unwrap();
        let first = record(&encode_event(&fixture_events()[0])).len();
        let path = dir.path().join("events.out.tfevents.cut");
        std::fs::write(&path, &whole[..first + 20]).unwrap();
        assert_eq!(read_events(&path).unwrap(), fixture_events()[..1]);

        let mut changed = whole.clone();
        changed[first + 30] ^= 1;
        std::fs::write(&path, &changed).unwrap();
        let err = read_events(&path).unwrap_err().to_string();
        assert!(err.contains(&format!("byte {}: the record's CRC does not match", first + 12)), "{err}");
        changed = whole;
        changed[first + 2] ^= 1;
        std::fs::write(&path, &changed).unwrap();
        let err = read_events(&path).unwrap_err().to_string();
        assert!(err.contains(&format!("byte {first}: the record length's CRC")), "{err}");
    }

    fn metrics(step: usize, experts: Option<LoadBalance>) -> StepMetrics {
        StepMetrics {
            step,
            epoch: 1,
            loss: 0.75,
            lr: 2e-5,
            grad_norm: 1.5,
            tokens: 8192,
            supervised_tokens: 4000,
            tokens_per_s: 12000.0,
            mfu: Some(0.41),
            peak_memory_bytes: Some(3 << 29),
            experts,
        }
    }

    fn scalars(event: &Event) -> &[(String, f32)] {
        match &event.body {
            EventBody::Scalars(values) => values,
            other => panic!("not scalars: {other:?}"),
        }
    }

    #[test]
    fn a_fresh_run_starts_the_folder_over_and_a_resumed_one_marks_where_it_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        std::fs::write(dir.path().join("events.out.tfevents.1.other-writer"), "old").unwrap();
        let mut log = EventLog::open(dir.path(), None).unwrap();
        let balance = LoadBalance { max_vio: 0.5, worst_layer: 3, worst_max_vio: 0.75, idle_experts: 0 };
        log.step(&metrics(4, Some(balance))).unwrap();
        let first = log.path().to_path_buf();
        assert_eq!(event_files(dir.path()).unwrap(), std::slice::from_ref(&first), "the earlier run's file is gone");
        assert!(dir.path().join("metrics.jsonl").exists());
        let events = read_events(&first).unwrap();
        assert_eq!(events[0].body, EventBody::FileVersion(FILE_VERSION.into()));
        assert_eq!((events[1].step, &events[1].body), (0, &EventBody::SessionStart), "where the run begins");
        assert_eq!(events[2].step, 5, "a step's scalars sit at the steps taken");
        let tags: Vec<(&str, f32)> = scalars(&events[2]).iter().map(|(t, v)| (t.as_str(), *v)).collect();
        assert_eq!(
            tags,
            [
                ("train/loss", 0.75),
                ("train/lr", 2e-5),
                ("train/grad_norm", 1.5),
                ("train/tokens", 8192.0),
                ("train/supervised_tokens", 4000.0),
                ("train/tokens_per_s", 12000.0),
                ("train/epoch", 1.0),
                ("train/mfu", 0.41),
                ("train/peak_memory_gib", 1.5),
                ("train/expert_max_vio", 0.5),
            ]
        );
        let dense = step_scalars(&StepMetrics { mfu: None, peak_memory_bytes: None, ..metrics(0, None) });
        assert_eq!(dense.len(), 7, "no MFU, memory or routing where the step has none: {dense:?}");

        assert_eq!(scalars_as_shown(dir.path()).unwrap()["train/loss"], [(5, 0.75)]);
        std::thread::sleep(std::time::Duration::from_millis(2));
        let resumed = EventLog::open(dir.path(), Some(4)).unwrap();
        assert_eq!(event_files(dir.path()).unwrap(), [first.clone(), resumed.path().to_path_buf()], "name order");
        let events = read_events(resumed.path()).unwrap();
        assert_eq!((events[1].step, &events[1].body), (5, &EventBody::SessionStart));
        assert!(scalars_as_shown(dir.path()).unwrap()["train/loss"].is_empty(), "step 5 is to be taken again");
        std::thread::sleep(std::time::Duration::from_millis(2));
        let at_base = EventLog::open(dir.path(), Some(0)).unwrap();
        let events = read_events(at_base.path()).unwrap();
        assert_eq!((events[1].step, &events[1].body), (0, &EventBody::SessionStart));
        assert_eq!(event_files(dir.path()).unwrap().len(), 3);
    }

    #[test]
    fn a_validation_point_gives_its_loss_by_source_at_its_own_step() {
        let sources = [("terminal", 0.5), ("toolbench", 1.25)]
            .into_iter()
            .map(|(s, loss)| (s.to_string(), super::super::validation::SourceLoss { loss, supervised_tokens: 10 }))
            .collect();
        let point = ValidationPoint {
            step: 0,
            epoch: 0.0,
            checkpoint: Some("base".into()),
            loss: 0.625,
            supervised_tokens: 20,
            sources,
            expert_tokens: ExpertLoad(BTreeMap::from([(2, vec![3, 1])])),
            seconds: 0.1,
        };
        let got = validation_scalars(&point);
        let want: Vec<(String, f32)> = [
            ("validation/loss", 0.625),
            ("validation/loss/terminal", 0.5),
            ("validation/loss/toolbench", 1.25),
            ("validation/expert_max_vio", 0.5),
        ]
        .into_iter()
        .map(|(t, v)| (t.to_string(), v))
        .collect();
        assert_eq!(got, want);
    }
}
