/*
 * smoke.c -- exercises the CUDA and NCCL stubs (libcuda.so.1,
 * libnccl.so.2 of this folder) and checks their results; build.sh runs
 * it after building them. Exits non-zero on the first failed check.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <libgen.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- the stubs' ABI (as cuda.h / nccl.h declare it) ---- */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUevent;
CUresult cuInit(unsigned);
CUresult cuDriverGetVersion(int *);
CUresult cuDeviceGetCount(int *);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDeviceGetName(char *, int, CUdevice);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxGetCurrent(CUcontext *);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuCtxGetDevice(CUdevice *);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemsetD8_v2(CUdeviceptr, unsigned char, size_t);
CUresult cuMemcpy(CUdeviceptr, CUdeviceptr, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoD_v2(CUdeviceptr, CUdeviceptr, size_t);
CUresult cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, CUstream);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuPointerGetAttribute(void *, int, CUdeviceptr);
CUresult cuPointerGetAttributes(unsigned, int *, void **, CUdeviceptr);
CUresult cuStreamCreate(CUstream *, unsigned);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamQuery(CUstream);
CUresult cuEventCreate(CUevent *, unsigned);
CUresult cuEventDestroy_v2(CUevent);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventQuery(CUevent);
CUresult cuEventSynchronize(CUevent);
CUresult cuGetErrorString(CUresult, const char **);
CUresult cuGetErrorName(CUresult, const char **);
void rdist_stub_stall_stream(void *, int);
void *rdist_stub_shadow(unsigned long long, size_t, int *);
int rdist_stub_current_device(void);

typedef struct nccl_comm *ncclComm_t;
typedef struct {
    char internal[128];
} ncclUniqueId;
typedef struct {
    size_t size;
    unsigned magic, version;
    int blocking, cgaClusterSize, minCTAs, maxCTAs;
    const char *netName;
    int splitShare;
} ncclConfig_t;
int ncclGetVersion(int *);
int ncclGetUniqueId(ncclUniqueId *);
const char *ncclGetErrorString(int);
const char *ncclGetLastError(ncclComm_t);
int ncclCommInitRank(ncclComm_t *, int, ncclUniqueId, int);
int ncclCommInitRankConfig(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
int ncclCommGetAsyncError(ncclComm_t, int *);
int ncclCommCount(ncclComm_t, int *);
int ncclCommUserRank(ncclComm_t, int *);
int ncclCommCuDevice(ncclComm_t, int *);
int ncclCommFinalize(ncclComm_t);
int ncclCommDestroy(ncclComm_t);
int ncclCommAbort(ncclComm_t);
int ncclCommSplit(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
int ncclAllReduce(const void *, void *, size_t, int, int, ncclComm_t, void *);
int ncclBroadcast(const void *, void *, size_t, int, int, ncclComm_t, void *);
int ncclReduce(const void *, void *, size_t, int, int, int, ncclComm_t, void *);
int ncclAllGather(const void *, void *, size_t, int, ncclComm_t, void *);
int ncclReduceScatter(const void *, void *, size_t, int, int, ncclComm_t, void *);
int ncclSend(const void *, size_t, int, int, ncclComm_t, void *);
int ncclRecv(void *, size_t, int, int, ncclComm_t, void *);
int ncclGroupStart(void);
int ncclGroupEnd(void);

/* ---- checks ---- */
static int g_checks;
#define CHECK(cond)                                                                     \
    do {                                                                                \
        __atomic_fetch_add(&g_checks, 1, __ATOMIC_RELAXED);                             \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "smoke: %s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)
#define EQ(expr, want) CHECK((expr) == (want))
#define PTR(d) ((void *)(uintptr_t)(d))
#define DEV(p) ((CUdeviceptr)(uintptr_t)(p))

enum { FLOAT32 = 7, INT32 = 2, SUM = 0 };

static char g_log[256];
static CUcontext g_ctx0, g_ctx1;

/* Runs f in a child process; returns its wait status. */
static int in_child(void (*f)(void *), void *arg)
{
    pid_t pid = fork();
    if (pid == 0) {
        f(arg);
        _exit(0);
    }
    int status;
    waitpid(pid, &status, 0);
    return status;
}

static void init_without_devices(void *arg)
{
    (void)arg;
    setenv("RDIST_STUB_DEVICES", "0", 1);
    _exit(cuInit(0) == 100 ? 0 : 1);
}

static void touch_device_memory(void *p)
{
    volatile char *c = p;
    c[0] = 1; /* must fault: device memory is not CPU-accessible */
}

/* Calls f with stderr captured into buf. */
static void capture_stderr(void (*f)(void *), void *arg, char *buf, size_t len)
{
    char path[] = "/tmp/rdist-smoke-stderr-XXXXXX";
    int fd = mkstemp(path), saved = dup(2);
    fflush(stderr);
    dup2(fd, 2);
    f(arg);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    ssize_t n = pread(fd, buf, len - 1, 0);
    buf[n > 0 ? n : 0] = 0;
    close(fd);
    unlink(path);
}

static void sync_event(void *e) { EQ(cuEventSynchronize(e), 600); }
static void sync_stream(void *s) { EQ(cuStreamSynchronize(s), 600); }
static void sync_ctx(void *unused) { (void)unused; EQ(cuCtxSynchronize(), 600); }

static void test_cuda_init(void)
{
    int v, n;
    EQ(cuDriverGetVersion(&v), 0);
    EQ(v, 12020);
    EQ(cuDeviceGetCount(&n), 3); /* not initialised */
    int status = in_child(init_without_devices, NULL);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    setenv("RDIST_STUB_DEVICES", "2", 1);
    EQ(cuInit(1), 1);
    EQ(cuInit(0), 0);
    EQ(cuDeviceGetCount(&n), 0);
    EQ(n, 2);
    CUdevice d;
    EQ(cuDeviceGet(&d, 2), 101);
    EQ(cuDeviceGet(&d, 1), 0);
    char name[64];
    EQ(cuDeviceGetName(name, sizeof name, 1), 0);
    CHECK(strcmp(name, "rdist stub GPU 1") == 0);
    size_t mem;
    EQ(cuDeviceTotalMem_v2(&mem, 0), 0);
    CHECK(mem > 0);
    const char *s;
    EQ(cuGetErrorString(600, &s), 0);
    CHECK(strcmp(s, "device not ready") == 0);
    EQ(cuGetErrorName(201, &s), 0);
    CHECK(strcmp(s, "CUDA_ERROR_INVALID_CONTEXT") == 0);
    EQ(cuGetErrorName(12345, &s), 1);
}

static void test_contexts(void)
{
    CUdeviceptr p;
    CUdevice d;
    CUcontext c;
    EQ(cuMemAlloc_v2(&p, 16), 201);
    EQ(cuCtxGetDevice(&d), 201);
    EQ(rdist_stub_current_device(), -1);
    EQ(cuCtxSetCurrent((CUcontext)&d), 201); /* not a context */
    EQ(cuDevicePrimaryCtxRetain(&g_ctx0, 0), 0);
    EQ(cuDevicePrimaryCtxRetain(&g_ctx1, 1), 0);
    CHECK(g_ctx0 && g_ctx1 && g_ctx0 != g_ctx1);
    EQ(cuCtxSetCurrent(g_ctx0), 0);
    EQ(cuCtxGetDevice(&d), 0);
    EQ(d, 0);
    EQ(cuCtxPushCurrent_v2(g_ctx1), 0);
    EQ(rdist_stub_current_device(), 1);
    EQ(cuCtxPopCurrent_v2(&c), 0);
    CHECK(c == g_ctx1);
    EQ(cuCtxGetCurrent(&c), 0);
    CHECK(c == g_ctx0);
    EQ(cuCtxSynchronize(), 0);
    /* a released primary context can no longer be made current */
    EQ(cuDevicePrimaryCtxRelease_v2(1), 0);
    EQ(cuDevicePrimaryCtxRelease_v2(1), 201);
    EQ(cuCtxPushCurrent_v2(g_ctx1), 201);
    EQ(cuDevicePrimaryCtxRetain(&c, 1), 0);
    CHECK(c == g_ctx1);
    EQ(cuCtxPushCurrent_v2(g_ctx1), 0);
    EQ(cuCtxPopCurrent_v2(NULL), 0);
    EQ(cuCtxPopCurrent_v2(NULL), 0);
    EQ(cuCtxPopCurrent_v2(NULL), 201); /* empty stack */
    EQ(cuCtxSetCurrent(g_ctx0), 0);
}

static void test_memory(void)
{
    CUdeviceptr a, b, c1;
    unsigned char host[1000], back[1000];
    for (int i = 0; i < 1000; i++)
        host[i] = (unsigned char)i;
    EQ(cuMemAlloc_v2(&a, 0), 1);
    EQ(cuMemAlloc_v2(&a, 1000), 0);
    EQ(cuMemAlloc_v2(&b, 1000), 0);
    CHECK(WIFSIGNALED(in_child(touch_device_memory, PTR(a))));
    EQ(cuMemcpyHtoD_v2(a, host, 1000), 0);
    EQ(cuMemcpyDtoD_v2(b, a, 1000), 0);
    memset(back, 0, sizeof back);
    EQ(cuMemcpyDtoH_v2(back, b, 1000), 0);
    CHECK(memcmp(host, back, 1000) == 0);
    EQ(cuMemcpyHtoD_v2(a, host, 1001), 1);       /* past the allocation */
    EQ(cuMemcpyHtoD_v2(a + 1, host, 1000), 1);   /* past the allocation */
    EQ(cuMemcpyHtoD_v2(a, PTR(b), 10), 1);       /* "host" side is device memory */
    EQ(cuMemcpyDtoH_v2(PTR(b), a, 10), 1);       /* "host" side is device memory */
    EQ(cuMemcpyDtoH_v2(back, DEV(host), 10), 1); /* "device" side is host memory */
    EQ(cuMemcpy(DEV(back), a + 10, 5), 0);       /* unified: DtoH */
    CHECK(memcmp(back, host + 10, 5) == 0);
    EQ(cuMemcpy(a, DEV(host + 500), 4), 0); /* unified: HtoD */
    EQ(cuMemsetD8_v2(a + 4, 0x7f, 4), 0);
    EQ(cuMemcpyDtoH_v2(back, a, 8), 0);
    CHECK(memcmp(back, host + 500, 4) == 0 && back[4] == 0x7f && back[7] == 0x7f);
    EQ(cuMemsetD8_v2(a + 999, 0, 2), 1);
    /* shadow lookups */
    int dev = -1;
    CHECK(rdist_stub_shadow(a, 1000, &dev) != NULL && dev == 0);
    CHECK(rdist_stub_shadow(a + 1000, 0, NULL) != NULL);
    CHECK(rdist_stub_shadow(a + 1, 1000, NULL) == NULL);
    CHECK(rdist_stub_shadow(DEV(host), 1, NULL) == NULL);
    /* pointer attributes */
    CUcontext ctx;
    unsigned mt, managed;
    int ordinal;
    CUdeviceptr dp;
    EQ(cuPointerGetAttribute(&ctx, 1, a + 3), 0);
    CHECK(ctx == g_ctx0);
    EQ(cuPointerGetAttribute(&mt, 2, a), 0);
    EQ(mt, 2);
    EQ(cuPointerGetAttribute(&dp, 3, a + 3), 0);
    EQ(dp, a + 3);
    EQ(cuPointerGetAttribute(&managed, 8, a), 0);
    EQ(managed, 0);
    EQ(cuPointerGetAttribute(&ordinal, 9, a), 0);
    EQ(ordinal, 0);
    EQ(cuPointerGetAttribute(&mt, 2, DEV(host)), 1);
    EQ(cuPointerGetAttribute(&mt, 2, a + 1000), 1);
    int attrs[] = {1, 2, 9};
    void *data[] = {&ctx, &mt, &ordinal};
    EQ(cuCtxPushCurrent_v2(g_ctx1), 0);
    EQ(cuMemAlloc_v2(&c1, 64), 0);
    EQ(cuCtxPopCurrent_v2(NULL), 0);
    EQ(cuPointerGetAttributes(3, attrs, data, c1), 0);
    CHECK(ctx == g_ctx1 && mt == 2 && ordinal == 1);
    EQ(cuPointerGetAttributes(3, attrs, data, DEV(host)), 0);
    CHECK(ctx == NULL && mt == 0 && ordinal == 0);
    EQ(cuMemcpyDtoD_v2(c1, a, 64), 0); /* across devices, as UVA allows */
    /* free */
    EQ(cuMemFree_v2(a + 1), 1);
    EQ(cuMemFree_v2(a), 0);
    EQ(cuMemFree_v2(a), 1);
    EQ(cuMemcpyDtoH_v2(back, a, 1), 1);
    CHECK(rdist_stub_shadow(a, 0, NULL) == NULL);
    EQ(cuMemFree_v2(b), 0);
    EQ(cuMemFree_v2(c1), 0);
}

static void test_streams_events(void)
{
    CUstream s;
    CUevent e, e2;
    CUdeviceptr a;
    char host[8] = "abcdefg", back[8];
    EQ(cuStreamCreate(&s, 2), 1);
    EQ(cuStreamCreate(&s, 1), 0);
    EQ(cuEventCreate(&e, 2), 0);
    EQ(cuEventCreate(&e2, 0), 0);
    EQ(cuEventQuery(e), 0); /* never recorded */
    EQ(cuMemAlloc_v2(&a, 8), 0);
    EQ(cuMemcpyHtoDAsync_v2(a, host, 8, s), 0);
    EQ(cuMemcpyDtoDAsync_v2(a, a, 8, NULL), 0);
    EQ(cuMemcpyDtoHAsync_v2(back, a, 8, s), 0);
    CHECK(memcmp(host, back, 8) == 0);
    EQ(cuEventRecord(e, s), 0);
    EQ(cuEventQuery(e), 0);
    rdist_stub_stall_stream(s, 1);
    EQ(cuStreamQuery(s), 600);
    EQ(cuStreamQuery(NULL), 0); /* the NULL stream is tracked separately */
    EQ(cuEventRecord(e, s), 0);
    EQ(cuEventQuery(e), 600);
    char err[256];
    capture_stderr(sync_event, e, err, sizeof err);
    CHECK(strstr(err, "rdist-stub: blocking wait on a stalled stream") != NULL);
    capture_stderr(sync_stream, s, err, sizeof err);
    CHECK(strstr(err, "cuStreamSynchronize") != NULL);
    rdist_stub_stall_stream(NULL, 1);
    EQ(cuEventRecord(e2, NULL), 0);
    EQ(cuEventQuery(e2), 600);
    capture_stderr(sync_ctx, NULL, err, sizeof err);
    CHECK(strstr(err, "cuCtxSynchronize") != NULL);
    rdist_stub_stall_stream(NULL, 0);
    rdist_stub_stall_stream(s, 0);
    EQ(cuEventQuery(e), 0);
    EQ(cuEventQuery(e2), 0);
    EQ(cuStreamSynchronize(s), 0);
    EQ(cuEventSynchronize(e), 0);
    EQ(cuEventDestroy_v2(e), 0);
    EQ(cuEventQuery(e), 400);
    EQ(cuEventDestroy_v2(e), 400);
    EQ(cuEventDestroy_v2(e2), 0);
    EQ(cuStreamDestroy_v2(s), 0);
    EQ(cuStreamQuery(s), 400);
    EQ(cuMemcpyHtoDAsync_v2(a, host, 8, s), 400);
    EQ(cuMemFree_v2(a), 0);
}

/* ---- NCCL ---- */

static CUdeviceptr dalloc_fill(size_t n, float start)
{
    CUdeviceptr p;
    float *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++)
        h[i] = start + (float)i;
    EQ(cuMemAlloc_v2(&p, n * sizeof *h), 0);
    EQ(cuMemcpyHtoD_v2(p, h, n * sizeof *h), 0);
    free(h);
    return p;
}

static int dequal(CUdeviceptr p, size_t n, float start)
{
    float *h = malloc(n * sizeof *h);
    int ok = cuMemcpyDtoH_v2(h, p, n * sizeof *h) == 0;
    for (size_t i = 0; ok && i < n; i++)
        ok = h[i] == start + (float)i;
    free(h);
    return ok;
}

static void test_nccl_basics(void)
{
    int v;
    EQ(ncclGetVersion(&v), 0);
    EQ(v, 22105);
    CHECK(strcmp(ncclGetLastError(NULL), "") == 0);
    CHECK(strcmp(ncclGetErrorString(6), "remote process exited or there was a network error") == 0);
    ncclUniqueId id, id2;
    EQ(ncclGetUniqueId(&id), 0);
    EQ(ncclGetUniqueId(&id2), 0);
    CHECK(strcmp(id.internal, "rdist-stub-id") == 0 && memcmp(&id, &id2, sizeof id) != 0);
    ncclComm_t comm;
    CUcontext c;
    EQ(cuCtxPopCurrent_v2(&c), 0); /* no current context */
    EQ(ncclCommInitRank(&comm, 1, id, 0), 1);
    CHECK(strcmp(ncclGetLastError(NULL), "no current CUDA device") == 0);
    EQ(cuCtxPushCurrent_v2(c), 0);
    EQ(ncclCommInitRank(&comm, 1, id, 1), 4);
    EQ(ncclCommInitRank(&comm, 0, id, 0), 4);
    ncclUniqueId zero = {{0}};
    EQ(ncclCommInitRank(&comm, 1, zero, 0), 4);
    ncclConfig_t bad = {sizeof bad, 0x1234, 0, 1, 0, 0, 0, NULL, 0};
    EQ(ncclCommInitRankConfig(&comm, 1, id, 0, &bad), 4);
    EQ(ncclCommGetAsyncError((ncclComm_t)&v, &v), 4);
    EQ(ncclGroupEnd(), 5);
}

static void test_nccl_collectives(void)
{
    ncclUniqueId id;
    ncclComm_t comm;
    int n, r, d;
    EQ(ncclGetUniqueId(&id), 0);
    EQ(ncclCommInitRank(&comm, 1, id, 0), 0);
    EQ(ncclCommCount(comm, &n), 0);
    EQ(ncclCommUserRank(comm, &r), 0);
    EQ(ncclCommCuDevice(comm, &d), 0);
    CHECK(n == 1 && r == 0 && d == 0);
    CUdeviceptr s = dalloc_fill(256, 1), dst = dalloc_fill(256, 0);
    EQ(ncclAllReduce(PTR(s), PTR(dst), 256, FLOAT32, SUM, comm, NULL), 0);
    CHECK(dequal(dst, 256, 1));
    EQ(ncclAllReduce(PTR(dst), PTR(dst), 256, FLOAT32, SUM, comm, NULL), 0); /* in place */
    CHECK(dequal(dst, 256, 1));
    CUdeviceptr s2 = dalloc_fill(64, 100);
    EQ(ncclBroadcast(PTR(s2), PTR(dst), 64, FLOAT32, 0, comm, NULL), 0);
    EQ(ncclReduce(PTR(s2), PTR(dst + 256), 32, FLOAT32, SUM, 0, comm, NULL), 0);
    EQ(ncclAllGather(PTR(s2), PTR(dst + 512), 16, FLOAT32, comm, NULL), 0);
    EQ(ncclReduceScatter(PTR(s2), PTR(dst + 768), 8, FLOAT32, SUM, comm, NULL), 0);
    CHECK(dequal(dst, 64, 100) && dequal(dst + 256, 32, 100) && dequal(dst + 512, 16, 100));
    CHECK(dequal(dst + 768, 8, 100));
    /* misuse */
    float host[4];
    EQ(ncclAllReduce(host, PTR(dst), 4, FLOAT32, SUM, comm, NULL), 4);
    CHECK(strstr(ncclGetLastError(comm), "ncclAllReduce: sendbuff") != NULL);
    CHECK(strstr(ncclGetLastError(comm), "is not device memory") != NULL);
    EQ(ncclAllReduce(PTR(s), host, 4, FLOAT32, SUM, comm, NULL), 4);
    EQ(ncclAllReduce(PTR(s), PTR(dst), 257, FLOAT32, SUM, comm, NULL), 4);
    EQ(ncclAllReduce(PTR(s), PTR(dst), 4, 10, SUM, comm, NULL), 4);
    EQ(ncclAllReduce(PTR(s), PTR(dst), 4, FLOAT32, 5, comm, NULL), 4);
    EQ(ncclBroadcast(PTR(s), PTR(dst), 4, FLOAT32, 1, comm, NULL), 4);
    EQ(ncclAllReduce(PTR(s), PTR(dst), 0, FLOAT32, SUM, comm, NULL), 0); /* count 0: no check */
    EQ(ncclAllReduce(PTR(s), PTR(dst), 4, FLOAT32, SUM, comm, (void *)host), 1); /* not a stream */
    /* send/recv */
    EQ(ncclSend(PTR(s), 4, FLOAT32, 0, comm, NULL), 5); /* outside a group */
    EQ(ncclGroupStart(), 0);
    EQ(ncclSend(PTR(s2), 16, FLOAT32, 0, comm, NULL), 0);
    EQ(ncclRecv(PTR(dst + 896), 16, FLOAT32, 0, comm, NULL), 0);
    EQ(ncclGroupEnd(), 0);
    CHECK(dequal(dst + 896, 16, 100));
    EQ(ncclGroupStart(), 0);
    EQ(ncclSend(PTR(s2), 16, FLOAT32, 0, comm, NULL), 0);
    EQ(ncclGroupEnd(), 5); /* unmatched */
    EQ(ncclGroupStart(), 0);
    EQ(ncclGroupStart(), 0);
    EQ(ncclSend(PTR(s2), 16, FLOAT32, 0, comm, NULL), 0);
    EQ(ncclRecv(PTR(dst), 8, FLOAT32, 0, comm, NULL), 0);
    EQ(ncclGroupEnd(), 0); /* inner */
    EQ(ncclGroupEnd(), 5); /* length mismatch */
    EQ(ncclGroupStart(), 0);
    EQ(ncclSend(PTR(s2), 4, FLOAT32, 1, comm, NULL), 4); /* no peer 1 */
    EQ(ncclGroupEnd(), 4);                                /* the group carries the error */
    /* split, finalize, destroy */
    ncclComm_t sub;
    EQ(ncclCommSplit(comm, -1, 0, &sub, NULL), 0);
    CHECK(sub == NULL);
    EQ(ncclCommSplit(comm, 3, 0, &sub, NULL), 0);
    EQ(ncclCommCount(sub, &n), 0);
    EQ(n, 1);
    EQ(ncclCommDestroy(sub), 0);
    EQ(ncclCommCount(sub, &n), 5);
    EQ(ncclCommFinalize(comm), 0);
    EQ(ncclAllReduce(PTR(s), PTR(dst), 4, FLOAT32, SUM, comm, NULL), 5);
    EQ(ncclCommDestroy(comm), 0);
    EQ(ncclCommDestroy(comm), 5);
    /* more than one rank: validated, no data moved */
    EQ(ncclCommInitRank(&comm, 2, id, 1), 0);
    EQ(ncclAllReduce(PTR(s), PTR(dst), 4, FLOAT32, SUM, comm, NULL), 0);
    CHECK(dequal(dst, 4, 100));
    EQ(ncclAllGather(PTR(s), PTR(dst), 128, FLOAT32, comm, NULL), 0);
    EQ(ncclAllGather(PTR(s), PTR(dst), 129, FLOAT32, comm, NULL), 4); /* recvbuff too small */
    EQ(ncclCommDestroy(comm), 0);
    EQ(cuMemFree_v2(s), 0);
    EQ(cuMemFree_v2(s2), 0);
    EQ(cuMemFree_v2(dst), 0);
}

static void test_nccl_nonblocking(void)
{
    ncclUniqueId id;
    ncclComm_t comm;
    int st;
    ncclConfig_t cfg = {sizeof cfg, 0xcafebeef, 22105, 0, 0, 0, 0, NULL, 0};
    CUdeviceptr b = dalloc_fill(16, 0);
    EQ(ncclGetUniqueId(&id), 0);
    EQ(ncclCommInitRankConfig(&comm, 1, id, 0, &cfg), 7);
    CHECK(comm != NULL);
    EQ(ncclAllReduce(PTR(b), PTR(b), 16, FLOAT32, SUM, comm, NULL), 4); /* not ready yet */
    EQ(ncclCommGetAsyncError(comm, &st), 0);
    EQ(st, 7);
    EQ(ncclCommGetAsyncError(comm, &st), 0);
    EQ(st, 7);
    EQ(ncclCommGetAsyncError(comm, &st), 0);
    EQ(st, 0);
    EQ(ncclAllReduce(PTR(b), PTR(b), 16, FLOAT32, SUM, comm, NULL), 7);
    EQ(ncclCommGetAsyncError(comm, &st), 0);
    EQ(st, 0);
    EQ(ncclGroupStart(), 0);
    EQ(ncclAllReduce(PTR(b), PTR(b), 16, FLOAT32, SUM, comm, NULL), 0);
    EQ(ncclGroupEnd(), 7);
    EQ(ncclCommGetAsyncError(comm, &st), 0);
    EQ(st, 0);
    EQ(ncclCommFinalize(comm), 7);
    EQ(ncclCommGetAsyncError(comm, &st), 0);
    EQ(st, 0);
    EQ(ncclCommDestroy(comm), 0);
    EQ(cuMemFree_v2(b), 0);
}

static void destroy_hung(void *comm) { EQ(ncclCommDestroy(comm), 5); }

static void test_nccl_faults(void)
{
    ncclUniqueId id;
    ncclComm_t comm;
    int st;
    CUdeviceptr b = dalloc_fill(16, 0);
    EQ(ncclGetUniqueId(&id), 0);
    /* injected asynchronous error */
    EQ(ncclCommInitRank(&comm, 1, id, 0), 0);
    setenv("RDIST_STUB_NCCL_ASYNC_ERROR", "6", 1);
    EQ(ncclAllReduce(PTR(b), PTR(b), 16, FLOAT32, SUM, comm, NULL), 0);
    unsetenv("RDIST_STUB_NCCL_ASYNC_ERROR");
    EQ(ncclCommGetAsyncError(comm, &st), 0);
    EQ(st, 6);
    CHECK(strcmp(ncclGetLastError(comm), "rdist stub: injected asynchronous error 6") == 0);
    EQ(ncclAllReduce(PTR(b), PTR(b), 16, FLOAT32, SUM, comm, NULL), 6); /* the comm is in error */
    CHECK(strcmp(ncclGetLastError(comm), "rdist stub: injected asynchronous error 6") == 0);
    EQ(ncclCommAbort(comm), 0);
    EQ(ncclCommGetAsyncError(comm, &st), 0);
    EQ(st, 0);
    EQ(ncclAllReduce(PTR(b), PTR(b), 16, FLOAT32, SUM, comm, NULL), 5);
    EQ(ncclCommAbort(comm), 5);
    EQ(ncclCommDestroy(comm), 5);
    /* hang: the operation's stream never completes until the abort */
    CUstream s;
    CUevent e;
    EQ(cuStreamCreate(&s, 0), 0);
    EQ(cuEventCreate(&e, 0), 0);
    EQ(ncclCommInitRank(&comm, 1, id, 0), 0);
    setenv("RDIST_STUB_NCCL_HANG", "1", 1);
    EQ(ncclAllReduce(PTR(b), PTR(b), 16, FLOAT32, SUM, comm, s), 0);
    unsetenv("RDIST_STUB_NCCL_HANG");
    EQ(cuEventRecord(e, s), 0);
    EQ(cuEventQuery(e), 600);
    EQ(cuStreamQuery(s), 600);
    char err[256];
    capture_stderr(destroy_hung, comm, err, sizeof err);
    CHECK(strstr(err, "hung operations") != NULL);
    EQ(ncclCommAbort(comm), 0);
    EQ(cuEventQuery(e), 0);
    EQ(cuStreamSynchronize(s), 0);
    EQ(cuEventDestroy_v2(e), 0);
    EQ(cuStreamDestroy_v2(s), 0);
    EQ(cuMemFree_v2(b), 0);
}

/* ---- threads ---- */

static void *worker(void *arg)
{
    CUcontext ctx = arg;
    EQ(cuCtxSetCurrent(ctx), 0);
    for (int i = 0; i < 200; i++) {
        CUdeviceptr p;
        long v = i, back = -1;
        EQ(cuMemAlloc_v2(&p, sizeof v), 0);
        EQ(cuMemcpyHtoD_v2(p, &v, sizeof v), 0);
        EQ(cuMemcpyDtoH_v2(&back, p, sizeof v), 0);
        EQ(back, v);
        EQ(cuMemFree_v2(p), 0);
    }
    ncclUniqueId id;
    ncclComm_t comm;
    CUdeviceptr s = dalloc_fill(32, 5), d = dalloc_fill(32, 0);
    EQ(ncclGetUniqueId(&id), 0);
    EQ(ncclCommInitRank(&comm, 1, id, 0), 0);
    for (int i = 0; i < 50; i++) {
        EQ(ncclGroupStart(), 0);
        EQ(ncclSend(PTR(s), 32, FLOAT32, 0, comm, NULL), 0);
        EQ(ncclRecv(PTR(d), 32, FLOAT32, 0, comm, NULL), 0);
        EQ(ncclGroupEnd(), 0);
        EQ(ncclAllReduce(PTR(s), PTR(d), 32, FLOAT32, SUM, comm, NULL), 0);
    }
    CHECK(dequal(d, 32, 5));
    EQ(ncclCommDestroy(comm), 0);
    EQ(cuMemFree_v2(s), 0);
    EQ(cuMemFree_v2(d), 0);
    return NULL;
}

static void test_threads(void)
{
    pthread_t t[4];
    CUdevice d;
    for (int i = 0; i < 4; i++)
        EQ(pthread_create(&t[i], NULL, worker, i % 2 ? g_ctx1 : g_ctx0), 0);
    for (int i = 0; i < 4; i++)
        EQ(pthread_join(t[i], NULL), 0);
    EQ(cuCtxGetDevice(&d), 0); /* this thread's stack is its own */
    EQ(d, 0);
}

/* The stubs are one instance whether linked or dlopen'ed by name. */
static void test_dlopen(void)
{
    Dl_info info;
    CHECK(dladdr((void *)cuInit, &info) && info.dli_fname);
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s", info.dli_fname);
    snprintf(path, sizeof path, "%s/libcuda.so", dirname(dir));
    void *h = dlopen(path, RTLD_NOW);
    CHECK(h != NULL && dlsym(h, "cuInit") == (void *)cuInit);
    snprintf(path, sizeof path, "%s/libnccl.so.2", dir);
    void *n = dlopen(path, RTLD_NOW);
    CHECK(n != NULL && dlsym(n, "ncclAllReduce") == (void *)ncclAllReduce);
}

static void test_log(void)
{
    char buf[1 << 16];
    int fd = open(g_log, O_RDONLY);
    CHECK(fd >= 0);
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    CHECK(n > 0);
    buf[n] = 0;
    CHECK(strstr(buf, "cuda pid=") && strstr(buf, " cuInit devices=2"));
    CHECK(strstr(buf, " cuMemAlloc dptr=") && strstr(buf, " memcpy dir=HtoD"));
    CHECK(strstr(buf, "nccl pid=") && strstr(buf, " init rank=0 nranks=1 id=72646973742d737475622d696400"));
    CHECK(strstr(buf, " idhash=") && strstr(buf, " abort rank=0 nranks=1 comm="));
    CHECK(strstr(buf, " ncclAllReduce rank=0 nranks=1 count=256 dtype=7 op=0"));
    CHECK(strstr(buf, " group_start ") && strstr(buf, " split ") && strstr(buf, " abort "));
    if (!getenv("RDIST_SMOKE_KEEP_LOG"))
        unlink(g_log);
}

int main(void)
{
    snprintf(g_log, sizeof g_log, "/tmp/rdist-smoke-log-%d", (int)getpid());
    unlink(g_log);
    setenv("RDIST_STUB_LOG", g_log, 1);
    test_cuda_init();
    test_contexts();
    test_memory();
    test_streams_events();
    test_nccl_basics();
    test_nccl_collectives();
    test_nccl_nonblocking();
    test_nccl_faults();
    test_threads();
    test_dlopen();
    test_log();
    printf("smoke: %d checks passed\n", g_checks);
    return 0;
}
