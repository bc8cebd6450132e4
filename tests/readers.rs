//! Readers on project-made fixtures of every format: good rows normalize, bad rows are counted by reason,
//! bad files stop with an error naming the file and the row group / line / element.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use indicatif::ProgressBar;
use kiln::data::ingest::ingest_source;
use kiln::data::readers::{Location, for_each_row};
use kiln::data::recipe::SourceSpec;
use kiln::data::{Conversation, DataError, Format, Role, SchemaMapping};
use rand::SeedableRng;

fn source(format: Format, schema: SchemaMapping) -> SourceSpec {
    SourceSpec {
        name: "fixture".into(),
        format,
        hub: None,
        path: None,
        max_rows: None,
        weight: 1.0,
        license: None,
        schema,
        off_schema_calls: Default::default(),
    }
}

fn run(
    spec: &SourceSpec,
    files: &[PathBuf],
) -> Result<(kiln::data::ingest::SourceStats, Vec<Conversation>), DataError> {
    let mut out = Vec::new();
    let stats = ingest_source(spec, files, None, None, 0, &ProgressBar::hidden(), &mut |c| {
        out.push(c);
        Ok(())
    })?;
    Ok((stats, out))
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::File::create(&path).unwrap().write_all(text.as_bytes()).unwrap();
    path
}

fn synth_conversations(n: usize) -> Vec<Conversation> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    (0..n)
        .map(|i| kiln::synth::terminal::task(&mut rng, i).conversation(&format!("c{i}"), &format!("task_{i}")))
        .collect()
}

#[test]
fn parquet_round_trips_list_of_struct_conversations_across_row_groups() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.parquet");
    let convs = synth_conversations(300); // three row groups of ≤128
    kiln::synth::write_terminal_parquet(&path, &convs).unwrap();
    let schema = SchemaMapping { id: Some("trial_name".into()), task: Some("task".into()), ..Default::default() };
    let (stats, read) = run(&source(Format::Parquet, schema), std::slice::from_ref(&path)).unwrap();
    assert_eq!((stats.rows_read, stats.kept, stats.emitted), (300, 300, 300));
    assert!(stats.dropped.is_empty());
    assert_eq!(read[0].messages, convs[0].messages);
    assert_eq!(read[299].task(), Some("task_299"));
    assert_eq!(read[7].id, convs[7].meta["trial_name"].as_str().unwrap());

    let mut groups = std::collections::BTreeSet::new();
    for_each_row(&path, Format::Parquet, None, |_, loc| {
        if let Location::Row { row_group, .. } = loc {
            groups.insert(row_group);
        }
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(groups.len(), 3);
}

#[test]
fn parquet_without_the_messages_column_names_the_columns_it_has() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.parquet");
    kiln::synth::write_terminal_parquet(&path, &synth_conversations(2)).unwrap();
    let schema = SchemaMapping { messages: "messages".into(), ..Default::default() };
    let err = run(&source(Format::Parquet, schema), &[path]).unwrap_err().to_string();
    assert!(err.contains("no column 'messages'") && err.contains("conversations, agent, task"), "{err}");
}

#[test]
fn recipe_columns_no_row_holds_are_reported_per_file() {
    let dir = tempfile::tempdir().unwrap();
    let parquet = dir.path().join("t.parquet");
    kiln::synth::write_terminal_parquet(&parquet, &synth_conversations(3)).unwrap();
    // `tsk` is a typo for `task`; `trial_name` exists; `episode` is named twice and listed once.
    let schema = SchemaMapping {
        id: Some("trial_name".into()),
        task: Some("tsk".into()),
        meta: vec!["episode".into(), "nope".into(), "episode".into()],
        ..Default::default()
    };
    let (stats, read) = run(&source(Format::Parquet, schema), std::slice::from_ref(&parquet)).unwrap();
    assert_eq!(read.len(), 3, "rows still normalize");
    let absent: Vec<_> = stats.absent_columns.iter().map(|a| (a.column.as_str(), a.feeds.as_str(), a.rows)).collect();
    assert_eq!(absent, [("tsk", "task", 3), ("nope", "meta", 3)]);
    let warning = stats.absent_columns[0].warning("fixture");
    assert!(warning.contains("'tsk' (schema.task)") && warning.contains("t.parquet"), "{warning}");

    // JSON lines: a column present in one row is not absent; one null in every row is.
    let jsonl = write(
        dir.path(),
        "t.jsonl",
        &[
            GOOD_ROW.replacen('{', r#"{"id": null, "task": null, "#, 1),
            GOOD_ROW.replacen('{', r#"{"id": "x", "task": null, "#, 1),
        ]
        .join("\n"),
    );
    let schema = SchemaMapping { id: Some("id".into()), task: Some("task".into()), ..Default::default() };
    let (stats, _) = run(&source(Format::Jsonl, schema), &[jsonl]).unwrap();
    let absent: Vec<_> = stats.absent_columns.iter().map(|a| (a.column.as_str(), a.rows)).collect();
    assert_eq!(absent, [("task", 2)]);

    let mut ingest = kiln::data::ingest::IngestStats::default();
    ingest.sources.push(stats);
    assert_eq!(ingest.warnings().len(), 1);
}

#[test]
fn corrupt_parquet_names_the_file_and_row_group() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.parquet");
    kiln::synth::write_terminal_parquet(&path, &synth_conversations(300)).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    for b in &mut bytes[mid..mid + 4096] {
        *b = 0x5a;
    }
    std::fs::write(&path, &bytes).unwrap();
    let err = run(&source(Format::Parquet, SchemaMapping::default()), &[path]).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, DataError::Parquet { row_group: Some(_), .. }), "{text}");
    assert!(text.contains("broken.parquet") && text.contains("row group"), "{text}");

    let truncated = dir.path().join("truncated.parquet");
    std::fs::write(&truncated, &bytes[..100]).unwrap();
    let text = run(&source(Format::Parquet, SchemaMapping::default()), &[truncated]).unwrap_err().to_string();
    assert!(text.contains("truncated.parquet") && text.contains("not a readable parquet file"), "{text}");
}

const GOOD_ROW: &str =
    r#"{"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}"#;

#[test]
fn jsonl_counts_each_bad_row_by_reason() {
    let dir = tempfile::tempdir().unwrap();
    let rows = [
        GOOD_ROW,
        "",
        r#"{"messages": []}"#,
        r#"{"conversations": []}"#,
        r#"{"conversations": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "a"}]}"#,
        r#"{"conversations": [{"role": "user", "content": {"nested": 1}}, {"role": "assistant", "content": "a"}]}"#,
        r#"{"conversations": [{"role": "user", "content": "no answer"}]}"#,
        r#"{"conversations": [{"role": "human", "content": "q"}, {"role": "gpt", "content": "a"}]}"#,
    ];
    let path = write(dir.path(), "rows.jsonl", &rows.join("\n"));
    let (stats, read) = run(&source(Format::Jsonl, SchemaMapping::default()), &[path]).unwrap();
    assert_eq!(stats.rows_read, 7, "blank lines are not rows");
    assert_eq!(stats.kept, 2);
    let dropped: Vec<(&str, u64)> = stats.dropped.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(
        dropped,
        [
            ("empty_conversation", 1),
            ("missing_column", 1),
            ("no_assistant_turn", 1),
            ("non_string_content", 1),
            ("unknown_role", 1)
        ]
    );
    assert_eq!(read[1].messages[0].role, Role::User);
    assert_eq!(read[1].id, "fixture/rows.jsonl#l8");
}

#[test]
fn malformed_jsonl_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "bad.jsonl", &format!("{GOOD_ROW}\n{GOOD_ROW}\n{{\"conversations\": [\n"));
    let err = run(&source(Format::Jsonl, SchemaMapping::default()), &[path]).unwrap_err().to_string();
    assert!(err.contains("bad.jsonl: line 3: invalid JSON"), "{err}");
}

#[test]
fn json_arrays_stream_openbmb_rows_and_name_the_broken_element() {
    let dir = tempfile::tempdir().unwrap();
    let schema =
        SchemaMapping { role: "from".into(), content: "value".into(), id: Some("id".into()), ..Default::default() };
    let good = r#"[
 {"id": "a", "conversations": [{"from": "system", "value": "tools"}, {"from": "user", "value": "q"}, {"from": "assistant", "value": "Action: f"}, {"from": "function", "value": "{\"r\": 1}"}, {"from": "assistant", "value": "done"}]},
 {"id": "b", "conversations": [{"from": "user", "value": "q"}]},
 "not an object",
 {"id": "c", "conversations": [{"from": "user", "value": "]},{"}, {"from": "assistant", "value": "ok"}]}
]"#;
    let path = write(dir.path(), "tools.json", good);
    let (stats, read) = run(&source(Format::Json, schema.clone()), &[path]).unwrap();
    assert_eq!((stats.rows_read, stats.kept), (4, 2));
    assert_eq!(stats.dropped["no_assistant_turn"], 1);
    assert_eq!(stats.dropped["missing_column"], 1);
    assert_eq!(read[0].messages[3].role, Role::Tool);
    assert_eq!(read[1].messages[0].content, "]},{");

    let broken =
        write(dir.path(), "broken.json", r#"[{"id": "a", "conversations": []}, {"id": "b", "conversations": [}]"#);
    let err = run(&source(Format::Json, schema.clone()), &[broken]).unwrap_err().to_string();
    assert!(err.contains("broken.json: array element 1"), "{err}");

    let cut = write(dir.path(), "cut.json", r#"[{"id": "a", "conversations": []}, {"id": "b", "conv"#);
    let err = run(&source(Format::Json, schema), &[cut]).unwrap_err().to_string();
    assert!(err.contains("cut.json: array element 1") && err.contains("end of file"), "{err}");
}

/// ToolBench-form rows: a system prompt printing its APIs as a Python list, ReAct calls.
fn toolbench_rows(dir: &Path) -> PathBuf {
    let system = "Specifically, you have access to the following APIs: [{'name': 'search_books', 'parameters': {'type': 'object', 'properties': {'author': {'type': 'string'}}, 'required': ['author']}}, {'name': 'Finish', 'parameters': {'type': 'object', 'properties': {'final_answer': {'type': 'string'}}, 'required': []}}]";
    let call = |name: &str, input: &str| serde_json::json!({"from": "assistant", "value": format!("Thought: go\nAction: {name}\nAction Input: {input}")});
    let result = serde_json::json!({"from": "function", "value": "{\"response\": \"ok\"}"});
    let finish = call("Finish", "{\"final_answer\": \"done\"}");
    let row = |id: &str, turns: Vec<serde_json::Value>| {
        let head =
            [serde_json::json!({"from": "system", "value": system}), serde_json::json!({"from": "user", "value": "q"})];
        serde_json::json!({"id": id, "conversations": head.into_iter().chain(turns).collect::<Vec<_>>()})
    };
    let rows = serde_json::json!([
        row("clean", vec![call("search_books", "{\"author\": \"Calvino\"}"), result.clone(), finish.clone()]),
        // A call to a function the prompt does not list, then the corrected call.
        row(
            "corrected",
            vec![
                call("search_films", "{\"author\": \"Calvino\"}"),
                result.clone(),
                call("search_books", "{\"author\": \"Calvino\"}"),
                result.clone(),
                finish
            ]
        ),
        // The only trained turn passes a Python dict, not JSON.
        row("unreadable", vec![call("search_books", "{'author': 'Calvino'}")]),
    ]);
    write(dir, "toolbench.json", &rows.to_string())
}

#[test]
fn calls_off_their_schema_are_kept_as_history_or_dropped_as_the_source_asks() {
    use kiln::data::recipe::OffSchemaCalls;
    let dir = tempfile::tempdir().unwrap();
    let path = toolbench_rows(dir.path());
    let schema =
        SchemaMapping { role: "from".into(), content: "value".into(), id: Some("id".into()), ..Default::default() };
    let with = |policy| SourceSpec { off_schema_calls: policy, ..source(Format::Json, schema.clone()) };
    let trained = |c: &Conversation| c.messages.iter().map(|m| m.is_trained_turn()).collect::<Vec<_>>();

    let (stats, kept) = run(&with(OffSchemaCalls::Keep), std::slice::from_ref(&path)).unwrap();
    assert_eq!((stats.kept, stats.turns_off_schema_untrained), (3, 0));
    assert!(stats.dropped.is_empty());

    let (stats, history) = run(&with(OffSchemaCalls::History), std::slice::from_ref(&path)).unwrap();
    assert_eq!((stats.kept, stats.turns_off_schema_untrained), (2, 1));
    assert_eq!(stats.dropped["calls_off_schema"], 1, "no trained turn is left of 'unreadable'");
    assert_eq!(history[0], kept[0]);
    assert_eq!(trained(&history[1]), [false, false, false, false, true, false, true], "only the stray call is history");
    assert_eq!(
        history[1].messages,
        kept[1]
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let mut m = m.clone();
                m.train &= i != 2;
                m
            })
            .collect::<Vec<_>>()
    );

    let (stats, dropped) = run(&with(OffSchemaCalls::Drop), &[path]).unwrap();
    assert_eq!((stats.kept, stats.dropped["calls_off_schema"]), (1, 2));
    assert_eq!(dropped[0].id, "clean");
}

#[test]
fn caps_and_weights_apply_after_drops() {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..50)
        .map(|i| {
            if i % 5 == 0 {
                r#"{"conversations": []}"#.to_string()
            } else {
                GOOD_ROW.replace("\"q\"", &format!("\"q{i}\""))
            }
        })
        .collect();
    let path = write(dir.path(), "rows.jsonl", &lines.join("\n"));
    let mut spec = source(Format::Jsonl, SchemaMapping::default());
    spec.max_rows = Some(12);
    spec.weight = 2.0;
    let (stats, read) = run(&spec, &[path]).unwrap();
    assert_eq!((stats.kept, stats.emitted, stats.capped), (12, 24, true));
    assert_eq!(read[1].id, format!("{}#1", read[0].id));
}

/// A Hub-style function-calling parquet: messages as list<struct<role, content, tool_calls:
/// list<struct<id, type, function: struct<name, arguments>>>>> with nulls where a message has no text or no
/// calls, and tools as a JSON string column.
#[test]
fn parquet_function_calls_with_nested_structs_and_nulls() {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, ListBuilder, RecordBatch, StringBuilder, StructBuilder};
    use arrow::datatypes::{DataType, Field, Fields};

    let text = |name: &str| Field::new(name, DataType::Utf8, true);
    let function_fields = Fields::from(vec![text("name"), text("arguments")]);
    let call_fields = Fields::from(vec![
        text("id"),
        text("type"),
        Field::new("function", DataType::Struct(function_fields.clone()), true),
    ]);
    let call_item = Arc::new(Field::new("item", DataType::Struct(call_fields.clone()), true));
    let message_fields = Fields::from(vec![
        text("role"),
        text("content"),
        Field::new("tool_calls", DataType::List(call_item.clone()), true),
    ]);
    let call_builder = StructBuilder::new(
        call_fields,
        vec![
            Box::new(StringBuilder::new()),
            Box::new(StringBuilder::new()),
            Box::new(StructBuilder::from_fields(function_fields, 0)),
        ],
    );
    let message_builder = StructBuilder::new(
        message_fields.clone(),
        vec![
            Box::new(StringBuilder::new()),
            Box::new(StringBuilder::new()),
            Box::new(ListBuilder::new(call_builder).with_field(call_item)),
        ],
    );
    let mut messages = ListBuilder::new(message_builder).with_field(Arc::new(Field::new(
        "item",
        DataType::Struct(message_fields),
        true,
    )));
    let mut tools = StringBuilder::new();
    type Call<'a> = (&'a str, &'a str, &'a str);
    let push = |list: &mut ListBuilder<StructBuilder>, role: &str, content: Option<&str>, calls: &[Call]| {
        let m = list.values();
        m.field_builder::<StringBuilder>(0).unwrap().append_value(role);
        m.field_builder::<StringBuilder>(1).unwrap().append_option(content);
        let call_list = m.field_builder::<ListBuilder<StructBuilder>>(2).unwrap();
        for (id, name, arguments) in calls {
            let c = call_list.values();
            c.field_builder::<StringBuilder>(0).unwrap().append_value(id);
            c.field_builder::<StringBuilder>(1).unwrap().append_value("function");
            let f = c.field_builder::<StructBuilder>(2).unwrap();
            f.field_builder::<StringBuilder>(0).unwrap().append_value(name);
            f.field_builder::<StringBuilder>(1).unwrap().append_value(arguments);
            f.append(true);
            c.append(true);
        }
        call_list.append(!calls.is_empty());
        m.append(true);
    };
    push(&mut messages, "user", Some("Weather in Oslo?"), &[]);
    push(&mut messages, "assistant", None, &[("c1", "get_weather", r#"{"city": "Oslo"}"#)]);
    push(&mut messages, "tool", Some("cold"), &[]);
    push(&mut messages, "assistant", Some("Cold."), &[]);
    messages.append(true);
    tools.append_value(r#"[{"name": "get_weather", "parameters": {"type": "object"}}]"#);
    push(&mut messages, "user", Some("hi"), &[]);
    push(&mut messages, "assistant", Some("hello"), &[]);
    messages.append(true);
    tools.append_null();
    let columns: Vec<(&str, ArrayRef)> =
        vec![("messages", Arc::new(messages.finish())), ("tools", Arc::new(tools.finish()))];
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calls.parquet");
    let mut writer =
        parquet::arrow::ArrowWriter::try_new(std::fs::File::create(&path).unwrap(), batch.schema(), None).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();

    let schema = SchemaMapping { messages: "messages".into(), tools: Some("tools".into()), ..Default::default() };
    let (stats, read) = run(&source(Format::Parquet, schema), std::slice::from_ref(&path)).unwrap();
    assert!(stats.dropped.is_empty() && stats.absent_columns.is_empty(), "{stats:?}");
    let call_turn = &read[0].messages[1];
    assert_eq!(call_turn.content, "");
    assert_eq!(call_turn.tool_calls[0].id.as_deref(), Some("c1"));
    assert_eq!(call_turn.tool_calls[0].function.name, "get_weather");
    assert_eq!(
        serde_json::Value::Object(call_turn.tool_calls[0].function.arguments.clone()),
        serde_json::json!({"city": "Oslo"})
    );
    assert!(read[0].messages[2].tool_calls.is_empty() && read[0].messages[2].role == Role::Tool);
    assert_eq!(
        read[0].tools,
        [
            serde_json::json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}})
        ]
    );
    assert!(read[1].tools.is_empty() && read[1].messages.iter().all(|m| m.tool_calls.is_empty()));
}

/// A function-calling set uploaded through Hugging Face `datasets` (tests/fixtures/datasets/make_fixtures.py):
/// the parquet's structs hold the union of every row's keys, so row 0's call is stored as `{"city": "Oslo",
/// "origin": null, "date": null, "filters": null, "unit": null}` and each tool's properties likewise. Read back,
/// the parquet must give the rows as written (the JSON lines of the same rows): a null struct field is a key
/// the row did not have, and a template would print it (`get_weather(city="Oslo", origin=null, …)`) in the
/// very calls the model learns to make.
#[test]
fn parquet_from_hf_datasets_reads_back_as_its_rows_without_the_unions_nulls() {
    use arrow::datatypes::DataType;

    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/datasets");
    let parquet = dir.join("function_calls.parquet");
    let schema = SchemaMapping { messages: "messages".into(), tools: Some("tools".into()), ..Default::default() };

    // The fixture holds the union: the calls' arguments are one struct of all five argument names.
    let file = std::fs::File::open(&parquet).unwrap();
    let arrow_schema =
        parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file).unwrap().schema().clone();
    let field_names = |dt: &DataType| match dt {
        DataType::Struct(fields) => fields.iter().map(|f| f.name().as_str()).collect::<Vec<_>>().join(","),
        other => panic!("not a struct: {other}"),
    };
    let item = |dt: &DataType| match dt {
        DataType::List(item) | DataType::LargeList(item) => item.data_type().clone(),
        other => panic!("not a list: {other}"),
    };
    let child = |dt: &DataType, name: &str| match dt {
        DataType::Struct(fields) => fields.iter().find(|f| f.name() == name).unwrap().data_type().clone(),
        other => panic!("not a struct: {other}"),
    };
    let message = item(arrow_schema.field_with_name("messages").unwrap().data_type());
    let arguments = child(&child(&item(&child(&message, "tool_calls")), "function"), "arguments");
    assert_eq!(field_names(&arguments), "city,origin,date,filters,unit");

    let (parquet_stats, from_parquet) = run(&source(Format::Parquet, schema.clone()), &[parquet]).unwrap();
    let (jsonl_stats, from_jsonl) = run(&source(Format::Jsonl, schema), &[dir.join("function_calls.jsonl")]).unwrap();
    assert_eq!((parquet_stats.kept, jsonl_stats.kept), (4, 4), "{parquet_stats:?} {jsonl_stats:?}");
    for (p, j) in from_parquet.iter().zip(&from_jsonl) {
        // Byte for byte, key order included: a template renders what it is given in that order.
        assert_eq!(serde_json::to_string(&p.messages).unwrap(), serde_json::to_string(&j.messages).unwrap());
        assert_eq!(serde_json::to_string(&p.tools).unwrap(), serde_json::to_string(&j.tools).unwrap());
    }
    let call = &from_parquet[0].messages[1].tool_calls[0];
    assert_eq!(serde_json::Value::Object(call.function.arguments.clone()), serde_json::json!({"city": "Oslo"}));
    let nested = &from_parquet[2].messages[2].tool_calls[1].function.arguments["filters"];
    assert_eq!(nested, &serde_json::json!({"airline": "SK"}));
    assert!(from_parquet[3].tools.is_empty());
}
