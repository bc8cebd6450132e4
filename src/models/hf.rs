//! The bridge to Hugging Face checkpoint names: which model parameter is which checkpoint tensor, in which
//! layout (Linear weights transposed, conv kernels reshaped, fused experts split per expert), and export of
//! a model as an HF directory transformers and vLLM load as-is (with the tensors of towers kiln does not
//! train, such as Qwen3.5's vision tower, copied from the source byte for byte).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use safetensors::Dtype;

use super::ModelError;
use super::gemma4::Gemma4Model;
use super::lfm2::{FeedForward, Lfm2Model, Mixer};
use super::qwen3_5::{Qwen35Mixer, Qwen35Model};
use super::weights::HostTensor;

/// A model whose parameters have checkpoint names.
pub trait HfNamed {
    /// Every checkpoint tensor of the model and the parameter it comes from.
    fn hf_entries(&self) -> Vec<HfEntry>;
}

/// How a parameter (burn layout) relates to its checkpoint tensor(s).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HfView {
    Same,
    /// burn Linear `[in, out]` ↔ PyTorch `[out, in]`.
    Transpose,
    /// `[hidden, L]` ↔ `[hidden, 1, L]`.
    ConvKernel,
    /// Expert `e`'s gate (w1) / up (w3) half of fused `gate_up [E, H, 2F]`, or its down (w2) of `down [E, F, H]`.
    ExpertW1(usize),
    ExpertW3(usize),
    ExpertW2(usize),
}

#[derive(Debug, Clone)]
pub struct HfEntry {
    pub key: String,
    pub id: ParamId,
    pub view: HfView,
}

fn entry<B: Backend, const D: usize>(key: String, p: &Param<Tensor<B, D>>, view: HfView) -> HfEntry {
    HfEntry { key, id: p.id, view }
}

impl<B: Backend> HfNamed for Lfm2Model<B> {
    /// Every checkpoint tensor of this model, in the per-expert layout the released checkpoints use.
    fn hf_entries(&self) -> Vec<HfEntry> {
        let mut out = vec![entry("model.embed_tokens.weight".into(), &self.embed_tokens, HfView::Same)];
        for (i, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            out.push(entry(format!("{p}.operator_norm.weight"), &layer.operator_norm.weight, HfView::Same));
            out.push(entry(format!("{p}.ffn_norm.weight"), &layer.ffn_norm.weight, HfView::Same));
            match &layer.mixer {
                Mixer::Conv(c) => {
                    out.push(entry(format!("{p}.conv.in_proj.weight"), &c.in_proj.weight, HfView::Transpose));
                    out.push(entry(format!("{p}.conv.conv.weight"), &c.conv, HfView::ConvKernel));
                    if let Some(b) = &c.conv_bias {
                        out.push(entry(format!("{p}.conv.conv.bias"), b, HfView::Same));
                    }
                    out.push(entry(format!("{p}.conv.out_proj.weight"), &c.out_proj.weight, HfView::Transpose));
                }
                Mixer::Attention(a) => {
                    for (name, lin) in
                        [("q_proj", &a.q_proj), ("k_proj", &a.k_proj), ("v_proj", &a.v_proj), ("out_proj", &a.out_proj)]
                    {
                        out.push(entry(format!("{p}.self_attn.{name}.weight"), &lin.weight, HfView::Transpose));
                    }
                    out.push(entry(format!("{p}.self_attn.q_layernorm.weight"), &a.q_layernorm.weight, HfView::Same));
                    out.push(entry(format!("{p}.self_attn.k_layernorm.weight"), &a.k_layernorm.weight, HfView::Same));
                }
            }
            match &layer.feed_forward {
                FeedForward::Dense(m) => {
                    for (name, lin) in [("w1", &m.w1), ("w3", &m.w3), ("w2", &m.w2)] {
                        out.push(entry(format!("{p}.feed_forward.{name}.weight"), &lin.weight, HfView::Transpose));
                    }
                }
                FeedForward::Moe(m) => {
                    out.push(entry(format!("{p}.feed_forward.gate.weight"), &m.gate.weight, HfView::Transpose));
                    if let Some(b) = &m.expert_bias {
                        out.push(entry(format!("{p}.feed_forward.expert_bias"), b, HfView::Same));
                    }
                    for e in 0..m.gate_up.dims()[0] {
                        let k = format!("{p}.feed_forward.experts.{e}");
                        out.push(entry(format!("{k}.w1.weight"), &m.gate_up, HfView::ExpertW1(e)));
                        out.push(entry(format!("{k}.w3.weight"), &m.gate_up, HfView::ExpertW3(e)));
                        out.push(entry(format!("{k}.w2.weight"), &m.down, HfView::ExpertW2(e)));
                    }
                }
            }
        }
        out.push(entry("model.embedding_norm.weight".into(), &self.embedding_norm.weight, HfView::Same));
        if let Some(head) = &self.lm_head {
            out.push(entry("lm_head.weight".into(), head, HfView::Same));
        }
        out
    }
}

impl<B: Backend> HfNamed for Qwen35Model<B> {
    fn hf_entries(&self) -> Vec<HfEntry> {
        let pre = &self.text_prefix;
        let mut out = vec![entry(format!("{pre}embed_tokens.weight"), &self.embed_tokens, HfView::Same)];
        for (i, layer) in self.layers.iter().enumerate() {
            let p = format!("{pre}layers.{i}");
            out.push(entry(format!("{p}.input_layernorm.weight"), &layer.input_layernorm.weight, HfView::Same));
            let post = &layer.post_attention_layernorm.weight;
            out.push(entry(format!("{p}.post_attention_layernorm.weight"), post, HfView::Same));
            match &layer.mixer {
                Qwen35Mixer::Linear(d) => {
                    let a = format!("{p}.linear_attn");
                    for (name, lin) in [
                        ("in_proj_qkv", &d.in_proj_qkv),
                        ("in_proj_z", &d.in_proj_z),
                        ("in_proj_b", &d.in_proj_b),
                        ("in_proj_a", &d.in_proj_a),
                        ("out_proj", &d.out_proj),
                    ] {
                        out.push(entry(format!("{a}.{name}.weight"), &lin.weight, HfView::Transpose));
                    }
                    out.push(entry(format!("{a}.conv1d.weight"), &d.conv1d, HfView::ConvKernel));
                    out.push(entry(format!("{a}.dt_bias"), &d.dt_bias, HfView::Same));
                    out.push(entry(format!("{a}.A_log"), &d.a_log, HfView::Same));
                    out.push(entry(format!("{a}.norm.weight"), &d.norm.weight, HfView::Same));
                }
                Qwen35Mixer::Full(attn) => {
                    let a = format!("{p}.self_attn");
                    for (name, lin) in [
                        ("q_proj", &attn.q_proj),
                        ("k_proj", &attn.k_proj),
                        ("v_proj", &attn.v_proj),
                        ("o_proj", &attn.o_proj),
                    ] {
                        out.push(entry(format!("{a}.{name}.weight"), &lin.weight, HfView::Transpose));
                    }
                    out.push(entry(format!("{a}.q_norm.weight"), &attn.q_norm.weight, HfView::Same));
                    out.push(entry(format!("{a}.k_norm.weight"), &attn.k_norm.weight, HfView::Same));
                }
            }
            for (name, lin) in [("gate_proj", &layer.mlp.w1), ("up_proj", &layer.mlp.w3), ("down_proj", &layer.mlp.w2)]
            {
                out.push(entry(format!("{p}.mlp.{name}.weight"), &lin.weight, HfView::Transpose));
            }
        }
        out.push(entry(format!("{pre}norm.weight"), &self.norm.weight, HfView::Same));
        if let Some(head) = &self.lm_head {
            out.push(entry("lm_head.weight".into(), head, HfView::Same));
        }
        out
    }
}

impl<B: Backend> HfNamed for Gemma4Model<B> {
    /// The text tower's parameters (`layer_scalar` is a buffer, not a parameter, and the K/V weights of
    /// KV-sharing layers do not exist here).
    fn hf_entries(&self) -> Vec<HfEntry> {
        let pre = &self.text_prefix;
        let linear = |out: &mut Vec<HfEntry>, key: String, lin: &burn::nn::Linear<B>| {
            out.push(entry(format!("{key}.weight"), &lin.weight, HfView::Transpose))
        };
        let mut out = vec![entry(format!("{pre}embed_tokens.weight"), &self.embed_tokens, HfView::Same)];
        if let Some(table) = &self.embed_tokens_per_layer {
            out.push(entry(format!("{pre}embed_tokens_per_layer.weight"), table, HfView::Same));
        }
        if let Some(projection) = &self.per_layer_model_projection {
            linear(&mut out, format!("{pre}per_layer_model_projection"), projection);
        }
        if let Some(norm) = &self.per_layer_projection_norm {
            out.push(entry(format!("{pre}per_layer_projection_norm.weight"), &norm.weight, HfView::Same));
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let p = format!("{pre}layers.{i}");
            for (name, norm) in [
                ("input_layernorm", &layer.input_layernorm),
                ("post_attention_layernorm", &layer.post_attention_layernorm),
                ("pre_feedforward_layernorm", &layer.pre_feedforward_layernorm),
                ("post_feedforward_layernorm", &layer.post_feedforward_layernorm),
            ] {
                out.push(entry(format!("{p}.{name}.weight"), &norm.weight, HfView::Same));
            }
            let (a, attn) = (format!("{p}.self_attn"), &layer.self_attn);
            linear(&mut out, format!("{a}.q_proj"), &attn.q_proj);
            out.push(entry(format!("{a}.q_norm.weight"), &attn.q_norm.weight, HfView::Same));
            if let Some(kv) = &attn.kv {
                linear(&mut out, format!("{a}.k_proj"), &kv.k_proj);
                linear(&mut out, format!("{a}.v_proj"), &kv.v_proj);
                out.push(entry(format!("{a}.k_norm.weight"), &kv.k_norm.weight, HfView::Same));
            }
            linear(&mut out, format!("{a}.o_proj"), &attn.o_proj);
            for (name, lin) in [
                ("gate_proj", &layer.mlp.gate_proj),
                ("up_proj", &layer.mlp.up_proj),
                ("down_proj", &layer.mlp.down_proj),
            ] {
                linear(&mut out, format!("{p}.mlp.{name}"), lin);
            }
            if let Some(branch) = &layer.per_layer {
                linear(&mut out, format!("{p}.per_layer_input_gate"), &branch.per_layer_input_gate);
                linear(&mut out, format!("{p}.per_layer_projection"), &branch.per_layer_projection);
                let norm = &branch.post_per_layer_input_norm.weight;
                out.push(entry(format!("{p}.post_per_layer_input_norm.weight"), norm, HfView::Same));
            }
        }
        out.push(entry(format!("{pre}norm.weight"), &self.norm.weight, HfView::Same));
        if let Some(head) = &self.lm_head {
            out.push(entry("lm_head.weight".into(), head, HfView::Same));
        }
        out
    }
}

/// The checkpoint tensor of `view` from its parameter's value (burn layout).
pub fn to_hf(view: HfView, t: &HostTensor) -> HostTensor {
    match view {
        HfView::Same => HostTensor { shape: t.shape.clone(), data: t.data.clone() },
        HfView::Transpose => t.transposed(),
        HfView::ConvKernel => HostTensor { shape: vec![t.shape[0], 1, t.shape[1]], data: t.data.clone() },
        HfView::ExpertW1(e) | HfView::ExpertW3(e) | HfView::ExpertW2(e) => {
            // gate_up: [E, H, 2F]; down: [E, F, H]
            let (rows, cols) = (t.shape[1], t.shape[2]);
            let block = &t.data[e * rows * cols..(e + 1) * rows * cols];
            let (c0, width) = match view {
                HfView::ExpertW1(_) => (0, cols / 2),
                HfView::ExpertW3(_) => (cols / 2, cols / 2),
                _ => (0, cols),
            };
            let mut data = Vec::with_capacity(rows * width);
            for r in 0..rows {
                data.extend_from_slice(&block[r * cols + c0..r * cols + c0 + width]);
            }
            HostTensor { shape: vec![rows, width], data }.transposed()
        }
    }
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> HostTensor {
    let shape = t.dims().to_vec();
    let data = t.into_data().convert::<f32>().to_vec::<f32>().unwrap_or_default();
    HostTensor { shape, data }
}

/// Parameter values by id.
struct ValueCollector(HashMap<ParamId, HostTensor>);

impl<B: Backend> ModuleVisitor<B> for ValueCollector {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.insert(param.id, host(param.val()));
    }
}

/// Gradients by parameter id.
struct GradCollector<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    out: HashMap<ParamId, HostTensor>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradCollector<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = param.val().grad(self.grads) {
            self.out.insert(param.id, host(g));
        }
    }
}

/// The model's tensors under their checkpoint names and layouts.
pub fn hf_tensors<B: Backend, M: Module<B> + HfNamed>(model: &M) -> BTreeMap<String, HostTensor> {
    let mut values = ValueCollector(HashMap::new());
    model.visit(&mut values);
    model.hf_entries().into_iter().filter_map(|e| Some((e.key, to_hf(e.view, values.0.get(&e.id)?)))).collect()
}

/// Gradients under checkpoint names and layouts (parameters without a gradient are left out).
pub fn hf_gradients<B: AutodiffBackend, M: Module<B> + HfNamed>(
    model: &M,
    grads: &B::Gradients,
) -> BTreeMap<String, HostTensor> {
    let mut collector = GradCollector::<B> { grads, out: HashMap::new() };
    model.visit(&mut collector);
    model.hf_entries().into_iter().filter_map(|e| Some((e.key, to_hf(e.view, collector.out.get(&e.id)?)))).collect()
}

/// One tensor planned into a shard: name, encoded bytes, dtype, shape.
type ShardEntry<'a> = (&'a String, Vec<u8>, Dtype, Vec<usize>);

/// Safetensors shard size limit, as transformers' `save_pretrained` default (5 GB).
pub const SHARD_BYTES: usize = 5_000_000_000;

/// The on-disk dtype of an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ExportDtype {
    F32,
    Bf16,
}

fn encode(t: &HostTensor, dtype: ExportDtype) -> Vec<u8> {
    match dtype {
        ExportDtype::F32 => t.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ExportDtype::Bf16 => t.data.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
    }
}

/// Files copied from the source checkpoint beside the weights (those that exist).
pub const COMPANION_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
];

/// A checkpoint tensor carried through an export unchanged: its dtype, shape and bytes as read.
#[derive(Debug, Clone, PartialEq)]
pub struct RawTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// Writes `tensors` (and the `raw` ones, as they are) as `model.safetensors` (or
/// `model-0000k-of-0000n.safetensors` shards past `shard_bytes`, with `model.safetensors.index.json`),
/// metadata `format = pt`. `keep_f32` names tensors kept in f32 whatever `dtype` (fp32 buffers such as
/// `expert_bias`, Qwen3.5's `A_log`).
pub fn write_safetensors(
    tensors: &BTreeMap<String, HostTensor>,
    raw: &BTreeMap<String, RawTensor>,
    out_dir: &Path,
    dtype: ExportDtype,
    keep_f32: &dyn Fn(&str) -> bool,
    shard_bytes: usize,
) -> Result<Vec<std::path::PathBuf>, ModelError> {
    std::fs::create_dir_all(out_dir).map_err(|e| ModelError::io(out_dir, e))?;
    let mut planned: Vec<ShardEntry> = tensors
        .iter()
        .map(|(key, t)| {
            let d = if keep_f32(key) { ExportDtype::F32 } else { dtype };
            let st = match d {
                ExportDtype::F32 => Dtype::F32,
                ExportDtype::Bf16 => Dtype::BF16,
            };
            (key, encode(t, d), st, t.shape.clone())
        })
        .collect();
    planned.extend(raw.iter().map(|(key, t)| (key, t.bytes.clone(), t.dtype, t.shape.clone())));
    planned.sort_by(|a, b| a.0.cmp(b.0));
    // Shards in key order.
    let mut shards: Vec<Vec<ShardEntry>> = vec![Vec::new()];
    let mut current = 0usize;
    for entry in planned {
        if current > 0 && current + entry.1.len() > shard_bytes {
            shards.push(Vec::new());
            current = 0;
        }
        current += entry.1.len();
        shards.last_mut().expect("one shard").push(entry);
    }
    let n = shards.len();
    let mut written = Vec::new();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for (i, shard) in shards.iter().enumerate() {
        let name = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
        };
        let path = out_dir.join(&name);
        let views: Vec<(String, safetensors::tensor::TensorView)> = shard
            .iter()
            .map(|(k, bytes, st, shape)| {
                total += bytes.len();
                weight_map.insert((*k).clone(), serde_json::Value::String(name.clone()));
                safetensors::tensor::TensorView::new(*st, shape.clone(), bytes).map(|v| ((*k).clone(), v))
            })
            .collect::<Result<_, _>>()
            .map_err(|e| ModelError::Weights { path: path.clone(), message: e.to_string() })?;
        let metadata: Option<std::collections::HashMap<String, String>> =
            Some([("format".to_string(), "pt".to_string())].into());
        safetensors::serialize_to_file(views, metadata, &path)
            .map_err(|e| ModelError::Weights { path: path.clone(), message: e.to_string() })?;
        written.push(path);
    }
    if n > 1 {
        let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let path = out_dir.join("model.safetensors.index.json");
        std::fs::write(&path, serde_json::to_string_pretty(&index).unwrap_or_default() + "\n")
            .map_err(|e| ModelError::io(&path, e))?;
        written.push(path);
    }
    remove_stale_weights(out_dir, &written)?;
    Ok(written)
}

/// Removes the weight files of an earlier export to `out_dir` that this one did not write (its single file
/// where shards are now, or the reverse, or shards beyond the new count), once the new ones are complete.
/// Readers disagree on which layout wins: transformers takes `model.safetensors` first, kiln the index, and
/// vLLM every `*.safetensors` file, so a stale file would be read as the checkpoint by one of them.
fn remove_stale_weights(out_dir: &Path, written: &[std::path::PathBuf]) -> Result<(), ModelError> {
    let is_weight_file = |name: &str| {
        name == "model.safetensors"
            || name == "model.safetensors.index.json"
            || (name.starts_with("model-") && name.contains("-of-") && name.ends_with(".safetensors"))
    };
    let entries = std::fs::read_dir(out_dir).map_err(|e| ModelError::io(out_dir, e))?;
    for entry in entries {
        let path = entry.map_err(|e| ModelError::io(out_dir, e))?.path();
        let stale = path.file_name().and_then(|n| n.to_str()).is_some_and(is_weight_file) && !written.contains(&path);
        if stale {
            std::fs::remove_file(&path).map_err(|e| ModelError::io(&path, e))?;
        }
    }
    Ok(())
}

/// Copies the companion files of `source_dir` (config, generation config, tokenizer, template) that exist.
pub fn copy_companions(source_dir: &Path, out_dir: &Path) -> Result<(), ModelError> {
    for file in COMPANION_FILES {
        let src = source_dir.join(file);
        if src.is_file() {
            let dst = out_dir.join(file);
            std::fs::copy(&src, &dst).map_err(|e| ModelError::io(&dst, e))?;
        }
    }
    Ok(())
}

/// Refuses to write a checkpoint into the folder it comes from: its weights would be replaced, and its
/// companion files, copied onto themselves, truncated to nothing.
pub fn refuse_overwriting_source(source_dir: &Path, out_dir: &Path) -> Result<(), ModelError> {
    match (source_dir.canonicalize(), out_dir.canonicalize()) {
        (Ok(source), Ok(out)) if source == out => Err(ModelError::Config {
            path: out_dir.to_path_buf(),
            message: format!(
                "is the checkpoint being read ({}); writing over it would lose it: choose another folder",
                source_dir.display()
            ),
        }),
        _ => Ok(()),
    }
}

/// An HF model directory: the weights (`write_safetensors`) and the source checkpoint's companion files.
pub fn export_dir(
    tensors: &BTreeMap<String, HostTensor>,
    raw: &BTreeMap<String, RawTensor>,
    source_dir: &Path,
    out_dir: &Path,
    dtype: ExportDtype,
    keep_f32: &dyn Fn(&str) -> bool,
    shard_bytes: usize,
) -> Result<Vec<std::path::PathBuf>, ModelError> {
    refuse_overwriting_source(source_dir, out_dir)?;
    let written = write_safetensors(tensors, raw, out_dir, dtype, keep_f32, shard_bytes)?;
    copy_companions(source_dir, out_dir)?;
    Ok(written)
}
