/*
 * test_tokenizer: unit tests of llmc/tokenizer.h and llmc/bpe_encoder.h. Run from the repository
 * root.
 *
 *  - Unicode tables and UTF-8 decoding; GPT-2's byte-to-unicode alphabet
 *  - pre-token splits, worked out from the regex by hand
 *  - encode cases with ids worked out by hand from GPT-2's rules, vocab.bpe and encoder.json
 *  - merge semantics on a tiny made-up vocabulary
 *  - round trips: random bytes (mostly invalid UTF-8), streaming (at_end = 0) == one shot
 *  - the tokenizer file: write, read back all ids; bad files end in one clear error
 *  - bad encoder.json / vocab.bpe end in one clear error naming the file and place
 *
 * GPT-2's files come from dev/data/gpt2/ (`make data`), else ../shared/data/gpt2/; without
 * either, the tests that need them print SKIP and the rest still run.
 */
#include <sys/wait.h>

#include "llmc/bpe_encoder.h"

static int failures = 0;

#define CHECK(cond, ...)                                                      \
    do {                                                                      \
        if (!(cond)) {                                                        \
            failures++;                                                       \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);              \
            fprintf(stderr, __VA_ARGS__);                                     \
            fputc('\n', stderr);                                              \
        }                                                                     \
    } while (0)

static void print_ids(const char* label, const uint32_t* ids, size_t n) {
    fprintf(stderr, "    %s:", label);
    for (size_t i = 0; i < n; i++) { fprintf(stderr, " %u", ids[i]); }
    fputc('\n', stderr);
}

static void write_file(const char* path, const void* data, size_t n) {
    FILE* f = fopen_or_die(path, "wb", "test file");
    fwrite_or_die(data, 1, n, f, path);
    fclose(f);
}

// Deterministic random numbers (xorshift64*), so a failure reproduces.
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rng(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}

// Runs fn(arg) in a child process and checks that it dies with exit code 1 and one stderr
// line "error: ..." that contains `expected`.
static void expect_fatal(const char* what, void (*fn)(const void*), const void* arg,
                         const char* expected) {
    int fds[2];
    if (pipe(fds) != 0) { fatal("pipe: %s", strerror(errno)); }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) { fatal("fork: %s", strerror(errno)); }
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], 2);
        fn(arg);
        _exit(0);  // fn returned: no error
    }
    close(fds[1]);
    char out[4096];
    size_t n = 0;
    ssize_t got;
    while ((got = read(fds[0], out + n, sizeof(out) - 1 - n)) > 0) { n += (size_t)got; }
    close(fds[0]);
    out[n] = '\0';
    int status;
    waitpid(pid, &status, 0);
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    char* newline = strchr(out, '\n');
    int one_line = newline != NULL && newline[1] == '\0';
    CHECK(code == 1 && strncmp(out, "error: ", 7) == 0 && one_line && strstr(out, expected),
          "%s: expected exit 1 and one line 'error: ...%s...', got exit %d and: %s", what,
          expected, code, out);
}

// ---------------------------------------------------------------------------------------

static void test_unicode_tables(void) {
    for (size_t i = 0; i < UNICODE_CLASS_RANGES; i++) {
        const UnicodeRange* r = &unicode_class_ranges[i];
        CHECK(r->first <= r->last && r->last <= 0x10FFFF && r->cls != UC_OTHER,
              "range %zu is malformed", i);
        CHECK(i == 0 || unicode_class_ranges[i - 1].last < r->first,
              "ranges %zu and %zu are not sorted and disjoint", i - 1, i);
    }
    // The ASCII table must agree with the ranges.
    for (uint32_t cp = 0; cp < 128; cp++) {
        int from_ranges = UC_OTHER;
        for (size_t i = 0; i < UNICODE_CLASS_RANGES; i++) {
            if (cp >= unicode_class_ranges[i].first && cp <= unicode_class_ranges[i].last) {
                from_ranges = unicode_class_ranges[i].cls;
            }
        }
        CHECK(unicode_ascii_class[cp] == from_ranges, "ASCII class of U+%04X", cp);
    }
    static const struct { uint32_t cp; int cls; const char* why; } cases[] = {
        {'a', UC_LETTER, "Ll"}, {'Z', UC_LETTER, "Lu"}, {'7', UC_NUMBER, "Nd"},
        {'_', UC_OTHER, "Pc"}, {'\'', UC_OTHER, "Po"}, {' ', UC_SPACE, "Zs"},
        {'\t', UC_SPACE, "bidi S"}, {'\n', UC_SPACE, "bidi B"}, {0x0B, UC_SPACE, "bidi S"},
        {0x0C, UC_SPACE, "bidi WS"}, {'\r', UC_SPACE, "bidi B"},
        {0x1C, UC_SPACE, "bidi B: str.isspace() is true for U+001C..U+001F"},
        {0x1F, UC_SPACE, "bidi S"}, {0x7F, UC_OTHER, "Cc"}, {0x85, UC_SPACE, "bidi B"},
        {0xA0, UC_SPACE, "Zs"}, {0xAD, UC_OTHER, "Cf"}, {0xAA, UC_LETTER, "Lo"},
        {0xB2, UC_NUMBER, "No"}, {0xBD, UC_NUMBER, "No"}, {0xE9, UC_LETTER, "Ll"},
        {0x01C5, UC_LETTER, "Lt"}, {0x02B0, UC_LETTER, "Lm"}, {0x0301, UC_OTHER, "Mn"},
        {0x0627, UC_LETTER, "Lo (Arabic alef)"}, {0x0661, UC_NUMBER, "Nd (Arabic-Indic one)"},
        {0x06F1, UC_NUMBER, "Nd (extended Arabic-Indic)"}, {0x0967, UC_NUMBER, "Nd (Devanagari)"},
        {0x1680, UC_SPACE, "Zs"}, {0x180E, UC_OTHER, "Cf since Unicode 6.3"},
        {0x2000, UC_SPACE, "Zs"}, {0x200A, UC_SPACE, "Zs"}, {0x200B, UC_OTHER, "Cf"},
        {0x2028, UC_SPACE, "Zl"}, {0x2029, UC_SPACE, "Zp"}, {0x202F, UC_SPACE, "Zs"},
        {0x205F, UC_SPACE, "Zs"}, {0x2160, UC_NUMBER, "Nl (Roman numeral)"},
        {0x2460, UC_NUMBER, "No (circled one)"}, {0x3000, UC_SPACE, "Zs"},
        {0x3007, UC_NUMBER, "Nl"}, {0x3042, UC_LETTER, "Lo (hiragana)"},
        {0x4E00, UC_LETTER, "Lo (CJK, in a First/Last range)"},
        {0x9FFF, UC_LETTER, "Lo (CJK, last of the block)"},
        {0xAC00, UC_LETTER, "Lo (Hangul, in a First/Last range)"}, {0xD7A3, UC_LETTER, "Lo"},
        {0xE000, UC_OTHER, "Co"}, {0xFEFF, UC_OTHER, "Cf"}, {0xFFFD, UC_OTHER, "So"},
        {0x1D400, UC_LETTER, "Lu (math bold A)"}, {0x1F600, UC_OTHER, "So (emoji)"},
        {0x1F3FD, UC_OTHER, "Sk"}, {0x20000, UC_LETTER, "Lo (CJK extension B)"},
        {0x31350, UC_LETTER, "Lo (CJK extension H, new in Unicode 15.0)"},
        {0xE0001, UC_OTHER, "Cf"}, {0x10FFFF, UC_OTHER, "Cn"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        CHECK(unicode_class(cases[i].cp) == cases[i].cls, "class of U+%04X (%s): got %d want %d",
              cases[i].cp, cases[i].why, unicode_class(cases[i].cp), cases[i].cls);
    }
}

static void test_utf8(void) {
    static const struct { const char* s; int len; uint32_t cp; } cases[] = {
        {"A", 1, 'A'}, {"\xC2\x80", 2, 0x80}, {"\xDF\xBF", 2, 0x7FF},
        {"\xE0\xA0\x80", 3, 0x800}, {"\xED\x9F\xBF", 3, 0xD7FF}, {"\xEE\x80\x80", 3, 0xE000},
        {"\xEF\xBF\xBF", 3, 0xFFFF}, {"\xF0\x90\x80\x80", 4, 0x10000},
        {"\xF4\x8F\xBF\xBF", 4, 0x10FFFF},
        {"\x80", 0, 0},              // continuation byte without a lead
        {"\xC0\x80", 0, 0},          // overlong NUL
        {"\xC1\xBF", 0, 0},          // overlong
        {"\xE0\x9F\xBF", 0, 0},      // overlong 3-byte
        {"\xED\xA0\x80", 0, 0},      // UTF-16 surrogate D800
        {"\xF0\x8F\xBF\xBF", 0, 0},  // overlong 4-byte
        {"\xF4\x90\x80\x80", 0, 0},  // beyond U+10FFFF
        {"\xF5\x80\x80\x80", 0, 0}, {"\xFF", 0, 0},
        {"\xC3", 0, 0},              // truncated at the end of the text
        {"\xE6\x97", 0, 0}, {"\xC3" "A", 0, 0}, {"\xE6\x97" "A", 0, 0},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        uint32_t cp = 0;
        int len = utf8_decode((const uint8_t*)cases[i].s, strlen(cases[i].s), 0, &cp);
        CHECK(len == cases[i].len && (len == 0 || cp == cases[i].cp),
              "utf8_decode case %zu: got len %d cp U+%04X", i, len, cp);
    }
}

// encoder.py's bytes_to_unicode(), built the way it is written there.
static void test_byte_alphabet(void) {
    int bs[256], cs[256], nb = 0;
    for (int b = '!'; b <= '~'; b++) { bs[nb++] = b; }
    for (int b = 0xA1; b <= 0xAC; b++) { bs[nb++] = b; }
    for (int b = 0xAE; b <= 0xFF; b++) { bs[nb++] = b; }
    for (int k = 0; k < nb; k++) { cs[k] = bs[k]; }
    int n = 0, listed = nb;
    for (int b = 0; b < 256; b++) {
        int in = 0;
        for (int k = 0; k < listed; k++) { in |= bs[k] == b; }
        if (!in) { bs[nb] = b; cs[nb] = 256 + n++; nb++; }
    }
    CHECK(nb == 256 && n == 68, "bytes_to_unicode has %d entries, %d shifted", nb, n);
    int hits = 0;
    for (uint32_t cp = 0; cp < 0x400; cp++) {
        int want = -1;
        for (int k = 0; k < 256; k++) { if ((uint32_t)cs[k] == cp) { want = bs[k]; } }
        CHECK(bpe_unicode_to_byte(cp) == want, "alphabet: U+%04X should stand for %d, got %d", cp,
              want, bpe_unicode_to_byte(cp));
        hits += want >= 0;
    }
    CHECK(hits == 256, "alphabet covers %d bytes", hits);
}

// Pre-token splits, from the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// Each case: the text, then its pre-tokens.
static void test_pretokenizer(void) {
    static const struct { const char* text; const char* pieces[6]; } cases[] = {
        // ' ?\p{L}+' takes one leading space
        {"Hello world", {"Hello", " world"}},
        // \s+(?!\S) stops before the run's last space, which then joins the next word
        {"a   b", {"a", "  ", " b"}},
        {"a \t b", {"a", " \t", " b"}},
        // at the end of the text a run is kept whole
        {"trailing   ", {"trailing", "   "}},
        {"\t\n", {"\t\n"}},
        {"x \n", {"x", " \n"}},
        // the run gives back "\n"; that is not ' ', so it stands alone (\s+)
        {"a\r\nb", {"a", "\r", "\n", "b"}},
        // ' ?[^\s\p{L}\p{N}]+' takes one leading space too
        {"x  !", {"x", " ", " !"}},
        {"x !!", {"x", " !!"}},
        // contractions: lowercase only, no word boundary needed around them
        {"don't", {"don", "'t"}}, {"I'll", {"I", "'ll"}}, {"they're", {"they", "'re"}},
        {"we've", {"we", "'ve"}}, {"I'm", {"I", "'m"}}, {"she'd", {"she", "'d"}},
        {"it's", {"it", "'s"}}, {"DON'T", {"DON", "'", "T"}}, {"IT'S", {"IT", "'", "S"}},
        {"'sx", {"'s", "x"}}, {"'re'", {"'re", "'"}}, {"'x", {"'", "x"}}, {"'", {"'"}},
        // not at the start of a pre-token: the space or a run of others takes the "'"
        {" 's", {" '", "s"}},
        {"?'s", {"?'", "s"}},
        // letters, numbers and others each form their own runs
        {"3.14", {"3", ".", "14"}}, {"abc123def", {"abc", "123", "def"}}, {" 42", {" 42"}},
        {"<|endoftext|>", {"<|", "endoftext", "|>"}},
        {"caf\xC3\xA9 ok", {"caf\xC3\xA9", " ok"}},          // é (Ll) is a letter
        {"cafe\xCC\x81", {"cafe", "\xCC\x81"}},             // combining U+0301 (Mn) is not
        {"\xD9\xA1\xD9\xA2x", {"\xD9\xA1\xD9\xA2", "x"}},   // Arabic-Indic digits are \p{N}
        {"\xF0\x9F\x98\x80!", {"\xF0\x9F\x98\x80!"}},       // an emoji is "other", like '!'
        // Unicode whitespace is \s, but only ' ' can prefix a word
        {"a\xE3\x80\x80" "b", {"a", "\xE3\x80\x80", "b"}},                    // U+3000
        {"a\xE3\x80\x80\xE3\x80\x80" "b", {"a", "\xE3\x80\x80", "\xE3\x80\x80", "b"}},
        {"x\xC2\xA0" "y", {"x", "\xC2\xA0", "y"}},                            // NBSP
        {"x\x1C\x1Cy", {"x", "\x1C", "\x1C", "y"}},                           // U+001C
        // invalid UTF-8: each bad byte is one character of class "other"
        {"a\xFF\xFE" "b", {"a", "\xFF\xFE", "b"}},
        {" \xFF", {" \xFF"}},
        {"ab\xC3", {"ab", "\xC3"}},               // a character cut off by the end of the text
        {"\xC3\xA9\xA9", {"\xC3\xA9", "\xA9"}},   // é, then a stray continuation byte
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const uint8_t* s = (const uint8_t*)cases[c].text;
        size_t n = strlen(cases[c].text), i = 0;
        int ok = 1;
        for (int k = 0; ok && cases[c].pieces[k]; k++) {
            size_t want = strlen(cases[c].pieces[k]);
            ok = i < n && bpe_pretoken_end(s, n, i) == i + want &&
                 memcmp(s + i, cases[c].pieces[k], want) == 0;
            CHECK(ok, "pre-token %d of case %zu ('%s') should be '%s', it ends at %zu", k, c,
                  cases[c].text, cases[c].pieces[k], i < n ? bpe_pretoken_end(s, n, i) : n);
            i += want;
        }
        CHECK(!ok || i == n, "case %zu ('%s'): pre-tokens left over at byte %zu", c,
              cases[c].text, i);
    }
}

// ---------------------------------------------------------------------------------------
// encoding with GPT-2's files

typedef struct {
    const char* text;
    uint32_t ids[8];
    size_t n;
    const char* why;
} EncodeCase;

#define IDS(...) {__VA_ARGS__}, sizeof((uint32_t[]){__VA_ARGS__}) / sizeof(uint32_t)

// Worked out by hand: the pre-tokens (test_pretokenizer), their bytes in GPT-2's alphabet,
// the merges that apply (vocab.bpe rank = line number - 2) and the ids in encoder.json.
static const EncodeCase encode_cases[] = {
    {"caf\xC3\xA9", IDS(66, 1878, 2634),
     "one \\p{L}+ pre-token, bytes 63 61 66 C3 A9 = 'cafÃ©'; merges a+f (1622), Ã+© (2378); "
     "(c,af) and (af,Ã©) have no merge: c=66 af=1878 Ã©=2634"},
    {" caf\xC3\xA9", IDS(40304),
     "' ?\\p{L}+' keeps the space: 'ĠcafÃ©'; Ġ+c (13), Ġc+a (1019), Ã+© (2378), Ġca+f "
     "(19689), Ġcaf+Ã© (40048) -> ĠcafÃ©=40304"},
    {"cafe\xCC\x81", IDS(66, 8635, 136, 223),
     "decomposed é: 'cafe' then U+0301 (Mn, not a letter) alone; a+f, af+e (8379) -> c=66 "
     "afe=8635; CC 81 = 'Ìģ' has no merge: Ì=136 ģ=223"},
    {"na\xC3\xAFve", IDS(2616, 38776),
     "'naÃ¯ve': v+e (47), n+a (2360), Ã+¯ (26628), Ã¯+ve (38520); (na,Ã¯ve) no merge"},
    {"\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E", IDS(33768, 98, 17312, 105, 45739, 252),
     "日本語 (Lo) is one pre-token; E6 97 A5 E6 9C AC E8 AA 9E = 'æĹ¥æľ¬èªŀ'; æ+ľ (17056), "
     "æ+Ĺ (33512), è+ª (45483); nothing merges with ¥ ¬ ŀ"},
    {"\xD9\x85\xD8\xB1\xD8\xAD\xD8\xA8\xD8\xA7", IDS(25405, 26897, 148, 255, 39848, 12919),
     "مرحبا (Lo): 'ÙħØ±ØŃØ¨Ø§'; Ø+§ (12663), Ù+ħ (25149), Ø+± (26641), Ø+¨ (39592); "
     "Ø+Ń has no merge: Ø=148 Ń=255"},
    {"\xF0\x9F\x98\x80", IDS(47249, 222),
     "😀 is 'other': 'ðŁĺĢ'; ð+Ł (8326), ðŁ+ĺ (46993); then Ģ (byte 80) = 222"},
    {"\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD", IDS(41840, 235, 8582, 237, 121),
     "👍🏽: both code points are 'other' (So, Sk), one pre-token 'ðŁĳįðŁı½' -> ðŁĳ į ðŁ ı ½"},
    {"\xD9\xA1\xD9\xA2\xD9\xA3", IDS(149, 94, 149, 95, 149, 96),
     "١٢٣ (Nd) is one \\p{N}+ pre-token; D9 A1 D9 A2 D9 A3 = 'Ù¡Ù¢Ù£', no pair merges"},
    {"x\xD9\xA1\xD9\xA2", IDS(87, 149, 94, 149, 95),
     "letter then Arabic-Indic digits: two pre-tokens 'x' and 'Ù¡Ù¢'"},
    {"x\xC2\xB2", IDS(87, 31185), "² (No) is a number: 'x' then 'Â²'=31185"},
    {"a\xE2\x85\xAB", IDS(64, 158, 227, 104), "Ⅻ (Nl) is a number: 'a' then 'âħ«', no merges"},
    {" 42", IDS(5433), "' ?\\p{N}+': Ġ+4 (348), Ġ4+2 (5177) -> Ġ42"},
    {"123456", IDS(10163, 29228),
     "one digit run; 1+2 (809), 4+5 (1975), 12+3 (9907), 45+6 (28972) -> 123 456"},
    {"a   b", IDS(64, 220, 220, 275),
     "'a', '  ' (the run gives back its last space), ' b'; vocab.bpe has no Ġ+Ġ: Ġ=220 twice; "
     "Ġ+b (19) -> Ġb=275"},
    {"hi  ", IDS(5303, 220, 220), "trailing spaces: the run at the end stays whole: 'hi', 'ĠĠ'"},
    {"\t\n", IDS(197, 198), "one whitespace pre-token 'ĉĊ', no merge: ĉ=197 Ċ=198"},
    {"\r\n", IDS(201, 198), "one whitespace pre-token 'čĊ', no merge: č=201 Ċ=198"},
    {"a\r\nb", IDS(64, 201, 198, 65),
     "'\\r\\n' before 'b' splits into '\\r' and '\\n' (the given-back char is not ' ')"},
    {"x  \ty", IDS(87, 220, 220, 197, 88), "run '  \\t' gives back the tab: 'ĠĠ', 'ĉ', 'y'"},
    {" \n", IDS(220, 198), "one whitespace pre-token 'ĠĊ', no merge"},
    {"x\xC2\xA0y", IDS(87, 1849, 88), "NBSP is \\s: 'x', 'Âł'=1849, 'y'"},
    {"x\x1C\x1Cy", IDS(87, 216, 216, 88),
     "U+001C is \\s for Python (str.isspace): the run gives back one: 'Ĝ', 'Ĝ'"},
    {"  \xC2\xA0x", IDS(220, 220, 1849, 87),
     "run '  NBSP' gives back NBSP (not ' '): 'ĠĠ', 'Âł', 'x'"},
    {"a\xE3\x80\x80" "b", IDS(64, 5099, 222, 65),
     "U+3000 is \\s: 'a', E3 80 80 = 'ãĢĢ' -> ã+Ģ (4843) = ãĢ, Ģ; 'b'"},
    {"don't", IDS(9099, 470), "'don' (o+n 5, d+on 8843) + contraction 't (' + t 214)"},
    {"I'll", IDS(40, 1183), "'I' + contraction 'll (l+l 41, '+ll 927)"},
    {"they're", IDS(9930, 821), "'they' (h+e, t+he, the+y) + contraction 're (r+e, '+re)"},
    {"it's", IDS(270, 338), "'it' + 's"},
    {"we've", IDS(732, 1053), "'we' + 've"},
    {"I'm", IDS(40, 1101), "'I' + 'm"},
    {"she'd", IDS(7091, 1549), "'she' + 'd"},
    {"DON'T", IDS(41173, 6, 51), "no uppercase contractions: 'DON', \"'\", 'T'"},
    {" hello", IDS(23748), "space before a letter: one pre-token 'Ġhello'"},
    {" !", IDS(5145), "space before punctuation: ' ?[^\\s\\p{L}\\p{N}]+' -> 'Ġ!' (Ġ+! 4889)"},
    {"x  !", IDS(87, 220, 5145),
     "'x'; the run '  ' gives back its last space, which ' ?[^\\s..]+' takes with '!': 'Ġ' 'Ġ!'"},
    {"x 's", IDS(87, 705, 82), "' 's' is not a contraction at the space: 'Ġ'' (449) then 's'"},
    {"Hello, world!", IDS(15496, 11, 995, 0), "'Hello' ',' ' world' '!'"},
    {"<|endoftext|>", IDS(27, 91, 437, 1659, 5239, 91, 29),
     "ordinary text, never 50256: '<|' 'endoftext' '|>'; no '<'+'|' merge; endoftext -> end of "
     "text"},
    {"hahaha", IDS(71, 993, 12236),
     "a+h (737) is the lowest pair and merges at both places: h ah ah a; then ah+a (11980) "
     "-> h ah aha (h+a is 2843, never reached)"},
    {"a\xFF" "b", IDS(64, 187, 65), "invalid byte FF is an 'other' character: 'a', 'ÿ'=187, 'b'"},
    {" \xFF\xFE", IDS(220, 187, 186), "' ?[^...]+' takes space and two invalid bytes; no merges"},
    {"caf\xC3", IDS(66, 1878, 127),
     "truncated é at the end: 'caf' (c, af), then C3 alone = 'Ã'=127"},
    {"\xC0\xAF", IDS(124, 107), "overlong '/': two invalid bytes, 'À'=124 '¯'=107, no merge"},
    {"\xED\xA0\x80", IDS(169, 254, 222), "encoded surrogate: three invalid bytes 'í' 'ł' 'Ģ'"},
    {"\xC3\xA9\xA9", IDS(2634, 102), "'é' then a stray continuation byte A9 = '©'=102"},
};

static void test_encode_cases(BPEEncoder* b) {
    for (size_t k = 0; k < sizeof(encode_cases) / sizeof(encode_cases[0]); k++) {
        const EncodeCase* c = &encode_cases[k];
        size_t want_n = c->n;
        TokenIds ids = {0};
        bpe_encode(b, (const uint8_t*)c->text, strlen(c->text), 1, &ids);
        int ok = ids.n == want_n && memcmp(ids.ids, c->ids, want_n * sizeof(uint32_t)) == 0;
        CHECK(ok, "encode case %zu (%s)", k, c->why);
        if (!ok) {
            print_ids("got ", ids.ids, ids.n);
            print_ids("want", c->ids, want_n);
        }
        token_ids_free(&ids);
    }
}

// Streaming: feeding text in pieces with at_end = 0 gives the same ids as one call.
static void check_stream(BPEEncoder* b, const uint8_t* text, size_t n, const char* what) {
    TokenIds whole = {0}, parts = {0};
    bpe_encode(b, text, n, 1, &whole);
    size_t done = 0, avail = 0;
    while (avail < n) {
        avail += 1 + rng() % 64;
        if (avail > n) { avail = n; }
        done += bpe_encode(b, text + done, avail - done, 0, &parts);
    }
    done += bpe_encode(b, text + done, n - done, 1, &parts);
    int same = done == n && whole.n == parts.n &&
               (n == 0 || memcmp(whole.ids, parts.ids, whole.n * sizeof(uint32_t)) == 0);
    CHECK(same, "%s: streaming encode differs from one-shot encode", what);
    // and the bytes come back
    size_t off = 0;
    int round_trip = 1;
    for (size_t k = 0; k < whole.n && round_trip; k++) {
        size_t len;
        const uint8_t* bytes = bpe_token(b, whole.ids[k], &len);
        round_trip = off + len <= n && memcmp(text + off, bytes, len) == 0;
        CHECK(whole.ids[k] != b->eot_token, "%s: encode produced <|endoftext|>", what);
        off += len;
    }
    CHECK(round_trip && off == n, "%s: decode(encode(x)) != x", what);
    token_ids_free(&whole);
    token_ids_free(&parts);
}

static void test_round_trips(BPEEncoder* b) {
    static const size_t sizes[] = {0, 1, 2, 3, 4, 5, 16, 100, 1000, 65536};
    uint8_t* buf = (uint8_t*)malloc_or_die(65536, "random bytes");
    // Random bytes: mostly invalid UTF-8.
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        for (int rep = 0; rep < 20; rep++) {
            for (size_t i = 0; i < sizes[s]; i++) { buf[i] = (uint8_t)rng(); }
            char what[64];
            snprintf(what, sizeof(what), "random bytes, size %zu", sizes[s]);
            check_stream(b, buf, sizes[s], what);
        }
    }
    // Random pieces that exercise every pre-token rule and UTF-8 at chunk edges.
    static const char* pieces[] = {" ", "  ", "\t", "\n", "\r\n", "\xC2\xA0", "\xE3\x80\x80",
                                   "a", "Zz", "\xC3\xA9", "\xE6\x97\xA5", "1", "\xD9\xA1", "!",
                                   "'s", "'ll", "'", "\xF0\x9F\x98\x80", "\xFF", "\xC3", "\x80",
                                   "\xED\xA0\x80", "\x1C"};
    size_t npieces = sizeof(pieces) / sizeof(pieces[0]);
    for (int rep = 0; rep < 200; rep++) {
        size_t n = 0, target = rng() % 2000;
        while (n < target) {
            const char* p = pieces[rng() % npieces];
            size_t len = strlen(p);
            if (n + len > 65536) { break; }
            memcpy(buf + n, p, len);
            n += len;
        }
        check_stream(b, buf, n, "random pieces");
    }
    free(buf);
}

static void test_tokenizer_file(BPEEncoder* b) {
    const char* path = "build/test_tokenizer.bin";
    bpe_write_tokenizer_file(b, path);
    Tokenizer t;
    tokenizer_init(&t, path);
    CHECK(t.init_ok && t.vocab_size == 50257 && t.eot_token == 50256,
          "tokenizer file: init_ok %d vocab %u eot %d", t.init_ok, t.vocab_size, t.eot_token);
    for (uint32_t id = 0; t.init_ok && id < t.vocab_size; id++) {
        size_t len;
        const uint8_t* want = bpe_token(b, id, &len);
        const char* got = tokenizer_decode(&t, id);
        // token bytes may contain NUL (id 188 is the byte 00): compare len bytes + terminator
        CHECK(got && memcmp(got, want, len) == 0 && got[len] == '\0', "tokenizer file: id %u", id);
    }
    CHECK(strcmp(tokenizer_decode(&t, 50256), "<|endoftext|>") == 0, "id 50256");
    CHECK(strcmp(tokenizer_decode(&t, 40304), " caf\xC3\xA9") == 0, "id 40304");
    CHECK(tokenizer_decode(&t, 50257) == NULL, "id 50257 is out of range");
    tokenizer_free(&t);
}

// ---------------------------------------------------------------------------------------
// bad files

static void run_tokenizer_init(const void* path) {
    Tokenizer t;
    tokenizer_init(&t, (const char*)path);
}

typedef struct { const char* encoder; const char* merges; } BPEPaths;

static void run_bpe_init(const void* arg) {
    const BPEPaths* p = (const BPEPaths*)arg;
    BPEEncoder b;
    bpe_init(&b, p->encoder, p->merges);
}

static void test_bad_tokenizer_files(void) {
    // A small valid version-2 file: 3 tokens, eot 2; then broken copies of it.
    uint32_t header[256] = {TOKENIZER_MAGIC, 2, 3, 2};
    uint8_t body[] = {1, 'a', 2, 'b', 'c', 3, 'x', 'y', 'z'};
    uint8_t file[sizeof(header) + sizeof(body) + 1];
    memcpy(file, header, sizeof(header));
    memcpy(file + sizeof(header), body, sizeof(body));
    const char* path = "build/test_tokenizer_small.bin";
    write_file(path, file, sizeof(header) + sizeof(body));
    Tokenizer t;
    tokenizer_init(&t, path);
    CHECK(t.init_ok && t.vocab_size == 3 && t.eot_token == 2 &&
          strcmp(tokenizer_decode(&t, 1), "bc") == 0, "small version-2 tokenizer file");
    tokenizer_free(&t);

    write_file(path, file, sizeof(header) + sizeof(body) - 1);
    expect_fatal("truncated token", run_tokenizer_init, path, "truncated or corrupt at token 2");
    write_file(path, file, 100);
    expect_fatal("truncated header", run_tokenizer_init, path, "truncated");
    file[sizeof(header) + sizeof(body)] = 'q';
    write_file(path, file, sizeof(header) + sizeof(body) + 1);
    expect_fatal("trailing bytes", run_tokenizer_init, path, "bytes after its 3 tokens");
    ((uint32_t*)file)[0] = 20240520;  // a token file's magic, not a tokenizer's
    write_file(path, file, sizeof(header) + sizeof(body));
    expect_fatal("wrong magic", run_tokenizer_init, path, "magic 20240520, expected 20240328");
    ((uint32_t*)file)[0] = TOKENIZER_MAGIC;
    ((uint32_t*)file)[1] = 3;
    write_file(path, file, sizeof(header) + sizeof(body));
    expect_fatal("bad version", run_tokenizer_init, path, "version 3, expected 1 or 2");
    ((uint32_t*)file)[1] = 1;
    write_file(path, file, sizeof(header) + sizeof(body));
    expect_fatal("version 1, eot 50256 >= vocab", run_tokenizer_init, path, "eot token 50256");
    ((uint32_t*)file)[1] = 2;
    file[sizeof(header)] = 0;  // a zero-length token
    write_file(path, file, sizeof(header) + sizeof(body));
    expect_fatal("empty token", run_tokenizer_init, path, "at token 0");
    remove(path);

    // A missing file is not an error: the trainer prints ids instead.
    tokenizer_init(&t, "build/no_such_tokenizer.bin");
    CHECK(!t.init_ok && tokenizer_decode(&t, 0) == NULL, "missing tokenizer file");
    tokenizer_free(&t);
}

static void test_bad_encoder_files(const char* encoder_path) {
    static const struct { const char* json; const char* expected; } cases[] = {
        {"", "byte offset 0: expected '{'"},
        {"[1, 2]", "byte offset 0: expected '{'"},
        {"{\"a\": 1,}", "byte offset 8: expected '\"'"},
        {"{\"a\": 1", "byte offset 7: expected ',' or '}'"},
        {"{\"a\" 1}", "byte offset 5: expected ':'"},
        {"{\"a\": -1}", "byte offset 6: expected a token id"},
        {"{\"a\": 1.5}", "byte offset 6: expected a token id"},
        {"{\"a\": 01}", "byte offset 6: expected a token id"},
        {"{\"a\": 99999999999}", "byte offset 6: expected a token id"},
        {"{\"\\q\": 0}", "byte offset 2: expected an escape"},
        {"{\"\\u12G4\": 0}", "byte offset 6: expected 4 hex digits"},
        {"{\"\\ud800\": 0}", "byte offset 8: expected \\u low surrogate"},
        {"{\"\\ud800\\u0041\": 0}", "byte offset 8: expected \\u low surrogate (DC00..DFFF)"},
        {"{\"\\udc00\": 0}", "byte offset 2: expected a high surrogate"},
        {"{\"\\ud83d\\ude00\": 0}", "byte offset 2: expected a character of GPT-2's"},
        {"{\"a\tb\": 0}", "byte offset 3: expected no raw control character"},
        {"{\"\xC3\": 0}", "byte offset 2: expected valid UTF-8"},
        {"{\" \": 0}", "byte offset 2: expected a character of GPT-2's"},  // space is Ġ there
        {"{\"a\": 0, \"a\": 1}", "byte offset 9: expected no duplicate key"},
        {"{\"a\": 0} x", "byte offset 9: expected the end of the file"},
        {"{\"a\": 1, \"b\": 1}", "token ids must be 0..1, each once; found id 1 twice"},
        {"{\"a\": 0, \"b\": 5}", "found id 5 out of that range"},
        {"{}", "the object is empty"},
        {"{\"\": 0}", "byte offset 1: expected a non-empty key"},
        {"{\"a\": 0}", "no token for the single byte 0x00"},
    };
    const char* path = "build/test_encoder.json";
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        write_file(path, cases[k].json, strlen(cases[k].json));
        BPEPaths p = {path, NULL};
        char what[64];
        snprintf(what, sizeof(what), "bad encoder.json case %zu", k);
        expect_fatal(what, run_bpe_init, &p, cases[k].expected);
    }
    remove(path);
    BPEPaths missing = {"build/no_such_encoder.json", NULL};
    expect_fatal("missing encoder.json", run_bpe_init, &missing, "no_such_encoder.json");

    if (encoder_path == NULL) { return; }
    static const struct { const char* bpe; const char* expected; } merges[] = {
        {"", "first line to be '#version: 0.2'"},
        {"h e\n", "first line to be '#version: 0.2'"},
        {"#version: 0.2\nh e\n\nt h\n", "line 3: expected a merge 'A B'"},
        {"#version: 0.2\nh  e\n", "line 2: expected a merge 'A B'"},
        {"#version: 0.2\nhe\n", "line 2: expected a merge 'A B'"},
        {"#version: 0.2\nh e\r\n", "line 2: expected a merge 'A B'"},
        {"#version: 0.2\nh e\nh e\n", "line 3: duplicate merge"},
        {"#version: 0.2\n\xC4\xA0 \xC4\xA0\n",  // "Ġ Ġ": GPT-2 has no token "ĠĠ"
         "line 2: the merge uses or makes a token that is not in"},
    };
    const char* bpe_path = "build/test_vocab.bpe";
    for (size_t k = 0; k < sizeof(merges) / sizeof(merges[0]); k++) {
        write_file(bpe_path, merges[k].bpe, strlen(merges[k].bpe));
        BPEPaths p = {encoder_path, bpe_path};
        char what[64];
        snprintf(what, sizeof(what), "bad vocab.bpe case %zu", k);
        expect_fatal(what, run_bpe_init, &p, merges[k].expected);
    }
    remove(bpe_path);
}

// A made-up vocabulary: the 256 bytes (keys written as \u escapes), "ab", "aba" and
// <|endoftext|>; merges, by rank: 0 "ab a", 1 "a b". encoder.py merges a pair at every place
// in one round before it looks for the next pair, so "abab" is [ab, ab]: merging only the
// first "a b" and then the lower-ranked "ab a" at once would give [aba, b].
static void test_merge_rounds(void) {
    const char* json_path = "build/test_mini_encoder.json";
    const char* bpe_path = "build/test_mini_vocab.bpe";
    FILE* f = fopen_or_die(json_path, "wb", "test file");
    fprintf(f, "{");
    for (int byte = 0; byte < 256; byte++) {
        uint32_t cp = 0;  // the alphabet's code point for this byte
        for (uint32_t c = 0; c < 0x200 && cp == 0; c++) {
            if (bpe_unicode_to_byte(c) == byte) { cp = c; }
        }
        fprintf(f, "\"\\u%04x\": %d, ", cp, byte);
    }
    fprintf(f, "\"ab\": 256, \"aba\": 257, \"<|endoftext|>\": 258}");
    fclose(f);
    const char* merges = "#version: 0.2\nab a\na b\n";
    write_file(bpe_path, merges, strlen(merges));
    BPEEncoder b;
    bpe_init(&b, json_path, bpe_path);
    CHECK(b.vocab_size == 259 && b.eot_token == 258, "mini vocabulary");
    static const struct { const char* text; uint32_t ids[4]; size_t n; } cases[] = {
        {"abab", {256, 256}, 2},   // round 1: a+b at both places; (ab,ab) has no merge
        {"aba", {257}, 1},         // round 1: a+b; round 2: ab+a
        {"ababa", {256, 257}, 2},  // round 1: ab ab a; round 2: ab+a at the end only
        {"abc", {256, 'c'}, 2},    // ids of single bytes are the byte values here
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        TokenIds ids = {0};
        bpe_encode(&b, (const uint8_t*)cases[k].text, strlen(cases[k].text), 1, &ids);
        CHECK(ids.n == cases[k].n && memcmp(ids.ids, cases[k].ids, ids.n * 4) == 0,
              "mini vocabulary: encode '%s'", cases[k].text);
        if (ids.n != cases[k].n || memcmp(ids.ids, cases[k].ids, ids.n * 4) != 0) {
            print_ids("got ", ids.ids, ids.n);
        }
        token_ids_free(&ids);
    }
    bpe_free(&b);
    remove(json_path);
    remove(bpe_path);
}

static const char* find_gpt2_file(const char* name) {
    static char paths[2][256];
    int slot = strcmp(name, "encoder.json") == 0 ? 0 : 1;
    snprintf(paths[slot], sizeof(paths[slot]), "dev/data/gpt2/%s", name);
    if (file_exists(paths[slot])) { return paths[slot]; }
    const char* shared = getenv("LLMC_SHARED_DATA");   // as in test_tokenizer.sh
    snprintf(paths[slot], sizeof(paths[slot]), "%s/gpt2/%s", shared ? shared : "../shared/data", name);
    return file_exists(paths[slot]) ? paths[slot] : NULL;
}

int main(void) {
    ensure_writable_dir("build", "test_tokenizer");
    test_unicode_tables();
    test_utf8();
    test_byte_alphabet();
    test_pretokenizer();
    test_bad_tokenizer_files();
    test_merge_rounds();
    const char* encoder = find_gpt2_file("encoder.json");
    const char* merges = find_gpt2_file("vocab.bpe");
    test_bad_encoder_files(encoder);
    if (encoder && merges) {
        printf("GPT-2 files: %s, %s\n", encoder, merges);
        BPEEncoder b;
        bpe_init(&b, encoder, merges);
        CHECK(b.vocab_size == 50257 && b.eot_token == GPT2_EOT,
              "GPT-2 vocabulary: %u tokens, eot %u", b.vocab_size, b.eot_token);
        test_encode_cases(&b);
        test_round_trips(&b);
        test_tokenizer_file(&b);
        bpe_free(&b);
    } else {
        printf("SKIP: ../shared/data not found (nor dev/data/gpt2 from `make data`): "
               "GPT-2 encoding tests skipped\n");
    }
    if (failures) {
        fprintf(stderr, "test_tokenizer: %d check(s) FAILED\n", failures);
        return 1;
    }
    printf("test_tokenizer: all checks passed\n");
    return 0;
}
