/* Tensor-parallel ranks of one machine exchanging buffers through a shared mapping.
 *
 * gloo's collectives cost 0.1-1.5 ms each on a small CPU machine (a handoff to its worker thread,
 * a TCP round trip through the kernel, a wake-up), and a decode step runs two all-reduces per layer:
 * more than the step's compute. Ranks on one machine exchange through a shared mapping instead
 * (tokenmill/parallel.py SharedExchange; vLLM's CPU backend does the same): each rank copies its
 * bytes into its slot and publishes a sequence number, then spins until every rank has published
 * the same number, and reads the others' slots.
 *
 * Layout of the region: `size` headers of one cache line (the last sequence number a rank published,
 * and its byte count for each parity), then data[2][size][slot_bytes]. Exchange number `seq` (1, 2,
 * ...: every rank makes the same exchanges in the same order; *shm->seq counts them, shared with
 * Python) uses parity seq % 2. Two parities are enough: a rank writes parity p again at seq + 2 only
 * after every rank published seq + 1, which each does only after it has read exchange seq's slots.
 *
 * stats[0] counts the exchanges and stats[1] the microseconds spent in them, waits included (what
 * the ranks' communication costs a step: bench parallel).
 *
 * A wait spins (the peer is usually microseconds away), then yields the core, then (past 1 ms: a
 * worker idle between requests) sleeps 50 us at a time, and every 10 ms checks that the processes
 * in peer_pids are alive: 0 on success, -1 when timeout_us passed (0: no limit), -2 when a peer
 * died (the caller raises; the group is broken either way).
 */
#define _POSIX_C_SOURCE 200809L

#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "kernels.h"

typedef struct {
    _Atomic int64_t seq;
    int64_t bytes[2];
    char pad[40];
} shm_header;

int64_t shm_header_bytes(void) { return (int64_t)sizeof(shm_header); }

static int64_t now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Alive: exists and is not a zombie (a dead child not yet reaped still answers kill(pid, 0)). */
static int process_alive(int64_t pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL) return kill((pid_t)pid, 0) == 0;
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *end = strrchr(buf, ')');
    return end != NULL && end[1] == ' ' && end[2] != 'Z' && end[2] != 'X';
}

static uint8_t *slot(const tm_shm *shm, int64_t seq, int32_t rank) {
    return shm->region + shm->size * sizeof(shm_header) + ((seq & 1) * shm->size + rank) * shm->slot_bytes;
}

static int32_t exchange(const tm_shm *shm, const uint8_t *data, int64_t nbytes) {
    shm_header *headers = (shm_header *)shm->region;
    const int64_t seq = ++*shm->seq;
    if (nbytes > 0) memcpy(slot(shm, seq, shm->rank), data, (size_t)nbytes);
    headers[shm->rank].bytes[seq & 1] = nbytes;
    atomic_store_explicit(&headers[shm->rank].seq, seq, memory_order_release);
    const int64_t start = now_us();
    int64_t checked = start, now = start;
    for (int32_t r = 0; r < shm->size; r++) {
        for (int64_t spins = 0; atomic_load_explicit(&headers[r].seq, memory_order_acquire) < seq; spins++) {
            if (spins < (1 << 14)) {
                cpu_relax();
                continue;
            }
            if ((spins & 63) == 0) {
                now = now_us();
                if (shm->timeout_us > 0 && now - start > shm->timeout_us) return -1;
                if (now - checked > 10000) {
                    checked = now;
                    for (int64_t p = 0; p < shm->num_peer_pids; p++)
                        if (!process_alive(shm->peer_pids[p])) return -2;
                }
            }
            if (now - start < 1000) {
                sched_yield();
            } else {   /* a long wait (an idle worker between requests): sleep, do not burn the core */
                const struct timespec pause = {0, 50000};
                nanosleep(&pause, NULL);
            }
        }
    }
    return 0;
}

int32_t shm_exchange(const tm_shm *shm, const uint8_t *data, int64_t nbytes) {
    const int64_t start = now_us();
    const int32_t status = exchange(shm, data, nbytes);
    shm->stats[0] += 1;
    shm->stats[1] += now_us() - start;
    return status;
}

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)h << 16};
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as PyTorch's conversion */
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);   /* NaN stays NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* x [n] (float32, or bfloat16 when bf16) = the sum of every rank's x, added in rank order in float32
 * (bfloat16: rounded once at the end): the same bits on every rank. -3 if a rank published another
 * byte count (the ranks are no longer running the same collectives). */
int32_t shm_all_reduce(const tm_shm *shm, void *x, int64_t n, int32_t bf16) {
    const int64_t elem = bf16 ? 2 : 4, chunk = shm->slot_bytes / elem;
    for (int64_t start = 0; start < n; start += chunk) {
        const int64_t count = n - start < chunk ? n - start : chunk;
        uint8_t *mine = (uint8_t *)x + start * elem;
        const int32_t failed = shm_exchange(shm, mine, count * elem);
        if (failed) return failed;
        for (int32_t r = 0; r < shm->size; r++)
            if (((const shm_header *)shm->region)[r].bytes[*shm->seq & 1] != count * elem) return -3;
        for (int64_t i = 0; i < count; i++) {
            float total = 0.0f;
            for (int32_t r = 0; r < shm->size; r++) {
                const uint8_t *part = slot(shm, *shm->seq, r);
                total = r == 0 ? (bf16 ? bf16_to_f32(((const uint16_t *)part)[i]) : ((const float *)part)[i])
                               : total + (bf16 ? bf16_to_f32(((const uint16_t *)part)[i]) : ((const float *)part)[i]);
            }
            if (bf16) ((uint16_t *)mine)[i] = f32_to_bf16(total);
            else ((float *)mine)[i] = total;
        }
    }
    return 0;
}
