//! Test models: a tiny random Llama's config and f32 tensors, for the tests of every layer of
//! the crate (the lowest module, so any test may use it).

use std::collections::BTreeMap;

use tandem_model::{ModelConfig, TensorData};

/// The config and f32 tensors of `tiny_model` (device/cpu.rs): 4 query heads over 2 KV heads, 2 layers.
pub(crate) fn tiny_tensors(seed: u64) -> (ModelConfig, BTreeMap<String, TensorData>) {
    use rand::{Rng, SeedableRng};
    use tandem_model::{GgmlType, LayerTensor, TensorName};
    let c = tiny_config();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut tensors = BTreeMap::new();
    for name in TensorName::required(&c) {
        let shape = name.shape(&c).expect("a required tensor has a shape");
        // Norm weights near 1 in scale, projections smaller so activations stay in range.
        let scale: f32 = match name {
            TensorName::Embedding | TensorName::OutputNorm => 1.0,
            TensorName::Layer(_, LayerTensor::AttnNorm | LayerTensor::FfnNorm) => 1.0,
            _ => 0.3,
        };
        let n: usize = shape.iter().product();
        let data = (0..n)
            .flat_map(|_| rng.gen_range(-scale..scale).to_le_bytes())
            .collect();
        tensors.insert(
            name.canonical(),
            TensorData {
                ty: GgmlType::F32,
                shape,
                data,
            },
        );
    }
    (c, tensors)
}

/// The shape of `tiny_model` (device/cpu.rs).
pub(crate) fn tiny_config() -> ModelConfig {
    ModelConfig {
        hidden_size: 32,
        intermediate_size: 64,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        vocab_size: 97,
        max_position_embeddings: 256,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        tie_word_embeddings: true,
        family: Default::default(),
        sliding_window: None,
        moe: None,
    }
}
