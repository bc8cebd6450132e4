//! The reference-ops switch (`kiln train --reference-ops`, `kiln bench-train --reference-ops`): training
//! through burn's plain compositions gives the hand-written ops' losses to rounding, for both architectures
//! and the MoE.
//! Its own test binary, because the switch is process-wide and the other training tests compare runs bit
//! for bit.

mod common;

use kiln::models::ModelConfig;
use kiln::models::ops::reference_ops;
use kiln::train::Precision;
use kiln::train::bench::{BenchConfig, bench_on_device};
use kiln::train::optim::MomentDtype;

#[test]
fn the_reference_compositions_train_to_the_same_losses() {
    let root = common::project_dir();
    let cfg = BenchConfig {
        seq: 48,
        micro_batch: 2,
        accumulation: 1,
        steps: 3,
        warmup: 0,
        docs_per_row: 3,
        seed: 5,
        lr: 3e-3,
        peak_tflops: None,
        activation_checkpointing: false,
        precision: Precision::F32,
        moments: MomentDtype::F32,
        reference_ops: false,
    };
    // LFM2, Qwen3.5 (DeltaNet scan op) and LFM2-MoE (grouped expert matmuls).
    for shape in ["configs/models/tiny", "configs/models/tiny-qwen3.5", "tests/fixtures/lfm2/lfm2-moe-tiny"] {
        let config = ModelConfig::from_file(&root.join(shape).join("config.json")).unwrap();
        let ops = bench_on_device(&config, &cfg, "cpu").unwrap();
        let reference = bench_on_device(&config, &BenchConfig { reference_ops: true, ..cfg.clone() }, "cpu").unwrap();
        assert!(!ops.reference_ops && reference.reference_ops, "{shape}: the results say which ran");
        assert!(!reference_ops(), "{shape}: the switch is restored after the run");
        assert_eq!(ops.losses.len(), 3);
        for (step, (a, b)) in ops.losses.iter().zip(&reference.losses).enumerate() {
            // Steps 1 and 2 run on parameters each path updated itself: forward, backward and update agree.
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{shape} step {step}: ops {a} vs reference {b}");
        }
    }
}
