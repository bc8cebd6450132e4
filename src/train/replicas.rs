//! Data-parallel training on one node (`train.devices`): a replica of the model and its AdamW state per
//! device, each running its share of every optimizer step's micro-batches, the gradient sums added across
//! the replicas by burn's collective engine (`burn_collective::all_reduce`), then the same clipping and
//! update on every replica, so the replicas stay equal and the run trains as one device would (up to the
//! order of the f32 sums).
//!
//! The trainer's thread is replica 0 and keeps the run (metrics, states, exports); `Replicas` runs the
//! others on threads of their own and hands them their shares. Every replica makes the same collective calls
//! in the same order each step, whatever its share held (nothing, or a failure: it then adds zeros and says
//! so afterwards), so no replica waits for ever on one that stopped.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Barrier, Mutex};
use std::thread::JoinHandle;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend, DeviceOps};
use burn::tensor::{FloatDType, Tensor, TensorPrimitive};
use burn_collective::{CollectiveConfig, PeerId, ReduceOperation};

use super::TrainError;
use super::data::TrainData;
use super::step::{MicroBatch, StepRule};
use super::validation::BatchSums;
use crate::backend::zeros_in;
use crate::models::routing::ExpertLoad;

/// The devices of `count` replicas on `device`'s backend: device indices 0..count, or the one device `count`
/// times where the backend has a single device (the CPU: replicas there check the data-parallel path, they do
/// not add compute).
pub fn replica_devices<B: Backend>(device: &B::Device, count: usize) -> Result<Vec<B::Device>, TrainError> {
    crate::backend::consecutive_devices::<B>(device, count).map_err(|available| {
        TrainError::Device(format!(
            "train.devices = {count} from device index {}, but the backend sees {available} devices",
            device.id().index_id
        ))
    })
}

/// On CUDA every replica needs a GPU of its own: `count` must not exceed the GPUs the driver shows (the CPU,
/// and a single Vulkan device, let the replicas share it: a check of the path).
pub fn check_gpus<B: Backend>(device_name: &str, count: usize) -> Result<(), TrainError> {
    if device_name != "cuda" || count <= 1 {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    check_nccl(count)?;
    let available = B::device_count(B::Device::default().id().type_id);
    if count > available {
        return Err(TrainError::Device(format!(
            "train.devices = {count} on cuda, but the driver shows {available} GPU(s): one replica a GPU"
        )));
    }
    Ok(())
}

/// burn's collective moves the replicas' sums between GPUs with NCCL, which cudarc loads at the first transfer:
/// missing, a device thread would panic there, after every replica has loaded the model. Looked for first,
/// by the names cudarc tries.
#[cfg(feature = "cuda")]
fn check_nccl(count: usize) -> Result<(), TrainError> {
    // SAFETY: opens and closes the library by name, as cudarc's own lookup does; nothing of it is called.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Ok(());
    }
    let names: Vec<String> =
        cudarc::get_lib_name_candidates("nccl").into_iter().filter(|n| n.starts_with("libnccl.so")).collect();
    Err(TrainError::Device(format!(
        "train.devices = {count} on cuda needs NCCL (burn's collective sums the replicas' gradients with it), and \
         no library of the names cudarc loads it by is found ({}): install NCCL's development package, or link \
         libnccl.so to a libnccl.so.2 (PyTorch's nvidia-nccl wheel ships one) in a folder on LD_LIBRARY_PATH",
        names.join(", ")
    )))
}

/// What the replicas pool on the host each step (they are threads of one process):
/// - which parameters had a gradient on any replica: the union, so that a parameter the step's passes never
///   reached on any replica stays without a gradient, and without an update (AdamW skips it), exactly as on
///   one device;
/// - the routing loads of their micro-batches, summed, which move the MoE expert bias alike on every replica.
struct StepBoard {
    union: Mutex<Vec<bool>>,
    expert_load: Mutex<ExpertLoad>,
    barrier: Barrier,
}

impl StepBoard {
    fn union(&self, mine: &[bool]) -> Vec<bool> {
        self.pool(
            &self.union,
            |union| {
                union.resize(mine.len(), false);
                union.iter_mut().zip(mine).for_each(|(u, &m)| *u |= m);
            },
            |union| union.fill(false),
        )
    }

    fn sum_expert_loads(&self, mine: &ExpertLoad) -> ExpertLoad {
        self.pool(&self.expert_load, |sum| sum.add(mine), |sum| *sum = ExpertLoad::default())
    }

    /// Every replica adds its part to `board`, then each reads the whole once all have added theirs; one
    /// clears it after all have read it, before any adds the next step's.
    fn pool<T: Clone>(&self, board: &Mutex<T>, add: impl FnOnce(&mut T), clear: impl FnOnce(&mut T)) -> T {
        add(&mut board.lock().unwrap_or_else(|e| e.into_inner()));
        self.barrier.wait();
        let whole = board.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if self.barrier.wait().is_leader() {
            clear(&mut board.lock().unwrap_or_else(|e| e.into_inner()));
        }
        self.barrier.wait();
        whole
    }
}

/// Unregisters `peer` from burn's collective. A replica that leaves early has already reported why, so its
/// error here says nothing more.
fn leave<B: Backend>(peer: PeerId) {
    let _ = burn_collective::finish_collective::<B>(peer);
}

/// One replica's place in the collective: its peer id and the step's shared board.
pub struct GradientSync {
    peer: PeerId,
    board: Arc<StepBoard>,
}

impl GradientSync {
    /// The sync of every replica of `count` (registered with burn's collective by `register`).
    fn group(count: usize) -> Vec<GradientSync> {
        let board = Arc::new(StepBoard {
            union: Mutex::new(Vec::new()),
            expert_load: Mutex::new(ExpertLoad::default()),
            barrier: Barrier::new(count),
        });
        (0..count).map(|r| GradientSync { peer: PeerId(r as u32), board: board.clone() }).collect()
    }

    /// The routing loads of every replica's share of the step, summed (each replica calls it, or none does).
    pub fn sum_expert_loads(&self, mine: &ExpertLoad) -> ExpertLoad {
        self.board.sum_expert_loads(mine)
    }

    fn register<B: Backend>(&self, device: &B::Device, count: usize) -> Result<(), TrainError> {
        let config = CollectiveConfig::default().with_num_devices(count);
        burn_collective::register::<B>(self.peer, device.clone(), config)
            .map_err(|e| TrainError::Device(format!("replica {}: joining the collective: {e:?}", self.peer.0)))
    }

    fn finish<B: Backend>(&self) {
        leave::<B>(self.peer);
    }

    /// The sum over all replicas of each parameter's gradient sum `grads` (f32, from `F32Accumulator`), in
    /// `model`'s parameter order; zeros stand in where this replica has none but another has.
    pub fn all_reduce<B: AutodiffBackend, M: Module<B>>(
        &self,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams, TrainError> {
        let mut mine = Present::<B> { grads: &grads, present: Vec::new(), _backend: Default::default() };
        model.visit(&mut mine);
        let present = self.board.union(&mine.present);
        let mut reduce = Reduce::<B> {
            peer: self.peer,
            grads: &mut grads,
            present: &present,
            index: 0,
            error: None,
            _backend: Default::default(),
        };
        model.visit(&mut reduce);
        match reduce.error {
            Some(e) => Err(TrainError::Device(format!("replica {}: all-reduce of the gradients: {e}", self.peer.0))),
            None => Ok(grads),
        }
    }
}

struct Present<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    present: Vec<bool>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Present<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.present.push(self.grads.get::<B::InnerBackend, D>(param.id).is_some());
    }
}

struct Reduce<'a, B: AutodiffBackend> {
    peer: PeerId,
    grads: &'a mut GradientsParams,
    present: &'a [bool],
    index: usize,
    error: Option<String>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Reduce<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let index = self.index;
        self.index += 1;
        // Every replica makes this call for the same parameters in the same order, even after an error of
        // its own, so none waits for ever.
        if !self.present.get(index).copied().unwrap_or(false) {
            return;
        }
        let grad = self.grads.remove::<B::InnerBackend, D>(param.id).unwrap_or_else(|| {
            let value = param.val();
            zeros_in::<B::InnerBackend, D>(value.dims(), FloatDType::F32, &value.device())
        });
        match burn_collective::all_reduce::<B::InnerBackend>(
            self.peer,
            grad.into_primitive().tensor(),
            ReduceOperation::Sum,
        ) {
            Ok(sum) => {
                self.grads.register(param.id, Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(sum)))
            }
            Err(e) => {
                self.error.get_or_insert(format!("{e:?}"));
            }
        }
    }
}

/// A replica's share of one optimizer step: its micro-batches with their index in the step, the step's
/// supervised count (the loss's normalizer, over every replica's micro-batches) and its learning rate.
pub struct Share {
    pub batches: Vec<(usize, MicroBatch)>,
    pub supervised: f32,
    pub rule: StepRule,
}

/// What a replica's share did: its micro-batches' losses by index in the step, and the step's global gradient
/// norm (the same on every replica); an error when the share failed (the replica took part in the sum with
/// zeros first).
pub type ShareOutcome = Result<super::step::ShardOutcome, TrainError>;

/// Splits a step's micro-batches (or the validation's) among `count` replicas, round robin: micro-batch `i`
/// goes to replica `i % count`, with its index.
pub fn split<T>(batches: impl IntoIterator<Item = T>, count: usize) -> Vec<Vec<(usize, T)>> {
    let count = count.max(1);
    let mut shares: Vec<Vec<(usize, T)>> = (0..count).map(|_| Vec::new()).collect();
    for (i, batch) in batches.into_iter().enumerate() {
        shares[i % count].push((i, batch));
    }
    shares
}

/// A replica's share of a validation measure: the numbers of the split's micro-batches it runs.
pub struct ValidationShare {
    pub data: Arc<TrainData>,
    pub batches: Vec<usize>,
    pub micro_batch: usize,
    pub pad_multiple: usize,
}

/// Each of the share's micro-batches' loss sums by source, with its number.
pub type ValidationOutcome = Result<Vec<(usize, BatchSums)>, TrainError>;

/// What a replica thread is handed: a step's share, or a validation measure's.
enum Job {
    Step(Share),
    Validate(ValidationShare),
}

enum JobOutcome {
    Step(ShareOutcome),
    Validate(ValidationOutcome),
}

/// Runs `f`, turning a panic into an error (a replica's share: it must still reach the collective calls).
pub fn catch<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, TrainError> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        TrainError::Device(format!("{what} panicked: {}", crate::device_panics::payload_text(payload.as_ref())))
    })
}

/// How a replica thread builds its model and optimizer on its device (the trainer's own loading, so every
/// replica starts from the same weights and state) and runs its shares.
pub trait ReplicaWork<B: AutodiffBackend>: Clone + Send + 'static {
    type State;
    fn load(&self, device: &B::Device) -> Result<Self::State, TrainError>;
    fn run(&self, state: &mut Self::State, share: Share, sync: &GradientSync) -> ShareOutcome;
    /// The validation loss sums of the share's micro-batches under the replica's model (equal to every other
    /// replica's between steps).
    fn validate(&self, state: &mut Self::State, share: &ValidationShare) -> ValidationOutcome;
}

/// The replicas beyond the trainer's own (replica 0): a thread each, fed shares over a channel.
pub struct Replicas<B: AutodiffBackend> {
    jobs: Vec<Sender<Job>>,
    outcomes: Vec<Receiver<JobOutcome>>,
    threads: Vec<JoinHandle<()>>,
    /// A replica stopped mid-step: its thread may be waiting in the collective, so it is not joined.
    failed: bool,
    own: PeerId,
    _backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> Replicas<B> {
    /// Starts a replica thread on each of `devices[1..]` and waits until each has loaded; then every replica,
    /// the caller's (`devices[0]`, whose sync is returned) with them, joins burn's collective (a registration
    /// returns once all have registered, so none joins before all have loaded). `Ok(None)` for one device.
    pub fn start<W: ReplicaWork<B>>(
        devices: &[B::Device],
        work: W,
    ) -> Result<Option<(Replicas<B>, GradientSync)>, TrainError> {
        let count = devices.len();
        if count <= 1 {
            return Ok(None);
        }
        burn_collective::reset_collective::<B::InnerBackend>();
        let mut syncs = GradientSync::group(count).into_iter();
        let own = syncs.next().ok_or_else(|| TrainError::Config("no replicas".into()))?;
        let mut replicas = Replicas {
            jobs: Vec::new(),
            outcomes: Vec::new(),
            threads: Vec::new(),
            failed: false,
            own: own.peer,
            _backend: std::marker::PhantomData,
        };
        let (mut loaded, mut go) = (Vec::new(), Vec::new());
        for (index, sync) in syncs.enumerate().map(|(i, s)| (i + 1, s)) {
            let (job_tx, job_rx) = channel::<Job>();
            let (out_tx, out_rx) = channel::<JobOutcome>();
            let (loaded_tx, loaded_rx) = channel::<Result<(), TrainError>>();
            let (go_tx, go_rx) = channel::<()>();
            let device = devices[index].clone();
            let work = work.clone();
            let thread = std::thread::Builder::new()
                .name(format!("kiln-replica-{index}"))
                .spawn(move || {
                    let mut state = match catch("loading the replica", || work.load(&device)).and_then(|r| r) {
                        Ok(state) => state,
                        Err(e) => {
                            let _ = loaded_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = loaded_tx.send(Ok(()));
                    // The trainer says go once every replica has loaded (else it drops the sender).
                    if go_rx.recv().is_err() || sync.register::<B::InnerBackend>(&device, count).is_err() {
                        return;
                    }
                    while let Ok(job) = job_rx.recv() {
                        let outcome = match job {
                            Job::Step(share) => JobOutcome::Step(work.run(&mut state, share, &sync)),
                            Job::Validate(share) => JobOutcome::Validate(
                                catch("the validation", || work.validate(&mut state, &share)).and_then(|r| r),
                            ),
                        };
                        if out_tx.send(outcome).is_err() {
                            break;
                        }
                    }
                    sync.finish::<B::InnerBackend>();
                })
                .map_err(|e| TrainError::Device(format!("starting replica {index}: {e}")))?;
            replicas.jobs.push(job_tx);
            replicas.outcomes.push(out_rx);
            replicas.threads.push(thread);
            loaded.push(loaded_rx);
            go.push(go_tx);
        }
        for (i, loaded) in loaded.into_iter().enumerate() {
            let answer = loaded.recv().unwrap_or_else(|_| Err(TrainError::Device("its thread ended".into())));
            if let Err(e) = answer {
                // Dropping `go` sends every loaded replica home.
                return Err(TrainError::Device(format!("replica {} on {:?}: {e}", i + 1, devices[i + 1])));
            }
        }
        for go in go {
            go.send(()).map_err(|_| TrainError::Device("a replica ended before joining the collective".into()))?;
        }
        own.register::<B::InnerBackend>(&devices[0], count)?;
        Ok(Some((replicas, own)))
    }

    /// All replicas, the trainer's own included.
    pub fn count(&self) -> usize {
        self.jobs.len() + 1
    }

    /// Hands replica `r + 1` its share `shares[r]` of the step.
    pub fn send(&mut self, shares: Vec<Share>) -> Result<(), TrainError> {
        self.send_jobs(shares.into_iter().map(Job::Step))
    }

    /// Each replica's outcome of the step last sent.
    pub fn collect(&mut self) -> Vec<ShareOutcome> {
        let outcomes = self.collect_jobs(|outcome| match outcome {
            JobOutcome::Step(outcome) => outcome,
            JobOutcome::Validate(_) => Err(TrainError::Device("a replica answered a step with a validation".into())),
        });
        self.failed |= outcomes.iter().any(Result::is_err);
        outcomes
    }

    /// Hands replica `r + 1` its share `shares[r]` of a validation measure.
    pub fn send_validation(&mut self, shares: Vec<ValidationShare>) -> Result<(), TrainError> {
        self.send_jobs(shares.into_iter().map(Job::Validate))
    }

    /// Each replica's outcome of the validation share last sent (a validation makes no collective call, so a
    /// replica whose share failed waits on nothing).
    pub fn collect_validation(&self) -> Vec<ValidationOutcome> {
        self.collect_jobs(|outcome| match outcome {
            JobOutcome::Validate(outcome) => outcome,
            JobOutcome::Step(_) => Err(TrainError::Device("a replica answered a validation with a step".into())),
        })
    }

    fn send_jobs(&mut self, jobs: impl Iterator<Item = Job>) -> Result<(), TrainError> {
        for (r, (job, sender)) in jobs.zip(&self.jobs).enumerate() {
            if sender.send(job).is_err() {
                self.failed = true;
                return Err(TrainError::Device(format!("replica {} has stopped", r + 1)));
            }
        }
        Ok(())
    }

    fn collect_jobs<T>(&self, take: impl Fn(JobOutcome) -> Result<T, TrainError>) -> Vec<Result<T, TrainError>> {
        (self.outcomes.iter().enumerate())
            .map(|(r, rx)| match rx.recv() {
                Ok(outcome) => take(outcome),
                Err(_) => Err(TrainError::Device(format!("replica {} has stopped", r + 1))),
            })
            .collect()
    }
}

impl<B: AutodiffBackend> Drop for Replicas<B> {
    fn drop(&mut self) {
        // Closing the channels ends every replica's loop; a registration that is left is dropped by the next
        // run's reset.
        self.jobs.clear();
        leave::<B::InnerBackend>(self.own);
        if !self.failed {
            for thread in self.threads.drain(..) {
                let _ = thread.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(tokens: u64) -> MicroBatch {
        MicroBatch {
            rows: 1,
            seq: 1,
            ids: vec![0],
            targets: vec![0],
            weights: vec![1.0],
            doc_lengths: vec![vec![1]],
            tokens,
        }
    }

    #[test]
    fn micro_batches_go_round_robin_with_their_index() {
        let shares = split((0..5).map(batch), 2);
        let indices: Vec<Vec<usize>> = shares.iter().map(|s| s.iter().map(|(i, _)| *i).collect()).collect();
        assert_eq!(indices, [vec![0, 2, 4], vec![1, 3]]);
        assert_eq!(shares[1][1].1.tokens, 3);
        // More replicas than micro-batches: the last ones get none.
        assert_eq!(split((0..1).map(batch), 3).iter().map(Vec::len).collect::<Vec<_>>(), [1, 0, 0]);
    }

    #[derive(burn::module::Module, Debug)]
    struct Three<B: Backend> {
        both: Param<Tensor<B, 1>>,
        first: Param<Tensor<B, 1>>,
        neither: Param<Tensor<B, 1>>,
    }

    /// Through burn's collective, two replicas' gradients are summed; one that only the first replica has
    /// is summed with zeros; one that neither has stays absent (no update, as on one device).
    /// burn's collective is one per backend type and process: tests that register with it take turns (under
    /// `cargo test`'s parallel threads one's `reset_collective` would drop the other's peers).
    static COLLECTIVE: Mutex<()> = Mutex::new(());

    fn collective_to_myself() -> std::sync::MutexGuard<'static, ()> {
        COLLECTIVE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[test]
    fn gradients_are_summed_across_replicas_and_those_none_has_stay_absent() {
        let _turn = collective_to_myself();
        type Train = crate::backend::CpuTrain;
        type Inner = <Train as AutodiffBackend>::InnerBackend;
        let device = Default::default();
        let param = |n: usize| Param::from_tensor(Tensor::<Train, 1>::zeros([n], &device));
        let model = Three { both: param(3), first: param(2), neither: param(1) };
        let syncs = GradientSync::group(2);
        burn_collective::reset_collective::<Inner>();
        let read = |grads: &GradientsParams, param: &Param<Tensor<Train, 1>>| {
            grads.get::<Inner, 1>(param.id).map(|t| t.into_data().to_vec::<f32>().unwrap())
        };
        let results: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = (syncs.iter().enumerate())
                .map(|(r, sync)| {
                    let (model, device, read) = (&model, &device, &read);
                    scope.spawn(move || {
                        sync.register::<Inner>(device, 2).unwrap();
                        let mut grads = GradientsParams::new();
                        let scale = (r * 9 + 1) as f32;
                        grads.register(model.both.id, Tensor::<Inner, 1>::from_floats([1.0, 2.0, 3.0], device) * scale);
                        if r == 0 {
                            grads.register(model.first.id, Tensor::<Inner, 1>::from_floats([4.0, 5.0], device));
                        }
                        let summed = sync.all_reduce(model, grads).unwrap();
                        sync.finish::<Inner>();
                        [read(&summed, &model.both), read(&summed, &model.first), read(&summed, &model.neither)]
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for result in results {
            assert_eq!(result, [Some(vec![11.0, 22.0, 33.0]), Some(vec![4.0, 5.0]), None]);
        }
    }

    /// A batch's sums as `ThreadNames` answers them: its number under the name of `thread`.
    fn sums(thread: &str, batch: usize) -> BatchSums {
        BatchSums { sources: vec![(thread.to_string(), batch as f32, 1)], expert_load: Default::default() }
    }

    /// Answers a validation share with its batch numbers, under the name of the thread that ran it.
    #[derive(Clone)]
    struct ThreadNames;

    impl<B: AutodiffBackend> ReplicaWork<B> for ThreadNames {
        type State = ();
        fn load(&self, _: &B::Device) -> Result<(), TrainError> {
            Ok(())
        }
        fn run(&self, _: &mut (), _: Share, _: &GradientSync) -> ShareOutcome {
            Err(TrainError::Device("this work takes no step".into()))
        }
        fn validate(&self, _: &mut (), share: &ValidationShare) -> ValidationOutcome {
            let thread = std::thread::current().name().unwrap_or_default().to_string();
            Ok(share.batches.iter().map(|&b| (b, sums(&thread, b))).collect())
        }
    }

    /// A validation is shared out as a step is, round robin, and each replica thread answers its own share.
    #[test]
    fn each_replica_validates_its_share_of_the_micro_batches() {
        let _turn = collective_to_myself();
        let device = Default::default();
        let (mut replicas, _own) =
            Replicas::<crate::backend::CpuTrain>::start(&[device; 3], ThreadNames).unwrap().unwrap();
        let shares = split(0..7, 3);
        assert_eq!(shares[0].iter().map(|(_, b)| *b).collect::<Vec<_>>(), [0, 3, 6]);
        let data = Arc::new(TrainData { rows: Vec::new(), seq_len: 0, files: Vec::new() });
        let theirs = shares[1..].iter().map(|share| ValidationShare {
            data: data.clone(),
            batches: share.iter().map(|(_, b)| *b).collect(),
            micro_batch: 1,
            pad_multiple: 0,
        });
        replicas.send_validation(theirs.collect()).unwrap();
        let answers: Vec<_> = replicas.collect_validation().into_iter().map(Result::unwrap).collect();
        let by = |thread: &str, b: usize| (b, sums(thread, b));
        assert_eq!(
            answers,
            [
                vec![by("kiln-replica-1", 1), by("kiln-replica-1", 4)],
                vec![by("kiln-replica-2", 2), by("kiln-replica-2", 5)]
            ]
        );
        // A step after it is answered as a step.
        let rule = StepRule { lr: 0.0, max_norm: None, expert_bias_rate: 0.0 };
        let step = |_| Share { batches: Vec::new(), supervised: 0.0, rule };
        replicas.send((0..2).map(step).collect()).unwrap();
        assert!(replicas.collect().iter().all(|o| o.as_ref().is_err_and(|e| e.to_string().contains("takes no step"))));
    }

    /// Each replica's answers to `steps` (one input per replica a step) pooled by `pool`, on threads.
    fn pooled<I: Sync, T: Send>(steps: &[Vec<I>], pool: impl Fn(&GradientSync, &I) -> T + Sync) -> Vec<Vec<T>> {
        let syncs = GradientSync::group(steps[0].len());
        std::thread::scope(|scope| {
            let handles: Vec<_> = syncs
                .iter()
                .enumerate()
                .map(|(r, sync)| {
                    let pool = &pool;
                    scope.spawn(move || steps.iter().map(|s| pool(sync, &s[r])).collect::<Vec<_>>())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn the_presence_union_covers_every_replica_step_after_step() {
        let steps = [
            vec![vec![true, false, false], vec![false, false, false], vec![false, false, true]],
            vec![vec![false, false, false], vec![false, true, false], vec![false, false, false]],
        ];
        for union in pooled(&steps, |sync, mine| sync.board.union(mine)) {
            assert_eq!(union, [vec![true, false, true], vec![false, true, false]]);
        }
    }

    /// Every replica reads the sum of all replicas' routing loads, afresh each step.
    #[test]
    fn the_routing_loads_are_summed_over_the_replicas_step_after_step() {
        let load = |layers: &[(usize, [u64; 2])]| ExpertLoad(layers.iter().map(|(l, c)| (*l, c.to_vec())).collect());
        let steps = [
            vec![load(&[(1, [1, 2])]), load(&[(1, [3, 0]), (2, [1, 1])]), ExpertLoad::default()],
            vec![load(&[(1, [0, 1])]), load(&[(1, [1, 0])]), load(&[(1, [0, 5])])],
        ];
        for sums in pooled(&steps, |sync, mine| sync.sum_expert_loads(mine)) {
            assert_eq!(sums, [load(&[(1, [4, 2]), (2, [1, 1])]), load(&[(1, [1, 6])])]);
        }
    }
}
