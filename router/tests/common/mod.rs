//! What the router's test binaries share.

use std::sync::{Arc, OnceLock};

use tandem_router::ServedModel;

/// The default model's tokenizer and template, loaded once per test binary.
pub fn served_model() -> Arc<ServedModel> {
    static MODEL: OnceLock<Arc<ServedModel>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let path = tandem_model::default_model_path();
            assert!(
                path.exists(),
                "{} missing: run scripts/test",
                path.display()
            );
            Arc::new(tandem_router::load_model(&path, None).unwrap())
        })
        .clone()
}
