/*
 * tokenize: GPT-2 BPE encoding, decoding and llm.c token files. See usage() or run
 * `dev/data/tokenize --help`.
 *
 * prepare follows llm.c's dev/data/tinyshakespeare.py: the text is split on "\n\n" into
 * sections, each written as <|endoftext|> followed by encode(section + "\n\n") (the last
 * section of a file without the "\n\n"). Files are read in chunks and tokens written as they
 * come, so corpora of any size stream through in bounded memory.
 */
#include <limits.h>

#include "llmc/bpe_encoder.h"
#include "llmc/utils.h"

#define TOKENS_MAGIC 20240520
#define READ_CHUNK (1 << 20)
#define DEFAULT_VAL_TOKENS 32768

static void usage(void) {
    printf(
        "usage: dev/data/tokenize COMMAND [OPTIONS] FILES...\n"
        "\n"
        "commands:\n"
        "  encode FILE     print the GPT-2 token ids of FILE's bytes ('-' = stdin), space-\n"
        "                  separated on one line; no special tokens (text \"<|endoftext|>\" is\n"
        "                  encoded as ordinary text)\n"
        "  decode FILE     read whitespace-separated token ids ('-' = stdin), write their\n"
        "                  bytes to stdout\n"
        "  prepare --out DIR FILES...\n"
        "                  write llm.c token files (header: 256 int32 {20240520, 1, ntokens},\n"
        "                  then uint16 ids). Each FILE is split after every \"\\n\\n\" (blank\n"
        "                  line) into documents; each is written as <|endoftext|> (50256)\n"
        "                  followed by the tokens of its text, \"\\n\\n\" included (llm.c's tiny\n"
        "                  Shakespeare recipe). Files are read in chunks: memory stays\n"
        "                  bounded for a corpus of any size.\n"
        "                  Without --shard-tokens: the first --val-tokens tokens go to\n"
        "                  DIR/NAME_val.bin, the rest to DIR/NAME_train.bin. With it: shards of\n"
        "                  N tokens, DIR/NAME_val_000000.bin first, then NAME_train_000001.bin,\n"
        "                  ... (the last one may be shorter).\n"
        "\n"
        "options:\n"
        "  --encoder PATH        GPT-2 encoder.json  (default: dev/data/gpt2/encoder.json if\n"
        "                        present, else ../shared/data/gpt2/encoder.json; both relative\n"
        "                        to the repository that holds this program)\n"
        "  --bpe PATH            GPT-2 vocab.bpe     (default: found as encoder.json is)\n"
        "  --out DIR             prepare: output directory (created if missing; one level)\n"
        "  --name NAME           prepare: file name prefix (default: the first FILE's name\n"
        "                        without directory and extension)\n"
        "  --val-tokens N        prepare: tokens in NAME_val.bin (default %d)\n"
        "  --shard-tokens N      prepare: write shards of N tokens instead of val + train\n"
        "  --tokenizer-out PATH  prepare: also write llm.c's tokenizer file (gpt2_tokenizer.bin)\n"
        "  -h, --help            this help\n"
        "\n"
        "example (tiny Shakespeare, as `make data` does it):\n"
        "  dev/data/tokenize prepare --out dev/data/tinyshakespeare --name tiny_shakespeare \\\n"
        "      --tokenizer-out gpt2_tokenizer.bin dev/data/tinyshakespeare/input.txt\n",
        DEFAULT_VAL_TOKENS);
}

// ---------------------------------------------------------------------------------------
// command line

typedef struct {
    const char* command;
    const char* encoder;
    const char* bpe;
    const char* out_dir;
    const char* name;
    const char* tokenizer_out;
    long long val_tokens;    // -1: not given
    long long shard_tokens;  // 0: not given
    const char** files;
    int nfiles;
} Args;

static long long parse_count(const char* flag, const char* s) {
    char* end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v <= 0 || v > INT32_MAX) {
        fatal("%s expects a whole number from 1 to %d, got '%s'", flag, INT32_MAX, s);
    }
    return v;
}

static void parse_args(Args* a, int argc, char** argv) {
    memset(a, 0, sizeof(*a));
    a->val_tokens = -1;
    a->files = (const char**)malloc_or_die(argc * sizeof(char*), "arguments");
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) { usage(); exit(0); }
    }
    if (argc < 2) { fatal("no command given: expected encode, decode or prepare (see --help)"); }
    a->command = argv[1];
    int is_prepare = strcmp(a->command, "prepare") == 0;
    if (!is_prepare && strcmp(a->command, "encode") != 0 && strcmp(a->command, "decode") != 0) {
        fatal("unknown command '%s': expected encode, decode or prepare (see --help)", a->command);
    }
    for (int i = 2; i < argc; i++) {
        const char* arg = argv[i];
        if (arg[0] != '-' || strcmp(arg, "-") == 0) { a->files[a->nfiles++] = arg; continue; }
        static const char* const prepare_only[] = {"--out", "--name", "--val-tokens",
                                                   "--shard-tokens", "--tokenizer-out"};
        int known = strcmp(arg, "--encoder") == 0 || strcmp(arg, "--bpe") == 0;
        for (size_t k = 0; k < sizeof(prepare_only) / sizeof(prepare_only[0]); k++) {
            if (strcmp(arg, prepare_only[k]) == 0) {
                if (!is_prepare) { fatal("option %s is only for prepare", arg); }
                known = 1;
            }
        }
        if (!known) { fatal("unknown option '%s' for %s (see --help)", arg, a->command); }
        if (i + 1 >= argc) { fatal("option %s needs a value", arg); }
        const char* v = argv[++i];
        if (strcmp(arg, "--encoder") == 0) { a->encoder = v; }
        else if (strcmp(arg, "--bpe") == 0) { a->bpe = v; }
        else if (strcmp(arg, "--out") == 0) { a->out_dir = v; }
        else if (strcmp(arg, "--name") == 0) { a->name = v; }
        else if (strcmp(arg, "--tokenizer-out") == 0) { a->tokenizer_out = v; }
        else if (strcmp(arg, "--val-tokens") == 0) { a->val_tokens = parse_count(arg, v); }
        else { a->shard_tokens = parse_count(arg, v); }
    }
    if (is_prepare) {
        if (a->out_dir == NULL) { fatal("prepare needs --out DIR"); }
        if (a->nfiles == 0) { fatal("prepare needs at least one input FILE"); }
        if (a->shard_tokens && a->val_tokens >= 0) {
            fatal("--val-tokens and --shard-tokens cannot be combined: with shards, the first "
                  "shard is the validation split");
        }
        if (a->val_tokens < 0) { a->val_tokens = DEFAULT_VAL_TOKENS; }
    } else if (a->nfiles != 1) {
        fatal("%s takes exactly one FILE ('-' for stdin), got %d", a->command, a->nfiles);
    }
}

// Default location of a GPT-2 file: dev/data/gpt2/NAME (where `make data` puts it), else
// ../shared/data/gpt2/NAME, both relative to the repository root (this program lives in
// ROOT/dev/data/), so it works from any current directory. Returns a malloc'ed path.
static char* default_gpt2_path(const char* name, const char* flag) {
    char root[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", root, sizeof(root) - 1);
    root[n > 0 ? n : 0] = '\0';
    for (int up = 0; up < 3 && root[0]; up++) {  // strip "/tokenize", "/data", "/dev"
        char* slash = strrchr(root, '/');
        *(slash ? slash : root) = '\0';
    }
    const char* base = root[0] ? root : ".";
    size_t size = strlen(base) + strlen(name) + 64;
    char* local = (char*)malloc_or_die(size, "path");
    char* shared = (char*)malloc_or_die(size, "path");
    snprintf(local, size, "%s/dev/data/gpt2/%s", base, name);
    snprintf(shared, size, "%s/../shared/data/gpt2/%s", base, name);
    if (file_exists(local)) { free(shared); return local; }
    if (file_exists(shared)) { free(local); return shared; }
    fatal("GPT-2 %s not found (looked for %s and %s): run `make data` or pass %s PATH", name,
          local, shared, flag);
}

// ---------------------------------------------------------------------------------------
// reading input in chunks

typedef struct {
    FILE* f;
    const char* path;
    uint8_t* data;
    size_t len, cap;  // data[0..len) holds unprocessed bytes
    int eof;
} Reader;

static void reader_open(Reader* r, const char* path) {
    memset(r, 0, sizeof(*r));
    r->path = path;
    if (strcmp(path, "-") == 0) {
        r->f = stdin;
    } else {
        struct stat st;
        if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
            fatal("input '%s' is a directory, expected a text file", path);
        }
        r->f = fopen_or_die(path, "rb", "input file");
    }
    r->cap = 2 * READ_CHUNK;
    r->data = (uint8_t*)malloc_or_die(r->cap, "input buffer");
}

// Drops the first `used` bytes, then appends more from the file: READ_CHUNK bytes, or as
// many as are left over when that is more. (Bytes are left over when one pre-token spans the
// chunk; it is scanned again after each read, so reads grow geometrically to keep the total
// work linear.)
static void reader_fill(Reader* r, size_t used) {
    memmove(r->data, r->data + used, r->len - used);
    r->len -= used;
    if (r->eof) { return; }
    size_t want = r->len > READ_CHUNK ? r->len : READ_CHUNK;
    if (r->len + want > r->cap) {
        r->cap = 2 * (r->len + want);
        r->data = (uint8_t*)realloc(r->data, r->cap);
        if (r->data == NULL) { fatal("out of memory reading '%s'", r->path); }
    }
    size_t got = fread(r->data + r->len, 1, want, r->f);
    if (ferror(r->f)) { fatal("cannot read '%s': %s", r->path, strerror(errno)); }
    r->len += got;
    r->eof = got < want && feof(r->f);
}

static void reader_close(Reader* r) {
    if (r->f != stdin) { fclose(r->f); }
    free(r->data);
}

// ---------------------------------------------------------------------------------------
// encode / decode

static void write_stdout(const void* p, size_t n) {
    if (n && fwrite(p, 1, n, stdout) != n) { fatal("cannot write to stdout: %s", strerror(errno)); }
}

// Appends the ids to stdout, space-separated (formatted by hand: printf dominates otherwise).
static void print_ids(const TokenIds* ids, int* first) {
    char buf[1 << 14];
    size_t len = 0;
    for (size_t k = 0; k < ids->n; k++) {
        if (len > sizeof(buf) - 16) { write_stdout(buf, len); len = 0; }
        if (!*first) { buf[len++] = ' '; }
        *first = 0;
        char digits[10];
        int nd = 0;
        uint32_t v = ids->ids[k];
        do { digits[nd++] = (char)('0' + v % 10); v /= 10; } while (v);
        while (nd) { buf[len++] = digits[--nd]; }
    }
    write_stdout(buf, len);
}

static void cmd_encode(BPEEncoder* b, const char* path) {
    Reader r;
    reader_open(&r, path);
    TokenIds ids = {0};
    int first = 1;
    size_t used = 0;
    do {
        reader_fill(&r, used);
        used = bpe_encode(b, r.data, r.len, r.eof, &ids);
        print_ids(&ids, &first);
        ids.n = 0;
    } while (!r.eof || used < r.len);
    write_stdout("\n", 1);
    token_ids_free(&ids);
    reader_close(&r);
}

static void cmd_decode(BPEEncoder* b, const char* path) {
    Reader r;
    reader_open(&r, path);
    size_t offset = 0;  // of r.data[0] in the file
    size_t used = 0;
    do {
        reader_fill(&r, used);
        offset += used;
        used = 0;
        size_t i = 0;
        while (i < r.len) {
            uint8_t c = r.data[i];
            if (isspace(c)) { i++; used = i; continue; }
            size_t start = i;
            uint64_t id = 0;
            for (; i < r.len && r.data[i] >= '0' && r.data[i] <= '9'; i++) {
                if (id <= UINT32_MAX) { id = id * 10 + (r.data[i] - '0'); }  // saturates
            }
            if (i == r.len && !r.eof) { break; }  // the number may go on in the next chunk
            if (i == start || (i < r.len && !isspace(r.data[i]))) {
                fatal("%s: byte offset %zu: expected a token id (digits), got '%c'", path,
                      offset + i, isprint(r.data[i]) ? r.data[i] : '?');
            }
            if (id >= b->vocab_size) {
                fatal("%s: byte offset %zu: token id %.*s is out of range (the vocabulary has "
                      "%u tokens)", path, offset + start, (int)(i - start), r.data + start,
                      b->vocab_size);
            }
            size_t len;
            const uint8_t* bytes = bpe_token(b, (uint32_t)id, &len);
            write_stdout(bytes, len);
            used = i;
        }
    } while (!r.eof || used < r.len);
    reader_close(&r);
}

// ---------------------------------------------------------------------------------------
// prepare: token files

typedef struct {
    AtomicWriter w;
    int64_t ntokens;
} TokenFile;

static void token_file_open(TokenFile* t, const char* dir, const char* name) {
    char path[2048];
    int n = snprintf(path, sizeof(path), "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= sizeof(path)) { fatal("output path too long: '%s/%s'", dir, name); }
    atomic_writer_open(&t->w, path);
    int32_t header[256] = {0};  // rewritten with the token count when the file is finished
    atomic_writer_write(&t->w, header, sizeof(header));
    t->ntokens = 0;
}

static void token_file_write(TokenFile* t, const uint32_t* ids, size_t n) {
    uint16_t buf[4096];
    if (t->ntokens + (int64_t)n > INT32_MAX) {
        fatal("'%s' would hold more than %d tokens, the format's limit: use --shard-tokens",
              t->w.final_path, INT32_MAX);
    }
    for (size_t done = 0; done < n;) {
        size_t k = 0;
        for (; k < 4096 && done < n; k++, done++) { buf[k] = (uint16_t)ids[done]; }
        atomic_writer_write(&t->w, buf, k * sizeof(uint16_t));
    }
    t->ntokens += (int64_t)n;
}

static void token_file_finish(TokenFile* t) {
    int32_t header[256] = {TOKENS_MAGIC, 1, (int32_t)t->ntokens};
    if (fseeko(t->w.f, 0, SEEK_SET) != 0) {
        fatal("cannot seek in '%s': %s", t->w.tmp_path, strerror(errno));
    }
    atomic_writer_write(&t->w, header, sizeof(header));
    atomic_writer_commit(&t->w);
    printf("wrote %lld tokens to %s\n", (long long)t->ntokens, t->w.final_path);
}

static void token_file_discard(TokenFile* t) {
    fclose(t->w.f);
    remove(t->w.tmp_path);
}

// Where prepare's tokens go: val + train files, or a sequence of shards.
typedef struct {
    const Args* args;
    TokenFile val, train;  // val + train mode
    TokenFile shard;       // shard mode: the open shard, if shard_open
    int shard_open, shard_index;
} Sink;

static void sink_write(Sink* s, const uint32_t* ids, size_t n) {
    const Args* a = s->args;
    while (n > 0) {
        size_t k = n;
        if (a->shard_tokens == 0) {
            TokenFile* t = s->val.ntokens < a->val_tokens ? &s->val : &s->train;
            if (t == &s->val && (long long)k > a->val_tokens - s->val.ntokens) {
                k = (size_t)(a->val_tokens - s->val.ntokens);
            }
            token_file_write(t, ids, k);
        } else {
            if (!s->shard_open) {
                char name[1100];
                snprintf(name, sizeof(name), "%s_%s_%06d.bin", a->name,
                         s->shard_index == 0 ? "val" : "train", s->shard_index);
                token_file_open(&s->shard, a->out_dir, name);
                s->shard_open = 1;
            }
            if ((long long)k > a->shard_tokens - s->shard.ntokens) {
                k = (size_t)(a->shard_tokens - s->shard.ntokens);
            }
            token_file_write(&s->shard, ids, k);
            if (s->shard.ntokens == a->shard_tokens) {
                token_file_finish(&s->shard);
                s->shard_open = 0;
                s->shard_index++;
            }
        }
        ids += k;
        n -= k;
    }
}

// Encodes one file as documents (see the top of this file) into the sink.
static void prepare_file(BPEEncoder* b, Sink* sink, const char* path) {
    Reader r;
    reader_open(&r, path);
    TokenIds ids = {0};
    size_t used = 0;   // bytes of r.data already encoded
    size_t scan = 0;   // where to look for the next "\n\n"
    int new_doc = 1;   // the next tokens start a document
    for (;;) {
        reader_fill(&r, used);  // drops the encoded bytes: positions shift down by `used`
        scan -= used;
        used = 0;
        for (;;) {
            if (new_doc) { token_ids_push(&ids, b->eot_token); new_doc = 0; }
            const uint8_t* sep = scan + 1 < r.len
                ? (const uint8_t*)memmem(r.data + scan, r.len - scan, "\n\n", 2) : NULL;
            if (sep) {
                size_t end = (size_t)(sep - r.data) + 2;
                used += bpe_encode(b, r.data + used, end - used, 1, &ids);
                scan = end;
                new_doc = 1;
            } else {
                used += bpe_encode(b, r.data + used, r.len - used, r.eof, &ids);
                // a '\n' at the end may pair with one at the start of the next chunk
                scan = r.len > used + 1 ? r.len - 1 : used;
                break;
            }
        }
        sink_write(sink, ids.ids, ids.n);
        ids.n = 0;
        if (r.eof) { break; }
    }
    token_ids_free(&ids);
    reader_close(&r);
}

// NAME default: the first file's base name without its extension.
static const char* default_name(const char* path) {
    static char name[1024];
    const char* base = strrchr(path, '/');
    snprintf(name, sizeof(name), "%s", base ? base + 1 : path);
    char* dot = strrchr(name, '.');
    if (dot && dot != name) { *dot = '\0'; }
    return name;
}

static void cmd_prepare(BPEEncoder* b, Args* a) {
    if (b->vocab_size > 65536) {
        fatal("the vocabulary has %u tokens: ids >= 65536 cannot be stored as uint16 in llm.c "
              "token files", b->vocab_size);
    }
    for (int k = 0; k < a->nfiles; k++) {  // fail before writing anything
        struct stat st;
        if (stat(a->files[k], &st) != 0) {
            fatal("cannot open input file '%s': %s", a->files[k], strerror(errno));
        }
        if (S_ISDIR(st.st_mode)) {
            fatal("input '%s' is a directory, expected a text file", a->files[k]);
        }
    }
    if (a->name == NULL) { a->name = default_name(a->files[0]); }
    if (a->name[0] == '\0' || strchr(a->name, '/')) {
        fatal("--name must be a non-empty file name prefix without '/', got '%s'", a->name);
    }
    ensure_writable_dir(a->out_dir, "--out");
    if (a->tokenizer_out) {
        bpe_write_tokenizer_file(b, a->tokenizer_out);
        printf("wrote the tokenizer (%u tokens) to %s\n", b->vocab_size, a->tokenizer_out);
    }

    Sink sink = {.args = a};
    if (a->shard_tokens == 0) {
        char name[1100];
        snprintf(name, sizeof(name), "%s_val.bin", a->name);
        token_file_open(&sink.val, a->out_dir, name);
        snprintf(name, sizeof(name), "%s_train.bin", a->name);
        token_file_open(&sink.train, a->out_dir, name);
    }
    for (int k = 0; k < a->nfiles; k++) { prepare_file(b, &sink, a->files[k]); }
    if (a->shard_tokens == 0) {
        if (sink.train.ntokens == 0) {
            int64_t total = sink.val.ntokens;
            token_file_discard(&sink.val);
            token_file_discard(&sink.train);
            fatal("the input has only %lld tokens: not more than --val-tokens %lld, so nothing "
                  "is left for training", (long long)total, a->val_tokens);
        }
        token_file_finish(&sink.val);
        token_file_finish(&sink.train);
    } else if (sink.shard_open) {
        token_file_finish(&sink.shard);
    }
}

int main(int argc, char** argv) {
    Args a;
    parse_args(&a, argc, argv);
    char* encoder = a.encoder ? strdup(a.encoder) : default_gpt2_path("encoder.json", "--encoder");
    char* bpe = NULL;  // decoding needs no merges
    if (strcmp(a.command, "decode") != 0) {
        bpe = a.bpe ? strdup(a.bpe) : default_gpt2_path("vocab.bpe", "--bpe");
    }
    BPEEncoder b;
    bpe_init(&b, encoder, bpe);
    free(encoder);
    free(bpe);
    if (strcmp(a.command, "encode") == 0) { cmd_encode(&b, a.files[0]); }
    else if (strcmp(a.command, "decode") == 0) { cmd_decode(&b, a.files[0]); }
    else { cmd_prepare(&b, &a); }
    if (fflush(stdout) != 0) { fatal("cannot write to stdout: %s", strerror(errno)); }
    bpe_free(&b);
    free(a.files);
    return 0;
}
