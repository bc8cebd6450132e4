//! AdamW's update of many parameters in one CubeCL launch (`train::optim::OptimizerOps::adamw_update`), as
//! PyTorch's fused AdamW runs it, for burn's CubeCL backends (CUDA, Vulkan) with and without burn-fusion.
//!
//! As tensor ops each parameter's update is one to three kernels (burn-fusion ends a block where shapes
//! change): on lavapipe, this kernel took LFM2-350M's step from 1,450 kernels to 1,235 and Qwen3.5-0.8B's
//! from 5,058 to 4,625. Here one kernel updates up to `MAX_TENSORS` parameters of one dtype class
//! (parameter, gradient and moment dtypes; with or without f32 masters): each unit reads a value's
//! gradient, master (or parameter) and moments once, and writes the moments and master back in place and
//! the parameter, rounded to its dtype, into a new tensor: to nearest, or without a master stochastically
//! with the noise `train::rounding` hashes from the parameter's key and each value's coordinates. The
//! arithmetic is the tensor ops' in f32, in their order (`optim::Step`); tested against them
//! (tests/vulkan_backend.rs, vulkan_half.rs).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::stream::Operation;
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer};
use cubecl::prelude::*;

use super::{CubeLayout, UNITS, grid_row, register_custom, register_float_outputs, row_grid, writable};
use crate::train::optim::{AdamWScalars, AdamWSlot, AdamWUpdated};

/// Parameters one launch updates at most (each takes five or six bindings; devices bound them,
/// `max_bindings`).
const MAX_TENSORS: usize = 32;

/// The step's constants, and where the launch's cubes start (`CubeLayout`).
#[derive(CubeLaunch, CubeType)]
struct AdamWArgs {
    beta1: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    step_size: f32,
    bias2_root: f32,
    eps: f32,
    /// Stochastic rounding: the reach to the neighbour as a share of the nearest value's magnitude
    /// (`0.6·2^-bits`), and its least (f16's subnormal spacing; 0 for bf16): `rounding::stochastic_round`.
    reach_scale: f32,
    min_reach: f32,
    base: u32,
    per_cube: u32,
}

/// `rounding::mix31` in the kernel's 32-bit integers (the tests hold the two equal).
#[cube]
fn mix31(x: u32) -> u32 {
    let mask = 0x7FFF_FFFFu32;
    let mut x = x & mask;
    x ^= x >> 16u32;
    x = (x * comptime!(crate::train::rounding::MUL1)) & mask;
    x ^= x >> 15u32;
    x = (x * comptime!(crate::train::rounding::MUL2)) & mask;
    x ^ (x >> 15u32)
}

/// `rounding::noise` of value `at` (flat, row-major) of contiguous `t` from `key`: uniform in [0, 1).
#[cube]
fn rounding_noise<P: Float>(t: &Tensor<P>, at: usize, key: u32) -> f32 {
    let mut hash = key & 0x7FFF_FFFFu32;
    for axis in 0..t.rank() {
        let coordinate = (at / t.stride(axis)) % t.shape(axis);
        hash = mix31(hash ^ u32::cast_from(coordinate));
    }
    f32::cast_from((hash >> 15u32) & 0xFFFFu32) / 65536.0
}

/// `p` rounded into `P`: to one of the two values of `P` around it, the farther with probability
/// `distance / gap` against `u` (`rounding::stochastic_round`, same casts and arithmetic).
#[cube]
fn round_stochastically<P: Float>(p: f32, u: f32, reach_scale: f32, min_reach: f32) -> P {
    let nearest = f32::cast_from(P::cast_from(p));
    let past = p - nearest;
    let mut reach = nearest.abs() * reach_scale;
    if reach < min_reach {
        reach = min_reach;
    }
    let toward = if past < 0.0 { -reach } else { reach };
    let other = f32::cast_from(P::cast_from(nearest + toward));
    let gap = (other - nearest).abs();
    let probability = past.abs() / gap;
    let rounded = if u < probability && other.abs() <= 3.402_823_5e38 { other } else { nearest };
    P::cast_from(rounded)
}

/// Cube `k = base + c` updates values `(k − starts[i]) · per_cube …` of parameter `i`, where
/// `starts[i] ≤ k < starts[i + 1]`: `p ← p · decay_i − m̂ / (√v̂ + eps) · lr` with the moments' update, on the
/// master when `kept_masters` (written back) or on the parameter; the parameter goes to `updated`, rounded
/// to nearest, or `stochastic`ally with the noise of key `keys[i]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel<P: Float, G: Float, M: Float>(
    params: &Sequence<Tensor<P>>,
    grads: &Sequence<Tensor<G>>,
    masters: &mut Sequence<Tensor<f32>>,
    ms: &mut Sequence<Tensor<M>>,
    vs: &mut Sequence<Tensor<M>>,
    updated: &mut Sequence<Tensor<P>>,
    clip: &Tensor<f32>,
    starts: Sequence<u32>,
    decays: Sequence<f32>,
    keys: Sequence<u32>,
    args: AdamWArgs,
    #[comptime] kept_masters: bool,
    #[comptime] stochastic: bool,
    #[comptime] _revision: u64,
    #[define(P, G, M)] _dtypes: [StorageType; 3],
) {
    let cube = args.base as usize + grid_row();
    let per_cube = args.per_cube as usize;
    let scale = clip[0];
    let count = comptime![params.len()];
    #[unroll]
    for i in 0..count {
        let start = *starts.index(i) as usize;
        let end = *starts.index(comptime![i + 1]) as usize;
        if cube >= start && cube < end {
            let decay = *decays.index(i);
            let first = (cube - start) * per_cube;
            let mut last = first + per_cube;
            if last > params.index(i).len() {
                last = params.index(i).len();
            }
            let mut at = first + UNIT_POS_X as usize;
            while at < last {
                let g = f32::cast_from(grads.index(i)[at]) * scale;
                let kept = if kept_masters { masters.index(i)[at] } else { f32::cast_from(params.index(i)[at]) };
                let mut p = kept * decay;
                let m = f32::cast_from(ms.index(i)[at]) * args.beta1 + g * args.one_minus_beta1;
                let v = f32::cast_from(vs.index(i)[at]) * args.beta2 + g * g * args.one_minus_beta2;
                let denom = v.sqrt() / args.bias2_root + args.eps;
                p -= m / denom * args.step_size;
                ms.index_mut(i)[at] = M::cast_from(m);
                vs.index_mut(i)[at] = M::cast_from(v);
                if kept_masters {
                    masters.index_mut(i)[at] = p;
                }
                if stochastic {
                    let u = rounding_noise::<P>(params.index(i), at, *keys.index(i));
                    updated.index_mut(i)[at] = round_stochastically::<P>(p, u, args.reach_scale, args.min_reach);
                } else {
                    updated.index_mut(i)[at] = P::cast_from(p);
                }
                at += UNITS;
            }
        }
    }
}

/// The kernel as a backend primitive: AdamW on `slots` of one dtype class (`class_of`), the gradients scaled
/// by `clip` (`[1]`, f32).
pub trait AdamWKernel: Backend {
    fn adamw_class(
        slots: Vec<AdamWSlot<Self>>,
        clip: FloatTensor<Self>,
        scalars: AdamWScalars,
    ) -> Vec<AdamWUpdated<Self>>;
}

/// What one launch needs alike in all its parameters: the parameter's, gradient's and moments' dtypes, and
/// whether masters are kept and the parameters rounded into stochastically.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Class {
    param: DType,
    grad: DType,
    moments: DType,
    kept_masters: bool,
    stochastic: bool,
}

fn class_of<B: Backend>(slot: &AdamWSlot<B>) -> Class {
    Class {
        param: slot.param.dtype(),
        grad: slot.grad.dtype(),
        moments: slot.m.dtype(),
        kept_masters: slot.master.is_some(),
        stochastic: slot.noise_key.is_some(),
    }
}

/// `OptimizerOps::adamw_update` on a CubeCL backend: the slots grouped by dtype class (in their order within
/// each), a few launches per class, the results in the slots' order. Without clipping the gradients are
/// scaled by 1.
pub fn adamw_update<B: AdamWKernel>(
    slots: Vec<AdamWSlot<B>>,
    clip: Option<FloatTensor<B>>,
    scalars: AdamWScalars,
) -> Vec<AdamWUpdated<B>> {
    let Some(first) = slots.first() else { return Vec::new() };
    let clip = clip.unwrap_or_else(|| {
        let one = burn::tensor::Tensor::<B, 1>::ones([1], (&B::float_device(&first.param), DType::F32));
        one.into_primitive().tensor()
    });
    let count = slots.len();
    let mut results: Vec<Option<AdamWUpdated<B>>> = (0..count).map(|_| None).collect();
    let mut pending: Vec<(usize, AdamWSlot<B>)> = slots.into_iter().enumerate().collect();
    while let Some((_, first)) = pending.first() {
        let class = class_of(first);
        let (members, rest): (Vec<_>, Vec<_>) = pending.into_iter().partition(|(_, s)| class_of(s) == class);
        pending = rest;
        let (order, members): (Vec<usize>, Vec<AdamWSlot<B>>) = members.into_iter().unzip();
        for (i, result) in order.into_iter().zip(B::adamw_class(members, clip.clone(), scalars)) {
            results[i] = Some(result);
        }
    }
    results.into_iter().map(|r| r.expect("every slot updated")).collect()
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> AdamWKernel for CubeBackend<R, F, I, BT> {
    fn adamw_class(
        slots: Vec<AdamWSlot<Self>>,
        clip: FloatTensor<Self>,
        scalars: AdamWScalars,
    ) -> Vec<AdamWUpdated<Self>> {
        let Some(first) = slots.first() else { return Vec::new() };
        let (client, device) = (first.param.client.clone(), first.param.device.clone());
        let class = class_of(first);
        assert!(slots.iter().all(|s| class_of(s) == class), "AdamW's kernel takes one dtype class per launch");
        let Class { param: param_dtype, grad: grad_dtype, moments: moment_dtype, kept_masters, stochastic } = class;
        // Unused (zeros) where the class does not round stochastically.
        let (reach_scale, min_reach) =
            crate::train::rounding::reach(burn::tensor::FloatDType::from(param_dtype)).unwrap_or((0.0, 0.0));
        // All of a parameter's tensors are read and written at the same flat index: contiguous, each in the
        // parameter's element order.
        let slots: Vec<AdamWSlot<Self>> = slots
            .into_iter()
            .map(|s| AdamWSlot {
                param: into_contiguous(s.param),
                grad: into_contiguous(s.grad),
                master: s.master.map(writable),
                m: writable(s.m),
                v: writable(s.v),
                decay: s.decay,
                noise_key: s.noise_key,
            })
            .collect();
        let lens: Vec<usize> = slots.iter().map(|s| s.param.shape().num_elements()).collect();
        for s in &slots {
            let n = s.param.shape().num_elements();
            let sizes = [s.grad.shape(), s.m.shape(), s.v.shape()].map(|shape| shape.num_elements());
            assert!(
                sizes.iter().all(|&k| k == n),
                "AdamW's tensors of one parameter differ in size: {n} and {sizes:?}"
            );
        }
        let updated: Vec<CubeTensor<R>> = slots
            .iter()
            .map(|s| empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), s.param.shape(), param_dtype))
            .collect();
        let layout = CubeLayout::new(&lens);
        let bindings = 5 + usize::from(kept_masters);
        let clip = into_contiguous(clip);
        for launch in layout.launches(bindings, client.properties().hardware.max_bindings, MAX_TENSORS) {
            let part = &slots[launch.tensors.clone()];
            let args = AdamWArgsLaunch::new(
                scalars.beta1,
                scalars.beta2,
                scalars.one_minus_beta1,
                scalars.one_minus_beta2,
                scalars.step_size,
                scalars.bias2_root,
                scalars.eps,
                reach_scale,
                min_reach,
                launch.base,
                launch.per_cube,
            );
            let arg = |t: &CubeTensor<R>| t.clone().into_tensor_arg();
            adamw_kernel::launch::<R>(
                &client,
                row_grid(launch.cubes),
                CubeDim::new_1d(UNITS as u32),
                part.iter().map(|s| arg(&s.param)).collect(),
                part.iter().map(|s| arg(&s.grad)).collect(),
                part.iter().filter_map(|s| s.master.as_ref().map(arg)).collect(),
                part.iter().map(|s| arg(&s.m)).collect(),
                part.iter().map(|s| arg(&s.v)).collect(),
                updated[launch.tensors.clone()].iter().map(arg).collect(),
                clip.clone().into_tensor_arg(),
                launch.starts.into_iter().collect(),
                part.iter().map(|s| s.decay).collect(),
                part.iter().map(|s| s.noise_key.unwrap_or(0)).collect(),
                args,
                kept_masters,
                stochastic,
                super::REVISION,
                [param_dtype, grad_dtype, moment_dtype].map(Into::into),
            );
        }
        slots
            .into_iter()
            .zip(updated)
            .map(|(s, param)| AdamWUpdated { param, master: s.master, m: s.m, v: s.v })
            .collect()
    }
}

/// The kernel as one custom operation of burn-fusion's stream: fusion runs it on the backend under it.
/// Inputs per slot: parameter, gradient, master (when kept), m, v; then the clip. Outputs per slot: the
/// parameter, master (when kept), m, v.
#[derive(Debug, Clone)]
struct FusedAdamW<B> {
    desc: CustomOpIr,
    decays: Vec<f32>,
    noise_keys: Vec<Option<u32>>,
    kept_masters: bool,
    scalars: AdamWScalars,
    _backend: std::marker::PhantomData<B>,
}

impl<B: FusionBackend + AdamWKernel> Operation<B::FusionRuntime> for FusedAdamW<B> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let mut inputs = self.desc.inputs.iter();
        let mut next = || handles.get_float_tensor::<B>(inputs.next().expect("an input per slot tensor"));
        let slots: Vec<AdamWSlot<B>> = self
            .decays
            .iter()
            .zip(&self.noise_keys)
            .map(|(&decay, &noise_key)| AdamWSlot {
                param: next(),
                grad: next(),
                master: self.kept_masters.then(&mut next),
                m: next(),
                v: next(),
                decay,
                noise_key,
            })
            .collect();
        let clip = next();
        let results = B::adamw_class(slots, clip, self.scalars);
        let flat =
            results.into_iter().flat_map(|u| [Some(u.param), u.master, Some(u.m), Some(u.v)].into_iter().flatten());
        register_float_outputs::<B>(handles, &self.desc.outputs, flat);
    }
}

impl<B: FusionBackend + AdamWKernel> AdamWKernel for Fusion<B> {
    fn adamw_class(
        slots: Vec<AdamWSlot<Self>>,
        clip: FloatTensor<Self>,
        scalars: AdamWScalars,
    ) -> Vec<AdamWUpdated<Self>> {
        let Some(first) = slots.first() else { return Vec::new() };
        let kept_masters = first.master.is_some();
        let count = slots.len();
        let decays = slots.iter().map(|s| s.decay).collect();
        let noise_keys = slots.iter().map(|s| s.noise_key).collect();
        let described = |t: &FloatTensor<Self>| (t.shape(), t.dtype());
        let mut inputs = Vec::new();
        let mut outputs: Vec<(Shape, DType)> = Vec::new();
        for s in slots {
            outputs.push(described(&s.param));
            outputs.extend(s.master.iter().map(described));
            outputs.extend([described(&s.m), described(&s.v)]);
            inputs.extend([Some(s.param), Some(s.grad), s.master, Some(s.m), Some(s.v)].into_iter().flatten());
        }
        inputs.push(clip);
        let results = register_custom::<B, _>("kiln_adamw", inputs, &outputs, |desc| FusedAdamW::<B> {
            desc,
            decays,
            noise_keys,
            kept_masters,
            scalars,
            _backend: std::marker::PhantomData,
        });
        let mut results = results.into_iter();
        let mut take = || results.next().expect("the kernel's operation returns every output it registered");
        (0..count)
            .map(|_| AdamWUpdated { param: take(), master: kept_masters.then(&mut take), m: take(), v: take() })
            .collect()
    }
}

/// The launches CUDA makes (`cuda_source`): f32 parameters, and bf16 ones with f32 masters kept, moments in
/// f32 or bf16, or without masters (stochastic rounding) with bf16 moments; a full launch of tensors and a
/// short last one.
#[cfg(all(test, feature = "vulkan"))]
pub(super) fn cuda_variants(client: &super::cuda_source::Client) -> Vec<super::cuda_source::Variant> {
    use super::cuda_source::{Runtime, Variant, scalars, settings, tensor, tensors};
    let args = || AdamWArgsCompilationArg {
        beta1: (),
        beta2: (),
        one_minus_beta1: (),
        one_minus_beta2: (),
        step_size: (),
        bias2_root: (),
        eps: (),
        reach_scale: (),
        min_reach: (),
        base: (),
        per_cube: (),
    };
    let mut variants = Vec::new();
    for (param, moment, kept_masters) in [
        (DType::F32, DType::F32, false),
        (DType::BF16, DType::F32, true),
        (DType::BF16, DType::BF16, true),
        (DType::BF16, DType::BF16, false),
    ] {
        let stochastic = param != DType::F32 && !kept_masters;
        for count in [MAX_TENSORS, 3] {
            let masters = if kept_masters { count } else { 0 };
            variants.push(Variant::new(
                format!("adamw {param:?} parameters, {moment:?} moments, {count} tensors, stochastic {stochastic}"),
                adamw_kernel::AdamwKernel::<Runtime>::new(
                    settings(UNITS as u32),
                    client.clone(),
                    tensors(count),
                    tensors(count),
                    tensors(masters),
                    tensors(count),
                    tensors(count),
                    tensors(count),
                    tensor(),
                    scalars(count + 1),
                    scalars(count),
                    scalars(count),
                    args(),
                    kept_masters,
                    stochastic,
                    super::REVISION,
                    [param, param, moment].map(Into::into),
                ),
            ));
        }
    }
    variants
}
