//! Decontamination: training conversations that reproduce an evaluation task are dropped, matched by
//! task name or by the first user message after whitespace normalization.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::DataError;
use super::conversation::{Conversation, Role};
use super::readers::read_all;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MatchKind {
    TaskName,
    FirstUserMessage,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Hit {
    /// The evaluation task that was matched (its `task_id`, else its task name).
    pub eval_task: String,
    pub by: MatchKind,
}

/// The evaluation set's task names and first user messages.
#[derive(Debug, Default, Clone)]
pub struct EvalIndex {
    task_names: HashMap<String, String>,
    first_user: HashMap<String, String>,
    /// Files the index was built from, for the stats.
    pub sources: Vec<String>,
}

/// Collapses every run of whitespace to one space and trims, so re-wrapped copies still match.
pub fn normalize_whitespace(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl EvalIndex {
    /// Reads eval records from JSONL / JSON files: TB2-lite replay steps (`task_id`, `messages`) or
    /// trajectories (`task`, `conversations`); both key spellings are accepted in either.
    pub fn load(paths: &[impl AsRef<Path>]) -> Result<EvalIndex, DataError> {
        let mut index = EvalIndex::default();
        for path in paths {
            let path = path.as_ref();
            let rows = read_all(path)?;
            if rows.is_empty() {
                return Err(DataError::Text {
                    path: path.to_path_buf(),
                    location: "eval set".into(),
                    message: "holds no records; decontamination against it would check nothing".into(),
                });
            }
            for row in &rows {
                index.add_record(row);
            }
            index.sources.push(path.display().to_string());
        }
        Ok(index)
    }

    pub fn add_record(&mut self, record: &Value) {
        let task_name = record.get("task").and_then(Value::as_str);
        let label =
            record.get("task_id").and_then(Value::as_str).or(task_name).unwrap_or("unnamed eval task").to_string();
        if let Some(name) = task_name.filter(|n| !n.is_empty()) {
            self.task_names.entry(name.to_string()).or_insert_with(|| label.clone());
        }
        if let Some(text) = first_user_in_record(record) {
            let key = normalize_whitespace(text);
            if !key.is_empty() {
                self.first_user.entry(key).or_insert(label);
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.task_names.is_empty() && self.first_user.is_empty()
    }

    pub fn len(&self) -> usize {
        self.task_names.len().max(self.first_user.len())
    }

    pub fn check(&self, conv: &Conversation) -> Option<Hit> {
        if let Some(eval_task) = conv.task().and_then(|t| self.task_names.get(t)) {
            return Some(Hit { eval_task: eval_task.clone(), by: MatchKind::TaskName });
        }
        let first = normalize_whitespace(conv.first_user_message()?);
        self.first_user
            .get(&first)
            .map(|eval_task| Hit { eval_task: eval_task.clone(), by: MatchKind::FirstUserMessage })
    }
}

fn first_user_in_record(record: &Value) -> Option<&str> {
    let messages = record.get("messages").or_else(|| record.get("conversations"))?.as_array()?;
    messages.iter().find_map(|m| {
        let role = m.get("role").or_else(|| m.get("from"))?.as_str()?;
        if Role::from_alias(role) != Some(Role::User) {
            return None;
        }
        m.get("content").or_else(|| m.get("value"))?.as_str()
    })
}

/// Decontamination counts for the stats: how many were dropped, by which rule, and which eval tasks leaked.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecontamStats {
    pub dropped: u64,
    pub by_task_name: u64,
    pub by_first_user_message: u64,
    /// Eval task → training conversations dropped for it.
    pub eval_tasks_hit: BTreeMap<String, u64>,
}

impl DecontamStats {
    pub fn record(&mut self, hit: &Hit) {
        self.dropped += 1;
        match hit.by {
            MatchKind::TaskName => self.by_task_name += 1,
            MatchKind::FirstUserMessage => self.by_first_user_message += 1,
        }
        *self.eval_tasks_hit.entry(hit.eval_task.clone()).or_default() += 1;
    }

    pub fn merge(&mut self, other: &DecontamStats) {
        self.dropped += other.dropped;
        self.by_task_name += other.by_task_name;
        self.by_first_user_message += other.by_first_user_message;
        for (k, v) in &other.eval_tasks_hit {
            *self.eval_tasks_hit.entry(k.clone()).or_default() += v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::conversation::Message;
    use serde_json::json;

    fn conv(task: Option<&str>, first_user: &str) -> Conversation {
        let mut meta = serde_json::Map::new();
        if let Some(t) = task {
            meta.insert("task".into(), json!(t));
        }
        Conversation {
            id: "c".into(),
            source: "s".into(),
            messages: vec![Message::new(Role::User, first_user), Message::new(Role::Assistant, "ok")],
            tools: Vec::new(),
            meta,
        }
    }

    #[test]
    fn matches_by_task_name_and_normalized_first_message() {
        let mut index = EvalIndex::default();
        index.add_record(
            &json!({"task": "security_task_0233", "conversations": [{"role": "user", "content": "Fix  the\nserver"}]}),
        );
        index.add_record(
            &json!({"task_id": "task-007", "messages": [{"role": "user", "content": "Count lines\tin a.txt"}]}),
        );

        let by_name = index.check(&conv(Some("security_task_0233"), "something else")).unwrap();
        assert_eq!(by_name, Hit { eval_task: "security_task_0233".into(), by: MatchKind::TaskName });

        let by_text = index.check(&conv(None, "  Count lines in\na.txt ")).unwrap();
        assert_eq!(by_text, Hit { eval_task: "task-007".into(), by: MatchKind::FirstUserMessage });

        assert_eq!(index.check(&conv(Some("security_task_0234"), "Count lines in b.txt")), None);
    }
}
