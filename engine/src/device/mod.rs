//! The devices steps run on, each a [`Backend`]: the CPU model over a host pool
//! ([`cpu::CpuBackend`]), the CPU model split over tensor-parallel rank threads
//! ([`tp_cpu::TpCpuBackend`]), the CUDA model over a device pool ([`cuda::CudaModel`]) and
//! split over GPUs, a rank thread each ([`tp_cuda::TpCudaBackend`]);
//! [`on`] picks one for a device.

pub(crate) mod cpu;
pub(crate) mod cuda;
#[cfg(any(test, feature = "fake-device"))]
pub mod fake;
pub(crate) mod ranks;
pub mod staging;
pub(crate) mod tp_cpu;
pub(crate) mod tp_cuda;

use tandem_kernels::cuda::DeviceSpec;
use tandem_model::LoadedModel;

use crate::backend::{Backend, PoolSize};
use crate::error::EngineError;
use cpu::{CpuBackend, CpuModel, WeightFormat};
use cuda::CudaModel;
use tp_cpu::{TpCpuBackend, TpCpuConfig};
use tp_cuda::TpCudaBackend;

/// The backend `device` names for `loaded`: the CPU model with its weights held as `format`
/// says, split over `tp`'s rank threads when it has more than one, or the model uploaded to a
/// CUDA device, whose decode steps run as CUDA graphs unless `eager`.
pub fn on(
    device: DeviceSpec,
    loaded: &LoadedModel,
    pool: &PoolSize,
    format: WeightFormat,
    tp: TpCpuConfig,
    eager: bool,
) -> Result<Box<dyn Backend>, EngineError> {
    // Each backend checks the pool it is given.
    if pool.gpu_memory_fraction.is_some() && device == DeviceSpec::Cpu {
        return Err(EngineError::Config(
            "--gpu-memory-fraction sizes a GPU's KV pool: on the CPU, size it with --kv-cache-mb"
                .into(),
        ));
    }
    Ok(match device {
        DeviceSpec::Cpu if tp.size > 1 => Box::new(TpCpuBackend::new(loaded, format, pool, tp)?),
        DeviceSpec::Cpu => Box::new(CpuBackend::new(CpuModel::new(loaded, format)?, pool)?),
        DeviceSpec::Cuda(n) if tp.size > 1 => Box::new(TpCudaBackend::new(n, loaded, pool, &tp)?),
        DeviceSpec::Cuda(n) => {
            let mut m = CudaModel::for_engine(n, loaded, pool)?;
            m.set_graphs(!eager);
            Box::new(m)
        }
    })
}
