//! AdamW as PyTorch computes it (decoupled weight decay applied first, bias-corrected moments, `eps` added to
//! the corrected root), no decay on vectors (norm weights, biases), global-norm gradient clipping, and
//! moments that save and load by parameter name for exact resume.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::models::weights::HostTensor;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

struct Moments<B: Backend> {
    m: Tensor<B, 1>,
    v: Tensor<B, 1>,
}

/// Optimizer state over the inner (non-autodiff) backend `B`.
pub struct AdamW<B: Backend> {
    pub config: AdamWConfig,
    /// Completed optimizer steps.
    pub steps: usize,
    moments: HashMap<ParamId, Moments<B>>,
}

impl<B: Backend> AdamW<B> {
    pub fn new(config: AdamWConfig) -> Self {
        AdamW { config, steps: 0, moments: HashMap::new() }
    }

    /// Moments as host tensors named by `names` (parameter id → stable name), for a training-state file.
    pub fn export_moments(&self, names: &HashMap<ParamId, String>) -> Vec<(String, HostTensor)> {
        let mut out = Vec::new();
        for (id, mo) in &self.moments {
            let Some(name) = names.get(id) else { continue };
            for (suffix, t) in [("m", &mo.m), ("v", &mo.v)] {
                let data = t.clone().into_data().convert::<f32>().to_vec::<f32>().unwrap_or_default();
                out.push((format!("{name}.{suffix}"), HostTensor { shape: vec![data.len()], data }));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Restores moments saved by `export_moments` onto the parameters of `names`.
    pub fn import_moments(
        &mut self,
        names: &HashMap<ParamId, String>,
        saved: &HashMap<String, HostTensor>,
        device: &B::Device,
    ) -> Result<(), String> {
        for (id, name) in names {
            let (Some(m), Some(v)) = (saved.get(&format!("{name}.m")), saved.get(&format!("{name}.v"))) else {
                continue;
            };
            let t = |h: &HostTensor| Tensor::<B, 1>::from_data(TensorData::new(h.data.clone(), [h.data.len()]), device);
            self.moments.insert(*id, Moments { m: t(m), v: t(v) });
        }
        if self.moments.is_empty() && !saved.is_empty() {
            return Err("no saved moment matches a parameter of this model".into());
        }
        Ok(())
    }
}

/// Sum of squared gradients over every parameter that has one.
struct SquaredNorm<'a> {
    grads: &'a GradientsParams,
    total: f64,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let s: f32 = g.powf_scalar(2.0).sum().into_scalar().to_f32();
            self.total += s as f64;
        }
    }
}

trait ToF32 {
    fn to_f32(self) -> f32;
}

impl<E: burn::tensor::ElementConversion> ToF32 for E {
    fn to_f32(self) -> f32 {
        self.elem::<f32>()
    }
}

/// The global L2 norm of the gradients.
pub fn grad_norm<B: AutodiffBackend, M: Module<B>>(model: &M, grads: &GradientsParams) -> f64 {
    let mut v = SquaredNorm { grads, total: 0.0 };
    model.visit(&mut v);
    v.total.sqrt()
}

struct Step<'a, B: AutodiffBackend> {
    opt: &'a mut AdamW<B::InnerBackend>,
    grads: &'a GradientsParams,
    lr: f64,
    /// Gradient multiplier from global-norm clipping (1 when not clipped).
    scale: f64,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Step<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.get::<B::InnerBackend, D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let shape = tensor.dims();
        let n: usize = shape.iter().product();
        let c = self.opt.config;
        let t = (self.opt.steps + 1) as i32;
        let g = if self.scale != 1.0 { grad * self.scale } else { grad }.reshape([n]);
        let mut p = tensor.inner().reshape([n]);
        if D > 1 && c.weight_decay != 0.0 {
            p = p * (1.0 - self.lr * c.weight_decay);
        }
        let device = p.device();
        let moments = self
            .opt
            .moments
            .remove(&id)
            .unwrap_or_else(|| Moments { m: Tensor::zeros([n], &device), v: Tensor::zeros([n], &device) });
        let m = moments.m * c.beta1 + g.clone() * (1.0 - c.beta1);
        let v = moments.v * c.beta2 + g.powf_scalar(2.0) * (1.0 - c.beta2);
        let bias1 = 1.0 - c.beta1.powi(t);
        let bias2 = 1.0 - c.beta2.powi(t);
        let denom = v.clone().sqrt() / bias2.sqrt() + c.eps;
        let p = p - m.clone() / denom * (self.lr / bias1);
        self.opt.moments.insert(id, Moments { m, v });
        let mut out = Tensor::from_inner(p.reshape(shape));
        if require_grad {
            out = out.require_grad();
        }
        Param::from_mapped_value(id, out, mapper)
    }
}

/// One optimizer step: clips to `max_norm` (if any) by the global norm, applies AdamW at `lr`, and
/// returns the updated model and the pre-clipping gradient norm.
pub fn step<B: AutodiffBackend, M: Module<B>>(
    model: M,
    opt: &mut AdamW<B::InnerBackend>,
    grads: &GradientsParams,
    lr: f64,
    max_norm: Option<f64>,
) -> (M, f64) {
    let norm = grad_norm::<B, M>(&model, grads);
    // torch.nn.utils.clip_grad_norm_: scale by max / (norm + 1e-6) when that is below 1.
    let scale = match max_norm {
        Some(max) if max / (norm + 1e-6) < 1.0 => max / (norm + 1e-6),
        _ => 1.0,
    };
    let mut mapper = Step::<B> { opt, grads, lr, scale };
    let model = model.map(&mut mapper);
    mapper.opt.steps += 1;
    (model, norm)
}
