//! The bridge to Hugging Face checkpoint names: which model parameter is which checkpoint tensor, in which
//! layout (Linear weights transposed, conv kernels reshaped, fused experts split per expert), and export of
//! a model as an HF directory transformers and vLLM load as-is (with the tensors of towers kiln does not
//! train, such as Qwen3.5's vision tower, copied from the source byte for byte), written tensor by tensor
//! (`StreamedTensor`) so that neither an export nor a training state holds the model on the host.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::rc::Rc;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};
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

/// A parameter's host copy, made when asked for.
type ParamRead = Box<dyn Fn() -> HostTensor>;

/// A parameter's shape and dtype on the device, and how to copy it to the host.
struct DeviceParam {
    shape: Vec<usize>,
    dtype: DType,
    read: ParamRead,
}

/// The model's parameters by id, each copied to the host when read. A parameter that several checkpoint
/// tensors are cut from (an MoE layer's fused experts) is copied once and kept until its last tensor has
/// been read, whatever the order, and no other host copy is kept: a model is read tensor by tensor.
struct ParamReader {
    params: HashMap<ParamId, DeviceParam>,
    /// Reads still to come of each parameter, from the checkpoint entries.
    uses: RefCell<HashMap<ParamId, usize>>,
    kept: RefCell<HashMap<ParamId, Rc<HostTensor>>>,
    copies: std::cell::Cell<usize>,
}

impl ParamReader {
    fn of<B: Backend, M: Module<B>>(model: &M, entries: &[HfEntry]) -> Self {
        let mut uses = HashMap::new();
        for e in entries {
            *uses.entry(e.id).or_insert(0) += 1;
        }
        let mut reader = ParamReader {
            params: HashMap::new(),
            uses: RefCell::new(uses),
            kept: RefCell::new(HashMap::new()),
            copies: std::cell::Cell::new(0),
        };
        model.visit(&mut reader);
        reader
    }

    fn shape(&self, id: &ParamId) -> Option<&[usize]> {
        self.params.get(id).map(|p| p.shape.as_slice())
    }

    fn dtype(&self, id: &ParamId) -> Option<DType> {
        self.params.get(id).map(|p| p.dtype)
    }

    /// The parameter's host copy, for one of the entries that read it.
    fn read(&self, id: &ParamId) -> Option<Rc<HostTensor>> {
        let remaining = {
            let mut uses = self.uses.borrow_mut();
            let left = uses.entry(*id).or_insert(1);
            *left = left.saturating_sub(1);
            *left
        };
        let kept = if remaining == 0 { self.kept.borrow_mut().remove(id) } else { self.kept.borrow().get(id).cloned() };
        if let Some(t) = kept {
            return Some(t);
        }
        let t = Rc::new((self.params.get(id)?.read)());
        self.copies.set(self.copies.get() + 1);
        if remaining > 0 {
            self.kept.borrow_mut().insert(*id, t.clone());
        }
        Some(t)
    }
}

impl<B: Backend> ModuleVisitor<B> for ParamReader {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        // A handle on the device tensor, not a copy of it.
        let value = param.val();
        let (shape, dtype) = (value.dims().to_vec(), value.dtype());
        self.params.insert(param.id, DeviceParam { shape, dtype, read: Box::new(move || host(value.clone())) });
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
    let entries = model.hf_entries();
    let params = ParamReader::of(model, &entries);
    entries.into_iter().filter_map(|e| Some((e.key, to_hf(e.view, &*params.read(&e.id)?)))).collect()
}

/// The model's tensors as `hf_tensors` names and lays them out, each in the dtype `dtype_of` gives its name
/// and its parameter's dtype on the device, copied from the device and encoded only when the writer reaches
/// it (`write_streamed`).
pub fn streamed_hf_tensors<'a, B: Backend, M: Module<B> + HfNamed>(
    model: &M,
    dtype_of: &dyn Fn(&str, DType) -> ExportDtype,
) -> Vec<(String, StreamedTensor<'a>)> {
    let entries = model.hf_entries();
    let params = Rc::new(ParamReader::of(model, &entries));
    entries
        .into_iter()
        .filter_map(|e| {
            let shape = hf_shape(e.view, params.shape(&e.id)?);
            let d = dtype_of(&e.key, params.dtype(&e.id)?);
            let params = params.clone();
            let id = e.id;
            let bytes = move || {
                let t = params.read(&id).ok_or("the parameter is gone")?;
                Ok(encode(&to_hf(e.view, &t), d))
            };
            Some((e.key, StreamedTensor::new(d.into(), shape, bytes)))
        })
        .collect()
}

/// The shape `to_hf` gives a parameter of `shape` (burn layout) under `view`.
fn hf_shape(view: HfView, shape: &[usize]) -> Vec<usize> {
    match view {
        HfView::Same => shape.to_vec(),
        HfView::Transpose => shape.iter().rev().copied().collect(),
        HfView::ConvKernel => vec![shape[0], 1, shape[1]],
        HfView::ExpertW1(_) | HfView::ExpertW3(_) => vec![shape[2] / 2, shape[1]],
        HfView::ExpertW2(_) => vec![shape[2], shape[1]],
    }
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

impl From<ExportDtype> for Dtype {
    fn from(dtype: ExportDtype) -> Dtype {
        match dtype {
            ExportDtype::F32 => Dtype::F32,
            ExportDtype::Bf16 => Dtype::BF16,
        }
    }
}

/// Makes a tensor's bytes for the writer, or says why it cannot.
type TensorBytes<'a> = Box<dyn Fn() -> Result<Vec<u8>, String> + 'a>;

/// A tensor to write whose bytes are made when the writer reaches it, so that a file is written with about
/// one tensor in host memory instead of a host copy of all of it: an 8B model's training state (f32 weights
/// and masters, moments) would otherwise take over 100 GB of host memory at every save.
pub struct StreamedTensor<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: TensorBytes<'a>,
    /// Why the bytes could not be made, or came out another length than the shape says; the file written
    /// with it is then refused.
    failure: RefCell<Option<String>>,
}

impl<'a> StreamedTensor<'a> {
    pub fn new(dtype: Dtype, shape: Vec<usize>, bytes: impl Fn() -> Result<Vec<u8>, String> + 'a) -> Self {
        StreamedTensor { dtype, shape, bytes: Box::new(bytes), failure: RefCell::new(None) }
    }

    /// `t`, encoded in `dtype` when written.
    pub fn encoded(t: &'a HostTensor, dtype: ExportDtype) -> Self {
        StreamedTensor::new(dtype.into(), t.shape.clone(), move || Ok(encode(t, dtype)))
    }

    /// `t`'s bytes as they are.
    pub fn raw(t: &'a RawTensor) -> Self {
        StreamedTensor::new(t.dtype, t.shape.clone(), move || Ok(t.bytes.clone()))
    }

    /// The tensor in f32 on the host, made now (integer codes become their values).
    pub fn to_host(&self) -> Result<HostTensor, String> {
        let bytes = self.checked_bytes()?;
        let data = match self.dtype {
            Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::U8 => bytes.iter().map(|&b| f32::from(b)).collect(),
            other => return Err(format!("a {other:?} tensor has no f32 values")),
        };
        Ok(HostTensor { shape: self.shape.clone(), data })
    }

    fn len(&self) -> usize {
        (self.shape.iter().product::<usize>() * self.dtype.bitsize()).div_ceil(8)
    }

    fn checked_bytes(&self) -> Result<Vec<u8>, String> {
        let bytes = (self.bytes)()?;
        if bytes.len() != self.len() {
            return Err(format!("{} bytes for a {:?} tensor of shape {:?}", bytes.len(), self.dtype, self.shape));
        }
        Ok(bytes)
    }
}

impl safetensors::View for &StreamedTensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        match self.checked_bytes() {
            Ok(bytes) => bytes.into(),
            Err(why) => {
                // The writer cannot stop here: the slot is filled with zeros and the file refused after.
                *self.failure.borrow_mut() = Some(why);
                vec![0; self.len()].into()
            }
        }
    }

    fn data_len(&self) -> usize {
        self.len()
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

/// The model card a checkpoint folder may hold (`README.md` and the figures it shows, in `card/`; kiln's card
/// stage writes them into the selected epoch). They document the checkpoint and are not part of it: whatever
/// asks whether a checkpoint changed leaves them out.
pub const CARD_ENTRIES: &[&str] = &["README.md", "card"];

/// A checkpoint tensor carried through an export unchanged: its dtype, shape and bytes as read.
#[derive(Debug, Clone, PartialEq)]
pub struct RawTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// Writes `tensors` (and the `raw` ones, as they are) as `write_streamed` does, each encoded in `dtype` as
/// it is written (`streamed_host`).
pub fn write_safetensors(
    tensors: &BTreeMap<String, HostTensor>,
    raw: &BTreeMap<String, RawTensor>,
    out_dir: &Path,
    dtype: ExportDtype,
    keep_f32: &dyn Fn(&str) -> bool,
    shard_bytes: usize,
) -> Result<Vec<std::path::PathBuf>, ModelError> {
    write_streamed(streamed_host(tensors, raw, dtype, keep_f32), out_dir, shard_bytes)
}

/// Host `tensors` to be encoded in `dtype` as they are written (f32 where `keep_f32` says: fp32 buffers such
/// as `expert_bias`, Qwen3.5's `A_log`), and `raw` ones to be written as they are.
fn streamed_host<'a>(
    tensors: &'a BTreeMap<String, HostTensor>,
    raw: &'a BTreeMap<String, RawTensor>,
    dtype: ExportDtype,
    keep_f32: &dyn Fn(&str) -> bool,
) -> Vec<(String, StreamedTensor<'a>)> {
    let encoded = tensors.iter().map(|(key, t)| {
        let d = if keep_f32(key) { ExportDtype::F32 } else { dtype };
        (key.clone(), StreamedTensor::encoded(t, d))
    });
    let as_they_are = raw.iter().map(|(key, t)| (key.clone(), StreamedTensor::raw(t)));
    encoded.chain(as_they_are).collect()
}

/// Writes `tensors` as `model.safetensors` (or `model-0000k-of-0000n.safetensors` shards past `shard_bytes`,
/// in key order, with `model.safetensors.index.json`), metadata `format = pt`, making each tensor's bytes
/// as its turn comes. A tensor whose bytes cannot be made refuses the whole export, naming it.
pub fn write_streamed(
    mut tensors: Vec<(String, StreamedTensor<'_>)>,
    out_dir: &Path,
    shard_bytes: usize,
) -> Result<Vec<std::path::PathBuf>, ModelError> {
    std::fs::create_dir_all(out_dir).map_err(|e| ModelError::io(out_dir, e))?;
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut shards: Vec<Vec<&(String, StreamedTensor)>> = vec![Vec::new()];
    let mut current = 0usize;
    for entry in &tensors {
        let len = entry.1.len();
        if current > 0 && current + len > shard_bytes {
            shards.push(Vec::new());
            current = 0;
        }
        current += len;
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
        for (key, t) in shard {
            total += t.len();
            weight_map.insert(key.clone(), serde_json::Value::String(name.clone()));
        }
        let metadata: Option<std::collections::HashMap<String, String>> =
            Some([("format".to_string(), "pt".to_string())].into());
        let views = shard.iter().map(|(key, t)| (key, t));
        // A file cut short (a full disk) is removed: it is not a checkpoint, and it holds the space.
        safetensors::serialize_to_file(views, metadata, &path).map_err(|e| {
            let _ = std::fs::remove_file(&path);
            ModelError::Weights { path: path.clone(), message: e.to_string() }
        })?;
        if let Some((key, why)) = shard.iter().find_map(|(key, t)| Some((key, t.failure.take()?))) {
            let _ = std::fs::remove_file(&path);
            return Err(ModelError::Weights { path, message: format!("{key}: {why}") });
        }
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
    export_streamed(streamed_host(tensors, raw, dtype, keep_f32), source_dir, out_dir, shard_bytes)
}

/// An HF model directory: the weights (`write_streamed`) and the source checkpoint's companion files.
pub fn export_streamed(
    tensors: Vec<(String, StreamedTensor<'_>)>,
    source_dir: &Path,
    out_dir: &Path,
    shard_bytes: usize,
) -> Result<Vec<std::path::PathBuf>, ModelError> {
    refuse_overwriting_source(source_dir, out_dir)?;
    let written = write_streamed(tensors, out_dir, shard_bytes)?;
    copy_companions(source_dir, out_dir)?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;

    /// Read in the writer's order (by name, where an MoE layer's experts alternate between the fused gate/up
    /// and down parameters), every parameter is copied to the host once and none is kept after.
    #[test]
    fn a_model_is_read_copying_each_parameter_once() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lfm2/lfm2-moe-tiny");
        let (_, model) = crate::models::load_model::<Cpu>(&dir, &Default::default()).unwrap();
        let mut entries = model.hf_entries();
        let params: std::collections::HashSet<ParamId> = entries.iter().map(|e| e.id).collect();
        assert!(params.len() < entries.len(), "the fixture has split parameters");
        entries.sort_by(|a, b| a.key.cmp(&b.key));
        let reader = ParamReader::of(&model, &entries);
        let expected = hf_tensors(&model);
        for e in &entries {
            let t = to_hf(e.view, &reader.read(&e.id).unwrap());
            assert!(t.shape == expected[&e.key].shape && t.data == expected[&e.key].data, "{}", e.key);
            assert_eq!(hf_shape(e.view, reader.shape(&e.id).unwrap()), t.shape, "{}", e.key);
        }
        assert_eq!(reader.copies.get(), params.len());
        assert!(reader.kept.borrow().is_empty());
    }

    /// A tensor whose bytes cannot be made, or come out at another length than its shape's, refuses the
    /// file, naming the tensor, and leaves no file behind.
    #[test]
    fn a_tensor_that_cannot_be_made_refuses_its_file() {
        let good = HostTensor { shape: vec![2, 3], data: vec![1.0; 6] };
        let lost = StreamedTensor::new(Dtype::F32, vec![2], || Err("device lost".to_string()));
        let short = StreamedTensor::new(Dtype::F32, vec![2], || Ok(vec![0u8; 4]));
        for (what, bad, message) in
            [("device lost", lost, "device lost"), ("short", short, "4 bytes for a F32 tensor of shape [2]")]
        {
            let out = tempfile::tempdir().unwrap();
            let tensors = vec![
                ("a.weight".to_string(), StreamedTensor::encoded(&good, ExportDtype::F32)),
                ("b.weight".to_string(), bad),
            ];
            let err = write_streamed(tensors, out.path(), usize::MAX).unwrap_err().to_string();
            assert!(err.contains("b.weight") && err.contains(message), "{what}: {err}");
            assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0, "{what}");
        }
    }
}
