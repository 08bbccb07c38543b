/*
 * logger.h: DIR/main.log with llm.c's keys, one line per event:
 *   s:STEP trl:LOSS lr:LR norm:NORM      (training step STEP, 0-based like llm.c; a mixture of
 *                                         experts adds aux:LOSS, its load-balancing loss)
 *   s:STEP tel:LOSS                      (validation loss before step STEP)
 * Floats are printed with %.9g, which round-trips every float exactly, so the logs of two
 * runs can be compared bit for bit with cmp. Only one rank writes. A resumed run keeps the
 * lines of the steps before its checkpoint and drops the later ones (which it trains again),
 * so the log of a run stopped and resumed reads as one run's.
 */
#ifndef LLMC_LOGGER_H
#define LLMC_LOGGER_H

#include <stdio.h>
#include "llmc/utils.h"

typedef struct {
    int active;
    char path[1100];
} Logger;

// resume_step < 0: a fresh run, an existing log is emptied; else the lines of steps before
// resume_step are kept (rewritten to a temp file and renamed, like a checkpoint).
static inline void logger_init(Logger* lg, const char* dir, int active, int resume_step) {
    lg->active = dir != NULL && active;
    if (!lg->active) { return; }
    snprintf(lg->path, sizeof(lg->path), "%s/main.log", dir);
    FILE* old = resume_step >= 0 ? fopen(lg->path, "r") : NULL;
    if (old == NULL) {
        FILE* f = fopen_or_die(lg->path, "w", "log file");
        fclose(f);
        return;
    }
    char tmp[1200], line[512];
    snprintf(tmp, sizeof(tmp), "%s.tmp", lg->path);
    FILE* f = fopen_or_die(tmp, "w", "log file");
    while (fgets(line, sizeof(line), old)) {
        long step = -1;
        if (sscanf(line, "s:%ld", &step) == 1 && step < resume_step) { fputs(line, f); }
    }
    fclose(old);
    if (fclose(f) != 0 || rename(tmp, lg->path) != 0) { fatal("cannot rewrite log file '%s'", lg->path); }
}

static inline void logger_line_(Logger* lg, const char* line) {
    if (!lg->active) { return; }
    FILE* f = fopen_or_die(lg->path, "a", "log file");
    fputs(line, f);
    if (fclose(f) != 0) { fatal("cannot write log file '%s'", lg->path); }
}

static inline void logger_log_train(Logger* lg, int step, float loss, float lr, float norm) {
    char line[256];
    snprintf(line, sizeof(line), "s:%d trl:%.9g lr:%.9g norm:%.9g\n", step, loss, lr, norm);
    logger_line_(lg, line);
}

// A mixture-of-experts model's step: the load-balancing loss beside the cross-entropy.
static inline void logger_log_train_aux(Logger* lg, int step, float loss, float lr, float norm, float aux) {
    char line[256];
    snprintf(line, sizeof(line), "s:%d trl:%.9g lr:%.9g norm:%.9g aux:%.9g\n", step, loss, lr, norm, aux);
    logger_line_(lg, line);
}

static inline void logger_log_val(Logger* lg, int step, float loss) {
    char line[128];
    snprintf(line, sizeof(line), "s:%d tel:%.9g\n", step, loss);
    logger_line_(lg, line);
}

#endif // LLMC_LOGGER_H
