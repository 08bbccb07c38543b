# GPT-2 tokenizer: the tokenize tool, its tests, `make data`, and regenerating the Unicode tables.

TOOLS += dev/data/tokenize
TEST_BINS += build/test_tokenizer
TESTS += build/test_tokenizer dev/test/test_tokenizer.sh

dev/data/tokenize: dev/data/tokenize.c $(LLMC_HEADERS)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

build/test_tokenizer: dev/test/test_tokenizer.c $(LLMC_HEADERS)
	@mkdir -p build
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

# tiny Shakespeare tokens, GPT-2's encoder.json/vocab.bpe and gpt2_tokenizer.bin (idempotent).
data: dev/data/tokenize
	dev/data/tinyshakespeare.sh

# Rewrites llmc/unicode_tables.h from Debian's unicode-data package (apt-get install unicode-data).
UNICODE_DATA ?= /usr/share/unicode
.PHONY: unicode-tables
unicode-tables:
	@mkdir -p build
	$(CC) -O2 -Wall -Wextra -o build/gen_unicode_tables dev/data/gen_unicode_tables.c
	build/gen_unicode_tables $(UNICODE_DATA)/UnicodeData.txt \
	    "$$(sed -n '1s/^# DerivedAge-\(.*\)\.txt$$/\1/p' $(UNICODE_DATA)/DerivedAge.txt)" \
	    > build/unicode_tables.h
	mv build/unicode_tables.h llmc/unicode_tables.h
