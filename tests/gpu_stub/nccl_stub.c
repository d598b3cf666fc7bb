/*
 * nccl_stub.c -- a test double that impersonates NCCL 2.21.5
 * (libnccl.so.2) on top of the CUDA driver stub (cuda_stub.c), so that
 * rdist's NCCL backend can run on a machine without a GPU.
 *
 * What it simulates:
 *  - world size 1 moves data: every collective copies count elements from
 *    sendbuff to recvbuff (memmove on the stub's shadow bytes); send/recv
 *    to self are queued inside a group and matched at the outermost
 *    ncclGroupEnd. With nranks > 1, arguments are validated and logged
 *    but no data moves (multi-rank movement is not simulated).
 *  - every buffer must be device memory of the communicator's device (the
 *    CUDA stub's allocation table is the judge); dtype/op/root/peer ranges
 *    are checked; misuse fails with NCCL's codes and a ncclGetLastError
 *    text.
 *  - non-blocking communicators (config->blocking == 0): init returns
 *    ncclInProgress and the first 2 polls of ncclCommGetAsyncError report
 *    ncclInProgress; a collective / ncclGroupEnd / ncclCommFinalize
 *    returns ncclInProgress and the next poll reports ncclSuccess. Using a
 *    communicator before a poll said ncclSuccess is ncclInvalidArgument,
 *    as in NCCL's ncclCommEnsureReady. A non-blocking ncclCommSplit keeps
 *    *newcomm NULL, reports progress on the parent, and stores the child
 *    through it from a thread of its own 20 ms after the parent's poll
 *    reported ncclSuccess; the child then reports ncclInProgress for two
 *    polls (NCCL 2.28 on an H100 stored it after the parent was idle).
 *  - faults, read at each call: RDIST_STUB_NCCL_HANG=1 stalls the stream
 *    of every operation (=from:N: of the N-th and later ones) (ncclCommAbort un-stalls them, as a real abort
 *    ends the kernels); RDIST_STUB_NCCL_ASYNC_ERROR=<code> makes the
 *    communicator report <code> asynchronously after its first operation.
 *    RDIST_STUB_NCCL_ENQUEUE_BLOCK=1 makes an operation outside a group
 *    block inside the call until the communicator is aborted.
 *  - communicators are never freed, so use after ncclCommAbort or
 *    ncclCommDestroy is an error code, not a crash.
 *
 * RDIST_STUB_LOG (a file) gets one line per notable call. Thread-safe: a
 * mutex guards the communicators; group state is per thread, as in NCCL.
 * No NCCL header is used: the types and codes below mirror nccl.h.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int ncclResult_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef struct nccl_comm *ncclComm_t;
typedef void *cudaStream_t;
typedef struct {
    char internal[128];
} ncclUniqueId;
typedef struct {
    size_t size;
    unsigned magic;
    unsigned version;
    int blocking;
    /* later fields are not read */
} ncclConfig_t;

enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};

#define NCCL_VERSION_CODE 22105
#define NCCL_CONFIG_MAGIC 0xcafebeefu
#define NCCL_CONFIG_MIN_SIZE 24
#define NCCL_SPLIT_NOCOLOR (-1)
#define NCCL_NUM_OPS 5
#define ID_PREFIX "rdist-stub-id"
#define MAX_HUNG 32
#define COMM_MAGIC 0x4E43434Cu

/* From the CUDA stub (libcuda.so.1 of this folder). */
void *rdist_stub_shadow(unsigned long long dptr, size_t len, int *device);
int rdist_stub_current_device(void);
void rdist_stub_stall_stream(void *stream, int stalled);
int rdist_stub_stream_check(void *stream);
int rdist_stub_stream_is_stalled(void *stream);

enum comm_state { LIVE, FINALIZED, ABORTED, DESTROYED };

struct nccl_comm {
    unsigned magic;
    int nranks, rank, device, blocking;
    enum comm_state state;
    int busy;         /* returned ncclInProgress; not yet polled to success */
    int polls_left;   /* polls that still report ncclInProgress */
    int async_error;  /* injected asynchronous error, sticky */
    unsigned char id[16];
    void *hung[MAX_HUNG]; /* streams stalled by RDIST_STUB_NCCL_HANG */
    int nhung;
    /* A non-blocking ncclCommSplit in flight: as in NCCL, *newcomm stays
     * NULL until after the parent is polled to ncclSuccess, then the child
     * is stored through the caller's pointer (which must still be valid). */
    struct nccl_comm **split_slot, *split_child;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct nccl_comm **g_comms; /* every communicator ever made */
static size_t g_ncomms, g_cap_comms;

static pthread_mutex_t g_err_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_last_error[512];
static __thread char tls_last_error[512];

/* Group state, per thread. */
struct p2p_op {
    int is_send;
    struct nccl_comm *comm;
    unsigned long long buf;
    size_t bytes;
};
static __thread int tls_group_depth;
static __thread ncclResult_t tls_group_error;
static __thread struct p2p_op *tls_ops;
static __thread size_t tls_nops, tls_cap_ops;
static __thread struct nccl_comm **tls_touched;
static __thread size_t tls_ntouched, tls_cap_touched;

static void lock(void) { pthread_mutex_lock(&g_lock); }
static void unlock(void) { pthread_mutex_unlock(&g_lock); }

/* ------------------------------------------------------------------ */
/* Logging and errors                                                  */
/* ------------------------------------------------------------------ */

__attribute__((format(printf, 1, 2))) static void stub_log(const char *fmt, ...)
{
    const char *path = getenv("RDIST_STUB_LOG");
    if (!path || !*path)
        return;
    char line[512];
    int n = snprintf(line, sizeof line, "nccl pid=%d ", (int)getpid());
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

static void set_last_error_v(const char *fmt, va_list ap)
{
    pthread_mutex_lock(&g_err_lock);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    pthread_mutex_unlock(&g_err_lock);
}

__attribute__((format(printf, 1, 2))) static void set_last_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    set_last_error_v(fmt, ap);
    va_end(ap);
}

/* Records a failure (text for ncclGetLastError; inside a group, the
 * group's result too) and returns its code. */
__attribute__((format(printf, 2, 3))) static ncclResult_t fail(ncclResult_t r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    set_last_error_v(fmt, ap);
    va_end(ap);
    if (tls_group_depth && !tls_group_error)
        tls_group_error = r;
    return r;
}

EXPORT const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

/* The text is copied to a per-thread buffer, so the pointer stays valid
 * for the calling thread until its next call. The comm is not used. */
EXPORT const char *ncclGetLastError(ncclComm_t comm)
{
    (void)comm;
    pthread_mutex_lock(&g_err_lock);
    memcpy(tls_last_error, g_last_error, sizeof tls_last_error);
    pthread_mutex_unlock(&g_err_lock);
    return tls_last_error;
}

EXPORT ncclResult_t ncclGetVersion(int *version)
{
    if (!version)
        return fail(ncclInvalidArgument, "ncclGetVersion: version is NULL");
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

/* ------------------------------------------------------------------ */
/* Fault injection                                                     */
/* ------------------------------------------------------------------ */

/* RDIST_STUB_NCCL_HANG=1 stalls every operation; =from:N the N-th
 * operation of the process (counting from 1) and every one after it.
 * Called once per operation, lock held. */
static int env_hang(void)
{
    static long operations;
    const char *v = getenv("RDIST_STUB_NCCL_HANG");
    operations++;
    if (v && strncmp(v, "from:", 5) == 0)
        return operations >= atol(v + 5);
    return v && strcmp(v, "1") == 0;
}

/* RDIST_STUB_NCCL_ENQUEUE_BLOCK=1: an operation outside a group blocks
 * inside the call until its communicator is aborted, then fails, as
 * NCCL's enqueue spins on a full work queue behind a dead peer until its
 * abort flag is set. */
static int env_enqueue_block(void)
{
    const char *v = getenv("RDIST_STUB_NCCL_ENQUEUE_BLOCK");
    return v && strcmp(v, "1") == 0;
}

/* The error code to inject, 0 for none. */
static int env_async_error(void)
{
    const char *v = getenv("RDIST_STUB_NCCL_ASYNC_ERROR");
    if (!v || !*v)
        return 0;
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < 0 || x > ncclRemoteError) {
        fprintf(stderr, "rdist-stub: RDIST_STUB_NCCL_ASYNC_ERROR=%s is not an ncclResult_t; ignored\n", v);
        return 0;
    }
    return (int)x;
}

/* Applies the faults the environment asks for to an operation. Lock held. */
static void inject_faults(struct nccl_comm *c, cudaStream_t stream)
{
    if (env_hang()) {
        rdist_stub_stall_stream(stream, 1);
        int known = 0;
        for (int i = 0; i < c->nhung; i++)
            known |= c->hung[i] == stream;
        if (!known && c->nhung < MAX_HUNG)
            c->hung[c->nhung++] = stream;
    }
    int code = env_async_error();
    if (code && !c->async_error) {
        c->async_error = code;
        set_last_error("rdist stub: injected asynchronous error %d", code);
    }
}

/* ------------------------------------------------------------------ */
/* Communicators                                                       */
/* ------------------------------------------------------------------ */

static int comm_known(const struct nccl_comm *c)
{
    for (size_t i = 0; i < g_ncomms; i++)
        if (g_comms[i] == c)
            return 1;
    return 0;
}

static int comm_register(struct nccl_comm *c)
{
    if (g_ncomms == g_cap_comms) {
        size_t cap = g_cap_comms ? 2 * g_cap_comms : 16;
        struct nccl_comm **n = realloc(g_comms, cap * sizeof *n);
        if (!n)
            return 0;
        g_comms = n;
        g_cap_comms = cap;
    }
    g_comms[g_ncomms++] = c;
    return 1;
}

enum { NEED_READY = 1, ALLOW_FINALIZED = 2 };

/* Validates a communicator argument. Lock held. */
static ncclResult_t comm_get(ncclComm_t comm, const char *api, int flags, struct nccl_comm **out)
{
    if (!comm)
        return fail(ncclInvalidArgument, "%s: comm is NULL", api);
    if (!comm_known(comm))
        return fail(ncclInvalidArgument, "%s: comm %p is not a communicator", api, (void *)comm);
    *out = comm; /* also on failure, for the log; callers check the result */
    static const char *const what[] = {"live", "finalized", "aborted", "destroyed"};
    if (comm->state == ABORTED || comm->state == DESTROYED ||
        (comm->state == FINALIZED && !(flags & ALLOW_FINALIZED)))
        return fail(ncclInvalidUsage, "%s: comm %p was %s", api, (void *)comm, what[comm->state]);
    if ((flags & NEED_READY) && comm->async_error) {
        /* The last error keeps the asynchronous error's own text. */
        if (tls_group_depth && !tls_group_error)
            tls_group_error = comm->async_error;
        return comm->async_error;
    }
    if ((flags & NEED_READY) && comm->busy)
        return fail(ncclInvalidArgument,
                    "%s: comm %p used before the previous operation returned ncclSuccess "
                    "(poll ncclCommGetAsyncError)", api, (void *)comm);
    return ncclSuccess;
}

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    if (!id)
        return fail(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
    memset(id, 0, sizeof *id);
    memcpy(id->internal, ID_PREFIX, sizeof ID_PREFIX);
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    size_t want = sizeof id->internal - sizeof ID_PREFIX;
    ssize_t got = fd < 0 ? -1 : read(fd, id->internal + sizeof ID_PREFIX, want);
    if (fd >= 0)
        close(fd);
    if (got != (ssize_t)want)
        return fail(ncclSystemError, "ncclGetUniqueId: reading /dev/urandom failed");
    return ncclSuccess;
}

static ncclResult_t check_config(const ncclConfig_t *cfg, const char *api)
{
    if (cfg && cfg->magic != NCCL_CONFIG_MAGIC)
        return fail(ncclInvalidArgument, "%s: config magic %#x is not 0xcafebeef (NCCL_CONFIG_INITIALIZER)", api,
                    cfg->magic);
    if (cfg && cfg->size < NCCL_CONFIG_MIN_SIZE)
        return fail(ncclInvalidArgument, "%s: config size %zu is too small", api, cfg->size);
    return ncclSuccess;
}

/* config->blocking: 0 = non-blocking; anything else (NCCL_CONFIG_UNDEF_INT
 * included) = blocking. */
static int config_blocking(const ncclConfig_t *cfg, int dflt)
{
    return cfg && cfg->blocking != INT_MIN ? cfg->blocking != 0 : dflt;
}

static struct nccl_comm *comm_new(int nranks, int rank, int device, int blocking, const unsigned char *id)
{
    struct nccl_comm *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    *c = (struct nccl_comm){.magic = COMM_MAGIC, .nranks = nranks, .rank = rank, .device = device,
                            .blocking = blocking, .state = LIVE};
    memcpy(c->id, id, sizeof c->id);
    if (!blocking) {
        c->busy = 1;
        c->polls_left = 2;
    }
    if (!comm_register(c)) {
        free(c);
        return NULL;
    }
    return c;
}

static ncclResult_t init_checks(ncclComm_t *out, int nranks, const ncclUniqueId *id, int rank,
                                const ncclConfig_t *cfg, const char *api)
{
    if (!out)
        return fail(ncclInvalidArgument, "%s: comm is NULL", api);
    *out = NULL;
    if (nranks < 1)
        return fail(ncclInvalidArgument, "%s: nranks %d is below 1", api, nranks);
    if (rank < 0 || rank >= nranks)
        return fail(ncclInvalidArgument, "%s: rank %d is not in 0..%d", api, rank, nranks - 1);
    if (memcmp(id->internal, ID_PREFIX, sizeof ID_PREFIX) != 0)
        return fail(ncclInvalidArgument, "%s: the unique id was not made by ncclGetUniqueId", api);
    ncclResult_t r = check_config(cfg, api);
    if (r)
        return r;
    if (rdist_stub_current_device() < 0)
        return fail(ncclUnhandledCudaError, "no current CUDA device");
    return ncclSuccess;
}

/* FNV-1a over all 128 bytes: the log's id= shows only the first 16,
 * which are mostly the constant prefix. */
static unsigned long long id_hash(const ncclUniqueId *id)
{
    unsigned long long h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof id->internal; i++)
        h = (h ^ (unsigned char)id->internal[i]) * 1099511628211ull;
    return h;
}

static ncclResult_t comm_init(ncclComm_t *out, int nranks, ncclUniqueId id, int rank, ncclConfig_t *cfg,
                              const char *api)
{
    ncclResult_t r = init_checks(out, nranks, &id, rank, cfg, api);
    struct nccl_comm *c = NULL;
    int device = rdist_stub_current_device(), blocking = config_blocking(cfg, 1);
    if (!r) {
        lock();
        c = comm_new(nranks, rank, device, blocking, (const unsigned char *)id.internal);
        unlock();
        r = c ? (blocking ? ncclSuccess : ncclInProgress) : fail(ncclSystemError, "%s: out of memory", api);
        *out = c;
    }
    char hex[33] = "";
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", (unsigned char)id.internal[i]);
    stub_log("init rank=%d nranks=%d id=%s idhash=%016llx blocking=%d device=%d comm=%p result=%d", rank, nranks,
             hex, id_hash(&id), blocking, device, (void *)c, r);
    return r;
}

EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
    return comm_init(comm, nranks, id, rank, NULL, "ncclCommInitRank");
}

EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                           ncclConfig_t *config)
{
    return comm_init(comm, nranks, id, rank, config, "ncclCommInitRankConfig");
}

struct late_store {
    struct nccl_comm **slot, *child;
};

static void *late_store_run(void *arg)
{
    struct late_store *job = arg;
    usleep(20000);
    lock();
    job->child->busy = 1;
    job->child->polls_left = 2;
    unlock();
    __atomic_store_n(job->slot, job->child, __ATOMIC_RELEASE);
    stub_log("split-stored comm=%p", (void *)job->child);
    free(job);
    return NULL;
}

/* NCCL's split thread: the child reaches *slot only after the parent is
 * idle again. Called with the lock held. */
static void store_child_later(struct nccl_comm **slot, struct nccl_comm *child)
{
    struct late_store *job = malloc(sizeof *job);
    pthread_t thread;
    if (job) {
        job->slot = slot;
        job->child = child;
        if (pthread_create(&thread, NULL, late_store_run, job) == 0) {
            pthread_detach(thread);
            return;
        }
        free(job);
    }
    *slot = child; /* no thread: store at once */
}

EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError)
{
    if (!asyncError)
        return fail(ncclInvalidArgument, "ncclCommGetAsyncError: asyncError is NULL");
    lock();
    ncclResult_t r = ncclSuccess;
    if (!comm || !comm_known(comm))
        r = fail(ncclInvalidArgument, "ncclCommGetAsyncError: comm %p is not a communicator", (void *)comm);
    else if (comm->state == DESTROYED)
        r = fail(ncclInvalidUsage, "ncclCommGetAsyncError: comm %p was destroyed", (void *)comm);
    else if (comm->state == ABORTED)
        *asyncError = ncclSuccess;
    else if (comm->async_error)
        *asyncError = comm->async_error;
    else if (comm->polls_left > 0) {
        comm->polls_left--;
        *asyncError = ncclInProgress;
    } else {
        comm->busy = 0;
        *asyncError = ncclSuccess;
        if (comm->split_slot) {
            store_child_later(comm->split_slot, comm->split_child);
            comm->split_slot = NULL;
            comm->split_child = NULL;
        }
    }
    unlock();
    return r;
}

typedef enum { Q_COUNT, Q_RANK, Q_DEVICE } query_t;

static ncclResult_t comm_query(ncclComm_t comm, int *out, query_t q, const char *api)
{
    if (!out)
        return fail(ncclInvalidArgument, "%s: output pointer is NULL", api);
    struct nccl_comm *c;
    lock();
    ncclResult_t r = comm_get(comm, api, NEED_READY | ALLOW_FINALIZED, &c);
    if (!r)
        *out = q == Q_COUNT ? c->nranks : q == Q_RANK ? c->rank : c->device;
    unlock();
    return r;
}

EXPORT ncclResult_t ncclCommCount(ncclComm_t comm, int *count)
{
    return comm_query(comm, count, Q_COUNT, "ncclCommCount");
}

EXPORT ncclResult_t ncclCommUserRank(ncclComm_t comm, int *rank)
{
    return comm_query(comm, rank, Q_RANK, "ncclCommUserRank");
}

EXPORT ncclResult_t ncclCommCuDevice(ncclComm_t comm, int *device)
{
    return comm_query(comm, device, Q_DEVICE, "ncclCommCuDevice");
}

EXPORT ncclResult_t ncclCommFinalize(ncclComm_t comm)
{
    struct nccl_comm *c = NULL;
    lock();
    ncclResult_t r = comm_get(comm, "ncclCommFinalize", NEED_READY, &c);
    if (!r) {
        c->state = FINALIZED;
        c->busy = !c->blocking;
        r = c->blocking ? ncclSuccess : ncclInProgress;
    }
    unlock();
    stub_log("finalize rank=%d nranks=%d comm=%p result=%d", c ? c->rank : -1, c ? c->nranks : -1, (void *)comm, r);
    return r;
}

/* Whether operations of the comm are still hung (their stream stalled). */
static int comm_hung(const struct nccl_comm *c)
{
    for (int i = 0; i < c->nhung; i++)
        if (rdist_stub_stream_is_stalled(c->hung[i]))
            return 1;
    return 0;
}

EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    if (!comm)
        return ncclSuccess; /* as NCCL does */
    struct nccl_comm *c = NULL;
    lock();
    ncclResult_t r = comm_get(comm, "ncclCommDestroy", ALLOW_FINALIZED, &c);
    if (!r && comm_hung(c)) {
        fprintf(stderr, "rdist-stub: ncclCommDestroy on comm %p with hung operations "
                        "(real NCCL would block forever; use ncclCommAbort)\n", (void *)comm);
        r = fail(ncclInvalidUsage, "ncclCommDestroy: comm %p has hung operations (real NCCL would block "
                                   "forever; use ncclCommAbort)", (void *)comm);
    }
    if (!r)
        c->state = DESTROYED;
    unlock();
    stub_log("destroy rank=%d nranks=%d comm=%p result=%d", c ? c->rank : -1, c ? c->nranks : -1, (void *)comm, r);
    return r;
}

EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    if (!comm)
        return ncclSuccess; /* as NCCL does */
    struct nccl_comm *c = NULL;
    lock();
    ncclResult_t r = comm_get(comm, "ncclCommAbort", ALLOW_FINALIZED, &c);
    if (!r) {
        c->state = ABORTED;
        c->async_error = ncclSuccess;
        c->busy = c->polls_left = 0;
        for (int i = 0; i < c->nhung; i++) /* a real abort ends the kernels */
            rdist_stub_stall_stream(c->hung[i], 0);
        c->nhung = 0;
    }
    unlock();
    stub_log("abort rank=%d nranks=%d comm=%p result=%d", c ? c->rank : -1, c ? c->nranks : -1, (void *)comm, r);
    return r;
}

static ncclResult_t split_locked(ncclComm_t comm, int color, ncclComm_t *newcomm, ncclConfig_t *config,
                                 struct nccl_comm **parent)
{
    const char *api = "ncclCommSplit";
    if (!newcomm)
        return fail(ncclInvalidArgument, "%s: newcomm is NULL", api);
    *newcomm = NULL;
    ncclResult_t r = comm_get(comm, api, NEED_READY, parent);
    if (!r)
        r = check_config(config, api);
    if (r || color == NCCL_SPLIT_NOCOLOR)
        return r;
    if (color < 0)
        return fail(ncclInvalidArgument, "%s: color %d is negative (and not NCCL_SPLIT_NOCOLOR)", api, color);
    int blocking = config_blocking(config, (*parent)->blocking);
    struct nccl_comm *c = comm_new(1, 0, (*parent)->device, blocking, (*parent)->id);
    if (!c)
        return fail(ncclSystemError, "%s: out of memory", api);
    if ((*parent)->blocking) {
        *newcomm = c;
        return ncclSuccess;
    }
    /* NCCL finishes a non-blocking split in a thread of its own, keeps
     * *newcomm NULL until then, and reports progress on the parent. */
    c->busy = c->polls_left = 0;
    (*parent)->split_slot = newcomm;
    (*parent)->split_child = c;
    (*parent)->busy = 1;
    (*parent)->polls_left = 1;
    return ncclInProgress;
}

/* Multi-rank splitting is not simulated: the new comm has 1 rank. */
EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config)
{
    struct nccl_comm *p = NULL;
    lock();
    ncclResult_t r = split_locked(comm, color, newcomm, config, &p);
    unlock();
    stub_log("split rank=%d nranks=%d color=%d key=%d comm=%p newcomm=%p result=%d", p ? p->rank : -1,
             p ? p->nranks : -1, color, key, (void *)comm, newcomm ? (void *)*newcomm : NULL, r);
    return r;
}

/* Multi-rank shrinking is not simulated either: with no rank to leave
 * out, the new comm has 1 rank, made as a split's child is. Faults:
 * RDIST_STUB_NCCL_SHRINK_FAILS=1 makes it fail (ncclInternalError). */
EXPORT ncclResult_t ncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount,
                                   ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags)
{
    struct nccl_comm *p = NULL;
    ncclResult_t r;
    lock();
    if (excludeRanksCount < 0 || (excludeRanksCount > 0 && !excludeRanksList))
        r = fail(ncclInvalidArgument, "ncclCommShrink: %d ranks to exclude at %p", excludeRanksCount,
                 (void *)excludeRanksList);
    else if (excludeRanksCount > 0)
        r = fail(ncclInvalidArgument, "ncclCommShrink: a world of one cannot leave a rank out");
    else if (shrinkFlags != 0 && shrinkFlags != 1)
        r = fail(ncclInvalidArgument, "ncclCommShrink: flags %d", shrinkFlags);
    else if (getenv("RDIST_STUB_NCCL_SHRINK_FAILS"))
        r = fail(ncclInternalError, "ncclCommShrink: failing as RDIST_STUB_NCCL_SHRINK_FAILS asks");
    else
        r = split_locked(comm, 0, newcomm, config, &p);
    unlock();
    stub_log("shrink rank=%d nranks=%d exclude=%d flags=%d comm=%p result=%d", p ? p->rank : -1, p ? p->nranks : -1,
             excludeRanksCount, shrinkFlags, (void *)comm, r);
    return r;
}

/* ------------------------------------------------------------------ */
/* Operations                                                          */
/* ------------------------------------------------------------------ */

enum op_kind { K_COLL, K_SEND, K_RECV };

struct op {
    const char *api;
    enum op_kind kind;
    const void *send;
    size_t send_elems; /* elements sendbuff (ncclRecv: recvbuff) must hold; 0: not checked */
    void *recv;
    size_t recv_elems;
    size_t count;      /* elements copied (world size 1) */
    int dtype, redop;  /* redop -1: none */
    int root, peer;    /* -1: none */
    ncclComm_t comm;
    cudaStream_t stream;
};

static size_t dtype_size(int dtype)
{
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    return dtype >= 0 && dtype < 10 ? sizes[dtype] : 0;
}

static int is_default_stream(const void *s) { return (uintptr_t)s <= 2; }

/* Checks that a buffer of elems elements is device memory of the comm's
 * device; returns its shadow bytes in *out. */
static ncclResult_t check_buffer(const struct op *o, const struct nccl_comm *c, const char *which, const void *buf,
                                 size_t elems, unsigned char **out)
{
    size_t esize = dtype_size(o->dtype);
    *out = NULL;
    if (elems == 0)
        return ncclSuccess;
    if (elems > SIZE_MAX / esize)
        return fail(ncclInvalidArgument, "%s: count %zu overflows", o->api, elems);
    int dev = -1;
    *out = rdist_stub_shadow((unsigned long long)(uintptr_t)buf, elems * esize, &dev);
    if (!*out)
        return fail(ncclInvalidArgument, "%s: %s %p is not device memory (or is smaller than %zu bytes)", o->api,
                    which, buf, elems * esize);
    if (dev != c->device)
        return fail(ncclInvalidArgument, "%s: %s %p is memory of device %d, the comm's device is %d", o->api, which,
                    buf, dev, c->device);
    return ncclSuccess;
}

static ncclResult_t check_args(const struct op *o, const struct nccl_comm *c)
{
    if (!dtype_size(o->dtype))
        return fail(ncclInvalidArgument, "%s: datatype %d is not in 0..9", o->api, o->dtype);
    if (o->redop != -1 && (o->redop < 0 || o->redop >= NCCL_NUM_OPS))
        return fail(ncclInvalidArgument, "%s: reduction op %d is not in 0..4", o->api, o->redop);
    if (o->root != -1 && (o->root < 0 || o->root >= c->nranks))
        return fail(ncclInvalidArgument, "%s: root %d is not in 0..%d", o->api, o->root, c->nranks - 1);
    if (o->kind != K_COLL && (o->peer < 0 || o->peer >= c->nranks))
        return fail(ncclInvalidArgument, "%s: peer %d is not in 0..%d", o->api, o->peer, c->nranks - 1);
    if (o->kind != K_COLL && !tls_group_depth)
        return fail(ncclInvalidUsage, "%s: send/recv outside ncclGroupStart/ncclGroupEnd is not simulated", o->api);
    if (!is_default_stream(o->stream) && rdist_stub_stream_check(o->stream) != 0)
        return fail(ncclUnhandledCudaError, "%s: stream %p is not a valid CUDA stream", o->api, o->stream);
    return ncclSuccess;
}

static ncclResult_t push_op(struct p2p_op op)
{
    if (tls_nops == tls_cap_ops) {
        size_t cap = tls_cap_ops ? 2 * tls_cap_ops : 16;
        struct p2p_op *n = realloc(tls_ops, cap * sizeof *n);
        if (!n)
            return fail(ncclSystemError, "out of memory");
        tls_ops = n;
        tls_cap_ops = cap;
    }
    tls_ops[tls_nops++] = op;
    return ncclSuccess;
}

static ncclResult_t touch(struct nccl_comm *c)
{
    for (size_t i = 0; i < tls_ntouched; i++)
        if (tls_touched[i] == c)
            return ncclSuccess;
    if (tls_ntouched == tls_cap_touched) {
        size_t cap = tls_cap_touched ? 2 * tls_cap_touched : 8;
        struct nccl_comm **n = realloc(tls_touched, cap * sizeof *n);
        if (!n)
            return fail(ncclSystemError, "out of memory");
        tls_touched = n;
        tls_cap_touched = cap;
    }
    tls_touched[tls_ntouched++] = c;
    return ncclSuccess;
}

/* Moves the data of a validated operation (world size 1 only). */
static ncclResult_t move_data(const struct op *o, struct nccl_comm *c, unsigned char *s, unsigned char *d)
{
    size_t bytes = o->count * dtype_size(o->dtype);
    if (c->nranks != 1 || o->count == 0)
        return ncclSuccess;
    if (o->kind == K_COLL) {
        memmove(d, s, bytes);
        return ncclSuccess;
    }
    int is_send = o->kind == K_SEND;
    const void *buf = is_send ? o->send : o->recv;
    return push_op((struct p2p_op){is_send, c, (unsigned long long)(uintptr_t)buf, bytes});
}

static ncclResult_t run_locked(const struct op *o, struct nccl_comm **cp)
{
    ncclResult_t r = comm_get(o->comm, o->api, NEED_READY, cp);
    struct nccl_comm *c = *cp;
    if (!r)
        r = check_args(o, c);
    unsigned char *s = NULL, *d = NULL;
    if (!r)
        r = check_buffer(o, c, o->kind == K_RECV ? "recvbuff" : "sendbuff", o->kind == K_RECV ? o->recv : o->send,
                         o->send_elems, &s);
    if (!r && o->kind == K_COLL)
        r = check_buffer(o, c, "recvbuff", o->recv, o->recv_elems, &d);
    if (!r)
        r = move_data(o, c, s, d);
    if (r)
        return r;
    inject_faults(c, o->stream);
    if (tls_group_depth)
        return touch(c);
    c->busy = !c->blocking;
    return c->blocking ? ncclSuccess : ncclInProgress;
}

/* Waits (without the lock, so that an abort can come) until `comm` is
 * aborted. */
static ncclResult_t block_until_aborted(ncclComm_t comm, const char *api)
{
    stub_log("%s blocked comm=%p", api, (void *)comm);
    for (;;) {
        lock();
        int aborted = comm_known(comm) && comm->state == ABORTED;
        unlock();
        if (aborted)
            return fail(ncclInternalError, "%s: the communicator was aborted while the call waited", api);
        usleep(1000);
    }
}

static ncclResult_t run(const struct op *o)
{
    struct nccl_comm *c = NULL;
    lock();
    ncclResult_t r = run_locked(o, &c);
    unlock();
    if ((r == ncclSuccess || r == ncclInProgress) && c && env_enqueue_block() && tls_group_depth == 0)
        r = block_until_aborted(c, o->api);
    char arg[48] = "";
    if (o->redop != -1)
        snprintf(arg, sizeof arg, " op=%d", o->redop);
    if (o->root != -1)
        snprintf(arg + strlen(arg), sizeof arg - strlen(arg), " root=%d", o->root);
    if (o->kind != K_COLL)
        snprintf(arg, sizeof arg, " peer=%d", o->peer);
    stub_log("%s rank=%d nranks=%d count=%zu dtype=%d%s stream=%p comm=%p group=%d result=%d", o->api,
             c ? c->rank : -1, c ? c->nranks : -1, o->count, o->dtype, arg, o->stream, (void *)o->comm,
             tls_group_depth, r);
    return r;
}

/* The rank the comm argument names, for the "only on root" rules; -1 when
 * the comm is invalid (run() then reports it). */
static int rank_of(ncclComm_t comm)
{
    lock();
    int rank = comm && comm_known(comm) ? comm->rank : -1;
    unlock();
    return rank;
}

static int nranks_of(ncclComm_t comm)
{
    lock();
    int n = comm && comm_known(comm) ? comm->nranks : 1;
    unlock();
    return n;
}

EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
    struct op o = {"ncclAllReduce", K_COLL, sendbuff, count, recvbuff, count, count, datatype, op, -1, -1,
                   comm, stream};
    return run(&o);
}

EXPORT ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  int root, ncclComm_t comm, cudaStream_t stream)
{
    size_t send_elems = rank_of(comm) == root ? count : 0; /* sendbuff is read on root only */
    struct op o = {"ncclBroadcast", K_COLL, sendbuff, send_elems, recvbuff, count, count, datatype, -1, root, -1,
                   comm, stream};
    return run(&o);
}

EXPORT ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                               ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream)
{
    size_t recv_elems = rank_of(comm) == root ? count : 0; /* recvbuff is written on root only */
    struct op o = {"ncclReduce", K_COLL, sendbuff, count, recvbuff, recv_elems, count, datatype, op, root, -1,
                   comm, stream};
    return run(&o);
}

EXPORT ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                                  ncclComm_t comm, cudaStream_t stream)
{
    size_t n = (size_t)nranks_of(comm);
    size_t recv_elems = sendcount > SIZE_MAX / n ? SIZE_MAX : sendcount * n;
    struct op o = {"ncclAllGather", K_COLL, sendbuff, sendcount, recvbuff, recv_elems, sendcount, datatype, -1, -1,
                   -1, comm, stream};
    return run(&o);
}

EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
    size_t n = (size_t)nranks_of(comm);
    size_t send_elems = recvcount > SIZE_MAX / n ? SIZE_MAX : recvcount * n;
    struct op o = {"ncclReduceScatter", K_COLL, sendbuff, send_elems, recvbuff, recvcount, recvcount, datatype, op,
                   -1, -1, comm, stream};
    return run(&o);
}

EXPORT ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream)
{
    struct op o = {"ncclSend", K_SEND, sendbuff, count, NULL, 0, count, datatype, -1, -1, peer, comm, stream};
    return run(&o);
}

EXPORT ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream)
{
    /* the one buffer is checked with send_elems (see run_locked) */
    struct op o = {"ncclRecv", K_RECV, NULL, count, recvbuff, 0, count, datatype, -1, -1, peer, comm, stream};
    return run(&o);
}

/* ------------------------------------------------------------------ */
/* Groups                                                              */
/* ------------------------------------------------------------------ */

EXPORT ncclResult_t ncclGroupStart(void)
{
    tls_group_depth++;
    if (tls_group_depth == 1)
        tls_group_error = ncclSuccess;
    stub_log("group_start rank=-1 nranks=-1 depth=%d", tls_group_depth);
    return ncclSuccess;
}

/* The index of the n-th (0-based) queued op of a kind on a comm, or -1. */
static long nth_op(int is_send, const struct nccl_comm *c, size_t n)
{
    for (size_t i = 0; i < tls_nops; i++)
        if (tls_ops[i].is_send == is_send && tls_ops[i].comm == c && n-- == 0)
            return (long)i;
    return -1;
}

static size_t count_ops(int is_send, const struct nccl_comm *c)
{
    size_t n = 0;
    for (size_t i = 0; i < tls_nops; i++)
        n += tls_ops[i].is_send == is_send && tls_ops[i].comm == c;
    return n;
}

/* Copies one send into its recv. */
static ncclResult_t deliver(const struct p2p_op *s, const struct p2p_op *r, size_t k)
{
    if (s->bytes != r->bytes)
        return fail(ncclInvalidUsage,
                    "ncclGroupEnd: ncclSend #%zu to self on comm %p has %zu bytes, the matching ncclRecv %zu", k,
                    (void *)s->comm, s->bytes, r->bytes);
    void *src = rdist_stub_shadow(s->buf, s->bytes, NULL);
    void *dst = rdist_stub_shadow(r->buf, r->bytes, NULL);
    if (!src || !dst)
        return fail(ncclInvalidArgument, "ncclGroupEnd: a send/recv buffer was freed before ncclGroupEnd");
    memmove(dst, src, s->bytes);
    return ncclSuccess;
}

/* Matches the queued sends and recvs to self, per comm and in order. */
static ncclResult_t match_p2p(void)
{
    for (size_t t = 0; t < tls_ntouched; t++) {
        const struct nccl_comm *c = tls_touched[t];
        size_t sends = count_ops(1, c), recvs = count_ops(0, c);
        if (sends != recvs)
            return fail(ncclInvalidUsage, "ncclGroupEnd: comm %p has %zu ncclSend and %zu ncclRecv to self; "
                                          "each send needs a matching recv", (void *)c, sends, recvs);
        for (size_t k = 0; k < sends; k++) {
            ncclResult_t r = deliver(&tls_ops[nth_op(1, c, k)], &tls_ops[nth_op(0, c, k)], k);
            if (r)
                return r;
        }
    }
    return ncclSuccess;
}

/* Ends the outermost group: data for send/recv, non-blocking state. */
static ncclResult_t group_finish(void)
{
    ncclResult_t r = tls_group_error;
    lock();
    if (!r)
        r = match_p2p();
    int in_progress = 0;
    for (size_t t = 0; t < tls_ntouched && !r; t++) {
        struct nccl_comm *c = tls_touched[t];
        c->busy = !c->blocking;
        in_progress |= !c->blocking;
    }
    unlock();
    tls_nops = tls_ntouched = 0;
    tls_group_error = ncclSuccess;
    return r ? r : in_progress ? ncclInProgress : ncclSuccess;
}

EXPORT ncclResult_t ncclGroupEnd(void)
{
    if (tls_group_depth == 0)
        return fail(ncclInvalidUsage, "ncclGroupEnd: no matching ncclGroupStart");
    ncclResult_t r = ncclSuccess;
    size_t ops = tls_nops;
    if (tls_group_depth == 1) {
        tls_group_depth = 0; /* so errors below are not recorded as the group's */
        r = group_finish();
    } else {
        tls_group_depth--;
    }
    stub_log("group_end rank=-1 nranks=-1 depth=%d p2p_ops=%zu result=%d", tls_group_depth, ops, r);
    return r;
}
