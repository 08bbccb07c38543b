/*
 * plot_log: draws the main.log files of training runs (llmc/logger.h) as one SVG picture.
 *
 *   dev/tools/plot_log -o loss.svg out/run/main.log
 *   dev/tools/plot_log -o cmp.svg --lr --norm --labels base,wide out/base/main.log out/wide/main.log
 *
 * Loss against step (train loss as a line, val loss as a dashed line with markers), optionally a
 * learning-rate and a gradient-norm panel below it on the same step axis, one colour per run.
 *
 * What the picture promises, so that dev/test/test_plot_log.sh can check it:
 *  - every series drawn is exactly one <polyline> (class "train-loss", "val-loss", "lr" or
 *    "norm"; one per run and quantity, runs in command-line order) and nothing else is a
 *    polyline: markers are <circle>s, legend samples and grid lines are <line>s. A series whose
 *    values are all non-finite is not drawn.
 *  - each panel's plot box is a <rect id="loss-box"> ("lr-box", "norm-box") with x, y, width,
 *    height. The smallest and the largest value a panel shows (over all runs) lie on the box's
 *    bottom and top edges, the first and the last step logged on its left and right edges.
 *    Only a constant panel is widened, so that its line sits in the middle.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llmc/utils.h"

static void usage(void) {
    printf(
        "usage: dev/tools/plot_log -o OUT.svg [options] RUN/main.log [RUN2/main.log ...]\n"
        "\n"
        "Draws the train loss (line) and the val loss (dashed, with markers) of training runs against\n"
        "the step, as SVG; several logs are overlaid, each run in its own colour.\n"
        "\n"
        "  -o FILE          the SVG to write (replaced atomically)\n"
        "  --lr             add a learning-rate panel\n"
        "  --norm           add a gradient-norm panel\n"
        "  --log            log scale for the loss\n"
        "  --title T        a title above the plot\n"
        "  --labels A,B,..  legend names, one per log (default: each log's directory name)\n"
        "  --width W        picture width in pixels (default 900)\n"
        "  --height H       picture height in pixels (default 420, plus 170 per extra panel)\n"
        "  --help           this text\n"
        "\n"
        "The logs are the trainer's main.log: 's:STEP trl:LOSS lr:LR norm:NORM' for a training step,\n"
        "'s:STEP tel:LOSS' for a validation loss. Other key:value fields (aux:...) are ignored, and so\n"
        "are lines that do not start with s:STEP. A step logged twice (a resumed run repeats the\n"
        "steps after its checkpoint) is drawn with its last value. nan and inf (a diverged run) are\n"
        "not drawn; a warning names the first step that has one.\n"
        "\n"
        "In the SVG every series is exactly one <polyline>, and each panel's plot box is a <rect\n"
        "id=\"loss-box\"> (\"lr-box\", \"norm-box\") whose edges are the panel's extreme values and steps.\n");
}

// ----------------------------------------------------------------------------------------------
// reading the logs

enum { TRAIN_LOSS, VAL_LOSS, LEARNING_RATE, GRAD_NORM, NUM_QUANTITIES };
static const char* const quantity_key[NUM_QUANTITIES] = {"trl", "tel", "lr", "norm"};
static const char* const quantity_class[NUM_QUANTITIES] = {"train-loss", "val-loss", "lr", "norm"};
static const char* const quantity_name[NUM_QUANTITIES] = {"train loss", "val loss", "learning rate",
                                                          "gradient norm"};

typedef struct {
    int step;
    int line;  // of two values for one step, the one on the later line wins
    double value;
} Point;

typedef struct {
    Point* points;
    int count, cap;
} Series;

typedef struct {
    const char* path;
    char* label;
    Series series[NUM_QUANTITIES];
} Run;

static void series_append(Series* s, int step, int line, double value) {
    if (s->count == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 256;
        s->points = (Point*)realloc(s->points, (size_t)s->cap * sizeof(Point));
        if (s->points == NULL) { fatal("out of memory reading the logs"); }
    }
    s->points[s->count++] = (Point){step, line, value};
}

static int by_step_then_line(const void* a, const void* b) {
    const Point* p = (const Point*)a;
    const Point* q = (const Point*)b;
    if (p->step != q->step) { return p->step < q->step ? -1 : 1; }
    return (p->line > q->line) - (p->line < q->line);
}

// A resumed run logs the steps after its checkpoint again: only the last value of a step counts.
static void series_keep_last_per_step(Series* s) {
    if (s->count == 0) { return; }  // points is still NULL, which qsort must not be given
    qsort(s->points, (size_t)s->count, sizeof(Point), by_step_then_line);
    int kept = 0;
    for (int i = 0; i < s->count; i++) {
        if (kept > 0 && s->points[kept - 1].step == s->points[i].step) {
            s->points[kept - 1] = s->points[i];
        } else {
            s->points[kept++] = s->points[i];
        }
    }
    s->count = kept;
}

static int parse_step(const char* path, int line, const char* text) {
    char* end = NULL;
    errno = 0;
    long step = strtol(text, &end, 10);
    if (*text == '\0' || *end != '\0' || errno != 0 || step < 0 || step > INT_MAX) {
        fatal("%s line %d: expected a step number after 's:', got '%s'", path, line, text);
    }
    return (int)step;
}

// nan and inf parse here (the trainer prints them when a run diverges); drop_non_finite()
// deals with them once the last value of every step is known.
static double parse_value(const char* path, int line, const char* key, const char* text) {
    char* end = NULL;
    double value = strtod(text, &end);
    if (*text == '\0' || *end != '\0') {
        fatal("%s line %d: expected a number after '%s:', got '%s'", path, line, key, text);
    }
    return value;
}

static void read_log(Run* run) {
    FILE* f = fopen_or_die(run->path, "r", "log file");
    char* line = NULL;
    size_t line_cap = 0;
    const char* separators = " \t\r\n";
    for (int line_no = 1; getline(&line, &line_cap, f) != -1; line_no++) {
        char* rest = NULL;
        char* field = strtok_r(line, separators, &rest);
        if (field == NULL || strncmp(field, "s:", 2) != 0) { continue; }
        int step = parse_step(run->path, line_no, field + 2);
        while ((field = strtok_r(NULL, separators, &rest)) != NULL) {
            char* colon = strchr(field, ':');
            if (colon == NULL) { continue; }
            *colon = '\0';
            for (int q = 0; q < NUM_QUANTITIES; q++) {
                if (strcmp(field, quantity_key[q]) == 0) {
                    series_append(&run->series[q], step, line_no, parse_value(run->path, line_no, field, colon + 1));
                }
            }
        }
    }
    if (ferror(f)) { fatal("cannot read log file '%s': %s", run->path, strerror(errno)); }
    free(line);
    fclose(f);
    if (run->series[TRAIN_LOSS].count + run->series[VAL_LOSS].count == 0) {
        fatal("%s: no loss lines: expected lines like 's:STEP trl:LOSS lr:LR norm:NORM' or 's:STEP tel:LOSS'",
              run->path);
    }
    for (int q = 0; q < NUM_QUANTITIES; q++) { series_keep_last_per_step(&run->series[q]); }
}

// nan and inf cannot be drawn: they are left out, and one warning per file explains the gap.
static void drop_non_finite(Run* run) {
    int dropped = 0;
    Point first = {0, 0, 0.0};
    const char* first_key = NULL;
    for (int q = 0; q < NUM_QUANTITIES; q++) {
        Series* s = &run->series[q];
        int kept = 0;
        for (int i = 0; i < s->count; i++) {
            if (isfinite(s->points[i].value)) {
                s->points[kept++] = s->points[i];
                continue;
            }
            if (dropped++ == 0 || s->points[i].step < first.step) {
                first = s->points[i];
                first_key = quantity_key[q];
            }
        }
        s->count = kept;
    }
    if (dropped > 0) {
        fprintf(stderr, "warning: %s: %d non-finite value%s not drawn, the first at step %d (%s:%g)\n", run->path,
                dropped, dropped == 1 ? "" : "s", first.step, first_key, first.value);
    }
}

static char* copy_text(const char* text, size_t len) {
    char* copy = (char*)malloc_or_die(len + 1, "a label");
    memcpy(copy, text, len);
    copy[len] = '\0';
    return copy;
}

// The default legend name: the run's directory (out/wide/main.log -> "wide"), or the file's own
// name when the path names no directory.
static char* default_label(const char* path) {
    const char* slash = strrchr(path, '/');
    if (slash != NULL) {
        size_t end = (size_t)(slash - path);
        while (end > 0 && path[end - 1] == '/') { end--; }
        size_t start = end;
        while (start > 0 && path[start - 1] != '/') { start--; }
        int is_dot = end - start == 1 && path[start] == '.';
        if (end > start && !is_dot) { return copy_text(path + start, end - start); }
    }
    const char* name = slash != NULL ? slash + 1 : path;
    return copy_text(name, strlen(name));
}

// "a,b,c" into one label per run.
static void set_labels(Run* runs, int num_runs, const char* labels) {
    int n = 0;
    for (const char* p = labels; p != NULL; n++) {
        const char* comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (n < num_runs) { runs[n].label = copy_text(p, len); }
        p = comma ? comma + 1 : NULL;
    }
    if (n != num_runs) { fatal("--labels: %d names for %d log files", n, num_runs); }
}

// ----------------------------------------------------------------------------------------------
// SVG text

typedef struct {
    char* data;
    size_t len, cap;
} Text;

__attribute__((format(printf, 2, 3)))
static void text_printf(Text* t, const char* fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(t->data + t->len, t->cap - t->len, fmt, ap);
        va_end(ap);
        if (n < 0) { fatal("cannot format the SVG output"); }
        if (t->len + (size_t)n < t->cap) {
            t->len += (size_t)n;
            return;
        }
        t->cap = 2 * t->cap + (size_t)n + 1;
        char* grown = (char*)realloc(t->data, t->cap);
        if (grown == NULL) { fatal("out of memory building the SVG"); }
        t->data = grown;
    }
}

// Length of the well-formed UTF-8 sequence starting at s, or 0 when s does not start one.
static int utf8_sequence_length(const unsigned char* s) {
    int n = s[0] < 0x80 ? 1 : s[0] < 0xc2 ? 0 : s[0] < 0xe0 ? 2 : s[0] < 0xf0 ? 3 : s[0] < 0xf5 ? 4 : 0;
    for (int i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80) { return 0; }
    }
    return n;
}

// Titles, labels and paths come from the user: escaped, and with control characters and bytes
// that are not UTF-8 replaced, any of them leaves the SVG well-formed XML.
static void text_escaped(Text* t, const char* s) {
    for (const unsigned char* p = (const unsigned char*)s; *p != '\0';) {
        int n = utf8_sequence_length(p);
        if (n == 0) {
            text_printf(t, "\xef\xbf\xbd");  // U+FFFD, the replacement character
            p++;
            continue;
        }
        switch (*p) {
            case '&': text_printf(t, "&amp;"); break;
            case '<': text_printf(t, "&lt;"); break;
            case '>': text_printf(t, "&gt;"); break;
            case '"': text_printf(t, "&quot;"); break;
            case '\'': text_printf(t, "&apos;"); break;
            default:
                if (*p < 0x20) {
                    text_printf(t, " ");
                } else {
                    text_printf(t, "%.*s", n, (const char*)p);
                }
        }
        p += n;
    }
}

// ----------------------------------------------------------------------------------------------
// axes

typedef struct {
    double lo, hi;              // the values at the two ends
    double pixel_lo, pixel_hi;  // where they are drawn
    int log_scale;
} Axis;

static double axis_pixel(const Axis* a, double value) {
    double t = a->log_scale ? log(value / a->lo) / log(a->hi / a->lo) : (value - a->lo) / (a->hi - a->lo);
    return a->pixel_lo + t * (a->pixel_hi - a->pixel_lo);
}

// The extremes of the finite values of the quantities, over all runs; 0 when there are none.
static int value_range(const Run* runs, int num_runs, const int* quantities, int num_quantities, double* lo,
                       double* hi) {
    int found = 0;
    for (int r = 0; r < num_runs; r++) {
        for (int k = 0; k < num_quantities; k++) {
            const Series* s = &runs[r].series[quantities[k]];
            for (int i = 0; i < s->count; i++, found++) {
                double v = s->points[i].value;
                if (found == 0 || v < *lo) { *lo = v; }
                if (found == 0 || v > *hi) { *hi = v; }
            }
        }
    }
    return found > 0;
}

// The first and the last step with a finite value of any quantity, over all runs; 0 when none has one.
static int step_range(const Run* runs, int num_runs, double* first, double* last) {
    int found = 0;
    for (int r = 0; r < num_runs; r++) {
        for (int q = 0; q < NUM_QUANTITIES; q++) {
            const Series* s = &runs[r].series[q];  // sorted by step
            if (s->count == 0) { continue; }
            if (found == 0 || s->points[0].step < *first) { *first = s->points[0].step; }
            if (found == 0 || s->points[s->count - 1].step > *last) { *last = s->points[s->count - 1].step; }
            found++;
        }
    }
    return found > 0;
}

// A constant quantity (a fixed learning rate) has no span to map: widen it to sit mid-panel.
static void widen_if_constant(Axis* a) {
    if (a->hi > a->lo) { return; }
    if (a->log_scale) {
        a->lo /= 1.1;
        a->hi *= 1.1;
    } else {
        double pad = a->lo != 0.0 ? 0.1 * fabs(a->lo) : 1.0;
        a->lo -= pad;
        a->hi += pad;
    }
}

enum { MAX_TICKS = 12 };

// Tick spacing: 1, 2 or 5 times a power of ten, for at most max_ticks ticks over span.
static double nice_step(double span, int max_ticks) {
    double base = pow(10.0, floor(log10(span / max_ticks)));
    static const double multiples[] = {1.0, 2.0, 5.0};
    for (int i = 0; i < 3; i++) {
        if (span / (base * multiples[i]) <= max_ticks) { return base * multiples[i]; }
    }
    return 10.0 * base;
}

static int linear_ticks(double lo, double hi, double step, double* ticks) {
    int n = 0;
    double slack = 1e-9 * step;  // so that an end that is itself a multiple still gets its tick
    for (double k = ceil((lo - slack) / step); k * step <= hi + slack && n < MAX_TICKS; k++) {
        ticks[n++] = k * step + 0.0;  // -0 + 0 is +0: no "-0" label
    }
    return n;
}

// Tick values, rounded to 1, 2 or 5 x 10^k, at most max_ticks (<= MAX_TICKS) of them. On a log
// axis: those of 1, 2, 5 x 10^k that fall in the range, or only the powers of ten when the range
// spans many decades; a narrow range (losses 3 to 8) has too few of either and gets linear
// steps instead, unevenly spaced on the log axis.
static int axis_ticks(const Axis* a, int max_ticks, double* ticks) {
    if (a->log_scale) {
        static const double multiples[] = {1.0, 2.0, 5.0};
        for (int num_multiples = 3; num_multiples >= 1; num_multiples -= 2) {  // 1, 2, 5; then 1 alone
            int n = 0;
            for (int e = (int)floor(log10(a->lo)); e <= (int)ceil(log10(a->hi)); e++) {
                for (int m = 0; m < num_multiples; m++) {
                    double v = multiples[m] * pow(10.0, e);
                    if (v >= a->lo * (1.0 - 1e-9) && v <= a->hi * (1.0 + 1e-9) && n < MAX_TICKS) { ticks[n++] = v; }
                }
            }
            if (n >= 3 && n <= max_ticks) { return n; }
        }
    }
    return linear_ticks(a->lo, a->hi, nice_step(a->hi - a->lo, max_ticks), ticks);
}

// ----------------------------------------------------------------------------------------------
// drawing

static const char* const run_colours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
static const char* run_colour(int r) { return run_colours[r % (int)(sizeof(run_colours) / sizeof(run_colours[0]))]; }

#define VAL_DASH "5 3"
#define KEY_COLOUR "#444444"

typedef struct {
    const char* box_id;
    const char* axis_label;
    int quantities[2];
    int num_quantities;
    double height_share;
    Axis y;
} Panel;

typedef struct {
    const char* out;
    const char* title;
    const char* labels;
    int width, height;  // height 0: the default for the number of panels
    int show_lr, show_norm, log_scale;
} Options;

static void draw_series(Text* t, const Run* run, int quantity, const char* colour, const Axis* x, const Axis* y) {
    const Series* s = &run->series[quantity];
    if (s->count == 0) { return; }
    int dashed = quantity == VAL_LOSS;
    text_printf(t, "<polyline class=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\"%s points=\"",
                quantity_class[quantity], colour, dashed ? " stroke-dasharray=\"" VAL_DASH "\"" : "");
    for (int i = 0; i < s->count; i++) {
        text_printf(t, "%s%.2f,%.2f", i ? " " : "", axis_pixel(x, s->points[i].step), axis_pixel(y, s->points[i].value));
    }
    text_printf(t, "\"><title>");
    text_escaped(t, run->label);
    text_printf(t, ": %s (", quantity_name[quantity]);
    text_escaped(t, run->path);
    text_printf(t, ")</title></polyline>\n");
    if (dashed) {  // validation points are few and far apart: a marker shows where each was taken
        text_printf(t, "<g fill=\"%s\">", colour);
        for (int i = 0; i < s->count; i++) {
            text_printf(t, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"2.5\"/>", axis_pixel(x, s->points[i].step),
                        axis_pixel(y, s->points[i].value));
        }
        text_printf(t, "</g>\n");
    }
}

// Box, grid, y ticks and label, the series; step tick labels under the bottom panel only.
static void draw_panel(Text* t, const Panel* p, const Axis* x, const Run* runs, int num_runs, int is_bottom) {
    double left = x->pixel_lo, right = x->pixel_hi, top = p->y.pixel_hi, bottom = p->y.pixel_lo;
    text_printf(t, "<rect id=\"%s\" x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"white\" "
                "stroke=\"#999999\"/>\n", p->box_id, left, top, right - left, bottom - top);
    double ticks[MAX_TICKS];
    int max_y_ticks = (int)((bottom - top) / 32.0);
    int n = axis_ticks(&p->y, max_y_ticks < 2 ? 2 : (max_y_ticks > 8 ? 8 : max_y_ticks), ticks);
    for (int i = 0; i < n; i++) {
        double y = axis_pixel(&p->y, ticks[i]);
        text_printf(t, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"#e6e6e6\"/>"
                    "<text x=\"%.2f\" y=\"%.2f\" font-size=\"11\" text-anchor=\"end\">%g</text>\n",
                    left, y, right, y, left - 6.0, y + 4.0, ticks[i]);
    }
    int max_x_ticks = (int)((right - left) / 70.0);
    double step = nice_step(x->hi - x->lo, max_x_ticks < 2 ? 2 : (max_x_ticks > 10 ? 10 : max_x_ticks));
    n = linear_ticks(x->lo, x->hi, step < 1.0 ? 1.0 : step, ticks);  // steps are whole numbers
    for (int i = 0; i < n; i++) {
        double px = axis_pixel(x, ticks[i]);
        text_printf(t, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"#e6e6e6\"/>\n", px, top, px,
                    bottom);
        if (is_bottom) {
            text_printf(t, "<text x=\"%.2f\" y=\"%.2f\" font-size=\"11\" text-anchor=\"middle\">%.0f</text>\n", px,
                        bottom + 16.0, ticks[i]);
        }
    }
    double label_x = 18.0, label_y = (top + bottom) / 2.0;
    text_printf(t, "<text x=\"%.2f\" y=\"%.2f\" font-size=\"13\" text-anchor=\"middle\" "
                "transform=\"rotate(-90 %.2f %.2f)\">%s%s</text>\n", label_x, label_y, label_x, label_y,
                p->axis_label, p->y.log_scale ? " (log scale)" : "");
    for (int r = 0; r < num_runs; r++) {
        for (int k = 0; k < p->num_quantities; k++) {
            draw_series(t, &runs[r], p->quantities[k], run_colour(r), x, &p->y);
        }
    }
    if (is_bottom) {
        text_printf(t, "<text x=\"%.2f\" y=\"%.2f\" font-size=\"13\" text-anchor=\"middle\">step</text>\n",
                    (left + right) / 2.0, bottom + 34.0);
    }
}

// One entry per run in its colour, then what a solid and a dashed line mean.
static void draw_legend(Text* t, const Run* runs, int num_runs, double x, double y) {
    const double row = 18.0, sample = 24.0;
    for (int r = 0; r < num_runs; r++, y += row) {
        text_printf(t, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"%s\" stroke-width=\"3\"/>"
                    "<text x=\"%.2f\" y=\"%.2f\" font-size=\"12\">", x, y, x + sample, y, run_colour(r),
                    x + sample + 6.0, y + 4.0);
        text_escaped(t, runs[r].label);
        text_printf(t, "</text>\n");
    }
    y += row / 2.0;
    text_printf(t, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"" KEY_COLOUR "\" stroke-width=\"1.5\"/>"
                "<text x=\"%.2f\" y=\"%.2f\" font-size=\"12\">train loss</text>\n", x, y, x + sample, y,
                x + sample + 6.0, y + 4.0);
    y += row;
    text_printf(t, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"" KEY_COLOUR "\" stroke-width=\"1.5\" "
                "stroke-dasharray=\"" VAL_DASH "\"/><circle cx=\"%.2f\" cy=\"%.2f\" r=\"2.5\" fill=\"" KEY_COLOUR "\"/>"
                "<text x=\"%.2f\" y=\"%.2f\" font-size=\"12\">val loss</text>\n", x, y, x + sample, y,
                x + sample / 2.0, y, x + sample + 6.0, y + 4.0);
}

// Returns the number of series drawn.
static int write_svg(const Options* opt, const Run* runs, int num_runs) {
    Panel panels[3];
    int num_panels = 0;
    panels[num_panels++] = (Panel){.box_id = "loss-box", .axis_label = "loss", .quantities = {TRAIN_LOSS, VAL_LOSS},
                                   .num_quantities = 2, .height_share = 2.5};
    if (opt->show_lr) {
        panels[num_panels++] = (Panel){.box_id = "lr-box", .axis_label = "learning rate",
                                       .quantities = {LEARNING_RATE}, .num_quantities = 1, .height_share = 1.0};
    }
    if (opt->show_norm) {
        panels[num_panels++] = (Panel){.box_id = "norm-box", .axis_label = "gradient norm",
                                       .quantities = {GRAD_NORM}, .num_quantities = 1, .height_share = 1.0};
    }

    // layout: the panels stacked under the title, the legend to their right
    size_t longest_label = 8;  // "val loss"
    for (int r = 0; r < num_runs; r++) {
        if (strlen(runs[r].label) > longest_label) { longest_label = strlen(runs[r].label); }
    }
    double width = opt->width;
    double height = opt->height > 0 ? opt->height : 420 + 170 * (num_panels - 1);
    double legend_width = 40.0 + 7.0 * longest_label;
    if (legend_width > width / 3.0) { legend_width = width / 3.0; }
    const double margin_left = 80.0, margin_bottom = 48.0, panel_gap = 20.0;
    double margin_top = opt->title ? 44.0 : 16.0;
    double plot_right = width - legend_width - 16.0;
    if (plot_right - margin_left < 100.0) { fatal("--width %d is too narrow for the plot and its legend", opt->width); }
    double shares = 0.0;
    for (int i = 0; i < num_panels; i++) { shares += panels[i].height_share; }
    double panels_height = height - margin_top - margin_bottom - panel_gap * (num_panels - 1);
    if (panels_height / shares < 40.0) { fatal("--height %.0f is too small for %d panels", height, num_panels); }

    // axes: every panel spans the same steps, each its own values
    Axis x = {0.0, 0.0, margin_left, plot_right, 0};
    if (!step_range(runs, num_runs, &x.lo, &x.hi)) { fatal("nothing to draw: every value in the logs is nan or inf"); }
    if (x.hi == x.lo) {  // a single step: centred
        x.lo -= 1.0;
        x.hi += 1.0;
    }
    double top = margin_top;
    for (int i = 0; i < num_panels; i++) {
        Panel* p = &panels[i];
        if (!value_range(runs, num_runs, p->quantities, p->num_quantities, &p->y.lo, &p->y.hi)) {
            fatal("the %s panel would be empty: no log has a finite %s value", p->axis_label, p->axis_label);
        }
        p->y.log_scale = i == 0 && opt->log_scale;
        widen_if_constant(&p->y);
        double h = panels_height * p->height_share / shares;
        p->y.pixel_hi = top;
        p->y.pixel_lo = top + h;
        top += h + panel_gap;
    }

    Text t = {NULL, 0, 0};
    text_printf(&t, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    text_printf(&t, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
                "font-family=\"Helvetica, Arial, sans-serif\">\n", width, height, width, height);
    text_printf(&t, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    if (opt->title) {
        text_printf(&t, "<text x=\"%.2f\" y=\"28\" font-size=\"16\" font-weight=\"bold\" text-anchor=\"middle\">",
                    (margin_left + plot_right) / 2.0);
        text_escaped(&t, opt->title);
        text_printf(&t, "</text>\n");
    }
    for (int i = 0; i < num_panels; i++) { draw_panel(&t, &panels[i], &x, runs, num_runs, i == num_panels - 1); }
    draw_legend(&t, runs, num_runs, plot_right + 16.0, margin_top + 8.0);
    text_printf(&t, "</svg>\n");

    AtomicWriter w;
    atomic_writer_open(&w, opt->out);
    atomic_writer_write(&w, t.data, t.len);
    atomic_writer_commit(&w);
    free(t.data);

    int drawn = 0;  // draw_series() skips empty series
    for (int i = 0; i < num_panels; i++) {
        for (int r = 0; r < num_runs; r++) {
            for (int k = 0; k < panels[i].num_quantities; k++) {
                drawn += runs[r].series[panels[i].quantities[k]].count > 0;
            }
        }
    }
    return drawn;
}

// ----------------------------------------------------------------------------------------------

static int parse_pixels(const char* flag, const char* value) {
    char* end = NULL;
    long x = strtol(value, &end, 10);
    if (*value == '\0' || *end != '\0' || x < 200 || x > 20000) {
        fatal("%s: expected a whole number of pixels from 200 to 20000, got '%s'", flag, value);
    }
    return (int)x;
}

int main(int argc, char** argv) {
    Options opt = {NULL, NULL, NULL, 900, 0, 0, 0, 0};
    const char** paths = (const char**)malloc_or_die((size_t)argc * sizeof(char*), "log paths");
    int num_runs = 0;
    for (int i = 1; i < argc; i++) {
        const char* arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            usage();
            free(paths);
            return 0;
        }
        if (arg[0] != '-') {
            paths[num_runs++] = arg;
            continue;
        }
        if (strcmp(arg, "--lr") == 0) { opt.show_lr = 1; continue; }
        if (strcmp(arg, "--norm") == 0) { opt.show_norm = 1; continue; }
        if (strcmp(arg, "--log") == 0) { opt.log_scale = 1; continue; }
        static const char* const with_value[] = {"-o", "--title", "--labels", "--width", "--height"};
        int known = 0;
        for (size_t k = 0; k < sizeof(with_value) / sizeof(with_value[0]); k++) { known |= strcmp(arg, with_value[k]) == 0; }
        if (!known) { fatal("unknown flag '%s' (see --help)", arg); }
        if (i + 1 >= argc) { fatal("%s: missing value (see --help)", arg); }
        const char* value = argv[++i];
        if (strcmp(arg, "-o") == 0) { opt.out = value; }
        else if (strcmp(arg, "--title") == 0) { opt.title = value; }
        else if (strcmp(arg, "--labels") == 0) { opt.labels = value; }
        else if (strcmp(arg, "--width") == 0) { opt.width = parse_pixels(arg, value); }
        else { opt.height = parse_pixels(arg, value); }
    }
    if (opt.out == NULL) { fatal("-o OUT.svg is required (see --help)"); }
    if (num_runs == 0) { fatal("no log files given: expected one or more RUN/main.log (see --help)"); }

    Run* runs = (Run*)calloc_or_die((size_t)num_runs, sizeof(Run), "runs");
    for (int r = 0; r < num_runs; r++) {
        runs[r].path = paths[r];
        read_log(&runs[r]);
        drop_non_finite(&runs[r]);
        if (opt.log_scale) {
            for (int q = TRAIN_LOSS; q <= VAL_LOSS; q++) {
                const Series* s = &runs[r].series[q];
                for (int i = 0; i < s->count; i++) {
                    if (s->points[i].value <= 0.0) {
                        fatal("--log: %s line %d: %s:%g is not positive, which a log scale cannot show", runs[r].path,
                              s->points[i].line, quantity_key[q], s->points[i].value);
                    }
                }
            }
        }
    }
    if (opt.labels) {
        set_labels(runs, num_runs, opt.labels);
    } else {
        for (int r = 0; r < num_runs; r++) { runs[r].label = default_label(runs[r].path); }
    }

    int drawn = write_svg(&opt, runs, num_runs);
    printf("wrote %s: %d run%s, %d series\n", opt.out, num_runs, num_runs == 1 ? "" : "s", drawn);
    for (int r = 0; r < num_runs; r++) {
        for (int q = 0; q < NUM_QUANTITIES; q++) { free(runs[r].series[q].points); }
        free(runs[r].label);
    }
    free(runs);
    free(paths);
    return 0;
}
