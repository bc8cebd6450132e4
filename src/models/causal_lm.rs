//! One handle over the architectures for the stages that do not care which one they run: loading by
//! `model_type`, seeded random init, the forward pass, decoding (greedy or sampled), checkpoint names, and
//! export of a trained model as an HF directory (text weights from the model, other towers carried from the
//! source).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use std::collections::HashSet;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, FloatDType, Int, Tensor};

use super::config::{ModelConfig, outside_text_tower};
use super::decode::{CachedDecoding, DecodeCache, Gemma4DecodeCache, QwenDecodeCache, generate, generate_greedy};
use super::gemma4::Gemma4Model;
use super::hf::{ExportDtype, HfEntry, HfNamed, StreamedTensor, export_streamed, streamed_hf_tensors};
use super::layers::{head_logits, soft_cap};
use super::lfm2::Lfm2Model;
use super::qwen3_5::Qwen35Model;
use super::routing::ExpertLoad;
use super::sampling::TokenPicker;
use super::weights::{
    HostTensor, Init, RandomInit, TensorSource, WeightStore, gemma4_init, kept_in_f32, lfm2_init, qwen3_5_init,
};
use super::{ModelBackend, ModelError, SequenceLayout};

#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum CausalLm<B: Backend> {
    Lfm2(Lfm2Model<B>),
    Qwen35(Qwen35Model<B>),
    Gemma4(Gemma4Model<B>),
}

impl<B: Backend> CausalLm<B> {
    pub fn from_source(config: &ModelConfig, store: &dyn TensorSource, device: &B::Device) -> Result<Self, ModelError> {
        Ok(match config {
            ModelConfig::Lfm2(c) => CausalLm::Lfm2(Lfm2Model::from_source(c, store, device)?),
            ModelConfig::Qwen35(c) => CausalLm::Qwen35(Qwen35Model::from_source(c, store, device)?),
            ModelConfig::Gemma4(c) => CausalLm::Gemma4(Gemma4Model::from_source(c, store, device)?),
        })
    }

    /// The output projection `[vocab, hidden]`.
    pub fn head_weight(&self) -> Tensor<B, 2> {
        match self {
            CausalLm::Lfm2(m) => m.head_weight(),
            CausalLm::Qwen35(m) => m.head_weight(),
            CausalLm::Gemma4(m) => m.head_weight(),
        }
    }

    /// The MoE expert bias moved `rate` toward an even load from the step's `load`
    /// (`routing::bias_steps`); other models are returned as they are.
    pub fn shift_expert_bias(self, load: &ExpertLoad, rate: f64) -> Self {
        match self {
            CausalLm::Lfm2(m) => CausalLm::Lfm2(m.shift_expert_bias(load, rate)),
            other => other,
        }
    }

    /// The cap `c` of the logits' soft-cap `c·tanh(logits/c)` (Gemma 4), applied wherever logits are made:
    /// the forward pass, decoding and the training loss.
    pub fn logit_softcap(&self) -> Option<f64> {
        match self {
            CausalLm::Lfm2(_) | CausalLm::Qwen35(_) => None,
            CausalLm::Gemma4(m) => m.final_logit_softcapping,
        }
    }

    /// Checkpoint tensors that are not parameters but belong to the model (Gemma 4's `layer_scalar`
    /// buffers), with their values: exports write them beside the parameters.
    pub fn buffers(&self) -> BTreeMap<String, HostTensor> {
        match self {
            CausalLm::Lfm2(_) | CausalLm::Qwen35(_) => BTreeMap::new(),
            CausalLm::Gemma4(m) => m.buffers(),
        }
    }

    /// The model with its parameters stored in `dtype` (the compute dtype: activations and gradients follow
    /// it), except the tensors `weights::kept_in_f32` names, which stay f32 as in the released checkpoints.
    /// Parameters stay leaves of the autodiff graph.
    pub fn cast_params(self, dtype: FloatDType) -> Self {
        let keep: HashSet<ParamId> =
            self.hf_entries().into_iter().filter(|e| kept_in_f32(&e.key)).map(|e| e.id).collect();
        self.map(&mut CastParams { dtype, keep })
    }

    /// A copy of the model on `device`, its parameters read back to the host and written there. burn-cubecl
    /// moves a tensor between devices over NCCL, which a machine may lack (and Vulkan has no such path); a
    /// model copied once for another device's decoding is not worth that dependency.
    pub fn copied_to(&self, device: &B::Device) -> Self {
        self.clone().map(&mut ThroughHost { device })
    }

    /// Whether a checkpoint tensor belongs to a tower this model does not hold (Qwen3.5's vision tower and
    /// multi-token-prediction head, Gemma 4's vision and audio towers) or is one it never reads (the K/V
    /// weights of Gemma 4's KV-sharing layers): exports carry such tensors from the source unchanged.
    pub fn is_carried(&self, key: &str) -> bool {
        match self {
            CausalLm::Lfm2(_) => false,
            CausalLm::Qwen35(m) => outside_text_tower(&m.text_prefix, key),
            CausalLm::Gemma4(m) => outside_text_tower(&m.text_prefix, key) || m.is_unused_kv(key),
        }
    }

    /// Writes the model as an HF directory: its tensors in `dtype` (f32 where `weights::kept_in_f32`), the
    /// other towers' tensors and the companion files (config, tokenizer, template) from `source_dir`. Each
    /// tensor is copied from the device (or read from the source) only when the writer reaches it, so the
    /// host holds about one tensor at a time, not the model.
    pub fn export(
        &self,
        source_dir: &Path,
        out_dir: &Path,
        dtype: ExportDtype,
        shard_bytes: usize,
    ) -> Result<Vec<PathBuf>, ModelError> {
        let dtype_of = |key: &str, _: DType| if kept_in_f32(key) { ExportDtype::F32 } else { dtype };
        self.export_with(source_dir, out_dir, &dtype_of, shard_bytes)
    }

    /// `export` with every tensor in the dtype it has on the device: bf16 parameters as bf16, the rest
    /// (f32 ones, f16 ones, buffers) in f32, so the checkpoint reloads to the same values, in half the bytes
    /// for bf16 parameters: how a training state keeps the weights.
    pub fn export_exact(&self, source_dir: &Path, out_dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
        let dtype_of = |_: &str, d: DType| if d == DType::BF16 { ExportDtype::Bf16 } else { ExportDtype::F32 };
        self.export_with(source_dir, out_dir, &dtype_of, usize::MAX)
    }

    /// `export` with each tensor in the dtype `dtype_of` gives its name and its dtype on the device (a
    /// buffer's is f32).
    fn export_with(
        &self,
        source_dir: &Path,
        out_dir: &Path,
        dtype_of: &dyn Fn(&str, DType) -> ExportDtype,
        shard_bytes: usize,
    ) -> Result<Vec<PathBuf>, ModelError> {
        let source = self.carried_source(source_dir)?;
        let buffers = self.buffers();
        let mut tensors = streamed_hf_tensors(self, dtype_of);
        for (key, t) in &buffers {
            tensors.push((key.clone(), StreamedTensor::encoded(t, dtype_of(key, DType::F32))));
        }
        if let Some(store) = &source {
            for key in store.keys().filter(|k| self.is_carried(k)) {
                let (Some(dtype), Some(shape)) = (store.dtype(key), store.shape(key)) else { continue };
                let bytes = move || store.raw(key).map(|t| t.bytes).map_err(|e| e.to_string());
                tensors.push((key.clone(), StreamedTensor::new(dtype, shape.to_vec(), bytes)));
            }
        }
        export_streamed(tensors, source_dir, out_dir, shard_bytes)
    }

    /// The source checkpoint, where it may hold tensors that `is_carried` names (not for LFM2, nor a source
    /// without weights, as a config-only directory for a random init).
    fn carried_source(&self, source_dir: &Path) -> Result<Option<WeightStore>, ModelError> {
        let has_weights =
            ["model.safetensors", "model.safetensors.index.json"].iter().any(|f| source_dir.join(f).is_file());
        if !has_weights || matches!(self, CausalLm::Lfm2(_)) {
            return Ok(None);
        }
        WeightStore::open(source_dir).map(Some)
    }
}

/// The decoding state of whichever architecture a `CausalLm` holds.
#[derive(Clone)]
pub enum CausalLmCache<B: Backend> {
    Lfm2(DecodeCache<B>),
    Qwen35(QwenDecodeCache<B>),
    Gemma4(Gemma4DecodeCache<B>),
}

impl<B: ModelBackend> CachedDecoding<B> for CausalLm<B> {
    type Cache = CausalLmCache<B>;

    fn new_cache(&self, batch: usize, device: &B::Device) -> CausalLmCache<B> {
        match self {
            CausalLm::Lfm2(m) => CausalLmCache::Lfm2(m.new_cache(batch, device)),
            CausalLm::Qwen35(m) => CausalLmCache::Qwen35(m.new_cache(batch, device)),
            CausalLm::Gemma4(m) => CausalLmCache::Gemma4(m.new_cache(batch, device)),
        }
    }

    fn hidden_cached(&self, ids: Tensor<B, 2, Int>, valid: &[Vec<bool>], cache: &mut CausalLmCache<B>) -> Tensor<B, 3> {
        match (self, cache) {
            (CausalLm::Lfm2(m), CausalLmCache::Lfm2(c)) => m.hidden_cached(ids, valid, c),
            (CausalLm::Qwen35(m), CausalLmCache::Qwen35(c)) => m.hidden_cached(ids, valid, c),
            (CausalLm::Gemma4(m), CausalLmCache::Gemma4(c)) => m.hidden_cached(ids, valid, c),
            _ => unreachable!("a cache comes from its own model's new_cache"),
        }
    }

    fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        soft_cap(head_logits(hidden, self.head_weight()), self.logit_softcap())
    }
}

impl<B: ModelBackend> CausalLm<B> {
    /// Greedy decoding with the architecture's cache (see `decode::generate_greedy`).
    pub fn generate_greedy(
        &self,
        prompts: &[Vec<u32>],
        max_tokens: usize,
        stop: &[u32],
        device: &B::Device,
    ) -> Vec<Vec<u32>> {
        generate_greedy(self, prompts, max_tokens, stop, device)
    }

    /// Decoding with `picker`'s settings, each token told to `on_token(row, id)` as it is chosen, which says
    /// whether to go on (see `decode::generate`).
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        max_tokens: usize,
        stop: &[u32],
        picker: &mut TokenPicker,
        on_token: impl FnMut(usize, u32) -> bool,
        device: &B::Device,
    ) -> Vec<Vec<u32>> {
        generate(self, prompts, max_tokens, stop, picker, on_token, device)
    }

    /// The final normalized hidden states `[batch, seq, hidden]`.
    pub fn forward_hidden(&self, ids: Tensor<B, 2, Int>, layout: &SequenceLayout) -> Tensor<B, 3> {
        match self {
            CausalLm::Lfm2(m) => m.forward_hidden(ids, layout),
            CausalLm::Qwen35(m) => m.forward_hidden(ids, layout),
            CausalLm::Gemma4(m) => m.forward_hidden(ids, layout),
        }
    }

    /// Logits `[batch, seq, vocab]` (soft-capped where the architecture caps them).
    pub fn forward(&self, ids: Tensor<B, 2, Int>, layout: &SequenceLayout) -> Tensor<B, 3> {
        self.logits(self.forward_hidden(ids, layout))
    }
}

impl<B: Backend> HfNamed for CausalLm<B> {
    fn hf_entries(&self) -> Vec<HfEntry> {
        match self {
            CausalLm::Lfm2(m) => m.hf_entries(),
            CausalLm::Qwen35(m) => m.hf_entries(),
            CausalLm::Gemma4(m) => m.hf_entries(),
        }
    }
}

struct CastParams {
    dtype: FloatDType,
    keep: HashSet<ParamId>,
}

impl<B: Backend> ModuleMapper<B> for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let target = if self.keep.contains(&id) { FloatDType::F32 } else { self.dtype };
        let tensor = if FloatDType::from(tensor.dtype()) == target {
            tensor
        } else {
            let require_grad = tensor.is_require_grad();
            let cast = tensor.cast(target).detach();
            if require_grad { cast.require_grad() } else { cast }
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

struct ThroughHost<'a, B: Backend> {
    device: &'a B::Device,
}

impl<B: Backend> ModuleMapper<B> for ThroughHost<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        param.map(|t| Tensor::from_data(t.into_data(), self.device))
    }

    fn map_int<const D: usize>(&mut self, param: Param<Tensor<B, D, Int>>) -> Param<Tensor<B, D, Int>> {
        param.map(|t| Tensor::from_data(t.into_data(), self.device))
    }

    fn map_bool<const D: usize>(&mut self, param: Param<Tensor<B, D, Bool>>) -> Param<Tensor<B, D, Bool>> {
        param.map(|t| Tensor::from_data(t.into_data(), self.device))
    }
}

/// Loads a checkpoint directory (config.json + safetensors) of any supported architecture.
pub fn load_model<B: Backend>(dir: &Path, device: &B::Device) -> Result<(ModelConfig, CausalLm<B>), ModelError> {
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let store = WeightStore::open(dir)?;
    let model = CausalLm::from_source(&config, &store, device)?;
    Ok((config, model))
}

/// The tensors loading the checkpoint in `dir` holds (its config's text tower: `ModelConfig::is_carried` left
/// out), as (name, number of values), from the safetensors headers alone: what a memory check needs before
/// the loading takes the memory.
pub fn checkpoint_tensor_sizes(dir: &Path) -> Result<Vec<(String, usize)>, ModelError> {
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let store = WeightStore::open(dir)?;
    let loaded = store.keys().filter(|k| !config.is_carried(k));
    Ok(loaded.map(|k| (k.clone(), store.shape(k).map_or(0, |s| s.iter().product()))).collect())
}

/// The bytes of the checkpoint tensors in `dir` that an export carries from it unchanged (those
/// `ModelConfig::is_carried` names), as stored.
pub fn checkpoint_carried_bytes(dir: &Path) -> Result<u64, ModelError> {
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let store = WeightStore::open(dir)?;
    let carried = store.keys().filter(|k| config.is_carried(k));
    Ok(carried
        .filter_map(
            |k| Some((store.shape(k)?.iter().product::<usize>() * store.dtype(k)?.bitsize()).div_ceil(8) as u64),
        )
        .sum())
}

/// A seeded random-init model for `config` with the architecture's init rule (normal(0, `std`) weights).
pub fn random_model<B: Backend>(
    config: &ModelConfig,
    seed: u64,
    std: f64,
    device: &B::Device,
) -> Result<CausalLm<B>, ModelError> {
    let rule: fn(&str) -> Init = match config {
        ModelConfig::Lfm2(_) => lfm2_init,
        ModelConfig::Qwen35(_) => qwen3_5_init,
        ModelConfig::Gemma4(_) => gemma4_init,
    };
    CausalLm::from_source(config, &RandomInit { seed, std, rule }, device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::models::hf::hf_tensors;

    /// The headers' sizes are the loaded model's tensors (parameters and buffers), the towers it does not load
    /// left out: the Qwen3.5 fixture's vision tower and mtp head, Gemma 4's vision tower.
    #[test]
    fn checkpoint_sizes_are_the_loaded_models_tensors() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        for (dir, carried) in [("lfm2/lfm2-moe-tiny", 0), ("qwen3_5/qwen3_5-tiny", 22), ("gemma4/gemma4-tiny", 16)] {
            let dir = fixtures.join(dir);
            let sizes = checkpoint_tensor_sizes(&dir).unwrap();
            let (_, model) = load_model::<Cpu>(&dir, &Default::default()).unwrap();
            let mut loaded: Vec<(String, usize)> = hf_tensors(&model)
                .into_iter()
                .chain(model.buffers())
                .map(|(key, t)| (key, t.shape.iter().product()))
                .collect();
            loaded.sort();
            assert_eq!(sizes, loaded, "{}", dir.display());
            let store = WeightStore::open(&dir).unwrap();
            assert_eq!(store.keys().count() - sizes.len(), carried, "{}", dir.display());
            let file_bytes = std::fs::metadata(dir.join("model.safetensors")).unwrap().len();
            let loaded_bytes: u64 =
                sizes.iter().map(|(k, n)| (*n * store.dtype(k).unwrap().bitsize() / 8) as u64).sum();
            let carried_bytes = checkpoint_carried_bytes(&dir).unwrap();
            assert_eq!(carried_bytes > 0, carried > 0, "{}", dir.display());
            // The header is all the file holds besides the tensors.
            assert!(file_bytes - (loaded_bytes + carried_bytes) < 64 * 1024, "{}", dir.display());
        }
    }

    /// The export that copies one tensor at a time from the device writes the same bytes as writing the
    /// model's host copy with the source's carried tensors: every architecture, in both dtypes, in one file
    /// and in shards.
    #[test]
    fn the_streamed_export_writes_what_the_host_copy_writes() {
        use crate::models::hf::{RawTensor, export_dir};
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        for dir in ["lfm2/lfm2-moe-tiny", "qwen3_5/qwen3_5-tiny", "gemma4/gemma4-tiny"] {
            let dir = fixtures.join(dir);
            let (_, model) = load_model::<Cpu>(&dir, &Default::default()).unwrap();
            let store = WeightStore::open(&dir).unwrap();
            let carried: BTreeMap<String, RawTensor> =
                store.keys().filter(|k| model.is_carried(k)).map(|k| (k.clone(), store.raw(k).unwrap())).collect();
            let mut host = hf_tensors(&model);
            host.extend(model.buffers());
            for (dtype, shard_bytes) in [(ExportDtype::F32, usize::MAX), (ExportDtype::Bf16, 40_000)] {
                let (streamed, copied) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
                let files = model.export(&dir, streamed.path(), dtype, shard_bytes).unwrap();
                export_dir(&host, &carried, &dir, copied.path(), dtype, &kept_in_f32, shard_bytes).unwrap();
                assert_eq!(files.len() > 1, shard_bytes < usize::MAX, "{}", dir.display());
                for file in &files {
                    let name = file.file_name().unwrap();
                    let same = std::fs::read(file).unwrap() == std::fs::read(copied.path().join(name)).unwrap();
                    assert!(same, "{}: {dtype:?} {name:?} differs", dir.display());
                }
            }
        }
    }
}
