//! `kiln eval`: each replay step's history rendered with the checkpoint's own template through the same
//! code path as training (thinking options applied), a prompt-length preflight, batched greedy decoding with
//! the cached decoder, and scoring into the result JSON.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use burn::module::Module;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::journal::Journal;
use super::parse::{ScorerVersion, parse_response};
use super::result::{EvalResult, ReplayStep, StepRow, aggregate, score_step};
use crate::chat::{ChatTemplate, PinnedClock, SpecialTokens, strip_thinking};
use crate::models::{CausalLm, ModelBackend, load_model};
use crate::tokens::TextTokenizer;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalOptions {
    pub max_tokens: usize,
    pub batch_size: usize,
    /// A batch holds at most this many prompt tokens (its rows times its longest prompt; one row at least):
    /// a prefill's activations grow with them, and the replay's longest prompts run a few at a time.
    #[serde(default = "default_batch_tokens")]
    pub batch_tokens: usize,
    /// Passed to the template as `enable_thinking` when set.
    pub enable_thinking: Option<bool>,
    /// Strip `<think>` blocks (and Gemma thought channels) from assistant history messages.
    pub strip_thinking_history: bool,
    pub scorer: ScorerVersion,
    pub limit: Option<usize>,
    pub tasks: Vec<String>,
}

impl Default for EvalOptions {
    fn default() -> Self {
        EvalOptions {
            max_tokens: 1024,
            batch_size: 8,
            batch_tokens: default_batch_tokens(),
            enable_thinking: None,
            strip_thinking_history: false,
            scorer: ScorerVersion::V2,
            limit: None,
            tasks: Vec::new(),
        }
    }
}

/// 128 Ki prompt tokens a batch: 16 rows of TB2-lite's median prompt (6.6k tokens with Qwen3.5's tokenizer),
/// five of its longest (23.5k).
pub fn default_batch_tokens() -> usize {
    131_072
}

/// The batches of `order` (steps by prompt length, longest first): consecutive runs of at most `batch_size`
/// steps whose rows times their first (longest) prompt stay within `batch_tokens`, one step at least.
fn token_batches<'a>(
    order: &'a [usize],
    lengths: &[usize],
    batch_size: usize,
    batch_tokens: usize,
) -> Vec<&'a [usize]> {
    let mut batches = Vec::new();
    let mut rest = order;
    while let Some(&first) = rest.first() {
        let rows = (batch_tokens / lengths[first].max(1)).clamp(1, batch_size.max(1)).min(rest.len());
        let (batch, after) = rest.split_at(rows);
        batches.push(batch);
        rest = after;
    }
    batches
}

/// The ChatML fallback of the reference evaluator for a template that cannot render (tool → user).
fn chatml(messages: &[Value]) -> String {
    let mut out = String::new();
    for m in messages {
        let role = match m["role"].as_str().unwrap_or("user") {
            "tool" => "user",
            r => r,
        };
        out.push_str(&format!("<|im_start|>{role}\n{}<|im_end|>\n", m["content"].as_str().unwrap_or("")));
    }
    out.push_str("<|im_start|>assistant\n");
    out
}

fn percentile(sorted: &[usize], q: f64) -> usize {
    if sorted.is_empty() {
        return 0;
    }
    let idx = ((q / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

impl EvalOptions {
    /// Settings that could only produce an empty or meaningless evaluation are refused up front.
    pub fn check(&self) -> Result<(), String> {
        if self.max_tokens == 0 {
            return Err("max_tokens is 0: a step needs at least 1 generated token".into());
        }
        if self.batch_size == 0 {
            return Err("batch_size is 0: it must be at least 1".into());
        }
        if self.batch_tokens == 0 {
            return Err("batch_tokens is 0: it must be at least 1".into());
        }
        if self.limit == Some(0) {
            return Err("limit is 0: it selects no step".into());
        }
        Ok(())
    }
}

/// Selects the steps of `--tasks` and `--limit`; a named task the replay set lacks, or a selection of no
/// step, is an error.
pub fn select_steps(steps: Vec<ReplayStep>, opts: &EvalOptions) -> Result<Vec<ReplayStep>, String> {
    opts.check()?;
    if steps.is_empty() {
        return Err("the replay set holds no step".into());
    }
    let known: std::collections::BTreeSet<&str> = steps.iter().map(|s| s.task_id.as_str()).collect();
    let unknown: Vec<&str> = opts.tasks.iter().map(String::as_str).filter(|t| !known.contains(t)).collect();
    if !unknown.is_empty() {
        let shown: Vec<&str> = known.iter().copied().take(5).collect();
        let more = if known.len() > shown.len() { ", …" } else { "" };
        return Err(format!(
            "no task {} in the replay set (it holds {} tasks: {}{more})",
            unknown.join(", "),
            known.len(),
            shown.join(", ")
        ));
    }
    let mut steps: Vec<ReplayStep> =
        steps.into_iter().filter(|s| opts.tasks.is_empty() || opts.tasks.contains(&s.task_id)).collect();
    if let Some(n) = opts.limit {
        steps.truncate(n);
    }
    Ok(steps)
}

/// `evaluate` on the named device (`cpu`, or `cuda` in a CUDA build), decoding batches on `devices` GPUs at
/// once (cuda 0..N: each holds a copy of the model and takes the next batch as it finishes one). On the CPU
/// the batches run on every core, whatever `devices` says.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_on_device(
    device: &str,
    devices: usize,
    name: &str,
    checkpoint: &Path,
    eval_path: &Path,
    steps: &[ReplayStep],
    opts: &EvalOptions,
    show_progress: bool,
    mut journal: Option<&mut Journal>,
) -> Result<EvalResult, String> {
    if devices == 0 {
        return Err("eval on 0 devices: it needs at least 1".into());
    }
    macro_rules! on {
        ($backend:ty, $workers:expr) => {
            evaluate::<$backend>(
                name,
                checkpoint,
                eval_path,
                steps,
                opts,
                show_progress,
                &$workers,
                journal.as_deref_mut(),
            )
        };
        ($backend:ty) => {
            decoding_devices::<$backend>(device, devices).and_then(|workers| on!($backend, workers))
        };
    }
    match device {
        // One batch's decoding keeps about one core busy on the CPU, so batches run side by side there.
        "cpu" => on!(
            crate::backend::Cpu,
            vec![Default::default(); std::thread::available_parallelism().map_or(1, |n| n.get())]
        ),
        #[cfg(feature = "cuda")]
        "cuda" if crate::backend::cuda_choice(true)? => on!(crate::backend::Gpu),
        #[cfg(feature = "cuda")]
        "cuda" => on!(crate::backend::GpuUnfused),
        #[cfg(feature = "vulkan")]
        "vulkan" => crate::backend::vulkan_ready(false).and_then(|()| on!(crate::backend::Vk)),
        other => Err(crate::train::device_error(other)),
    }
}

/// The devices `count` decoding workers run on: `crate::backend::consecutive_devices` from the default device.
#[cfg(any(feature = "cuda", feature = "vulkan"))]
fn decoding_devices<B: burn::tensor::backend::Backend>(name: &str, count: usize) -> Result<Vec<B::Device>, String> {
    crate::backend::consecutive_devices::<B>(&Default::default(), count)
        .map_err(|available| format!("eval on {count} {name} devices, but the backend sees {available}"))
}

/// Evaluates a checkpoint on `steps`, one decoding thread per entry of `workers` (a device each, repeated to
/// run several threads on one), the model loaded on the first; returns the result document (the same
/// whatever the workers). With a `journal`, the batches it holds are taken from it and every batch decoded is
/// recorded there as it finishes.
#[allow(clippy::too_many_arguments)]
pub fn evaluate<B: ModelBackend>(
    name: &str,
    checkpoint: &Path,
    eval_path: &Path,
    steps: &[ReplayStep],
    opts: &EvalOptions,
    show_progress: bool,
    workers: &[B::Device],
    mut journal: Option<&mut Journal>,
) -> Result<EvalResult, String> {
    let load_started = Instant::now();
    let device = workers.first().ok_or("eval with no decoding device")?;
    let (config, model) = load_model::<B>(checkpoint, device).map_err(|e| e.to_string())?;
    let special = SpecialTokens::load(checkpoint).map_err(|e| e.to_string())?;
    let template = ChatTemplate::load(checkpoint, None, PinnedClock::now()).map_err(|e| e.to_string())?;
    let tokenizer = TextTokenizer::load(checkpoint, &special, None).map_err(|e| e.to_string())?;
    let load_time = load_started.elapsed().as_secs_f64();

    let mut kwargs = Map::new();
    if let Some(t) = opts.enable_thinking {
        kwargs.insert("enable_thinking".into(), Value::Bool(t));
    }
    // Prompts: the step's history, thinking options applied, rendered with the generation prompt.
    let mut status: BTreeMap<String, usize> = BTreeMap::new();
    let mut raw_errors = Vec::new();
    let mut stripped_blocks = 0usize;
    let mut prompts = Vec::with_capacity(steps.len());
    for s in steps {
        let mut messages = s.messages.clone();
        if opts.strip_thinking_history {
            for m in messages.iter_mut().filter(|m| m["role"] == "assistant") {
                if let Some(Value::String(c)) = m.get_mut("content") {
                    let (text, n) = strip_thinking(c);
                    stripped_blocks += n;
                    *c = text;
                }
            }
        }
        let text = match template.render(&messages, None, true, &kwargs) {
            Ok(r) => {
                *status.entry("chat_template".into()).or_default() += 1;
                r.text
            }
            Err(e) => {
                *status.entry("raw_fallback".into()).or_default() += 1;
                raw_errors.push(format!("{}/{}: {e}", s.task_id, s.step_idx));
                chatml(&messages)
            }
        };
        let ids = tokenizer.encode(&text).map_err(|e| e.to_string())?.0;
        if ids.len() + opts.max_tokens > config.max_position_embeddings() {
            return Err(format!(
                "step {}/{}: the prompt has {} tokens; with max_tokens {} it exceeds the context length {}",
                s.task_id,
                s.step_idx,
                ids.len(),
                opts.max_tokens,
                config.max_position_embeddings()
            ));
        }
        prompts.push(ids);
    }
    let prompt_lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let mut lengths = prompt_lengths.clone();
    lengths.sort_unstable();

    // Batched greedy decoding, longest prompts first so each batch pads little.
    let mut order: Vec<usize> = (0..steps.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(prompt_lengths[i]));
    let mut stop = vec![tokenizer.end_of_turn_id];
    stop.extend(config.eos_token_id());
    let bar = if show_progress { ProgressBar::new(steps.len() as u64) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps {msg} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let gen_started = Instant::now();
    let mut rows: Vec<Option<StepRow>> = vec![None; steps.len()];
    let mut f1_sum = 0.0;
    let mut done = 0usize;
    let mut take = |batch: &[usize], generated: &[Vec<u32>]| {
        for (&i, ids) in batch.iter().zip(generated) {
            let finish = if ids.last().is_some_and(|t| stop.contains(t)) { "stop" } else { "length" };
            let text = tokenizer.decode_skip_special(ids);
            let parsed = parse_response(&text, opts.scorer);
            let row = score_step(&steps[i], &parsed, &text, finish, opts.scorer);
            f1_sum += row.command_f1;
            done += 1;
            rows[i] = Some(row);
        }
        bar.set_position(done as u64);
        bar.set_message(format!("Score so far {:.2}", 100.0 * f1_sum / done.max(1) as f64));
    };
    let batches = token_batches(&order, &prompt_lengths, opts.batch_size, opts.batch_tokens);
    let mut to_decode = Vec::with_capacity(batches.len());
    for batch in batches {
        match journal.as_ref().and_then(|j| j.finished(batch)) {
            Some(generated) => take(batch, generated),
            None => to_decode.push(batch),
        }
    }
    let seconds_before = journal.as_ref().map_or(0.0, |j| j.seconds_before());
    let mut unrecorded = None;
    decode_batches(&model, &to_decode, &prompts, opts.max_tokens, &stop, workers, |batch, generated| {
        if let Some(j) = journal.as_mut().filter(|_| unrecorded.is_none()) {
            let seconds = seconds_before + gen_started.elapsed().as_secs_f64();
            unrecorded = j.record(batch, &generated, seconds).err().map(|e| format!("{}: {e}", j.path().display()));
        }
        take(batch, &generated);
    });
    bar.finish_and_clear();
    if let Some(e) = unrecorded {
        eprintln!("warning: the eval's finished batches could not be recorded ({e}): stopped, it would start over");
    }
    let gen_time = seconds_before + gen_started.elapsed().as_secs_f64();
    let rows: Vec<StepRow> = rows.into_iter().flatten().collect();
    let template_status =
        match (status.get("chat_template").copied().unwrap_or(0), status.get("raw_fallback").copied().unwrap_or(0)) {
            (_, 0) => "chat_template",
            (0, _) => "mixed_or_raw",
            _ => "model_specific_or_mixed",
        };
    Ok(EvalResult {
        model: name.to_string(),
        model_path: checkpoint.display().to_string(),
        model_short: name.to_string(),
        eval_path: eval_path.display().to_string(),
        timestamp: chrono::Local::now().format("%Y-%m-%dT%H:%M:%S%.6f").to_string(),
        load_time_sec: crate::eval::score::py_round(load_time, 1),
        gen_time_sec: crate::eval::score::py_round(gen_time, 1),
        avg_sec_per_step: crate::eval::score::py_round(gen_time / steps.len().max(1) as f64, 3),
        scorer: opts.scorer,
        sampling: sampling(opts, config.max_position_embeddings()),
        prompt_template: json!({
            "template_status": template_status,
            "template_status_counts": status,
            "rank_eligible": template_status == "chat_template",
            "raw_fallback_errors": raw_errors,
            "template_origin": template.source.origin,
            "template_sha256": template.source.sha256,
            "stripped_thinking_blocks": stripped_blocks,
            "row_count": steps.len(),
            "prompt_tokens_min": lengths.first().copied().unwrap_or(0),
            "prompt_tokens_max": lengths.last().copied().unwrap_or(0),
            "prompt_tokens_p50": percentile(&lengths, 50.0),
            "prompt_tokens_p95": percentile(&lengths, 95.0),
            "prompt_tokens_p99": percentile(&lengths, 99.0),
            "max_model_len": config.max_position_embeddings(),
            "max_tokens": opts.max_tokens,
        }),
        aggregate: aggregate(&rows),
        per_step: rows,
    })
}

/// A result's `sampling` record: how its text was generated with `opts` (greedy) from a model of context
/// `max_model_len`.
pub fn sampling(opts: &EvalOptions, max_model_len: usize) -> Value {
    json!({
        "temperature": 0.0, "top_p": 1.0, "max_tokens": opts.max_tokens, "repetition_penalty": 1.0,
        "thinking_mode": match opts.enable_thinking { None => "auto", Some(true) => "on", Some(false) => "off" },
        "strip_thinking_history": opts.strip_thinking_history, "dtype": "float32", "backend": "kiln",
        "batch_size": opts.batch_size, "max_model_len": max_model_len, "skip_special_tokens": true,
    })
}

/// Greedy decoding of each of `batches` (indices into `prompts`), each batch's output handed to `done` on the
/// calling thread as it finishes. With several `workers` the batches run side by side, a thread per worker
/// on its device: the model's tensors shared by the threads of `model`'s device (burn's tensors are shared,
/// not copied), copied once to each other device (through the host). A batch decodes the same whichever
/// worker runs it, so only the order of the `done` calls changes.
fn decode_batches<B: ModelBackend>(
    model: &CausalLm<B>,
    batches: &[&[usize]],
    prompts: &[Vec<u32>],
    max_tokens: usize,
    stop: &[u32],
    workers: &[B::Device],
    mut done: impl FnMut(&[usize], Vec<Vec<u32>>),
) {
    let decode = |model: &CausalLm<B>, batch: &[usize], device: &B::Device| {
        let batch_prompts: Vec<Vec<u32>> = batch.iter().map(|&i| prompts[i].clone()).collect();
        model.generate_greedy(&batch_prompts, max_tokens, stop, device)
    };
    // The model as `device` holds it: shared where it lives, copied once to any other device.
    let on = |device: &B::Device| match model.devices().first() {
        Some(home) if home != device => model.copied_to(device),
        _ => model.clone(),
    };
    let workers = &workers[..workers.len().min(batches.len())];
    if let [device] = workers {
        let model = on(device);
        for batch in batches {
            done(batch, decode(&model, batch, device));
        }
        return;
    }
    let next = AtomicUsize::new(0);
    let (sender, finished) = mpsc::channel();
    std::thread::scope(|scope| {
        for device in workers {
            let (sender, next, decode, on) = (sender.clone(), &next, &decode, &on);
            scope.spawn(move || {
                let model = on(device);
                while let Some(batch) = batches.get(next.fetch_add(1, Ordering::Relaxed)) {
                    if sender.send((*batch, decode(&model, batch, device))).is_err() {
                        break;
                    }
                }
            });
        }
        drop(sender);
        for (batch, generated) in finished {
            done(batch, generated);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::models::config::ModelConfig;
    use crate::models::random_model;

    #[test]
    fn step_selection_refuses_unknown_tasks_and_empty_selections() {
        let step = |task: &str, idx| ReplayStep {
            task_id: task.into(),
            sample_idx: 0,
            step_idx: idx,
            source_group: String::new(),
            messages: Vec::new(),
            ref_raw: String::new(),
        };
        let steps = vec![step("a", 0), step("a", 1), step("b", 0)];
        let opts = |tasks: &[&str], limit| EvalOptions {
            tasks: tasks.iter().map(|t| t.to_string()).collect(),
            limit,
            ..Default::default()
        };
        let ids = |chosen: Vec<ReplayStep>| chosen.iter().map(|s| (s.task_id.clone(), s.step_idx)).collect::<Vec<_>>();
        assert_eq!(ids(select_steps(steps.clone(), &opts(&["b"], None)).unwrap()), [("b".to_string(), 0)]);
        assert_eq!(select_steps(steps.clone(), &opts(&[], Some(2))).unwrap().len(), 2);

        let err = select_steps(steps.clone(), &opts(&["b", "c"], None)).unwrap_err();
        assert_eq!(err, "no task c in the replay set (it holds 2 tasks: a, b)");
        let err = select_steps(steps.clone(), &opts(&[], Some(0))).unwrap_err();
        assert!(err.starts_with("limit is 0"), "{err}");
        assert_eq!(select_steps(Vec::new(), &opts(&[], None)).unwrap_err(), "the replay set holds no step");
        for (bad, what) in [
            (EvalOptions { max_tokens: 0, ..Default::default() }, "max_tokens is 0"),
            (EvalOptions { batch_size: 0, ..Default::default() }, "batch_size is 0"),
            (EvalOptions { batch_tokens: 0, ..Default::default() }, "batch_tokens is 0"),
        ] {
            assert!(select_steps(steps.clone(), &bad).unwrap_err().starts_with(what), "{what}");
        }
    }

    #[test]
    fn batches_hold_at_most_batch_size_rows_and_batch_tokens_prompt_tokens() {
        let lengths = [40_000, 9_000, 9_000, 8_000, 300, 300, 200, 100];
        let order: Vec<usize> = (0..lengths.len()).collect();
        let sizes = |size, tokens| -> Vec<Vec<usize>> {
            token_batches(&order, &lengths, size, tokens).into_iter().map(<[usize]>::to_vec).collect()
        };
        // A prompt longer than the budget runs alone; the others fill each batch up to the budget or the size.
        assert_eq!(sizes(16, 20_000), [vec![0], vec![1, 2], vec![3, 4], vec![5, 6, 7]]);
        assert_eq!(sizes(3, 1 << 20), [vec![0, 1, 2], vec![3, 4, 5], vec![6, 7]]);
        assert_eq!(sizes(16, 1), (0..8).map(|i| vec![i]).collect::<Vec<_>>());
    }

    /// Each of seven prompts of different lengths and last tokens, decoded in batches of two (four batches,
    /// the last one short) by `workers`.
    fn decode_all<B: ModelBackend>(model: &CausalLm<B>, workers: &[B::Device]) -> Vec<Vec<u32>> {
        let prompts: Vec<Vec<u32>> =
            (0..7u32).map(|p| (0..5 + p).map(|t| (p * 37 + t * 11) % 500 + 10).collect()).collect();
        let order: Vec<usize> = (0..prompts.len()).collect();
        let batches: Vec<&[usize]> = order.chunks(2).collect();
        let mut outputs = vec![Vec::new(); prompts.len()];
        decode_batches(model, &batches, &prompts, 5, &[], workers, |batch, generated| {
            for (&i, ids) in batch.iter().zip(generated) {
                outputs[i] = ids;
            }
        });
        outputs
    }

    fn tiny_config(name: &str) -> ModelConfig {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models").join(name);
        ModelConfig::from_file(&dir.join("config.json")).unwrap()
    }

    /// Batches decoded side by side give each prompt the tokens that one thread gives it.
    #[test]
    fn decoding_batches_on_several_threads_gives_each_prompt_its_own_output() {
        let device = Default::default();
        let model = random_model::<Cpu>(&tiny_config("tiny"), 3, 0.5, &device).unwrap();
        let one = decode_all(&model, std::slice::from_ref(&device));
        assert!(one.iter().all(|ids| ids.len() == 5), "{one:?}");
        assert!(one.iter().any(|ids| *ids != one[0]), "the prompts' outputs must differ to show whose is whose");
        assert_eq!(one, decode_all(&model, &[device; 3]));
    }

    /// A worker on another device than the model's decodes on a copy of it, to the same tokens: lavapipe as
    /// burn's default device and as its CPU device are two devices (two clients of one driver), so the copy
    /// crosses between them as between GPUs. Alone on the other device, and a worker on each; LFM2, Qwen3.5
    /// and Gemma 4 (a tensor left behind would fail the decoding).
    #[cfg(feature = "vulkan")]
    #[test]
    fn workers_on_other_devices_decode_a_copy_of_the_model_to_the_same_tokens() {
        use burn::backend::wgpu::WgpuDevice;
        crate::backend::vulkan_ready(false).unwrap();
        let home = WgpuDevice::DefaultDevice;
        for name in ["tiny", "tiny-qwen3.5", "tiny-gemma4"] {
            let model = random_model::<crate::backend::Vk>(&tiny_config(name), 3, 0.5, &home).unwrap();
            let on_home = decode_all(&model, std::slice::from_ref(&home));
            assert!(on_home.iter().any(|ids| *ids != on_home[0]), "{name}: the prompts' outputs must differ");
            assert_eq!(decode_all(&model, &[WgpuDevice::Cpu]), on_home, "{name}");
            assert_eq!(decode_all(&model, &[home.clone(), WgpuDevice::Cpu]), on_home, "{name}");
        }
    }
}
