/*
 * Fused CPU kernel behind specselect.selection.cheapest_mask (float32 costs).
 *
 * Same contract as the PyTorch kernel: take exactly min(budget, available) entries of a
 * [rows, cols] cost matrix in (cost, column, row) order, where "available" means cost < +inf,
 * then clear the rows outside `keep`. PyTorch needs ~8 tensor passes and a kthvalue for this;
 * here it is a radix select on order-preserving integer keys of the costs:
 *   1. one vectorised pass: the keys;
 *   2. one pass: an 11-bit histogram of every key's top digit (this also counts the
 *      available entries, as +inf and above share the top digits);
 *   3. one pass: gather the keys in the digit that holds the budget-th key (a small share:
 *      a digit spans a factor of 2^(1/4) in cost);
 *   4. two histogram passes over those fix the remaining 21 bits: the threshold key;
 *   5. one vectorised pass: the mask (keys below the threshold, and the ties at it when all
 *      of them fit), then the per-row counts.
 * Only when the budget ends inside a group of equal costs does a column-major scan split the
 * ties (shallower columns first, then lower rows), the same rule as the PyTorch kernel.
 *
 * Plain C99, no Python or torch headers: it compiles in a fraction of a second on first use.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TOP_SHIFT 21
#define DIGITS 2048            /* 11-bit digits (the last one has 10 bits) */
#define TOP_NEVER 0x7FCu       /* top digit of the key of +inf: it and above are never taken */

/* A uint32 whose unsigned order is the float order; -0.0 maps like +0.0, NaN above +inf.
 * Branch-free so that the mask pass vectorises. */
static inline uint32_t float_key(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = (u == 0x80000000u) ? 0u : u;
    const uint32_t magnitude = u & 0x7FFFFFFFu;
    const uint32_t key = u ^ ((0u - (u >> 31)) | 0x80000000u); /* negative: flip all bits */
    return magnitude > 0x7F800000u ? 0xFFFFFFFFu : key;
}

/* keys[i] = float_key(costs[i]) for all i: a separate pass because it vectorises. */
static void make_keys(const float *costs, int64_t n, uint32_t *keys) {
    for (int64_t i = 0; i < n; i++) keys[i] = float_key(costs[i]);
}

/* Histogram of the top digits; four interleaved copies so that runs of equal digits (costs
 * cluster in a few exponents) do not serialise on one counter. Returns the count of keys
 * below +inf. */
static int64_t top_histogram(const uint32_t *keys, int64_t n, uint32_t *hist) {
    uint32_t part[4][DIGITS];
    memset(part, 0, sizeof part);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        part[0][keys[i] >> TOP_SHIFT]++;
        part[1][keys[i + 1] >> TOP_SHIFT]++;
        part[2][keys[i + 2] >> TOP_SHIFT]++;
        part[3][keys[i + 3] >> TOP_SHIFT]++;
    }
    for (; i < n; i++) part[0][keys[i] >> TOP_SHIFT]++;
    int64_t available = 0;
    for (uint32_t d = 0; d < DIGITS; d++) {
        hist[d] = part[0][d] + part[1][d] + part[2][d] + part[3][d];
        if (d < TOP_NEVER) available += hist[d];
    }
    return available;
}

/* The digit holding the `*rank`-th key (1-based); `*rank` becomes the rank inside it. */
static uint32_t find_digit(const uint32_t *hist, int64_t *rank) {
    uint32_t digit = 0;
    while (hist[digit] < *rank) { /* terminates: the histogram holds >= rank keys */
        *rank -= hist[digit];
        digit++;
    }
    return digit;
}

/* The threshold key: the `*rank`-th smallest (1-based) of keys[0..n). On return *rank is how
 * many keys equal to it are taken and *ties how many there are. `scratch` holds >= n + 1. */
static uint32_t threshold(const uint32_t *keys, int64_t n, const uint32_t *top, int64_t *rank,
                          int64_t *ties, uint32_t *scratch) {
    const uint32_t digit = find_digit(top, rank);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) { /* branch-free compaction of the digit's keys */
        scratch[m] = keys[i];
        m += (keys[i] >> TOP_SHIFT) == digit;
    }
    static const int shifts[2] = {10, 0};
    static const uint32_t masks[2] = {0x7FFu, 0x3FFu};
    uint32_t prefix = digit << TOP_SHIFT, fixed = 0xFFFFFFFFu << TOP_SHIFT;
    uint32_t hist[DIGITS];
    for (int pass = 0; pass < 2; pass++) {
        memset(hist, 0, sizeof hist);
        for (int64_t i = 0; i < m; i++) {
            const uint32_t key = scratch[i];
            if (((key ^ prefix) & fixed) == 0) hist[(key >> shifts[pass]) & masks[pass]]++;
        }
        const uint32_t low = find_digit(hist, rank);
        prefix |= low << shifts[pass];
        fixed |= masks[pass] << shifts[pass];
        *ties = hist[low];
    }
    return prefix;
}

/* Take the first `quota` keys equal to `tau` in column-major order (mask/counts updated). */
static void split_ties(const float *costs, int64_t rows, int64_t cols, uint32_t tau,
                       int64_t quota, uint8_t *mask, int64_t *counts) {
    for (int64_t c = 0; c < cols && quota > 0; c++) {
        for (int64_t r = 0; r < rows && quota > 0; r++) {
            if (float_key(costs[r * cols + c]) == tau) {
                mask[r * cols + c] = 1;
                counts[r]++;
                quota--;
            }
        }
    }
}

/*
 * costs: [rows, cols] float32, row-major. keep: [rows] bytes (0/1) or NULL. mask: [rows, cols]
 * bytes (0/1, a torch.bool tensor's storage) and counts: [rows] int64 are written. Returns 0,
 * or -1 if scratch memory could not be allocated (outputs undefined then).
 */
int specselect_cheapest_mask(const float *costs, int64_t rows, int64_t cols, int64_t budget,
                             const uint8_t *keep, uint8_t *mask, int64_t *counts) {
    const int64_t n = rows * cols;
    uint32_t *keys = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(2 * n + 1));
    if (keys == NULL) return -1;
    make_keys(costs, n, keys);
    uint32_t top[DIGITS];
    const int64_t available = top_histogram(keys, n, top);
    const int64_t target = budget < available ? budget : available;
    uint32_t take_below = 0; /* every key below this is taken ... */
    uint32_t tau = 0;        /* ... and tie_quota of the keys equal to tau, when not all fit */
    int64_t tie_quota = 0, ties = 0;
    if (target > 0) {
        tie_quota = target;
        tau = threshold(keys, n, top, &tie_quota, &ties, keys + n);
        take_below = ties == tie_quota ? tau + 1u : tau; /* tau < +inf's key: no overflow */
    }
    for (int64_t i = 0; i < n; i++) mask[i] = keys[i] < take_below;
    free(keys);
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row_mask = mask + r * cols;
        uint32_t count = 0;
        for (int64_t c = 0; c < cols; c++) count += row_mask[c];
        counts[r] = count;
    }
    if (ties != tie_quota) split_ties(costs, rows, cols, tau, tie_quota, mask, counts);
    if (keep != NULL) {
        for (int64_t r = 0; r < rows; r++) {
            if (!keep[r]) {
                memset(mask + r * cols, 0, (size_t)cols);
                counts[r] = 0;
            }
        }
    }
    return 0;
}
