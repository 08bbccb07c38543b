# Training-run plots: dev/tools/plot_log draws main.log files as SVG; its test runs the tool on
# hand-written and (when the trainer and tiny Shakespeare are there) real logs. The test needs
# xmllint (Debian: libxml2-utils).
TOOLS += dev/tools/plot_log
TESTS += dev/test/test_plot_log.sh

dev/tools/plot_log: dev/tools/plot_log.c $(LLMC_HEADERS)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

.PHONY: clean-plot
clean: clean-plot
clean-plot:
	rm -f dev/tools/plot_log
