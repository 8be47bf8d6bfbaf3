//! The CUDA backend (feature `cuda`): TensorFlow's fused batch normalization on NVIDIA
//! GPUs, with the numbers of the CPU ops (SPEC §7) at the memory limit.
//!
//! Nothing CUDA is needed to build it: `cudarc` loads the driver and NVRTC at run time,
//! and the kernels (`kernels.cu`, [`SOURCE`]) are compiled by NVRTC for the device's
//! compute capability the first time an element type is used, then cached per device
//! and element type.
//!
//! Two levels, as on the CPU:
//! - Host slices, with the typed API's own structs: [`Gpu::forward`] and
//!   [`Gpu::backward`] take exactly what [`Problem::forward`] and [`Problem::backward`]
//!   take, validate with the same code (same errors, nothing written on error), apply
//!   the same empty-tensor rules, copy to the device, run, and copy back.
//! - Device buffers ([`DeviceBuffer`]): [`Gpu::forward_device`] and
//!   [`Gpu::backward_device`] run on data already on the GPU, asynchronously on the
//!   [`Gpu`]'s stream (what a framework adapter and the benchmark call).
//!
//! The op layer runs on the GPU through [`crate::ops::Backend::Cuda`].
//!
//! # Passes
//! | op | launches | memory traffic |
//! |---|---|---|
//! | forward, training | statistics → finalize → apply | x twice (the second time from L2 where it fits), y once |
//! | forward, inference | apply (coefficients computed in the kernel) | x, y |
//! | backward, training | reduce → finalize → apply | dy, x twice (likewise), dx |
//! | backward, inference | reduce writing dx → finalize | dy, x, dx |
//!
//! Statistics: f32 per thread around its first value, a batch of loads at a time (two
//! passes over registers, batches merged by Chan's formula), f64
//! across threads and blocks (Chan's merge for moments, plain sums for the gradient
//! sums), in a fixed order fixed by the problem's shape ([`launch`]): bit-identical
//! results run after run.
//!
//! ```no_run
//! use fusedbn::cuda::Gpu;
//! use fusedbn::{DataFormat, Problem};
//! use fusedbn::batch_norm::{Affine, Epilogue, Forward, SavedStats, TrainingStats};
//! let gpu = Gpu::new(0)?;
//! let p = Problem::new(DataFormat::Nchw, &[2, 3, 4, 4])?;
//! let x: Vec<f32> = (0..p.len()).map(|i| (i % 5) as f32).collect();
//! let (mut y, mut mean, mut var) = (vec![0.0; p.len()], vec![0.0; 3], vec![0.0; 3]);
//! let affine = Affine { scale: &[1.0, 1.0, 1.0], offset: &[0.0, 0.0, 0.0] };
//! let saved = SavedStats { mean: &mut mean, variance: &mut var };
//! gpu.forward(&p, &x, affine, Forward::Training(TrainingStats { saved, running: None }),
//!     Epilogue::plain(), &mut y)?;
//! # Ok::<(), fusedbn::Error>(())
//! ```

pub mod launch;

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use crate::batch_norm::{
    phases, Affine, Backward, Epilogue, Forward, GradEpilogue, GradInputs, Gradients, Problem,
    RunningStats, SavedStats, Statistics, TrainingStats,
};
use crate::element::{Element, Real};
use crate::error::{Error, Result};
use crate::tensor::DType;
use launch::{finalize_blocks, Geo, Plan, Traversal};

/// The CUDA C++ source of the kernels, compiled by NVRTC at run time.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every kernel the source defines (checked at module load).
pub const KERNELS: [&str; 19] = [
    "fbn_stats_cf_v",
    "fbn_stats_cf_s",
    "fbn_stats_cl_v",
    "fbn_stats_cl_s",
    "fbn_fwd_finalize",
    "fbn_apply_cf_v",
    "fbn_apply_cf_s",
    "fbn_apply_cl_v",
    "fbn_apply_cl_s",
    "fbn_reduce_cf_v",
    "fbn_reduce_cf_s",
    "fbn_reduce_cl_v",
    "fbn_reduce_cl_s",
    "fbn_bwd_finalize",
    "fbn_bapply_cf_v",
    "fbn_bapply_cf_s",
    "fbn_bapply_cl_v",
    "fbn_bapply_cl_s",
    "fbn_copy",
];

/// Bytes of one partial moment (`struct Mom`: count, mean, M2 in f64).
const MOM_BYTES: usize = 24;
/// Bytes of one partial gradient sum (`struct Sum2`: two f64).
const SUM2_BYTES: usize = 16;

fn device_err(what: impl std::fmt::Display) -> Error {
    Error::Device {
        what: what.to_string(),
    }
}

/// The NVRTC options for an element type on a device of compute capability
/// `major.minor`.
pub fn compile_options(dtype: DType, major: i32, minor: i32) -> Result<Vec<String>> {
    let code = match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::F64 => return Err(unsupported(dtype)),
    };
    Ok(vec![
        format!("--gpu-architecture=compute_{major}{minor}"),
        "--std=c++17".into(),
        format!("-DFBN_DTYPE={code}"),
    ])
}

fn unsupported(dtype: DType) -> Error {
    Error::arg(
        "x",
        "f32, f16 or bf16 data on the CUDA backend",
        dtype.to_string(),
    )
}

/// True when libnvrtc can be loaded (compiling needs no GPU).
pub fn nvrtc_present() -> bool {
    // SAFETY: a dlopen of libnvrtc (whose initializers run); nothing of it is called.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles [`SOURCE`] for `dtype` with NVRTC to PTX (no GPU needed, only libnvrtc).
pub fn compile(dtype: DType, major: i32, minor: i32) -> Result<String> {
    if !nvrtc_present() {
        return Err(device_err("libnvrtc was not found (set LD_LIBRARY_PATH)"));
    }
    let opts = CompileOptions {
        options: compile_options(dtype, major, minor)?,
        name: Some("kernels.cu".into()),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(SOURCE, opts)
        .map_err(|e| device_err(format!("NVRTC failed to compile kernels.cu: {e:?}")))?;
    Ok(ptx.to_src())
}

/// The kernels of one element type, loaded on one device.
struct Kernels {
    functions: HashMap<&'static str, CudaFunction>,
}

impl Kernels {
    fn get(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| device_err(format!("kernel {name} missing")))
    }
}

/// A GPU: its context and stream, the compiled kernels (per element type) and scratch
/// memory for partial results. Cloning is cheap and shares all of it. Every operation
/// runs on the one stream, in order.
#[derive(Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    capability: (i32, i32),
    name: String,
    multiprocessors: usize,
    l2_bytes: usize,
    group_bytes: Option<usize>,
    kernels: Arc<Mutex<HashMap<DType, Arc<Kernels>>>>,
    scratch: Arc<Mutex<Option<CudaSlice<u8>>>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("name", &self.name)
            .field("capability", &self.capability)
            .field("multiprocessors", &self.multiprocessors)
            .field("l2_bytes", &self.l2_bytes)
            .finish()
    }
}

/// A typed buffer in device memory: `len` elements of `T` (f32, f16 or bf16 data; f32
/// statistics).
pub struct DeviceBuffer<T> {
    raw: CudaSlice<u8>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> DeviceBuffer<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({} elements)", self.len)
    }
}

fn bytes_of<T: Element>(v: &[T]) -> &[u8] {
    // SAFETY: the element types (f32, f64, f16, bf16) are plain data without padding.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn bytes_of_mut<T: Element>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as above; every bit pattern is a valid value of these types.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// The statistics slices of a non-f64 element type are `f32`: `U == f32` is checked
/// through its type tag.
fn as_f32<U: Real>(v: &[U]) -> Result<&[f32]> {
    if U::DTYPE != DType::F32 {
        return Err(unsupported(DType::F64));
    }
    // SAFETY: U is f32 (its tag says so; the Element trait is sealed).
    Ok(unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<f32>(), v.len()) })
}

fn as_f32_mut<U: Real>(v: &mut [U]) -> Result<&mut [f32]> {
    if U::DTYPE != DType::F32 {
        return Err(unsupported(DType::F64));
    }
    // SAFETY: as above.
    Ok(unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<f32>(), v.len()) })
}

/// `struct ApplyArgs` of kernels.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ApplyArgs {
    coef: u64,
    mean: u64,
    var: u64,
    scale: u64,
    offset: u64,
    eps: f32,
    relu: i32,
    last: i32,
}

/// `struct GradArgs` of kernels.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GradArgs {
    dy: u64,
    x: u64,
    mask: u64,
    mean: u64,
    var: u64,
    scale: u64,
    coef: u64,
    sg: u64,
    dx: u64,
    eps: f32,
    last: i32,
}

// SAFETY: plain #[repr(C)] structs of integers and floats, laid out as in kernels.cu.
unsafe impl DeviceRepr for Geo {}
unsafe impl DeviceRepr for ApplyArgs {}
unsafe impl DeviceRepr for GradArgs {}

/// The inputs of [`Gpu::forward_device`].
#[derive(Debug)]
pub struct DeviceForward<'a, T> {
    /// `x`.
    pub x: &'a DeviceBuffer<T>,
    /// γ, `C` elements.
    pub scale: &'a DeviceBuffer<f32>,
    /// β, `C` elements.
    pub offset: &'a DeviceBuffer<f32>,
    /// The Ex op's side input (the shape of x), added before the activation.
    pub side_input: Option<&'a DeviceBuffer<T>>,
    /// The Ex op's ReLU.
    pub relu: bool,
}

/// The mode of [`Gpu::forward_device`].
#[derive(Debug)]
pub enum DeviceMode<'a> {
    /// Batch statistics, written to `saved_*`; the running statistics (when given)
    /// updated in place with `factor` as [`RunningStats`] says.
    Training {
        /// `reserve_space_1` (output).
        saved_mean: &'a mut DeviceBuffer<f32>,
        /// `reserve_space_2` (output).
        saved_variance: &'a mut DeviceBuffer<f32>,
        /// Running mean and variance, updated in place.
        running: Option<(&'a mut DeviceBuffer<f32>, &'a mut DeviceBuffer<f32>)>,
        /// `exponential_avg_factor`.
        factor: f32,
    },
    /// Population statistics.
    Inference {
        /// Mean per channel.
        mean: &'a DeviceBuffer<f32>,
        /// Variance per channel.
        variance: &'a DeviceBuffer<f32>,
    },
}

/// The inputs of [`Gpu::backward_device`].
#[derive(Debug)]
pub struct DeviceGrad<'a, T> {
    /// `y_backprop`.
    pub y_backprop: &'a DeviceBuffer<T>,
    /// `x`.
    pub x: &'a DeviceBuffer<T>,
    /// γ.
    pub scale: &'a DeviceBuffer<f32>,
    /// `reserve_space_1` (training) or the population mean (inference).
    pub mean: &'a DeviceBuffer<f32>,
    /// `reserve_space_2` (biased batch variance) or the population variance.
    pub variance: &'a DeviceBuffer<f32>,
    /// Training (the gradient flows through the batch statistics) or inference.
    pub training: bool,
    /// The forward output of a ReLU: dy counts where it is positive.
    pub relu_output: Option<&'a DeviceBuffer<T>>,
}

/// The outputs of [`Gpu::backward_device`].
#[derive(Debug)]
pub struct DeviceGradOut<'a, T> {
    /// `x_backprop`.
    pub x: &'a mut DeviceBuffer<T>,
    /// `scale_backprop`.
    pub scale: &'a mut DeviceBuffer<f32>,
    /// `offset_backprop`.
    pub offset: &'a mut DeviceBuffer<f32>,
    /// The side input's gradient (the masked dy), when wanted.
    pub side_input: Option<&'a mut DeviceBuffer<T>>,
}

/// True when a CUDA driver library can be loaded (a GPU may still be absent).
pub fn driver_present() -> bool {
    // SAFETY: a dlopen of libcuda (whose initializers run); nothing of it is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl Gpu {
    /// Opens GPU `ordinal`. Fails with a message (never panics) when no CUDA driver or
    /// no such device is there.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        if !driver_present() {
            return Err(device_err("no CUDA driver (libcuda.so) on this machine"));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| device_err(format!("cannot open CUDA device {ordinal}: {e}")))?;
        // SAFETY: without the tracking events, work on two streams would need its own
        // synchronization; every buffer of this context is used on its one stream
        // (`stream` below), in order, so there is none to need.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let attr = |a| ctx.attribute(a).map_err(device_err);
        use cudarc::driver::sys::CUdevice_attribute as A;
        let capability = ctx.compute_capability().map_err(device_err)?;
        let multiprocessors = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        let l2_bytes = attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize;
        let group_bytes = std::env::var("FUSEDBN_CUDA_GROUP_MB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map(|mb| mb.max(1) << 20);
        Ok(Gpu {
            name: ctx.name().map_err(device_err)?,
            ctx,
            stream,
            capability,
            multiprocessors,
            l2_bytes,
            group_bytes,
            kernels: Arc::default(),
            scratch: Arc::default(),
        })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability (major, minor).
    pub fn capability(&self) -> (i32, i32) {
        self.capability
    }

    /// Streaming multiprocessors.
    pub fn multiprocessors(&self) -> usize {
        self.multiprocessors
    }

    /// L2 cache size in bytes.
    pub fn l2_bytes(&self) -> usize {
        self.l2_bytes
    }

    /// Bytes of full-size inputs per channel-major group of the training passes: `None`
    /// (every channel in one launch, the default: see [`launch`]), or what
    /// `FUSEDBN_CUDA_GROUP_MB` sets, for experiments.
    pub fn group_bytes(&self) -> Option<usize> {
        self.group_bytes
    }

    /// The stream every operation runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Runs `f` (which queues work on the stream) between two CUDA events and returns
    /// the device time between them in microseconds.
    pub fn time_us(&self, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        // Timing events: cudarc's default flags (`None`) disable timing, and
        // `elapsed_ms` on such events fails with CUDA_ERROR_INVALID_HANDLE (seen on the
        // first run on an H100).
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let e0 = self.ctx.new_event(timing).map_err(device_err)?;
        let e1 = self.ctx.new_event(timing).map_err(device_err)?;
        e0.record(&self.stream).map_err(device_err)?;
        f()?;
        e1.record(&self.stream).map_err(device_err)?;
        e1.synchronize().map_err(device_err)?;
        Ok(f64::from(e0.elapsed_ms(&e1).map_err(device_err)?) * 1e3)
    }

    /// Overwrites `buf` with zero bytes (a memset; the benchmark evicts the L2 with it).
    pub fn zero<T: Element>(&self, buf: &mut DeviceBuffer<T>) -> Result<()> {
        self.stream.memset_zeros(&mut buf.raw).map_err(device_err)
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(device_err)
    }

    fn kernels(&self, dtype: DType) -> Result<Arc<Kernels>> {
        let mut cache = self
            .kernels
            .lock()
            .map_err(|_| device_err("kernel cache poisoned"))?;
        if let Some(k) = cache.get(&dtype) {
            return Ok(k.clone());
        }
        let (major, minor) = self.capability;
        let ptx = compile(dtype, major, minor)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(|e| device_err(format!("loading the kernels: {e}")))?;
        let mut functions = HashMap::new();
        for name in KERNELS {
            let f = module
                .load_function(name)
                .map_err(|e| device_err(format!("kernel {name}: {e}")))?;
            functions.insert(name, f);
        }
        let k = Arc::new(Kernels { functions });
        cache.insert(dtype, k.clone());
        Ok(k)
    }

    /// Compiles and loads the kernels of `dtype` now (else the first op does).
    pub fn prepare(&self, dtype: DType) -> Result<()> {
        self.kernels(dtype).map(|_| ())
    }

    /// A buffer of `len` elements (contents unspecified until written).
    pub fn alloc<T: Element>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        // Checked: a wrapped size would give a buffer shorter than `len` says.
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::TooLarge { shape: vec![len] })?
            .max(16);
        // SAFETY: the bytes are uninitialized device memory: `u8` has no invalid values,
        // and they reach the host only as elements of an `Element` type (f16, bf16,
        // f32, f64), every bit pattern of which is a value (unspecified until written,
        // as documented).
        let raw = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(device_err)?;
        Ok(DeviceBuffer {
            raw,
            len,
            _t: PhantomData,
        })
    }

    /// Copies `data` to a new device buffer.
    pub fn upload<T: Element>(&self, data: &[T]) -> Result<DeviceBuffer<T>> {
        let mut b = self.alloc::<T>(data.len())?;
        self.write(&mut b, data)?;
        Ok(b)
    }

    /// Overwrites `buf` with `data` (the same length).
    pub fn write<T: Element>(&self, buf: &mut DeviceBuffer<T>, data: &[T]) -> Result<()> {
        if buf.len != data.len() {
            return Err(Error::arg(
                "data",
                format!("{} elements (the buffer's)", buf.len),
                format!("{} elements", data.len()),
            ));
        }
        if data.is_empty() {
            return Ok(());
        }
        let bytes = bytes_of(data);
        let mut view = buf.raw.slice_mut(0..bytes.len());
        self.stream
            .memcpy_htod(bytes, &mut view)
            .map_err(device_err)
    }

    /// Copies `buf` back into `out` (the same length), waiting for the stream.
    pub fn read<T: Element>(&self, buf: &DeviceBuffer<T>, out: &mut [T]) -> Result<()> {
        if buf.len != out.len() {
            return Err(Error::arg(
                "out",
                format!("{} elements (the buffer's)", buf.len),
                format!("{} elements", out.len()),
            ));
        }
        if !out.is_empty() {
            let bytes = bytes_of_mut(out);
            let view = buf.raw.slice(0..bytes.len());
            self.stream.memcpy_dtoh(&view, bytes).map_err(device_err)?;
        }
        self.synchronize()
    }

    /// Copies `buf` back to a new vector.
    pub fn download<T: Element>(&self, buf: &DeviceBuffer<T>) -> Result<Vec<T>> {
        let mut v = vec![T::default(); buf.len];
        self.read(buf, &mut v)?;
        Ok(v)
    }

    fn ptr<T>(&self, b: &DeviceBuffer<T>) -> u64 {
        let (p, _sync) = b.raw.device_ptr(&self.stream);
        p
    }

    fn opt_ptr<T>(&self, b: Option<&DeviceBuffer<T>>) -> u64 {
        b.map_or(0, |b| self.ptr(b))
    }

    /// Scratch of at least `bytes` (partials, then coefficients), reused across calls.
    /// The guard is held while an op queues its launches, so that two host threads
    /// sharing this `Gpu` queue whole ops one after the other on the in-order stream and
    /// never interleave on the scratch.
    fn scratch(
        &self,
        bytes: usize,
    ) -> Result<(std::sync::MutexGuard<'_, Option<CudaSlice<u8>>>, u64)> {
        let mut s = self
            .scratch
            .lock()
            .map_err(|_| device_err("scratch poisoned"))?;
        if s.as_ref().is_none_or(|b| b.len() < bytes) {
            // SAFETY: uninitialized device memory, `u8` of any value; the scratch never
            // reaches the host (the ops' kernels write its partials and coefficients
            // before the next kernel on the in-order stream reads them).
            let raw = unsafe { self.stream.alloc::<u8>(bytes.max(1 << 16)) }.map_err(device_err)?;
            *s = Some(raw);
        }
        let p = match s.as_ref() {
            Some(buf) => buf.device_ptr(&self.stream).0,
            None => return Err(device_err("no scratch")),
        };
        Ok((s, p))
    }

    fn run<'a>(
        &'a self,
        f: &'a CudaFunction,
        grid: (u32, u32),
        block: (u32, u32),
        push: impl FnOnce(&mut cudarc::driver::LaunchArgs<'a>),
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.0, grid.1, 1),
            block_dim: (block.0, block.1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(f);
        push(&mut b);
        // SAFETY: the arguments match the kernel's signature (kernels.cu), every pointer
        // is a live buffer whose length the caller validated against the problem.
        unsafe { b.launch(cfg) }.map_err(|e| device_err(format!("launch: {e}")))?;
        Ok(())
    }

    fn kernel_name(kind: &str, plan: &Plan, elem: usize) -> String {
        let t = match plan.traversal {
            Traversal::ChannelsFirst => "cf",
            Traversal::ChannelsLast => "cl",
        };
        let v = if plan.vectorized(elem) { "v" } else { "s" };
        format!("fbn_{kind}_{t}_{v}")
    }

    /// A device copy of `bytes` bytes from `src` to `dst` (the benchmark's baseline:
    /// 16-byte streaming loads and stores over a grid that fills the device).
    pub fn copy<T: Element>(&self, src: &DeviceBuffer<T>, dst: &mut DeviceBuffer<T>) -> Result<()> {
        if src.len != dst.len {
            return Err(Error::arg("dst", "the length of src", dst.len.to_string()));
        }
        let k = self.kernels(DType::F32)?;
        let n = (src.len * std::mem::size_of::<T>() / 16) as u64;
        let blocks = (self.multiprocessors * 8) as u32;
        let (s, d) = (self.ptr(src), self.ptr(dst));
        self.run(k.get("fbn_copy")?, (blocks, 1), (launch::THREADS, 1), |b| {
            b.arg(&s).arg(&d).arg(&n);
        })
    }

    /// The forward op on device buffers (see [`Problem::forward`]): validated like it,
    /// queued on the stream. Empty tensors follow SPEC §5 (NaN statistics).
    pub fn forward_device<T: Element>(
        &self,
        p: &Problem,
        f: DeviceForward<'_, T>,
        mode: DeviceMode<'_>,
        y: &mut DeviceBuffer<T>,
    ) -> Result<()> {
        if T::DTYPE == DType::F64 {
            return Err(unsupported(T::DTYPE));
        }
        p.check_x("x", f.x.len())?;
        if let Some(s) = f.side_input {
            p.check_x("side_input", s.len())?;
        }
        p.check_c("scale", f.scale.len())?;
        p.check_c("offset", f.offset.len())?;
        p.check_x("y (output)", y.len())?;
        let c = p.channels();
        let elem = std::mem::size_of::<T>();
        let g = *p.geometry();
        let eps = p.epsilon();
        match mode {
            DeviceMode::Training {
                saved_mean,
                saved_variance,
                running,
                factor,
            } => {
                if let Some((m, v)) = &running {
                    p.check_c("running mean", m.len())?;
                    p.check_c("running variance", v.len())?;
                }
                p.check_c("saved mean (reserve_space_1, output)", saved_mean.len())?;
                p.check_c(
                    "saved variance (reserve_space_2, output)",
                    saved_variance.len(),
                )?;
                if p.is_empty() {
                    return self.empty_training_stats(
                        c,
                        saved_mean,
                        saved_variance,
                        running,
                        factor,
                    );
                }
                let k = self.kernels(T::DTYPE)?;
                let plan = launch::plan(g.outer, g.channels, g.inner, elem, 1, self.group_bytes);
                let part_bytes = c * plan.chunks as usize * MOM_BYTES;
                let (_lock, base) = self.scratch(part_bytes + 12 * c)?;
                let (part, coef) = (base, base + part_bytes as u64);
                let stats = k.get(&Self::kernel_name("stats", &plan, elem))?;
                let apply = k.get(&Self::kernel_name("apply", &plan, elem))?;
                let fin = k.get("fbn_fwd_finalize")?;
                let (x, side, yp) = (self.ptr(f.x), self.opt_ptr(f.side_input), self.ptr(y));
                let (scale, offset) = (self.ptr(f.scale), self.ptr(f.offset));
                let (sm, sv) = (self.ptr(saved_mean), self.ptr(saved_variance));
                let (rm, rv) = running
                    .as_ref()
                    .map_or((0, 0), |(m, v)| (self.ptr(m), self.ptr(v)));
                let args = ApplyArgs {
                    coef,
                    eps,
                    relu: i32::from(f.relu),
                    last: 1,
                    ..Default::default()
                };
                for grp in &plan.groups {
                    self.run(stats, grp.grid, plan.block, |b| {
                        b.arg(&grp.geo).arg(&x).arg(&part);
                    })?;
                    let (chans, chunks, first) =
                        (grp.channels as u64, plan.chunks, grp.first_channel as u64);
                    self.run(
                        fin,
                        (finalize_blocks(grp.channels), 1),
                        (launch::THREADS, 1),
                        |b| {
                            b.arg(&chans).arg(&chunks).arg(&first).arg(&part);
                            b.arg(&scale)
                                .arg(&offset)
                                .arg(&sm)
                                .arg(&sv)
                                .arg(&rm)
                                .arg(&rv);
                            b.arg(&factor).arg(&eps).arg(&coef);
                        },
                    )?;
                    self.run(apply, grp.grid, plan.block, |b| {
                        b.arg(&grp.geo).arg(&args).arg(&x).arg(&side).arg(&yp);
                    })?;
                }
                Ok(())
            }
            DeviceMode::Inference { mean, variance } => {
                p.check_c("mean", mean.len())?;
                p.check_c("variance", variance.len())?;
                if p.is_empty() {
                    return Ok(());
                }
                let k = self.kernels(T::DTYPE)?;
                let plan = launch::plan(g.outer, g.channels, g.inner, elem, 1, None);
                let apply = k.get(&Self::kernel_name("apply", &plan, elem))?;
                let args = ApplyArgs {
                    coef: 0,
                    mean: self.ptr(mean),
                    var: self.ptr(variance),
                    scale: self.ptr(f.scale),
                    offset: self.ptr(f.offset),
                    eps,
                    relu: i32::from(f.relu),
                    last: 1,
                };
                let (x, side, yp) = (self.ptr(f.x), self.opt_ptr(f.side_input), self.ptr(y));
                for grp in &plan.groups {
                    self.run(apply, grp.grid, plan.block, |b| {
                        b.arg(&grp.geo).arg(&args).arg(&x).arg(&side).arg(&yp);
                    })?;
                }
                Ok(())
            }
        }
    }

    /// SPEC §5 for the training forward of an empty `x`: the CPU's own rule
    /// ([`phases`]' `write_training_stats` with no moments), copied to the device.
    fn empty_training_stats(
        &self,
        c: usize,
        saved_mean: &mut DeviceBuffer<f32>,
        saved_variance: &mut DeviceBuffer<f32>,
        running: Option<(&mut DeviceBuffer<f32>, &mut DeviceBuffer<f32>)>,
        factor: f32,
    ) -> Result<()> {
        let (mut sm, mut sv) = (vec![0f32; c], vec![0f32; c]);
        let (mut rm, mut rv) = (vec![0f32; c], vec![0f32; c]);
        let saved = SavedStats {
            mean: &mut sm,
            variance: &mut sv,
        };
        let run = running.as_ref().map(|_| RunningStats {
            mean: &mut rm,
            variance: &mut rv,
            factor,
        });
        phases::write_training_stats::<f32>(
            &[],
            c,
            TrainingStats {
                saved,
                running: run,
            },
        );
        self.write(saved_mean, &sm)?;
        self.write(saved_variance, &sv)?;
        if let Some((m, v)) = running {
            self.write(m, &rm)?;
            self.write(v, &rv)?;
        }
        Ok(())
    }

    /// The gradient on device buffers (see [`Problem::backward`]): validated like it,
    /// queued on the stream. An empty `x` gives zero parameter gradients (SPEC §5).
    pub fn backward_device<T: Element>(
        &self,
        p: &Problem,
        i: DeviceGrad<'_, T>,
        out: DeviceGradOut<'_, T>,
    ) -> Result<()> {
        if T::DTYPE == DType::F64 {
            return Err(unsupported(T::DTYPE));
        }
        p.check_x("y_backprop", i.y_backprop.len())?;
        p.check_x("x", i.x.len())?;
        p.check_c("scale", i.scale.len())?;
        p.check_c("mean (reserve_space_1)", i.mean.len())?;
        p.check_c("variance (reserve_space_2)", i.variance.len())?;
        if let Some(y) = i.relu_output {
            p.check_x("y (relu_output)", y.len())?;
        }
        if let Some(sg) = &out.side_input {
            p.check_x("side_input_backprop (output)", sg.len())?;
        }
        p.check_x("x_backprop (output)", out.x.len())?;
        p.check_c("scale_backprop (output)", out.scale.len())?;
        p.check_c("offset_backprop (output)", out.offset.len())?;
        let c = p.channels();
        if p.is_empty() {
            let zeros = vec![0f32; c];
            self.write(out.scale, &zeros)?;
            return self.write(out.offset, &zeros);
        }
        let elem = std::mem::size_of::<T>();
        let g = *p.geometry();
        let eps = p.epsilon();
        let k = self.kernels(T::DTYPE)?;
        let inputs = 2 + usize::from(i.relu_output.is_some());
        let group = self.group_bytes.filter(|_| i.training);
        let plan = launch::plan(g.outer, g.channels, g.inner, elem, inputs, group);
        let part_bytes = c * plan.chunks as usize * SUM2_BYTES;
        let (_lock, base) = self.scratch(part_bytes + 12 * c)?;
        let (part, coef) = (base, base + part_bytes as u64);
        let reduce = k.get(&Self::kernel_name("reduce", &plan, elem))?;
        let fin = k.get("fbn_bwd_finalize")?;
        let dx = self.ptr(out.x);
        let args = GradArgs {
            dy: self.ptr(i.y_backprop),
            x: self.ptr(i.x),
            mask: self.opt_ptr(i.relu_output),
            mean: self.ptr(i.mean),
            var: self.ptr(i.variance),
            scale: self.ptr(i.scale),
            coef: 0,
            sg: self.opt_ptr(out.side_input.as_deref()),
            dx: if i.training { 0 } else { dx },
            eps,
            last: i32::from(!i.training),
        };
        let (scale, var) = (args.scale, args.var);
        let (ds, dof) = (self.ptr(out.scale), self.ptr(out.offset));
        let count = p.elements_per_channel() as f64;
        let fin_coef = if i.training { coef } else { 0 };
        let bapply = k.get(&Self::kernel_name("bapply", &plan, elem))?;
        for grp in &plan.groups {
            self.run(reduce, grp.grid, plan.block, |b| {
                b.arg(&grp.geo).arg(&args).arg(&part);
            })?;
            let (chans, chunks, first) =
                (grp.channels as u64, plan.chunks, grp.first_channel as u64);
            self.run(
                fin,
                (finalize_blocks(grp.channels), 1),
                (launch::THREADS, 1),
                |b| {
                    b.arg(&chans)
                        .arg(&chunks)
                        .arg(&first)
                        .arg(&count)
                        .arg(&part);
                    b.arg(&scale)
                        .arg(&var)
                        .arg(&eps)
                        .arg(&ds)
                        .arg(&dof)
                        .arg(&fin_coef);
                },
            )?;
            if i.training {
                let a = GradArgs {
                    coef,
                    sg: 0,
                    dx,
                    last: 1,
                    ..args
                };
                self.run(bapply, grp.grid, plan.block, |b| {
                    b.arg(&grp.geo).arg(&a);
                })?;
            }
        }
        Ok(())
    }

    /// [`Problem::forward`] on this GPU: the same arguments, the same validation and
    /// empty-tensor rules; the data is copied to the device and the results back.
    pub fn forward<T: Element>(
        &self,
        p: &Problem,
        x: &[T],
        affine: Affine<'_, T::Stat>,
        mode: Forward<'_, T::Stat>,
        epilogue: Epilogue<'_, T>,
        y: &mut [T],
    ) -> Result<()> {
        p.check_forward(x, affine, epilogue, y)?;
        match &mode {
            Forward::Training(stats) => p.check_training_stats(stats)?,
            Forward::Inference(s) => {
                p.check_c("mean", s.mean.len())?;
                p.check_c("variance", s.variance.len())?;
            }
        }
        if T::DTYPE == DType::F64 {
            return Err(unsupported(T::DTYPE));
        }
        let dx = self.upload(x)?;
        let side = epilogue.side_input.map(|s| self.upload(s)).transpose()?;
        let scale = self.upload(as_f32(affine.scale)?)?;
        let offset = self.upload(as_f32(affine.offset)?)?;
        let mut dy = self.alloc::<T>(y.len())?;
        let f = DeviceForward {
            x: &dx,
            scale: &scale,
            offset: &offset,
            side_input: side.as_ref(),
            relu: epilogue.activation == crate::batch_norm::Activation::Relu,
        };
        match mode {
            Forward::Training(TrainingStats { saved, running }) => {
                let c = p.channels();
                let (mut sm, mut sv) = (self.alloc::<f32>(c)?, self.alloc::<f32>(c)?);
                let mut run = match &running {
                    Some(r) => Some((
                        self.upload(as_f32(r.mean)?)?,
                        self.upload(as_f32(r.variance)?)?,
                        r.factor,
                    )),
                    None => None,
                };
                let factor = run.as_ref().map_or(1.0, |r| r.2);
                let mode = DeviceMode::Training {
                    saved_mean: &mut sm,
                    saved_variance: &mut sv,
                    running: run.as_mut().map(|(m, v, _)| (m, v)),
                    factor,
                };
                self.forward_device(p, f, mode, &mut dy)?;
                self.read(&dy, y)?;
                self.read(&sm, as_f32_mut(saved.mean)?)?;
                self.read(&sv, as_f32_mut(saved.variance)?)?;
                if let (Some(r), Some((m, v, _))) = (running, run) {
                    self.read(&m, as_f32_mut(r.mean)?)?;
                    self.read(&v, as_f32_mut(r.variance)?)?;
                }
            }
            Forward::Inference(s) => {
                let mean = self.upload(as_f32(s.mean)?)?;
                let variance = self.upload(as_f32(s.variance)?)?;
                self.forward_device(
                    p,
                    f,
                    DeviceMode::Inference {
                        mean: &mean,
                        variance: &variance,
                    },
                    &mut dy,
                )?;
                self.read(&dy, y)?;
            }
        }
        Ok(())
    }

    /// [`Problem::backward`] on this GPU: the same arguments, validation and
    /// empty-tensor rules; data copied to the device and the results back.
    pub fn backward<T: Element>(
        &self,
        p: &Problem,
        inputs: GradInputs<'_, T>,
        scale: &[T::Stat],
        mode: Backward<'_, T::Stat>,
        epilogue: GradEpilogue<'_, T>,
        grads: Gradients<'_, T>,
    ) -> Result<()> {
        let stats: Statistics<'_, T::Stat> = mode.statistics();
        p.check_backward(inputs, scale, stats, &epilogue, &grads)?;
        if T::DTYPE == DType::F64 {
            return Err(unsupported(T::DTYPE));
        }
        let dy = self.upload(inputs.y_backprop)?;
        let x = self.upload(inputs.x)?;
        let mask = epilogue.relu_output.map(|m| self.upload(m)).transpose()?;
        let scale_d = self.upload(as_f32(scale)?)?;
        let mean = self.upload(as_f32(stats.mean)?)?;
        let variance = self.upload(as_f32(stats.variance)?)?;
        let c = p.channels();
        let mut dx = self.alloc::<T>(grads.x.len())?;
        let (mut ds, mut dof) = (self.alloc::<f32>(c)?, self.alloc::<f32>(c)?);
        let want_side = epilogue.side_input_backprop.is_some();
        let mut sg = if want_side {
            Some(self.alloc::<T>(grads.x.len())?)
        } else {
            None
        };
        self.backward_device(
            p,
            DeviceGrad {
                y_backprop: &dy,
                x: &x,
                scale: &scale_d,
                mean: &mean,
                variance: &variance,
                training: mode.is_training(),
                relu_output: mask.as_ref(),
            },
            DeviceGradOut {
                x: &mut dx,
                scale: &mut ds,
                offset: &mut dof,
                side_input: sg.as_mut(),
            },
        )?;
        if !p.is_empty() {
            self.read(&dx, grads.x)?;
        }
        self.read(&ds, as_f32_mut(grads.scale)?)?;
        self.read(&dof, as_f32_mut(grads.offset)?)?;
        if let (Some(out), Some(sg)) = (epilogue.side_input_backprop, sg) {
            if !p.is_empty() {
                self.read(&sg, out)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The argument structs have the sizes of their kernels.cu twins (8-byte fields
    /// and pointers, then 4-byte ones, padded to 8).
    #[test]
    fn argument_structs_match_kernels_cu() {
        assert_eq!(std::mem::size_of::<Geo>(), 8 * 8);
        assert_eq!(std::mem::size_of::<ApplyArgs>(), 5 * 8 + 3 * 4 + 4);
        assert_eq!(std::mem::size_of::<GradArgs>(), 9 * 8 + 2 * 4);
        for (name, fields) in [
            ("struct Geo {", 8),
            ("struct ApplyArgs {", 8),
            ("struct GradArgs {", 11),
        ] {
            let body = &SOURCE[SOURCE.find(name).expect(name)..];
            let body = &body[..body.find("};").expect("end of struct")];
            let declared: usize = body
                .lines()
                .skip(1)
                .map(|l| l.split("//").next().unwrap_or(""))
                .map(|l| {
                    l.matches(';').count() + l.matches(',').count() * usize::from(l.contains(';'))
                })
                .sum();
            assert_eq!(declared, fields, "{name}");
        }
    }
}
