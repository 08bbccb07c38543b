/*
 * rand.h: random numbers that are the same on every machine: xorshift* (llm.c's sampler
 * generator) for sampling, and a normal distribution for GPT-2's weight init built on our own
 * double log/cos (canonical.h), so a fresh model has the same bits on any libm.
 */
#ifndef LLMC_RAND_H
#define LLMC_RAND_H

#include <math.h>
#include <stdint.h>
#include "llmc/canonical.h"

static inline uint32_t random_u32(uint64_t* state) {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (uint32_t)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}

// uniform in [0, 1) with 24 bits
static inline float random_f32(uint64_t* state) {
    return (float)(random_u32(state) >> 8) / 16777216.0f;
}

// uniform in (0, 1] with 53 bits
static inline double random_open_f64(uint64_t* state) {
    uint64_t hi = random_u32(state), lo = random_u32(state);
    uint64_t bits53 = ((hi << 32) | lo) >> 11;
    return ((double)bits53 + 1.0) / 9007199254740992.0;
}

// n samples of N(mean, std) by Box-Muller (both values of each pair used), rounded to float.
static inline void random_normal_fill(float* out, size_t n, float mean, float std, uint64_t* state) {
    for (size_t i = 0; i < n; i += 2) {
        double u1 = random_open_f64(state), u2 = random_open_f64(state);
        double radius = sqrt(-2.0 * canon_log_d(u1));      // sqrt is correctly rounded (IEEE)
        double z0 = radius * canon_cospi_d(2.0 * u2);
        double z1 = radius * canon_cospi_d(2.0 * u2 - 0.5); // sin(2 pi u2)
        out[i] = (float)(mean + std * z0);
        if (i + 1 < n) { out[i + 1] = (float)(mean + std * z1); }
    }
}

#endif // LLMC_RAND_H
