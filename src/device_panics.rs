//! What a panic looks like to the user, above all one on a GPU backend's device thread. burn runs each
//! device's work on a thread of its own; when a kernel launch panics there (a burn or CubeCL bug:
//! tracel-ai/burn#5292 stopped the first GPU session), that device's stream is poisoned and every later
//! operation panics again ("Ordering is bigger than operations", thousands of times in that session's log,
//! which buried the cause) until the main thread dies on burn's `CallError`. The hook installed here prints
//! the first panic of each source location once and counts the repeats; `main` catches the main thread's
//! panic and ends with one error line naming the first panic, the thread it came from and the switches
//! that narrow it down.

use std::any::Any;
use std::sync::Mutex;

/// Panics seen so far: the first one's text, the source locations already printed, the repeats not printed.
#[derive(Debug)]
struct PanicLog {
    first: Option<String>,
    places: Vec<String>,
    repeats: usize,
}

impl PanicLog {
    const fn new() -> Self {
        PanicLog { first: None, places: Vec::new(), repeats: 0 }
    }

    /// Records a panic at `place`; true when it is the first from there (and so worth printing).
    fn record(&mut self, place: &str, text: String) -> bool {
        self.first.get_or_insert(text);
        if self.places.iter().any(|p| p == place) {
            self.repeats += 1;
            false
        } else {
            self.places.push(place.to_string());
            true
        }
    }

    fn summary(&self) -> String {
        let first = self.first.as_deref().unwrap_or("a panic that left no message");
        let repeats = match self.repeats {
            0 => String::new(),
            n => format!(" (then {n} more from places already printed)"),
        };
        if is_allocation_failure(first) {
            return format!(
                "kiln stopped: the device could not allocate memory (it is full, or the buffer is larger than its \
                 driver allows): {first}{repeats}. `kiln train` prints what the weights, gradients and optimizer \
                 state take when it starts; the rest is activations: lower --micro-batch \
                 (the global batch stays, by accumulation), add --activation-checkpointing, shorten the sequence, \
                 keep AdamW's moments in bf16 or 8 bits (--moments bf16|q8), or drop the f32 masters of bf16 \
                 weights (--masters stochastic)"
            );
        }
        format!(
            "kiln stopped on a panic: {first}{repeats}. A panic on one of burn's device threads (named DSU-… or \
             Device-…) is a burn or CubeCL failure, not bad input: on CUDA, KILN_CUDA_FUSION=off runs without \
             burn's fusion, KILN_SCAN_KERNEL=off without kiln's DeltaNet kernels, KILN_ATTENTION_KERNEL=off, \
             KILN_LOSS_KERNEL=off, KILN_NORM_KERNEL=off, KILN_CONV_KERNEL=off and KILN_OPTIM_KERNEL=off without \
             its attention, loss, norm, conv and optimizer kernels, KILN_EXPERTS_BATCHED=off with a matmul per \
             MoE expert, and --reference-ops on burn's plain compositions instead of kiln's ops"
        )
    }
}

static LOG: Mutex<PanicLog> = Mutex::new(PanicLog::new());

/// How CubeCL 0.10 words a failed device allocation (`IoError::BufferTooBig`: what CUDA's
/// `CUDA_ERROR_OUT_OF_MEMORY` becomes, and wgpu's answer to a buffer over its size limit;
/// `LaunchError::OutOfMemory`) and how the driver does.
const OUT_OF_MEMORY: [&str; 4] =
    ["can't allocate buffer of size", "out-of-memory error", "CUDA_ERROR_OUT_OF_MEMORY", "BufferTooBig"];

fn is_allocation_failure(text: &str) -> bool {
    OUT_OF_MEMORY.iter().any(|m| text.contains(m))
}

/// Whether any thread has panicked. A command whose device thread panicked may still end in an error rather
/// than a panic (burn returns the poisoned stream's failure from a sync or a read), and that error is the
/// panic's echo: `summary` names the cause.
pub fn panicked() -> bool {
    LOG.lock().map_or(true, |log| log.first.is_some())
}

/// The first panic's text when it was a failed device allocation: the command ran out of device memory.
pub fn out_of_memory() -> Option<String> {
    let log = LOG.lock().ok()?;
    log.first.clone().filter(|first| is_allocation_failure(first))
}

/// The message a panic carried (`panic!` with a literal or with a formatted string).
pub fn payload_text(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Replaces the default panic hook with one that prints each source location's first panic (as the
/// default hook does) and only counts the repeats.
pub fn install() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let place = info.location().map_or_else(String::new, |l| format!("{}:{}", l.file(), l.line()));
        let thread = std::thread::current().name().unwrap_or("unnamed").to_string();
        let text = format!("'{}' on thread '{thread}' at {place}", payload_text(info.payload()));
        // A poisoned lock (a panic while recording) prints rather than hides.
        let print = LOG.lock().map_or(true, |mut log| log.record(&place, text));
        if print {
            default(info);
        }
    }));
}

/// The error line for a command that ended in a panic: the first panic and what to try.
pub fn summary() -> String {
    LOG.lock().map_or_else(|_| PanicLog::new().summary(), |log| log.summary())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_panic_is_kept_and_repeats_from_a_place_are_counted_not_printed() {
        let mut log = PanicLog::new();
        assert!(log.record("fusion/ir.rs:500", "'index out of bounds' on thread 'DSU-0-0'".into()));
        let cascade = (0..3).map(|_| log.record("fusion/ordering.rs:49", "'Ordering is bigger…'".into()));
        assert_eq!(cascade.collect::<Vec<_>>(), [true, false, false]);
        assert!(log.record("fusion/client.rs:175", "'CallError' on thread 'main'".into()));
        assert_eq!(log.places, ["fusion/ir.rs:500", "fusion/ordering.rs:49", "fusion/client.rs:175"]);
        assert_eq!(log.repeats, 2);
        let summary = log.summary();
        assert!(summary.starts_with("kiln stopped on a panic: 'index out of bounds' on thread 'DSU-0-0' (then 2 more"));
        assert!(summary.contains("KILN_CUDA_FUSION=off"), "{summary}");
    }

    #[test]
    fn running_out_of_device_memory_says_what_takes_less() {
        let mut log = PanicLog::new();
        let text = "'called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 8589934592' on thread 'DSU-0-0'";
        log.record("cubecl-runtime/src/memory_management.rs:310", text.into());
        let summary = log.summary();
        assert!(summary.starts_with("kiln stopped: the device could not allocate memory (it is full"), "{summary}");
        assert!(summary.contains("driver allows): 'called `Result::unwrap()`"), "{summary}");
        assert!(
            summary.contains("--micro-batch")
                && summary.contains("--moments bf16|q8")
                && summary.contains("--masters stochastic"),
            "{summary}"
        );
        assert!(!summary.contains("KILN_CUDA_FUSION"), "not a burn bug: {summary}");
    }

    #[test]
    fn a_summary_without_a_recorded_panic_still_says_what_to_try() {
        let summary = PanicLog::new().summary();
        assert!(summary.contains("a panic that left no message") && !summary.contains("then"), "{summary}");
    }
}
