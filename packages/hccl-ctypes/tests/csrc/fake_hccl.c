/*
 * fake_hccl.c -- a conformance library with the HCCL C ABI, for tests on machines without Ascend.
 *
 * Exports the symbols ascend_dist.hccl_ctypes binds (same prototypes as CANN's hccl.h) and runs
 * the collectives for real across 1..8 processes over POSIX shared memory, on host pointers:
 *
 *   HcclGetRootInfo      writes a magic and a fresh shared-memory name into the 4108-byte root info
 *   HcclCommInitRootInfo rank 0 creates the segment, others attach; all wait until every rank
 *                        joined (deadline: HCCL_CONNECT_TIMEOUT seconds, default 120 -> 9 E_TIMEOUT);
 *                        a rank whose nRanks differs from the root's -> 1 E_PARA on every rank
 *   HcclAllReduce, HcclBroadcast (in place), HcclAllGather, HcclReduceScatter, HcclSend, HcclRecv
 *                        chunked through per-rank staging slots and per-pair mailboxes, with a
 *                        deadline on every wait (HCCL_EXEC_TIMEOUT seconds, default 60)
 *   HcclCommDestroy      unmaps; unknown or already destroyed handles -> 2 E_PTR
 *   HcclGetErrorString   static text per code
 *
 * The stream argument is accepted and ignored: calls complete before returning. Scripted errors:
 * env FAKE_HCCL_FAIL="<Symbol>:<code>[:<rank>]" makes that symbol return <code> (on <rank> only,
 * when given) without doing anything. Build: cc -O2 -shared -fPIC -o libfakehccl.so fake_hccl.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int HcclResult;
typedef void *HcclComm;
typedef void *aclrtStream;
typedef struct { char internal[4108]; } HcclRootInfo;

enum { E_SUCCESS = 0, E_PARA = 1, E_PTR = 2, E_MEMORY = 3, E_INTERNAL = 4, E_NOT_SUPPORT = 5,
       E_TIMEOUT = 9, E_SYSCALL = 8 };

#define MAGIC "ADFAKEHCCL1"
#define MAX_RANKS 8
#define SLOT_BYTES (1u << 20)
#define P2P_BYTES (256u << 10)
#define MAX_COMMS 64

typedef struct {
    uint64_t written, read, len, pad[5];
} chan_t;

typedef struct {
    uint32_t ready, nranks, joined, mismatch, bar_count, bar_gen, pad[10];
    chan_t chan[MAX_RANKS][MAX_RANKS];
} header_t;

typedef struct {
    char name[64];
    uint32_t rank, nranks;
    size_t size;
    header_t *hdr;
    char *slots;
    char *p2p;
    int broken;
} comm_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static comm_t *g_live[MAX_COMMS];
static unsigned g_counter;

static const char *g_errors[] = {
    "success", "E_PARA: invalid parameter", "E_PTR: null or unknown pointer or handle",
    "E_MEMORY: out of memory", "E_INTERNAL: internal error (communicator broken)",
    "E_NOT_SUPPORT: not supported", "E_NOT_FOUND: not found", "E_UNAVAIL: resource unavailable",
    "E_SYSCALL: system call failed", "E_TIMEOUT: timed out waiting for peers",
    "E_OPEN_FILE_FAILURE: cannot open file", "E_TCP_CONNECT: TCP connect failed",
    "E_ROCE_CONNECT: RoCE connect failed", "E_TCP_TRANSFER: TCP transfer failed",
    "E_ROCE_TRANSFER: RoCE transfer failed", "E_RUNTIME: runtime error", "E_DRV: driver error",
    "E_PROFILING: profiling error", "E_CCE: CCE error", "E_NETWORK: network error",
    "E_AGAIN: try again", "E_REMOTE: remote error", "E_SUSPENDING: suspending",
};

const char *HcclGetErrorString(HcclResult code) {
    if (code >= 0 && (size_t)code < sizeof(g_errors) / sizeof(g_errors[0])) return g_errors[code];
    return "unknown error code (fake hccl)";
}

static int scripted(const char *fn, int rank) {
    const char *spec = getenv("FAKE_HCCL_FAIL");
    if (!spec) return 0;
    size_t n = strlen(fn);
    if (strncmp(spec, fn, n) != 0 || spec[n] != ':') return 0;
    char *end = NULL;
    long code = strtol(spec + n + 1, &end, 10);
    if (end && *end == ':' && rank >= 0 && strtol(end + 1, NULL, 10) != rank) return 0;
    return (int)code;
}

static double env_seconds(const char *name, double fallback) {
    const char *v = getenv(name);
    double s = v ? atof(v) : 0.0;
    return s > 0 ? s : fallback;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void pause_briefly(unsigned *spins) {
    if (++*spins < 64) { sched_yield(); return; }
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
}

static int live(comm_t *c) {
    int found = 0;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_COMMS; i++) found |= g_live[i] == c && c != NULL;
    pthread_mutex_unlock(&g_lock);
    return found;
}

static size_t segment_size(uint32_t nranks) {
    return sizeof(header_t) + (size_t)nranks * SLOT_BYTES + (size_t)nranks * nranks * P2P_BYTES;
}

HcclResult HcclGetRootInfo(HcclRootInfo *info) {
    int rc = scripted("HcclGetRootInfo", -1);
    if (rc) return rc;
    if (!info) return E_PTR;
    memset(info, 0, sizeof(*info));
    memcpy(info->internal, MAGIC, sizeof(MAGIC));
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    pthread_mutex_lock(&g_lock);
    unsigned k = ++g_counter;
    pthread_mutex_unlock(&g_lock);
    snprintf(info->internal + 16, 48, "/adfh_%d_%u_%ld", (int)getpid(), k, (long)(ts.tv_nsec ^ ts.tv_sec));
    return E_SUCCESS;
}

static int wait_joined(header_t *h, uint32_t nranks, double deadline) {
    unsigned spins = 0;
    while (__atomic_load_n(&h->joined, __ATOMIC_ACQUIRE) < nranks) {
        if (__atomic_load_n(&h->mismatch, __ATOMIC_ACQUIRE)) return E_PARA;
        if (now_s() > deadline) return E_TIMEOUT;
        pause_briefly(&spins);
    }
    return __atomic_load_n(&h->mismatch, __ATOMIC_ACQUIRE) ? E_PARA : E_SUCCESS;
}

static int attach(const char *name, uint32_t nranks, uint32_t rank, double deadline, comm_t *c) {
    int fd = -1;
    unsigned spins = 0;
    size_t size = segment_size(nranks);
    if (rank == 0) {
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0) return E_SYSCALL;
        if (ftruncate(fd, (off_t)size) != 0) { close(fd); shm_unlink(name); return E_SYSCALL; }
    } else {
        struct stat st;
        for (;;) {  /* wait for the root to create and size the segment */
            if (fd < 0) fd = shm_open(name, O_RDWR, 0600);
            if (fd >= 0 && fstat(fd, &st) == 0 && st.st_size >= (off_t)sizeof(header_t)) break;
            if (now_s() > deadline) { if (fd >= 0) close(fd); return E_TIMEOUT; }
            pause_briefly(&spins);
        }
        size = (size_t)st.st_size;
    }
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) return E_SYSCALL;
    c->hdr = (header_t *)base;
    c->size = size;
    return E_SUCCESS;
}

static void detach(comm_t *c) {
    if (c->hdr) munmap(c->hdr, c->size);
    c->hdr = NULL;
}

HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *info, uint32_t rank, HcclComm *comm) {
    int rc = scripted("HcclCommInitRootInfo", (int)rank);
    if (rc) return rc;
    if (!info || !comm) return E_PTR;
    if (nRanks < 1 || nRanks > MAX_RANKS || rank >= nRanks) return E_PARA;
    if (memcmp(info->internal, MAGIC, sizeof(MAGIC)) != 0) return E_PARA;
    comm_t *c = calloc(1, sizeof(comm_t));
    if (!c) return E_MEMORY;
    memcpy(c->name, info->internal + 16, 48);
    c->rank = rank;
    c->nranks = nRanks;
    double deadline = now_s() + env_seconds("HCCL_CONNECT_TIMEOUT", 120.0);
    rc = attach(c->name, nRanks, rank, deadline, c);
    if (rc) { if (rank == 0) shm_unlink(c->name); free(c); return rc; }
    header_t *h = c->hdr;
    if (rank == 0) {
        h->nranks = nRanks;
        __atomic_store_n(&h->ready, 1, __ATOMIC_RELEASE);
    } else {
        unsigned spins = 0;
        while (!__atomic_load_n(&h->ready, __ATOMIC_ACQUIRE)) {
            if (now_s() > deadline) { detach(c); free(c); return E_TIMEOUT; }
            pause_briefly(&spins);
        }
        if (h->nranks != nRanks || c->size < segment_size(nRanks)) __atomic_store_n(&h->mismatch, 1, __ATOMIC_RELEASE);
    }
    __atomic_add_fetch(&h->joined, 1, __ATOMIC_ACQ_REL);
    rc = wait_joined(h, h->nranks, deadline);
    if (rank == 0) shm_unlink(c->name);  /* everyone attached (or gave up): the name is no longer needed */
    if (rc) { detach(c); free(c); return rc; }
    c->slots = (char *)h + sizeof(header_t);
    c->p2p = c->slots + (size_t)nRanks * SLOT_BYTES;
    pthread_mutex_lock(&g_lock);
    int slot = -1;
    for (int i = 0; i < MAX_COMMS && slot < 0; i++) if (!g_live[i]) slot = i;
    if (slot >= 0) g_live[slot] = c;
    pthread_mutex_unlock(&g_lock);
    if (slot < 0) { detach(c); free(c); return E_MEMORY; }
    *comm = c;
    return E_SUCCESS;
}

HcclResult HcclCommDestroy(HcclComm comm) {
    comm_t *c = (comm_t *)comm;
    int rc = scripted("HcclCommDestroy", live(c) ? (int)c->rank : -1);
    if (rc) return rc;
    pthread_mutex_lock(&g_lock);
    int found = 0;
    for (int i = 0; i < MAX_COMMS; i++) if (c && g_live[i] == c) { g_live[i] = NULL; found = 1; }
    pthread_mutex_unlock(&g_lock);
    if (!found) return E_PTR;
    detach(c);
    free(c);
    return E_SUCCESS;
}

static int barrier(comm_t *c) {
    header_t *h = c->hdr;
    uint32_t gen = __atomic_load_n(&h->bar_gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&h->bar_count, 1, __ATOMIC_ACQ_REL) == c->nranks) {
        __atomic_store_n(&h->bar_count, 0, __ATOMIC_RELAXED);
        __atomic_add_fetch(&h->bar_gen, 1, __ATOMIC_RELEASE);
        return E_SUCCESS;
    }
    double deadline = now_s() + env_seconds("HCCL_EXEC_TIMEOUT", 60.0);
    unsigned spins = 0;
    while (__atomic_load_n(&h->bar_gen, __ATOMIC_ACQUIRE) == gen) {
        if (now_s() > deadline) { c->broken = 1; return E_TIMEOUT; }
        pause_briefly(&spins);
    }
    return E_SUCCESS;
}

static size_t elem_size(int dtype) {
    static const size_t sizes[] = {1, 2, 4, 2, 4, 8, 8, 1, 2, 4, 8, 2, 16};
    return dtype >= 0 && dtype <= 12 ? sizes[dtype] : 0;
}

static float bf16_to_f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t f_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define RED(a, b, op) ((op) == 0 ? (a) + (b) : (op) == 1 ? (a) * (b) : (op) == 2 ? ((a) > (b) ? (a) : (b)) : ((a) < (b) ? (a) : (b)))
#define REDUCE_T(T)                                                          \
    for (size_t i = 0; i < n; i++) {                                         \
        T acc = ((const T *)srcs[0])[i];                                     \
        for (uint32_t j = 1; j < nsrc; j++) acc = RED(acc, ((const T *)srcs[j])[i], op); \
        ((T *)dst)[i] = acc;                                                 \
    }                                                                        \
    break;

/* dst[i] = reduce over j of srcs[j][i]; fixed order j = 0..nsrc-1, so every rank gets the same bits. */
static void reduce(void *dst, const char **srcs, uint32_t nsrc, size_t n, int dtype, int op) {
    switch (dtype) {
    case 0: REDUCE_T(int8_t)
    case 1: REDUCE_T(int16_t)
    case 2: REDUCE_T(int32_t)
    case 4: REDUCE_T(float)
    case 5: REDUCE_T(int64_t)
    case 6: REDUCE_T(uint64_t)
    case 7: REDUCE_T(uint8_t)
    case 8: REDUCE_T(uint16_t)
    case 9: REDUCE_T(uint32_t)
    case 10: REDUCE_T(double)
    case 3: REDUCE_T(_Float16)
    case 11:
        for (size_t i = 0; i < n; i++) {
            float acc = bf16_to_f(((const uint16_t *)srcs[0])[i]);
            for (uint32_t j = 1; j < nsrc; j++) {  /* round after every step, as torch's bf16 ops do */
                float x = bf16_to_f(((const uint16_t *)srcs[j])[i]);
                acc = bf16_to_f(f_to_bf16(RED(acc, x, op)));
            }
            ((uint16_t *)dst)[i] = f_to_bf16(acc);
        }
        break;
    default: break;
    }
}

static int check_op(comm_t *c, const char *fn, const void *buf, uint64_t count, int dtype, int op, int *rc) {
    if (!live(c)) { *rc = E_PTR; return 1; }
    if ((*rc = scripted(fn, (int)c->rank))) return 1;
    if (c->broken) { *rc = E_INTERNAL; return 1; }
    if (dtype == 12) { *rc = E_NOT_SUPPORT; return 1; }
    if (!elem_size(dtype) || op < 0 || op > 3) { *rc = E_PARA; return 1; }
    if (count && !buf) { *rc = E_PTR; return 1; }
    return 0;
}

static char *slot(comm_t *c, uint32_t r) { return c->slots + (size_t)r * SLOT_BYTES; }

HcclResult HcclAllReduce(void *send, void *recv, uint64_t count, int dtype, int op, HcclComm comm, aclrtStream s) {
    comm_t *c = (comm_t *)comm;
    int rc;
    (void)s;
    if (check_op(c, "HcclAllReduce", send, count, dtype, op, &rc)) return rc;
    if (count && !recv) return E_PTR;
    size_t es = elem_size(dtype), k = SLOT_BYTES / es;
    const char *srcs[MAX_RANKS];
    for (uint32_t j = 0; j < c->nranks; j++) srcs[j] = slot(c, j);
    for (uint64_t off = 0; off < count; off += k) {
        size_t n = count - off < k ? (size_t)(count - off) : k;
        memcpy(slot(c, c->rank), (char *)send + off * es, n * es);
        if ((rc = barrier(c))) return rc;
        reduce((char *)recv + off * es, srcs, c->nranks, n, dtype, op);
        if ((rc = barrier(c))) return rc;
    }
    return E_SUCCESS;
}

HcclResult HcclBroadcast(void *buf, uint64_t count, int dtype, uint32_t root, HcclComm comm, aclrtStream s) {
    comm_t *c = (comm_t *)comm;
    int rc;
    (void)s;
    if (check_op(c, "HcclBroadcast", buf, count, dtype, 0, &rc)) return rc;
    if (root >= c->nranks) return E_PARA;
    size_t es = elem_size(dtype), k = SLOT_BYTES / es;
    for (uint64_t off = 0; off < count; off += k) {
        size_t n = count - off < k ? (size_t)(count - off) : k;
        if (c->rank == root) memcpy(slot(c, root), (char *)buf + off * es, n * es);
        if ((rc = barrier(c))) return rc;
        if (c->rank != root) memcpy((char *)buf + off * es, slot(c, root), n * es);
        if ((rc = barrier(c))) return rc;
    }
    return E_SUCCESS;
}

HcclResult HcclAllGather(void *send, void *recv, uint64_t count, int dtype, HcclComm comm, aclrtStream s) {
    comm_t *c = (comm_t *)comm;
    int rc;
    (void)s;
    if (check_op(c, "HcclAllGather", send, count, dtype, 0, &rc)) return rc;
    if (count && !recv) return E_PTR;
    size_t es = elem_size(dtype), k = SLOT_BYTES / es;
    for (uint64_t off = 0; off < count; off += k) {
        size_t n = count - off < k ? (size_t)(count - off) : k;
        memcpy(slot(c, c->rank), (char *)send + off * es, n * es);
        if ((rc = barrier(c))) return rc;
        for (uint32_t j = 0; j < c->nranks; j++) memcpy((char *)recv + (j * count + off) * es, slot(c, j), n * es);
        if ((rc = barrier(c))) return rc;
    }
    return E_SUCCESS;
}

HcclResult HcclReduceScatter(void *send, void *recv, uint64_t count, int dtype, int op, HcclComm comm, aclrtStream s) {
    comm_t *c = (comm_t *)comm;
    int rc;
    (void)s;
    if (check_op(c, "HcclReduceScatter", send, count, dtype, op, &rc)) return rc;
    if (count && !recv) return E_PTR;
    size_t es = elem_size(dtype), k = SLOT_BYTES / (es * c->nranks);
    const char *srcs[MAX_RANKS];
    for (uint64_t off = 0; off < count; off += k) {
        size_t n = count - off < k ? (size_t)(count - off) : k;
        for (uint32_t j = 0; j < c->nranks; j++)
            memcpy(slot(c, c->rank) + j * n * es, (char *)send + (j * count + off) * es, n * es);
        if ((rc = barrier(c))) return rc;
        for (uint32_t j = 0; j < c->nranks; j++) srcs[j] = slot(c, j) + c->rank * n * es;
        reduce((char *)recv + off * es, srcs, c->nranks, n, dtype, op);
        if ((rc = barrier(c))) return rc;
    }
    return E_SUCCESS;
}

static int p2p(comm_t *c, int sending, void *buf, uint64_t count, int dtype, uint32_t peer) {
    if (peer >= c->nranks || peer == c->rank) return E_PARA;
    uint32_t src = sending ? c->rank : peer, dst = sending ? peer : c->rank;
    chan_t *ch = &c->hdr->chan[src][dst];
    char *data = c->p2p + ((size_t)src * c->nranks + dst) * P2P_BYTES;
    size_t es = elem_size(dtype), k = P2P_BYTES / es;
    double timeout = env_seconds("HCCL_EXEC_TIMEOUT", 60.0);
    uint64_t off = 0;
    do {
        size_t n = count - off < k ? (size_t)(count - off) : k;
        double deadline = now_s() + timeout;
        unsigned spins = 0;
        for (;;) {
            uint64_t w = __atomic_load_n(&ch->written, __ATOMIC_ACQUIRE), r = __atomic_load_n(&ch->read, __ATOMIC_ACQUIRE);
            if (sending ? w == r : w > r) break;
            if (now_s() > deadline) { c->broken = 1; return E_TIMEOUT; }
            pause_briefly(&spins);
        }
        if (sending) {
            memcpy(data, (char *)buf + off * es, n * es);
            ch->len = n * es;
            __atomic_add_fetch(&ch->written, 1, __ATOMIC_RELEASE);
        } else {
            if (ch->len != n * es) { c->broken = 1; __atomic_add_fetch(&ch->read, 1, __ATOMIC_RELEASE); return E_PARA; }
            memcpy((char *)buf + off * es, data, n * es);
            __atomic_add_fetch(&ch->read, 1, __ATOMIC_RELEASE);
        }
        off += n;
    } while (off < count);
    return E_SUCCESS;
}

HcclResult HcclSend(void *buf, uint64_t count, int dtype, uint32_t dest, HcclComm comm, aclrtStream s) {
    comm_t *c = (comm_t *)comm;
    int rc;
    (void)s;
    if (check_op(c, "HcclSend", buf, count, dtype, 0, &rc)) return rc;
    return p2p(c, 1, buf, count, dtype, dest);
}

HcclResult HcclRecv(void *buf, uint64_t count, int dtype, uint32_t src, HcclComm comm, aclrtStream s) {
    comm_t *c = (comm_t *)comm;
    int rc;
    (void)s;
    if (check_op(c, "HcclRecv", buf, count, dtype, 0, &rc)) return rc;
    return p2p(c, 0, buf, count, dtype, src);
}
