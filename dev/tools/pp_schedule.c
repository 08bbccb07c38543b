/*
 * pp_schedule: prints (and draws) a pipeline-parallel schedule from llmc/pipeline.h, timed by
 * the simulator beside it (dev/tools/pp_sim.h).
 *
 *   dev/tools/pp_schedule --stages 4 --microbatches 8 --schedule 1f1b
 *   dev/tools/pp_schedule --stages 4 --microbatches 8 --schedule interleaved --chunks 2 --svg pp.svg
 *   dev/tools/pp_schedule --stages 4 --microbatches 8 --schedule zbv --fwd 1 --bwd 2.2 --wgt 1 --svg pp.svg
 *   dev/tools/pp_schedule --stages 4 --microbatches 8 --schedule dualpipev --fb 2.5 --svg pp.svg
 *
 * For each stage: its actions (F3 / B3 = forward / backward of microbatch 3; I3 / W3 = its
 * input-gradient / weight-gradient halves under zb1 and zbv; F3c0&B1c1 an F&B pair under
 * dualpipev), then the modelled bubble
 * fraction, the bubble of a simulated run with the given times, and the most (microbatch,
 * chunk) activations each stage holds against the schedule's textbook bound. --svg draws the
 * simulated timeline.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dev/tools/pp_sim.h"
#include "llmc/utils.h"

static void usage(void) {
    printf(
        "usage: dev/tools/pp_schedule --stages S --microbatches M --schedule NAME [options]\n"
        "\n"
        "Prints every stage's pipeline schedule, the modelled and the simulated bubble fraction and the\n"
        "most activations each stage holds; optionally draws the timeline as SVG.\n"
        "\n"
        "  --stages S          pipeline stages (ranks), >= 1\n"
        "  --microbatches M    microbatches per step, >= 1 (interleaved: a multiple of S)\n"
        "  --schedule NAME     gpipe, 1f1b (Megatron-LM's non-interleaved 1F1B), interleaved\n"
        "                      (Megatron-LM's interleaved 1F1B), zb1 (ZB-H1) or zbv (ZB-V, two chunks\n"
        "                      per stage placed as a V) or dualpipev (DeepSeek's DualPipeV: the V of\n"
        "                      zbv with F&B pairs, M >= 2S) or dualpipe (DeepSeek's DualPipe: S even,\n"
        "                      M even >= 2S, each stage on two ranks, half the microbatches entering\n"
        "                      at each end); zb1 and zbv split each backward into I (the input\n"
        "                      gradient) and W (the weight gradient), dualpipev and dualpipe some\n"
        "  --chunks V          model chunks per stage, interleaved only (default 2; zbv and dualpipev\n"
        "                      have 2)\n"
        "  --fwd T[,T,...]     time of one forward (one microbatch, one chunk): one value for every\n"
        "                      stage or one per stage, e.g. measured (default 1)\n"
        "  --bwd T[,T,...]     time of one whole backward (input and weight gradients), likewise\n"
        "                      (default 2)\n"
        "  --wgt T[,T,...]     time of the weight-gradient part W of that backward, likewise, at most\n"
        "                      --bwd; I then takes bwd - wgt (default: half of --bwd, so the defaults\n"
        "                      give F = I = W = 1 as in the zero-bubble paper). Ignored by schedules\n"
        "                      that do not split the backward, so one command line compares them all\n"
        "  --fb T[,T,...]      time of one F&B pair (a forward overlapped with a whole backward),\n"
        "                      likewise (default fwd + bwd: nothing hidden; measured, it can be more:\n"
        "                      the halves contend for the cores)\n"
        "  --transfer T        time one activation or gradient takes between stages (default 0)\n"
        "  --comm MODEL        how sends behave in the simulation: eager (default; buffered, never\n"
        "                      wait), batched (runs joined by '+' posted at once, each send waits for\n"
        "                      its receive) or rendezvous (one at a time, each send waits)\n"
        "  --actions           print sends and receives too: rF3 / sF3 receive / send microbatch 3's\n"
        "                      activation, rB3 / sB3 its gradient; '+' joins actions posted together\n"
        "  --layers L          also print which of L transformer layers each stage (and chunk) holds:\n"
        "                      balanced over the S*V virtual stages, placed round-robin (interleaved)\n"
        "                      or as a V (zbv, dualpipev)\n"
        "  --embed-cost E      cost of the embedding for --layers, in layers (default 0)\n"
        "  --head-cost H       cost of final layernorm + LM head + loss for --layers, in layers\n"
        "                      (default 0; GPT-2 124M: 50304/(12*768) = 5.46)\n"
        "  --svg FILE          write the simulated timeline as SVG (replaced atomically)\n"
        "  --help              this text\n"
        "\n"
        "With several chunks actions carry their chunk: F3c1 is the forward of microbatch 3 on chunk 1.\n"
        "The SVG draws forwards blue, backwards (or I) orange, W green, later chunks lighter; an F&B\n"
        "pair as its forward beside its backward, framed in purple.\n");
}

// ----------------------------------------------------------------------------------------------
// flags

static int parse_int_flag(const char* flag, const char* value, int min) {
    char* end = NULL;
    long x = strtol(value, &end, 10);
    if (*value == '\0' || *end != '\0' || x < min || x > 1000000) {
        fatal("%s: expected an integer >= %d, got '%s'", flag, min, value);
    }
    return (int)x;
}

static double parse_time(const char* flag, const char* text) {
    char* end = NULL;
    double x = strtod(text, &end);
    if (*text == '\0' || *end != '\0' || !(x >= 0.0) || !isfinite(x)) {
        fatal("%s: expected a finite number >= 0, got '%s'", flag, text);
    }
    return x;
}

// "1.5" (every stage) or "1,1.2,0.9,1" (one per stage) into out[S].
static void parse_times(const char* flag, const char* value, int S, double* out) {
    char buf[4096];
    if (strlen(value) >= sizeof(buf)) { fatal("%s: value too long", flag); }
    snprintf(buf, sizeof(buf), "%s", value);
    int n = 0;
    for (char* p = buf; p != NULL; n++) {
        char* comma = strchr(p, ',');
        if (comma) { *comma = '\0'; }
        double t = parse_time(flag, p);
        if (n < S) { out[n] = t; }
        p = comma ? comma + 1 : NULL;
    }
    if (n == 1) {
        for (int s = 1; s < S; s++) { out[s] = out[0]; }
    } else if (n != S) {
        fatal("%s: expected one value or one per stage (%d), got %d", flag, S, n);
    }
}

// ----------------------------------------------------------------------------------------------
// SVG

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

// Forward boxes blue, backward (or its input-gradient half) orange, weight gradient green;
// later chunks lighter, mixed with white.
static double chunk_lightness(int chunk, int num_chunks) {
    return num_chunks > 1 ? 0.55 * chunk / (num_chunks - 1) : 0.0;
}

static void box_colour(char* buf, size_t len, PipelineActionKind kind, int chunk, int num_chunks) {
    static const int blue[3] = {0x3b, 0x6e, 0xa8}, orange[3] = {0xe8, 0x7d, 0x1e}, green[3] = {0x3f, 0x9b, 0x4f};
    const int* base = kind == PP_FORWARD ? blue : kind == PP_BACKWARD_WEIGHT ? green : orange;
    int rgb[3] = {base[0], base[1], base[2]};
    double mix = chunk_lightness(chunk, num_chunks);
    for (int i = 0; i < 3; i++) { rgb[i] = (int)lround(rgb[i] + (255 - rgb[i]) * mix); }
    snprintf(buf, len, "#%02x%02x%02x", rgb[0], rgb[1], rgb[2]);
}

// Tick spacing: 1, 2 or 5 times a power of ten, for at most 10 ticks.
static double tick_step(double span) {
    if (!(span > 0.0)) { return 1.0; }
    double base = pow(10.0, floor(log10(span / 10.0)));
    static const double multiples[] = {1.0, 2.0, 5.0};
    for (int i = 0; i < 3; i++) {
        if (span / (base * multiples[i]) <= 10.0) { return base * multiples[i]; }
    }
    return 10.0 * base;
}

static void write_svg(const char* path, const PipelineSchedule* sch, const PipelineTimeline* tl, double bubble,
                      const double* fwd, const double* bwd, const char* caption) {
    const PipelineConfig* cfg = &sch->cfg;
    int S = cfg->num_stages;
    const double left = 70.0, top = 44.0, row_h = 28.0, row_gap = 8.0;
    // wide enough that the shortest box still shows its number (14 px), within 1000..4000 px
    double shortest = INFINITY;
    for (int i = 0; i < sch->offset[S]; i++) {
        double d = tl->end[i] - tl->start[i];
        if (pipeline_is_compute(sch->actions[i].kind) && d > 0.0 && d < shortest) { shortest = d; }
    }
    double span = tl->makespan > 0.0 ? tl->makespan : 1.0;
    double chart_w = isfinite(shortest) ? 14.0 * span / shortest : 1000.0;
    chart_w = chart_w < 1000.0 ? 1000.0 : (chart_w > 4000.0 ? 4000.0 : chart_w);
    double scale = chart_w / span;
    double rows_h = S * (row_h + row_gap);
    double width = left + chart_w + 30.0, height = top + rows_h + 130.0;
    Text t = {NULL, 0, 0};
    text_printf(&t, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    text_printf(&t, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
                "font-family=\"Helvetica, Arial, sans-serif\">\n", width, height, width, height);
    text_printf(&t, "<defs><pattern id=\"idle\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
                "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#f2f2f2\"/>"
                "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#cfcfcf\" stroke-width=\"2\"/></pattern></defs>\n");
    text_printf(&t, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    char chunks[48] = "";
    if (cfg->num_chunks > 1) { snprintf(chunks, sizeof(chunks), ", %d chunks per stage", cfg->num_chunks); }
    text_printf(&t, "<text x=\"%.1f\" y=\"24\" font-size=\"16\" font-weight=\"bold\">Pipeline schedule: %s, %d stages, "
                "%d microbatches%s: bubble %.3f</text>\n", left, pipeline_schedule_name(cfg->kind), S,
                cfg->num_microbatches, chunks, bubble);
    for (int s = 0; s < S; s++) {
        double y = top + s * (row_h + row_gap);
        text_printf(&t, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"end\">stage %d</text>\n", left - 8.0,
                    y + row_h / 2.0 + 4.5, s);
        // the whole row hatched as idle; computations are drawn over it, so what shows is the bubble
        text_printf(&t, "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"url(#idle)\" stroke=\"#bbbbbb\" "
                    "stroke-width=\"0.5\"/>\n", left, y, tl->makespan * scale, row_h);
        for (int i = sch->offset[s]; i < sch->offset[s + 1]; i++) {
            const PipelineAction* pair = &sch->actions[i];
            if (!pipeline_is_compute(pair->kind)) { continue; }
            // an F&B: its forward, then its backward, splitting the box by their own times
            PipelineAction halves[2];
            int nh = pipeline_action_halves(pair, halves);
            double box_x = left + tl->start[i] * scale, box_w = (tl->end[i] - tl->start[i]) * scale;
            double forward_share = nh == 2 ? fwd[s] / (fwd[s] + bwd[s]) : 1.0;
            for (int h = 0; h < nh; h++) {
                const PipelineAction* a = &halves[h];
                double x = box_x + (h == 1 ? forward_share * box_w : 0.0);
                double w = nh == 2 ? (h == 0 ? forward_share : 1.0 - forward_share) * box_w : box_w;
                char colour[16], label[32];
                box_colour(colour, sizeof(colour), a->kind, a->chunk, cfg->num_chunks);
                if (cfg->num_chunks > 1) {
                    snprintf(label, sizeof(label), "%dc%d", a->microbatch, a->chunk);
                } else {
                    snprintf(label, sizeof(label), "%d", a->microbatch);
                }
                const char* what = a->kind == PP_FORWARD ? "forward" : a->kind == PP_BACKWARD ? "backward"
                                 : a->kind == PP_BACKWARD_INPUT ? "input gradient (I)" : "weight gradient (W)";
                text_printf(&t, "<g><title>%s of microbatch %d chunk %d: %g to %g</title>"
                            "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\" stroke=\"white\" "
                            "stroke-width=\"0.75\"/>", what, a->microbatch, a->chunk, tl->start[i], tl->end[i], x, y, w,
                            row_h, colour);
                // the microbatch number, as large as fits the box (about 0.6 em per digit)
                double font = w / (0.62 * strlen(label) + 0.5);
                if (font > 12.0) { font = 12.0; }
                if (font >= 5.0) {
                    text_printf(&t, "<text x=\"%.2f\" y=\"%.2f\" font-size=\"%.1f\" text-anchor=\"middle\" fill=\"%s\">%s"
                                "</text>", x + w / 2.0, y + row_h / 2.0 + font * 0.35, font,
                                chunk_lightness(a->chunk, cfg->num_chunks) > 0.3 ? "#222222" : "white", label);
                }
                text_printf(&t, "</g>\n");
            }
            if (nh == 2) {
                text_printf(&t, "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"none\" "
                            "stroke=\"#7b2d8e\" stroke-width=\"2\"/>\n", box_x + 1.0, y + 1.0, box_w - 2.0, row_h - 2.0);
            }
        }
    }
    // time axis
    double axis_y = top + rows_h + 4.0;
    text_printf(&t, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"#444444\"/>\n", left, axis_y,
                left + tl->makespan * scale, axis_y);
    double step = tick_step(tl->makespan);
    for (int k = 0; k * step <= tl->makespan * (1.0 + 1e-12); k++) {
        double x = left + k * step * scale;
        text_printf(&t, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"#444444\"/>"
                    "<text x=\"%.2f\" y=\"%.2f\" font-size=\"11\" text-anchor=\"middle\">%g</text>\n",
                    x, axis_y, x, axis_y + 5.0, x, axis_y + 17.0, k * step);
    }
    text_printf(&t, "<text x=\"%.2f\" y=\"%.2f\" font-size=\"11\" text-anchor=\"end\">time</text>\n",
                left + chart_w, axis_y + 30.0);
    // legend: a colour box and its text per entry, laid out left to right
    double ly = axis_y + 42.0, lx = left;
    int split = pipeline_splits_backward(cfg->kind);
    static const PipelineActionKind legend_kinds[3] = {PP_FORWARD, PP_BACKWARD, PP_BACKWARD_WEIGHT};
    const char* legend_text[3] = {"forward (microbatch number inside)",
                                  split ? "input gradient (I)" : "backward", "weight gradient (W)"};
    for (int k = 0; k < (split ? 3 : 2); k++) {
        char colour[16];
        box_colour(colour, sizeof(colour), legend_kinds[k], 0, 1);
        text_printf(&t, "<rect x=\"%.2f\" y=\"%.2f\" width=\"18\" height=\"12\" fill=\"%s\"/>"
                    "<text x=\"%.2f\" y=\"%.2f\" font-size=\"12\">%s</text>\n", lx, ly, colour, lx + 24.0, ly + 10.5,
                    legend_text[k]);
        lx += 24.0 + 7.0 * strlen(legend_text[k]) + 20.0;
    }
    text_printf(&t, "<rect x=\"%.2f\" y=\"%.2f\" width=\"18\" height=\"12\" fill=\"url(#idle)\" stroke=\"#bbbbbb\" "
                "stroke-width=\"0.5\"/><text x=\"%.2f\" y=\"%.2f\" font-size=\"12\">idle (bubble)</text>\n",
                lx, ly, lx + 24.0, ly + 10.5);
    if (cfg->num_chunks > 1) {
        text_printf(&t, "<text x=\"%.2f\" y=\"%.2f\" font-size=\"12\">lighter: later chunk (label: microbatch c chunk)%s"
                    "</text>\n", left, ly + 32.0, cfg->kind == PP_DUALPIPEV || cfg->kind == PP_DUALPIPE ? "; framed in purple: an F&B pair, "
                    "its forward overlapped with the other chunk's backward" : "");
    }
    text_printf(&t, "<text x=\"%.2f\" y=\"%.2f\" font-size=\"13\">%s</text>\n", left, ly + 56.0, caption);
    text_printf(&t, "</svg>\n");

    AtomicWriter w;
    atomic_writer_open(&w, path);
    atomic_writer_write(&w, t.data, t.len);
    atomic_writer_commit(&w);
    free(t.data);
}

// ----------------------------------------------------------------------------------------------

int main(int argc, char** argv) {
    int S = 0, M = 0, chunks = 0, show_actions = 0, layers = 0;
    const char* schedule = NULL;
    const char* fwd_text = "1";
    const char* bwd_text = "2";
    const char* wgt_text = NULL;
    const char* fb_text = NULL;
    const char* comm_text = "eager";
    const char* svg = NULL;
    double transfer = 0.0, embed_cost = 0.0, head_cost = 0.0;
    for (int i = 1; i < argc; i++) {
        const char* flag = argv[i];
        if (strcmp(flag, "--help") == 0 || strcmp(flag, "-h") == 0) {
            usage();
            return 0;
        }
        if (strcmp(flag, "--actions") == 0) {
            show_actions = 1;
            continue;
        }
        static const char* const with_value[] = {"--stages", "--microbatches", "--schedule", "--chunks", "--fwd",
                                                 "--bwd", "--wgt", "--fb", "--transfer", "--comm", "--layers", "--embed-cost",
                                                 "--head-cost", "--svg"};
        int known = 0;
        for (size_t k = 0; k < sizeof(with_value) / sizeof(with_value[0]); k++) { known |= strcmp(flag, with_value[k]) == 0; }
        if (!known) { fatal("unknown flag '%s' (see --help)", flag); }
        if (i + 1 >= argc) { fatal("%s: missing value (see --help)", flag); }
        const char* value = argv[++i];
        if (strcmp(flag, "--stages") == 0) { S = parse_int_flag(flag, value, 1); }
        else if (strcmp(flag, "--microbatches") == 0) { M = parse_int_flag(flag, value, 1); }
        else if (strcmp(flag, "--schedule") == 0) { schedule = value; }
        else if (strcmp(flag, "--chunks") == 0) { chunks = parse_int_flag(flag, value, 1); }
        else if (strcmp(flag, "--fwd") == 0) { fwd_text = value; }
        else if (strcmp(flag, "--bwd") == 0) { bwd_text = value; }
        else if (strcmp(flag, "--wgt") == 0) { wgt_text = value; }
        else if (strcmp(flag, "--fb") == 0) { fb_text = value; }
        else if (strcmp(flag, "--transfer") == 0) { transfer = parse_time(flag, value); }
        else if (strcmp(flag, "--comm") == 0) { comm_text = value; }
        else if (strcmp(flag, "--layers") == 0) { layers = parse_int_flag(flag, value, 1); }
        else if (strcmp(flag, "--embed-cost") == 0) { embed_cost = parse_time(flag, value); }
        else if (strcmp(flag, "--head-cost") == 0) { head_cost = parse_time(flag, value); }
        else { svg = value; }
    }
    if (S == 0) { fatal("--stages is required (see --help)"); }
    if (M == 0) { fatal("--microbatches is required (see --help)"); }
    if (schedule == NULL) { fatal("--schedule is required: gpipe, 1f1b, interleaved, zb1, zbv, dualpipev or dualpipe"); }

    char err[512];
    PipelineConfig cfg;
    cfg.num_stages = S;
    cfg.num_microbatches = M;
    if (pipeline_parse_schedule(schedule, &cfg.kind, err, sizeof(err)) != 0) { fatal("--schedule: %s", err); }
    int two_chunks = cfg.kind == PP_INTERLEAVED || cfg.kind == PP_ZBV || cfg.kind == PP_DUALPIPEV || cfg.kind == PP_DUALPIPE;
    cfg.num_chunks = chunks > 0 ? chunks : (two_chunks ? 2 : 1);
    PipelineCommModel comm;
    if (strcmp(comm_text, "eager") == 0) { comm = PP_COMM_EAGER; }
    else if (strcmp(comm_text, "batched") == 0) { comm = PP_COMM_BATCHED; }
    else if (strcmp(comm_text, "rendezvous") == 0) { comm = PP_COMM_RENDEZVOUS; }
    else { fatal("--comm: expected eager, batched or rendezvous, got '%s'", comm_text); }
    PipelineSchedule sch;
    if (pipeline_schedule_build(&sch, &cfg, err, sizeof(err)) != 0) { fatal("%s", err); }
    double* fwd = (double*)malloc_or_die((size_t)S * sizeof(double), "forward times");
    double* bwd = (double*)malloc_or_die((size_t)S * sizeof(double), "backward times");
    parse_times("--fwd", fwd_text, S, fwd);
    parse_times("--bwd", bwd_text, S, bwd);
    double* wgt = (double*)malloc_or_die((size_t)S * sizeof(double), "weight-gradient times");
    for (int s = 0; s < S; s++) { wgt[s] = 0.5 * bwd[s]; }
    if (wgt_text != NULL) { parse_times("--wgt", wgt_text, S, wgt); }
    for (int s = 0; s < S; s++) {
        if (wgt[s] > bwd[s]) {
            fatal("--wgt: stage %d: W (%g) is part of the backward, so it cannot exceed --bwd (%g)", s, wgt[s], bwd[s]);
        }
    }
    double* overlapped = (double*)malloc_or_die((size_t)S * sizeof(double), "F&B times");
    for (int s = 0; s < S; s++) { overlapped[s] = fwd[s] + bwd[s]; }
    if (fb_text != NULL) { parse_times("--fb", fb_text, S, overlapped); }

    int split = pipeline_splits_backward(cfg.kind), with_chunk = cfg.num_chunks > 1;
    if (with_chunk) {
        printf("schedule %s: %d stages, %d microbatches, %d chunks per stage\n", pipeline_schedule_name(cfg.kind), S, M,
               cfg.num_chunks);
    } else {
        printf("schedule %s: %d stages, %d microbatches\n", pipeline_schedule_name(cfg.kind), S, M);
    }
    for (int s = 0; s < S; s++) {
        printf("stage %d:", s);
        for (int i = sch.offset[s]; i < sch.offset[s + 1]; i++) {
            const PipelineAction* a = &sch.actions[i];
            if (!show_actions && !pipeline_is_compute(a->kind)) { continue; }
            char token[32];
            pipeline_action_token(a, with_chunk, token, sizeof(token));
            printf(" %s%s", token, show_actions && a->post_with_next ? "+" : "");
        }
        printf("\n");
    }

    PipelineCosts costs = {fwd, bwd, transfer, comm, wgt, overlapped};
    PipelineTimeline tl;
    if (pipeline_simulate(&sch, &costs, &tl, err, sizeof(err)) != 0) { fatal("%s", err); }
    double modelled = pipeline_bubble_fraction(&cfg), simulated = pipeline_timeline_bubble(&tl);
    const char* formula = cfg.kind == PP_INTERLEAVED ? "(S-1)/(v*M+S-1)"
                        : cfg.kind == PP_ZB1 ? "with F=I=W: 1 - 3M/max(3M+S-1, 2M+2S-1)"
                        : cfg.kind == PP_ZBV ? "with F=I=W: 1 - 6M/max(6M+S-1, 4M+4S-2)"
                        : cfg.kind == PP_DUALPIPEV ? "with F=I=W, F&B=F+B: 1 - 6M/(6M+2(S-1))"
                        : cfg.kind == PP_DUALPIPE ? "with F=I=W, F&B=F+B: (S-2)/(3M+S-2)" : "(S-1)/(M+S-1)";
    printf("bubble fraction, modelled %s: %.4f\n", formula, modelled);
    printf("bubble fraction, simulated (%s sends, transfer %g): %.4f, makespan %g\n", pipeline_comm_model_name(comm),
           transfer, simulated, tl.makespan);
    printf("stage  fwd    bwd    %sbusy      idle      max in flight / bound%s\n", split ? "wgt    " : "",
           with_chunk ? " (microbatch, chunk pairs)" : "");
    for (int s = 0; s < S; s++) {
        int n = sch.offset[s + 1] - sch.offset[s];
        char weight[16] = "";
        if (split) { snprintf(weight, sizeof(weight), "%-5g  ", wgt[s]); }
        printf("%5d  %-5g  %-5g  %s%-8g  %-8g  %d / %d\n", s, fwd[s], bwd[s], weight, tl.busy[s], tl.idle[s],
               pipeline_max_in_flight(sch.actions + sch.offset[s], n), pipeline_memory_bound(&cfg, s));
    }

    if (layers > 0) {
        int parts = S * cfg.num_chunks;
        ChunkPlace* place = (ChunkPlace*)malloc_or_die((size_t)parts * sizeof(ChunkPlace), "layer placement");
        if (pipeline_place_layers(&cfg, layers, embed_cost, head_cost, place, err, sizeof(err)) != 0) {
            fatal("--layers: %s", err);
        }
        printf("layers: %d transformer layers, embedding cost %g, head cost %g (in layers)\n", layers, embed_cost,
               head_cost);
        for (int p = 0; p < parts; p++) {
            const ChunkPlace* c = &place[p];
            char where[64];
            if (with_chunk) {
                snprintf(where, sizeof(where), "stage %d chunk %d (virtual stage %d)", p / cfg.num_chunks,
                         p % cfg.num_chunks, c->virtual_stage);
            } else {
                snprintf(where, sizeof(where), "stage %d", p);
            }
            printf("  %s: ", where);
            if (c->last_layer > c->first_layer) {
                printf("layers %d..%d", c->first_layer, c->last_layer - 1);
            } else {
                printf("no layers");
            }
            printf("%s%s, cost %g\n", c->has_embedding ? " + embedding" : "", c->has_head ? " + head" : "",
                   c->last_layer - c->first_layer + (c->has_embedding ? embed_cost : 0.0) + (c->has_head ? head_cost : 0.0));
        }
        free(place);
    }

    if (svg != NULL) {
        char caption[512], weight[160] = "";
        if (split) { snprintf(weight, sizeof(weight), ", wgt %s", wgt_text != NULL ? wgt_text : "bwd/2"); }
        if (cfg.kind == PP_DUALPIPEV || cfg.kind == PP_DUALPIPE) {
            size_t used = strlen(weight);
            snprintf(weight + used, sizeof(weight) - used, ", F&B %s", fb_text != NULL ? fb_text : "fwd+bwd");
        }
        snprintf(caption, sizeof(caption), "bubble fraction: modelled %s = %.3f; simulated %.3f (makespan %g, "
                 "fwd %s, bwd %s%s, %s sends)", formula, modelled, simulated, tl.makespan, fwd_text, bwd_text, weight,
                 pipeline_comm_model_name(comm));
        write_svg(svg, &sch, &tl, simulated, fwd, bwd, caption);
        printf("wrote %s\n", svg);
    }
    pipeline_timeline_free(&tl);
    pipeline_schedule_free(&sch);
    free(fwd);
    free(bwd);
    free(wgt);
    free(overlapped);
    return 0;
}
