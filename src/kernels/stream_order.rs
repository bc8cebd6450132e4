//! Ordering work on another CUDA stream (cuBLAS's, `kernels::cublas`) around cubecl's stream on the device,
//! without the host waiting on either: a flag in device memory that one-unit kernels on cubecl's stream set
//! and wait on, and that the other stream waits on and sets with CUDA's stream memory operations
//! (`cuStreamWaitValue32`, `cuStreamWriteValue32`).
//!
//! cubecl keeps its CUDA stream to itself (no handle to record an event on, no blocking stream the legacy
//! default stream would order), so the only way into its order is a kernel. For product `n` the flag goes
//! `2n + 1` ("operands ready": `StreamFlag::set` on cubecl's stream, after their writers) → the other stream
//! waits for it, runs the product, writes `2n + 2` ("done") → `StreamFlag::wait` on cubecl's stream holds
//! every later kernel until then. The values only grow, so every wait is "at least", and a flag read early or late
//! cannot pass a wait it should not (a wait finds the flag at its mark or one below: CUDA's cyclic "at least",
//! `(int32)(flag − value) ≥ 0`, is then plain ≥); after 2³¹ − 1 products the marks run out, and the caller
//! starts the flag again from zero once the other stream is idle (`restart`). A new or restarted flag's zero is in
//! device memory before either returns, so the other stream's next wait cannot read what was there before.
//!
//! No wait is queued before what satisfies it is on its stream: the other stream's wait for "ready" only once
//! the set is on cubecl's stream (cubecl launches from its device thread, in the order of the client's calls,
//! so a blocking call on the client after `set` is that point), and `wait` for "done" only once the other
//! stream's write is queued. The order the host queues them in is then an order the device can run them in,
//! one after another. CUDA does not see these dependencies: a context-wide synchronization (a kernel's lazy
//! loading at its first launch, Linux's default since CUDA 12.2; `cuMemFree`) waits for every queued wait,
//! and two streams may share one hardware queue; a wait queued before its satisfier would then wait forever.
//!
//! The wait spins one unit on one multiprocessor while the product runs on the others; its reads are
//! atomic (`atomicAdd(p, 0)` in CUDA C++: the compiler cannot hoist them out of the loop).

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Sets `flag[0]` to `value` once the kernels before it on the stream are done; or, `wait`, returns once
/// `flag[0]` holds `value` or more, holding the kernels after it on the stream until then.
#[cube(launch)]
fn flag_kernel(flag: &Tensor<Atomic<u32>>, value: u32, #[comptime] wait: bool, #[comptime] _revision: u64) {
    if ABSOLUTE_POS == 0 {
        if wait {
            loop {
                if Atomic::load(&flag[0]) >= value {
                    break;
                }
            }
        } else {
            Atomic::store(&flag[0], value);
        }
    }
}

/// One flag on one device: the values of the next product's "ready" and "done" marks.
pub struct StreamFlag<R: CubeRuntime> {
    flag: CubeTensor<R>,
    last: u32,
}

impl<R: CubeRuntime> StreamFlag<R> {
    /// A flag at zero, in device memory when this returns: cubecl writes it with an asynchronous copy on its
    /// stream, and the other stream's first wait, queued on no order of cubecl's, could otherwise read the
    /// memory before the zero lands: what an earlier tensor left there may pass the wait at once, and a zero
    /// landing after the product's "done" mark leaves the spin waiting for that mark forever.
    pub fn new(client: ComputeClient<R>, device: R::Device) -> Self {
        let handle = client.create_from_slice(&0u32.to_ne_bytes());
        let flag = CubeTensor::new_contiguous(client, device, [1].into(), handle, DType::U32);
        let flag = StreamFlag { flag, last: 0 };
        flag.wait_until_written();
        flag
    }

    /// The next product's marks `(ready, done)`; none when they would wrap (`restart` first).
    pub fn next_marks(&mut self) -> Option<(u32, u32)> {
        let ready = self.last.checked_add(1)?;
        let done = ready.checked_add(1)?;
        self.last = done;
        Some((ready, done))
    }

    /// Sets the flag back to zero, in device memory when this returns (as `new`). Only while the other
    /// stream has no work that reads or writes it: a wait for a high mark still queued there would pass at
    /// once on the old value or hang on the new one. cubecl's own queued waits run before the zero, in its
    /// stream's order, and pass once the other stream's last "done" is written.
    pub fn restart(&mut self) {
        self.set(0);
        self.wait_until_written();
        self.last = 0;
    }

    /// Returns once cubecl's stream has done everything queued on it, the flag's last write included.
    fn wait_until_written(&self) {
        if let Err(e) = cubecl::future::block_on(self.flag.client.sync()) {
            panic!("stream order: waiting for the flag's write on cubecl's stream failed: {e:?}");
        }
    }

    /// The flag's tensor (its device address is what the other stream waits on and writes).
    pub fn tensor(&self) -> &CubeTensor<R> {
        &self.flag
    }

    /// Queues on cubecl's stream the setting of the flag to `value`: on the stream once a blocking call on
    /// the same client after this one (a resource look-up, a read) has returned.
    pub fn set(&self, value: u32) {
        self.launch(value, false);
    }

    /// Queues on cubecl's stream a wait for the flag to reach `value`.
    pub fn wait(&self, value: u32) {
        self.launch(value, true);
    }

    fn launch(&self, value: u32, wait: bool) {
        flag_kernel::launch::<R>(
            &self.flag.client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            self.flag.clone().into_tensor_arg(),
            value,
            wait,
            super::REVISION,
        );
    }

    /// The flag's value, read back (tests).
    #[cfg(test)]
    pub fn read(&self) -> u32 {
        let bytes = self.flag.client.read_one(self.flag.handle.clone());
        let bytes = bytes.expect("the flag reads back");
        u32::from_ne_bytes(bytes[..4].try_into().expect("four bytes"))
    }
}

/// The launches CUDA makes (`cuda_source`).
#[cfg(all(test, feature = "vulkan"))]
pub(super) fn cuda_variants(client: &super::cuda_source::Client) -> Vec<super::cuda_source::Variant> {
    use super::cuda_source::{Runtime, Variant, settings, tensor};
    [(false, "set"), (true, "wait")]
        .map(|(wait, name)| {
            Variant::new(
                format!("stream order: {name} flag"),
                flag_kernel::FlagKernel::<Runtime>::new(
                    settings(1),
                    client.clone(),
                    tensor(),
                    (),
                    wait,
                    super::REVISION,
                ),
            )
        })
        .into()
}

#[cfg(all(test, feature = "vulkan"))]
mod tests {
    use cubecl::wgpu::WgpuRuntime;

    use super::*;

    /// A new flag on lavapipe, or none (and why) where Vulkan is missing.
    fn lavapipe_flag() -> Option<StreamFlag<WgpuRuntime>> {
        if let Err(why) = crate::backend::vulkan_ready(false) {
            eprintln!("skipped: {why}");
            return None;
        }
        let client = <WgpuRuntime as cubecl::Runtime>::client(&Default::default());
        Some(StreamFlag::new(client, Default::default()))
    }

    #[test]
    fn marks_grow_two_a_product_and_end_before_they_wrap() {
        let Some(mut flag) = lavapipe_flag() else { return };
        assert_eq!(flag.next_marks(), Some((1, 2)));
        assert_eq!(flag.next_marks(), Some((3, 4)));
        flag.last = u32::MAX - 2;
        assert_eq!(flag.next_marks(), Some((u32::MAX - 1, u32::MAX)));
        assert_eq!(flag.next_marks(), None);
        flag.last = u32::MAX - 1;
        assert_eq!(flag.next_marks(), None);
        flag.restart();
        assert_eq!(flag.read(), 0);
        assert_eq!(flag.next_marks(), Some((1, 2)));
    }

    /// On one stream (lavapipe's) a wait follows its set: the wait for a value set returns, as does the wait
    /// for a lower one, and the flag holds what was set last.
    #[test]
    fn a_wait_for_a_value_set_returns() {
        let Some(mut flag) = lavapipe_flag() else { return };
        assert_eq!(flag.read(), 0, "a new flag is zero");
        let (ready, done) = flag.next_marks().expect("marks left");
        flag.set(ready);
        flag.wait(ready);
        assert_eq!(flag.read(), ready);
        flag.set(done);
        flag.wait(ready);
        flag.wait(done);
        assert_eq!(flag.read(), done);
    }
}
