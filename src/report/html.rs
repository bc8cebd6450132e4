//! The inspection report as text: `index.html` (self-contained, no JavaScript, well-formed XML so it can be
//! checked mechanically; plots inline as SVG) and `summary.md` (the key figures for terminals and the card).

use std::fmt::Write;

use super::ReportError;
use super::figures::{CallChecks, Distribution, Inspection, share};
use super::inspect::{InspectResult, Piece};
use super::plots::histogram_svg;

/// Escapes text for HTML/XML; control characters become their visible Unicode pictures (␛ for ESC), since
/// terminal output in the data often carries them and XML forbids them.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            '\n' | '\t' => out.push(c),
            c if (c as u32) < 0x20 => out.push(char::from_u32(0x2400 + c as u32).unwrap_or('?')),
            '\u{7f}' => out.push('␡'),
            c => out.push(c),
        }
    }
    out
}

pub fn percent(x: f64) -> String {
    format!("{:.1} %", 100.0 * x)
}

fn count_share(part: u64, whole: u64) -> String {
    format!("{part} ({})", percent(share(part, whole)))
}

/// The key figures, in order, as (name, value): `summary.md`'s table and the report's first table.
pub fn key_figures(ins: &Inspection) -> Vec<(&'static str, String)> {
    let s = &ins.samples;
    let t = &s.tokens_per_sample;
    let decontaminated: u64 = ins.sources.iter().map(|x| x.decontaminated).sum();
    let dropped: u64 =
        ins.sources.iter().flat_map(|x| x.dropped.values()).sum::<u64>() + s.dropped.values().sum::<u64>();
    let term = &ins.terminus;
    let mut rows = vec![
        ("conversations", ins.conversations.total.to_string()),
        ("samples", s.samples.to_string()),
        ("tokens", s.tokens.to_string()),
        ("supervised tokens", count_share(s.supervised_tokens, s.tokens)),
        ("tokens per sample (p50 / p95 / p99 / max)", format!("{} / {} / {} / {}", t.p50, t.p95, t.p99, t.max)),
        ("padding share of row slots", percent(s.padding_share)),
        ("truncated samples", s.truncated.to_string()),
        ("dropped (ingest + prepare)", dropped.to_string()),
        ("removed as eval overlap", decontaminated.to_string()),
        ("duplicate conversations", ins.duplicates.duplicate_conversations.to_string()),
        ("duplicate targets", count_share(ins.duplicates.duplicate_targets, ins.duplicates.assistant_turns)),
        ("assistant turns with thinking", count_share(ins.thinking.turns_with_thinking, ins.thinking.assistant_turns)),
        ("thinking tokens in targets", ins.thinking.thinking_tokens_in_targets.to_string()),
    ];
    if ins.conversations.untrained_turns > 0 {
        let all = ins.thinking.assistant_turns;
        rows.push((
            "assistant turns not trained on (history only)",
            count_share(ins.conversations.untrained_turns, all),
        ));
    }
    if term.assistant_turns > 0 {
        rows.push(("Terminus-2 turns with valid JSON", count_share(term.valid_json, term.assistant_turns)));
    }
    if ins.tools.conversations > 0 {
        rows.push(("tool calls", ins.tools.tool_calls.to_string()));
    }
    let checks = &ins.tools.checks;
    if checks.calls > 0 {
        rows.push(("tool calls off their offered schema", count_share(checks.off_schema, checks.calls)));
    }
    if let Some(v) = &ins.validation {
        rows.push((
            "held out for validation",
            format!(
                "{} conversations ({} samples, {} tokens; not in the sample and token figures above)",
                v.conversations, v.counts.samples, v.counts.tokens
            ),
        ));
    }
    rows.push(("template", format!("{} (sha256 {})", ins.template.origin, short(&ins.template.sha256))));
    rows.push(("thinking policy / sample mode", format!("{} / {}", ins.template.thinking, ins.template.mode)));
    rows
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}

pub fn summary_markdown(ins: &Inspection) -> String {
    let mut md = format!("# Dataset summary: {}\n\n| figure | value |\n|---|---|\n", ins.run);
    for (name, value) in key_figures(ins) {
        let _ = writeln!(md, "| {name} | {} |", value.replace('|', "\\|"));
    }
    if !ins.warnings.is_empty() {
        md.push_str("\n## Warnings\n\n");
        for w in &ins.warnings {
            let _ = writeln!(md, "- {w}");
        }
    }
    md.push_str("\nThe full report: `report/index.html`.\n");
    md
}

/// A small builder for well-formed HTML.
struct Page {
    html: String,
}

impl Page {
    fn h2(&mut self, id: &str, title: &str) {
        let _ = writeln!(self.html, "<h2 id=\"{id}\">{}</h2>", escape(title));
    }

    fn p(&mut self, text: &str) {
        let _ = writeln!(self.html, "<p>{}</p>", escape(text));
    }

    fn table<R: AsRef<str>>(&mut self, headers: &[&str], rows: &[Vec<R>]) {
        self.html.push_str("<table><thead><tr>");
        for h in headers {
            let _ = write!(self.html, "<th>{}</th>", escape(h));
        }
        self.html.push_str("</tr></thead><tbody>\n");
        for row in rows {
            self.html.push_str("<tr>");
            for cell in row {
                let _ = write!(self.html, "<td>{}</td>", escape(cell.as_ref()));
            }
            self.html.push_str("</tr>\n");
        }
        self.html.push_str("</tbody></table>\n");
    }

    fn pairs(&mut self, rows: &[(&str, String)]) {
        let rows: Vec<Vec<&str>> = rows.iter().map(|(k, v)| vec![*k, v.as_str()]).collect();
        self.table(&["figure", "value"], &rows);
    }

    /// A ranked list with a bar per entry, scaled to the first (largest) count.
    fn ranked(&mut self, headers: &[&str; 2], items: &[(String, u64)]) {
        let top = items.first().map_or(1, |(_, c)| (*c).max(1));
        self.html.push_str("<table class=\"ranked\"><thead><tr>");
        let _ = write!(self.html, "<th>{}</th><th>{}</th><th></th>", escape(headers[0]), escape(headers[1]));
        self.html.push_str("</tr></thead><tbody>\n");
        for (name, count) in items {
            let width = 100.0 * *count as f64 / top as f64;
            let _ = writeln!(
                self.html,
                "<tr><td><code>{}</code></td><td>{count}</td><td><div class=\"bar\" style=\"width:{width:.1}%\"></div></td></tr>",
                escape(name)
            );
        }
        self.html.push_str("</tbody></table>\n");
    }

    fn svg(&mut self, svg: &str) {
        // plotters writes an XML declaration-free <svg> element; inline it as is.
        let _ = writeln!(self.html, "<div class=\"plot\">{svg}</div>");
    }
}

fn dist_row(name: &str, d: &Distribution) -> Vec<String> {
    vec![
        name.to_string(),
        d.count.to_string(),
        format!("{:.1}", d.mean),
        d.min.to_string(),
        d.p50.to_string(),
        d.p95.to_string(),
        d.p99.to_string(),
        d.max.to_string(),
    ]
}

const DIST_HEADERS: [&str; 8] = ["", "count", "mean", "min", "p50", "p95", "p99", "max"];

fn markers(d: &Distribution) -> [(&'static str, u64); 2] {
    [("p50", d.p50), ("p95", d.p95)]
}

const STYLE: &str = "body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;padding:0 1em;color:#1d1d1f}\
h1{font-size:1.6em;margin-bottom:.2em}h2{margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:.2em}\
table{border-collapse:collapse;margin:.6em 0}th,td{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}\
th{background:#f5f5f7}td:nth-child(n+2){font-variant-numeric:tabular-nums}.ranked td:last-child{width:320px}\
.bar{background:#466eaa;height:.8em}.warn{background:#fff4e5;border:1px solid #f0b86e;padding:.6em 1em}\
nav a{margin-right:1em}.plot svg{max-width:100%;height:auto}.muted{color:#666}\
.ex{white-space:pre-wrap;word-break:break-all;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;line-height:1.55;border:1px solid #ddd;padding:.6em;background:#fafafa}\
.ex span{border-right:1px solid rgba(0,0,0,.10)}.ex .u{color:#555}.ex .u.o{background:#eeeeee}\
.ex .s{background:#c6ecc6;color:#000}.ex .s.o{background:#a9dfa9}.ex span:hover{outline:2px solid #c0392b}\
.legend span{padding:0 .4em;margin-right:.6em}";

/// The whole report page.
pub fn render_page(result: &InspectResult) -> Result<String, ReportError> {
    let ins = &result.inspection;
    let v = &result.values;
    let mut page = Page { html: String::new() };
    let _ = write!(
        page.html,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"/><meta name=\"viewport\" content=\"width=device-width\"/><title>kiln dataset report: {run}</title><style>{STYLE}</style></head><body>\n<h1>Dataset report: {run}</h1>\n",
        run = escape(&ins.run)
    );
    page.html.push_str("<nav><a href=\"#key\">key figures</a><a href=\"#sources\">sources</a><a href=\"#shape\">shape</a><a href=\"#thinking\">thinking</a><a href=\"#targets\">targets</a><a href=\"#duplicates\">duplicates</a><a href=\"#template\">template</a><a href=\"#examples\">examples</a></nav>\n");
    if !ins.warnings.is_empty() {
        page.html.push_str("<div class=\"warn\"><strong>Warnings</strong><ul>");
        for w in &ins.warnings {
            let _ = write!(page.html, "<li>{}</li>", escape(w));
        }
        page.html.push_str("</ul></div>\n");
    }
    page.h2("key", "Key figures");
    page.pairs(&key_figures(ins));

    sources_section(&mut page, ins);
    page.h2("shape", "Shape");
    let c = &ins.conversations;
    let per_source: Vec<Vec<String>> = c.per_source.iter().map(|(k, n)| vec![k.clone(), n.to_string()]).collect();
    page.table(&["source", "conversations"], &per_source);
    let s = &ins.samples;
    page.table(
        &DIST_HEADERS,
        &[
            dist_row("messages per conversation", &c.messages),
            dist_row("assistant turns per conversation", &c.assistant_turns),
            dist_row("tokens per sample", &s.tokens_per_sample),
            dist_row("supervised tokens per sample", &s.supervised_per_sample),
        ],
    );
    page.svg(&histogram_svg("tokens per sample", "tokens", &v.tokens_per_sample, &markers(&s.tokens_per_sample))?);
    page.svg(&histogram_svg(
        "supervised tokens per sample",
        "supervised tokens",
        &v.supervised_per_sample,
        &markers(&s.supervised_per_sample),
    )?);
    let sample_rows: Vec<Vec<String>> = s
        .per_source
        .iter()
        .map(|(k, x)| {
            vec![
                k.clone(),
                x.samples.to_string(),
                x.tokens.to_string(),
                x.supervised_tokens.to_string(),
                percent(share(x.supervised_tokens, x.tokens)),
            ]
        })
        .collect();
    page.table(&["source", "samples", "tokens", "supervised", "supervised share"], &sample_rows);
    let dropped = if s.dropped.is_empty() {
        "none".to_string()
    } else {
        s.dropped.iter().map(|(k, n)| format!("{k}: {n}")).collect::<Vec<_>>().join(", ")
    };
    page.pairs(&[
        ("sequence length / layout", format!("{} / {}", ins.template.seq_len, ins.template.layout)),
        ("rows", s.rows.to_string()),
        ("token slots", s.slots.to_string()),
        ("padding tokens", count_share(s.padding_tokens, s.slots)),
        ("packing efficiency (tokens / slots)", percent(share(s.tokens, s.slots))),
        ("truncated samples", format!("{} (rule: {})", s.truncated, ins.template.truncation)),
        ("dropped by prepare", dropped),
    ]);

    page.h2("thinking", "Thinking");
    let th = &ins.thinking;
    page.pairs(&[
        ("assistant turns", th.assistant_turns.to_string()),
        ("turns with thinking", count_share(th.turns_with_thinking, th.assistant_turns)),
        ("thinking blocks stripped from history", th.blocks_stripped_from_history.to_string()),
        ("thinking tokens in targets", count_share(th.thinking_tokens_in_targets, s.supervised_tokens)),
        ("samples whose target has thinking", count_share(th.samples_with_thinking_targets, s.samples)),
    ]);

    targets_section(&mut page, result)?;
    duplicates_section(&mut page, ins);
    template_section(&mut page, ins);
    examples_section(&mut page, result);
    let _ = write!(
        page.html,
        "<p class=\"muted\">Written by kiln inspect in {:.2} s. Figures: report/summary.json.</p>\n</body></html>\n",
        ins.wall_seconds
    );
    Ok(page.html)
}

fn sources_section(page: &mut Page, ins: &Inspection) {
    page.h2("sources", "Sources");
    if ins.sources.is_empty() {
        page.p("No ingest.json in this run: source figures are unavailable.");
        return;
    }
    let rows: Vec<Vec<String>> = ins
        .sources
        .iter()
        .map(|s| {
            let dropped = s.dropped.iter().map(|(k, n)| format!("{k}: {n}")).collect::<Vec<_>>().join(", ");
            vec![
                s.recipe.clone(),
                s.name.clone(),
                s.rows_read.to_string(),
                s.kept.to_string(),
                if dropped.is_empty() { "0".into() } else { dropped },
                s.decontaminated.to_string(),
                format!("{}", s.weight),
                s.emitted.to_string(),
            ]
        })
        .collect();
    page.table(&["recipe", "source", "rows read", "kept", "dropped", "eval overlap", "weight", "emitted"], &rows);
    let untrained: Vec<String> = ins
        .sources
        .iter()
        .filter(|s| s.turns_off_schema_untrained > 0)
        .map(|s| format!("{} {}", s.name, s.turns_off_schema_untrained))
        .collect();
    if !untrained.is_empty() {
        page.p(&format!(
            "Assistant turns kept as history only, not trained on, because a call of theirs left its schema (`off_schema_calls = \"history\"`): {}.",
            untrained.join(", ")
        ));
    }
    let sets = if ins.eval_sets.is_empty() { "none".to_string() } else { ins.eval_sets.join(", ") };
    page.p(&format!("Decontaminated against: {sets}."));
    let mut hits: Vec<(String, u64)> = Vec::new();
    for s in &ins.sources {
        for (task, n) in &s.eval_tasks_hit {
            hits.push((format!("{task} ({})", s.name), *n));
        }
    }
    hits.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    if hits.is_empty() {
        page.p("No training conversation overlapped an eval task.");
    } else {
        page.p("Eval tasks found in the training data and removed:");
        page.ranked(&["eval task (source)", "conversations removed"], &hits);
    }
}

fn targets_section(page: &mut Page, result: &InspectResult) -> Result<(), ReportError> {
    let ins = &result.inspection;
    page.h2("targets", "Targets");
    let t = &ins.terminus;
    if t.conversations > 0 {
        page.p(&format!(
            "Terminus-2 style ({} conversations, {} assistant turns): each reply read as the TB2-lite scorer (v2) reads it, after any thinking block.",
            t.conversations, t.assistant_turns
        ));
        let n = t.assistant_turns;
        page.pairs(&[
            ("valid JSON action", count_share(t.valid_json, n)),
            ("with analysis", count_share(t.with_analysis, n)),
            ("with plan", count_share(t.with_plan, n)),
            ("with commands", count_share(t.with_commands, n)),
            ("with task_complete", count_share(t.with_task_complete, n)),
            ("task_complete true", count_share(t.task_complete_true, n)),
            (
                "empty-command turns",
                format!("{} ({} of them complete the task)", t.empty_command_turns, t.empty_command_turns_completing),
            ),
        ]);
        page.table(&DIST_HEADERS, &[dist_row("command units per turn", &t.command_units_per_turn)]);
        page.svg(&histogram_svg(
            "command units per turn",
            "command units",
            &result.values.command_units_per_turn,
            &markers(&t.command_units_per_turn),
        )?);
        page.ranked(&["first word of command", "units"], &t.top_first_words);
    }
    let tools = &ins.tools;
    if tools.conversations > 0 {
        page.p(&format!(
            "Tool use ({} conversations, {} tool messages, {} calls).",
            tools.conversations, tools.tool_messages, tools.tool_calls
        ));
        page.table(&DIST_HEADERS, &[dist_row("tool calls per conversation", &tools.calls_per_conversation)]);
        page.ranked(&["tool", "calls"], &tools.top_tools);
        call_checks(page, &tools.checks);
    }
    if t.conversations == 0 && tools.conversations == 0 {
        page.p("No Terminus-2 or tool-use conversations: no target checks apply.");
    }
    Ok(())
}

fn call_checks(page: &mut Page, c: &CallChecks) {
    if c.calls == 0 {
        return;
    }
    page.p(&format!(
        "The {} calls of trained turns ({} structured, {} written in the text as ReAct, Hermes / Qwen or LFM calls), each against the function schemas its conversation offers: its tools, or the list its prompt prints ({} calls). A call with several problems counts in each row:",
        c.calls,
        c.calls - c.from_text,
        c.from_text,
        c.against_prompt_list
    ));
    let n = c.calls;
    page.pairs(&[
        ("in conversations offering no tools kiln can read", count_share(c.no_tools_offered, n)),
        ("off their schema", count_share(c.off_schema, n)),
        ("calling a function not offered", count_share(c.unoffered, n)),
        ("with arguments that do not read as an object", count_share(c.unreadable, n)),
        ("passing an argument the schema does not declare", count_share(c.undeclared_arguments, n)),
        ("leaving out a required argument", count_share(c.missing_required, n)),
        ("passing null", count_share(c.null_arguments, n)),
        ("passing null for an undeclared argument", count_share(c.undeclared_nulls, n)),
    ]);
    if !c.examples.is_empty() {
        let rows: Vec<Vec<&str>> = c.examples.iter().map(|e| vec![e.as_str()]).collect();
        page.table(&["the first calls off their schema (conversation: function: what)"], &rows);
    }
}

fn duplicates_section(page: &mut Page, ins: &Inspection) {
    page.h2("duplicates", "Duplicates");
    let d = &ins.duplicates;
    page.pairs(&[
        ("conversations identical to an earlier one", count_share(d.duplicate_conversations, ins.conversations.total)),
        ("assistant turns repeating an earlier target", count_share(d.duplicate_targets, d.assistant_turns)),
    ]);
    if !d.top_repeated_targets.is_empty() {
        page.ranked(&["most repeated targets (first 120 characters)", "occurrences"], &d.top_repeated_targets);
    }
    page.p("Copies made on purpose by mixing weights above 1 count as duplicates here.");
}

fn template_section(page: &mut Page, ins: &Inspection) {
    page.h2("template", "Template");
    let t = &ins.template;
    let kwargs = serde_json::Value::Object(t.kwargs.clone()).to_string();
    page.pairs(&[
        ("template", t.origin.clone()),
        ("revision", t.revision.clone().unwrap_or_else(|| "local file".into())),
        ("template sha256", t.sha256.clone()),
        ("tokenizer", t.tokenizer.clone()),
        ("tokenizer sha256", t.tokenizer_sha256.clone()),
        ("thinking policy", t.thinking.clone()),
        ("sample mode", t.mode.clone()),
        ("template variables", kwargs),
    ]);
}

/// Longer examples show their head and their tail, where the target is; the middle is elided (and said to be).
const SHOWN_HEAD: usize = 600;
const SHOWN_TAIL: usize = 2400;

fn examples_section(page: &mut Page, result: &InspectResult) {
    page.h2("examples", "Examples");
    page.html.push_str("<p class=\"legend\"><span class=\"ex s\">supervised (trained on)</span><span class=\"ex u\">context (not trained on)</span> Hover a token to see its id; ↵ marks a newline.</p>\n");
    for (example, pieces) in result.inspection.examples.iter().zip(&result.pieces) {
        let _ = write!(
            page.html,
            "<h3>{} · <code>{}</code> · {} · {} tokens, {} supervised</h3>\n<div class=\"ex\">",
            escape(&example.kind),
            escape(&example.sample_id),
            escape(&example.source),
            example.tokens,
            example.supervised
        );
        let elide = pieces.len() > SHOWN_HEAD + SHOWN_TAIL;
        for (i, piece) in pieces.iter().enumerate() {
            if elide && i == SHOWN_HEAD {
                let hidden: usize = pieces[SHOWN_HEAD..pieces.len() - SHOWN_TAIL].iter().map(|p| p.ids.len()).sum();
                let _ = write!(page.html, "<em>\n… {hidden} tokens not shown …\n</em>");
            }
            if elide && (SHOWN_HEAD..pieces.len() - SHOWN_TAIL).contains(&i) {
                continue;
            }
            write_piece(&mut page.html, piece, i);
        }
        page.html.push_str("</div>\n");
    }
}

fn write_piece(html: &mut String, piece: &Piece, index: usize) {
    let class = match (piece.supervised, index % 2) {
        (true, 0) => "s",
        (true, _) => "s o",
        (false, 0) => "u",
        (false, _) => "u o",
    };
    let ids = piece.ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
    let label = if piece.ids.len() == 1 { "id" } else { "ids" };
    let state = if piece.supervised { "supervised" } else { "not supervised" };
    let text = escape(&piece.text).replace('\n', "↵\n");
    let _ = write!(html, "<span class=\"{class}\" title=\"{label} {ids} · {state}\">{text}</span>");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_keeps_xml_well_formed() {
        assert_eq!(escape("<a href=\"x\">&'</a>"), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;&lt;/a&gt;");
        assert_eq!(escape("\x1b[0m\tok\n"), "␛[0m\tok\n");
    }
}
