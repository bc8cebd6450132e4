//! TB2-lite replay records (the schema of ../shared/docs/EVAL_TB2LITE.md) cut from held-out synthetic
//! trajectories: one record per assistant step whose reference has commands.

use serde_json::{Value, json};

use super::terminal::Task;

/// Command units of a reference action: each keystroke's lines, stripped, empties dropped; `<WAIT>` for none.
pub fn command_units(commands: &[String]) -> Vec<String> {
    let mut units = Vec::new();
    for keystrokes in commands {
        let normalized = keystrokes.replace("\r\n", "\n").replace('\r', "\n");
        let lines: Vec<&str> = normalized.split('\n').map(str::trim).filter(|l| !l.is_empty()).collect();
        if lines.is_empty() {
            units.push("<WAIT>".to_string());
        } else {
            units.extend(lines.iter().map(|l| l.to_string()));
        }
    }
    units
}

fn flatten(messages: &[Value]) -> String {
    messages
        .iter()
        .map(|m| {
            let role = m["role"].as_str().unwrap_or("").to_uppercase();
            format!("{role}:\n{}", m["content"].as_str().unwrap_or(""))
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// The replay records of one held-out task.
pub fn records(task: &Task, sample_idx: usize, task_id: &str) -> Vec<Value> {
    let conv = task.conversation(task_id, task_id);
    let messages: Vec<Value> =
        conv.messages.iter().map(|m| json!({"role": m.role.as_str(), "content": m.content})).collect();
    let total_steps = task.steps.len();
    let mut out = Vec::new();
    for (step_idx, step) in task.steps.iter().enumerate() {
        if step.commands.is_empty() {
            continue;
        }
        // Assistant turn k sits at message 1 + 2k: the history before it is everything earlier.
        let history = &messages[..1 + 2 * step_idx];
        let action = step.action();
        out.push(json!({
            "task_id": task_id,
            "sample_idx": sample_idx,
            "step_idx": step_idx,
            "total_steps": total_steps,
            "is_final_step": step_idx + 1 == total_steps,
            "source": format!("synthetic/kiln/{}", task.group),
            "source_group": task.group,
            "messages": history,
            "prompt": flatten(history),
            "ref_raw": step.assistant_text(),
            "ref_commands": action["commands"],
            "ref_command_units": command_units(&step.commands),
            "ref_analysis": step.analysis,
            "ref_plan": step.plan,
            "ref_task_complete": step.complete,
            "ref_parse_ok": true,
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_follow_the_reference_rules() {
        let cmds = vec!["ls -la\n".to_string(), "  cd a \r\n\r\necho x\n".to_string(), "\n".to_string()];
        assert_eq!(command_units(&cmds), ["ls -la", "cd a", "echo x", "<WAIT>"]);
    }
}
