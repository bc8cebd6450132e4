//! The f32 slice arithmetic shared by the CPU backend's loop kernels (`cpu_attention`, `cpu_deltanet`,
//! `cpu_elementwise`): a dot product in eight interleaved lanes, `y += a·x`, an exponential that
//! vectorizes, matrix products over strided views of slices (the `gemm` crate's kernels, which burn-flex
//! runs too), row access, and a tensor's host values: copied out (`host`), or read in place from the CPU
//! backend's storage (`FlexValues`, `HeadRows`).

use burn::backend::Flex;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_flex::FlexTensor;

/// `Σ aᵢ bᵢ` in eight interleaved partial sums (which the compiler keeps in vector registers).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    let mut lanes = [0.0f32; 8];
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `y += a · x`.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// A `rows × cols` matrix read from a slice: element `(r, c)` at `r · row_stride + c · col_stride`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// The row-major `rows × cols` matrix at the start of `data`.
    pub fn rows(data: &'a [f32], rows: usize, cols: usize) -> Self {
        MatRef { data, rows, cols, row_stride: cols, col_stride: 1 }
    }

    /// The transpose (a view: no copy).
    pub fn t(self) -> Self {
        MatRef { rows: self.cols, cols: self.rows, row_stride: self.col_stride, col_stride: self.row_stride, ..self }
    }

    /// Whether every element lies inside `data`.
    fn in_bounds(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride < self.data.len()
    }
}

/// `out = scale · a·b`, or `out += scale · a·b` with `accumulate`, for `out` the row-major `a.rows × b.cols`
/// matrix at the start of the slice; single-threaded (callers run it inside their own parallel tasks), and
/// so in a fixed order of additions.
pub fn matmul(out: &mut [f32], a: MatRef, b: MatRef, scale: f32, accumulate: bool) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    assert_eq!(b.rows, k, "inner dimensions agree");
    assert!(a.in_bounds() && b.in_bounds() && out.len() >= m * n, "matrices inside their slices");
    if m == 0 || n == 0 {
        return;
    }
    let stride = |s: usize| s as isize;
    // SAFETY: the asserts above keep every element `gemm` reads or writes inside its slice; `out` is borrowed
    // mutably and `a`, `b` shared, so they do not overlap.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            stride(n),
            accumulate,
            a.data.as_ptr(),
            stride(a.col_stride),
            stride(a.row_stride),
            b.data.as_ptr(),
            stride(b.col_stride),
            stride(b.row_stride),
            1.0,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Row `i` of a `[rows, d]` slice.
pub fn row<T>(x: &[T], i: usize, d: usize) -> &[T] {
    &x[i * d..(i + 1) * d]
}

/// Row `i` of a `[rows, d]` slice, mutably.
pub fn row_mut<T>(x: &mut [T], i: usize, d: usize) -> &mut [T] {
    &mut x[i * d..(i + 1) * d]
}

/// The host values of an f32 tensor, row-major (a strided view is copied out in its logical order).
pub fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().into_vec::<f32>().expect("an f32 tensor (checked by the caller)")
}

/// An f32 tensor of the CPU backend read in place: Flex's storage borrowed rather than copied out as
/// `host` does (a copy of every cached key and value per decoded token was a sixth of an evaluation).
pub struct FlexValues {
    tensor: FlexTensor,
}

impl FlexValues {
    /// `t` as held; `values` and `heads` read it where it lies.
    pub fn new<const D: usize>(t: Tensor<Flex, D>) -> Self {
        let tensor = t.into_primitive().tensor();
        assert_eq!(tensor.dtype(), burn::tensor::DType::F32, "an f32 tensor (checked by the caller)");
        FlexValues { tensor }
    }

    /// The values in row-major order: in place when the tensor is contiguous, else copied once into a
    /// contiguous tensor that this then holds.
    pub fn values(&mut self) -> &[f32] {
        if self.tensor.as_slice::<f32>().is_none() {
            self.tensor = self.tensor.to_contiguous();
        }
        self.tensor.as_slice::<f32>().expect("a contiguous f32 tensor")
    }

    /// A `[outer, inner, rows, d]` tensor as `outer · inner` heads of `rows × d` row-major values, read in
    /// place where each head's rows lie back to back (a contiguous tensor, or a cache narrowed to its
    /// filled positions), else from a contiguous copy.
    pub fn heads(&mut self) -> HeadRows<'_> {
        let layout = self.tensor.layout();
        let (shape, strides, start) = (layout.shape().to_vec(), layout.strides().to_vec(), layout.start_offset());
        assert_eq!(shape.len(), 4, "a [outer, inner, rows, d] tensor");
        let (inner, rows, d) = (shape[1], shape[2], shape[3]);
        // A dimension of size 1 is never stepped over, whatever its stride.
        let rows_in_place = (d <= 1 || strides[3] == 1) && (rows <= 1 || strides[2] == d as isize);
        let outer_strides = [strides[0], strides[1]].map(usize::try_from);
        match outer_strides {
            [Ok(outer_stride), Ok(inner_stride)] if rows_in_place => HeadRows {
                data: self.tensor.storage::<f32>(),
                start,
                strides: [outer_stride, inner_stride],
                inner,
                len: rows * d,
            },
            _ => {
                self.tensor = self.tensor.to_contiguous();
                HeadRows::contiguous(self.tensor.storage::<f32>(), rows * d)
            }
        }
    }
}

/// Heads of `len` row-major values in a slice: head `h` at `start + (h / inner) · strides[0] + (h % inner) ·
/// strides[1]`.
#[derive(Debug, Clone, Copy)]
pub struct HeadRows<'a> {
    data: &'a [f32],
    start: usize,
    strides: [usize; 2],
    inner: usize,
    len: usize,
}

impl<'a> HeadRows<'a> {
    /// Heads of `len` values back to back from the start of `data`.
    pub fn contiguous(data: &'a [f32], len: usize) -> Self {
        HeadRows { data, start: 0, strides: [len, len], inner: 1, len }
    }

    /// Head `h`'s values.
    pub fn head(&self, h: usize) -> &'a [f32] {
        let at = self.start + (h / self.inner) * self.strides[0] + (h % self.inner) * self.strides[1];
        &self.data[at..at + self.len]
    }
}

/// `eˣ` in branch-free f32 arithmetic, so that loops over slices of it vectorize (libm's `expf` is a call per
/// element: a tenth of a CPU training step went to it). `eˣ = 2ⁿ · eʳ` with `n = round(x / ln 2)` and
/// `r = x − n ln 2` (ln 2 in two parts, so `r` keeps its low bits) in `[−ln2/2, ln2/2]`, where the Taylor
/// series to `r⁷` is within 1e-8 relative; `2ⁿ` is applied in two halves so that `n` from −150 to 128
/// stays a normal power, and the result underflows to 0 and overflows to ∞ where `expf` does. Within 2ε
/// (f32's epsilon) relative of `eˣ`; NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4; // 355/512, exact: n · LN2_HI is exact for |n| < 2¹⁴
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 · 2²³ rounds to an integer in the low mantissa bits (round to nearest even).
    const ROUNDER: f32 = 12_582_912.0;
    let x = x.clamp(-104.0, 89.0);
    let shifted = x * std::f32::consts::LOG2_E + ROUNDER;
    let n = shifted.to_bits().wrapping_sub(ROUNDER.to_bits()) as i32;
    let nf = shifted - ROUNDER;
    let r = (x - nf * LN2_HI) - nf * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let half = n >> 1;
    let power = |k: i32| f32::from_bits((k.wrapping_add(127) as u32) << 23);
    p * power(half) * power(n.wrapping_sub(half))
}

#[cfg(test)]
mod tests {
    use super::{FlexValues, exp};
    use crate::backend::Cpu;
    use crate::testing::{normal, values};

    /// A cache narrowed to its first positions is read where it lies; a view whose rows are not contiguous
    /// (keys transposed) is read from a copy, in its logical order either way.
    #[test]
    fn heads_are_read_in_place_where_their_rows_lie_back_to_back() {
        let cache = normal::<Cpu, 4>([2, 3, 10, 4], 0.0, 1.0, 1, &Default::default());
        let base = FlexValues::new(cache.clone()).values().as_ptr();
        let narrowed = cache.clone().narrow(2, 0, 6);
        let transposed = cache.clone().narrow(2, 0, 6).swap_dims(2, 3);
        for (view, in_place) in [(narrowed, true), (transposed, false)] {
            let [_, _, rows, d] = view.dims();
            let expected = values(view.clone());
            let mut held = FlexValues::new(view);
            let heads = held.heads();
            assert_eq!(std::ptr::eq(heads.head(0).as_ptr(), base), in_place, "{rows} × {d} heads");
            let read: Vec<f32> = (0..6).flat_map(|h| heads.head(h).to_vec()).collect();
            assert_eq!(read, expected, "{rows} × {d} heads");
        }
    }

    /// Every 97th f32 magnitude from −87 to 88.7 (normal results) within 2ε relative of the f64
    /// exponential, the results near and below the smallest normal within that or one subnormal step, and
    /// the ends and NaN as `expf` has them.
    #[test]
    fn exp_is_within_two_ulp_of_the_exponential() {
        for bits in (0..88.7f32.to_bits()).step_by(97) {
            let magnitude = f32::from_bits(bits);
            for x in [magnitude, -magnitude].into_iter().filter(|&x| x >= -87.0) {
                let (got, want) = (f64::from(exp(x)), f64::from(x).exp());
                assert!(((got - want) / want).abs() <= 2.0 * f64::from(f32::EPSILON), "exp({x}) = {got}, not {want}");
            }
        }
        for i in 0..20_000 {
            let x = -104.5 + i as f32 * 1e-3;
            let (got, want) = (f64::from(exp(x)), f64::from(x).exp());
            let tolerance = (2.0 * f64::from(f32::EPSILON) * want).max(1.5e-45);
            assert!((got - want).abs() <= tolerance, "exp({x}) = {got}, not {want}");
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(88.8), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }
}
