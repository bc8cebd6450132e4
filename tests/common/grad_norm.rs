//! The gradients' squared norm as a backend takes it (`SquaredNorm`: kiln's kernel, `kernels::grad_norm`, on
//! the CubeCL backends) against the tensor ops it replaces (`optim::squared_sums_in_order`) and an f64 sum on
//! the host.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Shape, Tensor, TensorMetadata, TensorPrimitive};
use kiln::train::optim::{SquaredNorm, squared_sums_in_order};

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
pub fn assert_squared_norm_matches<B: SquaredNorm>(dtypes: &[FloatDType]) {
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
