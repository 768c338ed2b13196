/*
 * fake_nccl.c -- a one-rank library with the NCCL C ABI, to check the binding's NCCL dialect on a CPU:
 * argument order (comm out-parameter first), the 128-byte ncclUniqueId passed BY VALUE, NCCL's
 * data-type codes (element sizes), the two-buffer broadcast, and the optional abort. Host pointers;
 * the stream is ignored. Only nranks == 1 is accepted. Build: cc -shared -fPIC -o libfakenccl.so fake_nccl.c
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int ncclResult_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct { int rank; } comm_t;

enum { OK = 0, SYSTEM_ERROR = 2, INVALID_ARGUMENT = 4, INVALID_USAGE = 5 };

static int g_last_broadcast_in_place = -1;

int fake_nccl_last_broadcast_in_place(void) { return g_last_broadcast_in_place; }

const char *ncclGetErrorString(ncclResult_t code) {
    switch (code) {
    case OK: return "no error";
    case SYSTEM_ERROR: return "unhandled system error (fake nccl)";
    case INVALID_ARGUMENT: return "invalid argument (fake nccl)";
    case INVALID_USAGE: return "invalid usage (fake nccl)";
    default: return "unknown result (fake nccl)";
    }
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (!id) return INVALID_ARGUMENT;
    for (int i = 0; i < 128; i++) id->internal[i] = (char)(i * 7 + 3);
    return OK;
}

ncclResult_t ncclCommInitRank(void **comm, int nranks, ncclUniqueId id, int rank) {
    if (!comm || nranks != 1 || rank != 0) return INVALID_ARGUMENT;
    for (int i = 0; i < 128; i++)
        if (id.internal[i] != (char)(i * 7 + 3)) return INVALID_ARGUMENT;  /* id must arrive by value, intact */
    comm_t *c = calloc(1, sizeof(comm_t));
    if (!c) return SYSTEM_ERROR;
    *comm = c;
    return OK;
}

static size_t elem(int dtype) {
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
    return dtype >= 0 && dtype < 12 ? sizes[dtype] : 0;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, int dtype, int op, void *comm, void *stream) {
    (void)stream;
    if (!comm || !elem(dtype) || op < 0 || op > 4) return INVALID_ARGUMENT;
    if (send != recv) memcpy(recv, send, count * elem(dtype));
    return OK;
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, int dtype, int root, void *comm, void *stream) {
    (void)stream;
    if (!comm || !elem(dtype) || root != 0) return INVALID_ARGUMENT;
    g_last_broadcast_in_place = send == recv;
    if (send != recv) memcpy(recv, send, count * elem(dtype));
    return OK;
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, int dtype, void *comm, void *stream) {
    return ncclAllReduce(send, recv, count, dtype, 0, comm, stream);
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, int dtype, int op, void *comm, void *stream) {
    return ncclAllReduce(send, recv, count, dtype, op, comm, stream);
}

ncclResult_t ncclSend(const void *buf, size_t count, int dtype, int peer, void *comm, void *stream) {
    (void)buf; (void)count; (void)dtype; (void)peer; (void)comm; (void)stream;
    return INVALID_USAGE;  /* one rank: there is no peer */
}

ncclResult_t ncclRecv(void *buf, size_t count, int dtype, int peer, void *comm, void *stream) {
    (void)buf; (void)count; (void)dtype; (void)peer; (void)comm; (void)stream;
    return INVALID_USAGE;
}

ncclResult_t ncclCommDestroy(void *comm) {
    if (!comm) return INVALID_ARGUMENT;
    free(comm);
    return OK;
}

ncclResult_t ncclCommAbort(void *comm) { return ncclCommDestroy(comm); }
