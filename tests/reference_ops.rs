//! The reference-ops switch (`kiln train --reference-ops`, `kiln bench-train --reference-ops`): training
//! through burn's plain compositions gives the hand-written ops' losses to rounding, for both architectures
//! and the MoE.
//! Its own test binary, because the switch is process-wide and the other training tests compare runs bit
//! for bit.

mod common;

#[test]
fn the_reference_compositions_train_to_the_same_losses() {
    common::assert_reference_ops_agree(kiln::train::Precision::F32, 1, 1e-5);
}
