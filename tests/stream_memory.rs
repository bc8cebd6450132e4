//! A multi-hundred-MB JSON array (the shape of OpenBMB's 2 GB ToolBench file) is ingested element by
//! element: peak memory grows by a small bound, not by the file's size. Alone in its own test binary so
//! no other test shares the process's peak.

use std::io::{BufWriter, Write};

use indicatif::ProgressBar;
use kiln::data::ingest::ingest_source;
use kiln::data::recipe::SourceSpec;
use kiln::data::{Format, SchemaMapping};
use kiln::host::peak_rss_bytes;

const TARGET_BYTES: u64 = 300 << 20;
const GROWTH_BOUND: u64 = 64 << 20;

#[test]
fn a_300_mb_json_array_streams_in_bounded_memory() {
    let Some(_) = peak_rss_bytes() else {
        eprintln!("no /proc/self/status here: memory bound not measurable");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("toolllama_like.json");
    let mut w = BufWriter::new(std::fs::File::create(&path).unwrap());
    let filler = "lorem ipsum dolor sit amet ".repeat(40);
    let mut written = 0u64;
    let mut rows = 0u64;
    w.write_all(b"[").unwrap();
    while written < TARGET_BYTES {
        let row = serde_json::json!({"id": format!("q{rows}"), "conversations": [
            {"from": "system", "value": filler},
            {"from": "user", "value": format!("question {rows} {filler}")},
            {"from": "assistant", "value": format!("Thought: {filler}\nAction: f\nAction Input: {{}}")},
            {"from": "function", "value": filler},
            {"from": "assistant", "value": "Finish"}]});
        let bytes = serde_json::to_vec(&row).unwrap();
        if rows > 0 {
            w.write_all(b",\n").unwrap();
        }
        w.write_all(&bytes).unwrap();
        written += bytes.len() as u64 + 2;
        rows += 1;
    }
    w.write_all(b"]").unwrap();
    w.flush().unwrap();
    drop(w);

    let before = peak_rss_bytes().unwrap();
    let spec = SourceSpec {
        name: "toolbench".into(),
        format: Format::Json,
        hub: None,
        path: None,
        max_rows: None,
        weight: 1.0,
        license: None,
        schema: SchemaMapping {
            role: "from".into(),
            content: "value".into(),
            id: Some("id".into()),
            ..Default::default()
        },
        off_schema_calls: Default::default(),
    };
    let mut seen = 0u64;
    let stats = ingest_source(&spec, &[path], None, None, 0, &ProgressBar::hidden(), &mut |_| {
        seen += 1;
        Ok(())
    })
    .unwrap();
    let growth = peak_rss_bytes().unwrap().saturating_sub(before);
    assert_eq!((stats.rows_read, seen), (rows, rows));
    assert!(growth < GROWTH_BOUND, "peak memory grew by {} MiB reading a {} MiB array", growth >> 20, written >> 20);
}
