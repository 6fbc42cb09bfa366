/*
 * What a `ram` namespace can reach on this host at best (not a test).
 *
 * A server that copies each 4 KiB read out of a RAM disk is bound by one core
 * copying random blocks out of DRAM. This program measures that floor without
 * udrive: a 1 GiB disk in transparent huge pages, written once, and a "server"
 * loop on CPU 0 with udrive's structure at its barest: it reads a batch of
 * 64-byte submission entries from a ring, copies each entry's block into one of
 * QD client buffers (prefetching the next entry's block with prefetcht2 while it
 * copies, as decision 0027 does; the batch's first block gets its first two lines
 * when the entries are read and the rest right before its copy, as a read hinted
 * with `Prefetch::Now` does) and posts a 16-byte completion right after each copy
 * (decision 0028). A "client" thread on CPU 1 reaps each completion and
 * submits a new random read at once, like spdk_nvme_perf.
 *
 *   gcc -O2 -pthread -o /tmp/copy-floor scripts/copy-floor.c
 *   /tmp/copy-floor [QD=32] [SECONDS=3] [MODE=client] [SERVER_CPU=0] [CLIENT_CPU=1]
 *
 * MODE: client (the two threads above), alone (the server feeds itself: no
 * second core touches the rings), copy (a bare loop of prefetched copies).
 * Prints I/Os per second and TSC cycles per I/O, and the cycles spent inside
 * memcpy per I/O. The TSC rate is measured against CLOCK_MONOTONIC.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <x86intrin.h>

#define DISK (1UL << 30)
#define BS 4096
#define RING 256
#define MAXQD 128

struct sqe {
	uint64_t block;
	uint32_t buf;
	uint32_t pad[13];
};
struct cqe {
	uint32_t buf;
	uint32_t phase;
	uint64_t pad;
};

static struct sqe *sq;
static struct cqe *cq;
static volatile uint32_t *sq_tail;
static char *disk, *bufs;
static volatile int stop;
static unsigned qd = 32;
static int client_cpu = 1;

static void pin(int cpu)
{
	cpu_set_t s;
	CPU_ZERO(&s);
	CPU_SET(cpu, &s);
	sched_setaffinity(0, sizeof s, &s);
}

static uint64_t next_block(uint64_t *x)
{
	*x ^= *x << 13;
	*x ^= *x >> 7;
	*x ^= *x << 17;
	return *x % (DISK / BS);
}

static void prefetch_range(const char *p, int from, int to)
{
	for (int j = from; j < to; j += 64)
		_mm_prefetch(p + j, _MM_HINT_T2);
}

static void prefetch_block(const char *p)
{
	prefetch_range(p, 0, BS);
}

static void *client(void *arg)
{
	uint64_t x = 88172645463325252ULL;
	uint32_t tail = 0, head = 0, phase = 1;
	(void)arg;
	pin(client_cpu);
	for (uint32_t i = 0; i < qd; i++, tail++)
		sq[tail % RING] = (struct sqe){ .block = next_block(&x), .buf = i };
	__atomic_store_n(sq_tail, tail, __ATOMIC_RELEASE);
	while (!stop) {
		struct cqe *c = &cq[head % RING];
		if (__atomic_load_n(&c->phase, __ATOMIC_ACQUIRE) != phase)
			continue;
		uint32_t buf = c->buf;
		if (++head % RING == 0)
			phase ^= 1;
		sq[tail % RING] = (struct sqe){ .block = next_block(&x), .buf = buf };
		__atomic_store_n(sq_tail, ++tail, __ATOMIC_RELEASE);
	}
	return NULL;
}

static double tsc_per_ns(void)
{
	struct timespec a, b;
	clock_gettime(CLOCK_MONOTONIC, &a);
	uint64_t t0 = __rdtsc();
	do
		clock_gettime(CLOCK_MONOTONIC, &b);
	while ((b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec) < 100000000L);
	return (double)(__rdtsc() - t0) /
	       ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec));
}

int main(int argc, char **argv)
{
	qd = argc > 1 ? (unsigned)atoi(argv[1]) : 32;
	int secs = argc > 2 ? atoi(argv[2]) : 3;
	const char *mode = argc > 3 ? argv[3] : "client";
	int server_cpu = argc > 4 ? atoi(argv[4]) : 0;
	client_cpu = argc > 5 ? atoi(argv[5]) : 1;
	int with_client = !strcmp(mode, "client"), bare_copy = !strcmp(mode, "copy");
	if (qd < 1 || qd > MAXQD || secs < 1 || (!with_client && !bare_copy && strcmp(mode, "alone"))) {
		fprintf(stderr, "usage: %s [QD 1-%d] [SECONDS] [client|alone|copy] [SERVER_CPU] [CLIENT_CPU]\n",
			argv[0], MAXQD);
		return 2;
	}
	disk = mmap(NULL, DISK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	bufs = aligned_alloc(1 << 21, MAXQD * BS);
	sq = aligned_alloc(4096, RING * sizeof *sq);
	cq = aligned_alloc(4096, RING * sizeof *cq);
	sq_tail = aligned_alloc(64, 64);
	if (disk == MAP_FAILED || !bufs || !sq || !cq || !sq_tail) {
		perror("allocation");
		return 1;
	}
	madvise(disk, DISK, MADV_HUGEPAGE);
	memset(disk, 1, DISK);
	memset(bufs, 0, MAXQD * BS);
	memset(sq, 0, RING * sizeof *sq);
	memset(cq, 0, RING * sizeof *cq);
	*sq_tail = 0;
	double rate = tsc_per_ns();
	pin(server_cpu);

	uint64_t x = 1234567, done = 0, in_copy = 0, batches = 0;
	uint64_t t0 = __rdtsc(), end = t0 + (uint64_t)(secs * 1e9 * rate);
	if (bare_copy) {
		uint64_t block = next_block(&x);
		while (__rdtsc() < end) {
			uint64_t next = next_block(&x);
			prefetch_block(disk + next * BS);
			uint64_t c0 = __rdtsc();
			memcpy(bufs + (done % qd) * BS, disk + block * BS, BS);
			in_copy += __rdtsc() - c0;
			block = next;
			done++;
		}
	} else {
		pthread_t t;
		if (with_client) {
			pthread_create(&t, NULL, client, NULL);
		} else {
			for (uint32_t i = 0; i < qd; i++)
				sq[i] = (struct sqe){ .block = next_block(&x), .buf = i };
			*sq_tail = qd;
		}
		uint32_t head = 0, cq_tail = 0, phase = 1;
		struct sqe batch[RING];
		while (__rdtsc() < end) {
			uint32_t n = __atomic_load_n(sq_tail, __ATOMIC_ACQUIRE) - head;
			if (!n)
				continue;
			batches++;
			for (uint32_t i = 0; i < n; i++)
				batch[i] = sq[(head + i) % RING];
			head += n;
			prefetch_range(disk + batch[0].block * BS, 0, 128);
			for (uint32_t i = 0; i < n; i++) {
				if (i == 0)
					prefetch_range(disk + batch[0].block * BS, 128, BS);
				if (i + 1 < n)
					prefetch_block(disk + batch[i + 1].block * BS);
				uint64_t c0 = __rdtsc();
				memcpy(bufs + batch[i].buf * BS, disk + batch[i].block * BS, BS);
				in_copy += __rdtsc() - c0;
				struct cqe *c = &cq[cq_tail % RING];
				c->buf = batch[i].buf;
				__atomic_store_n(&c->phase, phase, __ATOMIC_RELEASE);
				if (++cq_tail % RING == 0)
					phase ^= 1;
				done++;
				if (!with_client) {
					uint32_t tail = *sq_tail;
					sq[tail % RING] = (struct sqe){ .block = next_block(&x), .buf = batch[i].buf };
					*sq_tail = tail + 1;
				}
			}
		}
		stop = 1;
		if (with_client)
			pthread_join(t, NULL);
	}
	double cycles = (double)(__rdtsc() - t0);
	printf("%s QD%u: %.2f M IOPS, %.0f ns (%.0f cycles) per I/O, %.0f cycles in memcpy, %.1f per batch\n",
	       mode, qd, done / (cycles / rate / 1e9) / 1e6, cycles / rate / done, cycles / done,
	       (double)in_copy / done, batches ? (double)done / batches : 1.0);
	return 0;
}
