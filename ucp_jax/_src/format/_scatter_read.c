/* Chunks read straight into scattered rows of a buffer, each checked by its CRC32C trailer.
 *
 * A restore's target shard rarely holds a stored inner chunk as one contiguous run of bytes: a
 * (248, 496) chunk of a (992, 992) shard lands in 248 rows of 1984 bytes each, 3968 bytes apart.
 * Python can read such a chunk into a contiguous buffer, check its crc32c and copy it into place
 * (three passes over the bytes), or read it into place with one `preadv` iovec per row, but then
 * the checksum must be taken over the scattered rows, one call per row. No library offers a
 * CRC32C over an iovec list, so this does both here, the GIL released: one `preadv` per run of
 * chunks adjacent in the file (rows merged where they touch in the buffer), then the CRC32C of
 * each chunk's rows with the CPU's CRC instruction, compared with its 4-byte trailer.
 * Where a chunk's rows are short (under BOUNCE_ROW_BYTES), the kernel's copy into one iovec per
 * row costs far more than the bytes (a (1536, 96) bf16 chunk: 192-byte rows; 4x the time of one
 * contiguous copy, measured): such a run is read whole into this thread's bounce buffer (1 MiB,
 * in the cache), each chunk checked there and then copied row by row into place.
 *
 * read_chunks(fd, dst, file_offsets, dst_offsets, counts, strides, row_bytes) -> (bad, errno)
 *   fd            an open file
 *   dst           a writable buffer (the restore's array)
 *   file_offsets  int64 per chunk: where its bytes start in the file (rows, then the trailer)
 *   dst_offsets   int64 per chunk: where its first row goes in dst
 *   counts        int64 per leading axis: the chunk's extent along it (rows = their product)
 *   strides       int64 per leading axis: dst's byte stride along it
 *   row_bytes     bytes of one row (the chunk's last axis, contiguous in dst)
 * Returns (-1, 0) when every chunk was read and matched its trailer; else (k, e): chunk k (and
 * possibly later ones) failed, by a read error e (errno), an early end of file (e = 0, k's
 * trailer short) or a checksum that disagrees (e = 0). Bytes of a failed chunk are in dst and
 * must be overwritten by the caller's other way of reading it.
 * With an eighth argument, a writable buffer of 4 bytes per chunk, each chunk's trailer as read
 * is left there (in the order of file_offsets): a shard's fingerprint is taken from them, so no
 * second read of the trailers is needed.
 * read_shard(...): a whole sharding_indexed shard (its index, then its inner chunks inside the
 * target, as read_chunks does), see its comment below; read_at(...): small reads at many offsets.
 * hardware() -> bool: the CRC32C runs on the CPU's CRC instruction here (or folds by carry-less
 *   multiplication, see crc_fold); crc_way(w): which of the ways it takes (tests set each).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif
#define MAX_AXES 32
/* Chunks read by one preadv: their checksums are taken right after, while the bytes the kernel
 * just copied are still in this core's cache (a larger run makes the CRC read them from memory). */
#ifndef RUN_BYTES
#define RUN_BYTES (256 << 10)
#endif
#define MAX_IOV (IOV_MAX < 1024 ? IOV_MAX : 1024)
/* Chunks whose contiguous pieces in dst are shorter than this are read into a bounce buffer and
 * copied into place from there: the kernel copies into one iovec per piece far slower than
 * memcpy does from a buffer still in the cache (a (1536, 96) bf16 chunk: 192-byte pieces). */
#ifndef BOUNCE_ROW_BYTES
#define BOUNCE_ROW_BYTES 4096
#endif
/* an inner chunk holds at most 1 MiB (format/store.py); scatter_read.BOUNCE_BYTES says the same */
#define BOUNCE_BYTES ((1 << 20) + 64)
static int64_t bounce_below = BOUNCE_ROW_BYTES; /* bounce_below(n) sets it (tests take both ways) */

/* ------------------------------------------------------------------------------ CRC32C */

static uint32_t table[8][256];

static void init_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xFF];
}

static uint32_t crc_soft(uint32_t c, const unsigned char *p, size_t n) {
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= c;
        c = table[7][v & 0xFF] ^ table[6][(v >> 8) & 0xFF] ^ table[5][(v >> 16) & 0xFF] ^
            table[4][(v >> 24) & 0xFF] ^ table[3][(v >> 32) & 0xFF] ^ table[2][(v >> 40) & 0xFF] ^
            table[1][(v >> 48) & 0xFF] ^ table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ table[0][(c ^ *p++) & 0xFF];
    return c;
}

/* Shifting a CRC register past n zero bytes (linear over GF(2)): how three CRCs of adjacent
 * blocks, computed at once to hide the CRC instruction's latency, are joined into one. */
#define LANE 256 /* bytes of each of the three interleaved streams */
static uint32_t shift_lane[4][256];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++)
        if (vec & 1) sum ^= *mat;
    return sum;
}

static void gf2_square(uint32_t *sq, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) sq[n] = gf2_times(mat, mat[n]);
}

/* The table of the operator that appends `len` (a power of two) zero bytes to a register. */
static void init_shift(uint32_t out[4][256], size_t len) {
    uint32_t odd[32], even[32];
    odd[0] = 0x82F63B78u; /* one zero bit */
    for (int n = 1; n < 32; n++) odd[n] = 1u << (n - 1);
    gf2_square(even, odd); /* two bits */
    gf2_square(odd, even); /* four bits */
    const uint32_t *op;
    for (;;) {
        gf2_square(even, odd); /* 8, 32, ... bits: 1, 4, ... bytes */
        op = even;
        len >>= 1;
        if (!len) break;
        gf2_square(odd, even); /* 2, 8, ... bytes */
        op = odd;
        len >>= 1;
        if (!len) break;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int b = 0; b < 4; b++) out[b][n] = gf2_times(op, n << (8 * b));
}

static uint32_t shift(uint32_t t[4][256], uint32_t c) {
    return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24];
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#include <wmmintrin.h>
#define HAVE_HW 1
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c, const unsigned char *p, size_t n) {
    while (n >= 3 * LANE) {
        uint64_t a = c, b = 0, d = 0, v;
        for (int i = 0; i < LANE; i += 8) {
            memcpy(&v, p + i, 8);
            a = _mm_crc32_u64(a, v);
            memcpy(&v, p + LANE + i, 8);
            b = _mm_crc32_u64(b, v);
            memcpy(&v, p + 2 * LANE + i, 8);
            d = _mm_crc32_u64(d, v);
        }
        c = shift(shift_lane, (uint32_t)a) ^ (uint32_t)b;
        c = shift(shift_lane, c) ^ (uint32_t)d;
        p += 3 * LANE;
        n -= 3 * LANE;
    }
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c64 = _mm_crc32_u64(c64, v);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--) c = _mm_crc32_u8(c, *p++);
    return c;
}
static int hw_present(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}

/* Carry-less multiplication folds the message 64 bytes at a time into four 128-bit remainders
 * (congruent modulo the CRC's polynomial to the bytes they stand for), joined into one at the end
 * and reduced by the CRC instruction. Where the CRC instruction is slow to issue (one per three
 * cycles on AMD Zen: 5 GB/s at 2 GHz, measured) this is twice as fast (9-10 GB/s); elsewhere it is
 * as fast as the three interleaved streams. A remainder bit j stands for x^(127-j) (the byte order
 * of a reflected CRC), so a remainder a advanced by d bits is a.lo * (x^(d+64) mod P) +
 * a.hi * (x^d mod P), each constant reflected into 64 bits and taken one power lower for
 * the bit the reflected product is off by. */
#define HAVE_FOLD 1
static __m128i fold_by_512, fold_by_128;

/* x^e mod P (P the CRC32C polynomial), bit-reflected into the high half of 64 bits. */
static uint64_t reflected_power(unsigned e) {
    uint64_t r = 1;
    for (unsigned i = 0; i < e; i++) {
        r <<= 1;
        if (r & (UINT64_C(1) << 32)) r ^= UINT64_C(0x11EDC6F41);
    }
    uint32_t rev = 0;
    for (int b = 0; b < 32; b++)
        if (r & (UINT64_C(1) << b)) rev |= 1u << (31 - b);
    return (uint64_t)rev << 32;
}

static void init_fold(void) {
    fold_by_512 = _mm_set_epi64x((long long)reflected_power(512 - 1), (long long)reflected_power(512 + 64 - 1));
    fold_by_128 = _mm_set_epi64x((long long)reflected_power(128 - 1), (long long)reflected_power(128 + 64 - 1));
}

__attribute__((target("sse4.2,pclmul"))) static inline __m128i fold(__m128i a, __m128i k, __m128i next) {
    __m128i lo = _mm_clmulepi64_si128(a, k, 0x00), hi = _mm_clmulepi64_si128(a, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

__attribute__((target("sse4.2,pclmul"))) static uint32_t crc_fold(uint32_t c, const unsigned char *p, size_t n) {
    if (n < 64) return crc_hw(c, p, n);
    const __m128i *v = (const __m128i *)p;
    __m128i a0 = _mm_xor_si128(_mm_loadu_si128(v), _mm_cvtsi32_si128((int)c)), a1 = _mm_loadu_si128(v + 1);
    __m128i a2 = _mm_loadu_si128(v + 2), a3 = _mm_loadu_si128(v + 3);
    p += 64;
    n -= 64;
    for (; n >= 64; p += 64, n -= 64) {
        v = (const __m128i *)p;
        a0 = fold(a0, fold_by_512, _mm_loadu_si128(v));
        a1 = fold(a1, fold_by_512, _mm_loadu_si128(v + 1));
        a2 = fold(a2, fold_by_512, _mm_loadu_si128(v + 2));
        a3 = fold(a3, fold_by_512, _mm_loadu_si128(v + 3));
    }
    __m128i a = fold(fold(fold(a0, fold_by_128, a1), fold_by_128, a2), fold_by_128, a3);
    for (; n >= 16; p += 16, n -= 16) a = fold(a, fold_by_128, _mm_loadu_si128((const __m128i *)p));
    uint64_t r = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(a));
    r = _mm_crc32_u64(r, (uint64_t)_mm_extract_epi64(a, 1));
    return crc_hw((uint32_t)r, p, n);
}

static int fold_present(void) { return hw_present() && __builtin_cpu_supports("pclmul"); }
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define HAVE_HW 1
static uint32_t crc_hw(uint32_t c, const unsigned char *p, size_t n) {
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __crc32cd(c, v);
        p += 8;
        n -= 8;
    }
    while (n--) c = __crc32cb(c, *p++);
    return c;
}
static int hw_present(void) { return 1; }
#define HAVE_FOLD 0
static uint32_t crc_fold(uint32_t c, const unsigned char *p, size_t n) { return crc_hw(c, p, n); }
static void init_fold(void) {}
static int fold_present(void) { return 0; }
#else
#define HAVE_HW 0
static uint32_t crc_hw(uint32_t c, const unsigned char *p, size_t n) { return crc_soft(c, p, n); }
static int hw_present(void) { return 0; }
#define HAVE_FOLD 0
static uint32_t crc_fold(uint32_t c, const unsigned char *p, size_t n) { return crc_soft(c, p, n); }
static void init_fold(void) {}
static int fold_present(void) { return 0; }
#endif

/* The CRC32C's way here: 2 folding (carry-less multiply), 1 the CRC instruction, 0 tables. */
static int crc_way = 0;

/* The fastest way this CPU has. */
static int best_crc_way(void) { return HAVE_FOLD && fold_present() ? 2 : HAVE_HW && hw_present() ? 1 : 0; }

static uint32_t crc_extend(uint32_t c, const unsigned char *p, size_t n) {
    return crc_way == 2 ? crc_fold(c, p, n) : crc_way == 1 ? crc_hw(c, p, n) : crc_soft(c, p, n);
}

/* ------------------------------------------------------------------------------ reading */

typedef struct {
    int64_t rows;                /* rows of one chunk */
    int nlead;                   /* leading axes */
    const int64_t *counts, *strides;
    int64_t row_bytes;
} Shape;

/* The byte offset in dst of row `r` (C order over the leading axes) of a chunk. */
static int64_t row_offset(const Shape *s, int64_t r) {
    int64_t off = 0;
    for (int a = s->nlead - 1; a >= 0; a--) {
        int64_t n = s->counts[a];
        off += (r % n) * s->strides[a];
        r /= n;
    }
    return off;
}

/* Fill iov with the rows [r0, r1) of a chunk at dst + base, merging rows that touch; returns
 * the number of iovecs used (at most room), and sets *stop to the first row not placed. */
static int chunk_iov(const Shape *s, unsigned char *dst, int64_t base, int64_t r0, int64_t r1,
                     struct iovec *iov, int room, int64_t *stop) {
    int n = 0;
    int64_t r = r0;
    for (; r < r1; r++) {
        unsigned char *p = dst + base + row_offset(s, r);
        if (n && (unsigned char *)iov[n - 1].iov_base + iov[n - 1].iov_len == p &&
            iov[n - 1].iov_len <= (size_t)(INT_MAX / 2)) {
            iov[n - 1].iov_len += (size_t)s->row_bytes;
            continue;
        }
        if (n == room) break;
        iov[n].iov_base = p;
        iov[n].iov_len = (size_t)s->row_bytes;
        n++;
    }
    *stop = r;
    return n;
}

/* preadv until every iovec is full; 0, or errno (-1 at the end of the file). */
static int read_full(int fd, struct iovec *iov, int n, int64_t off) {
    while (n > 0) {
        ssize_t got = preadv(fd, iov, n, (off_t)off);
        if (got < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (got == 0) return -1;
        off += got;
        while (n > 0 && (size_t)got >= iov->iov_len) {
            got -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0 && got > 0) {
            iov->iov_base = (unsigned char *)iov->iov_base + got;
            iov->iov_len -= (size_t)got;
        }
    }
    return 0;
}

/* The CRC32C of one chunk's rows as they now lie in dst. */
static uint32_t chunk_crc(const Shape *s, unsigned char *dst, int64_t base) {
    uint32_t c = 0xFFFFFFFFu;
    unsigned char *run = NULL;
    int64_t len = 0;
    for (int64_t r = 0; r < s->rows; r++) {
        unsigned char *p = dst + base + row_offset(s, r);
        if (run && run + len == p) {
            len += s->row_bytes;
            continue;
        }
        if (run) c = crc_extend(c, run, (size_t)len);
        run = p;
        len = s->row_bytes;
    }
    if (run) c = crc_extend(c, run, (size_t)len);
    return ~c;
}

/* Bytes of a chunk that lie contiguously in dst: its rows merged across the leading axes whose
 * stride is the length of what they hold. */
static int64_t contiguous_bytes(const Shape *s) {
    int64_t len = s->row_bytes;
    for (int a = s->nlead - 1; a >= 0 && s->strides[a] == len; a--) len *= s->counts[a];
    return len;
}

/* A reading thread's bounce buffer (BOUNCE_BYTES, allocated on first use, freed when it exits). */
static pthread_key_t bounce_key;
static int bounce_ready = 0;

static unsigned char *bounce_buffer(void) {
    if (!bounce_ready) return NULL;
    unsigned char *b = pthread_getspecific(bounce_key);
    if (!b) {
        b = malloc(BOUNCE_BYTES);
        if (b && pthread_setspecific(bounce_key, b)) {
            free(b);
            b = NULL;
        }
    }
    return b;
}

/* Read and check chunks [k0, k1), adjacent in the file, through `buf`: one read of the run's
 * bytes, each chunk's CRC32C over its contiguous bytes there, then its rows copied into place (a
 * chunk that fails is not copied). Returns -1, or the failed chunk. */
static int64_t read_run_bounced(int fd, const Shape *s, unsigned char *dst, const int64_t *foff,
                                const int64_t *doff, int64_t k0, int64_t k1, uint32_t *trailers, int *err,
                                unsigned char *buf) {
    int64_t body = s->rows * s->row_bytes, chunk_len = body + 4;
    struct iovec all = {buf, (size_t)((k1 - k0) * chunk_len)};
    int e = read_full(fd, &all, 1, foff[k0]);
    if (e) {
        *err = e > 0 ? e : 0;
        return k0;
    }
    int64_t seg = contiguous_bytes(s), per = seg / s->row_bytes;
    for (int64_t k = k0; k < k1; k++) {
        const unsigned char *c = buf + (k - k0) * chunk_len, *t = c + body;
        memcpy(&trailers[k - k0], t, 4);
        uint32_t want = (uint32_t)t[0] | (uint32_t)t[1] << 8 | (uint32_t)t[2] << 16 | (uint32_t)t[3] << 24;
        if (~crc_extend(0xFFFFFFFFu, c, (size_t)body) != want) return k;
        for (int64_t r = 0; r < s->rows; r += per) memcpy(dst + doff[k] + row_offset(s, r), c + r * s->row_bytes, (size_t)seg);
    }
    return -1;
}

/* Read and check chunks [k0, k1), adjacent in the file. Returns -1, or the failed chunk. */
static int64_t read_run(int fd, const Shape *s, unsigned char *dst, const int64_t *foff,
                        const int64_t *doff, int64_t k0, int64_t k1, uint32_t *trailers, int *err) {
    struct iovec iov[MAX_IOV];
    int64_t k = k0, r = 0;
    int64_t pos = foff[k0];
    while (k < k1) {
        int n = 0;
        int64_t first = k;
        while (k < k1 && n < MAX_IOV) {
            int64_t stop;
            n += chunk_iov(s, dst, doff[k], r, s->rows, iov + n, MAX_IOV - n, &stop);
            r = stop;
            if (r < s->rows) break; /* out of iovecs inside this chunk */
            if (n == MAX_IOV) break;
            iov[n].iov_base = &trailers[k - k0];
            iov[n].iov_len = 4;
            n++;
            k++;
            r = 0;
        }
        int64_t bytes = 0;
        for (int i = 0; i < n; i++) bytes += (int64_t)iov[i].iov_len;
        int e = read_full(fd, iov, n, pos);
        if (e) {
            *err = e > 0 ? e : 0;
            return first;
        }
        pos += bytes;
    }
    for (k = k0; k < k1; k++) {
        unsigned char *t = (unsigned char *)&trailers[k - k0];
        uint32_t want = (uint32_t)t[0] | (uint32_t)t[1] << 8 | (uint32_t)t[2] << 16 | (uint32_t)t[3] << 24;
        if (chunk_crc(s, dst, doff[k]) != want) return k;
    }
    return -1;
}

/* Read and check the chunks [0, n) (file offsets fo, ascending where adjacent), in runs of chunks
 * adjacent in the file of at most RUN_BYTES. Returns -1, or the first failed chunk. */
static int64_t read_runs(int fd, const Shape *s, unsigned char *dst, const int64_t *fo, const int64_t *dd,
                         int64_t n, uint32_t *trailers, int *err) {
    int64_t chunk_len = s->rows * s->row_bytes + 4, k0 = 0, bad = -1;
    int short_rows = contiguous_bytes(s) < bounce_below; /* the same for every chunk */
    while (k0 < n && bad < 0) {
        int64_t k1 = k0 + 1;
        while (k1 < n && fo[k1] == fo[k1 - 1] + chunk_len && (k1 - k0 + 1) * chunk_len <= RUN_BYTES) k1++;
        unsigned char *buf = NULL;
        if (short_rows && (k1 - k0) * chunk_len <= BOUNCE_BYTES) buf = bounce_buffer();
        bad = buf ? read_run_bounced(fd, s, dst, fo, dd, k0, k1, trailers + k0, err, buf)
                  : read_run(fd, s, dst, fo, dd, k0, k1, trailers + k0, err);
        k0 = k1;
    }
    return bad;
}

/* A chunk's bytes in dst lie in [d + *lo, d + *hi), d the offset of its first element (strides
 * may be negative). */
static void chunk_span(const Shape *s, int64_t *lo, int64_t *hi) {
    *lo = 0;
    *hi = s->row_bytes;
    for (int a = 0; a < s->nlead; a++) {
        int64_t ext = (s->counts[a] - 1) * s->strides[a];
        if (ext >= 0) *hi += ext;
        else *lo += ext;
    }
}

/* Release the buffers of `views` that were taken (a view not taken has no obj). */
static void release_all(Py_buffer **views, int n) {
    for (int i = 0; i < n; i++)
        if (views[i]->obj) PyBuffer_Release(views[i]);
}

static int int64_view(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || (view->format && strcmp(view->format, "q") && strcmp(view->format, "l") &&
                                strcmp(view->format, "<q") && strcmp(view->format, "=q"))) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s: int64 values expected", what);
        return -1;
    }
    return 0;
}

static PyObject *read_chunks(PyObject *self, PyObject *args) {
    int fd;
    PyObject *dst_o, *foff_o, *doff_o, *counts_o, *strides_o, *trail_o = NULL;
    long long row_bytes;
    if (!PyArg_ParseTuple(args, "iOOOOOL|O", &fd, &dst_o, &foff_o, &doff_o, &counts_o, &strides_o, &row_bytes,
                          &trail_o))
        return NULL;
    Py_buffer dst = {0}, foff = {0}, doff = {0}, counts = {0}, strides = {0}, trail = {0};
    PyObject *result = NULL;
    uint32_t *trailers = NULL;
    if (PyObject_GetBuffer(dst_o, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (int64_view(foff_o, &foff, "file_offsets") < 0 || int64_view(doff_o, &doff, "dst_offsets") < 0 ||
        int64_view(counts_o, &counts, "counts") < 0 || int64_view(strides_o, &strides, "strides") < 0)
        goto done;
    int64_t nchunks = foff.len / 8, nlead = counts.len / 8;
    if (doff.len != foff.len || strides.len != counts.len || nlead > MAX_AXES || row_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "read_chunks: mismatched arguments");
        goto done;
    }
    Shape s = {1, (int)nlead, (const int64_t *)counts.buf, (const int64_t *)strides.buf, row_bytes};
    for (int a = 0; a < nlead; a++) {
        int64_t n = s.counts[a];
        if (n <= 0 || n > (INT64_MAX / 2) / (s.rows > 0 ? s.rows : 1)) {
            PyErr_SetString(PyExc_ValueError, "read_chunks: bad counts");
            goto done;
        }
        s.rows *= n;
    }
    /* Every row of every chunk must lie inside dst: the span of a chunk, from its lowest to its
     * highest byte, is checked once per chunk. */
    int64_t lo, hi;
    chunk_span(&s, &lo, &hi);
    const int64_t *fo = (const int64_t *)foff.buf, *d = (const int64_t *)doff.buf;
    for (int64_t k = 0; k < nchunks; k++) {
        if (d[k] + lo < 0 || d[k] + hi > (int64_t)dst.len || fo[k] < 0) {
            PyErr_SetString(PyExc_ValueError, "read_chunks: a chunk outside the buffer");
            goto done;
        }
    }
    if (trail_o && trail_o != Py_None) {
        if (PyObject_GetBuffer(trail_o, &trail, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (trail.len < nchunks * 4) {
            PyErr_SetString(PyExc_ValueError, "read_chunks: the trailers buffer holds fewer than 4 bytes per chunk");
            goto done;
        }
    }
    trailers = PyMem_RawMalloc((size_t)(nchunks ? nchunks : 1) * 4);
    if (!trailers) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t bad;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    bad = read_runs(fd, &s, (unsigned char *)dst.buf, fo, d, nchunks, trailers, &err);
    if (trail.obj && nchunks) memcpy(trail.buf, trailers, (size_t)nchunks * 4);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(Li)", (long long)bad, err);
done:
    PyMem_RawFree(trailers);
    release_all((Py_buffer *[]){&trail, &dst, &foff, &doff, &counts, &strides}, 6);
    return result;
}

/* ------------------------------------------------------------------------ one whole shard */

#define NO_CHUNK UINT64_MAX
#define MAX_LISTED_OFFSET (UINT64_C(1) << 62)

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

typedef struct {
    int64_t foff, doff;
    int64_t flat;
} Planned;

static int by_file_offset(const void *a, const void *b) {
    int64_t x = ((const Planned *)a)->foff, y = ((const Planned *)b)->foff;
    return (x > y) - (x < y);
}

/* What read_shard does without the GIL. Returns 0 (done), 1 (the shard is not as expected:
 * index checksum, a missing or odd-sized inner chunk, a read error, a chunk checksum) or
 * 2 (out of memory). *listed_ok says whether `listed` holds the fingerprint's trailers. */
static int shard_work(int fd, int64_t shard_off, int64_t shard_len, int nd, const int64_t *grid,
                      const int64_t *inner, int64_t itemsize, const int64_t *lo, const int64_t *hi,
                      unsigned char *dst, int64_t dst_len, int64_t base, const int64_t *strides,
                      unsigned char *index, int64_t index_bytes, int64_t count, int want_listed,
                      unsigned char *listed, int64_t *listed_len, int *listed_ok) {
    struct iovec one = {index, (size_t)index_bytes};
    if (read_full(fd, &one, 1, shard_off + shard_len - index_bytes)) return 1;
    uint32_t want = (uint32_t)index[index_bytes - 4] | (uint32_t)index[index_bytes - 3] << 8 |
                    (uint32_t)index[index_bytes - 2] << 16 | (uint32_t)index[index_bytes - 1] << 24;
    if (~crc_extend(0xFFFFFFFFu, index, (size_t)(index_bytes - 4)) != want) return 1;
    int64_t elems = 1;
    for (int a = 0; a < nd; a++) elems *= inner[a];
    int64_t step = elems * itemsize + 4, data_end = shard_len - index_bytes;
    int64_t n = 1;
    for (int a = 0; a < nd; a++) n *= hi[a] - lo[a];
    Planned *plan = NULL;
    uint32_t *trailers = NULL;
    unsigned char *have = NULL;
    int rc = 0;
    if (n > 0) {
        plan = malloc((size_t)n * sizeof(Planned));
        trailers = malloc((size_t)n * 4);
        if (!plan || !trailers) {
            rc = 2;
            goto out;
        }
        /* the chunks of the grid box [lo, hi), row-major; each must be listed whole */
        int64_t idx[MAX_AXES];
        for (int a = 0; a < nd; a++) idx[a] = lo[a];
        Shape sh = {1, nd - 1, inner, strides, inner[nd - 1] * itemsize};
        for (int a = 0; a + 1 < nd; a++) sh.rows *= inner[a];
        int64_t span_lo, span_hi;
        chunk_span(&sh, &span_lo, &span_hi);
        for (int64_t k = 0; k < n; k++) {
            int64_t flat = 0, d = base;
            for (int a = 0; a < nd; a++) {
                flat = flat * grid[a] + idx[a];
                d += idx[a] * inner[a] * strides[a];
            }
            uint64_t off = le64(index + 16 * flat), nb = le64(index + 16 * flat + 8);
            if (off == NO_CHUNK || nb != (uint64_t)step || data_end < step || off > (uint64_t)(data_end - step)) {
                rc = 1;
                goto out;
            }
            if (d + span_lo < 0 || d + span_hi > dst_len) {
                rc = 1; /* said as a mismatch: Python checked the box, so this is never reached */
                goto out;
            }
            plan[k].foff = shard_off + (int64_t)off;
            plan[k].doff = d;
            plan[k].flat = flat;
            for (int a = nd - 1; a >= 0; a--) { /* next index, row-major */
                if (++idx[a] < hi[a]) break;
                idx[a] = lo[a];
            }
        }
        qsort(plan, (size_t)n, sizeof(Planned), by_file_offset);
        int64_t *fo = malloc((size_t)n * 8), *dd = malloc((size_t)n * 8);
        if (!fo || !dd) {
            free(fo);
            free(dd);
            rc = 2;
            goto out;
        }
        for (int64_t k = 0; k < n; k++) {
            fo[k] = plan[k].foff;
            dd[k] = plan[k].doff;
        }
        int err = 0;
        int64_t bad = read_runs(fd, &sh, dst, fo, dd, n, trailers, &err);
        free(fo);
        free(dd);
        if (bad >= 0) {
            rc = 1;
            goto out;
        }
    }
    *listed_ok = 0;
    *listed_len = 0;
    if (want_listed) {
        /* the fingerprint's trailers (format/integrity.py): every listed inner chunk's, in index
         * order; those read above are taken from there, the others read now */
        have = calloc((size_t)count, 1);
        uint32_t *by_flat = calloc((size_t)count, 4);
        if (!have || !by_flat) {
            free(by_flat);
            rc = 2;
            goto out;
        }
        for (int64_t k = 0; k < n; k++) {
            have[plan[k].flat] = 1;
            by_flat[plan[k].flat] = trailers[k];
        }
        int ok = 1;
        for (int64_t f = 0; f < count && ok; f++) {
            uint64_t off = le64(index + 16 * f), nb = le64(index + 16 * f + 8);
            if (off == NO_CHUNK || nb < 4 || off > MAX_LISTED_OFFSET) continue;
            unsigned char *t = listed + *listed_len;
            if (have[f]) {
                memcpy(t, &by_flat[f], 4);
            } else {
                if (nb > MAX_LISTED_OFFSET || off + nb > (uint64_t)shard_len) {
                    ok = 0; /* a trailer outside the shard: Python's exact way says what it is */
                    break;
                }
                struct iovec iv = {t, 4};
                ok = read_full(fd, &iv, 1, shard_off + (int64_t)(off + nb) - 4) == 0;
            }
            *listed_len += 4;
        }
        free(by_flat);
        *listed_ok = ok;
    }
out:
    free(plan);
    free(trailers);
    free(have);
    return rc;
}

/* read_shard(fd, shard_offset, shard_length, grid, inner, itemsize, lo, hi, dst, base, strides,
 *            want_listed) -> (ok, index, listed)
 * One sharding_indexed shard: its index (at the end, checked by its crc32c), then the inner
 * chunks of the grid box [lo, hi) (all of them wholly inside the target), each read straight
 * into its rows of dst and checked by its crc32c; the inner chunk at grid index g goes to byte
 * base + sum(g * inner * strides) of dst. ok is False when the shard is not as expected (the
 * caller reads it another way); index is the index as read (None when not read); listed, with
 * want_listed, the 4-byte trailers a fingerprint takes (None: take it the exact, slower way). */
static PyObject *read_shard(PyObject *self, PyObject *args) {
    int fd, want_listed;
    long long shard_off, shard_len, itemsize, base;
    PyObject *grid_o, *inner_o, *lo_o, *hi_o, *dst_o, *strides_o;
    if (!PyArg_ParseTuple(args, "iLLOOLOOOLOp", &fd, &shard_off, &shard_len, &grid_o, &inner_o,
                          &itemsize, &lo_o, &hi_o, &dst_o, &base, &strides_o, &want_listed))
        return NULL;
    Py_buffer grid = {0}, inner = {0}, lo = {0}, hi = {0}, dst = {0}, strides = {0};
    PyObject *result = NULL, *index_o = NULL, *listed_o = NULL;
    if (int64_view(grid_o, &grid, "grid") < 0 || int64_view(inner_o, &inner, "inner") < 0 ||
        int64_view(lo_o, &lo, "lo") < 0 || int64_view(hi_o, &hi, "hi") < 0 ||
        int64_view(strides_o, &strides, "strides") < 0)
        goto done;
    if (PyObject_GetBuffer(dst_o, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    int nd = (int)(grid.len / 8);
    const int64_t *g = grid.buf, *in = inner.buf, *l = lo.buf, *h = hi.buf, *st = strides.buf;
    if (nd < 1 || nd > MAX_AXES || inner.len != grid.len || lo.len != grid.len || hi.len != grid.len ||
        strides.len != grid.len || itemsize <= 0 || st[nd - 1] != itemsize || shard_off < 0 || shard_len < 0) {
        PyErr_SetString(PyExc_ValueError, "read_shard: mismatched arguments");
        goto done;
    }
    int64_t count = 1, elems = 1;
    for (int a = 0; a < nd; a++) {
        if (g[a] <= 0 || in[a] <= 0 || l[a] < 0 || h[a] < l[a] || h[a] > g[a] || count > INT64_MAX / 32 / g[a] ||
            elems > INT64_MAX / 16 / itemsize / in[a] || (st[a] < 0 ? -st[a] : st[a]) > INT64_MAX / 16 / in[a] / g[a]) {
            PyErr_SetString(PyExc_ValueError, "read_shard: bad grid, inner chunk, range or stride");
            goto done;
        }
        count *= g[a];
        elems *= in[a];
    }
    int64_t index_bytes = count * 16 + 4;
    if (shard_len < index_bytes) {
        result = Py_BuildValue("(OOO)", Py_False, Py_None, Py_None);
        goto done;
    }
    index_o = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)index_bytes);
    listed_o = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(want_listed ? count * 4 : 0));
    if (!index_o || !listed_o) goto done;
    unsigned char *ix = (unsigned char *)PyBytes_AS_STRING(index_o);
    unsigned char *ls = (unsigned char *)PyBytes_AS_STRING(listed_o);
    int64_t listed_len = 0;
    int listed_ok = 0, rc;
    Py_BEGIN_ALLOW_THREADS
    rc = shard_work(fd, shard_off, shard_len, nd, g, in, itemsize, l, h, dst.buf, (int64_t)dst.len, base, st, ix,
                    index_bytes, count, want_listed, ls, &listed_len, &listed_ok);
    Py_END_ALLOW_THREADS
    if (rc == 2) {
        PyErr_NoMemory();
        goto done;
    }
    if (rc == 1) {
        result = Py_BuildValue("(OOO)", Py_False, Py_None, Py_None);
        goto done;
    }
    if (listed_ok && _PyBytes_Resize(&listed_o, (Py_ssize_t)listed_len) < 0) {
        listed_o = NULL;
        goto done;
    }
    result = Py_BuildValue("(OOO)", Py_True, index_o, listed_ok ? listed_o : Py_None);
done:
    Py_XDECREF(index_o);
    Py_XDECREF(listed_o);
    release_all((Py_buffer *[]){&grid, &inner, &lo, &hi, &dst, &strides}, 6);
    return result;
}

static PyObject *crc32c_of(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = ~crc_extend(0xFFFFFFFFu, (const unsigned char *)b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

static PyObject *hardware(PyObject *self, PyObject *unused) { return PyBool_FromLong(crc_way > 0); }

/* crc_way(w) -> int: the CRC32C from now on by folding (2), the CRC instruction (1) or tables (0),
 * as far as this CPU has them (a way it lacks falls back to the next one down); -1 sets nothing.
 * Returns the way before. Tests take each way. */
static PyObject *set_crc_way(PyObject *self, PyObject *arg) {
    long w = PyLong_AsLong(arg);
    if (w == -1 && PyErr_Occurred()) return NULL;
    int old = crc_way;
    if (w >= 0) {
        int best = best_crc_way();
        crc_way = w < best ? (int)w : best;
    }
    return PyLong_FromLong(old);
}

/* bounce_below(n) -> int: chunks whose contiguous pieces in the target are shorter than n bytes
 * are read through a bounce buffer from now on (0: none, a huge n: all that fit); returns the
 * previous n. */
static PyObject *set_bounce_below(PyObject *self, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    long long old = (long long)bounce_below;
    bounce_below = n < 0 ? 0 : (int64_t)n;
    return PyLong_FromLongLong(old);
}

/* read_at(fd, offsets, length, out) -> bool: `length` bytes from each offset of the file into
 * consecutive places of out (len(offsets) * length bytes), the GIL released: the few bytes a
 * shard's fingerprint takes from each inner chunk it did not read (their trailers), in one call
 * instead of one system call, and one hand-over of the interpreter lock, each. False when a read
 * failed or the file ended first. */
static PyObject *read_at(PyObject *self, PyObject *args) {
    int fd;
    PyObject *off_o, *out_o;
    long long length;
    if (!PyArg_ParseTuple(args, "iOLO", &fd, &off_o, &length, &out_o)) return NULL;
    Py_buffer offs = {0}, out = {0};
    PyObject *result = NULL;
    if (int64_view(off_o, &offs, "offsets") < 0) goto done;
    if (PyObject_GetBuffer(out_o, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    int64_t n = offs.len / 8;
    if (length < 0 || (length > 0 && n > (int64_t)out.len / length)) {
        PyErr_SetString(PyExc_ValueError, "read_at: out holds fewer than len(offsets) * length bytes");
        goto done;
    }
    const int64_t *o = (const int64_t *)offs.buf;
    for (int64_t k = 0; k < n; k++) {
        if (o[k] < 0) {
            PyErr_SetString(PyExc_ValueError, "read_at: a negative offset");
            goto done;
        }
    }
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t k = 0; k < n && ok; k++) {
        struct iovec iov = {(unsigned char *)out.buf + k * length, (size_t)length};
        ok = read_full(fd, &iov, 1, o[k]) == 0;
    }
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    release_all((Py_buffer *[]){&offs, &out}, 2);
    return result;
}

/* seal_chunks(buf, count, body, stride) -> bytes: for k < count, the CRC32C of the `body` bytes at
 * k * stride, written (4 bytes, little-endian) right after them, as zarr3's crc32c codec lays out
 * a shard's inner chunks; returns those trailers, one after another. One call, the GIL released:
 * the encoder of a shard otherwise takes the interpreter lock once per inner chunk. */
static PyObject *seal_chunks(PyObject *self, PyObject *args) {
    PyObject *buf_o;
    long long count, body, stride;
    if (!PyArg_ParseTuple(args, "OLLL", &buf_o, &count, &body, &stride)) return NULL;
    Py_buffer b = {0};
    if (PyObject_GetBuffer(buf_o, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (count < 0 || body < 0 || stride < body + 4 ||
        (count > 0 && (count - 1) > ((long long)b.len - body - 4) / stride)) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "seal_chunks: count chunks of body + 4 bytes at stride do not fit the buffer");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(count * 4));
    if (out == NULL) {
        PyBuffer_Release(&b);
        return NULL;
    }
    unsigned char *tr = (unsigned char *)PyBytes_AS_STRING(out);
    unsigned char *base = (unsigned char *)b.buf;
    Py_BEGIN_ALLOW_THREADS
    for (long long k = 0; k < count; k++) {
        unsigned char *p = base + k * stride;
        uint32_t c = ~crc_extend(0xFFFFFFFFu, p, (size_t)body);
        for (int i = 0; i < 4; i++) p[body + i] = tr[4 * k + i] = (unsigned char)(c >> (8 * i));
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return out;
}

/* gather_chunks(src, base, strides, shape, inner, itemsize, dst, stride): a shard's elements laid
 * out as zarr3's sharding_indexed stores them: the shard (`shape`, its elements at byte `base` of
 * `src` with byte `strides`, the last one `itemsize`) cut into inner chunks of `inner`, chunk k
 * (row-major over the chunk grid) at byte k * stride of `dst`, its elements in C order. The copy
 * walks the source in its own order, one row at a time, each row's pieces to their chunks: numpy's
 * copy walks the destination's order, chunk by chunk, so that every source row it reads starts a
 * new stream (a page further on), which ran at 1.2-3 GB/s against 11-28 GB/s for a plain copy. The
 * GIL is released. The trailers are left to seal_chunks. */
static PyObject *gather_chunks(PyObject *self, PyObject *args) {
    PyObject *src_o, *strides_o, *shape_o, *inner_o, *dst_o;
    long long base, itemsize, stride;
    if (!PyArg_ParseTuple(args, "OLOOOLOL", &src_o, &base, &strides_o, &shape_o, &inner_o, &itemsize, &dst_o,
                          &stride))
        return NULL;
    Py_buffer src = {0}, st = {0}, sh = {0}, in = {0}, dst = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(src_o, &src, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (PyObject_GetBuffer(dst_o, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (int64_view(strides_o, &st, "strides") < 0 || int64_view(shape_o, &sh, "shape") < 0 ||
        int64_view(inner_o, &in, "inner") < 0)
        goto done;
    int nd = (int)(sh.len / 8);
    const int64_t *S = st.buf, *N = sh.buf, *I = in.buf;
    if (nd < 1 || nd > MAX_AXES || st.len != sh.len || in.len != sh.len || itemsize <= 0 || S[nd - 1] != itemsize ||
        base < 0 || stride <= 0) {
        PyErr_SetString(PyExc_ValueError, "gather_chunks: mismatched arguments");
        goto done;
    }
    int64_t grid[MAX_AXES], count = 1, elems = 1, lo = base, hi = base + itemsize;
    for (int a = 0; a < nd; a++) {
        if (N[a] <= 0 || I[a] <= 0 || N[a] % I[a] || N[a] > INT64_MAX / 16 / itemsize ||
            (S[a] < 0 ? -S[a] : S[a]) > INT64_MAX / 16 / N[a]) {
            PyErr_SetString(PyExc_ValueError, "gather_chunks: bad shape, inner chunk or stride");
            goto done;
        }
        grid[a] = N[a] / I[a];
        count *= grid[a];
        elems *= I[a];
        if (S[a] < 0) lo += (N[a] - 1) * S[a];
        else hi += (N[a] - 1) * S[a];
    }
    int64_t body = elems * itemsize;
    if (lo < 0 || hi > (int64_t)src.len || stride < body || count > (int64_t)dst.len / stride) {
        PyErr_SetString(PyExc_ValueError, "gather_chunks: the shard or its chunks do not fit the buffers");
        goto done;
    }
    const unsigned char *sp = src.buf;
    unsigned char *dp = dst.buf;
    Py_BEGIN_ALLOW_THREADS
    int64_t idx[MAX_AXES] = {0}, piece = I[nd - 1] * itemsize, rows = 1;
    for (int a = 0; a + 1 < nd; a++) rows *= N[a];
    for (int64_t r = 0; r < rows; r++) {
        /* source row idx[0..nd-2]: its chunk grid row, and its row inside those chunks */
        int64_t off = base, flat = 0, within = 0;
        for (int a = 0; a + 1 < nd; a++) {
            off += idx[a] * S[a];
            flat = flat * grid[a] + idx[a] / I[a];
            within = within * I[a] + idx[a] % I[a];
        }
        unsigned char *to = dp + flat * grid[nd - 1] * stride + within * piece;
        const unsigned char *from = sp + off;
        for (int64_t j = 0; j < grid[nd - 1]; j++) memcpy(to + j * stride, from + j * piece, (size_t)piece);
        for (int a = nd - 2; a >= 0; a--) { /* next source row, C order */
            if (++idx[a] < N[a]) break;
            idx[a] = 0;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release_all((Py_buffer *[]){&src, &dst, &st, &sh, &in}, 5);
    return result;
}

static PyMethodDef methods[] = {
    {"read_chunks", read_chunks, METH_VARARGS, "Read chunks into scattered rows, each checked by its CRC32C."},
    {"crc32c", crc32c_of, METH_O, "The CRC32C of a contiguous buffer (the same function read_chunks checks with)."},
    {"hardware", hardware, METH_NOARGS, "The CRC32C runs on the CPU's CRC instruction."},
    {"read_shard", read_shard, METH_VARARGS, "One shard: its index, then whole inner chunks into place, checked."},
    {"read_at", read_at, METH_VARARGS, "The same number of bytes from each of many offsets of a file."},
    {"seal_chunks", seal_chunks, METH_VARARGS, "CRC32C trailers of chunks laid out at a stride, written in place."},
    {"gather_chunks", gather_chunks, METH_VARARGS, "A shard's elements laid out as its inner chunks, walking the source in order."},
    {"crc_way", set_crc_way, METH_O, "The CRC32C by folding (2), the CRC instruction (1) or tables (0); -1: ask."},
    {"bounce_below", set_bounce_below, METH_O, "Chunks in pieces shorter than n bytes go through a bounce buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scatter_read", NULL, -1, methods};

PyMODINIT_FUNC PyInit__scatter_read(void) {
    init_table();
    init_shift(shift_lane, LANE);
    init_fold();
    crc_way = best_crc_way();
    bounce_ready = pthread_key_create(&bounce_key, free) == 0; /* without it: no bounce buffer */
    return PyModule_Create(&module);
}
