/*
 * The guest's load during the live-migration VM test (tests/vm-migrate/README.md),
 * and the host's check of the disk afterwards. Built static on the host.
 *
 *   migcheck run DEV MIB      in the guest: passes over the first MIB MiB of DEV
 *   migcheck verify FILE MIB GEN   on the host: every block holds generation GEN
 *
 * A pass writes a new generation into one eighth of the region (a different
 * eighth each pass, in 1 MiB requests), then reads the whole region with O_DIRECT
 * into one large buffer and only then checks every block against the generation
 * it must hold.
 * The buffer is written by the device alone (DMA), never by a guest CPU, so after
 * a migration it holds what it held before only if the device's writes were in
 * the VMM's dirty-page log: a page read into it after the VMM last sent it, and
 * not marked, reaches the destination stale, and the check of that pass reports
 * it. Most of a pass is reading and checking (the writes are few, large
 * requests), so a switch-over is likely to land in that window.
 *
 * Each pass prints "MIGCHECK pass=N gen=G bad=B total_bad=T" on stdout. SIGUSR1
 * ends the loop after the current pass: the whole region is then written with one
 * final generation, read back and checked ("MIGCHECK final gen=G bad=B"), which
 * the host checks again in the backing store with `verify`.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BLOCK 4096u
#define CHUNK (1u << 20)
#define MAGIC 0x5247494du /* "MIGR" */
#define EIGHTHS 8u

static volatile sig_atomic_t stop;
static void on_usr1(int s) { (void)s; stop = 1; }

static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* Block `blk` of generation `gen`: a header, then words derived from both. */
static void fill(uint8_t *p, uint32_t gen, uint64_t blk) {
    uint64_t *w = (uint64_t *)p;
    w[0] = (uint64_t)MAGIC | ((uint64_t)gen << 32);
    w[1] = blk;
    uint64_t s = mix(((uint64_t)gen << 40) ^ blk);
    for (unsigned i = 2; i < BLOCK / 8; i++) {
        s += 0x9e3779b97f4a7c15ull;
        w[i] = mix(s);
    }
}

/* Whether `p` is block `blk` of generation `gen`; `got` gets the generation it holds. */
static int check(const uint8_t *p, uint32_t gen, uint64_t blk, uint32_t *got) {
    static uint8_t want[BLOCK] __attribute__((aligned(64)));
    const uint64_t *w = (const uint64_t *)p;
    *got = (uint32_t)(w[0] & 0xffffffffu) == MAGIC ? (uint32_t)(w[0] >> 32) : 0;
    fill(want, gen, blk);
    return memcmp(p, want, BLOCK) == 0;
}

static void *aligned(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, BLOCK, n) != 0) {
        perror("posix_memalign");
        exit(2);
    }
    return p;
}

static int io(int fd, uint8_t *buf, size_t len, off_t off, int wr) {
    while (len > 0) {
        ssize_t n = wr ? pwrite(fd, buf, len, off) : pread(fd, buf, len, off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            fprintf(stderr, "MIGCHECK %s at %lld: %s\n", wr ? "write" : "read", (long long)off,
                    n < 0 ? strerror(errno) : "short");
            return -1;
        }
        buf += n, len -= (size_t)n, off += n;
    }
    return 0;
}

/* Writes generation `gen` into blocks [first, first + count), 1 MiB at a time
 * through `w` (CHUNK bytes). */
static int write_gen(int fd, uint8_t *w, uint64_t first, uint64_t count, uint32_t gen,
                     uint32_t *gens) {
    const uint64_t per = CHUNK / BLOCK;
    for (uint64_t b = first; b < first + count; b += per) {
        uint64_t n = first + count - b < per ? first + count - b : per;
        for (uint64_t i = 0; i < n; i++) {
            fill(w + i * BLOCK, gen, b + i);
            gens[b + i] = gen;
        }
        if (io(fd, w, n * BLOCK, (off_t)(b * BLOCK), 1) < 0)
            return -1;
    }
    return fdatasync(fd);
}

/* Reads the region into `r`, then checks it; returns the blocks that differ. */
static long read_check(int fd, uint8_t *r, uint64_t blocks, const uint32_t *gens, uint32_t pass) {
    uint64_t bytes = blocks * BLOCK;
    for (uint64_t off = 0; off < bytes; off += CHUNK) {
        size_t n = bytes - off < CHUNK ? (size_t)(bytes - off) : CHUNK;
        if (io(fd, r + off, n, (off_t)off, 0) < 0)
            return -1;
    }
    long bad = 0;
    for (uint64_t b = 0; b < blocks; b++) {
        uint32_t got;
        if (!check(r + b * BLOCK, gens[b], b, &got)) {
            if (bad < 5)
                printf("MIGCHECK mismatch pass=%u block=%llu want_gen=%u got_gen=%u\n", pass,
                       (unsigned long long)b, gens[b], got);
            bad++;
        }
    }
    return bad;
}

static int run(const char *dev, unsigned mib) {
    int fd = open(dev, O_RDWR | O_DIRECT);
    if (fd < 0) {
        perror(dev);
        return 2;
    }
    uint64_t blocks = (uint64_t)mib * (1u << 20) / BLOCK;
    uint8_t *w = aligned(CHUNK), *r = aligned(blocks * BLOCK);
    uint32_t *gens = calloc(blocks, sizeof *gens);
    if (!gens)
        return 2;
    signal(SIGUSR1, on_usr1);
    /* Generation 1 everywhere, then passes. */
    uint32_t gen = 1, pass = 0;
    long total = 0;
    if (write_gen(fd, w, 0, blocks, gen, gens) < 0)
        return 2;
    printf("MIGCHECK start mib=%u blocks=%llu\n", mib, (unsigned long long)blocks);
    fflush(stdout);
    while (!stop) {
        pass++, gen++;
        uint64_t eighth = blocks / EIGHTHS;
        if (write_gen(fd, w, (pass % EIGHTHS) * eighth, eighth, gen, gens) < 0)
            return 2;
        long bad = read_check(fd, r, blocks, gens, pass);
        if (bad < 0)
            return 2;
        total += bad;
        printf("MIGCHECK pass=%u gen=%u bad=%ld total_bad=%ld\n", pass, gen, bad, total);
        fflush(stdout);
    }
    gen++;
    if (write_gen(fd, w, 0, blocks, gen, gens) < 0)
        return 2;
    long bad = read_check(fd, r, blocks, gens, pass + 1);
    printf("MIGCHECK final gen=%u bad=%ld total_bad=%ld passes=%u\n", gen, bad,
           total + (bad > 0 ? bad : 0), pass);
    fflush(stdout);
    return bad == 0 && total == 0 ? 0 : 1;
}

static int verify(const char *path, unsigned mib, uint32_t gen) {
    int fd = strcmp(path, "-") == 0 ? 0 : open(path, O_RDONLY);
    if (fd < 0) {
        perror(path);
        return 2;
    }
    uint64_t blocks = (uint64_t)mib * (1u << 20) / BLOCK;
    uint8_t *p = aligned(BLOCK);
    long bad = 0;
    for (uint64_t b = 0; b < blocks; b++) {
        size_t have = 0;
        while (have < BLOCK) {
            ssize_t n = read(fd, p + have, BLOCK - have);
            if (n <= 0) {
                printf("short read at block %llu\n", (unsigned long long)b);
                return 1;
            }
            have += (size_t)n;
        }
        uint32_t got;
        if (!check(p, gen, b, &got)) {
            if (bad < 5)
                printf("block %llu: want gen %u, got gen %u\n", (unsigned long long)b, gen, got);
            bad++;
        }
    }
    printf("%llu blocks checked, %ld differ from generation %u\n", (unsigned long long)blocks,
           bad, gen);
    return bad == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "run") == 0)
        return run(argv[2], (unsigned)atoi(argv[3]));
    if (argc == 5 && strcmp(argv[1], "verify") == 0)
        return verify(argv[2], (unsigned)atoi(argv[3]), (uint32_t)strtoul(argv[4], NULL, 10));
    fprintf(stderr, "usage: migcheck run DEV MIB | migcheck verify FILE|- MIB GEN\n");
    return 2;
}
