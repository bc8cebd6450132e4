//! AdamW with 8-bit moments against bitsandbytes (tests/fixtures/optim/make_q8_fixture.py): its dynamic
//! maps, its block-wise quantization of fixed values, and four AdamW8bit steps on fixed gradients; shared
//! by the CPU tests and the fused-backend ones (u8 tensors, gathers and the quantizer's arithmetic there).

use std::collections::HashMap;

use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use kiln::train::optim::{AdamW, AdamWConfig, MomentDtype, step};
use kiln::train::quant8::{self, Map};
use safetensors::SafeTensors;

#[derive(Module, Debug)]
struct Pair<B: Backend> {
    weight: Param<Tensor<B, 2>>,
    bias: Param<Tensor<B, 1>>,
}

struct Fixture {
    bytes: Vec<u8>,
}

impl Fixture {
    fn load() -> Self {
        let path = super::project_dir().join("tests/fixtures/optim/q8_fixture.safetensors");
        Fixture { bytes: std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())) }
    }

    fn tensors(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("the fixture is a safetensors file")
    }

    fn f32s(&self, name: &str) -> Vec<f32> {
        super::training::f32s(&self.tensors().tensor(name).unwrap_or_else(|e| panic!("{name}: {e}")))
    }

    /// The generator's settings (lr, betas, eps, weight decay, steps), from the file's metadata.
    fn settings(&self) -> serde_json::Value {
        let (_, metadata) = SafeTensors::read_metadata(&self.bytes).expect("a safetensors header");
        let text = metadata.metadata().as_ref().and_then(|m| m.get("settings").cloned()).expect("settings metadata");
        serde_json::from_str(&text).expect("settings are JSON")
    }

    fn codes(&self, name: &str) -> Vec<f32> {
        let t = self.tensors().tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        t.data().chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32).collect()
    }
}

/// Code indices that differ from bitsandbytes' must be neighbours whose codes are equally near the value
/// (a tie that f32 rounding of the value's scaling decides); returns how many differ.
fn assert_codes_agree(what: &str, got: &[f32], want: &[f32], map: Map, scaled: Option<&[f32]>) -> usize {
    assert_eq!(got.len(), want.len(), "{what}: code counts");
    let codes = map.codes();
    let mut differ = 0;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g == w {
            continue;
        }
        differ += 1;
        assert!((g - w).abs() == 1.0, "{what}[{i}]: code {g}, bitsandbytes {w}");
        if let Some(x) = scaled {
            let (a, b) = ((codes[*g as usize] - x[i]).abs(), (codes[*w as usize] - x[i]).abs());
            assert!((a - b).abs() <= 1e-6 * x[i].abs().max(1e-6), "{what}[{i}]: {x:?} is nearer one of them", x = x[i]);
        }
    }
    differ
}

/// The maps, block-wise quantization and four AdamW8bit steps of the fixture on backend `B`: parameters
/// within `tolerance` of bitsandbytes' (relative to their largest magnitude), and the final moments' codes
/// equal up to rounding ties.
pub fn assert_8bit_adamw_follows_bitsandbytes<B: AutodiffBackend>(tolerance: f32)
where
    B::InnerBackend: kiln::train::optim::OptimizerOps,
{
    let f = Fixture::load();
    let device = B::Device::default();
    for (map, name) in [(Map::Signed, "signed"), (Map::Unsigned, "unsigned")] {
        let want = f.f32s(&format!("map.{name}"));
        for (i, (a, b)) in map.codes().iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= 2e-7 * b.abs(), "{name} map[{i}]: {a} vs bitsandbytes {b}");
        }
        let input = f.f32s(&format!("quantize.{name}.input"));
        let n = input.len();
        let tensor = Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(input.clone(), [n]), &device);
        let (codes, scales) = quant8::quantize(tensor, map).to_host();
        assert_eq!(scales, f.f32s(&format!("quantize.{name}.absmax")), "{name}: block scales");
        let scaled: Vec<f32> =
            input.iter().enumerate().map(|(i, x)| x / scales[i / quant8::BLOCK].max(1e-38)).collect();
        let differ =
            assert_codes_agree(name, &codes[..n], &f.codes(&format!("quantize.{name}.codes")), map, Some(&scaled));
        eprintln!("{name}: {differ} of {n} codes differ from bitsandbytes' (rounding ties)");
        assert!(differ <= 2, "{name}: {differ} codes differ from bitsandbytes'");
    }

    let settings = f.settings();
    let number = |key: &str| settings[key].as_f64().unwrap_or_else(|| panic!("settings.{key}"));
    let adamw = AdamWConfig {
        beta1: number("beta1"),
        beta2: number("beta2"),
        eps: number("eps"),
        weight_decay: number("weight_decay"),
        moments: MomentDtype::Q8,
        masters: kiln::train::optim::Masters::F32,
    };
    let weight = Tensor::<B, 2>::from_data(TensorData::new(f.f32s("adamw.weight.initial"), [40, 130]), &device);
    let bias = Tensor::<B, 1>::from_data(TensorData::new(f.f32s("adamw.bias.initial"), [64]), &device);
    let mut model = Pair { weight: Param::from_tensor(weight), bias: Param::from_tensor(bias) };
    let mut opt = AdamW::<B::InnerBackend>::new(adamw);
    for k in 0..number("steps") as usize {
        let mut grads = GradientsParams::new();
        let g = |name: &str, shape: Vec<usize>| TensorData::new(f.f32s(&format!("adamw.{name}.grad.{k}")), shape);
        grads.register(model.weight.id, Tensor::<B::InnerBackend, 2>::from_data(g("weight", vec![40, 130]), &device));
        grads.register(model.bias.id, Tensor::<B::InnerBackend, 1>::from_data(g("bias", vec![64]), &device));
        model = step::<B, _>(model, &mut opt, &grads, number("lr"), None).0;
        let params =
            [("weight", super::parity::values(model.weight.val())), ("bias", super::parity::values(model.bias.val()))];
        for (name, got) in params {
            let want = f.f32s(&format!("adamw.{name}.after.{k}"));
            let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!((a - b).abs() <= tolerance * scale, "step {k} {name}[{i}]: {a} vs bitsandbytes {b}");
            }
        }
    }
    let names = HashMap::from([(model.weight.id, "weight".to_string()), (model.bias.id, "bias".to_string())]);
    let state: HashMap<String, Vec<f32>> =
        opt.export_state(&names).unwrap().into_iter().map(|(k, t)| (k, t.data)).collect();
    assert!(state.contains_key("bias.m") && !state.contains_key("bias.m.q8"), "small tensors keep f32 moments");
    for (moment, map) in [("m", Map::Signed), ("v", Map::Unsigned)] {
        let want = f.f32s(&format!("adamw.weight.{moment}.absmax"));
        let got = &state[&format!("weight.{moment}.absmax")];
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= tolerance.max(1e-6) * b.abs(), "{moment} absmax[{i}]: {a} vs {b}");
        }
        let codes = &state[&format!("weight.{moment}.q8")];
        let what = format!("weight.{moment}");
        let differ =
            assert_codes_agree(&what, &codes[..5200], &f.codes(&format!("adamw.weight.{moment}.codes")), map, None);
        eprintln!("{what}: {differ} of 5200 codes differ from bitsandbytes' (rounding ties)");
        assert!(differ <= 5, "{what}: {differ} of 5200 codes differ from bitsandbytes'");
    }
}
