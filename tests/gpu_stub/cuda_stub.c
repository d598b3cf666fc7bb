/*
 * cuda_stub.c -- a test double that impersonates the CUDA driver API
 * (libcuda.so.1) so that rdist's GPU code paths can run on a machine
 * without a GPU.
 *
 * It is deliberately simple, deterministic and strict:
 *  - "device" memory is address space reserved with mmap(PROT_NONE), so any
 *    host read or write of a device pointer by the code under test faults;
 *    the bytes live in a separate malloc'd shadow buffer that only the
 *    copy functions (and the NCCL stub, through rdist_stub_shadow) touch.
 *    Each reservation has a guard page, so allocations are never adjacent,
 *    and freed reservations stay reserved for a while (quarantine), so a
 *    stale device pointer is rejected instead of aliasing new memory.
 *    Fresh allocations are filled with 0xA5 (never zero).
 *  - all copies happen immediately; streams and events only model
 *    "stalled" streams (rdist_stub_stall_stream) for watchdog tests.
 *  - stream and event handles are never freed or reused, so a use after
 *    destroy is reported as CUDA_ERROR_INVALID_HANDLE, never a crash.
 *  - a pthread mutex guards every shared table; the context stack is
 *    thread-local, as in the real driver.
 *
 * Environment: RDIST_STUB_DEVICES (number of devices, default 1, 0 = none),
 * RDIST_STUB_LOG (a file to which one line per notable call is appended).
 * No CUDA header is used: the types and codes below mirror cuda.h.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct stub_ctx *CUcontext;
typedef struct stub_stream *CUstream;
typedef struct stub_event *CUevent;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
};

enum {
    ATTR_CONTEXT = 1,
    ATTR_MEMORY_TYPE = 2,
    ATTR_DEVICE_POINTER = 3,
    ATTR_IS_MANAGED = 8,
    ATTR_DEVICE_ORDINAL = 9,
};
#define CU_MEMORYTYPE_DEVICE 2u

#define MAX_DEVICES 64
#define CTX_STACK_MAX 64
#define DEVICE_TOTAL_MEM (16ull << 30)
#define FILL_BYTE 0xA5
#define QUARANTINE 256
#define MAX_SLOTS (1u << 20)
#define MAGIC_CTX 0xC0C7C7C0u
#define MAGIC_STREAM 0x57EA5EA5u
#define MAGIC_EVENT 0xE7E7E7E7u

/* ------------------------------------------------------------------ */
/* State                                                               */
/* ------------------------------------------------------------------ */

struct stub_ctx {
    unsigned magic;
    int device;
    int refcount; /* primary-context retain count; 0 = not active */
};

/* Whether work on a stream can complete; epoch counts stall periods. */
struct stall_state {
    int stalled;
    unsigned epoch;
};

struct stub_stream {
    unsigned magic;
    int live;
    struct stub_ctx *ctx;
    unsigned flags;
    struct stall_state st;
};

struct stub_event {
    unsigned magic;
    int live;
    struct stub_ctx *ctx;
    unsigned flags;
    struct stall_state *wait; /* stall state it was recorded behind */
    unsigned wait_epoch;
};

/* Handles come from one never-freed arena, so validating one is a
 * range check and a destroyed handle stays recognisable. */
union stub_slot {
    struct stub_stream s;
    struct stub_event e;
    char pad[64];
};

struct alloc {
    uintptr_t base;
    size_t size;     /* bytes asked for */
    size_t reserved; /* bytes mapped, page-rounded plus a guard page */
    unsigned char *shadow;
    struct stub_ctx *ctx;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_initialized; /* read with __atomic_load_n */
static int g_ndev;
static struct stub_ctx g_ctx[MAX_DEVICES];
static struct stall_state g_null_stream; /* the legacy default stream */

static struct alloc *g_allocs; /* sorted by base */
static size_t g_nallocs, g_cap_allocs;
static struct { uintptr_t base; size_t reserved; } g_quarantine[QUARANTINE];
static size_t g_qnext;

static union stub_slot *g_slots;
static size_t g_nslots;

static __thread struct stub_ctx *tls_stack[CTX_STACK_MAX];
static __thread int tls_depth;

static void lock(void) { pthread_mutex_lock(&g_lock); }
static void unlock(void) { pthread_mutex_unlock(&g_lock); }
static int initialized(void) { return __atomic_load_n(&g_initialized, __ATOMIC_ACQUIRE); }

/* ------------------------------------------------------------------ */
/* Logging                                                             */
/* ------------------------------------------------------------------ */

__attribute__((format(printf, 1, 2))) static void stub_log(const char *fmt, ...)
{
    const char *path = getenv("RDIST_STUB_LOG");
    if (!path || !*path)
        return;
    char line[512];
    int n = snprintf(line, sizeof line, "cuda pid=%d ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 2)
        n = (int)sizeof line - 2;
    line[n++] = '\n';
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    ssize_t w = write(fd, line, (size_t)n);
    (void)w;
    close(fd);
}

static void warn_blocking_wait(const char *what, const void *handle)
{
    fprintf(stderr, "rdist-stub: blocking wait on a stalled stream (%s %p)\n", what, handle);
    stub_log("blocking_wait_on_stalled_stream api=%s handle=%p", what, handle);
}

/* ------------------------------------------------------------------ */
/* Contexts                                                            */
/* ------------------------------------------------------------------ */

/* The context a handle names, or NULL when it is not one of ours. */
static struct stub_ctx *ctx_of(CUcontext c)
{
    uintptr_t p = (uintptr_t)c, lo = (uintptr_t)g_ctx;
    if (p < lo || p >= (uintptr_t)(g_ctx + g_ndev) || (p - lo) % sizeof *g_ctx)
        return NULL;
    return c;
}

static struct stub_ctx *tls_top(void) { return tls_depth ? tls_stack[tls_depth - 1] : NULL; }

/* The current context, which must exist and be active. Lock held. */
static CUresult current_ctx(struct stub_ctx **out)
{
    struct stub_ctx *c = tls_top();
    if (!c || c->refcount <= 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    *out = c;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* Device memory table                                                 */
/* ------------------------------------------------------------------ */

/* Index of the last allocation whose base is <= p, or -1. Lock held. */
static long alloc_floor(uintptr_t p)
{
    long lo = 0, hi = (long)g_nallocs - 1, found = -1;
    while (lo <= hi) {
        long mid = lo + (hi - lo) / 2;
        if (g_allocs[mid].base <= p) {
            found = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return found;
}

/* The allocation holding all of [p, p+len) (len 0: p inside or at the
 * end), or NULL. Lock held. */
static struct alloc *alloc_find(uintptr_t p, size_t len)
{
    long i = alloc_floor(p);
    if (i < 0)
        return NULL;
    struct alloc *a = &g_allocs[i];
    size_t off = p - a->base;
    if (off > a->size || len > a->size - off)
        return NULL;
    return a;
}

/* Whether [p, p+len) touches any live reservation. Lock held. */
static int overlaps_device(uintptr_t p, size_t len)
{
    uintptr_t end = p + (len ? len : 1);
    if (end < p)
        return 1;
    long i = alloc_floor(end - 1);
    return i >= 0 && g_allocs[i].base + g_allocs[i].reserved > p;
}

static CUresult alloc_insert(const struct alloc *a)
{
    if (g_nallocs == g_cap_allocs) {
        size_t cap = g_cap_allocs ? 2 * g_cap_allocs : 64;
        struct alloc *n = realloc(g_allocs, cap * sizeof *n);
        if (!n)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g_allocs = n;
        g_cap_allocs = cap;
    }
    size_t at = (size_t)(alloc_floor(a->base) + 1);
    memmove(g_allocs + at + 1, g_allocs + at, (g_nallocs - at) * sizeof *a);
    g_allocs[at] = *a;
    g_nallocs++;
    return CUDA_SUCCESS;
}

/* Keeps a freed reservation mapped PROT_NONE for a while. Lock held. */
static void quarantine(uintptr_t base, size_t reserved)
{
    size_t slot = g_qnext++ % QUARANTINE;
    if (g_quarantine[slot].base)
        munmap((void *)g_quarantine[slot].base, g_quarantine[slot].reserved);
    g_quarantine[slot].base = base;
    g_quarantine[slot].reserved = reserved;
}

static CUresult mem_alloc_locked(CUdeviceptr *dptr, size_t bytes, struct alloc *out)
{
    struct stub_ctx *ctx;
    CUresult r = current_ctx(&ctx);
    if (r)
        return r;
    if (!dptr || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (bytes > DEVICE_TOTAL_MEM)
        return CUDA_ERROR_OUT_OF_MEMORY;
    size_t reserved = (bytes + page - 1) / page * page + page;
    void *base = mmap(NULL, reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    unsigned char *shadow = malloc(bytes);
    if (base == MAP_FAILED || !shadow) {
        if (base != MAP_FAILED)
            munmap(base, reserved);
        free(shadow);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    memset(shadow, FILL_BYTE, bytes);
    *out = (struct alloc){(uintptr_t)base, bytes, reserved, shadow, ctx};
    r = alloc_insert(out);
    if (r) {
        munmap(base, reserved);
        free(shadow);
        return r;
    }
    *dptr = (CUdeviceptr)(uintptr_t)base;
    return CUDA_SUCCESS;
}

static CUresult mem_free_locked(CUdeviceptr dptr, struct alloc *out)
{
    long i = alloc_floor((uintptr_t)dptr);
    if (i < 0 || g_allocs[i].base != (uintptr_t)dptr)
        return CUDA_ERROR_INVALID_VALUE;
    *out = g_allocs[i];
    free(out->shadow);
    quarantine(out->base, out->reserved);
    memmove(g_allocs + i, g_allocs + i + 1, (g_nallocs - (size_t)i - 1) * sizeof *g_allocs);
    g_nallocs--;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* Stream and event handles                                            */
/* ------------------------------------------------------------------ */

static int is_default_stream(const void *s) { return (uintptr_t)s <= 2; /* NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD */ }

static union stub_slot *slot_of(const void *h)
{
    uintptr_t p = (uintptr_t)h, lo = (uintptr_t)g_slots;
    if (!g_slots || p < lo || p >= (uintptr_t)(g_slots + g_nslots) || (p - lo) % sizeof *g_slots)
        return NULL;
    return (union stub_slot *)h;
}

static union stub_slot *slot_new(void)
{
    if (!g_slots) {
        void *m = mmap(NULL, (size_t)MAX_SLOTS * sizeof *g_slots, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED)
            return NULL;
        g_slots = m;
    }
    if (g_nslots == MAX_SLOTS)
        return NULL;
    return &g_slots[g_nslots++];
}

/* A stream handle ever created (live or destroyed), or NULL. Lock held. */
static struct stub_stream *stream_any(CUstream h)
{
    union stub_slot *s = slot_of(h);
    return s && s->s.magic == MAGIC_STREAM ? &s->s : NULL;
}

static struct stub_stream *stream_live(CUstream h)
{
    struct stub_stream *s = stream_any(h);
    return s && s->live ? s : NULL;
}

static struct stub_event *event_live(CUevent h)
{
    union stub_slot *s = slot_of(h);
    return s && s->e.magic == MAGIC_EVENT && s->e.live ? &s->e : NULL;
}

/* The stall state behind a stream argument (the NULL stream included);
 * CUDA_ERROR_INVALID_HANDLE for a handle that is not a live stream. The
 * NULL stream needs a current context. Lock held. */
static CUresult stream_state(CUstream h, struct stall_state **out)
{
    if (is_default_stream(h)) {
        struct stub_ctx *c;
        CUresult r = current_ctx(&c);
        *out = &g_null_stream;
        return r;
    }
    struct stub_stream *s = stream_live(h);
    if (!s)
        return CUDA_ERROR_INVALID_HANDLE;
    *out = &s->st;
    return CUDA_SUCCESS;
}

static void set_stalled(struct stall_state *st, int stalled)
{
    if (stalled && !st->stalled)
        st->epoch++;
    st->stalled = stalled != 0;
}

static int event_pending(const struct stub_event *e)
{
    return e->wait && e->wait->stalled && e->wait->epoch == e->wait_epoch;
}

/* ------------------------------------------------------------------ */
/* Initialisation, version, errors                                     */
/* ------------------------------------------------------------------ */

static CUresult read_device_count(int *n)
{
    const char *v = getenv("RDIST_STUB_DEVICES");
    if (!v || !*v) {
        *n = 1;
        return CUDA_SUCCESS;
    }
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || *end || x < 0 || x > MAX_DEVICES) {
        fprintf(stderr, "rdist-stub: RDIST_STUB_DEVICES=%s is not a number in 0..%d\n", v, MAX_DEVICES);
        return CUDA_ERROR_INVALID_VALUE;
    }
    *n = (int)x;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    lock();
    CUresult r = CUDA_SUCCESS;
    int n = g_ndev;
    if (!initialized()) {
        r = read_device_count(&n);
        if (!r && n == 0)
            r = CUDA_ERROR_NO_DEVICE;
        if (!r) {
            for (int i = 0; i < n; i++)
                g_ctx[i] = (struct stub_ctx){MAGIC_CTX, i, 0};
            g_ndev = n;
            __atomic_store_n(&g_initialized, 1, __ATOMIC_RELEASE);
        }
    }
    unlock();
    stub_log("cuInit devices=%d result=%d", r ? 0 : n, r);
    return r;
}

EXPORT CUresult cuDriverGetVersion(int *version)
{
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = 12020;
    return CUDA_SUCCESS;
}

struct err_text {
    CUresult code;
    const char *name, *text;
};

static const struct err_text g_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
};

static const struct err_text *err_lookup(CUresult code)
{
    for (size_t i = 0; i < sizeof g_errors / sizeof *g_errors; i++)
        if (g_errors[i].code == code)
            return &g_errors[i];
    return NULL;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **str)
{
    const struct err_text *e = err_lookup(error);
    if (!str)
        return CUDA_ERROR_INVALID_VALUE;
    *str = e ? e->text : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorName(CUresult error, const char **str)
{
    const struct err_text *e = err_lookup(error);
    if (!str)
        return CUDA_ERROR_INVALID_VALUE;
    *str = e ? e->name : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------ */
/* Devices                                                             */
/* ------------------------------------------------------------------ */

#define REQUIRE_INIT()                          \
    do {                                        \
        if (!initialized())                     \
            return CUDA_ERROR_NOT_INITIALIZED;  \
    } while (0)

static int valid_device(CUdevice d) { return d >= 0 && d < g_ndev; }

EXPORT CUresult cuDeviceGetCount(int *count)
{
    REQUIRE_INIT();
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = g_ndev;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    REQUIRE_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    REQUIRE_INIT();
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "rdist stub GPU %d", dev);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    REQUIRE_INIT();
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)DEVICE_TOTAL_MEM;
    return CUDA_SUCCESS;
}

/* Extra (cudarc's CudaContext::new asks for it): compute capability 8.0,
 * every other attribute 0 (so no memory pools: cuMemAlloc_v2 is used). */
EXPORT CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev)
{
    REQUIRE_INIT();
    if (!value || attrib <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *value = attrib == 75 ? 8 : 0;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* Contexts                                                            */
/* ------------------------------------------------------------------ */

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    lock();
    int refs = ++g_ctx[dev].refcount;
    *pctx = &g_ctx[dev];
    unlock();
    stub_log("cuDevicePrimaryCtxRetain device=%d refcount=%d", dev, refs);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    REQUIRE_INIT();
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    lock();
    CUresult r = g_ctx[dev].refcount > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    int refs = r ? 0 : --g_ctx[dev].refcount;
    unlock();
    stub_log("cuDevicePrimaryCtxRelease device=%d refcount=%d result=%d", dev, refs, r);
    return r;
}

/* Whether a context handle may be made current. */
static CUresult usable_ctx(CUcontext c)
{
    struct stub_ctx *x = ctx_of(c);
    if (!x)
        return CUDA_ERROR_INVALID_CONTEXT;
    lock();
    int active = x->refcount > 0;
    unlock();
    return active ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    REQUIRE_INIT();
    if (!ctx) { /* unbinds: pops the top, no-op on an empty stack */
        if (tls_depth)
            tls_depth--;
        return CUDA_SUCCESS;
    }
    CUresult r = usable_ctx(ctx);
    if (r)
        return r;
    if (tls_depth == 0)
        tls_depth = 1;
    tls_stack[tls_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    REQUIRE_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = tls_top();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    REQUIRE_INIT();
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = usable_ctx(ctx);
    if (r)
        return r;
    if (tls_depth == CTX_STACK_MAX) {
        fprintf(stderr, "rdist-stub: context stack deeper than %d (push without pop?)\n", CTX_STACK_MAX);
        return CUDA_ERROR_INVALID_VALUE;
    }
    tls_stack[tls_depth++] = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    REQUIRE_INIT();
    if (!tls_depth)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct stub_ctx *c = tls_stack[--tls_depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    REQUIRE_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    struct stub_ctx *c;
    lock();
    CUresult r = current_ctx(&c);
    unlock();
    if (!r)
        *device = c->device;
    return r;
}

/* Whether the current context has stalled work (its streams or the
 * NULL stream). Lock held. */
static int ctx_has_stalled_work(const struct stub_ctx *c)
{
    if (g_null_stream.stalled)
        return 1;
    for (size_t i = 0; i < g_nslots; i++) {
        const struct stub_stream *s = &g_slots[i].s;
        if (s->magic == MAGIC_STREAM && s->live && s->ctx == c && s->st.stalled)
            return 1;
    }
    return 0;
}

EXPORT CUresult cuCtxSynchronize(void)
{
    REQUIRE_INIT();
    struct stub_ctx *c;
    lock();
    CUresult r = current_ctx(&c);
    if (!r && ctx_has_stalled_work(c))
        r = CUDA_ERROR_NOT_READY;
    unlock();
    if (r == CUDA_ERROR_NOT_READY)
        warn_blocking_wait("cuCtxSynchronize", c);
    return r;
}

/* rdist_stub_current_device: the current context's device, or -1. */
EXPORT int rdist_stub_current_device(void)
{
    if (!initialized())
        return -1;
    struct stub_ctx *c;
    lock();
    int dev = current_ctx(&c) ? -1 : c->device;
    unlock();
    return dev;
}

/* ------------------------------------------------------------------ */
/* Memory                                                              */
/* ------------------------------------------------------------------ */

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes)
{
    REQUIRE_INIT();
    struct alloc a = {0};
    lock();
    CUresult r = mem_alloc_locked(dptr, bytes, &a);
    unlock();
    stub_log("cuMemAlloc dptr=%#llx bytes=%zu device=%d result=%d", (unsigned long long)a.base, bytes,
             a.ctx ? a.ctx->device : -1, r);
    return r;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    REQUIRE_INIT();
    struct alloc a = {0};
    lock();
    CUresult r = mem_free_locked(dptr, &a);
    unlock();
    stub_log("cuMemFree dptr=%#llx bytes=%zu device=%d result=%d", dptr, a.size, a.ctx ? a.ctx->device : -1, r);
    return r;
}

/* rdist_stub_shadow: the CPU-visible bytes behind [dptr, dptr+len) when
 * that range lies in one allocation (len 0: dptr inside or at the end of
 * one), else NULL. *device (optional) gets the allocation's device. */
EXPORT void *rdist_stub_shadow(unsigned long long dptr, size_t len, int *device)
{
    if (!initialized())
        return NULL;
    lock();
    struct alloc *a = alloc_find((uintptr_t)dptr, len);
    void *p = a ? a->shadow + ((uintptr_t)dptr - a->base) : NULL;
    if (a && device)
        *device = a->ctx->device;
    unlock();
    return p;
}

/* One side of a copy as CPU-usable bytes. device: the API names this
 * side Device (1), Host (0) or either (-1, cuMemcpy). Lock held. */
static CUresult resolve(uintptr_t p, size_t n, int device, unsigned char **out, int *was_device)
{
    struct alloc *a = device != 0 ? alloc_find(p, n) : NULL;
    if (a) {
        *out = a->shadow + (p - a->base);
        *was_device = 1;
        return CUDA_SUCCESS;
    }
    if (device == 1 || !p || overlaps_device(p, n))
        return CUDA_ERROR_INVALID_VALUE;
    *out = (unsigned char *)p;
    *was_device = 0;
    return CUDA_SUCCESS;
}

struct copy_args {
    const char *api;
    uintptr_t dst, src;
    int dst_kind, src_kind; /* 1 device, 0 host, -1 either */
    size_t n;
    int async;
    CUstream stream;
};

static CUresult copy_locked(const struct copy_args *c, int *dst_dev, int *src_dev)
{
    struct stub_ctx *ctx;
    struct stall_state *st;
    CUresult r = current_ctx(&ctx);
    if (!r && c->async)
        r = stream_state(c->stream, &st);
    if (r || c->n == 0)
        return r;
    unsigned char *d, *s;
    r = resolve(c->dst, c->n, c->dst_kind, &d, dst_dev);
    if (!r)
        r = resolve(c->src, c->n, c->src_kind, &s, src_dev);
    if (!r)
        memmove(d, s, c->n);
    return r;
}

static CUresult do_copy(struct copy_args c)
{
    REQUIRE_INIT();
    int dd = c.dst_kind == 1, sd = c.src_kind == 1;
    lock();
    CUresult r = copy_locked(&c, &dd, &sd);
    unlock();
    stub_log("memcpy dir=%cto%c api=%s bytes=%zu dst=%#lx src=%#lx stream=%p result=%d", sd ? 'D' : 'H',
             dd ? 'D' : 'H', c.api, c.n, (unsigned long)c.dst, (unsigned long)c.src, (void *)c.stream, r);
    return r;
}

#define HOST(p) ((uintptr_t)(p))

EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    return do_copy((struct copy_args){"cuMemcpy", dst, src, -1, -1, n, 0, NULL});
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    return do_copy((struct copy_args){"cuMemcpyDtoH_v2", HOST(dst), src, 0, 1, n, 0, NULL});
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    return do_copy((struct copy_args){"cuMemcpyHtoD_v2", dst, HOST(src), 1, 0, n, 0, NULL});
}

EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    return do_copy((struct copy_args){"cuMemcpyDtoD_v2", dst, src, 1, 1, n, 0, NULL});
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    return do_copy((struct copy_args){"cuMemcpyDtoHAsync_v2", HOST(dst), src, 0, 1, n, 1, s});
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    return do_copy((struct copy_args){"cuMemcpyHtoDAsync_v2", dst, HOST(src), 1, 0, n, 1, s});
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    return do_copy((struct copy_args){"cuMemcpyDtoDAsync_v2", dst, src, 1, 1, n, 1, s});
}

static CUresult memset_locked(CUdeviceptr dst, unsigned char v, size_t n, int async, CUstream s)
{
    struct stub_ctx *ctx;
    struct stall_state *st;
    CUresult r = current_ctx(&ctx);
    if (!r && async)
        r = stream_state(s, &st);
    if (r || n == 0)
        return r;
    struct alloc *a = alloc_find((uintptr_t)dst, n);
    if (!a)
        return CUDA_ERROR_INVALID_VALUE;
    memset(a->shadow + ((uintptr_t)dst - a->base), v, n);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n)
{
    REQUIRE_INIT();
    lock();
    CUresult r = memset_locked(dst, v, n, 0, NULL);
    unlock();
    return r;
}

/* Extra (cudarc's alloc_zeros uses it). */
EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s)
{
    REQUIRE_INIT();
    lock();
    CUresult r = memset_locked(dst, v, n, 1, s);
    unlock();
    return r;
}

/* ------------------------------------------------------------------ */
/* Pointer attributes                                                  */
/* ------------------------------------------------------------------ */

/* RDIST_STUB_UNSUPPORTED_ATTRIBUTE=N: this driver does not know pointer
 * attribute N (as an older driver lacks newer ones): asking for it is
 * CUDA_ERROR_INVALID_VALUE, and so is a cuPointerGetAttributes list that
 * includes it. */
static int unsupported_attr(int attr)
{
    const char *v = getenv("RDIST_STUB_UNSUPPORTED_ATTRIBUTE");
    return v && *v && atoi(v) == attr;
}

/* Writes one attribute of pointer p (a: its allocation, NULL when p is
 * not device memory: zero/NULL values). Lock held. */
static CUresult write_attr(int attr, void *data, const struct alloc *a, CUdeviceptr p)
{
    if (!data || unsupported_attr(attr))
        return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case ATTR_CONTEXT:
        *(CUcontext *)data = a ? a->ctx : NULL;
        return CUDA_SUCCESS;
    case ATTR_MEMORY_TYPE:
        *(unsigned *)data = a ? CU_MEMORYTYPE_DEVICE : 0;
        return CUDA_SUCCESS;
    case ATTR_DEVICE_POINTER:
        *(CUdeviceptr *)data = a ? p : 0;
        return CUDA_SUCCESS;
    case ATTR_IS_MANAGED:
        *(unsigned *)data = 0;
        return CUDA_SUCCESS;
    case ATTR_DEVICE_ORDINAL:
        *(int *)data = a ? a->ctx->device : 0;
        return CUDA_SUCCESS;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

/* RDIST_STUB_POINTER_NEEDS_CONTEXT=1: pointer queries fail with
 * CUDA_ERROR_INVALID_CONTEXT on a thread with no current context (as some
 * drivers answer only in one). */
static CUresult pointer_query_context(void)
{
    const char *v = getenv("RDIST_STUB_POINTER_NEEDS_CONTEXT");
    struct stub_ctx *c;
    if (!v || strcmp(v, "1") != 0)
        return CUDA_SUCCESS;
    lock();
    CUresult r = current_ctx(&c);
    unlock();
    return r;
}

/* Pointer queries answered so far (a test checks which buffers rdist
 * tells apart without asking). */
static unsigned long g_pointer_queries;

EXPORT unsigned long rdist_stub_pointer_queries(void)
{
    return __atomic_load_n(&g_pointer_queries, __ATOMIC_RELAXED);
}

EXPORT CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr)
{
    __atomic_add_fetch(&g_pointer_queries, 1, __ATOMIC_RELAXED);
    REQUIRE_INIT();
    CUresult needs = pointer_query_context();
    if (needs)
        return needs;
    lock();
    const struct alloc *a = alloc_find((uintptr_t)ptr, 1); /* one past the end is not inside */
    CUresult r = a ? write_attr(attribute, data, a, ptr) : CUDA_ERROR_INVALID_VALUE;
    unlock();
    return r;
}

EXPORT CUresult cuPointerGetAttributes(unsigned num, int *attributes, void **data, CUdeviceptr ptr)
{
    __atomic_add_fetch(&g_pointer_queries, 1, __ATOMIC_RELAXED);
    REQUIRE_INIT();
    if (num == 0 || !attributes || !data)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult needs = pointer_query_context();
    if (needs)
        return needs;
    lock();
    const struct alloc *a = alloc_find((uintptr_t)ptr, 1);
    CUresult r = CUDA_SUCCESS;
    for (unsigned i = 0; i < num && !r; i++)
        r = write_attr(attributes[i], data[i], a, ptr);
    unlock();
    return r;
}

/* ------------------------------------------------------------------ */
/* Streams                                                             */
/* ------------------------------------------------------------------ */

EXPORT CUresult cuStreamCreate(CUstream *ph, unsigned flags)
{
    REQUIRE_INIT();
    if (!ph || (flags & ~1u))
        return CUDA_ERROR_INVALID_VALUE;
    struct stub_ctx *ctx;
    lock();
    CUresult r = current_ctx(&ctx);
    union stub_slot *s = r ? NULL : slot_new();
    if (!r && !s)
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (!r) {
        s->s = (struct stub_stream){MAGIC_STREAM, 1, ctx, flags, {0, 0}};
        *ph = &s->s;
    }
    unlock();
    stub_log("cuStreamCreate stream=%p result=%d", (void *)s, r);
    return r;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream h)
{
    REQUIRE_INIT();
    lock();
    struct stub_stream *s = stream_live(h);
    if (s)
        s->live = 0;
    unlock();
    stub_log("cuStreamDestroy stream=%p result=%d", (void *)h, s ? 0 : CUDA_ERROR_INVALID_HANDLE);
    return s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static CUresult stream_stalled(CUstream h, int *stalled)
{
    struct stall_state *st;
    lock();
    CUresult r = stream_state(h, &st);
    *stalled = !r && st->stalled;
    unlock();
    return r;
}

EXPORT CUresult cuStreamQuery(CUstream h)
{
    REQUIRE_INIT();
    int stalled;
    CUresult r = stream_stalled(h, &stalled);
    return r ? r : stalled ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(CUstream h)
{
    REQUIRE_INIT();
    int stalled;
    CUresult r = stream_stalled(h, &stalled);
    if (r)
        return r;
    if (stalled) {
        warn_blocking_wait("cuStreamSynchronize", h);
        return CUDA_ERROR_NOT_READY;
    }
    return CUDA_SUCCESS;
}

/* rdist_stub_stall_stream: while a stream is stalled, events recorded on
 * it stay NOT_READY (work "never completes"); un-stalling completes them. */
EXPORT void rdist_stub_stall_stream(void *stream, int stalled)
{
    lock();
    struct stub_stream *s = is_default_stream(stream) ? NULL : stream_any(stream);
    struct stall_state *st = is_default_stream(stream) ? &g_null_stream : s ? &s->st : NULL;
    if (st)
        set_stalled(st, stalled);
    unlock();
    if (!st)
        fprintf(stderr, "rdist-stub: rdist_stub_stall_stream: %p is not a stream\n", stream);
    stub_log("stall_stream stream=%p stalled=%d%s", stream, stalled != 0, st ? "" : " invalid_handle");
}

/* rdist_stub_stream_check: CUDA_SUCCESS when the stream argument is valid
 * (a live stream, or the NULL stream with a current context). */
EXPORT int rdist_stub_stream_check(void *stream)
{
    if (!initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    struct stall_state *st;
    lock();
    CUresult r = stream_state(stream, &st);
    unlock();
    return r;
}

/* ------------------------------------------------------------------ */
/* Events                                                              */
/* ------------------------------------------------------------------ */

EXPORT CUresult cuEventCreate(CUevent *ph, unsigned flags)
{
    REQUIRE_INIT();
    if (!ph || (flags & ~7u))
        return CUDA_ERROR_INVALID_VALUE;
    struct stub_ctx *ctx;
    lock();
    CUresult r = current_ctx(&ctx);
    union stub_slot *s = r ? NULL : slot_new();
    if (!r && !s)
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (!r) {
        s->e = (struct stub_event){MAGIC_EVENT, 1, ctx, flags, NULL, 0};
        *ph = &s->e;
    }
    unlock();
    return r;
}

EXPORT CUresult cuEventDestroy_v2(CUevent h)
{
    REQUIRE_INIT();
    lock();
    struct stub_event *e = event_live(h);
    if (e)
        e->live = 0;
    unlock();
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static CUresult event_record_locked(CUevent h, CUstream s)
{
    struct stub_event *e = event_live(h);
    if (!e)
        return CUDA_ERROR_INVALID_HANDLE;
    struct stall_state *st;
    CUresult r = stream_state(s, &st);
    if (r)
        return r;
    struct stub_stream *ss = stream_live(s);
    if (ss && ss->ctx != e->ctx)
        return CUDA_ERROR_INVALID_HANDLE; /* event and stream of different contexts */
    e->wait = st->stalled ? st : NULL;
    e->wait_epoch = st->epoch;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(CUevent h, CUstream s)
{
    REQUIRE_INIT();
    lock();
    CUresult r = event_record_locked(h, s);
    unlock();
    return r;
}

static CUresult event_pending_of(CUevent h, int *pending)
{
    lock();
    struct stub_event *e = event_live(h);
    *pending = e && event_pending(e);
    unlock();
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuEventQuery(CUevent h)
{
    REQUIRE_INIT();
    int pending;
    CUresult r = event_pending_of(h, &pending);
    return r ? r : pending ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

EXPORT CUresult cuEventSynchronize(CUevent h)
{
    REQUIRE_INIT();
    int pending;
    CUresult r = event_pending_of(h, &pending);
    if (r)
        return r;
    if (pending) {
        warn_blocking_wait("cuEventSynchronize", h);
        return CUDA_ERROR_NOT_READY;
    }
    return CUDA_SUCCESS;
}

/* Extra (cudarc's stream tracking uses it): a stream that waits on a
 * pending event is stalled itself. */
EXPORT CUresult cuStreamWaitEvent(CUstream s, CUevent h, unsigned flags)
{
    REQUIRE_INIT();
    if (flags & ~1u)
        return CUDA_ERROR_INVALID_VALUE;
    struct stall_state *st;
    lock();
    struct stub_event *e = event_live(h);
    CUresult r = e ? stream_state(s, &st) : CUDA_ERROR_INVALID_HANDLE;
    if (!r && event_pending(e))
        set_stalled(st, 1);
    unlock();
    return r;
}

/* rdist_stub_stream_is_stalled: 1 when the stream (or the NULL stream)
 * is stalled, 0 otherwise (invalid handles included). */
EXPORT int rdist_stub_stream_is_stalled(void *stream)
{
    lock();
    struct stub_stream *s = is_default_stream(stream) ? NULL : stream_any(stream);
    int stalled = is_default_stream(stream) ? g_null_stream.stalled : s ? s->st.stalled : 0;
    unlock();
    return stalled;
}
