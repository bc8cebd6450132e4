//! AdamW as PyTorch computes it (decoupled weight decay applied first, bias-corrected moments, `eps` added to
//! the corrected root), no decay on vectors (norm weights, biases), global-norm gradient clipping, gradient
//! accumulation in f32, and a state that saves and loads by parameter name for exact resume.
//!
//! Mixed precision: burn has no master weights, so the optimizer keeps them. A parameter stored below f32
//! (bf16 on the GPU) gets an f32 master copy here; every update runs in f32 on the master and the parameter
//! is the master rounded to its dtype — the update is the f32 update, bit for bit, whatever the compute
//! dtype. Moments are f32, bf16 (`moments = "bf16"`, 4 bytes per parameter less) or block-wise 8-bit
//! (`moments = "q8"`, 6 bytes less: `quant8`, as bitsandbytes' AdamW8bit) for the largest models. Without
//! masters (`masters = "stochastic"`, 4 bytes less) the f32 update of a bf16 parameter is rounded into it
//! stochastically (`rounding`): unbiased, where PyTorch's plain bf16 AdamW rounds small updates away.

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Shape, Tensor, TensorMetadata, TensorPrimitive};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};

use super::quant8::{self, Blocks, Map};
use super::rounding;
use crate::backend::{host_tensor, zeros_in};
use crate::models::hf::StreamedTensor;
use crate::models::weights::HostTensor;

/// The dtype AdamW's moments are stored in between steps (they are always updated in f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum MomentDtype {
    #[default]
    F32,
    Bf16,
    /// Block-wise 8-bit (`quant8`) for parameters of `quant8::MIN_ELEMENTS` values or more, f32 below.
    Q8,
}

impl MomentDtype {
    /// The dtype of moments kept as tensors (all of them, except the 8-bit ones of large parameters).
    fn dense(self) -> FloatDType {
        match self {
            MomentDtype::F32 | MomentDtype::Q8 => FloatDType::F32,
            MomentDtype::Bf16 => FloatDType::BF16,
        }
    }
}

/// The suffix of an 8-bit moment's code indices in a training state (`<param>.m.q8`: values 0 to 255, which
/// the state file stores as u8), beside its block scales (`<param>.m.absmax`).
pub const CODES_SUFFIX: &str = ".q8";

/// One moment of one parameter between steps.
enum Moment<B: Backend> {
    /// In the parameter's shape, rank-erased (or flat, from a file, until its first step: `shaped`).
    Dense(B::FloatTensorPrimitive),
    /// Block-wise 8-bit, flat.
    Blocks(Blocks<B>),
}

impl<B: Backend> Moment<B> {
    /// The moment in f32 in the parameter's `shape`.
    fn into_f32<const D: usize>(self, shape: [usize; D], map: Map) -> Tensor<B, D> {
        match self {
            Moment::Dense(t) => shaped::<B, D>(t, shape).cast(FloatDType::F32),
            Moment::Blocks(blocks) => quant8::dequantize(&blocks, map, shape.iter().product()).reshape(shape),
        }
    }

    /// `value` stored as `dtype` says: 8-bit for a parameter of `quant8::MIN_ELEMENTS` values or more.
    fn store<const D: usize>(value: Tensor<B, D>, dtype: MomentDtype, map: Map) -> Self {
        let len = value.shape().num_elements();
        if dtype == MomentDtype::Q8 && len >= quant8::MIN_ELEMENTS {
            Moment::Blocks(quant8::quantize(value.reshape([len]), map))
        } else {
            Moment::Dense(primitive(value.cast(dtype.dense())))
        }
    }

    /// The tensors of a training-state file, under `name` (`<param>.m`, `<param>.v`): the f32 values, or for
    /// 8-bit moments the code indices (`<name>.q8`, u8) and block scales (`<name>.absmax`), which restore the
    /// moment exactly; each copied from the device when the writer reaches it.
    fn streamed(&self, name: &str) -> Vec<(String, StreamedTensor<'static>)> {
        match self {
            Moment::Dense(t) => vec![(name.to_string(), streamed_f32::<B>(t))],
            Moment::Blocks(blocks) => {
                let (codes, scales) = (blocks.codes.clone(), blocks.absmax.clone());
                let read_codes = move || codes.clone().into_data().convert::<u8>().into_vec::<u8>();
                let read_scales = move || scales.clone().into_data().convert::<f32>().into_vec::<f32>();
                let why = |e: burn::tensor::DataError| format!("{e:?}");
                let codes = StreamedTensor::new(Dtype::U8, vec![blocks.block_count() * quant8::BLOCK], move || {
                    read_codes().map_err(why)
                });
                let scales = StreamedTensor::new(Dtype::F32, vec![blocks.block_count()], move || {
                    read_scales().map(|v| f32_bytes(&v)).map_err(why)
                });
                vec![(format!("{name}{CODES_SUFFIX}"), codes), (format!("{name}.absmax"), scales)]
            }
        }
    }

    /// The moment saved under `name` by `streamed` for a parameter of `len` values, in `dtype`; `None` where
    /// nothing is saved under that name.
    fn from_host(
        saved: &HashMap<String, HostTensor>,
        name: &str,
        len: usize,
        dtype: MomentDtype,
        device: &B::Device,
    ) -> Result<Option<Self>, String> {
        let codes = saved.get(&format!("{name}{CODES_SUFFIX}"));
        if let (Some(codes), Some(scales)) = (codes, saved.get(&format!("{name}.absmax"))) {
            let blocks = Blocks::from_host(&codes.data, &scales.data, device).map_err(|e| format!("{name}: {e}"))?;
            if blocks.block_count() != len.div_ceil(quant8::BLOCK) {
                return Err(format!("{name}: {} blocks saved for a parameter of {len} values", blocks.block_count()));
            }
            return Ok(Some(Moment::Blocks(blocks)));
        }
        let Some(t) = saved.get(name) else { return Ok(None) };
        if t.data.len() != len {
            return Err(format!("{name}: {} values saved for a parameter of {len}", t.data.len()));
        }
        let values = host_tensor::<B, 1>(t.data.clone(), [len], FloatDType::F32, device);
        Ok(Some(Moment::Dense(primitive(values.cast(dtype.dense())))))
    }
}

/// How the update reaches a parameter stored below f32 (bf16 on the GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Masters {
    /// An f32 master copy takes the update, and the parameter is the master rounded to nearest.
    #[default]
    F32,
    /// No master: the update is computed in f32 from the parameter and rounded into it stochastically
    /// (`rounding::stochastic_round`), 4 bytes a parameter less.
    Stochastic,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub moments: MomentDtype,
    pub masters: Masters,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            moments: MomentDtype::F32,
            masters: Masters::F32,
        }
    }
}

impl AdamWConfig {
    /// Whether a parameter stored as `dtype` gets an f32 master copy.
    pub(crate) fn keeps_master(&self, dtype: DType) -> bool {
        dtype != DType::F32 && self.masters == Masters::F32
    }
}

/// What AdamW keeps for one parameter: its moments and, for a parameter stored below f32, the f32 master.
/// They are rank-erased primitives in the parameter's own shape: flattening them (and the parameter and its
/// gradient) to one dimension would cost the fused backends a kernel per tensor, since burn-fusion cannot fuse
/// a reshape to a lower rank and ends the element-wise block there. A state restored from a file is flat
/// until its first step (`shaped`).
struct ParamState<B: Backend> {
    m: Moment<B>,
    v: Moment<B>,
    master: Option<B::FloatTensorPrimitive>,
}

fn primitive<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> B::FloatTensorPrimitive {
    tensor.into_primitive().tensor()
}

/// A stored state tensor's values as a flat f32 tensor of a training-state file, copied from the device
/// when written.
fn streamed_f32<B: Backend>(t: &B::FloatTensorPrimitive) -> StreamedTensor<'static> {
    let t = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t.clone()));
    let len = t.shape().num_elements();
    StreamedTensor::new(Dtype::F32, vec![len], move || {
        let values = t.clone().into_data().convert::<f32>().into_vec::<f32>().map_err(|e| format!("{e:?}"))?;
        Ok(f32_bytes(&values))
    })
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A stored state tensor in the parameter's `shape`: as is when it has it, else (flat, from a file) reshaped
/// up to it — a rank increase, which burn-fusion fuses.
fn shaped<B: Backend, const D: usize>(state: B::FloatTensorPrimitive, shape: [usize; D]) -> Tensor<B, D> {
    if state.shape() == Shape::from(shape) {
        Tensor::from_primitive(TensorPrimitive::Float(state))
    } else {
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(state)).reshape(shape)
    }
}

/// Optimizer state over the inner (non-autodiff) backend `B`.
pub struct AdamW<B: Backend> {
    pub config: AdamWConfig,
    /// Completed optimizer steps.
    pub steps: usize,
    states: HashMap<ParamId, ParamState<B>>,
}

impl<B: Backend> AdamW<B> {
    pub fn new(config: AdamWConfig) -> Self {
        AdamW { config, steps: 0, states: HashMap::new() }
    }

    /// Moments (`<name>.m`, `<name>.v`: f32 values, or 8-bit codes and scales, `Moment::streamed`) and f32
    /// master weights (`<name>.master`), named by `names` (parameter id → stable name), as the tensors of a
    /// training-state file, each copied from the device when written.
    pub fn state_tensors(&self, names: &HashMap<ParamId, String>) -> Vec<(String, StreamedTensor<'static>)> {
        let mut out = Vec::new();
        for (id, state) in &self.states {
            let Some(name) = names.get(id) else { continue };
            out.extend(state.m.streamed(&format!("{name}.m")));
            out.extend(state.v.streamed(&format!("{name}.v")));
            if let Some(master) = &state.master {
                out.push((format!("{name}.master"), streamed_f32::<B>(master)));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// `state_tensors` as f32 host tensors (8-bit codes as their values), as `import_state` takes them.
    pub fn export_state(&self, names: &HashMap<ParamId, String>) -> Result<Vec<(String, HostTensor)>, String> {
        self.state_tensors(names)
            .into_iter()
            .map(|(name, t)| t.to_host().map(|host| (name.clone(), host)).map_err(|why| format!("{name}: {why}")))
            .collect()
    }

    /// Restores a state saved by `export_state` onto the parameters of `names` (id → name and number of
    /// values: `param_sizes`), in this config's moment dtype; an error names a saved tensor whose
    /// size does not fit its parameter.
    pub fn import_state(
        &mut self,
        names: &HashMap<ParamId, (String, usize)>,
        saved: &HashMap<String, HostTensor>,
        device: &B::Device,
    ) -> Result<(), String> {
        let dtype = self.config.moments;
        for (id, (name, len)) in names {
            let m = Moment::from_host(saved, &format!("{name}.m"), *len, dtype, device)?;
            let v = Moment::from_host(saved, &format!("{name}.v"), *len, dtype, device)?;
            let (Some(m), Some(v)) = (m, v) else { continue };
            let master = match saved.get(&format!("{name}.master")) {
                Some(t) if t.data.len() != *len => {
                    return Err(format!("{name}.master: {} values saved for a parameter of {len}", t.data.len()));
                }
                Some(t) => Some(primitive(host_tensor::<B, 1>(t.data.clone(), [*len], FloatDType::F32, device))),
                None => None,
            };
            self.states.insert(*id, ParamState { m, v, master });
        }
        if self.states.is_empty() && !saved.is_empty() {
            return Err("no saved moment matches a parameter of this model".into());
        }
        Ok(())
    }
}

/// What a model's weights, gradients and AdamW state take on the device between optimizer steps, in bytes
/// (activations come on top): the arithmetic of docs/TRAINING.md's memory table for this model's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StateMemory {
    pub parameters: u64,
    pub weights: u64,
    /// One backward pass's gradients, in the parameters' dtypes.
    pub gradients: u64,
    /// The f32 sum of a step's micro-batch gradients (only when several are accumulated).
    pub gradient_sum: u64,
    /// f32 master copies of parameters stored below f32.
    pub masters: u64,
    /// Both moments, 8-bit codes and block scales included.
    pub moments: u64,
}

impl StateMemory {
    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.gradient_sum + self.masters + self.moments
    }

    /// One line: each part and the total in GiB.
    pub fn summary(&self) -> String {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        format!(
            "{:.1} M parameters: weights {:.2} GiB, gradients {:.2}{}, masters {:.2}, moments {:.2}: {:.2} GiB before activations",
            self.parameters as f64 / 1e6,
            gib(self.weights),
            gib(self.gradients),
            if self.gradient_sum > 0 { format!(" (+{:.2} summed)", gib(self.gradient_sum)) } else { String::new() },
            gib(self.masters),
            gib(self.moments),
            gib(self.total())
        )
    }
}

/// `StateMemory` of `model` as AdamW with `config` trains it, accumulating micro-batches or not; or an error
/// where it alone (before any activation) exceeds `device_bytes`, the device's memory: an 8B model's f32 AdamW
/// state does not fit an 80 GB GPU, and saying so before the first step beats an allocation failure on the
/// device's thread after minutes of loading. The error names the moment storage that would fit, if one does.
pub fn state_memory_on_device<B: Backend, M: Module<B>>(
    model: &M,
    config: &AdamWConfig,
    accumulating: bool,
    device_bytes: Option<u64>,
) -> Result<StateMemory, String> {
    let tensors: Vec<(usize, usize)> = float_params(model).into_iter().map(|(_, n, bytes)| (n, bytes)).collect();
    tensors_fit_device(&tensors, config, accumulating, device_bytes)
}

/// `state_memory_on_device` for tensors of `(values, bytes a value)`: a model known by its checkpoint's
/// headers before it is loaded (`models::checkpoint_tensor_sizes`).
pub fn tensors_fit_device(
    tensors: &[(usize, usize)],
    config: &AdamWConfig,
    accumulating: bool,
    device_bytes: Option<u64>,
) -> Result<StateMemory, String> {
    let memory = state_memory_of(tensors, config, accumulating);
    let Some(device_bytes) = device_bytes.filter(|&d| memory.total() > d) else { return Ok(memory) };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    // Smaller moments first, then without masters as well (the least change that fits).
    let masters_to_try: &[Masters] =
        if config.masters == Masters::F32 { &[Masters::F32, Masters::Stochastic] } else { &[Masters::Stochastic] };
    let smaller = masters_to_try
        .iter()
        .flat_map(|&masters| [MomentDtype::Bf16, MomentDtype::Q8].map(|moments| (moments, masters)))
        .chain([(config.moments, Masters::Stochastic)])
        .filter(|&(moments, masters)| (moments, masters) != (config.moments, config.masters))
        .filter(|&(moments, _)| moments_rank(moments) >= moments_rank(config.moments))
        .map(|(moments, masters)| {
            let total = state_memory_of(tensors, &AdamWConfig { moments, masters, ..*config }, accumulating).total();
            (moments, masters, total)
        })
        .filter(|&(_, _, total)| total <= device_bytes)
        .min_by_key(|&(moments, masters, _)| (masters != config.masters, moments_rank(moments)));
    let hint = match smaller {
        Some((m, masters, total)) => {
            let name = format!("{m:?}").to_lowercase();
            let (what, keys, flags) = if masters == config.masters {
                (format!("AdamW moments in {name}"), format!("moments = \"{name}\""), format!("--moments {name}"))
            } else if m == config.moments {
                (
                    "bf16 weights without f32 masters".into(),
                    "masters = \"stochastic\"".into(),
                    "--masters stochastic".into(),
                )
            } else {
                (
                    format!("AdamW moments in {name} and bf16 weights without f32 masters"),
                    format!("moments = \"{name}\", masters = \"stochastic\""),
                    format!("--moments {name} --masters stochastic"),
                )
            };
            format!("{what} need {:.1} GiB before activations (`[train.adamw] {keys}` or `{flags}`)", gib(total))
        }
        None => "no moment or master storage fits: this model needs a device with more memory".into(),
    };
    Err(format!(
        "the weights, gradients and AdamW state of {:.1} M parameters need {:.1} GiB before any activation, and the device has {:.1} GiB: {hint}",
        memory.parameters as f64 / 1e6,
        gib(memory.total()),
        gib(device_bytes)
    ))
}

/// How small moments of `dtype` are: f32 0, bf16 1, q8 2.
fn moments_rank(dtype: MomentDtype) -> u8 {
    match dtype {
        MomentDtype::F32 => 0,
        MomentDtype::Bf16 => 1,
        MomentDtype::Q8 => 2,
    }
}

/// Each float parameter of `model`: its id, number of values and bytes a value.
fn float_params<B: Backend, M: Module<B>>(model: &M) -> Vec<(ParamId, usize, usize)> {
    struct Tally(Vec<(ParamId, usize, usize)>);
    impl<B: Backend> ModuleVisitor<B> for Tally {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let t = param.val();
            self.0.push((param.id, t.shape().num_elements(), t.dtype().size()));
        }
    }
    let mut tally = Tally(Vec::new());
    model.visit(&mut tally);
    tally.0
}

/// `StateMemory` of tensors of `(values, bytes a value)` under `config`'s moments and masters.
fn state_memory_of(tensors: &[(usize, usize)], config: &AdamWConfig, accumulating: bool) -> StateMemory {
    let mut m = StateMemory::default();
    for &(n, bytes) in tensors {
        let (n64, bytes) = (n as u64, bytes as u64);
        m.parameters += n64;
        m.weights += n64 * bytes;
        m.gradients += n64 * bytes;
        m.gradient_sum += if accumulating { n64 * 4 } else { 0 };
        m.masters += if bytes < 4 && config.masters == Masters::F32 { n64 * 4 } else { 0 };
        m.moments += match config.moments {
            MomentDtype::Q8 if n >= quant8::MIN_ELEMENTS => {
                let blocks = n.div_ceil(quant8::BLOCK) as u64;
                2 * (blocks * quant8::BLOCK as u64 + blocks * 4)
            }
            MomentDtype::Bf16 => n64 * 4,
            _ => n64 * 8,
        };
    }
    m
}

/// Each float parameter's number of values, by id (what a saved optimizer state must fit).
pub fn param_sizes<B: Backend, M: Module<B>>(model: &M) -> HashMap<ParamId, usize> {
    float_params(model).into_iter().map(|(id, n, _)| (id, n)).collect()
}

/// Sums the gradients of a step's micro-batches in f32, whatever dtype the backward pass produced them in
/// (bf16 gradients summed in bf16 would lose the small contributions of later micro-batches).
pub struct F32Accumulator<B: AutodiffBackend> {
    sum: Option<GradientsParams>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> Default for F32Accumulator<B> {
    fn default() -> Self {
        F32Accumulator { sum: None, _backend: std::marker::PhantomData }
    }
}

struct AddInF32<'a, B: AutodiffBackend> {
    sum: &'a mut GradientsParams,
    new: &'a mut GradientsParams,
    _backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for AddInF32<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(new) = self.new.remove::<B::InnerBackend, D>(param.id) else { return };
        let new = new.cast(FloatDType::F32);
        let total = match self.sum.remove::<B::InnerBackend, D>(param.id) {
            Some(old) => old + new,
            None => new,
        };
        self.sum.register(param.id, total);
    }
}

impl<B: AutodiffBackend> F32Accumulator<B> {
    /// Adds one micro-batch's gradients of `model`'s parameters.
    pub fn add<M: Module<B>>(&mut self, model: &M, mut grads: GradientsParams) {
        let sum = self.sum.get_or_insert_with(GradientsParams::new);
        model.visit(&mut AddInF32::<B> { sum, new: &mut grads, _backend: std::marker::PhantomData });
    }

    /// The summed gradients (empty when nothing was added).
    pub fn finish(self) -> GradientsParams {
        self.sum.unwrap_or_default()
    }
}

/// Each parameter's gradient, in the model's parameter order.
struct GradientsInOrder<'a, B: Backend> {
    grads: &'a GradientsParams,
    tensors: Vec<FloatTensor<B>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradientsInOrder<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            self.tensors.push(g.into_primitive().tensor());
        }
    }
}

/// Tensors from this many elements on have their squared sum taken by rows first. burn's CPU backend sums
/// a whole tensor of `1 << 22` elements or more with rayon, whose reduction tree follows the work stealing
/// of the moment: the last bits of such a sum (an embedding's gradient, say) could change from one run to
/// the next, and with them the clipping scale. Row sums are sequential, and their sum stays below it.
const ROWS_FIRST_FROM: usize = 1 << 22;

/// `Σ g²` in f32, reproducible on the CPU whatever the tensor's size (`ROWS_FIRST_FROM`).
fn squared_sum<B: Backend, const D: usize>(g: Tensor<B, D>) -> Tensor<B, 1> {
    let squares = g.cast(FloatDType::F32).powf_scalar(2.0);
    let width = squares.dims()[D - 1];
    if D > 1 && squares.shape().num_elements() >= ROWS_FIRST_FROM && width > 1 {
        squares.reshape([-1, width as i64]).sum_dim(1).sum()
    } else {
        squares.sum()
    }
}

/// `squared_sum` of a rank-erased tensor, at its own rank.
fn squared_sum_at_rank<B: Backend>(g: FloatTensor<B>) -> Tensor<B, 1> {
    fn at<B: Backend, const D: usize>(g: FloatTensor<B>) -> Tensor<B, 1> {
        squared_sum(Tensor::<B, D>::from_primitive(TensorPrimitive::Float(g)))
    }
    match g.shape().num_dims() {
        1 => at::<B, 1>(g),
        2 => at::<B, 2>(g),
        3 => at::<B, 3>(g),
        4 => at::<B, 4>(g),
        _ => {
            let len = g.shape().num_elements();
            squared_sum(Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(g, Shape::new([len])))))
        }
    }
}

/// `OptimizerOps::squared_norm` as tensor ops: each tensor's `squared_sum`, added in order. A chain of
/// one-value additions, which the fused backends compile into one kernel (`Tensor::cat` of the sums would
/// cost a slice-assign kernel per tensor).
pub fn squared_sums_in_order<B: Backend>(tensors: Vec<FloatTensor<B>>) -> Option<Tensor<B, 1>> {
    // Every sum queued before the first addition: interleaved with the reductions, each addition would be a
    // kernel of its own.
    let sums: Vec<Tensor<B, 1>> = tensors.into_iter().map(squared_sum_at_rank::<B>).collect();
    sums.into_iter().reduce(|a, b| a + b)
}

/// What AdamW's update of one parameter reads, rank-erased: the parameter as stored, its gradient, its f32
/// master (a parameter stored below f32 with masters kept), both moments in their dense dtype (f32 or bf16;
/// a moment restored from a file is flat), the weight-decay multiplier (`1 − lr·wd` for matrices, 1 for
/// vectors), and for a parameter below f32 without a master the key of its rounding noise
/// (`rounding::noise_key`): the update is then rounded into it stochastically.
pub struct AdamWSlot<B: Backend> {
    pub param: FloatTensor<B>,
    pub grad: FloatTensor<B>,
    pub master: Option<FloatTensor<B>>,
    pub m: FloatTensor<B>,
    pub v: FloatTensor<B>,
    pub decay: f32,
    pub noise_key: Option<u32>,
}

/// What it writes: the parameter in its own dtype and shape, the master and the moments.
pub struct AdamWUpdated<B: Backend> {
    pub param: FloatTensor<B>,
    pub master: Option<FloatTensor<B>>,
    pub m: FloatTensor<B>,
    pub v: FloatTensor<B>,
}

/// A step's AdamW constants in f32, each computed in f64 as the tensor ops' scalars are.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    pub beta1: f32,
    pub beta2: f32,
    pub one_minus_beta1: f32,
    pub one_minus_beta2: f32,
    /// `lr / (1 − β1^t)`.
    pub step_size: f32,
    /// `sqrt(1 − β2^t)`.
    pub bias2_root: f32,
    pub eps: f32,
}

impl AdamWScalars {
    /// The constants of optimizer step `t` (from 1) at rate `lr`.
    pub fn new(config: &AdamWConfig, lr: f64, t: i32) -> Self {
        AdamWScalars {
            beta1: config.beta1 as f32,
            beta2: config.beta2 as f32,
            one_minus_beta1: (1.0 - config.beta1) as f32,
            one_minus_beta2: (1.0 - config.beta2) as f32,
            step_size: (lr / (1.0 - config.beta1.powi(t))) as f32,
            bias2_root: (1.0 - config.beta2.powi(t)).sqrt() as f32,
            eps: config.eps as f32,
        }
    }
}

/// The optimizer's work on a backend: the gradients' squared norm and AdamW's update.
pub trait OptimizerOps: Backend {
    /// `Σ x²` over every value of `tensors` (any float dtypes) in f32, `[1]`; `None` for no tensors. The
    /// tensor ops of `squared_sums_in_order` by default; the CubeCL backends read every gradient in a few
    /// kernel launches (`kernels::grad_norm`) unless `KILN_OPTIM_KERNEL=off`.
    fn squared_norm(tensors: Vec<FloatTensor<Self>>) -> Option<Tensor<Self, 1>> {
        squared_sums_in_order(tensors)
    }

    /// AdamW's update of every slot together, in their order, with the gradients scaled by `clip` (`[1]`,
    /// f32) when clipping. `Err` gives the slots back, to be updated one by one as tensor ops: the default;
    /// the CubeCL backends update them in a few kernel launches (`kernels::adamw`) unless
    /// `KILN_OPTIM_KERNEL=off`.
    fn adamw_update(
        slots: Vec<AdamWSlot<Self>>,
        _clip: Option<FloatTensor<Self>>,
        _scalars: AdamWScalars,
    ) -> Result<Vec<AdamWUpdated<Self>>, Vec<AdamWSlot<Self>>> {
        Err(slots)
    }
}

/// `Σ g²` over every gradient of `model`'s parameters, on the device (`OptimizerOps`). `None` without
/// gradients.
pub fn squared_norm<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    grads: &GradientsParams,
) -> Option<Tensor<B::InnerBackend, 1>>
where
    B::InnerBackend: OptimizerOps,
{
    let mut visitor = GradientsInOrder::<B::InnerBackend> { grads, tensors: Vec::new() };
    model.visit(&mut visitor);
    B::InnerBackend::squared_norm(visitor.tensors)
}

/// One-element tensors read back to the host in a single transfer, as f32 (not the backend's default
/// element, which is bf16 on the CUDA bf16 backend and would round them).
pub fn read_scalars<B: Backend>(scalars: Vec<Tensor<B, 1>>) -> Vec<f32> {
    if scalars.is_empty() {
        return Vec::new();
    }
    let n = scalars.len();
    let all = Tensor::cat(scalars.into_iter().map(|t| t.cast(FloatDType::F32)).collect(), 0);
    all.into_data().convert::<f32>().to_vec::<f32>().unwrap_or_else(|_| vec![f32::NAN; n])
}

/// The gradient multiplier of global-norm clipping to `max_norm`: `min(1, max_norm / (‖g‖ + 1e-6))` in f32,
/// as `torch.nn.utils.clip_grad_norm_` computes it, from `squared_norm`. It stays on the device, so the update
/// is queued behind the backward pass instead of waiting for the norm to be read back (the device would idle
/// while the host then queued the optimizer's ops). Shaped `[1; rank]` for each parameter rank up front: a
/// reshape among a parameter's update ops would end the fused backends' element-wise kernel there.
pub struct ClipScale<B: Backend> {
    by_rank: [B::FloatTensorPrimitive; 4],
}

impl<B: Backend> ClipScale<B> {
    pub fn new(squared_norm: Tensor<B, 1>, max_norm: f64) -> Self {
        let scale = ((squared_norm.sqrt() + 1e-6).recip() * max_norm).clamp_max(1.0);
        let by_rank = [
            primitive(scale.clone()),
            primitive(scale.clone().reshape([1, 1])),
            primitive(scale.clone().reshape([1, 1, 1])),
            primitive(scale.reshape([1, 1, 1, 1])),
        ];
        ClipScale { by_rank }
    }

    /// The multiplier as a `[1; D]` tensor.
    fn shaped<const D: usize>(&self) -> Tensor<B, D> {
        match self.by_rank.get(D.wrapping_sub(1)) {
            Some(t) => Tensor::from_primitive(TensorPrimitive::Float(t.clone())),
            None => Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(self.by_rank[0].clone())).reshape([1; D]),
        }
    }
}

/// Parameters one chunk of the backend's AdamW update takes at most, and values (a larger parameter is a
/// chunk of its own). A chunk's new parameters are allocated before the old ones are released (the model
/// holds them until the chunk's results replace them), so the chunk bounds what the update adds to the memory
/// in use: 512 MiB of bf16 parameters, where one update of all of them would add a whole model's copy.
const CHUNK_PARAMS: usize = 32;
const CHUNK_VALUES: usize = 1 << 28;

/// The next chunk of parameters for the backend's AdamW update (`OptimizerOps::adamw_update`), with their
/// states: in the model's order, not updated yet this step, with dense moments (8-bit ones stay with the
/// tensor ops of `Step`), all of the first one's parameter and gradient dtypes.
struct Gather<'a, B: AutodiffBackend> {
    opt: &'a mut AdamW<B::InnerBackend>,
    grads: &'a GradientsParams,
    /// `1 − lr·wd` in f32, for matrices.
    decay: f32,
    /// The optimizer step being taken (from 1), for the rounding noise's keys.
    step: usize,
    /// Float parameters visited so far (`Step::ordinal`).
    ordinal: usize,
    done: &'a HashSet<ParamId>,
    dtypes: Option<(DType, DType)>,
    values: usize,
    ids: Vec<ParamId>,
    slots: Vec<AdamWSlot<B::InnerBackend>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let ordinal = self.ordinal;
        self.ordinal += 1;
        if self.slots.len() == CHUNK_PARAMS || self.done.contains(&param.id) {
            return;
        }
        let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) else { return };
        let tensor = param.val().inner();
        let len = tensor.shape().num_elements();
        let moments = self.opt.config.moments;
        let dtypes = (tensor.dtype(), grad.dtype());
        if (moments == MomentDtype::Q8 && len >= quant8::MIN_ELEMENTS)
            || self.dtypes.is_some_and(|d| d != dtypes)
            || (!self.slots.is_empty() && self.values + len > CHUNK_VALUES)
        {
            return;
        }
        let keeps_master = self.opt.config.keeps_master(tensor.dtype());
        let (m, v, master) = match self.opt.states.remove(&param.id) {
            // A master restored into a run without masters takes one more update, as tensor ops (`Step`).
            Some(ParamState { m: Moment::Dense(m), v: Moment::Dense(v), master })
                if keeps_master || master.is_none() =>
            {
                (m, v, master)
            }
            Some(state) => {
                self.opt.states.insert(param.id, state);
                return;
            }
            None => {
                let zeros =
                    || primitive(zeros_in::<B::InnerBackend, D>(tensor.dims(), moments.dense(), &tensor.device()));
                (zeros(), zeros(), None)
            }
        };
        // A state saved without masters, restored into a run with them, gets its master here.
        let master = master.or_else(|| keeps_master.then(|| primitive(tensor.clone().cast(FloatDType::F32))));
        let decay = if D > 1 { self.decay } else { 1.0 };
        let noise_key =
            (master.is_none() && tensor.dtype() != DType::F32).then(|| rounding::noise_key(self.step, ordinal));
        self.dtypes = Some(dtypes);
        self.values += len;
        self.ids.push(param.id);
        self.slots.push(AdamWSlot { param: primitive(tensor), grad: primitive(grad), master, m, v, decay, noise_key });
    }
}

/// Puts the backend's updated parameters into the model.
struct Replace<B: Backend> {
    updated: HashMap<ParamId, FloatTensor<B>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Replace<B::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(updated) = self.updated.remove(&id) else { return Param::from_mapped_value(id, tensor, mapper) };
        let out = Tensor::from_inner(Tensor::from_primitive(TensorPrimitive::Float(updated)));
        let out = if tensor.is_require_grad() { out.require_grad() } else { out };
        Param::from_mapped_value(id, out, mapper)
    }
}

/// AdamW as tensor ops, one parameter at a time, for the parameters not in `done`.
struct Step<'a, B: AutodiffBackend> {
    opt: &'a mut AdamW<B::InnerBackend>,
    grads: &'a GradientsParams,
    lr: f64,
    /// Gradient multiplier from global-norm clipping (none when not clipping).
    scale: Option<&'a ClipScale<B::InnerBackend>>,
    /// Parameters the backend has updated already (`OptimizerOps::adamw_update`).
    done: &'a HashSet<ParamId>,
    /// Float parameters visited so far: the place in the model that keys a parameter's rounding noise.
    ordinal: usize,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Step<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let ordinal = self.ordinal;
        self.ordinal += 1;
        let grad = self.grads.get::<B::InnerBackend, D>(id).filter(|_| !self.done.contains(&id));
        let Some(grad) = grad else { return Param::from_mapped_value(id, tensor, mapper) };
        let require_grad = tensor.is_require_grad();
        let shape = tensor.dims();
        let c = self.opt.config;
        let t = (self.opt.steps + 1) as i32;
        let param = tensor.inner();
        let param_dtype = FloatDType::from(param.dtype());
        let g = grad.cast(FloatDType::F32);
        let g = match self.scale {
            Some(scale) => g * scale.shaped::<D>(),
            None => g,
        };
        let keeps_master = c.keeps_master(param.dtype());
        let device = param.device();
        let state = self.opt.states.remove(&id).unwrap_or_else(|| {
            let zeros = || Moment::Dense(primitive(zeros_in::<B::InnerBackend, D>(shape, FloatDType::F32, &device)));
            let master = keeps_master.then(|| primitive(param.clone().cast(FloatDType::F32)));
            ParamState { m: zeros(), v: zeros(), master }
        });
        // The update runs on the f32 master when there is one (a state restored from a run with masters has
        // one at its first step, whatever `masters` says now), else on the parameter in f32.
        let mut p = match state.master {
            Some(master) => shaped(master, shape),
            None if param_dtype == FloatDType::F32 => param,
            None => param.cast(FloatDType::F32),
        };
        if D > 1 && c.weight_decay != 0.0 {
            p = p * (1.0 - self.lr * c.weight_decay);
        }
        let m = state.m.into_f32(shape, Map::Signed) * c.beta1 + g.clone() * (1.0 - c.beta1);
        let v = state.v.into_f32(shape, Map::Unsigned) * c.beta2 + g.powf_scalar(2.0) * (1.0 - c.beta2);
        let bias1 = 1.0 - c.beta1.powi(t);
        let bias2 = 1.0 - c.beta2.powi(t);
        let denom = v.clone().sqrt() / bias2.sqrt() + c.eps;
        let p = p - m.clone() / denom * (self.lr / bias1);
        let master = keeps_master.then(|| primitive(p.clone()));
        let state = ParamState {
            m: Moment::store(m, c.moments, Map::Signed),
            v: Moment::store(v, c.moments, Map::Unsigned),
            master,
        };
        self.opt.states.insert(id, state);
        let p = if keeps_master || param_dtype == FloatDType::F32 {
            p.cast(param_dtype)
        } else {
            let noise = rounding::noise::<B::InnerBackend, D>(shape, rounding::noise_key(t as usize, ordinal), &device);
            rounding::stochastic_round(p, param_dtype, noise)
        };
        let mut out = Tensor::from_inner(p);
        if require_grad {
            out = out.require_grad();
        }
        Param::from_mapped_value(id, out, mapper)
    }
}

/// One optimizer step: clips to `max_norm` (if any) by the global norm, applies AdamW at `lr`, and
/// returns the updated model and the pre-clipping gradient norm (read back after the update is queued).
pub fn step<B: AutodiffBackend, M: Module<B>>(
    model: M,
    opt: &mut AdamW<B::InnerBackend>,
    grads: &GradientsParams,
    lr: f64,
    max_norm: Option<f64>,
) -> (M, f64)
where
    B::InnerBackend: OptimizerOps,
{
    let squared = squared_norm::<B, M>(&model, grads);
    let scale = max_norm.zip(squared.clone()).map(|(max, squared)| ClipScale::new(squared, max));
    let model = step_scaled(model, opt, grads, lr, scale.as_ref());
    let norm =
        squared.map_or(0.0, |squared| read_scalars(vec![squared]).first().map_or(f64::NAN, |&s| f64::from(s).sqrt()));
    (model, norm)
}

/// `step` with the clipping multiplier already on the device (`ClipScale`), or none: the parameters with
/// dense moments go to the backend's update of many at once (`OptimizerOps::adamw_update`), a chunk at a
/// time (`Gather`); what it gives back, and 8-bit moments, are updated one by one as tensor ops (`Step`).
pub fn step_scaled<B: AutodiffBackend, M: Module<B>>(
    mut model: M,
    opt: &mut AdamW<B::InnerBackend>,
    grads: &GradientsParams,
    lr: f64,
    scale: Option<&ClipScale<B::InnerBackend>>,
) -> M
where
    B::InnerBackend: OptimizerOps,
{
    let c = opt.config;
    let decay = if c.weight_decay != 0.0 { (1.0 - lr * c.weight_decay) as f32 } else { 1.0 };
    let step_number = opt.steps + 1;
    let scalars = AdamWScalars::new(&c, lr, step_number as i32);
    let mut done = HashSet::new();
    loop {
        let mut gather = Gather::<B> {
            opt,
            grads,
            decay,
            step: step_number,
            ordinal: 0,
            done: &done,
            dtypes: None,
            values: 0,
            ids: Vec::new(),
            slots: Vec::new(),
        };
        model.visit(&mut gather);
        let Gather { ids, slots, .. } = gather;
        if slots.is_empty() {
            break;
        }
        let clip = scale.map(|s| s.by_rank[0].clone());
        match <B::InnerBackend as OptimizerOps>::adamw_update(slots, clip, scalars) {
            Ok(results) => {
                let mut updated = HashMap::new();
                for (id, u) in ids.into_iter().zip(results) {
                    opt.states
                        .insert(id, ParamState { m: Moment::Dense(u.m), v: Moment::Dense(u.v), master: u.master });
                    updated.insert(id, u.param);
                    done.insert(id);
                }
                model = model.map(&mut Replace { updated });
            }
            Err(slots) => {
                for (id, s) in ids.into_iter().zip(slots) {
                    opt.states
                        .insert(id, ParamState { m: Moment::Dense(s.m), v: Moment::Dense(s.v), master: s.master });
                }
                break;
            }
        }
    }
    let mut mapper = Step::<B> { opt, grads, lr, scale, done: &done, ordinal: 0 };
    let model = model.map(&mut mapper);
    mapper.opt.steps += 1;
    model
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Cpu, CpuTrain};
    use crate::testing::{normal, values};

    /// The memory table of docs/TRAINING.md, per parameter: 16 B in f32; 16 B in bf16 (20 accumulating);
    /// 12 (16) with bf16 moments; 10.03 (14.03) with 8-bit moments, whose small tensors keep f32 moments;
    /// 4 B less for bf16 parameters without masters (8 B with bf16 moments, PyTorch's plain bf16 AdamW).
    #[test]
    fn state_memory_follows_the_table() {
        let memory = |tensors: &[(usize, usize)], moments, masters, accumulating| {
            state_memory_of(tensors, &AdamWConfig { moments, masters, ..AdamWConfig::default() }, accumulating)
        };
        let per_value_of = |bytes, moments, masters, accumulating| {
            let m = memory(&[(1 << 24, bytes)], moments, masters, accumulating);
            assert_eq!(m.parameters, 1 << 24);
            m.total() as f64 / (1u64 << 24) as f64
        };
        let per_value = |bytes, moments, accumulating| per_value_of(bytes, moments, Masters::F32, accumulating);
        assert_eq!(per_value_of(2, MomentDtype::Bf16, Masters::Stochastic, false), 8.0);
        assert_eq!(per_value_of(2, MomentDtype::F32, Masters::Stochastic, true), 16.0);
        assert_eq!(per_value_of(4, MomentDtype::F32, Masters::Stochastic, false), 16.0, "f32 parameters have none");
        assert_eq!(per_value(4, MomentDtype::F32, false), 16.0);
        assert_eq!(per_value(2, MomentDtype::F32, false), 16.0);
        assert_eq!(per_value(2, MomentDtype::F32, true), 20.0);
        assert_eq!(per_value(2, MomentDtype::Bf16, true), 16.0);
        assert_eq!((per_value(2, MomentDtype::Q8, false), per_value(2, MomentDtype::Q8, true)), (10.03125, 14.03125));
        let small = memory(&[(4095, 2), (4096, 2)], MomentDtype::Q8, Masters::F32, false);
        assert_eq!(small.moments, 4095 * 8 + 2 * (4096 + 16 * 4));
        assert_eq!(small.masters, 8191 * 4);
        assert!(small.summary().contains("0.0 M parameters") && small.summary().ends_with("before activations"));
    }

    /// A state larger than the device is an error before the first step, naming the moment storage that
    /// would fit: 8,192 bf16 values need 16 B each with f32 moments, 12 with bf16, 8 + 16,640 B with 8-bit.
    #[test]
    fn a_state_larger_than_the_device_is_refused_with_what_would_fit() {
        let device = Default::default();
        let weight = Param::from_tensor(normal::<Cpu, 2>([128, 64], 0.0, 1.0, 1, &device).cast(FloatDType::BF16));
        let f32_moments = AdamWConfig::default();
        let fits = |bytes| state_memory_on_device(&weight, &f32_moments, false, bytes);
        assert_eq!(fits(None).unwrap().total(), 131_072);
        assert_eq!(fits(Some(131_072)).unwrap().total(), 131_072);
        let err = fits(Some(100_000)).unwrap_err();
        assert!(err.contains("need 0.0 GiB before any activation"), "{err}");
        assert!(err.ends_with("`[train.adamw] moments = \"bf16\"` or `--moments bf16`)"), "{err}");
        assert!(fits(Some(90_000)).unwrap_err().contains("AdamW moments in q8 need"));
        // 6 B a value and the blocks' scales without masters: 49,408 B.
        let err = fits(Some(50_000)).unwrap_err();
        assert!(
            err.ends_with("moments = \"q8\", masters = \"stochastic\"` or `--moments q8 --masters stochastic`)"),
            "{err}"
        );
        let stochastic = AdamWConfig { masters: Masters::Stochastic, ..AdamWConfig::default() };
        let err = state_memory_on_device(&weight, &stochastic, false, Some(90_000)).unwrap_err();
        assert!(err.contains("AdamW moments in bf16 need 0.0 GiB"), "{err}");
        assert!(
            fits(Some(40_000))
                .unwrap_err()
                .ends_with("no moment or master storage fits: this model needs a device with more memory")
        );
        let q8 = AdamWConfig { moments: MomentDtype::Q8, ..AdamWConfig::default() };
        assert_eq!(state_memory_on_device(&weight, &q8, false, Some(90_000)).unwrap().total(), 8 * 8192 + 16_640);
    }

    /// A state exported after a step restores to the same next step, in every moment dtype; a state whose
    /// tensors do not fit the parameter is refused, naming the tensor.
    #[test]
    fn a_saved_state_restores_exactly_and_a_misfit_one_is_refused() {
        let device = Default::default();
        let param = || Param::from_tensor(normal::<CpuTrain, 2>([64, 80], 0.0, 1.0, 1, &device));
        let grads = |p: &Param<Tensor<CpuTrain, 2>>, seed| {
            let mut grads = GradientsParams::new();
            grads.register(p.id, normal::<Cpu, 2>([64, 80], 0.0, 1.0, seed, &device));
            grads
        };
        for moments in [MomentDtype::F32, MomentDtype::Bf16, MomentDtype::Q8] {
            let config = AdamWConfig { moments, ..AdamWConfig::default() };
            let mut opt = AdamW::<Cpu>::new(config);
            let p = param();
            let p = step::<CpuTrain, _>(p.clone(), &mut opt, &grads(&p, 2), 1e-2, None).0;
            let names = HashMap::from([(p.id, "w".to_string())]);
            let saved: HashMap<String, HostTensor> = opt.export_state(&names).unwrap().into_iter().collect();
            let eight_bit = saved.contains_key("w.m.q8") && saved.contains_key("w.v.absmax");
            assert_eq!(eight_bit, moments == MomentDtype::Q8, "{moments:?}: {:?}", saved.keys());
            let mut restored = AdamW::<Cpu>::new(config);
            restored.steps = opt.steps;
            restored.import_state(&HashMap::from([(p.id, ("w".to_string(), 5120))]), &saved, &device).unwrap();
            let next =
                |opt: &mut AdamW<Cpu>| values(step::<CpuTrain, _>(p.clone(), opt, &grads(&p, 3), 1e-2, None).0.val());
            assert_eq!(next(&mut opt), next(&mut restored), "{moments:?}: the restored state steps differently");
            let err = AdamW::<Cpu>::new(config)
                .import_state(&HashMap::from([(p.id, ("w".to_string(), 4000))]), &saved, &device)
                .unwrap_err();
            let want = if eight_bit {
                "w.m: 20 blocks saved for a parameter of 4000 values"
            } else {
                "w.m: 5120 values saved for a parameter of 4000"
            };
            assert!(err.contains(want), "{moments:?}: {err}");
        }
    }

    /// Without masters a bf16 parameter takes the f32 update of its own value, rounded stochastically: every
    /// value lands on one of the two bf16 values around the f32 result (computed here from the same bf16
    /// start with f32 masters, whose first step is that f32 result), no master is kept or saved, the same
    /// step rounds alike every time (a resumed run, a replica), and a state saved with masters restores into a
    /// run without them, its masters taking the next update and then dropped.
    #[test]
    fn without_masters_bf16_parameters_take_the_f32_update_rounded_stochastically() {
        let device = Default::default();
        let start = normal::<Cpu, 2>([64, 80], 0.0, 1.0, 1, &device).cast(FloatDType::BF16);
        let param = || Param::from_tensor(Tensor::<CpuTrain, 2>::from_inner(start.clone()));
        let grads = |p: &Param<Tensor<CpuTrain, 2>>, seed| {
            let mut grads = GradientsParams::new();
            grads.register(p.id, normal::<Cpu, 2>([64, 80], 0.0, 1.0, seed, &device).cast(FloatDType::BF16));
            grads
        };
        let stochastic = AdamWConfig { masters: Masters::Stochastic, ..AdamWConfig::default() };
        let names = |p: &Param<Tensor<CpuTrain, 2>>| HashMap::from([(p.id, "w".to_string())]);

        let p = param();
        let mut with_masters = AdamW::<Cpu>::new(AdamWConfig::default());
        step::<CpuTrain, _>(p.clone(), &mut with_masters, &grads(&p, 2), 1e-3, None);
        let exact =
            with_masters.export_state(&names(&p)).unwrap().into_iter().find(|(k, _)| k == "w.master").unwrap().1;

        let mut opt = AdamW::<Cpu>::new(stochastic);
        let rounded = values(step::<CpuTrain, _>(p.clone(), &mut opt, &grads(&p, 2), 1e-3, None).0.val());
        let bf16 = |x: f32| half::bf16::from_f32(x).to_f32();
        let (mut moved_up, mut moved_down) = (0, 0);
        for (&got, &x) in rounded.iter().zip(&exact.data) {
            let nearest = bf16(x);
            let ulp = (bf16(nearest.abs() * (1.0 + 2f32.powi(-7))) - nearest.abs()).max(f32::MIN_POSITIVE);
            assert!((got - x).abs() <= ulp, "{got} is not a bf16 neighbour of {x}");
            moved_up += usize::from(got > x);
            moved_down += usize::from(got < x);
        }
        assert!(moved_up > 1000 && moved_down > 1000, "{moved_up} up, {moved_down} down");
        let saved = opt.export_state(&names(&p)).unwrap();
        assert!(
            saved.iter().all(|(k, _)| !k.ends_with(".master")),
            "{:?}",
            saved.iter().map(|(k, _)| k).collect::<Vec<_>>()
        );
        let mut again = AdamW::<Cpu>::new(stochastic);
        assert_eq!(values(step::<CpuTrain, _>(p.clone(), &mut again, &grads(&p, 2), 1e-3, None).0.val()), rounded);

        // A state with masters, restored without them: the master's value takes the second update.
        let saved: HashMap<String, HostTensor> = with_masters.export_state(&names(&p)).unwrap().into_iter().collect();
        let mut switched = AdamW::<Cpu>::new(stochastic);
        switched.steps = with_masters.steps;
        switched.import_state(&HashMap::from([(p.id, ("w".to_string(), 5120))]), &saved, &device).unwrap();
        let next = step::<CpuTrain, _>(p.clone(), &mut switched, &grads(&p, 3), 1e-3, None).0;
        step::<CpuTrain, _>(p.clone(), &mut with_masters, &grads(&p, 3), 1e-3, None);
        let exact =
            with_masters.export_state(&names(&p)).unwrap().into_iter().find(|(k, _)| k == "w.master").unwrap().1;
        let off: f32 = values(next.val())
            .iter()
            .zip(&exact.data)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
            .fold(0.0, f32::max);
        assert!(off <= 2f32.powi(-7), "{off}");
        assert!(switched.export_state(&names(&p)).unwrap().iter().all(|(k, _)| !k.ends_with(".master")));
    }

    #[test]
    fn a_large_gradients_squared_sum_is_exact_to_f32_and_the_same_every_time() {
        // 2,048 × 2,049 elements: over the size from which burn's CPU backend sums a whole tensor in parallel.
        let g = normal::<Cpu, 2>([2048, 2049], 0.0, 1.0, 7, &Default::default());
        let exact: f64 = values(g.clone()).iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let sums: Vec<f32> = (0..8).map(|_| values(squared_sum(g.clone()))[0]).collect();
        assert!(((f64::from(sums[0]) - exact) / exact).abs() < 1e-6, "{} vs {exact}", sums[0]);
        assert!(sums.iter().all(|s| s.to_bits() == sums[0].to_bits()), "{sums:?}");
        // A small one is summed whole, and a vector too.
        let small = normal::<Cpu, 2>([3, 5], 0.0, 1.0, 8, &Default::default());
        let whole: f32 = values(small.clone()).iter().map(|x| x * x).sum();
        assert!((values(squared_sum(small))[0] - whole).abs() < 1e-5);
        let vector = normal::<Cpu, 1>([10], 0.0, 1.0, 9, &Default::default());
        let whole: f32 = values(vector.clone()).iter().map(|x| x * x).sum();
        assert!((values(squared_sum(vector))[0] - whole).abs() < 1e-5);
    }
}
