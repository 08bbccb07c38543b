# Pipeline-parallel schedules (llmc/pipeline.h) and their simulator (dev/tools/pp_sim.h): the
# schedule printing/drawing tool, the unit tests, a smoke run of the tool, and the tool's tests
# (every schedule drawn, textbook makespans, --wgt, bad input), and DualPipeV end to end under mpirun.
TOOLS     += dev/tools/pp_schedule
TEST_BINS += build/test_pipeline
TESTS     += build/test_pipeline dev/tools/pp_schedule:--stages:4:--microbatches:8:--schedule:1f1b dev/test/test_pp_dualpipe.sh \
             dev/test/test_pipeline_tool.sh

dev/tools/pp_schedule: dev/tools/pp_schedule.c dev/tools/pp_sim.h $(LLMC_HEADERS)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

build/test_pipeline: dev/test/test_pipeline.c dev/tools/pp_sim.h $(LLMC_HEADERS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

.PHONY: clean-pipeline
clean: clean-pipeline
clean-pipeline:
	rm -f dev/tools/pp_schedule
