//! The golden checks with the AMX tile path switched off for this process: on a CPU with AMX the
//! other golden tests run on the tiles, so this keeps the AVX-512/AVX2 kernels covered.

mod golden_support;

use golden_support::*;
use tandem_engine::WeightFormat;

#[test]
fn greedy_tokens_equal_golden_without_amx() {
    tandem_kernels::amx::set_enabled(false);
    for format in [WeightFormat::Native, WeightFormat::F32] {
        let (mut e, recs) = engine(format, golden_config());
        check_all(&mut e, &recs);
    }
}
