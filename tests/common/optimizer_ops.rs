//! The optimizer's work as a backend does it (`OptimizerOps`: kiln's kernels on the CubeCL backends,
//! `kernels::grad_norm` and `kernels::adamw`) against the tensor ops they replace: the gradients' squared norm
//! against `optim::squared_sums_in_order` and an f64 sum on the host, AdamW's steps against the CPU's.

use std::collections::HashMap;

use burn::module::{Module, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Shape, Tensor, TensorMetadata, TensorPrimitive};
use kiln::train::optim::{AdamW, AdamWConfig, Masters, MomentDtype, OptimizerOps, squared_sums_in_order, step};

use super::parity::{spread, values};

/// Gradient-like tensors in `dtypes` (taken in turn): a norm weight, ranks 2 and 3, a transposed view (its
/// buffer holds just its values, read as it lies), a narrowed one (copied first), one over several cubes,
/// and enough small ones that they take two launches (`MAX_TENSORS` is 32).
fn cases<B: Backend>(dtypes: &[FloatDType], device: &B::Device) -> Vec<FloatTensor<B>> {
    let mut dtype = dtypes.iter().copied().cycle();
    let mut seed = 0;
    let mut next = |dims: &[usize]| {
        seed += 1;
        let len = dims.iter().product();
        let flat =
            kiln::backend::host_tensor::<B, 1>(spread(len, seed, -2.0, 2.0), [len], dtype.next().unwrap(), device);
        flat.into_primitive().tensor()
    };
    let shaped =
        |t: FloatTensor<B>, dims: [usize; 2]| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t)).reshape(dims);
    let mut tensors = vec![next(&[64]), next(&[3, 5]), next(&[96, 40])];
    tensors.push(
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(next(&[42])))
            .reshape([2, 3, 7])
            .into_primitive()
            .tensor(),
    );
    tensors.push(shaped(next(&[40 * 96]), [40, 96]).transpose().into_primitive().tensor());
    tensors.push(shaped(next(&[50 * 30]), [50, 30]).narrow(0, 5, 40).into_primitive().tensor());
    tensors.push(next(&[300 * 100]));
    tensors.extend((0..30).map(|_| next(&[77])));
    tensors
}

/// `Σ x²` in f64 over the values the tensors hold.
fn host_sum<B: Backend>(tensors: &[FloatTensor<B>]) -> f64 {
    tensors
        .iter()
        .map(|t| {
            let flat = B::float_reshape(t.clone(), Shape::new([t.shape().num_elements()]));
            let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(flat));
            values(flat).iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>()
        })
        .sum()
}

/// The backend's sum (twice: bit for bit the same) and the tensor ops', relative to the host's: each within
/// 2e-6.
pub fn assert_squared_norm_matches<B: OptimizerOps>(dtypes: &[FloatDType]) {
    let device = Default::default();
    let tensors = cases::<B>(dtypes, &device);
    let exact = host_sum::<B>(&tensors);
    let kernel = || values(B::squared_norm(tensors.clone()).expect("tensors"))[0];
    let (first, again) = (kernel(), kernel());
    let ops = values(squared_sums_in_order::<B>(tensors.clone()).expect("tensors"))[0];
    let relative = |x: f32| (f64::from(x) - exact).abs() / exact;
    eprintln!(
        "{dtypes:?}: backend {first} ({:.1e}), tensor ops {ops} ({:.1e}), host {exact}",
        relative(first),
        relative(ops)
    );
    assert_eq!(first.to_bits(), again.to_bits(), "the backend's sum changed between runs: {first} then {again}");
    assert!(relative(first) <= 2e-6 && relative(ops) <= 2e-6, "{first} and {ops} against {exact}");
    assert!(B::squared_norm(Vec::new()).is_none());
}

/// Parameters of every rank, one large enough for 8-bit moments (`quant8::MIN_ELEMENTS`), and more of them
/// than one AdamW launch takes.
#[derive(Module, Debug)]
struct Params<B: Backend> {
    weight: Param<Tensor<B, 2>>,
    bias: Param<Tensor<B, 1>>,
    conv: Param<Tensor<B, 3>>,
    many: Vec<Param<Tensor<B, 2>>>,
}

const MANY: usize = 34;

fn values_in<B: Backend, const D: usize>(dims: [usize; D], seed: u64, dtype: FloatDType) -> Tensor<B, D> {
    let len = dims.iter().product();
    kiln::backend::host_tensor::<B, 1>(spread(len, seed, -1.0, 1.0), [len], dtype, &Default::default()).reshape(dims)
}

/// Three AdamW steps (lr 1e-2, weight decay 0.1, the first two clipped to norm 1) of `Params` in `dtype` with `moments`
/// and `masters`,
/// on fixed gradients (the weight's a transposed view): each step's gradient norm and parameters, and the
/// final state by name.
#[allow(clippy::type_complexity)]
fn adamw_run<A: AutodiffBackend>(
    dtype: FloatDType,
    moments: MomentDtype,
    masters: Masters,
) -> (Vec<(f64, Vec<Vec<f32>>)>, HashMap<String, Vec<f32>>)
where
    A::InnerBackend: OptimizerOps,
{
    let mut model = Params::<A> {
        weight: Param::from_tensor(values_in([128, 40], 1, dtype)),
        bias: Param::from_tensor(values_in([40], 2, dtype)),
        conv: Param::from_tensor(values_in([12, 1, 4], 3, dtype)),
        many: (0..MANY).map(|i| Param::from_tensor(values_in([7, 11], 10 + i as u64, dtype))).collect(),
    };
    let mut names: HashMap<ParamId, String> = HashMap::from([
        (model.weight.id, "weight".into()),
        (model.bias.id, "bias".into()),
        (model.conv.id, "conv".into()),
    ]);
    names.extend(model.many.iter().enumerate().map(|(i, p)| (p.id, format!("many.{i}"))));
    let mut opt =
        AdamW::<A::InnerBackend>::new(AdamWConfig { weight_decay: 0.1, moments, masters, ..AdamWConfig::default() });
    let mut steps = Vec::new();
    for step_index in 0..3u64 {
        let seed = 100 * (step_index + 1);
        let mut grads = GradientsParams::new();
        grads.register(model.weight.id, values_in::<A::InnerBackend, 2>([40, 128], seed, dtype).transpose());
        grads.register(model.bias.id, values_in::<A::InnerBackend, 1>([40], seed + 1, dtype));
        grads.register(model.conv.id, values_in::<A::InnerBackend, 3>([12, 1, 4], seed + 2, dtype));
        for (i, p) in model.many.iter().enumerate() {
            grads.register(p.id, values_in::<A::InnerBackend, 2>([7, 11], seed + 10 + i as u64, dtype));
        }
        // The last step unclipped: the kernel's gradient scale is then 1.
        let max_norm = (step_index < 2).then_some(1.0);
        let (next, norm) = step::<A, _>(model, &mut opt, &grads, 1e-2, max_norm);
        model = next;
        let mut params = vec![values(model.weight.val()), values(model.bias.val()), values(model.conv.val())];
        params.extend(model.many.iter().map(|p| values(p.val())));
        steps.push((norm, params));
    }
    let state = opt.export_state(&names).unwrap().into_iter().map(|(name, t)| (name, t.data)).collect();
    (steps, state)
}

/// Three AdamW steps on backend `A` (kiln's AdamW kernel on the CubeCL backends) against the CPU's tensor
/// ops, both in `dtype` with `moments` and `masters`: gradient norms within 1e-6 relative, parameters and the
/// final masters and moments within `tolerance` of their largest magnitude (8-bit moments' codes as the
/// CPU's; without masters the rounding's noise is the same on both, so parameters round alike: all but one
/// in a thousand values equal; the kernel's noise with four of its bits masked off rounded 5.6 % otherwise).
pub fn assert_adamw_matches_the_cpu<A: AutodiffBackend>(
    dtype: FloatDType,
    moments: MomentDtype,
    masters: Masters,
    tolerance: f32,
) where
    A::InnerBackend: OptimizerOps,
{
    let (device, device_state) = adamw_run::<A>(dtype, moments, masters);
    let (cpu, cpu_state) = adamw_run::<kiln::backend::CpuTrain>(dtype, moments, masters);
    let close = |what: &str, a: &[f32], b: &[f32]| {
        let scale = b.iter().fold(1e-30f32, |m, x| m.max(x.abs()));
        let off = super::parity::max_abs_diff(a, b);
        assert!(off <= tolerance * scale, "{dtype:?} {moments:?} {what}: off by {off:.2e} (largest {scale:.2e})");
        off / scale
    };
    let mut worst = 0.0f32;
    let (mut differing, mut count) = (0, 0);
    for (step, ((norm, params), (cpu_norm, cpu_params))) in device.iter().zip(&cpu).enumerate() {
        assert!((norm - cpu_norm).abs() <= 1e-6 * cpu_norm, "step {step}: gradient norm {norm} vs {cpu_norm}");
        for (i, (a, b)) in params.iter().zip(cpu_params).enumerate() {
            worst = worst.max(close(&format!("step {step}, parameter {i}"), a, b));
            differing += a.iter().zip(b).filter(|(x, y)| x != y).count();
            count += a.len();
        }
    }
    if masters == Masters::Stochastic {
        assert!(differing * 1000 <= count, "{differing} of {count} values rounded otherwise than on the CPU");
    }
    assert_eq!(
        device_state.keys().collect::<std::collections::BTreeSet<_>>(),
        cpu_state.keys().collect(),
        "the same state tensors"
    );
    for (name, values) in &device_state {
        if name.ends_with(kiln::train::optim::CODES_SUFFIX) {
            let differing = values.iter().zip(&cpu_state[name]).filter(|(a, b)| a != b).count();
            assert!(differing * 100 <= values.len(), "{name}: {differing} of {} codes differ", values.len());
        } else {
            worst = worst.max(close(name, values, &cpu_state[name]));
        }
    }
    eprintln!("{dtype:?} {moments:?} {masters:?}: parameters and state within {worst:.1e} of their largest value");
}
