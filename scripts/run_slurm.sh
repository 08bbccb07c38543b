#!/usr/bin/env bash
# SLURM: submit with `sbatch scripts/run_slurm.sh [train_gpt2 arguments]`. The job asks for 2
# nodes x 4 tasks; srun starts the ranks (Open MPI must be built with SLURM/PMIx support, as
# Debian's is) and each rank finds its place from the environment like under mpirun.
#SBATCH --job-name=llmc
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --output=slurm-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
srun --mpi=pmix ./train_gpt2 -e d12 -b 4 -t 1024 -x 1000 -z 1 -n 200 -o out/slurm "$@"
