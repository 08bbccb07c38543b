# The communicator (llmc/comm.h, with its transports: comm_transport.h's table, comm_mpi.h,
# comm_nccl.h) and its tests.
#
# build/test_comm is built like train_gpt2 (mpicc -DUSE_MPI when mpicc exists) and run on 1 to
# 8 ranks by dev/test/test_comm.sh; build/test_comm_nompi is the same test built without MPI,
# where comm.h must be a genuine single-rank communicator.
TEST_BINS += build/test_comm build/test_comm_nompi
TESTS     += dev/test/test_comm.sh

build/test_comm: dev/test/test_comm.c $(LLMC_HEADERS)
	@mkdir -p $(@D)
	$(TRAIN_CC) $(CFLAGS) $(TRAIN_CFLAGS) -o $@ $< $(LDLIBS)

build/test_comm_nompi: dev/test/test_comm.c $(LLMC_HEADERS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)
