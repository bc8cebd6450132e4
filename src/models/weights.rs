//! Reading checkpoints: HF safetensors, one file or sharded with `model.safetensors.index.json`, memory-
//! mapped, f32 / bf16 / f16 widened to f32 on read. Keys are handed out once so that what a model did not
//! ask for (unexpected) and what it asked for but the files lack (missing) can both be listed.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::ModelError;

/// Where a model's tensors come from: a checkpoint, or a seeded random initialization.
pub trait TensorSource {
    /// The tensor named `key` with `shape` (problems are recorded for `finish`).
    fn take(&self, key: &str, shape: &[usize]) -> HostTensor;
    /// Whether the source has `key` (optional tensors, alternative layouts).
    fn contains(&self, key: &str) -> bool;
    /// Lists every problem met while loading, if any; keys `ignore` accepts may stay untaken.
    fn finish_except(&self, ignored: &[&str], ignore: &dyn Fn(&str) -> bool) -> Result<(), ModelError>;

    fn finish(&self, ignored: &[&str]) -> Result<(), ModelError> {
        self.finish_except(ignored, &|_| false)
    }

    fn take_optional(&self, key: &str, shape: &[usize]) -> Option<HostTensor> {
        self.contains(key).then(|| self.take(key, shape))
    }
}

/// How one tensor of a fresh model starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// normal(0, initializer_range)
    Normal,
    Constant(f32),
    /// `log(uniform(lo, hi))` (Gated DeltaNet's `A_log`).
    LogUniform(f32, f32),
}

/// transformers' LFM2 init: ones for norms, zeros for biases and the expert bias, normal otherwise.
pub fn lfm2_init(key: &str) -> Init {
    if key.ends_with("norm.weight") {
        Init::Constant(1.0)
    } else if key.ends_with("expert_bias") || key.ends_with(".bias") {
        Init::Constant(0.0)
    } else {
        Init::Normal
    }
}

/// transformers' Qwen3.5 init: zero-centered norms at 0, the DeltaNet output norm and `dt_bias` at 1,
/// `A_log = log(U(0.01, 16))`, normal otherwise.
pub fn qwen3_5_init(key: &str) -> Init {
    if key.ends_with("linear_attn.norm.weight") || key.ends_with("dt_bias") {
        Init::Constant(1.0)
    } else if key.ends_with("norm.weight") {
        Init::Constant(0.0)
    } else if key.ends_with("A_log") {
        Init::LogUniform(0.01, 16.0)
    } else {
        Init::Normal
    }
}

/// transformers' Gemma 4 init: norms and layer scalars at 1, normal otherwise.
pub fn gemma4_init(key: &str) -> Init {
    if key.ends_with("norm.weight") || key.ends_with("layernorm.weight") || key.ends_with("layer_scalar") {
        Init::Constant(1.0)
    } else {
        Init::Normal
    }
}

/// A seeded random initialization following an architecture's init rule. Each tensor's values depend on
/// the seed and its name only.
pub struct RandomInit {
    pub seed: u64,
    pub std: f64,
    pub rule: fn(&str) -> Init,
}

/// Tensors of this many values or more are drawn in `RANDOM_CHUNK` pieces on every core, each piece from a
/// generator of its own: one generator draws ~10⁸ values a second, so LFM2.5-8B-A1B's 8.5 B took minutes of a
/// GPU session's benchmark. Smaller tensors keep one generator, so the tiny models' weights are unchanged.
const PARALLEL_FROM: usize = 1 << 22;
const RANDOM_CHUNK: usize = 1 << 20;

impl RandomInit {
    /// Fills `out` with values of `init` from the generator seeded with `seed`.
    fn fill(&self, init: Init, out: &mut [f32], seed: u64) {
        use rand::{Rng, SeedableRng};
        use rand_distr::Distribution;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        match init {
            Init::Constant(value) => out.fill(value),
            Init::LogUniform(lo, hi) => out.iter_mut().for_each(|x| *x = rng.random_range(lo..hi).ln()),
            Init::Normal => {
                let normal = rand_distr::Normal::new(0.0f32, self.std as f32)
                    .unwrap_or_else(|_| rand_distr::Normal::new(0.0, 0.02).expect("valid"));
                out.iter_mut().for_each(|x| *x = normal.sample(&mut rng));
            }
        }
    }
}

impl TensorSource for RandomInit {
    fn take(&self, key: &str, shape: &[usize]) -> HostTensor {
        use rayon::prelude::*;
        let n: usize = shape.iter().product();
        let digest = crate::hub::sha256_bytes(format!("{}:{key}", self.seed).as_bytes());
        let seed = u64::from_str_radix(&digest[..16], 16).unwrap_or(self.seed);
        let init = (self.rule)(key);
        let mut data = vec![0.0f32; n];
        if n < PARALLEL_FROM {
            self.fill(init, &mut data, seed);
        } else {
            // Each piece written in place (no per-piece buffers to concatenate: twice the tensor's memory).
            data.par_chunks_mut(RANDOM_CHUNK).enumerate().for_each(|(c, piece)| {
                self.fill(init, piece, seed ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            });
        }
        HostTensor { shape: shape.to_vec(), data }
    }

    fn contains(&self, _key: &str) -> bool {
        false
    }

    fn finish_except(&self, _ignored: &[&str], _ignore: &dyn Fn(&str) -> bool) -> Result<(), ModelError> {
        Ok(())
    }
}

pub struct WeightStore {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    /// key → (file index, dtype, shape)
    index: BTreeMap<String, (usize, Dtype, Vec<usize>)>,
    taken: RefCell<BTreeSet<String>>,
    missing: RefCell<Vec<String>>,
    mismatched: RefCell<Vec<String>>,
}

/// Tensors the released checkpoints keep in f32 beside bf16 weights (LFM2-MoE's `expert_bias` buffer,
/// Qwen3.5's `A_log` and DeltaNet output norm): loaded, trained and exported in f32 whatever the compute dtype.
pub fn kept_in_f32(key: &str) -> bool {
    key.ends_with("feed_forward.expert_bias")
        || key.ends_with("linear_attn.A_log")
        || key.ends_with("linear_attn.norm.weight")
}

/// `t` on `device`, in the device's default float dtype (bf16 on the CUDA bf16 backend, f32 on the CPU).
pub(crate) fn device_tensor<B: burn::tensor::backend::Backend, const D: usize>(
    t: HostTensor,
    device: &B::Device,
) -> burn::tensor::Tensor<B, D> {
    burn::tensor::Tensor::from_data(burn::tensor::TensorData::new(t.data, t.shape), device)
}

/// The parameter `key` of `shape`: in f32 where `kept_in_f32`, else in the device's default float dtype.
pub(crate) fn load_param<B: burn::tensor::backend::Backend, const D: usize>(
    store: &dyn TensorSource,
    key: &str,
    shape: [usize; D],
    device: &B::Device,
) -> burn::module::Param<burn::tensor::Tensor<B, D>> {
    let t = store.take(key, &shape);
    let tensor = if kept_in_f32(key) {
        crate::backend::host_tensor(t.data, shape, burn::tensor::FloatDType::F32, device)
    } else {
        device_tensor(t, device)
    };
    burn::module::Param::from_tensor(tensor)
}

/// A PyTorch Linear `[out, in]` (bias when the checkpoint has one) as burn's `[in, out]`.
pub(crate) fn load_linear<B: burn::tensor::backend::Backend>(
    store: &dyn TensorSource,
    key: &str,
    d_in: usize,
    d_out: usize,
    device: &B::Device,
) -> burn::nn::Linear<B> {
    // Transposed on the host, so the parameter is a contiguous `[in, out]` tensor: a transposed view would be
    // copied whole by every forward pass on the CPU backend (burn's `linear` reshapes the weight, and
    // burn-flex copies a strided tensor to reshape it): once per generated token in decoding.
    let w = store.take(&format!("{key}.weight"), &[d_out, d_in]).transposed();
    let bias = store
        .take_optional(&format!("{key}.bias"), &[d_out])
        .map(|b| burn::module::Param::from_tensor(device_tensor::<B, 1>(b, device)));
    burn::nn::Linear { weight: burn::module::Param::from_tensor(device_tensor(w, device)), bias }
}

/// A tensor read as f32, row-major.
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    /// A `[rows, cols]` matrix as `[cols, rows]`, row-major: 32 output rows per rayon task, filled in
    /// 32 × 32 tiles so reads and writes both stay in cache.
    pub fn transposed(&self) -> Self {
        use rayon::prelude::*;
        const TILE: usize = 32;
        let [rows, cols] = self.shape[..] else {
            panic!("transposed() takes a matrix, not shape {:?}", self.shape);
        };
        let mut data = vec![0.0f32; self.data.len()];
        data.par_chunks_mut(TILE * rows.max(1)).enumerate().for_each(|(block, out)| {
            let c0 = block * TILE;
            for r0 in (0..rows).step_by(TILE) {
                for c in c0..(c0 + TILE).min(cols) {
                    for r in r0..(r0 + TILE).min(rows) {
                        out[(c - c0) * rows + r] = self.data[r * cols + c];
                    }
                }
            }
        });
        HostTensor { shape: vec![cols, rows], data }
    }
}

impl WeightStore {
    /// Opens `model.safetensors`, or the shards listed in `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let shard_names: Vec<String> = if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::Weights { path: index_path.clone(), message: e.to_string() })?;
            let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| ModelError::Weights {
                path: index_path.clone(),
                message: "no `weight_map` object".into(),
            })?;
            let names: BTreeSet<String> = map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
            names.into_iter().collect()
        } else if single.is_file() {
            vec!["model.safetensors".into()]
        } else {
            return Err(ModelError::Weights {
                path: dir.to_path_buf(),
                message: "no model.safetensors and no model.safetensors.index.json".into(),
            });
        };
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for name in shard_names {
            let path = dir.join(&name);
            let file = File::open(&path).map_err(|e| ModelError::Weights {
                path: path.clone(),
                message: format!("shard missing or unreadable: {e}"),
            })?;
            // Safety: the file is only read; a checkpoint rewritten underneath a running job is out of scope.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let tensors = SafeTensors::deserialize(&mmap).map_err(|e| ModelError::Weights {
                path: path.clone(),
                message: format!("not a readable safetensors file: {e}"),
            })?;
            for (key, view) in tensors.tensors() {
                index.insert(key, (files.len(), view.dtype(), view.shape().to_vec()));
            }
            drop(tensors);
            files.push((path, mmap));
        }
        Ok(WeightStore {
            dir: dir.to_path_buf(),
            files,
            index,
            taken: RefCell::new(BTreeSet::new()),
            missing: RefCell::new(Vec::new()),
            mismatched: RefCell::new(Vec::new()),
        })
    }

    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.index.keys()
    }

    pub fn shape(&self, key: &str) -> Option<&[usize]> {
        self.index.get(key).map(|(_, _, s)| s.as_slice())
    }

    pub fn dtype(&self, key: &str) -> Option<Dtype> {
        self.index.get(key).map(|(_, d, _)| *d)
    }

    fn read(&self, file: usize, key: &str, dtype: Dtype) -> Result<Vec<f32>, String> {
        let tensors = SafeTensors::deserialize(&self.files[file].1).map_err(|e| e.to_string())?;
        let view = tensors.tensor(key).map_err(|e| e.to_string())?;
        let bytes = view.data();
        Ok(match dtype {
            Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => return Err(format!("dtype {other:?} is not a float type kiln loads")),
        })
    }

    /// `key`'s dtype, shape and bytes exactly as stored.
    pub fn raw(&self, key: &str) -> Result<super::hf::RawTensor, ModelError> {
        let bad = |message: String| ModelError::Weights { path: self.dir.clone(), message };
        let (file, dtype, shape) = self.index.get(key).ok_or_else(|| bad(format!("no tensor `{key}`")))?;
        let tensors = SafeTensors::deserialize(&self.files[*file].1).map_err(|e| bad(e.to_string()))?;
        let view = tensors.tensor(key).map_err(|e| bad(format!("{key}: {e}")))?;
        Ok(super::hf::RawTensor { dtype: *dtype, shape: shape.clone(), bytes: view.data().to_vec() })
    }

    pub fn files(&self) -> Vec<&Path> {
        self.files.iter().map(|(p, _)| p.as_path()).collect()
    }
}

impl TensorSource for WeightStore {
    /// Reads `key`, which must have `shape`; a missing key or another shape is recorded and a zero tensor
    /// returned so that loading goes on and `finish` can list every problem at once.
    fn take(&self, key: &str, shape: &[usize]) -> HostTensor {
        let zeros = || HostTensor { shape: shape.to_vec(), data: vec![0.0; shape.iter().product()] };
        let Some((file, dtype, actual)) = self.index.get(key) else {
            self.missing.borrow_mut().push(key.to_string());
            return zeros();
        };
        self.taken.borrow_mut().insert(key.to_string());
        if actual.as_slice() != shape {
            self.mismatched.borrow_mut().push(format!("{key}: checkpoint {actual:?}, model expects {shape:?}"));
            return zeros();
        }
        match self.read(*file, key, *dtype) {
            Ok(data) => HostTensor { shape: shape.to_vec(), data },
            Err(message) => {
                self.mismatched.borrow_mut().push(format!("{key}: {message}"));
                zeros()
            }
        }
    }

    fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Ends loading: every key must have been taken (bar `ignored` and what `ignore` accepts), none missing,
    /// all shapes right.
    fn finish_except(&self, ignored: &[&str], ignore: &dyn Fn(&str) -> bool) -> Result<(), ModelError> {
        let taken = self.taken.borrow();
        let unexpected: Vec<String> = self
            .index
            .keys()
            .filter(|k| !taken.contains(*k) && !ignored.contains(&k.as_str()) && !ignore(k))
            .cloned()
            .collect();
        let missing = self.missing.borrow().clone();
        let mismatched = self.mismatched.borrow().clone();
        if unexpected.is_empty() && missing.is_empty() && mismatched.is_empty() {
            return Ok(());
        }
        let list = |v: &[String]| {
            if v.len() > 20 { format!("{} … and {} more", v[..20].join(", "), v.len() - 20) } else { v.join(", ") }
        };
        let mut parts = Vec::new();
        if !missing.is_empty() {
            parts.push(format!("missing keys ({}): {}", missing.len(), list(&missing)));
        }
        if !unexpected.is_empty() {
            parts.push(format!("unexpected keys ({}): {}", unexpected.len(), list(&unexpected)));
        }
        if !mismatched.is_empty() {
            parts.push(format!("wrong tensors ({}): {}", mismatched.len(), list(&mismatched)));
        }
        Err(ModelError::Weights { path: self.dir.clone(), message: parts.join("; ") })
    }
}

#[cfg(test)]
mod tests {
    use super::HostTensor;

    #[test]
    fn a_transposed_matrix_moves_every_entry_across_partial_tiles() {
        // 37 × 70: neither side a multiple of the 32-entry tile.
        let (rows, cols) = (37, 70);
        let data: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let t = HostTensor { shape: vec![rows, cols], data: data.clone() }.transposed();
        assert_eq!(t.shape, [cols, rows]);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(t.data[c * rows + r], data[r * cols + c], "entry ({r}, {c})");
            }
        }
    }
}
