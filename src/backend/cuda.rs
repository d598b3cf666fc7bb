//! The CUDA driver as rdist uses it: telling device buffers from host
//! ones, copying between them on the caller's stream, events to wait on
//! (always bounded) and contexts. The driver is loaded at run time by
//! cudarc; nothing here is touched unless a CUDA device exists.
//!
//! cudarc panics when the driver lacks an entry point, so every driver
//! call goes through [`check`], which turns a panic into a Backend error.

use crate::error::{Error, ErrorKind, Result};
use cudarc::driver::sys::{
    self as cu, CUcontext, CUevent, CUpointer_attribute, CUresult, CUstream,
};
use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A `cudaStream_t` / `CUstream` as the caller passed it (NULL: the legacy
/// default stream).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stream(pub usize);

impl Stream {
    /// The legacy default stream.
    pub const DEFAULT: Stream = Stream(0);

    pub fn from_ptr(p: *mut c_void) -> Stream {
        Stream(p as usize)
    }

    pub fn as_cu(self) -> CUstream {
        self.0 as CUstream
    }
}

/// Where a buffer lives, as the driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Host memory (pageable, or pinned by CUDA): the CPU may touch it.
    Host,
    /// Device (or managed) memory of a device, owned by `context`.
    Device { ordinal: i32, context: usize },
}

/// The driver, once it initialised with at least one device.
#[derive(Debug)]
pub struct Cuda {
    pub devices: usize,
}

/// The driver when this process can have device buffers (a driver and at
/// least one device); `None` otherwise. Probed once per process.
pub fn driver() -> Option<&'static Cuda> {
    static DRIVER: OnceLock<Option<Cuda>> = OnceLock::new();
    DRIVER
        .get_or_init(|| cuda_devices().ok().map(|devices| Cuda { devices }))
        .as_ref()
}

/// Whether `len` bytes at `addr` are host memory for sure: no driver, an
/// empty buffer, or the driver says so. When the driver cannot say, the
/// answer is no (the buffer then takes the device path, which reports it).
pub fn is_host(addr: usize, len: usize) -> bool {
    match driver() {
        None => true,
        Some(_) if len == 0 => true,
        Some(cuda) => matches!(cuda.memory(addr), Ok(Memory::Host)),
    }
}

/// The number of CUDA devices, or why there are none usable. Never panics:
/// cudarc panics when a library or symbol is missing, so the driver's
/// presence is checked first and every driver call runs under
/// `catch_unwind`. Probed once per process.
pub fn cuda_devices() -> std::result::Result<usize, String> {
    static COUNTED: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    COUNTED.get_or_init(count_devices).clone()
}

/// Whether the driver's library loads. On Linux the driver installs
/// libcuda.so.1 (the toolkit adds libcuda.so): two lookups say no, where
/// cudarc's search tries 34 names in every library directory, about 1 ms
/// a process (a second of CPU for a 1024-rank job on one host).
fn driver_library_present() -> bool {
    if cfg!(target_os = "linux") {
        // SAFETY: opening the driver runs only its initialisers; it stays
        // loaded for cudarc, which opens it again by one of these names.
        return ["libcuda.so.1", "libcuda.so"].into_iter().any(|name| {
            unsafe { libloading::Library::new(name) }
                .map(std::mem::forget)
                .is_ok()
        });
    }
    // SAFETY: only tries to open the driver's library by its names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn count_devices() -> std::result::Result<usize, String> {
    if !driver_library_present() {
        return Err("no CUDA driver (libcuda.so not found)".to_string());
    }
    let counted = std::panic::catch_unwind(|| {
        cudarc::driver::result::init()?;
        cudarc::driver::result::device::get_count()
    });
    use cudarc::driver::sys::CUresult;
    match counted {
        Err(_) => Err("the CUDA driver could not be used (loading it failed)".to_string()),
        Ok(Err(e)) if e.0 == CUresult::CUDA_ERROR_NO_DEVICE => Err("no CUDA device".to_string()),
        Ok(Err(e)) => Err(format!("the CUDA driver failed to initialise ({:?})", e.0)),
        Ok(Ok(n)) if n <= 0 => Err("no CUDA device".to_string()),
        Ok(Ok(n)) => Ok(n as usize),
    }
}

/// Runs one driver call; a failure becomes a Backend error naming `what`
/// and the driver's text, a missing entry point too.
pub fn check(what: &str, call: impl FnOnce() -> CUresult) -> Result<()> {
    match catch_unwind(AssertUnwindSafe(call)) {
        Ok(CUresult::CUDA_SUCCESS) => Ok(()),
        Ok(rc) => Err(Error::new(
            ErrorKind::Backend,
            format!("{what} failed: {}", describe(rc)),
        )),
        Err(_) => Err(Error::new(
            ErrorKind::Backend,
            format!("{what}: the CUDA driver could not be called (a missing entry point)"),
        )),
    }
}

/// The driver's name and text for a result ("CUDA_ERROR_X: text").
pub fn describe(rc: CUresult) -> String {
    let text = catch_unwind(|| {
        let mut p: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: the driver writes a static string (or leaves NULL).
        let ok = unsafe { cu::cuGetErrorString(rc, &mut p) } == CUresult::CUDA_SUCCESS;
        // SAFETY: a non-NULL result is a NUL-terminated static string.
        (ok && !p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    })
    .ok()
    .flatten();
    match text {
        Some(t) => format!("{rc:?}: {t}"),
        None => format!("{rc:?}"),
    }
}

impl Cuda {
    /// Where `addr` points. Anything the driver does not know is host
    /// memory (plain malloc'd buffers); managed memory counts as device
    /// memory (NCCL takes it, and copies handle it). Fails when the
    /// driver cannot say: guessing "host" would have the CPU touch
    /// device memory.
    pub fn memory(&self, addr: usize) -> Result<Memory> {
        // No device memory is ever there: no driver call (it costs every
        // call with a GPU present, host buffers included).
        if addr == 0 || super::host_memory::surely_host(addr) {
            return Ok(Memory::Host);
        }
        let mut attrs = [
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        ];
        let mut memory_type: u32 = 0;
        let mut context: CUcontext = std::ptr::null_mut();
        let mut ordinal: i32 = -1;
        let mut managed: u32 = 0;
        let mut data: [*mut c_void; 4] = [
            (&mut memory_type as *mut u32).cast(),
            (&mut context as *mut CUcontext).cast(),
            (&mut ordinal as *mut i32).cast(),
            (&mut managed as *mut u32).cast(),
        ];
        let mut ask = || {
            // SAFETY: four attributes, four outputs of the documented
            // types. An address the driver does not know yields zeros and
            // success.
            check("cuPointerGetAttributes", || unsafe {
                cu::cuPointerGetAttributes(
                    attrs.len() as u32,
                    attrs.as_mut_ptr(),
                    data.as_mut_ptr(),
                    addr as cu::CUdeviceptr,
                )
            })
        };
        let mut all = ask();
        if all.is_err() && !has_current_context() {
            // A driver may want a context to answer in; this thread has
            // none (its program works on another thread).
            if let Ok(_ctx) = primary_context(0).and_then(ContextGuard::push) {
                all = ask();
            }
        }
        if let Err(e) = all {
            // A driver that lacks one of the attributes fails the whole
            // list: ask one at a time.
            return memory_one_by_one(addr).map_err(|why| {
                Error::new(
                    ErrorKind::Backend,
                    format!(
                        "cannot tell whether buffer {addr:#x} is host or device memory: {}; {why}",
                        e.message()
                    ),
                )
            });
        }
        let device = memory_type == cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 || managed != 0;
        Ok(match device {
            true => device_memory(ordinal, context),
            false => Memory::Host,
        })
    }
}

/// Whether a context is current on this thread.
fn has_current_context() -> bool {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local.
    check("cuCtxGetCurrent", || unsafe {
        cu::cuCtxGetCurrent(&mut ctx)
    })
    .is_ok()
        && !ctx.is_null()
}

/// Device memory of `ordinal`, owned by `context`. Memory mapped with
/// cuMemMap (e.g. PyTorch's expandable segments) has no context: its
/// device's primary one stands for it.
fn device_memory(ordinal: i32, context: CUcontext) -> Memory {
    Memory::Device {
        ordinal,
        context: match context.is_null() {
            false => context as usize,
            true => primary_context(ordinal).unwrap_or(0),
        },
    }
}

/// One pointer attribute (`cuPointerGetAttribute`): Ok(None) when the
/// driver does not know the address, or this attribute.
fn attribute<T: Default>(
    attr: CUpointer_attribute,
    addr: usize,
) -> std::result::Result<Option<T>, String> {
    let mut value = T::default();
    // SAFETY: `value` has the attribute's documented type.
    let rc = catch_unwind(AssertUnwindSafe(|| unsafe {
        cu::cuPointerGetAttribute((&mut value as *mut T).cast(), attr, addr as cu::CUdeviceptr)
    }))
    .map_err(|_| "cuPointerGetAttribute could not be called".to_string())?;
    match rc {
        CUresult::CUDA_SUCCESS => Ok(Some(value)),
        CUresult::CUDA_ERROR_INVALID_VALUE => Ok(None),
        rc => Err(format!(
            "cuPointerGetAttribute({attr:?}) failed: {}",
            describe(rc)
        )),
    }
}

/// `Cuda::memory` for a driver whose attribute list failed: each
/// attribute alone. A pointer whose memory type the driver does not know
/// is host memory (the driver's documented answer for pageable memory).
fn memory_one_by_one(addr: usize) -> std::result::Result<Memory, String> {
    use CUpointer_attribute as A;
    let memory_type: Option<u32> = attribute(A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)?;
    let managed: Option<u32> = attribute(A::CU_POINTER_ATTRIBUTE_IS_MANAGED, addr)?;
    let device = memory_type == Some(cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32)
        || managed.unwrap_or(0) != 0;
    if !device {
        return Ok(Memory::Host);
    }
    let context: CUcontext =
        attribute::<usize>(A::CU_POINTER_ATTRIBUTE_CONTEXT, addr)?.unwrap_or(0) as CUcontext;
    let ordinal = match attribute::<i32>(A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr)? {
        Some(o) => o,
        // An older driver: the device of the owning context.
        None if !context.is_null() => {
            let _ctx = ContextGuard::push(context as usize).map_err(|e| e.message().to_string())?;
            let mut dev: cu::CUdevice = 0;
            // SAFETY: an out-pointer to a local.
            check("cuCtxGetDevice", || unsafe { cu::cuCtxGetDevice(&mut dev) })
                .map_err(|e| e.message().to_string())?;
            dev
        }
        None => return Err("the driver names neither its device nor its context".to_string()),
    };
    Ok(device_memory(ordinal, context))
}

/// Makes a context current on this thread until dropped (then restores
/// whatever was current before).
pub struct ContextGuard {
    pushed: bool,
}

impl ContextGuard {
    pub fn push(context: usize) -> Result<ContextGuard> {
        if context == 0 {
            return Ok(ContextGuard { pushed: false });
        }
        // SAFETY: a context handle the driver gave out.
        check("cuCtxPushCurrent", || unsafe {
            cu::cuCtxPushCurrent_v2(context as CUcontext)
        })?;
        Ok(ContextGuard { pushed: true })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut old: CUcontext = std::ptr::null_mut();
            // SAFETY: pops the context pushed above.
            let _ = check("cuCtxPopCurrent", || unsafe {
                cu::cuCtxPopCurrent_v2(&mut old)
            });
        }
    }
}

/// The primary context of device `ordinal` (retained once, for the life
/// of the process, as the CUDA runtime does).
pub fn primary_context(ordinal: i32) -> Result<usize> {
    static RETAINED: std::sync::Mutex<Vec<(i32, usize)>> = std::sync::Mutex::new(Vec::new());
    let mut retained = crate::sync::lock(&RETAINED);
    if let Some(&(_, ctx)) = retained.iter().find(|(o, _)| *o == ordinal) {
        return Ok(ctx);
    }
    let ctx = retain_primary_context(ordinal)?;
    retained.push((ordinal, ctx));
    Ok(ctx)
}

fn retain_primary_context(ordinal: i32) -> Result<usize> {
    let mut dev: cu::CUdevice = 0;
    // SAFETY: out-pointers to locals.
    check(&format!("cuDeviceGet({ordinal})"), || unsafe {
        cu::cuDeviceGet(&mut dev, ordinal)
    })?;
    let mut ctx: CUcontext = std::ptr::null_mut();
    check("cuDevicePrimaryCtxRetain", || unsafe {
        cu::cuDevicePrimaryCtxRetain(&mut ctx, dev)
    })?;
    Ok(ctx as usize)
}

/// An event marking a point on a stream; waiting on it is bounded.
pub struct Event {
    raw: CUevent,
}

// SAFETY: CUDA events may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: the driver's event calls are thread-safe (the watchdog's queue
// holds an event that a caller may be recording again).
unsafe impl Sync for Event {}

impl Event {
    /// A new event, not recorded yet.
    pub fn new() -> Result<Event> {
        let mut raw: CUevent = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check("cuEventCreate", || unsafe {
            cu::cuEventCreate(&mut raw, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(Event { raw })
    }

    /// Records the event on `stream` now (again, for a reused event).
    pub fn record_on(&self, stream: Stream) -> Result<()> {
        // SAFETY: a live event and the caller's stream.
        check("cuEventRecord", || unsafe {
            cu::cuEventRecord(self.raw, stream.as_cu())
        })
    }

    /// Whether the work before the event has finished.
    pub fn done(&self) -> Result<bool> {
        // SAFETY: a live event.
        match catch_unwind(|| unsafe { cu::cuEventQuery(self.raw) }) {
            Ok(CUresult::CUDA_SUCCESS) => Ok(true),
            Ok(CUresult::CUDA_ERROR_NOT_READY) => Ok(false),
            Ok(rc) => Err(Error::new(
                ErrorKind::Backend,
                format!("cuEventQuery failed: {}", describe(rc)),
            )),
            Err(_) => Err(Error::new(
                ErrorKind::Backend,
                "cuEventQuery: the CUDA driver could not be called",
            )),
        }
    }

    /// Waits until the event completes or `deadline` passes (Timeout,
    /// saying what was waited for). Polls, backing off to 1 ms.
    pub fn wait(&self, deadline: Instant, what: &str) -> Result<()> {
        let mut pause = Duration::from_micros(2);
        loop {
            if self.done()? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("{what} did not finish on the GPU before the timeout"),
                ));
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is ours; destroying a pending event is allowed
        // (it is freed once complete).
        let _ = check("cuEventDestroy", || unsafe {
            cu::cuEventDestroy_v2(self.raw)
        });
    }
}

/// Copies `len` bytes of device memory at `device` to `host`, on `stream`
/// (the caller waits for an event before using the bytes).
///
/// # Safety
/// `host` valid for `len` bytes of writes until the copy completes.
pub unsafe fn copy_to_host(host: *mut u8, device: usize, len: usize, stream: Stream) -> Result<()> {
    check("cuMemcpyDtoHAsync", || {
        cu::cuMemcpyDtoHAsync_v2(host.cast(), device as cu::CUdeviceptr, len, stream.as_cu())
    })
}

/// Copies `len` bytes from `host` to device memory at `device`, on `stream`.
///
/// # Safety
/// `host` valid for `len` bytes of reads until the copy completes.
pub unsafe fn copy_to_device(
    device: usize,
    host: *const u8,
    len: usize,
    stream: Stream,
) -> Result<()> {
    check("cuMemcpyHtoDAsync", || {
        cu::cuMemcpyHtoDAsync_v2(device as cu::CUdeviceptr, host.cast(), len, stream.as_cu())
    })
}
