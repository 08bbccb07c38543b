/*
 * fuzz_input.h: how one fuzz input holds a format made of several files (optimizer state
 * pieces, encoder.json + vocab.bpe + text): the files joined by FUZZ_FILE_SEPARATOR.
 * fuzz.h fuzz_split() splits an input; make_seeds.c joins seeds.
 */
#ifndef LLMC_FUZZ_INPUT_H
#define LLMC_FUZZ_INPUT_H

#define FUZZ_FILE_SEPARATOR "\n--next-file--\n"
#define FUZZ_MAX_FILES 4

#endif // LLMC_FUZZ_INPUT_H
